"""Caches that are views of one slab per block (engine/kv_cache.py): the layout that lets
groups of different KV sizes (Gemma 4's full layers: larger heads, other KV-head counts)
share one pool.

A layer's cache is then ``[num_blocks, b, kv_heads, d]`` with blocks a whole slab apart;
the rest of every slab (the group's other layers, or another group's shape) is poisoned,
so a kernel that assumed contiguous blocks reads NaN and fails against the float64 oracle,
and a write that strays outside its layer shows up in the neighbours.
"""

from __future__ import annotations

import pytest
import torch

from ringserve import kernels
from ringserve.block_manager import KVCacheSpec, group_layers
from ringserve.engine.kv_cache import allocate_kv_caches
from ringserve.kernels.checks import pick_backend
from ringserve.kernels.torch_gather import gather_rows
from tests.kernel_utils import Case, assert_close, dense_attention, make_case

BACKENDS = ["cpu", "torch", "triton"]  # triton: the interpreter on this CPU


def in_slab(case: Case, before: int, after: int) -> torch.Tensor:
    """Move ``case``'s caches into NaN slabs with ``before`` / ``after`` other elements a
    block around them; returns the K slab (V's holds the same layout)."""
    nb, b, h, d = case.key_cache.shape
    row = b * h * d
    slabs = []
    for name in ("key_cache", "value_cache"):
        cache = getattr(case, name)
        slab = torch.full((nb, before + row + after), float("nan"), dtype=cache.dtype)
        view = slab[:, before : before + row].view(nb, b, h, d)
        view.copy_(cache)
        setattr(case, name, view)
        slabs.append(slab)
    assert not case.key_cache.is_contiguous() or nb <= 1
    return slabs[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("before", "after", "kwargs"), [
    (0, 3 * 4 * 2 * 16, {}),  # first of four layers of the same row
    (2 * 4 * 2 * 16, 4 * 2 * 16, dict(sinks=True)),  # a middle layer, gpt-oss sinks
    (4 * 4 * 2 * 16, 0, dict(softcap=2.0, window=None, ring=False)),  # last; a full layer
    (7, 5, dict(head_dim=32, num_kv_heads=1)),  # blocks no whole number of rows apart
], ids=["first", "middle_sinks", "last_full_softcap", "odd_stride"])
def test_attention_reads_a_layer_of_the_slab(backend: str, before: int, after: int,
                                             kwargs: dict[str, object]) -> None:
    case = make_case([(19, 4), (33, 1), (0, 2), (40, 1), (7, 1)], seed=3, **kwargs)
    in_slab(case, before, after)
    if backend == "cpu" and pick_backend(None, case.query) != "cpu":
        pytest.skip("the compiled CPU kernel did not build here")
    out = torch.full_like(case.query, float("nan"))
    kernels.paged_attention(*case.tensors(), **case.kwargs(), backend=backend, out=out)
    assert_close(out, dense_attention(case), case.query.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("before", "after"), [(0, 96), (64, 32), (13, 3)])
def test_write_kv_stays_inside_its_layer(backend: str, before: int, after: int) -> None:
    nb, b, h, d = 5, 4, 2, 8
    key_slab = torch.full((nb, before + b * h * d + after), float("nan"))
    value_slab = key_slab.clone()
    key_cache = key_slab[:, before : before + b * h * d].view(nb, b, h, d)
    value_cache = value_slab[:, before : before + b * h * d].view(nb, b, h, d)
    slots = torch.tensor([17, 3, -1, 0, 19, 8])
    key, value = torch.randn(6, h, d), torch.randn(6, h, d)
    kernels.write_kv(key, value, key_cache, value_cache, slots, backend=backend)
    for cache, new in ((key_cache, key), (value_cache, value)):
        for i, slot in enumerate(slots.tolist()):
            if slot >= 0:
                torch.testing.assert_close(cache[slot // b, slot % b], new[i], rtol=0, atol=0)
        written = {s for s in slots.tolist() if s >= 0}
        untouched = [cache[s // b, s % b] for s in range(nb * b) if s not in written]
        assert torch.isnan(torch.stack(untouched)).all()
    for slab in (key_slab, value_slab):  # the rest of every slab keeps its poison
        assert torch.isnan(slab[:, :before]).all()
        assert torch.isnan(slab[:, before + b * h * d :]).all()
    got = gather_rows(key_cache, slots[slots >= 0], "test")
    torch.testing.assert_close(got, key[slots >= 0], rtol=0, atol=0)


def test_groups_of_two_sizes_share_the_slabs() -> None:
    # Gemma 4 E2B's layers with K/V of their own: 12 sliding of 1 x 256, 3 full of 1 x 512
    windows = [512] * 4 + [None] + [512] * 4 + [None] + [512] * 4 + [None]
    dims = [512 if w is None else 256 for w in windows]
    spec = KVCacheSpec(block_size=16, dtype_bytes=2,
                       groups=group_layers(windows, num_kv_heads=1, head_dim=dims))
    assert [(g.name, len(g.layer_ids), g.head_dim) for g in spec.groups] == [
        ("sliding_512", 6, 256), ("sliding_512", 6, 256), ("full", 3, 512)]
    assert spec.slab_row == 1536 and spec.padding(2) == 0.0
    assert spec.block_bytes == 2 * 16 * 1536 * 2
    caches = allocate_kv_caches(spec, 3, len(windows), torch.bfloat16, "cpu")
    base = caches[0][0].untyped_storage().data_ptr()
    for group in spec.groups:
        spans = []
        for layer in group.layer_ids:
            k, _v = caches[layer]
            assert k.shape == (3, 16, 1, group.head_dim) and k.stride(0) == 16 * 1536
            start = (k.data_ptr() - base) // 2
            spans.append(range(start, start + 16 * group.row))
        flat = [i for span in spans for i in span]
        assert len(flat) == len(set(flat)) <= 16 * 1536  # disjoint, inside one slab
    # a full layer's block 1 and a sliding layer's block 1 are the same slab row
    assert caches[4][0][1].data_ptr() == caches[0][0][1].data_ptr()
