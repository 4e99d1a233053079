"""Ring KV block management, in pure Python (no torch): one pool, block tables, budget."""

from ringserve.block_manager.budget import (
    Admission,
    AdmissionState,
    Capacity,
    KVCacheSpec,
    LayerGroup,
    RequestTooLargeError,
    admission,
    capacity,
    group_layers,
    layers_per_group,
    parse_size,
    plan_num_blocks,
    sequences_that_fit,
    slab_layers,
)
from ringserve.block_manager.manager import (
    KVCacheError,
    KVCacheManager,
    KVStats,
)
from ringserve.block_manager.pool import BlockPool, BlockPoolError
from ringserve.block_manager.ring import blocks_for_tokens, ring_length, ring_slack, table_index
from ringserve.block_manager.table import SKIP_SLOT, BlockTable

__all__ = [
    "SKIP_SLOT",
    "Admission",
    "AdmissionState",
    "BlockPool",
    "BlockPoolError",
    "BlockTable",
    "Capacity",
    "KVCacheError",
    "KVCacheManager",
    "KVCacheSpec",
    "KVStats",
    "LayerGroup",
    "RequestTooLargeError",
    "admission",
    "blocks_for_tokens",
    "capacity",
    "group_layers",
    "layers_per_group",
    "parse_size",
    "plan_num_blocks",
    "ring_length",
    "ring_slack",
    "sequences_that_fit",
    "slab_layers",
    "table_index",
]
