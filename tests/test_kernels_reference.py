"""The torch reference (the CPU serving path) against a float64 dense oracle."""

from __future__ import annotations

import pytest
import torch

from ringserve import kernels
from ringserve.kernels import cpu_attention
from ringserve.kernels.reference import QUERY_CHUNK, paged_attention_reference
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


@pytest.mark.parametrize(("name", "seqs", "kwargs"), CASES, ids=CASE_IDS)
def test_reference_matches_dense(name: str, seqs: list[tuple[int, int]], kwargs: dict) -> None:
    case = make_case(seqs, seed=case_seed(name), **kwargs)
    out = torch.full_like(case.query, float("nan"))
    res = kernels.paged_attention(*case.tensors(), **case.kwargs(), backend="torch", out=out)
    assert res is out
    assert_close(out, dense_attention(case), case.query.dtype)


@pytest.mark.parametrize("seed", range(12))
def test_reference_random_configs(seed: int) -> None:
    seqs, kwargs = random_case_args(seed)
    case = make_case(seqs, **kwargs)
    out = kernels.paged_attention(*case.tensors(), **case.kwargs(), backend="torch")
    assert_close(out, dense_attention(case), case.query.dtype)


def test_reference_on_cpu_without_compiled_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from ringserve.kernels import cpu_build

    monkeypatch.setitem(cpu_build._state, "ok", False)  # as on a machine without a compiler
    case = make_case([(9, 2), (4, 1)], seed=3)
    out = kernels.paged_attention(*case.tensors(), **case.kwargs())
    assert_close(out, dense_attention(case), case.query.dtype)


def test_reference_long_chunk_is_sliced() -> None:
    """A chunk longer than QUERY_CHUNK crosses the slice boundary with a window across it."""
    n = QUERY_CHUNK + 37
    case = make_case([(20, n)], num_heads=1, num_kv_heads=1, head_dim=8, window=50,
                     block_size=16, seed=11)
    out = paged_attention_reference(*case.tensors(), **case.kwargs())
    assert_close(out, dense_attention(case), case.query.dtype)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_reference_does_not_mutate_inputs(softcap: float | None) -> None:
    case = make_case([(19, 4), (33, 1), (0, 2), (5, 0)], softcap=softcap, seed=5)
    before = [t.clone() for t in case.tensors()]
    paged_attention_reference(*case.tensors(), **case.kwargs())
    for old, new in zip(before, case.tensors(), strict=True):
        torch.testing.assert_close(new, old, rtol=0, atol=0, equal_nan=True)


def test_write_kv_reference_skips_minus_one() -> None:
    gen = torch.Generator().manual_seed(0)
    key_cache = torch.randn(4, 2, 1, 8, generator=gen)
    value_cache = torch.randn(4, 2, 1, 8, generator=gen)
    k_before, v_before = key_cache.clone(), value_cache.clone()
    key = torch.randn(3, 1, 8, generator=gen)
    value = torch.randn(3, 1, 8, generator=gen)
    kernels.write_kv(key, value, key_cache, value_cache, torch.tensor([5, -1, 0]))
    assert torch.equal(key_cache[2, 1], key[0]) and torch.equal(value_cache[0, 0], value[2])
    touched = torch.zeros(4, 2, dtype=torch.bool)
    touched[2, 1] = touched[0, 0] = True
    assert torch.equal(key_cache[~touched], k_before[~touched])
    assert torch.equal(value_cache[~touched], v_before[~touched])


def _strided_caches(case: Case) -> Case:
    """The same cache contents in views whose blocks are not adjacent rows of one matrix."""
    nb, b, kvh, d = case.key_cache.shape
    for name in ("key_cache", "value_cache"):
        big = torch.full((nb, b + 1, kvh, d + 3), float("nan"), dtype=case.key_cache.dtype)
        big[:, :b, :, :d] = getattr(case, name)
        setattr(case, name, big[:, :b, :, :d])
    return case


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_strided_cache_views(backend: str) -> None:
    case = _strided_caches(make_case([(19, 4), (33, 1), (6, 1)], head_dim=16, seed=8))
    assert case.key_cache.stride(0) != case.key_cache.shape[1] * case.key_cache.stride(1)
    out = kernels.paged_attention(*case.tensors(), **case.kwargs(), backend=backend)
    assert_close(out, dense_attention(case), case.query.dtype)


def test_plan_cache_sees_in_place_updates() -> None:
    """The torch path caches its index plan by value: refilled buffers must not go stale."""
    first = make_case([(19, 1), (33, 1)], seed=9)
    second = make_case([(20, 1), (7, 1)], seed=10)
    tables = first.block_tables.clone()
    qsl, ctx = first.query_start_loc.clone(), first.context_lens.clone()
    for case in (first, second, first):
        tables.copy_(case.block_tables)  # one buffer, refilled every step
        ctx.copy_(case.context_lens)
        qsl.copy_(case.query_start_loc)
        out = paged_attention_reference(case.query, case.key, case.value, case.key_cache,
                                        case.value_cache, tables, qsl, ctx, **case.kwargs())
        assert_close(out, dense_attention(case), case.query.dtype)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_groups_sharing_a_step_get_their_own_tables(backend: str) -> None:
    """Layer groups of one window share a step's shape and differ in tables and caches;
    the plan made for one group must not read another's tables (prefill rows included)."""
    if backend == "cpu" and not cpu_attention.supports(torch.zeros(1)):
        pytest.skip("no compiled CPU kernel here")
    seqs = [(19, 1), (0, 6), (33, 1), (9, 5)]
    groups = [make_case(seqs, seed=s) for s in (21, 22, 23)]
    assert all(torch.equal(g.query_start_loc, groups[0].query_start_loc) for g in groups)
    assert not torch.equal(groups[0].block_tables, groups[1].block_tables)
    for _ in range(2):  # the second round finds every plan cached
        for case in groups:
            if backend == "cpu":
                out = cpu_attention.paged_attention_cpu(*case.tensors(), **case.kwargs())
            else:
                out = paged_attention_reference(*case.tensors(), **case.kwargs())
            assert_close(out, dense_attention(case), case.query.dtype)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_write_kv_into_strided_views(backend: str) -> None:
    gen = torch.Generator().manual_seed(4)
    big_k = torch.zeros(5, 4, 2, 11)
    big_v = torch.zeros(5, 4, 2, 11)
    key_cache, value_cache = big_k[:, :3, :, :8], big_v[:, :3, :, :8]  # blocks of 3 slots
    key, value = torch.randn(4, 2, 8, generator=gen), torch.randn(4, 2, 8, generator=gen)
    slots = torch.tensor([14, -1, 3, 7], dtype=torch.int32)
    kernels.write_kv(key, value, key_cache, value_cache, slots, backend=backend)
    for token, slot in ((0, 14), (2, 3), (3, 7)):
        assert torch.equal(key_cache[slot // 3, slot % 3], key[token])
        assert torch.equal(value_cache[slot // 3, slot % 3], value[token])
    assert int((big_k != 0).sum()) == 3 * 2 * 8  # nothing else written, padding untouched


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_tokens_at_all(backend: str) -> None:
    """A step whose rows all have zero new tokens, and a step with no rows at all."""
    case = make_case([(5, 0), (9, 0)], seed=12)
    out = kernels.paged_attention(*case.tensors(), **case.kwargs(), backend=backend)
    assert out.shape == (0, 4, 16)
    none = make_case([], seed=13)
    out = kernels.paged_attention(*none.tensors(), **none.kwargs(), backend=backend)
    assert out.shape == (0, 4, 16)


def test_usable_outside_inference_mode_after_a_call_inside_it() -> None:
    """The engine calls the reference under inference_mode; scratch buffers it grew then
    must still be writable by a later plain call (a bug once made this raise)."""
    case = make_case([(9, 1), (4, 1), (12, 3)], seed=11)
    with torch.inference_mode():
        inside = paged_attention_reference(*case.tensors(), **case.kwargs())
    outside = paged_attention_reference(*case.tensors(), **case.kwargs())
    torch.testing.assert_close(outside, inside.clone())
