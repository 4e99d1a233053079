"""Triton building blocks shared by the attention kernels: sequence lookup, ring gather,
online-softmax step."""

# NOTE: @triton.jit functions take untyped tensors and constexprs (Triton reads parameter
# annotations as specialisation hints), so they stay unannotated.
# mypy: disable-error-code="no-untyped-def"
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): softmax runs on exp2


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


@triton.jit
def find_seq(query_start_loc_ptr, pid, num_seqs, TILE_Q: tl.constexpr):
    """Largest sequence s whose first tile `qsl[s] // TILE_Q + s` is <= pid (binary search)."""
    lo: tl.int32 = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(query_start_loc_ptr + mid).to(tl.int32) // TILE_Q + mid
        ok = first_tile <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def load_cached_tile(
    cache_ptr, bt_row_ptr, pos, pos_ok, d, d_ok, block_size, ring_blocks,
    stride_b, stride_s, head_off, USE_RING: tl.constexpr,
):  # fmt: skip
    """Load [BLOCK_N, D_PAD] cached K or V rows of positions `pos` through the block table.

    Position p lives at block `table[(p // b) % R]` (ring) or `table[p // b]`, offset p % b.
    Masked positions read neither the table nor the cache.
    """
    logical = pos // block_size
    column = logical % ring_blocks if USE_RING else logical
    # NOTE: int64 before the multiply: block id * block stride overflows int32 on big pools.
    block = tl.load(bt_row_ptr + column, mask=pos_ok, other=0).to(tl.int64)
    slot = (pos % block_size).to(tl.int64)
    off = block * stride_b + slot * stride_s + head_off
    mask = pos_ok[:, None] & d_ok[None, :]
    return tl.load(cache_ptr + off[:, None] + d[None, :], mask=mask, other=0.0)


@triton.jit
def _tanh(x):
    """tanh from exp of a non-positive argument: no overflow, odd by construction."""
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0.0, -y, y)


@triton.jit
def attend_tile(
    q, k, v, valid, m_i, l_i, acc, scale, softcap,
    USE_SOFTCAP: tl.constexpr, NATIVE_DOT: tl.constexpr,
):  # fmt: skip
    """One online-softmax step of a [BLOCK_M, D_PAD] query tile over [BLOCK_N, D_PAD] keys.

    `valid` [BLOCK_M, BLOCK_N] masks keys a row must not see. m_i is kept in log2 units.
    With NATIVE_DOT the dots take fp16/bf16 operands (exact products, fp32 accumulation);
    otherwise everything is fp32.
    """
    if NATIVE_DOT:
        s = tl.dot(q, tl.trans(k))
    else:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    s = s * scale
    if USE_SOFTCAP:
        s = softcap * _tanh(s / softcap)
    s = tl.where(valid, s * LOG2E, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if NATIVE_DOT:
        acc = tl.dot(p.to(v.dtype), v, acc)
    else:
        acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def attend_cached(
    q, m_i, l_i, acc, row_ok, q_pos, k_begin, k_end, bt_row, k_cache_ptr, v_cache_ptr,
    kv_head, d, d_ok, scale, softcap, window, ring_blocks, block_size,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, USE_RING: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, NATIVE_DOT: tl.constexpr,
):  # fmt: skip
    """Online softmax over cached positions [k_begin, k_end), read through the block table."""
    for n0 in range(k_begin, k_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_ok = pos < k_end
        k = load_cached_tile(k_cache_ptr, bt_row, pos, pos_ok, d, d_ok, block_size,
                             ring_blocks, stride_kcb, stride_kcs, kv_head * stride_kch, USE_RING)
        v = load_cached_tile(v_cache_ptr, bt_row, pos, pos_ok, d, d_ok, block_size,
                             ring_blocks, stride_vcb, stride_vcs, kv_head * stride_vch, USE_RING)
        valid = pos_ok[None, :] & row_ok[:, None]
        if USE_WINDOW:
            valid = valid & (pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = attend_tile(q, k, v, valid, m_i, l_i, acc, scale, softcap,
                                    USE_SOFTCAP, NATIVE_DOT)
    return m_i, l_i, acc


@triton.jit
def attend_fresh(
    q, m_i, l_i, acc, row_ok, tok, f_begin, f_end, q_start, k_ptr, v_ptr, kv_head, d, d_ok,
    scale, softcap, window, stride_kt, stride_kh, stride_vt, stride_vh,
    BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
):  # fmt: skip
    """Online softmax over the step's own tokens [f_begin, f_end), causal and windowed."""
    for n0 in range(f_begin, f_end, BLOCK_N):
        kt = n0 + tl.arange(0, BLOCK_N)
        kt_ok = kt < f_end
        tile_mask = kt_ok[:, None] & d_ok[None, :]
        kt_row = (q_start + kt).to(tl.int64)
        k_ptrs = k_ptr + (kt_row * stride_kt + kv_head * stride_kh)[:, None] + d[None, :]
        v_ptrs = v_ptr + (kt_row * stride_vt + kv_head * stride_vh)[:, None] + d[None, :]
        k = tl.load(k_ptrs, mask=tile_mask, other=0.0)
        v = tl.load(v_ptrs, mask=tile_mask, other=0.0)
        valid = kt_ok[None, :] & row_ok[:, None] & (kt[None, :] <= tok[:, None])
        if USE_WINDOW:
            valid = valid & (kt[None, :] > tok[:, None] - window)
        m_i, l_i, acc = attend_tile(q, k, v, valid, m_i, l_i, acc, scale, softcap,
                                    USE_SOFTCAP, NATIVE_DOT)
    return m_i, l_i, acc
