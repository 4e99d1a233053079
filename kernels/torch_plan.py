"""The index work of one torch-path attention step, computed once and reused by every layer.

All layers of a step (of one layer group) call attention with the same block tables,
`query_start_loc` and `context_lens`; only K/V differ. On the CPU, the dozen small index
ops that map each row's window to cache rows cost as much as the attention of a short
batch, so the plan is cached per thread and reused when the next call's index tensors are
*equal* (compared by value, not identity: a caller may refill one buffer every step).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ringserve.kernels.torch_gather import slot_rows

# NOTE: one entry per layer group that alternates within a step: gemma-3-270m has six (five
# sliding groups of 3 layers and one full group), its layers visiting them out of order.
_CACHE_ENTRIES = 8
# NOTE: decode rows are padded to the longest window of their group; a row whose window is
# under half its group's longest (and the longest is past this many keys) opens a new group,
# so padding at most doubles the gather (full attention mixes very different lengths).
_GROUP_MIN_KEYS = 64


@dataclass(frozen=True, kw_only=True)
class PrefillRow:
    """One sequence with new tokens `start:end` served alone (a chunk, or an empty context).

    `rows` are the cache rows of its window positions `[lo, ctx)`, in position order, read
    through row `seq` of the block tables.
    """

    seq: int
    start: int
    end: int
    ctx: int
    lo: int
    rows: torch.Tensor


@dataclass(frozen=True, kw_only=True)
class DecodeRows:
    """A group of one-token rows with a cached context, served together.

    Row i reads `rows[i]` (its window, padded) then its fresh K/V into the last column;
    `valid[i]` masks the padding. `tokens` are the rows' indices into the packed batch.
    """

    tokens: torch.Tensor
    rows: torch.Tensor
    valid: torch.Tensor


@dataclass(kw_only=True)
class StepPlan:
    """What `paged_attention_reference` needs besides the tensors' values.

    The decode rows' gather indices are built on first use: the compiled CPU kernel
    (`kernels.cpu_attention`) reads the ring itself and needs only `decode_index`.
    """

    key: tuple[object, ...]
    index: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    settings: tuple[int, int | None, int | None]
    # int64 [num prefill rows, 4]: sequence index, first and end token, context length
    prefill_index: torch.Tensor
    # int64 [num decode rows] each: sequence index, token index, context length
    decode_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    _prefill: list[PrefillRow] | None = None
    _decode: list[DecodeRows] | None = None

    @property
    def prefill(self) -> list[PrefillRow]:
        """The prefill rows with the cache rows of their windows, built on first use (the
        compiled CPU kernel reads the ring itself and needs only `prefill_index`)."""
        if self._prefill is None:
            block_tables = self.index[0]
            block_size, window, ring = self.settings
            self._prefill = []
            for seq, start, end, ctx in self.prefill_index.tolist():
                lo = 0 if window is None else max(0, ctx - window + 1)
                positions = torch.arange(lo, ctx, device=block_tables.device)
                rows = slot_rows(block_tables, seq, positions, block_size, ring)
                self._prefill.append(PrefillRow(seq=seq, start=start, end=end, ctx=ctx, lo=lo,
                                                rows=rows))
        return self._prefill

    @property
    def decode(self) -> list[DecodeRows]:
        """Decode rows grouped by window length, with their padded gather indices."""
        if self._decode is None:
            seqs, tokens, ctxs = (t.tolist() for t in self.decode_index)
            window = self.settings[1]
            self._decode = [
                _decode_rows(self.index[0], [seqs[i] for i in group],
                             [tokens[i] for i in group], [ctxs[i] for i in group],
                             self.settings)
                for group in _length_groups(ctxs, window)]  # fmt: skip
        return self._decode


def _decode_rows(
    block_tables: torch.Tensor,
    seqs: list[int],
    tokens: list[int],
    ctxs: list[int],
    settings: tuple[int, int | None, int | None],
) -> DecodeRows:
    block_size, window, ring = settings
    dev = block_tables.device
    ctx = torch.tensor(ctxs, device=dev)
    lo = torch.zeros_like(ctx) if window is None else (ctx - window + 1).clamp(min=0)
    length = ctx - lo
    width = int(length.max()) + 1  # + the fresh key
    col = torch.arange(width, device=dev)[None, :]
    in_window = col < length[:, None]
    # Padding columns re-read position ctx - 1: inside the window, so never garbage.
    positions = torch.where(in_window, lo[:, None] + col, ctx[:, None] - 1)
    seq_t = torch.tensor(seqs, device=dev)[:, None]
    return DecodeRows(
        tokens=torch.tensor(tokens, device=dev),
        rows=slot_rows(block_tables, seq_t, positions, block_size, ring),
        valid=in_window | (col == width - 1),
    )


def _build(
    key: tuple[object, ...],
    index: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    settings: tuple[int, int | None, int | None],
) -> StepPlan:
    block_tables, query_start_loc, context_lens = index
    starts = query_start_loc.tolist()
    ctxs = context_lens.tolist()
    prefill: list[tuple[int, int, int, int]] = []
    seqs: list[int] = []
    tokens: list[int] = []
    for seq, ctx in enumerate(ctxs):
        start, end = starts[seq], starts[seq + 1]
        if end - start == 1 and ctx > 0:
            seqs.append(seq)
            tokens.append(start)
        elif end > start:
            prefill.append((seq, start, end, ctx))
    dev = block_tables.device
    decode_index = (torch.tensor(seqs, dtype=torch.int64, device=dev),
                    torch.tensor(tokens, dtype=torch.int64, device=dev),
                    torch.tensor([ctxs[s] for s in seqs], dtype=torch.int64, device=dev))
    prefill_index = torch.tensor(prefill, dtype=torch.int64, device=dev).view(-1, 4)
    return StepPlan(key=key, index=index, settings=settings, prefill_index=prefill_index,
                    decode_index=decode_index)


def _rebind(
    sibling: StepPlan,
    key: tuple[object, ...],
    index: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> StepPlan:
    """`sibling`'s plan for other block tables: the same rows (their gathers, built on first
    use, read the new tables)."""
    return StepPlan(key=key, index=index, settings=sibling.settings,
                    prefill_index=sibling.prefill_index, decode_index=sibling.decode_index)


def _length_groups(ctxs: list[int], window: int | None) -> list[list[int]]:
    """Indices of `ctxs` grouped by window length, longest first, padding at most ~2x."""
    lengths = [c if window is None else min(c, window - 1) for c in ctxs]
    order = sorted(range(len(ctxs)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        top = lengths[groups[-1][0]] if groups else 0
        if not groups or (2 * lengths[i] < top and top > _GROUP_MIN_KEYS):
            groups.append([])
        groups[-1].append(i)
    return groups


class _PlanCache(threading.local):
    def __init__(self) -> None:
        self.entries: list[StepPlan] = []


_PLANS = _PlanCache()


def step_plan(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int,
    window: int | None,
    ring: int | None,
) -> StepPlan:
    """The (cached) plan of a step.

    Args:
        block_tables, query_start_loc, context_lens: as `kernels.paged_attention`.
        block_size: tokens per cache block.
        window: sliding window or None.
        ring: ring length R or None.

    Returns:
        A plan equal to a fresh build for these values.
    """
    index = (block_tables, query_start_loc, context_lens)
    key: tuple[object, ...] = (block_size, window, ring, block_tables.device,
                               *((t.shape, t.dtype) for t in index))  # fmt: skip
    entries = _PLANS.entries
    for i, plan in enumerate(entries):
        same = plan.key == key and all(map(torch.equal, plan.index, index))
        if same:
            entries.insert(0, entries.pop(i))
            return plan
    settings = (block_size, window, ring)
    copies = (block_tables.clone(), query_start_loc.clone(), context_lens.clone())
    # Groups with one window share the step's shape and differ only in their tables: reuse
    # a sibling's decode index (it does not read the tables) and gather only prefill rows.
    sibling = next((p for p in entries if p.key[:4] == key[:4] and p.key[5:] == key[5:]
                    and torch.equal(p.index[1], query_start_loc)
                    and torch.equal(p.index[2], context_lens)), None)
    plan = _build(key, copies, settings) if sibling is None else _rebind(sibling, key, copies)
    entries.insert(0, plan)
    del entries[_CACHE_ENTRIES:]
    return plan
