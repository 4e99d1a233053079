"""The block pool, and the rule that block_manager stays pure Python."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ringserve.block_manager import BlockPool, BlockPoolError


def test_fifo_reuse_and_usage() -> None:
    pool = BlockPool(3)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    assert pool.usage == 1.0 and pool.num_free == 0
    pool.free(1)
    pool.free(0)
    assert pool.allocate() == 1  # oldest freed first
    assert (pool.num_used, pool.num_free) == (2, 1)


def test_misuse_is_an_error_not_silent_corruption() -> None:
    pool = BlockPool(2)
    block = pool.allocate()
    pool.free(block)
    with pytest.raises(BlockPoolError, match="not in use"):
        pool.free(block)
    with pytest.raises(BlockPoolError, match="not in use"):
        pool.free(7)
    pool.allocate()
    pool.allocate()
    with pytest.raises(BlockPoolError, match="no free block"):
        pool.allocate()
    assert BlockPool(0).usage == 0.0


def test_block_manager_imports_no_torch() -> None:
    code = "import sys, block_manager; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_held_blocks_are_free_memory_yet_evicted_last() -> None:
    """A cached block let go with ``hold`` counts as free but goes after every evictable
    one; `let_go` puts it at the LRU's young end; `pin` takes it back from either."""
    pool = BlockPool(4)
    blocks = [pool.allocate() for _ in range(4)]
    for i, block in enumerate(blocks):
        assert pool.register(block, ("g", i))
    pool.free(blocks[0], hold=True)
    pool.free(blocks[1])
    pool.free(blocks[2], hold=True)
    assert pool.num_free == 3 and pool.num_used == 1
    assert pool.allocate() == blocks[1]  # the evictable one first, though freed later
    assert pool.allocate() == blocks[0]  # then the held ones, oldest first
    assert pool.peek(("g", 0)) is None and pool.peek(("g", 2)) == blocks[2]
    pool.pin(blocks[2])  # a hit takes a held block back
    assert pool.ref(blocks[2]) == 1 and pool.num_free == 0
    pool.free(blocks[2], hold=True)
    pool.free(blocks[3])
    pool.let_go([blocks[2], blocks[3]])  # blocks[3] is not held: left where it is
    assert pool.allocate() == blocks[3]
    assert pool.allocate() == blocks[2]
