"""Triton kernels (interpreter on CPU, real on CUDA) against the reference and the oracle.

Every case poisons the slots that must not be read (NaN, or 1e30 in `poison_huge`) and the
output buffer (NaN), so a stray read or a missed store fails the comparison.
"""

from __future__ import annotations

import pytest
import torch

from ringserve import kernels
from ringserve.kernels.reference import paged_attention_reference, write_kv_reference
from tests.kernel_utils import (
    CASE_IDS,
    CASES,
    Case,
    assert_close,
    case_seed,
    dense_attention,
    make_case,
    random_case_args,
)


def _to(case: Case, device: str) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in case.tensors())


def _check_triton(case: Case, device: str = "cpu", **launch: object) -> None:
    """Run the Triton path into a NaN-filled buffer; compare with oracle and reference."""
    expected = dense_attention(case)
    reference = paged_attention_reference(*case.tensors(), **case.kwargs())
    tensors = _to(case, device)
    out = torch.full_like(tensors[0], float("nan"))
    if launch:
        from ringserve.kernels.triton_attention import paged_attention_triton

        paged_attention_triton(*tensors, **case.kwargs(), out=out, **launch)  # type: ignore[arg-type]
    else:
        kernels.paged_attention(*tensors, **case.kwargs(), backend="triton", out=out)
    assert_close(out.cpu(), expected, case.query.dtype)
    assert_close(out.cpu(), reference, case.query.dtype)


@pytest.mark.parametrize(("name", "seqs", "kwargs"), CASES, ids=CASE_IDS)
def test_triton_small_tiles(name: str, seqs: list[tuple[int, int]], kwargs: dict) -> None:
    """16 x 16 tiles: sequences span several query tiles and key tiles."""
    _check_triton(make_case(seqs, seed=case_seed(name), **kwargs), block_m=16, block_n=16)


@pytest.mark.parametrize(
    "name", ["mixed_decode_prefill_wrapped", "chunk_longer_than_ring", "gqa_7", "head_dim_96"]
)
def test_triton_default_tiles(name: str) -> None:
    _, seqs, kwargs = CASES[CASE_IDS.index(name)]
    _check_triton(make_case(seqs, seed=case_seed(name), **kwargs))


@pytest.mark.parametrize(("name", "seqs", "kwargs"), CASES, ids=CASE_IDS)
def test_triton_split_keys(name: str, seqs: list[tuple[int, int]], kwargs: dict) -> None:
    """The split-key path (partial softmaxes merged by a second kernel), 4 splits."""
    _check_triton(make_case(seqs, seed=case_seed(name), **kwargs), block_m=16, block_n=16,
                  num_splits=4)


@pytest.mark.parametrize("seed", range(12))
def test_triton_random_configs(seed: int) -> None:
    seqs, kwargs = random_case_args(seed)
    _check_triton(make_case(seqs, **kwargs), block_m=16, block_n=16, num_splits=[1, 2, 8][seed % 3])


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_triton_native_fp16_dot(softcap: float | None) -> None:
    """The GPU fast path (fp16 tl.dot operands, fp32 accumulate), run by the interpreter."""
    case = make_case([(23, 6), (8, 1), (40, 1)], dtype=torch.float16, softcap=softcap,
                     num_heads=6, num_kv_heads=2, seed=21)
    _check_triton(case, block_m=16, block_n=16, native_dot=True)


def test_triton_does_not_mutate_inputs() -> None:
    case = make_case([(19, 4), (33, 1), (0, 2)], seed=6)
    before = [t.clone() for t in case.tensors()]
    kernels.paged_attention(*case.tensors(), **case.kwargs(), backend="triton")
    for old, new in zip(before, case.tensors(), strict=True):
        torch.testing.assert_close(new, old, rtol=0, atol=0, equal_nan=True)


def _write_case(dtype: torch.dtype, cache_dtype: torch.dtype, device: str) -> tuple:
    gen = torch.Generator().manual_seed(7)
    num_blocks, block_size, kvh, d = 6, 4, 3, 24
    caches = [torch.randn(num_blocks, block_size, kvh, d, generator=gen).to(cache_dtype)
              for _ in range(2)]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:9]
    slots[[1, 4, 8]] = -1
    key = torch.randn(9, kvh, d, generator=gen).to(dtype)
    value = torch.randn(9, kvh, d, generator=gen).to(dtype)
    return tuple(t.to(device) for t in (key, value, *caches, slots.to(torch.int32)))


@pytest.mark.parametrize(("dtype", "cache_dtype"), [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16),
])  # fmt: skip
def test_write_kv_triton_matches_reference(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    key, value, k_cache, v_cache, slots = _write_case(dtype, cache_dtype, "cpu")
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_reference(key, value, k_ref, v_ref, slots)
    kernels.write_kv(key, value, k_cache, v_cache, slots, backend="triton")
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "seqs", "kwargs"), CASES, ids=CASE_IDS)
def test_gpu_cases(name: str, seqs: list[tuple[int, int]], kwargs: dict) -> None:
    """The same cases on CUDA with the automatic tiles and the native-dot default."""
    _check_triton(make_case(seqs, seed=case_seed(name), **kwargs), device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(32))
def test_gpu_random_configs(seed: int) -> None:
    seqs, kwargs = random_case_args(seed)
    _check_triton(make_case(seqs, **kwargs), device="cuda")


@pytest.mark.gpu
def test_gpu_write_kv() -> None:
    key, value, k_cache, v_cache, slots = _write_case(torch.bfloat16, torch.bfloat16, "cuda")
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_reference(key, value, k_ref, v_ref, slots)
    kernels.write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
