"""Prefix caching: chained block hashes, and the longest prefix every layer group can reuse
(docs/design.md §9).

Block ``k`` of a sequence (tokens ``[k*b, (k+1)*b)``) is named by a hash of its parent's
name and its own tokens, so a name stands for the whole prefix up to the block's end. A
group finds a block by (group, name). A prefix of ``L = m * b`` tokens is a hit when:

- full attention: blocks ``0 .. m-1`` are all cached (what a later query reads);
- a ring of window ``w``: the blocks holding positions ``[max(0, L - w + 1), L)`` are cached
  (the keys a query at ``L`` or later can still see); older ones need not be.

The usable hit is the longest ``L`` that every group can serve, at most ``prompt - 1`` tokens:
the last prompt token is always computed, for the first logits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from ringserve.block_manager.budget import KVCacheSpec
from ringserve.block_manager.pool import BlockPool
from ringserve.block_manager.ring import blocks_for_tokens, table_index

ROOT = b"ringserve-prefix-v1"


def extend_chain(chain: list[bytes], tokens: Sequence[int], block_size: int) -> None:
    """Append the names of the full blocks of ``tokens`` that ``chain`` does not name yet."""
    for k in range(len(chain), len(tokens) // block_size):
        parent = chain[k - 1] if k else ROOT
        block = tokens[k * block_size : (k + 1) * block_size]
        data = b",".join(str(t).encode() for t in block)
        chain.append(hashlib.sha256(parent + b"|" + data).digest()[:16])


@dataclass(frozen=True)
class Hit:
    """A usable prefix: ``num_blocks`` blocks, and each group's table row for it (in table
    order; None where a ring entry holds only expired positions: it gets a fresh block)."""

    num_blocks: int
    rows: list[list[int | None]]

    @property
    def cached_blocks(self) -> list[tuple[int, int]]:
        """(group, block) of every cached block the rows pin."""
        return [(g, blk) for g, row in enumerate(self.rows) for blk in row if blk is not None]


def find_hit(spec: KVCacheSpec, chain: Sequence[bytes], prompt_len: int,
             lookup: Callable[[int, bytes], int | None]) -> Hit:
    """The longest prefix every group of ``spec`` serves from cached blocks.

    Args:
        chain: the prompt's block names (at least its full blocks).
        prompt_len: prompt tokens; the hit stays under it.
        lookup: (group, name) -> cached block or None.
    """
    b = spec.block_size
    top = min(len(chain), (prompt_len - 1) // b)
    found: list[list[int | None]] = []
    ok_prefix: list[list[int]] = []  # per group: cumulative count of cached blocks
    for g, group in enumerate(spec.groups):
        blocks = [lookup(g, name) for name in chain[:top]]
        found.append(blocks)
        ok_prefix.append([0, *accumulate(blk is not None for blk in blocks)])
        if group.window is None:  # only the run from block 0 counts
            run = next((k for k, blk in enumerate(blocks) if blk is None), top)
            top = min(top, run)
    m = top
    while m > 0 and not all(_serves(spec, g, ok_prefix[g], m) for g in range(len(spec.groups))):
        m -= 1
    rows = [_row(spec, g, found[g], m) for g in range(len(spec.groups))]
    return Hit(num_blocks=m, rows=rows)


def first_needed(spec: KVCacheSpec, group: int, m: int) -> int:
    """First block a query at position ``m * b`` or later still reads in ``group``."""
    window = spec.groups[group].window
    if window is None:
        return 0
    return max(0, m * spec.block_size - window + 1) // spec.block_size


def _serves(spec: KVCacheSpec, group: int, ok: list[int], m: int) -> bool:
    lo = first_needed(spec, group, m)
    return ok[m] - ok[lo] == m - lo


def _row(spec: KVCacheSpec, group: int, blocks: list[int | None], m: int) -> list[int | None]:
    b, ring = spec.block_size, spec.ring_blocks(group)
    size = blocks_for_tokens(m * b, b, ring)
    row: list[int | None] = [None] * size
    lo = first_needed(spec, group, m)
    for k in range(m - size, m):
        row[table_index(k * b, b, ring)] = blocks[k] if k >= lo else None
    return row


class PrefixIndex:
    """The pool's blocks by name: what a prompt finds, what steps filled, what is coming.

    A step's filled blocks are `queue` d and become findable at `commit`, once its K/V are
    written (`discard` drops them: a failed step names nothing). Names an admitted sequence
    is still computing are promised, so a prompt that shares them can wait for them.
    """

    def __init__(self, spec: KVCacheSpec, pool: BlockPool) -> None:
        self.spec = spec
        self.pool = pool
        self.queries = 0  # prompt tokens looked up at admission
        self.hits = 0  # of those, found cached
        self._promised: dict[bytes, int] = {}
        self._pending: list[tuple[int, tuple[int, bytes], Any]] = []

    def chain(self, prompt_ids: list[int]) -> list[bytes]:
        """The names of the prompt's full blocks (a sequence computes them once: `find`
        and `next_is_promised` take them back)."""
        chain: list[bytes] = []
        extend_chain(chain, prompt_ids, self.spec.block_size)
        return chain

    def find(self, prompt_ids: list[int], prompt_len: int,
             chain: list[bytes] | None = None) -> tuple[list[bytes], Hit]:
        """The prompt's block names (a copy of ``chain`` when given) and its usable hit.

        Only the hit's own blocks are marked recently used, a full layer's deepest first (so
        the LRU takes a chain from its tail, and a shorter prefix outlives a longer one).
        The search also finds blocks the hit cannot use: a ring's blocks older than its
        window at the hit's end, a full layer's blocks past where another group stops.
        Marking those too (as every look-up did) kept a waiting prompt's dead blocks as
        fresh as its live ones, and the LRU took other sessions' live blocks first."""
        chain = self.chain(prompt_ids) if chain is None else list(chain)
        hit = find_hit(self.spec, chain, prompt_len, lambda g, name: self.pool.peek((g, name)))
        for row in hit.rows:
            for block in reversed(row):
                if block is not None:
                    self.pool.touch(block)
        return chain, hit

    def next_is_promised(self, prompt_ids: list[int], chain: list[bytes] | None = None) -> bool:
        """True if an admitted sequence is computing the block after the prompt's hit."""
        if not self._promised:
            return False
        chain, hit = self.find(prompt_ids, len(prompt_ids), chain)
        m = hit.num_blocks
        return m < (len(prompt_ids) - 1) // self.spec.block_size and chain[m] in self._promised

    def promise(self, names: list[bytes]) -> None:
        for name in names:
            self._promised[name] = self._promised.get(name, 0) + 1

    def fulfil(self, names: list[bytes]) -> None:
        for name in names:
            left = self._promised[name] - 1
            if left:
                self._promised[name] = left
            else:
                del self._promised[name]

    def queue(self, block: int, group: int, name: bytes, meta: Any = None) -> None:
        self._pending.append((block, (group, name), meta))

    def commit(self) -> None:
        for block, key, meta in self._pending:
            self.pool.register(block, key, meta)
        self._pending.clear()
        self.pool.unpark()

    def discard(self) -> None:
        self._pending.clear()
        self.pool.unpark()
