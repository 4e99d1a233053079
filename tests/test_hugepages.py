"""`kernels.hugepages.huge_copy`: the greedy head's copies on 2 MiB pages where Linux offers
transparent huge pages. Reference: the tensor copied, and the kernel's own account of the
mapping (/proc/self/smaps: its VmFlags say `hg` for memory advised MADV_HUGEPAGE)."""

from __future__ import annotations

import mmap
import pathlib
import re

import pytest
import torch

from ringserve.kernels.hugepages import HUGE_PAGE, huge_copy

THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        found = re.search(r"\[(\w+)\]", THP.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def _flags_of(address: int) -> tuple[str, set[str]]:
    """The permissions (`rw-p`: private) and VmFlags of the mapping that holds ``address``."""
    current: tuple[int, int, str] | None = None
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) ", line)
        if head:
            current = (int(head.group(1), 16), int(head.group(2), 16), head.group(3))
        elif line.startswith("VmFlags:") and current and current[0] <= address < current[1]:
            return current[2], set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_copy_holds_the_same_values_in_the_same_shape() -> None:
    t = torch.arange(3 * HUGE_PAGE // 4, dtype=torch.int32).view(3, -1)
    view = t.t()  # not contiguous: copied in its own order
    out = huge_copy(view)
    assert out.is_contiguous() and out.shape == view.shape and out.dtype == view.dtype
    assert torch.equal(out, view)
    out[0, 0] = -1  # its own memory, writable
    assert int(t[0, 0]) == 0
    small = torch.arange(10)
    assert torch.equal(huge_copy(small), small)


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"),
                    reason="this kernel offers no transparent huge pages "
                           "(/sys/kernel/mm/transparent_hugepage/enabled is never or absent)")
def test_the_copy_is_advised_for_huge_pages_and_aligned_to_them() -> None:
    out = huge_copy(torch.ones(4 * HUGE_PAGE, dtype=torch.int8))
    assert out.data_ptr() % HUGE_PAGE == 0
    perms, flags = _flags_of(out.data_ptr())
    # private: Linux gives shared anonymous memory huge pages only by shmem_enabled
    assert "hg" in flags and perms.endswith("p")
    # a private map of the same size not advised says no `hg` (so the check can fail)
    # NOTE: not a plain tensor: in a full test run torch's own large allocations came
    # advised too (`hg`), whoever asked for it.
    bare = mmap.mmap(-1, 4 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = torch.frombuffer(bare, dtype=torch.int8)
    view[0] = 1  # touched, so that the mapping is there
    assert "hg" not in _flags_of(view.data_ptr())[1]
