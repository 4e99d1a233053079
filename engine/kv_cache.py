"""The KV cache tensors: one pool of blocks, a (K, V) view per layer of a block
(docs/design.md §8)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ringserve.block_manager import KVCacheSpec, group_layers, ring_slack
from ringserve.engine.models import KVCaches, ModelConfig
from ringserve.kernels.hugepages import huge_zeros


def kv_cache_spec(cfg: ModelConfig, block_size: int, dtype: torch.dtype, *,
                  prefix_caching: bool = False, speculative_tokens: int = 0) -> KVCacheSpec:
    """The block manager's view of a model: its layer groups by window and KV shape (the
    layers that keep K/V of their own: Gemma 4's last layers attend to an earlier one's);
    each ring holds ``b - 1`` tokens beyond its window with prefix caching, and ``k`` more
    with ``k`` speculative tokens (see `block_manager.ring`)."""
    own = [i for i in range(cfg.num_layers) if cfg.kv_source_of(i) == i]
    return KVCacheSpec(
        block_size=block_size,
        ring_slack=ring_slack(block_size, prefix_caching, speculative_tokens),
        dtype_bytes=torch.empty((), dtype=dtype).element_size(),
        groups=group_layers([cfg.layer_windows[i] for i in own],
                            num_kv_heads=[cfg.kv_heads_of(i) for i in own],
                            head_dim=[cfg.head_dim_of(i) for i in own], layer_ids=own),
    )


def layer_group_index(spec: KVCacheSpec, num_layers: int,
                      kv_source: Sequence[int] = ()) -> list[int]:
    """Per layer, the index of the group that holds its K/V (a layer that attends to
    another's, ``kv_source[layer] != layer``, that layer's group)."""
    index = [-1] * num_layers
    for g, group in enumerate(spec.groups):
        for layer in group.layer_ids:
            index[layer] = g
    for layer, source in enumerate(kv_source):
        index[layer] = index[source]
    assert min(index, default=0) >= 0, "every layer's K/V belongs to a group"
    return index


def allocate_kv_caches(
    spec: KVCacheSpec,
    num_blocks: int,
    num_layers: int,
    dtype: torch.dtype,
    device: torch.device | str,
    kv_source: Sequence[int] = (),
) -> KVCaches:
    """Per layer, its (K, V) cache ``[num_blocks, block_size, kv_heads, head_dim]``: views
    of one zeroed K slab and one V slab ``[num_blocks, block_size * spec.slab_row]``.

    Block ``n`` of a group is row ``n`` of the slabs, its layers one after another in it
    (``block_size * row`` elements each), so a view's blocks are ``block_size *
    spec.slab_row`` elements apart. A block id belongs to one group of one sequence at a
    time, so the layers of different groups that view the same row never touch it at once.
    A layer that attends to another's K/V (``kv_source``) gets that layer's views.
    """
    slab = spec.block_size * spec.slab_row
    # NOTE: on the CPU on 2 MiB pages where Linux offers them: a decode step reads every
    # sequence's window of K/V (docs/cpu.md, "Huge pages for the copies a step streams")
    slabs = [huge_zeros((num_blocks, slab), dtype) if torch.device(device).type == "cpu"
             else torch.zeros((num_blocks, slab), dtype=dtype, device=device)
             for _ in range(2)]
    caches: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
    for group in spec.groups:
        size = spec.block_size * group.row
        for j, layer in enumerate(group.layer_ids):
            k, v = (s[:, j * size : (j + 1) * size].view(
                num_blocks, spec.block_size, group.num_kv_heads, group.head_dim)
                for s in slabs)  # fmt: skip
            caches[layer] = (k, v)
    for layer, source in enumerate(kv_source):
        caches[layer] = caches[source]
    assert all(c is not None for c in caches), "every layer belongs to a group"
    return [c for c in caches if c is not None]


def model_kv_sources(cfg: ModelConfig) -> list[int]:
    """Per layer, the layer whose K/V it attends to (itself but for Gemma 4's sharing)."""
    return [cfg.kv_source_of(i) for i in range(cfg.num_layers)]


def model_layer_groups(cfg: ModelConfig) -> list[int]:
    """Per layer, its KV group index, in the order `kv_cache_spec` builds the groups."""
    return layer_group_index(kv_cache_spec(cfg, 1, torch.float32), cfg.num_layers,
                             model_kv_sources(cfg))
