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
