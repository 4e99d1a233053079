"""Triton scatter of the step's fresh K/V into the paged caches (`kernels.write_kv`)."""

# NOTE: @triton.jit functions take untyped tensors and constexprs (Triton reads parameter
# annotations as specialisation hints), so they stay unannotated.
# mypy: disable-error-code="no-untyped-def"
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ringserve.kernels.triton_common import next_pow2


@triton.jit
def write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):  # fmt: skip
    """One program per token: copy its [num_kv_heads, head_dim] K and V rows to its slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # -1: a token whose K/V is not cached (padding, or a skipped write)
        return
    block = slot // block_size
    offset = slot % block_size
    h = tl.arange(0, H_PAD).to(tl.int64)
    d = tl.arange(0, D_PAD)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(key_ptr + (token * stride_kt + h * stride_kh)[:, None] + d[None, :], mask=mask)
    v = tl.load(value_ptr + (token * stride_vt + h * stride_vh)[:, None] + d[None, :], mask=mask)
    kc_off = block * stride_kcb + offset * stride_kcs + h * stride_kch
    vc_off = block * stride_vcb + offset * stride_vcs + h * stride_vch
    tl.store(k_cache_ptr + kc_off[:, None] + d[None, :], k.to(k_cache_ptr.dtype.element_ty),
             mask=mask)
    tl.store(v_cache_ptr + vc_off[:, None] + d[None, :], v.to(v_cache_ptr.dtype.element_ty),
             mask=mask)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Launch `write_kv_kernel`; arguments as `kernels.write_kv` (last dims of stride 1).

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim].
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], mutated.
        slot_mapping: [num_tokens] flat slots, -1 to skip a token.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, key_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, H_PAD=next_pow2(num_kv_heads),
        D_PAD=next_pow2(head_dim),
    )  # fmt: skip
