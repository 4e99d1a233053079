"""A fixed set of physical KV block ids: handed out, shared, cached and taken back in O(1)."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Any


class BlockPoolError(RuntimeError):
    """A block was freed twice, or taken from an empty pool: a bug in the caller."""


class BlockPool:
    """The physical blocks of the KV cache (shared by every layer group), as plain integer ids.

    Each block has a reference count: the sequences whose tables hold it. With prefix
    caching a full block may also carry a key (layer group, chained hash of its tokens) under
    which `peek` finds it; such a block keeps its key when its last holder lets go and
    waits, still findable, in an LRU of evictable blocks. A block is taken from the truly
    free ones first (oldest freed first, which keeps allocation order deterministic and easy
    to narrate in tests), else the least recently used evictable one loses its key and is
    reused. A block let go with ``hold`` (a running sequence's ring moved past it, and the
    sequence's next turn will read it: `BlockTable`) waits behind every other evictable
    block until `let_go` puts it in the LRU. So free = truly free + evictable + held. The
    pool never grows.

    For exact admission with sharing (`KVCacheManager`), the pool keeps three counters:
    blocks in use (``num_used``), references to full-attention blocks (``full_refs``) and
    ring blocks held by exactly one sequence (``ring_exclusive``).

    Args:
        num_blocks: how many physical blocks the cache tensors hold.
    """

    __slots__ = ("_cached", "_evictable", "_free", "_held", "_key", "_parked", "_ref", "_ring",
                 "events", "evictions", "full_refs", "num_blocks", "num_used", "ring_exclusive")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._ring = bytearray(num_blocks)
        self._key: list[Hashable | None] = [None] * num_blocks
        self._cached: dict[Hashable, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._held: OrderedDict[int, None] = OrderedDict()
        self._parked: set[int] = set()
        self.num_used = 0
        self.full_refs = 0
        self.ring_exclusive = 0
        self.evictions = 0
        # KV events (`engine.kv_events`), when on: ("stored", key, meta) as a block becomes
        # findable, ("removed", key) as its key is evicted; the engine takes them each step.
        self.events: list[tuple[Any, ...]] | None = None

    @property
    def num_free(self) -> int:
        """Blocks a caller can take: truly free, evictable and held."""
        return len(self._free) + len(self._evictable) + len(self._held)

    @property
    def num_cached(self) -> int:
        """Blocks that carry a key (in use or evictable)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 for an empty pool."""
        return self.num_used / self.num_blocks if self.num_blocks else 0.0

    def allocate(self, *, ring: bool = False) -> int:
        """Take one block (reference count 1), evicting the least recently used cached one
        when no block is truly free.

        Args:
            ring: the block goes into a sliding (ring) group's table (for the counters).

        Raises:
            BlockPoolError: every block is in use (admission should have prevented it).
        """
        if self._free:
            block = self._free.popleft()
        elif self._evictable or self._held:
            block, _ = (self._evictable or self._held).popitem(last=False)
            key = self._key[block]
            del self._cached[key]
            self._key[block] = None
            self.evictions += 1
            if self.events is not None:
                self.events.append(("removed", key))
        else:
            raise BlockPoolError(f"no free block left (all {self.num_blocks} in use)")
        self._ring[block] = ring
        self._set_ref(block, 1)
        return block

    def pin(self, block: int) -> None:
        """One more holder of a cached block (found by `peek`), or of a block in use."""
        if self._ref[block] == 0:
            if block in self._evictable:
                del self._evictable[block]
            elif block in self._held:
                del self._held[block]
            else:
                raise BlockPoolError(f"block {block} is free and holds nothing to share")
        self._set_ref(block, self._ref[block] + 1)

    def free(self, block: int, *, hold: bool = False) -> bool:
        """One holder lets go of a block.

        Args:
            hold: a cached block left by its last holder waits behind every other
                evictable block until `let_go` (it is still free memory to admission).

        Returns:
            True when the block's contents are gone for good (it went back to the truly
            free blocks); False while it is still held or, cached, waits as evictable.

        Raises:
            BlockPoolError: the id is not one of this pool's blocks in use.
        """
        if not 0 <= block < self.num_blocks or not self._ref[block]:
            raise BlockPoolError(f"block {block} is not in use and cannot be freed")
        self._set_ref(block, self._ref[block] - 1)
        if self._ref[block]:
            return False
        if self._key[block] is not None:
            (self._held if hold else self._evictable)[block] = None
            return False
        self._free.append(block)
        return True

    def let_go(self, blocks: list[int]) -> None:
        """Held blocks join the LRU as its most recently used, in this order (a block no
        longer held, taken or evicted since, is left alone)."""
        for block in blocks:
            if block in self._held:
                del self._held[block]
                self._evictable[block] = None

    def park(self, block: int) -> None:
        """Let go of a block whose contents the current step is still writing: nobody holds
        it, yet it is neither free nor evictable until `unpark` (after `register`)."""
        if not 0 <= block < self.num_blocks or self._ref[block] != 1:
            raise BlockPoolError(f"block {block} is not held by one sequence alone")
        self._set_ref(block, 0)
        self._parked.add(block)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def unpark(self) -> None:
        """The step is over: parked blocks become evictable (with a key) or free."""
        for block in self._parked:
            if self._key[block] is not None:
                self._evictable[block] = None
            else:
                self._free.append(block)
        self._parked.clear()

    def register(self, block: int, key: Hashable, meta: Any = None) -> bool:
        """Make a full block in use (or parked) findable under ``key``; False if another
        block already holds that key (the same tokens computed twice) or this one holds a
        key. ``meta`` goes into the KV event (its parent's name and its tokens)."""
        if key in self._cached or self._key[block] is not None:
            return False
        if not self._ref[block] and block not in self._parked:
            return False
        self._cached[key] = block
        self._key[block] = key
        if self.events is not None:
            self.events.append(("stored", key, meta))
        return True

    def peek(self, key: Hashable) -> int | None:
        """The block cached under ``key``, or None, leaving its place in the LRU alone (a
        search that may not use what it finds)."""
        return self._cached.get(key)

    def touch(self, block: int) -> None:
        """Mark an evictable block recently used: the last to be evicted, for now."""
        if block in self._evictable:
            self._evictable.move_to_end(block)

    def is_used(self, block: int) -> bool:
        return bool(self._ref[block])

    def ref(self, block: int) -> int:
        return self._ref[block]

    def keeps(self, block: int) -> bool:
        """True if the block's contents must not be overwritten in place: another sequence
        holds it too, or it is cached for later hits."""
        return self._ref[block] > 1 or self._key[block] is not None

    def _set_ref(self, block: int, new: int) -> None:
        old = self._ref[block]
        self._ref[block] = new
        self.num_used += (new > 0) - (old > 0)
        if self._ring[block]:
            self.ring_exclusive += (new == 1) - (old == 1)
        else:
            self.full_refs += new - old
