"""One sequence's block table for one layer group: a ring (sliding) or a growing row (full)."""

from __future__ import annotations

from block_manager.pool import BlockPool
from block_manager.ring import (
    blocks_for_tokens,
    overwrites_between,
    recycles_between,
    table_index,
)

SKIP_SLOT = -1
"""Slot-mapping value for a position the cache write must skip (see `BlockTable.append`)."""


class BlockTable:
    """Physical block ids of one sequence in one layer group, taken lazily from a pool.

    The row holds ``min(ceil(len / b), R)`` ids: a short sequence never takes the whole
    ring; once the ring is full, logical block ``k`` reuses entry ``k % R`` in place.

    Args:
        pool: the block pool (shared by every layer group).
        block_size: tokens per block ``b``.
        ring_blocks: ring length ``R``, or None for a full-attention group.
    """

    __slots__ = ("block_size", "blocks", "capacity", "num_tokens", "pool", "ring_blocks")

    def __init__(self, pool: BlockPool, block_size: int, ring_blocks: int | None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.ring_blocks = ring_blocks
        self.capacity = None if ring_blocks is None else ring_blocks * block_size
        self.blocks: list[int] = []
        self.num_tokens = 0

    def slot(self, position: int) -> int:
        """Physical slot of ``position``: ``table[(p // b) % R] * b + p % b``."""
        b = self.block_size
        return self.blocks[table_index(position, b, self.ring_blocks)] * b + position % b

    def append(self, num_new: int) -> tuple[list[int], int, int]:
        """Extend the sequence by ``num_new`` positions and say where each one is written.

        Blocks are taken from the pool as the sequence needs them. When one step stores more
        positions than the ring holds (a prefill chunk longer than ``C``), a position that a
        later position of the same step overwrites gets `SKIP_SLOT`: no query after this
        step can see it, and two writes to one slot in a parallel kernel would race.

        Returns:
            (slot mapping for positions ``[old_len, old_len + num_new)``, blocks recycled,
            slots overwritten)
        """
        start, end = self.num_tokens, self.num_tokens + num_new
        b, ring = self.block_size, self.ring_blocks
        need = blocks_for_tokens(end, b, ring)
        while len(self.blocks) < need:
            self.blocks.append(self.pool.allocate())
        self.num_tokens = end
        first_kept = start if self.capacity is None else max(start, end - self.capacity)
        slots = [SKIP_SLOT] * (first_kept - start)
        slots += [self.slot(p) for p in range(first_kept, end)]
        return (
            slots,
            recycles_between(start, end, b, ring),
            overwrites_between(start, end, self.capacity),
        )

    def free(self) -> None:
        """Return every block to the pool."""
        for block in self.blocks:
            self.pool.free(block)
        self.blocks.clear()
