"""The CPU serving path: compiled kernels that read the ring in place.

The torch reference serves a decode row by copying its whole window out of the cache
(gather), widening the copy to float32 (a second copy) and running two bmm calls: about six
times the bytes the attention needs, every layer. `csrc/paged_decode.cpp` reads each K and
V row of the window once, through the block table, and writes the output row directly.
A prefill chunk on the reference path is the whole (chunk x window) score square through
bmm, masking and softmax, one sequence at a time from Python; `csrc/paged_prefill.cpp`
scores each new token against only the keys it may see, every chunk of the step in one
call. It serves on AVX2 and AVX-512 classes (the same register tiles, 8 or 16 lanes wide);
the portable build's rows are plain loops, so that class keeps the torch path.

The kernel is built by `kernels.cpu_build`; where it cannot be (no compiler) the torch
reference serves everything, as before.
"""

from __future__ import annotations

import torch

from ringserve.kernels import cpu_isa
from ringserve.kernels.cpu_build import available, ops
from ringserve.kernels.reference import Batch, prefill_row, write_kv_reference
from ringserve.kernels.torch_plan import step_plan

_DTYPES = (torch.float32, torch.bfloat16)


def supports(query: torch.Tensor) -> bool:
    """Whether `paged_attention_cpu` takes this call (CPU tensor of a dtype it compiles)."""
    return query.device.type == "cpu" and query.dtype in _DTYPES and available()


def paged_attention_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None,
    ring_blocks: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    compiled_prefill: bool | None = None,
) -> torch.Tensor:
    """`kernels.paged_attention` on the CPU: same arguments, same result (see there).

    Prefill rows (a chunk of new tokens, or one token without a context) go through the
    prefill kernel, decode rows (one new token after a cached context) through the decode
    kernel; both read the ring in place. ``compiled_prefill``: whether prefill rows take
    the compiled kernel (None: on AVX2 and AVX-512 classes, module doc) or the torch
    reference.
    """
    result = out if out is not None and out.is_contiguous() else torch.empty_like(query)
    plan = step_plan(block_tables, query_start_loc, context_lens,
                     block_size=key_cache.shape[1], window=sliding_window,
                     ring=ring_blocks)  # fmt: skip
    tables = block_tables.to(torch.int32).contiguous()
    sink_logits = None if sinks is None else sinks.float().contiguous()
    if compiled_prefill is None:
        compiled_prefill = cpu_isa.info().at_least("avx2")
    # NOTE: once for both kernels (a step with prompt chunks and decodes copied v, a view of
    # the fused projection, twice)
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    if plan.prefill_index.numel() and compiled_prefill:
        ops().paged_prefill(
            query, key, value, key_cache, value_cache, tables, plan.prefill_index, result,
            scale, sliding_window or 0, ring_blocks or 0, softcap or 0.0, sink_logits)
    elif plan.prefill_index.numel():
        args = Batch(query=query, key=key, value=value, key_cache=key_cache,
                     value_cache=value_cache, block_size=key_cache.shape[1],
                     window=sliding_window, ring=ring_blocks, scale=scale, softcap=softcap,
                     sinks=sinks)  # fmt: skip
        for row in plan.prefill:
            prefill_row(args, row, result)
    seqs, tokens, ctxs = plan.decode_index
    if seqs.numel():
        ops().paged_decode(
            # NOTE: the caches as they are (a copy would be read, not the cache): the kernel
            # takes any block stride (views of a slab, engine/kv_cache.py) and checks them
            query, key, value, key_cache, value_cache, tables, seqs, tokens, ctxs, result,
            scale, sliding_window or 0, ring_blocks or 0, softcap or 0.0, sink_logits,
        )  # fmt: skip
    if out is not None and out is not result:
        out.copy_(result)
        return out
    return result


def write_kv_cpu(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`kernels.write_kv` on the CPU (`csrc/write_kv.cpp`): the rows the torch reference
    writes, in one call instead of two index_copy_ and the views around them. A cache
    whose token rows are not contiguous (not a view of engine/kv_cache.py's slab) takes
    the reference."""
    if not (dense_rows(key_cache) and dense_rows(value_cache)
            and key_cache.dtype == value_cache.dtype):
        write_kv_reference(key, value, key_cache, value_cache, slot_mapping)
        return
    ops().write_kv(key, value, key_cache, value_cache, slot_mapping)


def dense_rows(cache: torch.Tensor) -> bool:
    """Whether each token row (kv heads x head dim) of a [blocks, block_size, kv_heads,
    head_dim] cache is contiguous, as in a view of engine/kv_cache.py's slab."""
    heads, dim = cache.shape[2], cache.shape[3]
    return cache.stride(3) == 1 and cache.stride(2) == dim and cache.stride(1) == heads * dim
