"""Large read-only copies on transparent huge pages, where Linux offers them (docs/cpu.md,
"Huge pages for the copies a step streams").

A decode step streams its largest copies from memory once a step. With 4 KiB pages every
4 KiB of them is a TLB miss, and in a virtual machine a miss walks two page tables: on the
AMX machine (KVM) the greedy head's AMX pass at 16 rows read its copy 1.4x as fast from
2 MiB pages. `huge_copy` places a tensor in an anonymous mapping advised MADV_HUGEPAGE,
aligned to 2 MiB, where the kernel's transparent huge pages are `always` or `madvise`;
elsewhere (`never`, another OS, a small tensor) it is an ordinary contiguous tensor.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap

import torch

HUGE_PAGE = 2 << 20


def huge_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``t`` on memory advised MADV_HUGEPAGE (freed with it), or
    ``t.contiguous()`` where that cannot be had."""
    nbytes = t.numel() * t.element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if t.device.type != "cpu" or nbytes < HUGE_PAGE or advice is None:
        return t.contiguous()
    # NOTE: private: Python's default for an anonymous map is shared memory, whose huge
    # pages Linux governs apart (shmem_enabled, usually never).
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # NOTE: the mapping is only page-aligned; the tensor starts at its first 2 MiB boundary
    # so that every huge page it spans can be one.
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    offset = -address % HUGE_PAGE
    with contextlib.suppress(OSError):  # no transparent huge pages here: ordinary pages
        buf.madvise(advice, offset, nbytes)
    out = torch.frombuffer(buf, dtype=t.dtype, count=t.numel(), offset=offset).view(t.shape)
    out.copy_(t)
    return out
