"""The KV cache tensors: one pair per layer, shaped by its layer group's pool."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from block_manager import KVCacheSpec, group_layers
from engine.models import KVCaches, ModelConfig


def kv_cache_spec(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
    """The block manager's view of a model: its layer groups by window."""
    return KVCacheSpec(
        block_size=block_size,
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
    num_blocks: Sequence[int],
    num_layers: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> KVCaches:
    """Zeroed ``[num_blocks_g, block_size, kv_heads, head_dim]`` K and V tensors per layer."""
    groups = layer_group_index(spec, num_layers)
    caches = []
    for layer in range(num_layers):
        g = groups[layer]
        group = spec.groups[g]
        shape = (num_blocks[g], spec.block_size, group.num_kv_heads, group.head_dim)
        caches.append(
            (torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device))
        )
    return caches


def model_layer_groups(cfg: ModelConfig) -> list[int]:
    """Per layer, its KV group index, in the order `kv_cache_spec` builds the groups."""
    return layer_group_index(kv_cache_spec(cfg, 1, torch.float32), cfg.num_layers)
