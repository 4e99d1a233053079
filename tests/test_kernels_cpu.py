"""The compiled CPU decode kernel (reads the ring in place) against a float64 dense oracle.

Every slot that no query may read holds NaN (or 1e30), so a read outside the window, of an
expired position or through a padding table entry shows up in the output.
"""

from __future__ import annotations

import pytest
import torch

from ringserve import kernels
from ringserve.kernels import cpu_attention, cpu_build
from ringserve.kernels.checks import pick_backend
from tests.kernel_utils import (
    CASE_IDS,
    CASES,
    assert_close,
    case_seed,
    dense_attention,
    make_case,
    random_case_args,
)


def test_kernel_is_built_here() -> None:
    """CI machines have a compiler: the fast path must really be the one tested."""
    assert cpu_build.available()
    assert pick_backend(None, torch.zeros(1)) == "cpu"


@pytest.mark.parametrize(("name", "seqs", "kwargs"), CASES, ids=CASE_IDS)
def test_cpu_kernel_matches_dense(cpu_variant: str, name: str, seqs: list[tuple[int, int]],
                                  kwargs: dict) -> None:
    case = make_case(seqs, seed=case_seed(name), **kwargs)
    out = torch.full_like(case.query, float("nan"))
    if case.query.dtype == torch.float16:  # not compiled for fp16: the default falls back
        with pytest.raises(ValueError, match="backend='cpu'"):
            kernels.paged_attention(*case.tensors(), **case.kwargs(), backend="cpu")
        res = kernels.paged_attention(*case.tensors(), **case.kwargs(), out=out)
    else:
        res = kernels.paged_attention(*case.tensors(), **case.kwargs(), backend="cpu", out=out)
        # the prefill kernel too where this class keeps prefill rows on torch's path
        compiled = cpu_attention.paged_attention_cpu(*case.tensors(), **case.kwargs(),
                                                     compiled_prefill=True)
        assert_close(compiled, dense_attention(case), case.query.dtype)
    assert res is out
    assert_close(out, dense_attention(case), case.query.dtype)


@pytest.mark.parametrize("seed", range(12))
def test_cpu_kernel_random_configs(cpu_variant: str, seed: int) -> None:
    seqs, kwargs = random_case_args(seed)
    kwargs["dtype"] = torch.float32 if kwargs["dtype"] == torch.float16 else kwargs["dtype"]
    case = make_case(seqs, **kwargs)
    out = kernels.paged_attention(*case.tensors(), **case.kwargs(), backend="cpu")
    assert_close(out, dense_attention(case), case.query.dtype)
    compiled = cpu_attention.paged_attention_cpu(*case.tensors(), **case.kwargs(),
                                                 compiled_prefill=True)
    assert_close(compiled, dense_attention(case), case.query.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_ragged_decode_batch_matches_reference(cpu_variant: str,
                                                    dtype: torch.dtype) -> None:
    """Gemma-3-like heads (4 q / 1 kv, d 256) over wrapped rings of different lengths."""
    seqs = [(700, 1), (5, 1), (511, 1), (512, 1), (1300, 1), (0, 1), (64, 1)]
    case = make_case(seqs, num_heads=4, num_kv_heads=1, head_dim=256, block_size=16,
                     window=512, dtype=dtype, seed=7)
    got = kernels.paged_attention(*case.tensors(), **case.kwargs(), backend="cpu")
    assert_close(got, dense_attention(case), dtype)
    ref = kernels.paged_attention(*case.tensors(), **case.kwargs(), backend="torch")
    assert_close(got, ref, dtype)


@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize(("kv_heads", "extra"), [
    (1, {}), (1, {"softcap": 2.0}), (1, {"sinks": True}), (2, {"window": None, "ring": False}),
], ids=["gemma", "softcap", "sinks", "2kv-full"])
def test_one_row_split_over_threads_matches_dense(cpu_variant: str, threads: int,
                                                  kv_heads: int, extra: dict) -> None:
    """Fewer (sequence, kv head) items than threads: each window is split into parts, one a
    thread, whose partial softmax sums are merged (paged_decode.cpp). One decode row at a
    time, windows of 65-513 columns (parts of 64 or more), each against float64."""
    kwargs: dict = {"window": 512, **extra}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for i, (ctx, dtype) in enumerate([(64, torch.float32), (127, torch.bfloat16),
                                          (300, torch.float32), (700, torch.bfloat16),
                                          (1300, torch.float32)]):
            case = make_case([(ctx, 1)], num_heads=4, num_kv_heads=kv_heads, head_dim=256,
                             block_size=16, dtype=dtype, seed=40 + i, **kwargs)
            out = torch.full_like(case.query, float("nan"))
            got = kernels.paged_attention(*case.tensors(), **case.kwargs(), backend="cpu",
                                          out=out)
            assert_close(got, dense_attention(case), dtype)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [512, 40, None], ids=["w512", "w40", "full"])
def test_long_prefill_chunks_match_dense(cpu_variant: str, dtype: torch.dtype,
                                         window: int | None) -> None:
    """Chunks of many query tiles (the prefill kernel's items are 32 tokens) after cached
    contexts that have wrapped the ring, beside decode rows and an empty row, Gemma-3's
    heads (4 q / 1 kv, d 256); every output row starts as NaN."""
    seqs = [(0, 100), (700, 70), (30, 33), (511, 64), (5, 1), (9, 0), (0, 1), (64, 31)]
    case = make_case(seqs, num_heads=4, num_kv_heads=1, head_dim=256, block_size=16,
                     window=window, ring=window is not None, dtype=dtype, seed=11)
    want = dense_attention(case)
    ref = kernels.paged_attention(*case.tensors(), **case.kwargs(), backend="torch")
    for compiled in (True, None):  # the kernel in every variant; what this class serves
        out = torch.full_like(case.query, float("nan"))
        got = cpu_attention.paged_attention_cpu(*case.tensors(), **case.kwargs(), out=out,
                                                compiled_prefill=compiled)
        assert_close(got, want, dtype)
        assert_close(got, ref, dtype)


def test_cpu_path_does_not_mutate_inputs() -> None:
    case = make_case([(19, 4), (33, 1), (0, 2), (5, 0), (40, 1)], softcap=2.0, seed=5)
    before = [t.clone() for t in case.tensors()]
    kernels.paged_attention(*case.tensors(), **case.kwargs(), backend="cpu")
    for old, new in zip(before, case.tensors(), strict=True):
        torch.testing.assert_close(new, old, rtol=0, atol=0, equal_nan=True)


def test_non_contiguous_value_and_out() -> None:
    """The model hands over V as a view of the fused qkv output."""
    case = make_case([(30, 1), (12, 1), (7, 3)], seed=2)
    wide = torch.randn(case.value.shape[0], 3, *case.value.shape[1:])
    wide[:, 1] = case.value
    value = wide[:, 1]
    assert not value.is_contiguous()
    out = torch.full((case.query.shape[1], case.query.shape[0], case.query.shape[2]),
                     float("nan")).transpose(0, 1)
    args = list(case.tensors())
    args[2] = value
    res = kernels.paged_attention(*args, **case.kwargs(), backend="cpu", out=out)
    assert res is out
    assert_close(out, dense_attention(case), case.query.dtype)


def _rms64(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * scale.double()


def _rope64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    r, rest = x[..., :rot], x[..., rot:]
    x1, x2 = r[..., : rot // 2], r[..., rot // 2 :]
    out = r * cos.double() + torch.cat((-x2, x1), dim=-1) * sin.double()
    return torch.cat((out, rest), dim=-1)


def test_rms_norm_matches_float64_on_strided_rows(cpu_variant: str) -> None:
    from ringserve.kernels import cpu_norm

    torch.manual_seed(0)
    wide = torch.randn(7, 3, 2 * 80).to(torch.bfloat16)
    x = wide[:, :, 40:120]  # rows with a stride: a view into a wider tensor
    scale = 1.0 + 0.3 * torch.randn(80)
    assert cpu_norm.supports(x)
    got = cpu_norm.rms_norm(x, scale, 1e-6)
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), _rms64(x, scale, 1e-6), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("rot", [32, 16], ids=["full", "partial"])
@pytest.mark.parametrize("norm", [True, False])
def test_norm_rope_matches_float64(cpu_variant: str, rot: int, norm: bool) -> None:
    from ringserve.kernels import cpu_norm

    torch.manual_seed(1)
    tokens, heads, d = 5, 3, 32
    fused = torch.randn(tokens, heads * d + 2 * d).to(torch.bfloat16)  # a qkv output
    x = fused[:, : heads * d].view(tokens, heads, d)
    angles = torch.rand(tokens, 1, rot // 2) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(torch.bfloat16)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(torch.bfloat16)
    scale = 1.0 + 0.3 * torch.randn(d) if norm else None
    got = cpu_norm.norm_rope(x, scale, cos, sin, 1e-6)
    h = _rms64(x, scale, 1e-6) if scale is not None else x.double()
    assert got.is_contiguous() and got.shape == x.shape
    torch.testing.assert_close(got.double(), _rope64(h, cos, sin), rtol=2**-7, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm_gives_the_bits_of_add_after_norm(cpu_variant: str,
                                                       dtype: torch.dtype) -> None:
    """The fused residual add rounds as torch's ``res + rms_norm(x)`` does: the norm to the
    dtype first, then the sum (for float32 no FMA may merge the two roundings)."""
    ops = cpu_build.ops()
    torch.manual_seed(2)
    res = (torch.randn(9, 640) * 30).to(dtype)
    x = torch.randn(9, 640).to(dtype)
    scale = 1.0 + 0.3 * torch.randn(640)
    got = ops.add_rms_norm(res, x, scale, 1e-6)
    assert torch.equal(got, res + ops.rms_norm(x, scale, 1e-6))
    torch.testing.assert_close(got.double(), res.double() + _rms64(x, scale, 1e-6),
                               rtol=2**-7, atol=0.3 if dtype == torch.bfloat16 else 1e-4)
    with pytest.raises(RuntimeError, match="add_rms_norm: res"):
        ops.add_rms_norm(res[:, :320], x[:, :320], scale[:320], 1e-6)  # res not contiguous


@pytest.mark.parametrize("norm", [True, False])
def test_qkv_rope_splits_as_the_three_ops(cpu_variant: str, norm: bool) -> None:
    """q and k through norm_rope, v a contiguous copy: the same bits as splitting the fused
    projection and calling the ops one by one; checked against float64 too."""
    ops = cpu_build.ops()
    torch.manual_seed(3)
    tokens, heads, kv_heads, d, rot = 5, 4, 2, 32, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d).to(torch.bfloat16)
    angles = torch.rand(tokens, rot // 2) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(torch.bfloat16)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(torch.bfloat16)
    q_scale, k_scale = ((1.0 + 0.3 * torch.randn(d), 1.0 + 0.3 * torch.randn(d)) if norm
                        else (None, None))
    q, k, v = ops.qkv_rope(qkv, q_scale, k_scale, cos, sin, 1e-6, 1e-5, heads, kv_heads)
    q0, k0, v0 = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    assert torch.equal(q, ops.norm_rope(q0.view(tokens, heads, d), q_scale, cos, sin, 1e-6))
    assert torch.equal(k, ops.norm_rope(k0.view(tokens, kv_heads, d), k_scale, cos, sin, 1e-5))
    assert torch.equal(v, v0.reshape(tokens, kv_heads, d)) and v.is_contiguous()
    h = q0.view(tokens, heads, d)
    h = _rms64(h, q_scale, 1e-6) if q_scale is not None else h.double()
    torch.testing.assert_close(q.double(), _rope64(h, cos[:, None], sin[:, None]),
                               rtol=2**-7, atol=2e-2)
    with pytest.raises(RuntimeError, match="qkv_rope: qkv"):
        ops.qkv_rope(qkv[:, 1:], q_scale, k_scale, cos, sin, 1e-6, 1e-6, heads, kv_heads)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("seed", range(6))
def test_float32_queries_over_a_bf16_cache(cpu_variant: str, backend: str, seed: int) -> None:
    """kv_cache_dtype=bfloat16 under a float32 model: the cache holds bf16, the step's own
    K/V arrive in float32 and are read as the cache will hold them (rounded to bf16). The
    oracle: float64 attention over the bf16-rounded history."""
    import dataclasses

    seqs, kwargs = random_case_args(seed)
    kwargs["dtype"] = torch.float32
    case = make_case(seqs, **kwargs)

    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).float()

    oracle_case = dataclasses.replace(case, full_k=[rounded(k) for k in case.full_k],
                                      full_v=[rounded(v) for v in case.full_v])
    args = list(case.tensors())
    args[3], args[4] = case.key_cache.to(torch.bfloat16), case.value_cache.to(torch.bfloat16)
    before = [t.clone() for t in args]
    out = kernels.paged_attention(*args, **case.kwargs(), backend=backend)
    assert out.dtype == torch.float32
    expected = dense_attention(oracle_case)
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5)
    for a, b in zip(args, before, strict=True):  # inputs untouched
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


def _slab_caches(blocks: int, b: int, heads: int, dim: int, dtype: torch.dtype,
                 spare_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value caches as engine/kv_cache.py lays them out: views of one slab row per
    block, ``spare_rows`` token rows of other layers between one block and the next."""
    row = heads * dim
    slab = torch.full((blocks, (2 * b + spare_rows) * row), float("nan"), dtype=dtype)
    key = slab[:, : b * row].view(blocks, b, heads, dim)
    value = slab[:, b * row: 2 * b * row].view(blocks, b, heads, dim)
    return key, value


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32),
                                               (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("slots_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("spare_rows", [0, 3])
def test_compiled_write_puts_each_row_in_its_slot(cpu_variant: str, dtype: torch.dtype,
                                                  cache_dtype: torch.dtype,
                                                  slots_dtype: torch.dtype,
                                                  spare_rows: int) -> None:
    """The compiled K/V write against a token-by-token oracle (each row converted by torch's
    `.to`, stored at block slot // b, row slot % b): -1 slots skipped, nothing else of the
    slab touched, keys read through a view of a fused projection."""
    gen = torch.Generator().manual_seed(7)
    blocks, b, heads, dim, tokens = 9, 4, 2, 16, 11
    key_cache, value_cache = _slab_caches(blocks, b, heads, dim, cache_dtype, spare_rows)
    fused = torch.randn(tokens, 3 * heads * dim, generator=gen).to(dtype)
    key = fused[:, heads * dim: 2 * heads * dim].view(tokens, heads, dim)  # strided rows
    value = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    slots = torch.randperm(blocks * b, generator=gen)[:tokens]
    slots[[2, 7]] = -1
    slots = slots.to(slots_dtype)
    expect_k, expect_v = key_cache.clone(), value_cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expect_k[s // b, s % b] = key[t].to(cache_dtype)
            expect_v[s // b, s % b] = value[t].to(cache_dtype)
    slab = key_cache._base if key_cache._base is not None else key_cache
    spare_before = slab[:, 2 * b * heads * dim:].clone()
    kernels.write_kv(key, value, key_cache, value_cache, slots, backend="cpu")
    assert torch.equal(key_cache.nan_to_num(7.0), expect_k.nan_to_num(7.0))
    assert torch.equal(value_cache.nan_to_num(7.0), expect_v.nan_to_num(7.0))
    assert slab[:, 2 * b * heads * dim:].isnan().all() and spare_before.isnan().all()


def test_compiled_write_refuses_a_slot_past_the_cache(cpu_variant: str) -> None:
    key_cache, value_cache = _slab_caches(2, 4, 1, 8, torch.float32, 0)
    rows = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="slot 8 is past the cache's 8 slots"):
        kernels.write_kv(rows, rows, key_cache, value_cache, torch.tensor([8]), backend="cpu")
