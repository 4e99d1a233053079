"""Reading a slice of a weights file into memory of its own, through a small mapping.

Both loaders (safetensors: `checkpoint.iter_weights`; GGUF: `gguf_file.GgufFile`) read
each tensor into the memory that serves it, one at a time (docs/design.md §12). Plain
reads (`read`, `preadv`) copy out of the page cache at 1.4-1.6 GB/s on the KVM machines
these sessions run on; copying from a mapping of the same pages, a window at a time, ran at
3.5-4.5 GB/s there (an AVX2 EPYC, 2 cores, gpt-oss's 4-layer GGUF read in 8 MiB pieces
into one buffer, each way alternated). So the bytes are copied from a window of the file
mapped for the copy alone and unmapped after it: a window is at most `WINDOW` bytes, so at
most that much of the file ever counts in the process's resident memory, and the file's
pages stay page cache.

`map_at` does not copy at all: the tensor is the file's pages, mapped copy-on-write, for
weights served exactly as stored of which a step reads a few (gpt-oss's MXFP4 experts, 4 of
32 a layer for a row). They cost no fresh memory and no time at start (copying into fresh
memory is what bounds a load on these machines: ~1-1.5 GB/s), and count in the resident
memory once a step has read them, as llama.cpp's mapped weights do.
"""

from __future__ import annotations

import mmap

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["WINDOW", "map_at", "read_at"]

WINDOW = 32 << 20
"""The most bytes of a file mapped at once."""


def read_at(fileno: int, offset: int, out: npt.NDArray[np.uint8]) -> bool:
    """Copy ``out.nbytes`` bytes of the open file ``fileno`` from ``offset`` into ``out``
    (contiguous uint8), a window at a time.

    Returns:
        False where the file ends before those bytes do (nothing is promised of ``out``).
    """
    flat = out.reshape(-1)
    size, done = flat.size, 0
    while done < size:
        start = offset + done
        base = start - start % mmap.ALLOCATIONGRANULARITY
        length = min(size - done, WINDOW)
        try:
            view = mmap.mmap(fileno, start - base + length, prot=mmap.PROT_READ, offset=base)
        except ValueError:  # the window runs past the end of the file
            return False
        try:
            if hasattr(mmap, "MADV_SEQUENTIAL"):
                view.madvise(mmap.MADV_SEQUENTIAL)
            src = np.frombuffer(view, np.uint8, length, start - base)
            np.copyto(flat[done:done + length], src)
            del src  # the mapping closes only when no array views it
        finally:
            view.close()
        done += length
    return True


def map_at(fileno: int, offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """The tensor of ``dtype`` and ``shape`` whose bytes start at ``offset`` of the open file
    ``fileno``, as a copy-on-write mapping of the file (a write, which nothing of ours
    makes, would change a private copy of its page, never the file). It stays mapped for as
    long as the tensor (or a view of it) lives; the file may be closed.

    Raises:
        ValueError: the bytes run past the end of the file.
    """
    count = 1
    for n in shape:
        count *= n
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    base = offset - offset % mmap.ALLOCATIONGRANULARITY
    view = mmap.mmap(fileno, offset - base + nbytes, access=mmap.ACCESS_COPY, offset=base)
    return torch.frombuffer(view, dtype=dtype, count=count, offset=offset - base).view(shape)
