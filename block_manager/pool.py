"""A fixed set of physical KV block ids handed out and taken back in O(1)."""

from __future__ import annotations

from collections import deque


class BlockPoolError(RuntimeError):
    """A block was freed twice, or taken from an empty pool: a bug in the caller."""


class BlockPool:
    """The physical blocks of the KV cache (shared by every layer group), as plain integer ids.

    Ids are handed out oldest-freed first (a FIFO queue), which keeps allocation order
    deterministic and easy to narrate in tests. The pool never grows.

    Args:
        num_blocks: how many physical blocks the cache tensors hold.
    """

    __slots__ = ("_free", "_in_use", "num_blocks")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._in_use = bytearray(num_blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 for an empty pool."""
        return self.num_used / self.num_blocks if self.num_blocks else 0.0

    def allocate(self) -> int:
        """Take one free block id.

        Raises:
            BlockPoolError: the pool is empty (admission should have prevented it).
        """
        if not self._free:
            raise BlockPoolError(f"no free block left (all {self.num_blocks} in use)")
        block = self._free.popleft()
        self._in_use[block] = 1
        return block

    def free(self, block: int) -> None:
        """Give a block id back.

        Raises:
            BlockPoolError: the id is not one of this pool's blocks in use.
        """
        if not 0 <= block < self.num_blocks or not self._in_use[block]:
            raise BlockPoolError(f"block {block} is not in use and cannot be freed")
        self._in_use[block] = 0
        self._free.append(block)

    def is_used(self, block: int) -> bool:
        return bool(self._in_use[block])
