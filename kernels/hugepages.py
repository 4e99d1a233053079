"""Large read-only copies on transparent huge pages, where Linux offers them (docs/cpu.md,
"Huge pages for the copies a step streams").

A decode step streams its largest copies from memory once a step. With 4 KiB pages every
4 KiB of them is a TLB miss, and in a virtual machine a miss walks two page tables: on the
AMX machine (KVM) the greedy head's AMX pass at 16 rows read its copy 1.4x as fast from
2 MiB pages. `huge_copy` places a tensor in an anonymous mapping advised MADV_HUGEPAGE,
aligned to 2 MiB, where the kernel's transparent huge pages are `always` or `madvise`;
elsewhere (`never`, another OS, a small tensor) it is an ordinary contiguous tensor.
`HugeArena` holds many smaller tensors in one such mapping (the quantized layers' weights
and their copies: `engine.models.linear_copies.place_on_huge_pages`).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import re
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def offered() -> bool:
    """Whether this process can have transparent huge pages by asking for them: Linux's
    mode is `always` or `madvise`, and ``RINGSERVE_HUGE_PAGES`` is not 0 (to compare)."""
    if os.environ.get("RINGSERVE_HUGE_PAGES", "1") == "0" or \
            getattr(mmap, "MADV_HUGEPAGE", None) is None:
        return False
    try:
        mode = re.search(r"\[(\w+)\]", _THP.read_text())
    except OSError:
        return False
    return mode is not None and mode.group(1) in ("always", "madvise")


def _advised(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping with ``nbytes`` from its first 2 MiB boundary (the
    offset returned) advised MADV_HUGEPAGE (where the kernel takes the advice)."""
    # NOTE: private: Python's default for an anonymous map is shared memory, whose huge
    # pages Linux governs apart (shmem_enabled, usually never).
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # NOTE: the mapping is only page-aligned; the data starts at its first 2 MiB boundary
    # so that every huge page it spans can be one.
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    offset = -address % HUGE_PAGE
    with contextlib.suppress(OSError):  # no transparent huge pages here: ordinary pages
        buf.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    return buf, offset


def huge_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``t`` on memory advised MADV_HUGEPAGE (freed with it), or
    ``t.contiguous()`` where that cannot be had."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < HUGE_PAGE or getattr(mmap, "MADV_HUGEPAGE",
                                                               None) is None:
        return t.contiguous()
    buf, offset = _advised(nbytes)
    out = torch.frombuffer(buf, dtype=t.dtype, count=t.numel(), offset=offset).view(t.shape)
    out.copy_(t)
    return out


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on memory advised MADV_HUGEPAGE where `offered`, else
    ``torch.zeros``. Written through once, as torch.zeros writes: every page is taken now,
    so that a machine without the memory fails here, at start, not in a later step."""
    return huge_empty(shape, dtype).zero_()


def huge_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor on memory advised MADV_HUGEPAGE where `offered` and it spans a huge
    page, else ``torch.empty``; not zeroed (`huge_zeros` is): for a tensor its maker
    writes through at once (a copy packed), whose pages that one write takes."""
    count = 1
    for n in shape:
        count *= n
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not offered():
        return torch.empty(shape, dtype=dtype)
    buf, offset = _advised(nbytes)
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset).view(shape)


class HugeArena:
    """Many tensors in one mapping on 2 MiB pages, each copied in by `place`.

    `huge_copy` gives each tensor its own mapping, whose first and last partial huge pages
    stay 4 KiB pages, and a tensor under 2 MiB none at all: a quantized layer's weights and
    copies are 0.3-5 MiB each, so most of them. Here they sit one after another, every
    4 KiB-aligned, so all but the arena's last partial page can be huge. The mapping lives
    as long as any tensor placed in it.

    Args:
        nbytes: the bytes of the tensors to be placed (`span` of each, summed).
    """

    ALIGN = 4096

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._buf, self._at = _advised(max(nbytes, 1))
        self._end = self._at + nbytes

    @classmethod
    def span(cls, t: torch.Tensor) -> int:
        """The bytes ``t`` takes in an arena (its own, rounded up to the alignment)."""
        return -(-t.numel() * t.element_size() // cls.ALIGN) * cls.ALIGN

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of CPU tensor ``t`` in the arena."""
        if t.numel() == 0:
            return t.clone()
        size = self.span(t)
        if self._at + size > self._end:
            raise ValueError(f"the arena has {self._end - self._at} bytes left, not {size}")
        out = torch.frombuffer(self._buf, dtype=t.dtype, count=t.numel(),
                               offset=self._at).view(t.shape)
        out.copy_(t)
        self._at += size
        return out
