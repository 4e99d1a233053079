"""Triton paged attention over a ring (or full) block table, for a packed varlen batch.

Grid: (query tiles, kv heads, key splits). A program takes up to TILE_Q = BLOCK_M // GROUP
new tokens of one sequence and all GROUP query heads that share one kv head, flattened into
the M dimension (row r = token r // GROUP, head r % GROUP), so a GQA decode fills a tile.
Sequence `s` owns tiles `[qsl[s] // TILE_Q + s, qsl[s + 1] // TILE_Q + s + 1)`, a range that
is at least ceil(n_s / TILE_Q) long; the grid is `num_tokens // TILE_Q + num_seqs` programs
(known on the host without a sync) and each program finds its sequence by a binary search
over `query_start_loc`. Spare tiles exit at once.

Each program runs online softmax (m_i, l_i, acc in fp32) over two key ranges:

    cached:  positions [max(0, q_lo - w + 1), ctx)      read through the block table
    fresh:   new tokens [max(0, q_lo - w + 1 - ctx), t_hi] read from key / value

where q_lo is the tile's first query position and t_hi its last token. Keys before the
tile's window are never visited (no loop over the table with a mask); inside the range a
per-row mask applies the exact causal window. Each key tile resolves its own block ids, so
one code path serves block sizes 1..128 and any BLOCK_N.

Split keys (small decode batches on a GPU): the cached range is cut into NUM_SPLITS runs of
whole key tiles, one per program along grid axis 2; the last split also takes the fresh
keys. Each writes its partial (m, l, acc) in fp32, and `combine_splits_kernel` merges them.

Attention sinks (gpt-oss: a logit per head in the softmax denominator that weighs no value)
join where the softmax is finished, once per row: in `store_tile` without splits, in the
merge with them.
"""

# NOTE: @triton.jit functions take untyped tensors and constexprs (Triton reads parameter
# annotations as specialisation hints), so they stay unannotated.
# mypy: disable-error-code="no-untyped-def"
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ringserve.kernels.triton_common import LOG2E, attend_cached, attend_fresh, find_seq, next_pow2


@triton.jit
def paged_attention_kernel(
    out_ptr, part_ml_ptr, part_acc_ptr, sinks_ptr, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, query_start_loc_ptr, context_lens_ptr,
    scale, softcap, window, ring_blocks, num_seqs, block_size,
    stride_ot, stride_oh, stride_qt, stride_qh,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_bt,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_RING: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    NATIVE_DOT: tl.constexpr, USE_SINKS: tl.constexpr,
):  # fmt: skip
    """One (query tile, kv head, key split): see the module docstring."""
    TILE_Q: tl.constexpr = BLOCK_M // GROUP
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = find_seq(query_start_loc_ptr, pid, num_seqs, TILE_Q)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    n_new = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    t0 = (pid - (q_start // TILE_Q + seq)) * TILE_Q
    if t0 >= n_new:
        return
    ctx = tl.load(context_lens_ptr + seq).to(tl.int32)

    rows = tl.arange(0, BLOCK_M)
    tok = t0 + rows // GROUP  # token index inside the sequence's new tokens
    head = (kv_head * GROUP + rows % GROUP).to(tl.int64)
    row_ok = (rows < TILE_Q * GROUP) & (tok < n_new)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_off = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                other=0.0)
    if not NATIVE_DOT:
        q = q.to(tl.float32)  # NOTE: bf16 arithmetic is wrong in the interpreter.
    q_lo = ctx + t0  # the tile's earliest query position: its window reaches furthest back

    # NOTE: -1e30, not -inf, so a row that has seen only masked keys keeps alpha = 1.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)

    # Cached keys: positions [k_lo, ctx) only, cut into NUM_SPLITS runs of whole key tiles.
    k_lo = 0
    f_lo = 0
    if USE_WINDOW:
        k_lo = tl.maximum(q_lo - window + 1, 0)
        f_lo = tl.maximum(q_lo - window + 1 - ctx, 0)
    run = tl.cdiv(tl.cdiv(tl.maximum(ctx - k_lo, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N
    k_begin = k_lo + split * run
    k_end = tl.minimum(k_begin + run, ctx)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_off = kv_head.to(tl.int64)
    m_i, l_i, acc = attend_cached(
        q, m_i, l_i, acc, row_ok, ctx + tok, k_begin, k_end, bt_row, k_cache_ptr, v_cache_ptr,
        kv_off, d, d_ok, scale, softcap, window, ring_blocks, block_size,
        stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
        BLOCK_N, USE_WINDOW, USE_RING, USE_SOFTCAP, NATIVE_DOT,
    )  # fmt: skip
    # Fresh keys of this step, tokens [f_lo, last token of the tile]: the last split's job.
    f_end = tl.minimum(t0 + TILE_Q, n_new)
    f_end = tl.where(split == NUM_SPLITS - 1, f_end, f_lo)
    m_i, l_i, acc = attend_fresh(
        q, m_i, l_i, acc, row_ok, tok, f_lo, f_end, q_start, k_ptr, v_ptr, kv_off, d, d_ok,
        scale, softcap, window, stride_kt, stride_kh, stride_vt, stride_vh,
        BLOCK_N, USE_WINDOW, USE_SOFTCAP, NATIVE_DOT,
    )  # fmt: skip

    store_tile(out_ptr, part_ml_ptr, part_acc_ptr, sinks_ptr, m_i, l_i, acc,
               (q_start + tok).to(tl.int64), head, split, row_ok, d, d_ok, stride_ot, stride_oh,
               GROUP, D_PAD, NUM_SPLITS, USE_SINKS)  # fmt: skip


@triton.jit
def store_tile(
    out_ptr, part_ml_ptr, part_acc_ptr, sinks_ptr, m_i, l_i, acc, token, head, split, row_ok,
    d, d_ok, stride_ot, stride_oh, GROUP: tl.constexpr, D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, USE_SINKS: tl.constexpr,
):  # fmt: skip
    """Store the normalised output, or this split's partial (m, l, acc) for the merge."""
    if NUM_SPLITS == 1:
        if USE_SINKS:  # the sink's exp joins the denominator (m_i is in log2 units)
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * LOG2E
            m_new = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.exp2(sink - m_new)
            acc = acc * alpha[:, None]
        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows only; never stored
        o = acc / l_i[:, None]
        o_off = token * stride_ot + head * stride_oh
        tl.store(out_ptr + o_off[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
    else:  # partials [num_tokens, num_heads, NUM_SPLITS] x (m, l) and x acc[D_PAD]
        part = (token * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * D_PAD + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def combine_splits_kernel(
    out_ptr, part_ml_ptr, part_acc_ptr, sinks_ptr, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    USE_SINKS: tl.constexpr,
):  # fmt: skip
    """out[t, h] = merge of the NUM_SPLITS partial softmaxes of (token t, head h)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    part = (token * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    m = tl.load(part_ml_ptr + part * 2)
    l_part = tl.load(part_ml_ptr + part * 2 + 1)
    d = tl.arange(0, D_PAD)
    acc = tl.load(part_acc_ptr + part[:, None] * D_PAD + d[None, :])
    top = tl.max(m, 0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head) * LOG2E
        top = tl.maximum(top, sink)
    weight = tl.exp2(m - top)  # m is in log2 units; empty splits weigh 0
    denom = tl.sum(l_part * weight, 0)
    if USE_SINKS:
        denom += tl.exp2(sink - top)
    o = tl.sum(acc * weight[:, None], 0) / denom
    o_ptrs = out_ptr + token * stride_ot + head * stride_oh + d
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _tile_sizes(num_tokens: int, num_seqs: int, group: int, d_pad: int) -> tuple[int, int]:
    """BLOCK_M, BLOCK_N: small query tiles for decode-like batches, larger for prefill."""
    decode_like = num_tokens <= num_seqs + num_seqs // 2
    block_m = max(16 if decode_like else 64, next_pow2(group))
    block_n = 32 if d_pad >= 256 else 64
    return block_m, block_n


@functools.cache
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def _auto_splits(query: torch.Tensor, programs: int, window: int | None, block_n: int) -> int:
    """Split the key range when the grid would leave most SMs idle (small decode batches).

    Aims at about two programs per SM, at most 16 splits, and at least two key tiles per
    split when the window bounds the range. Off the GPU (the interpreter) it is 1.
    """
    if not query.is_cuda or query.shape[0] > 512:
        return 1
    want = -(-2 * _sm_count(query.device.index or 0) // programs)
    cap = 16 if window is None else max(1, window // (2 * block_n))
    splits = 1
    while splits * 2 <= min(want, cap, 16):
        splits *= 2
    return splits


def _launch(
    tensors: tuple[torch.Tensor, ...], scalars: tuple[float | int, ...], out: torch.Tensor,
    grid: tuple[int, int], splits: int, d_pad: int, params: dict[str, object],
    sinks: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Run the attention kernel, then the split merge when the key range was split."""
    query, key, value, key_cache, value_cache, block_tables = tensors[:6]
    num_tokens, num_heads = query.shape[:2]
    part_ml = part_acc = out  # placeholders: never touched when splits == 1
    if splits > 1:
        part_ml = torch.empty(num_tokens, num_heads, splits, 2, device=out.device,
                              dtype=torch.float32)  # fmt: skip
        part_acc = torch.empty(num_tokens, num_heads, splits, d_pad, device=out.device,
                               dtype=torch.float32)  # fmt: skip
    sink_arg = out if sinks is None else sinks  # a placeholder pointer when unused
    paged_attention_kernel[(*grid, splits)](
        out, part_ml, part_acc, sink_arg, *tensors, *scalars,
        out.stride(0), out.stride(1), query.stride(0), query.stride(1),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), D_PAD=d_pad, NUM_SPLITS=splits, USE_SINKS=sinks is not None,
        **params,
        num_warps=4 if d_pad <= 128 else 8,
    )  # fmt: skip
    if splits > 1:
        combine_splits_kernel[(num_tokens, num_heads)](
            out, part_ml, part_acc, sink_arg, out.stride(0), out.stride(1),
            HEAD_DIM=query.shape[2], D_PAD=d_pad, NUM_SPLITS=splits,
            USE_SINKS=sinks is not None,
        )  # fmt: skip


def paged_attention_triton(
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
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    native_dot: bool | None = None,
) -> torch.Tensor:
    """Launch `paged_attention_kernel`; arguments as `kernels.paged_attention`.

    Args:
        block_m, block_n: tile sizes (powers of two >= 16); None picks them from the shapes.
        num_splits: split each query tile's key range over this many programs (a power of
            two) and merge after; None decides from the grid size (1 off the GPU).
        native_dot: run tl.dot in fp16/bf16 with fp32 accumulation (tensor cores); None
            means "on CUDA with a half dtype". Else q, k, v are upcast to fp32 after loading.
        Others: as `kernels.paged_attention`. The last dim of every tensor must have
            stride 1 (checked by the caller).

    Returns:
        `out` (allocated when None), [num_tokens, num_heads, head_dim] in query's dtype.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    num_seqs = context_lens.shape[0]
    group = num_heads // num_kv_heads
    d_pad = max(16, next_pow2(head_dim))
    auto_m, auto_n = _tile_sizes(num_tokens, num_seqs, group, d_pad)
    block_m = max(block_m or auto_m, next_pow2(group), 16)
    block_n = block_n or auto_n
    if native_dot is None:
        native_dot = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    grid = (num_tokens // (block_m // group) + num_seqs, num_kv_heads)
    splits = num_splits or _auto_splits(query, grid[0] * grid[1], sliding_window, block_n)
    tensors = (query, key, value, key_cache, value_cache, block_tables, query_start_loc,
               context_lens)  # fmt: skip
    scalars = (float(scale), float(softcap or 0.0), int(sliding_window or 0),
               int(ring_blocks or 1), num_seqs, key_cache.shape[1])  # fmt: skip
    params: dict[str, object] = {
        "HEAD_DIM": head_dim, "GROUP": group, "BLOCK_M": block_m, "BLOCK_N": block_n,
        "USE_WINDOW": sliding_window is not None, "USE_RING": ring_blocks is not None,
        "USE_SOFTCAP": softcap is not None, "NATIVE_DOT": native_dot,
    }
    _launch(tensors, scalars, out, grid, splits, d_pad, params, sinks)
    return out
