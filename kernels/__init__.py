"""Paged ring attention and KV cache writes: Triton kernels with a torch reference each.

`paged_attention` and `write_kv` dispatch to Triton on CUDA tensors, to the compiled CPU
kernels (`kernels.cpu_attention`) on CPU tensors where they are built, and to the torch
reference (`kernels.reference`) elsewhere; see docs/design.md §5 for the contract.
"""

from __future__ import annotations

from ringserve.kernels.api import paged_attention, write_kv
from ringserve.kernels.reference import paged_attention_reference, write_kv_reference

__all__ = ["paged_attention", "paged_attention_reference", "write_kv", "write_kv_reference"]
