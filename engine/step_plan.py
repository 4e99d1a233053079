"""A scheduled step as data: the one place a step talks to the KV manager.

`StepPlanner.plan` takes the scheduler's sequences, checks what their queries will read,
appends their positions to the block manager, and writes down everything the model runner
needs as plain lists: the tokens and positions, each query's table row and context, the
slot every new position is written to, and the block ids each table row gained. The runner
(`engine.model_runner`) only turns a `StepPlan` into tensors and runs the model; it never
sees the manager. A plan is plain data (it pickles): what a step would send to a model
runner in another process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ringserve.block_manager import KVCacheManager
from ringserve.engine.scheduler import ScheduledSeq


@dataclass(frozen=True)
class TableUpdate:
    """Entries ``[first, first + len(blocks))`` of table row ``row`` of layer group
    ``group`` now hold ``blocks``."""

    row: int
    group: int
    first: int
    blocks: tuple[int, ...]


@dataclass
class StepPlan:
    """What one step feeds the model and where its K/V go, as lists.

    Queries are grouped: a plain sequence's new positions are one group (a prefill chunk or
    a decode); a speculative verification row is one group per position, each served as a
    decode. ``updates`` are applied in order before the step runs.
    """

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    query_starts: list[int] = field(default_factory=lambda: [0])  # per group, cumulative
    context_lens: list[int] = field(default_factory=list)  # per group: positions cached
    rows: list[int] = field(default_factory=list)  # per group: the table row it reads
    slots: list[list[int]] = field(default_factory=list)  # per layer group, per position
    logits_rows: list[int] = field(default_factory=list)  # positions whose logits are kept
    early_writes: list[int] = field(default_factory=list)  # positions written before reads
    updates: list[TableUpdate] = field(default_factory=list)


class StepPlanner:
    """Turns scheduled sequences into `StepPlan` s, keeping which table row each running
    sequence has and how much of it the runner already holds.

    Args:
        kv: the KV cache manager.
        max_num_seqs: table rows (one per running sequence).
    """

    def __init__(self, kv: KVCacheManager, max_num_seqs: int) -> None:
        self.kv = kv
        self.num_groups = len(kv.ring_blocks)
        self._row: dict[int, int] = {}
        self._synced: dict[int, list[int]] = {}  # per group: entries the runner holds
        self._swaps: dict[int, list[int]] = {}  # per group: fresh blocks seen so far
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence's table row."""
        row = self._row.pop(seq_id, None)
        if row is not None:
            self._free_rows.append(row)
            del self._synced[seq_id], self._swaps[seq_id]

    def plan(self, scheduled: list[ScheduledSeq]) -> StepPlan:
        """Append the step's positions to the block manager and write the step down."""
        plan = StepPlan(slots=[[] for _ in range(self.num_groups)])
        for item in scheduled:
            seq, n = item.seq, item.num_new
            start = seq.num_computed
            self.kv.check_reads(seq.seq_id, start)
            # NOTE: the rows the step reads are taken before its append: attention reads
            # only positions before `start`, and with prefix caching the append may give a
            # ring entry a fresh block (for positions this step writes) while the step's
            # first queries still read the old one.
            row = self._sync_row(seq.seq_id, plan.updates)
            tokens = seq.token_ids[start : start + n - len(item.draft)] + list(item.draft)
            for g, mapping in enumerate(self.kv.append(seq.seq_id, n, tokens,
                                                       drafts=len(item.draft))):
                plan.slots[g] += mapping
            starts = plan.query_starts
            if item.draft:
                # NOTE: a verification row: each of its n queries is served as a decode
                # (the compiled decode kernel, not a chunk's slower path) reading the row's
                # earlier tokens from the cache, so they are written first, through the row
                # as this append left it (an entry may have taken a fresh block; what the
                # old one held has expired for these queries: the speculative slack).
                self._sync_row(seq.seq_id, plan.updates)
                first = len(plan.input_ids)
                plan.early_writes += range(first, first + n)
                plan.rows += [row] * n
                plan.context_lens += range(start, start + n)
                starts += range(starts[-1] + 1, starts[-1] + n + 1)
            else:
                plan.rows.append(row)
                plan.context_lens.append(start)
                starts.append(starts[-1] + n)
            plan.input_ids += tokens
            plan.positions += range(start, start + n)
            if item.samples:  # a verified run: every position's next-token logits
                plan.logits_rows += range(starts[-1] - 1 - len(item.draft), starts[-1])
        return plan

    def _sync_row(self, seq_id: int, updates: list[TableUpdate]) -> int:
        """The sequence's table row, and the block ids it gained since the runner last
        heard (the whole row where a ring entry took a fresh block)."""
        row = self._row.get(seq_id)
        if row is None:
            row = self._free_rows.pop()
            self._row[seq_id] = row
            self._synced[seq_id] = [0] * self.num_groups
            self._swaps[seq_id] = [0] * self.num_groups
        synced, seen = self._synced[seq_id], self._swaps[seq_id]
        swaps = self.kv.row_swaps(seq_id)
        for g, blocks in enumerate(self.kv.block_tables(seq_id)):
            first = synced[g]
            if swaps[g] != seen[g]:
                first, seen[g] = 0, swaps[g]
            if len(blocks) > first:
                updates.append(TableUpdate(row, g, first, tuple(blocks[first:])))
                synced[g] = len(blocks)
        return row
