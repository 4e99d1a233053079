"""Block ids whose element offsets pass 2**31: the kernels must address in int64.

The caches are contiguous [num_blocks, 4, 1, 16] fp16, so a block is 64 elements and block
id B starts at element 64 * B. With B = 2**25 + 1 that is 2**31 + 64 elements (4 GiB in),
which int32 arithmetic would wrap to -2**31 + 64: a read before the base pointer (garbage or
a crash) instead of the right block. The test stays cheap because torch.empty on the CPU
only reserves address space: just the handful of pages that are written become resident
(about 8 GiB of address space for the two caches, a few KiB of memory). The Triton
interpreter hands CPU tensors to the kernel without copying them.
"""

from __future__ import annotations

import math

import pytest
import torch

from ringserve import kernels
from tests.kernel_utils import assert_close

BLOCK_SIZE, HEAD_DIM = 4, 16
HIGH = 2**25  # blocks HIGH and HIGH + 1 start at element offsets 2**31 and 2**31 + 64
NUM_BLOCKS = HIGH + 2


@pytest.fixture(scope="module")
def caches() -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NUM_BLOCKS, BLOCK_SIZE, 1, HEAD_DIM)
    assert HIGH * BLOCK_SIZE * HEAD_DIM >= 2**31
    return torch.empty(shape, dtype=torch.float16), torch.empty(shape, dtype=torch.float16)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_high_block_ids(caches: tuple[torch.Tensor, torch.Tensor], backend: str) -> None:
    key_cache, value_cache = caches
    gen = torch.Generator().manual_seed(0)
    ctx, new, window = 7, 2, 8  # ring of R = 2 blocks: ids [HIGH + 1, HIGH]
    table = torch.tensor([[HIGH + 1, HIGH]], dtype=torch.int32)
    hist_k = torch.randn(ctx + new, 1, HEAD_DIM, generator=gen).half()
    hist_v = torch.randn(ctx + new, 1, HEAD_DIM, generator=gen).half()
    positions = torch.arange(ctx)
    slots = table[0, (positions // BLOCK_SIZE) % 2].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    # The write goes through the kernel under test too: slots near 2**27, offsets past 2**31.
    kernels.write_kv(hist_k[:ctx], hist_v[:ctx], key_cache, value_cache, slots, backend=backend)
    assert torch.equal(key_cache[HIGH + 1, :, 0], hist_k[:4, 0])
    assert torch.equal(value_cache[HIGH, :3, 0], hist_v[4:7, 0])

    query = torch.randn(new, 2, HEAD_DIM, generator=gen).half()
    out = kernels.paged_attention(
        query, hist_k[ctx:], hist_v[ctx:], key_cache, value_cache, table,
        torch.tensor([0, new], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32),
        scale=1 / math.sqrt(HEAD_DIM), sliding_window=window, ring_blocks=2, backend=backend,
    )  # fmt: skip
    expected = torch.empty(new, 2, HEAD_DIM, dtype=torch.float64)
    for t in range(new):
        i = ctx + t
        seen = hist_k[max(0, i - window + 1) : i + 1, 0].double()
        vals = hist_v[max(0, i - window + 1) : i + 1, 0].double()
        probs = torch.softmax(query[t].double() @ seen.T / math.sqrt(HEAD_DIM), dim=-1)
        expected[t] = probs @ vals
    assert_close(out, expected, torch.float16)
