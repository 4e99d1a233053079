"""Entry points of `kernels`: check the arguments, then run the Triton or the torch path.

Triton runs on CUDA tensors (or on CPU tensors under TRITON_INTERPRET=1, in the tests); the
torch reference serves everything else. The Triton modules are imported lazily, so a CPU
install without Triton still imports `kernels`.
"""

from __future__ import annotations

import os

import torch

from ringserve.kernels.checks import (
    check_attention_args,
    check_sinks,
    check_unit_stride,
    check_window,
    check_write_args,
    pick_backend,
)
from ringserve.kernels.reference import paged_attention_reference, write_kv_reference


def _require_triton_device(t: torch.Tensor) -> None:
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before Triton "
            "is imported to run on CPU"
        )


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def paged_attention(
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
    backend: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a step's new tokens over their ring-paged context and themselves.

    Sequence s owns the new tokens `query_start_loc[s]:query_start_loc[s + 1]`, at positions
    `context_lens[s] + t`. Each sees the cached positions `< context_lens[s]` inside its window
    (read through the block table: position p lives at `key_cache[block, p % b]` with
    `block = block_tables[s, (p // b) % ring_blocks]`, or `block_tables[s, p // b]` when
    ring_blocks is None) and the step's new tokens up to itself (from key / value). The
    caches are only read: call `write_kv` afterwards (attend first, write after).

    Args:
        query: [num_tokens, num_heads, head_dim], fp16 / bf16 / fp32.
        key, value: [num_tokens, num_kv_heads, head_dim], query's dtype.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        block_tables: [num_seqs, table_width] int32 block ids.
        query_start_loc: [num_seqs + 1] int32 cumulative new-token counts, from 0.
        context_lens: [num_seqs] int32 positions cached before this step.
        scale: softmax scale, applied to q.k before the softcap.
        sliding_window: w (query i sees keys i - w < j <= i), or None for full attention.
        ring_blocks: R, the ring length (R * block_size >= w), or None.
        softcap: logits = softcap * tanh(logits / softcap) when set (Gemma-2).
        sinks: [num_heads] float32 attention-sink logits on query's device (gpt-oss): each
            joins its head's softmax denominator as exp(sink) and weighs no value.
        backend: "triton", "cpu", "torch", or None (Triton on CUDA; on the CPU the
            compiled decode kernel where it is built, else torch).
        out: optional preallocated output, query's shape and dtype.

    Returns:
        [num_tokens, num_heads, head_dim] in query's dtype, accumulated in fp32.
    """
    check_attention_args(query, key, value, key_cache, value_cache, block_tables,
                         query_start_loc, context_lens, out)  # fmt: skip
    check_window(sliding_window, ring_blocks, key_cache.shape[1], block_tables.shape[1])
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be None or > 0, got {softcap!r}")
    check_sinks(sinks, query)
    chosen = pick_backend(backend, query)
    if chosen == "cpu":
        from ringserve.kernels.cpu_attention import paged_attention_cpu, supports

        if not supports(query):
            raise ValueError("backend='cpu' needs CPU float32/bfloat16 tensors and the "
                             "compiled kernel (see kernels/cpu_attention.py)")
        return paged_attention_cpu(
            query, key, value, key_cache, value_cache, block_tables, query_start_loc,
            context_lens, scale=scale, sliding_window=sliding_window, ring_blocks=ring_blocks,
            softcap=softcap, sinks=sinks, out=out,
        )  # fmt: skip
    if chosen == "torch":
        return paged_attention_reference(
            query, key, value, key_cache, value_cache, block_tables, query_start_loc,
            context_lens, scale=scale, sliding_window=sliding_window, ring_blocks=ring_blocks,
            softcap=softcap, sinks=sinks, out=out,
        )  # fmt: skip
    _require_triton_device(query)
    check_unit_stride("key_cache", key_cache)
    check_unit_stride("value_cache", value_cache)
    if out is not None:
        check_unit_stride("out", out)
    from ringserve.kernels.triton_attention import paged_attention_triton

    return paged_attention_triton(
        _unit_last(query), _unit_last(key), _unit_last(value), key_cache, value_cache,
        _unit_last(block_tables), query_start_loc.contiguous(), context_lens.contiguous(),
        scale=scale, sliding_window=sliding_window, ring_blocks=ring_blocks, softcap=softcap,
        sinks=None if sinks is None else sinks.float().contiguous(), out=out,
    )  # fmt: skip


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """Write the step's fresh K/V into the paged caches, in place.

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim].
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]; mutated.
        slot_mapping: [num_tokens] int32/int64 flat slot `block * block_size + offset`
            (for a ring: `table[(p // b) % R] * b + p % b`), or -1 to skip a token.
        backend: "triton", "cpu", "torch", or None (Triton on CUDA; on the CPU the
            compiled write where it is built, else torch).
    """
    check_write_args(key, value, key_cache, value_cache, slot_mapping)
    chosen = pick_backend(backend, key)
    if chosen == "cpu":
        from ringserve.kernels.cpu_attention import supports, write_kv_cpu

        if not supports(key):
            raise ValueError("backend='cpu' needs CPU float32/bfloat16 tensors and the "
                             "compiled kernels (see kernels/cpu_attention.py)")
        write_kv_cpu(key, value, key_cache, value_cache, slot_mapping)
        return
    if chosen == "torch":
        write_kv_reference(key, value, key_cache, value_cache, slot_mapping)
        return
    _require_triton_device(key)
    check_unit_stride("key_cache", key_cache)
    check_unit_stride("value_cache", value_cache)
    from ringserve.kernels.triton_cache import write_kv_triton

    write_kv_triton(_unit_last(key), _unit_last(value), key_cache, value_cache,
                    slot_mapping.contiguous())  # fmt: skip
