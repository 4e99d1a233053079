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

    __slots__ = ("block_size", "blocks", "capacity", "num_tokens", "pool", "ring_blocks",
                 "swaps")

    def __init__(self, pool: BlockPool, block_size: int, ring_blocks: int | None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.ring_blocks = ring_blocks
        self.capacity = None if ring_blocks is None else ring_blocks * block_size
        self.blocks: list[int] = []
        self.num_tokens = 0
        self.swaps = 0  # entries given a fresh block so far (a copy of the row must redo them)

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

        When the ring comes back to an entry whose block another sequence shares or the
        prefix cache keeps (`BlockPool.keeps`), the entry takes a fresh block instead of
        overwriting it: the old contents have expired for this sequence, not for the others;
        the old block goes back to the pool, still findable by its hash. Either way the row
        holds at most ``R`` blocks.

        Returns:
            (slot mapping for positions ``[old_len, old_len + num_new)``, blocks recycled,
            slots overwritten)
        """
        start, end = self.num_tokens, self.num_tokens + num_new
        b, ring = self.block_size, self.ring_blocks
        need = blocks_for_tokens(end, b, ring)
        while len(self.blocks) < need:
            self.blocks.append(self.pool.allocate(ring=ring is not None))
        if ring is not None:
            # logical blocks this step starts that reuse an entry of the ring
            for k in range(max(-(-start // b), ring), -(-end // b)):
                entry = table_index(k * b, b, ring)
                old = self.blocks[entry]
                if self.pool.keeps(old):
                    self.blocks[entry] = self.pool.allocate(ring=True)
                    self.pool.free(old)
                    self.swaps += 1
        self.num_tokens = end
        first_kept = start if self.capacity is None else max(start, end - self.capacity)
        slots = [SKIP_SLOT] * (first_kept - start)
        slots += [self.slot(p) for p in range(first_kept, end)]
        return (
            slots,
            recycles_between(start, end, b, ring),
            overwrites_between(start, end, self.capacity),
        )

    def adopt(self, num_tokens: int, blocks: list[int | None]) -> None:
        """Start the row at ``num_tokens`` cached positions (a prefix-cache hit).

        Args:
            num_tokens: the hit, a multiple of the block size.
            blocks: the row's ``min(num_tokens / b, R)`` entries in table order: a cached
                block (already pinned by the caller) or None where the ring's entry holds
                positions no later query reads; those get a fresh block.
        """
        if self.blocks or self.num_tokens:
            raise ValueError("a row adopts a prefix only when it is empty")
        if len(blocks) != blocks_for_tokens(num_tokens, self.block_size, self.ring_blocks):
            raise ValueError(f"{len(blocks)} entries for a prefix of {num_tokens} tokens")
        ring = self.ring_blocks is not None
        self.blocks = [self.pool.allocate(ring=ring) if blk is None else blk for blk in blocks]
        self.num_tokens = num_tokens

    def free(self) -> list[int]:
        """Let go of every block; returns those whose contents are gone for good."""
        gone = [block for block in self.blocks if self.pool.free(block)]
        self.blocks.clear()
        return gone
