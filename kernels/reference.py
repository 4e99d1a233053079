"""Torch reference of the paged ring attention and the KV cache write.

These functions are the CPU serving path and the oracle the Triton kernels are tested
against. They share the signatures of `kernels.paged_attention` / `kernels.write_kv`.
`paged_attention_reference` never mutates its inputs; `write_kv_reference` mutates only the
two caches, as the contract says.

Ring mapping (docs/design.md §2): cached position `p` of sequence `s` lives in
`cache[table[s, (p // b) % R], p % b]` with a ring of `R` blocks, or `table[s, p // b]` for
full attention. With a window `w`, the query at position `i` sees keys `i - w < j <= i`.

Two paths: pure decode rows (one new token) of a batch are served together by one batched
gather of each row's window; every other row (a prefill chunk) is served per sequence, in
query chunks that only look at the keys inside their window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringserve.kernels.torch_gather import flat_rows, gather_rows
from ringserve.kernels.torch_plan import DecodeRows, PrefillRow, step_plan

# NOTE: a prefill chunk is processed in query slices of this many tokens, which bounds the
# score matrix at QUERY_CHUNK x (QUERY_CHUNK + window) per head however long the chunk is.
QUERY_CHUNK = 256


@dataclass(frozen=True, kw_only=True)
class Batch:
    """The call's tensors and settings, bundled for the row helpers."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_size: int
    window: int | None
    ring: int | None
    scale: float
    softcap: float | None
    sinks: torch.Tensor | None = None  # [num_heads] float32 logits


def _with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None,
                view: tuple[int, ...]) -> torch.Tensor:
    """softmax over the scores' last dim with each head's sink logit in the denominator
    (gpt-oss): the sink column is appended, normalised with the rest and dropped."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().view(view).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]


def _softcapped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma-2 soft cap, in place on a scores tensor the caller owns."""
    if softcap is None:
        return scores
    return scores.div_(softcap).tanh_().mul_(softcap)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked GQA attention of one sequence slice, in fp32.

    Args:
        q: [n, num_heads, d]; k, v: [L, num_kv_heads, d] (any float dtype).
        mask: [n, L] bool, True where the query may see the key.
        sinks: [num_heads] sink logits, or None.

    Returns:
        [n, num_heads, d] float32.
    """
    n, num_heads, d = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # NOTE: plain bmm + softmax measured faster here than SDPA with a bool mask (and GQA).
    # Query heads of one kv head are stacked along M; K and V stay strided views of the
    # gathered rows (BLAS takes them as transposed / leading-dim operands, no copy).
    qg = q.float().view(n, num_kv_heads, group, d).permute(1, 2, 0, 3)
    qg = qg.reshape(num_kv_heads, group * n, d)
    kf, vf = k.float(), v.float()
    scores = torch.bmm(qg, kf.permute(1, 2, 0)).view(num_kv_heads, group, n, -1)
    scores = _softcapped(scores.mul_(scale), softcap).masked_fill_(~mask, float("-inf"))
    probs = _with_sinks(scores, sinks, (num_kv_heads, group, 1, 1))
    probs = probs.reshape(num_kv_heads, group * n, -1)
    out = torch.bmm(probs, vf.transpose(0, 1)).view(num_kv_heads, group, n, d)
    return out.permute(2, 0, 1, 3).reshape(n, num_heads, d)


def prefill_row(args: Batch, row: PrefillRow, out: torch.Tensor) -> None:
    """Attention of one sequence's new tokens, in query slices that see only their window."""
    w, lo, ctx, start = args.window, row.lo, row.ctx, row.start
    n = row.end - start
    keys = gather_rows(args.key_cache, row.rows, "prefill_k", extra=n)
    values = gather_rows(args.value_cache, row.rows, "prefill_v", extra=n)
    keys[ctx - lo :] = args.key[start : row.end]
    values[ctx - lo :] = args.value[start : row.end]
    for qa in range(0, n, QUERY_CHUNK):
        qb = min(n, qa + QUERY_CHUNK)
        # Keys of this slice: positions [max(lo, first query - w + 1), last query].
        k_lo = lo if w is None else max(lo, ctx + qa - w + 1)
        k_hi = ctx + qb  # exclusive
        q_pos = torch.arange(ctx + qa, ctx + qb, device=out.device)[:, None]
        k_pos = torch.arange(k_lo, k_hi, device=out.device)[None, :]
        mask = k_pos <= q_pos
        if w is not None:
            mask &= k_pos > q_pos - w
        res = _attend(
            args.query[start + qa : start + qb],
            keys[k_lo - lo : k_hi - lo],
            values[k_lo - lo : k_hi - lo],
            mask,
            args.scale,
            args.softcap,
            args.sinks,
        )
        out[start + qa : start + qb] = res


def _decode_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, args: Batch
) -> torch.Tensor:
    """One query per sequence over a padded window, one bmm per kv head, in fp32.

    Args:
        q: [S, kvh, group, d]; k, v: [S, W, kvh, d]; valid: [S, W] bool.

    Returns:
        [S, kvh, group, d] float32.
    """
    num_seqs, kvh, group, d = q.shape
    width = k.shape[1]
    scores = torch.empty(kvh, num_seqs, group, width, dtype=torch.float32, device=q.device)
    for h in range(kvh):  # NOTE: strided K views go to BLAS as transposed operands, no copy
        torch.bmm(q[:, h], k[:, :, h].transpose(1, 2), out=scores[h])
    scores = _softcapped(scores.mul_(args.scale), args.softcap)
    scores.masked_fill_(~valid[None, :, None, :], float("-inf"))
    probs = _with_sinks(scores, args.sinks, (kvh, 1, group, 1))
    res = torch.empty(kvh, num_seqs, group, d, dtype=torch.float32, device=q.device)
    for h in range(kvh):
        torch.bmm(probs[h], v[:, :, h], out=res[h])
    return res.transpose(0, 1)


def _decode_batch(args: Batch, plan: DecodeRows, out: torch.Tensor) -> None:
    """Attention of all one-token rows at once over their padded, gathered windows."""
    k = gather_rows(args.key_cache, plan.rows, "decode_k")  # [S, width, kvh, d]
    v = gather_rows(args.value_cache, plan.rows, "decode_v")
    k[:, -1] = args.key[plan.tokens]
    v[:, -1] = args.value[plan.tokens]
    num_seqs = plan.tokens.shape[0]
    num_heads, d = args.query.shape[1:]
    kvh = args.key.shape[1]
    q = args.query[plan.tokens].float().view(num_seqs, kvh, num_heads // kvh, d)
    res = _decode_attend(q, k.float(), v.float(), plan.valid, args)
    out[plan.tokens] = res.reshape(num_seqs, num_heads, d).to(out.dtype)


def paged_attention_reference(
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
) -> torch.Tensor:
    """Paged (ring) attention of a packed varlen batch, attend-first: the cache is only read.

    Args:
        query: [num_tokens, num_heads, head_dim] the step's new tokens, packed by sequence.
        key, value: [num_tokens, num_kv_heads, head_dim] their fresh K/V.
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        block_tables: [num_seqs, table_width] int block ids (a ring row holds R ids).
        query_start_loc: [num_seqs + 1] cumulative new-token counts.
        context_lens: [num_seqs] positions already cached before this step.
        scale: softmax scale applied to q.k.
        sliding_window: window w (query i sees i - w < j <= i), None for full attention.
        ring_blocks: ring length R, or None when the table is indexed by p // b.
        softcap: Gemma-2 logit soft cap (applied after scale), or None.
        sinks: [num_heads] float32 attention-sink logits (gpt-oss): each joins its head's
            softmax denominator as exp(sink) and weighs no value; None: no sinks.
        out: optional preallocated [num_tokens, num_heads, head_dim] output.

    Returns:
        [num_tokens, num_heads, head_dim] in query's dtype (computed in fp32).
    """
    if out is None:
        out = torch.empty_like(query)
    args = Batch(
        query=query, key=key, value=value, key_cache=key_cache, value_cache=value_cache,
        block_size=key_cache.shape[1], window=sliding_window, ring=ring_blocks, scale=scale,
        softcap=softcap, sinks=sinks,
    )
    plan = step_plan(block_tables, query_start_loc, context_lens, block_size=args.block_size,
                     window=sliding_window, ring=ring_blocks)  # fmt: skip
    for row in plan.prefill:
        prefill_row(args, row, out)
    for rows in plan.decode:
        _decode_batch(args, rows, out)
    return out


def write_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter fresh K/V into the paged caches, in place; slot -1 means skip the token.

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim].
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], mutated.
        slot_mapping: [num_tokens] flat slot `block * block_size + offset`, or -1.
    """
    block_size = key_cache.shape[1]
    slots = slot_mapping.long()
    # NOTE: skipped slots (-1) are rare (a chunk longer than its ring); the boolean
    # selection they need costs more than the write itself in a decode step.
    keep = None if slots.numel() == 0 or int(slots.min()) >= 0 else slots >= 0
    if keep is not None:
        slots = slots[keep]
    for cache, new in ((key_cache, key), (value_cache, value)):
        rows = (new if keep is None else new[keep]).to(cache.dtype)
        flat, index = flat_rows(cache, slots)
        if flat is not None:  # one index_copy_
            flat.index_copy_(0, index, rows)
        else:
            blocks = torch.div(slots, block_size, rounding_mode="floor")
            cache[blocks, slots % block_size] = rows
