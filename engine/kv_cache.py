"""The KV cache tensors: one pool of blocks, a (K, V) pair per layer of a block."""

from __future__ import annotations

import torch

from block_manager import KVCacheSpec, group_layers
from engine.models import KVCaches, ModelConfig


def kv_cache_spec(cfg: ModelConfig, block_size: int, dtype: torch.dtype, *,
                  prefix_caching: bool = False, speculative_tokens: int = 0) -> KVCacheSpec:
    """The block manager's view of a model: its layer groups by window; each ring holds
    ``b - 1`` tokens beyond its window with prefix caching, and ``k`` more with ``k``
    speculative tokens (see `block_manager.ring`)."""
    return KVCacheSpec(
        block_size=block_size,
        ring_slack=(block_size - 1 if prefix_caching else 0) + speculative_tokens,
        dtype_bytes=torch.empty((), dtype=dtype).element_size(),
        groups=group_layers(cfg.layer_windows, num_kv_heads=cfg.num_kv_heads,
                            head_dim=cfg.head_dim),
    )


def layer_group_index(spec: KVCacheSpec, num_layers: int) -> list[int]:
    """Per layer, the index of the group that holds it."""
    index = [0] * num_layers
    for g, group in enumerate(spec.groups):
        for layer in group.layer_ids:
            index[layer] = g
    return index


def allocate_kv_caches(
    spec: KVCacheSpec,
    num_blocks: int,
    num_layers: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> KVCaches:
    """Per layer, its (K, V) cache: the j-th layer of every group shares pair j.

    ``spec.layers_per_block`` zeroed ``[num_blocks, block_size, kv_heads, head_dim]`` pairs;
    a block id belongs to one group of one sequence at a time, so the layers sharing a
    pair never touch the same block.
    """
    g0 = spec.groups[0]
    shape = (num_blocks, spec.block_size, g0.num_kv_heads, g0.head_dim)
    pairs = [(torch.zeros(shape, dtype=dtype, device=device),
              torch.zeros(shape, dtype=dtype, device=device))
             for _ in range(spec.layers_per_block)]
    caches: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
    for group in spec.groups:
        for j, layer in enumerate(group.layer_ids):
            caches[layer] = pairs[j]
    assert all(c is not None for c in caches), "every layer belongs to a group"
    return [c for c in caches if c is not None]


def model_layer_groups(cfg: ModelConfig) -> list[int]:
    """Per layer, its KV group index, in the order `kv_cache_spec` builds the groups."""
    return layer_group_index(kv_cache_spec(cfg, 1, torch.float32), cfg.num_layers)
