"""Ring-table gathers for the torch path: position -> physical slot, and row gathers into
reusable scratch buffers.

The CPU path is bound by memory traffic: a decode step copies every sequence's window of
K and V out of the paged cache. Fresh multi-MiB temporaries cost a page fault per 4 KiB on
every call (the allocator hands big blocks back to the OS), which measured as much as the
copy itself, so gathers land in per-thread scratch buffers that only ever grow.
"""

from __future__ import annotations

import threading

import torch


def slot_rows(
    block_tables: torch.Tensor,
    seq_ids: torch.Tensor | int,
    positions: torch.Tensor,
    block_size: int,
    ring_blocks: int | None,
) -> torch.Tensor:
    """Flat cache rows (`block * block_size + offset`) of cached positions.

    Position p of sequence s lives in block `table[s, (p // b) % R]` (ring) or
    `table[s, p // b]` (full table), at offset `p % b` (docs/design.md §2).

    Args:
        block_tables: [num_seqs, table_width] block ids.
        seq_ids: sequence index (an int, or a tensor broadcastable to `positions`).
        positions: absolute token positions (any shape), all inside the cached window.
        block_size: tokens per block.
        ring_blocks: ring length R, or None when the table is indexed by `p // b` directly.

    Returns:
        int64 rows shaped like `positions`.
    """
    logical = torch.div(positions, block_size, rounding_mode="floor")
    column = logical % ring_blocks if ring_blocks is not None else logical
    return block_tables[seq_ids, column].long() * block_size + positions % block_size


class _Scratch(threading.local):
    """Grow-only buffers, one set per thread, keyed by (name, dtype, device)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        key = (name, like.dtype, like.device)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            # NOTE: a normal tensor, even when first asked for under inference_mode (the
            # engine's), so that a later call outside it may still write into the buffer.
            with torch.inference_mode(False):
                buf = torch.empty(max(numel, 1), dtype=like.dtype, device=like.device)
            self.buffers[key] = buf
        return buf[:numel].view(shape)


_SCRATCH = _Scratch()


def clear_scratch() -> None:
    """Free this thread's gather buffers (they otherwise keep their peak size)."""
    _SCRATCH.buffers.clear()


def gather_rows(cache: torch.Tensor, rows: torch.Tensor, name: str, extra: int = 0) -> torch.Tensor:
    """Copy the cache rows `rows` into a scratch buffer, followed by `extra` free rows.

    Args:
        cache: [num_blocks, block_size, num_kv_heads, head_dim].
        rows: int64 flat rows `block * block_size + offset` (any shape; 1-D when extra > 0).
        name: scratch slot; the result stays valid until the next gather with this name on
            this thread.
        extra: rows left uninitialised after the gathered ones, for the caller to fill.

    Returns:
        [*rows.shape (+ extra on dim 0), num_kv_heads, head_dim] in cache's dtype.
    """
    row_shape = tuple(cache.shape[2:])
    n = rows.numel()
    out = _SCRATCH.get(name, (n + extra, *row_shape), cache)
    flat, index = flat_rows(cache, rows.view(-1))
    if flat is not None:
        torch.index_select(flat, 0, index, out=out[:n])
    else:  # unusual layout: plain advanced indexing
        block_size = cache.shape[1]
        out[:n] = cache[torch.div(index, block_size, rounding_mode="floor"),
                        index % block_size]
    return out if extra else out.view(*rows.shape, *row_shape)


def flat_rows(cache: torch.Tensor,
              slots: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """A ``[rows, num_kv_heads, head_dim]`` view of ``cache`` and ``slots`` (``block *
    block_size + offset``) as its row indices; (None, slots) for a layout it cannot view.

    A cache is a view of one slab row per block (`engine.kv_cache.allocate_kv_caches`):
    its blocks are ``cache.stride(0)`` elements apart, a whole number of token rows, so
    one strided view covers every block and slot ``s`` is row ``s + (s // b) * (r - b)``
    for ``r`` rows a block.
    """
    block_size = cache.shape[1]
    row = cache.stride(1)
    if cache.stride(0) == block_size * row:  # contiguous: the plain flat view
        return cache.view(-1, *cache.shape[2:]), slots
    if row == 0 or cache.stride(0) % row or cache.shape[0] == 0 or \
            cache[0, 0].stride() != (cache.shape[3], 1) or row != cache[0, 0].numel():
        return None, slots
    per_block = cache.stride(0) // row
    count = (cache.shape[0] - 1) * per_block + block_size
    flat = cache.as_strided((count, *cache.shape[2:]), (row, cache.shape[3], 1))
    shifted = slots + torch.div(slots, block_size, rounding_mode="floor") * (per_block - block_size)
    return flat, shifted
