"""One sequence's block table for one layer group: a ring (sliding) or a growing row (full)."""

from __future__ import annotations

from ringserve.block_manager.pool import BlockPool
from ringserve.block_manager.ring import (
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

    __slots__ = ("block_size", "blocks", "capacity", "held", "hold", "keep_steps", "num_tokens",
                 "parked", "pool", "ring_blocks", "swaps")

    def __init__(self, pool: BlockPool, block_size: int, ring_blocks: int | None, *,
                 keep_steps: bool = False, hold: range = range(0)) -> None:
        self.pool = pool
        self.keep_steps = keep_steps
        # logical blocks whose block, when the ring moves past it, stays behind the pool's
        # other evictable blocks until `free` (`BlockPool.free`'s hold): a later prompt
        # that extends this one's prompt reads them (docs/design.md §9)
        self.hold = hold
        self.held: list[int] = []
        self.parked: dict[int, int] = {}  # logical block -> the block that holds it, parked
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

    def append(self, num_new: int, spare: int = 0) -> tuple[list[int], int, int]:
        """Extend the sequence by ``num_new`` positions and say where each one is written.

        Blocks are taken from the pool as the sequence needs them. When one step stores more
        positions than the ring holds (a prefill chunk longer than ``C``), a position that a
        later position of the same step overwrites gets `SKIP_SLOT`: no query after this
        step can see it, and two writes to one slot in a parallel kernel would race.

        With ``keep_steps`` (prefix caching), a block someone may still want is never
        overwritten in place: when the ring comes back to an entry whose block another
        sequence shares or the prefix cache keeps (`BlockPool.keeps`), the entry takes a
        fresh block and the old one goes back to the pool, still findable by its hash. A
        block this very step wrote is kept the same way while the pool has ``spare``
        blocks nobody is promised: it is parked until the step's K/V are in (`parked`), so
        a long chunk can leave every block it fills to the cache; without spare it is
        overwritten in place as above. Either way the row holds at most ``R`` blocks.

        Returns:
            (slot mapping for positions ``[old_len, old_len + num_new)``, blocks recycled,
            slots overwritten)
        """
        start, end = self.num_tokens, self.num_tokens + num_new
        b, ring = self.block_size, self.ring_blocks
        need = blocks_for_tokens(end, b, ring)
        while len(self.blocks) < need:
            self.blocks.append(self.pool.allocate(ring=ring is not None))
        self.parked = {}
        if ring is not None and self.keep_steps:
            # logical blocks this step starts that reuse an entry of the ring
            for k in range(max(-(-start // b), ring), -(-end // b)):
                entry = table_index(k * b, b, ring)
                old = self.blocks[entry]
                if self.pool.keeps(old):
                    # NOTE: let go first: in a full pool the fresh block may be the old one
                    # itself, evicted from the cache (its contents have expired for us).
                    hold = k - ring in self.hold
                    self.pool.free(old, hold=hold)
                    if hold:
                        self.held.append(old)
                    self.blocks[entry] = self.pool.allocate(ring=True)
                    self.swaps += 1
                elif (k - ring + 1) * b > start and spare > 0:  # written by this step
                    self.pool.park(old)
                    self.blocks[entry] = self.pool.allocate(ring=True)
                    self.parked[k - ring] = old
                    self.swaps += 1
                    spare -= 1
        self.num_tokens = end
        slots = [SKIP_SLOT if self.lost(p, end) else self.block_of(p // b) * b + p % b
                 for p in range(start, end)]
        return (
            slots,
            recycles_between(start, end, b, ring),
            overwrites_between(start, end, self.capacity),
        )

    def lost(self, position: int, end: int) -> bool:
        """True if a step storing up to ``end`` overwrites ``position`` in place."""
        return (self.capacity is not None and position + self.capacity < end
                and position // self.block_size not in self.parked)

    def block_of(self, logical: int) -> int:
        """The block that holds logical block ``logical`` (one the last step parked, or the
        row's entry for it)."""
        parked = self.parked.get(logical)
        if parked is not None:
            return parked
        return self.blocks[table_index(logical * self.block_size, self.block_size,
                                       self.ring_blocks)]

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
        """Let go of every block; returns those whose contents are gone for good.

        With prefix caching a full-attention row goes back deepest block first, so the
        pool's LRU evicts its tail before its head: what is left stays a usable prefix; a
        ring's held blocks (`hold`) go back just before its row."""
        self.pool.let_go(self.held)
        self.held.clear()
        tail_first = self.keep_steps and self.ring_blocks is None
        gone = [block for block in (self.blocks[::-1] if tail_first else self.blocks)
                if self.pool.free(block)]
        self.blocks.clear()
        return gone
