"""A step's plan in, logits out: the one place block ids become tensors.

The runner never calls the KV manager: `engine.step_plan.StepPlanner` appends the step's
positions and hands over a `StepPlan` of lists (tokens, positions, slots, the block ids each
table row gained). Block tables live in persistent host tensors, one row per running
sequence; a step copies in only the entries a plan names (a ring row stops changing once
the ring is full), then gathers the batch's rows.
"""

from __future__ import annotations

import torch

from ringserve.engine.forward_batch import ForwardBatch, GroupTables
from ringserve.engine.models import CausalLM, KVCaches
from ringserve.engine.models.greedy_head import GreedyHead
from ringserve.engine.scheduler import ScheduledSeq
from ringserve.engine.sequence import PromptLogprob
from ringserve.engine.step_plan import StepPlan

# NOTE: prompt positions reduced to logprobs at once: bounds the float32 [rows, vocab]
# logits a long prompt's chunk materialises (64 x 262k x 4 bytes = 64 MiB).
PROMPT_LOGPROBS_ROWS = 64


class ModelRunner:
    """Runs the model on a planned step.

    Args:
        model: our model, on ``device``.
        caches: per layer, its (key_cache, value_cache).
        windows: per layer group, its sliding window (None: full attention).
        rings: per layer group, its ring length in blocks (None: full attention).
        block_size: tokens per block.
        max_num_seqs: rows of the persistent block tables.
        max_model_len: the longest sequence (width of full-attention tables).
        device: where the model runs.
        greedy_head: the output head's `GreedyHead`, or None: plain greedy rows then pick
            from it (see `execute`).
    """

    def __init__(self, model: CausalLM, caches: KVCaches, *, windows: list[int | None],
                 rings: list[int | None], block_size: int, max_num_seqs: int,
                 max_model_len: int, device: torch.device,
                 greedy_head: GreedyHead | None = None) -> None:
        self.model = model
        self.greedy_head = greedy_head
        # the last `execute`'s picks: logits row -> token, for rows it made no logits for
        self.picked: dict[int, int] = {}
        self.caches = caches
        self.device = device
        self.windows = list(windows)
        self.rings = list(rings)
        widths = [r if r is not None else -(-max_model_len // block_size) for r in self.rings]
        self.tables = [torch.zeros((max_num_seqs, w), dtype=torch.int32) for w in widths]

    @torch.inference_mode()
    def execute(self, plan: StepPlan, scheduled: list[ScheduledSeq]) -> tuple[
        torch.Tensor, dict[int, list[PromptLogprob]]
    ]:
        """Feed the step's tokens through the model, writing their K/V into the ring.

        Returns:
            logits [rows, vocab] in the model's dtype (float32 where the model soft-caps
            them), in the order of ``scheduled`` restricted to the entries whose `samples`
            is true: one row each, ``1 + len(draft)`` rows for a speculative decode;
            and, by sequence id, the prompt logprobs of this step's prompt positions for
            sequences that ask for them (see `prompt_logprobs`). With a greedy head, the
            rows of plain greedy sequences (`plain_greedy`) may be picked instead: then
            `picked` maps those rows (numbered as above) to their tokens, and the logits
            hold only the other rows, in the same order.
        """
        input_ids, batch = self.prepare(plan)
        hidden = self.model(input_ids, batch, self.caches)
        rows = hidden[batch.logits_indices]
        self.picked = {}
        greedy = self._greedy_rows(scheduled)
        if greedy:
            tokens = self.greedy_head.pick(rows[greedy]) if self.greedy_head else None
            if tokens is not None:
                self.picked = dict(zip(greedy, tokens.tolist(), strict=True))
                rest = [r for r in range(len(rows)) if r not in self.picked]
                if not rest:  # nothing left for the head
                    vocab = self.greedy_head.vocab  # type: ignore[union-attr]
                    return rows.new_empty((0, vocab)), self.prompt_logprobs(scheduled, hidden)
                rows = rows[rest]
        logits = self.model.compute_logits(rows, upcast=False)
        return logits, self.prompt_logprobs(scheduled, hidden)

    def _greedy_rows(self, scheduled: list[ScheduledSeq]) -> list[int]:
        """The logits rows a greedy head would pick: plain greedy ones, when there are at
        least the head's `min_rows` of them (else none)."""
        if self.greedy_head is None:
            return []
        out, row = [], 0
        for item in (i for i in scheduled if i.samples):
            if not item.draft and plain_greedy(item):
                out.append(row)
            row += 1 + len(item.draft)
        return out if len(out) >= self.greedy_head.min_rows else []

    def prompt_logprobs(self, scheduled: list[ScheduledSeq],
                        hidden: torch.Tensor) -> dict[int, list[PromptLogprob]]:
        """For each scheduled sequence with `prompt_logprobs_k` set, the records of the
        prompt tokens its fed positions predict: the logits at prompt position ``p`` give
        the record of prompt token ``p + 1``; the last prompt position predicts the first
        output token, which is the sampler's.

        The logits are made and reduced ``PROMPT_LOGPROBS_ROWS`` positions at a time.
        """
        out: dict[int, list[PromptLogprob]] = {}
        row = 0
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed
            k = seq.prompt_logprobs_k
            end = min(start + item.num_new, seq.num_prompt_tokens - 1)
            if k is not None and start < end:
                targets = seq.token_ids[start + 1 : end + 1]
                out[seq.seq_id] = [
                    record
                    for lo in range(0, end - start, PROMPT_LOGPROBS_ROWS)
                    for record in self._reduce(
                        hidden[row + lo : row + min(lo + PROMPT_LOGPROBS_ROWS, end - start)],
                        targets[lo : lo + PROMPT_LOGPROBS_ROWS], k)
                ]
            row += item.num_new
        return out

    def _reduce(self, hidden: torch.Tensor, targets: list[int],
                k: int) -> list[PromptLogprob]:
        logp = torch.log_softmax(self.model.compute_logits(hidden, upcast=True), dim=-1)
        target = torch.tensor(targets, dtype=torch.int64, device=logp.device)[:, None]
        chosen = logp.gather(1, target)
        # vLLM's rank: how many tokens are at least as likely (1 = the likeliest)
        ranks = (logp >= chosen).sum(dim=-1)
        top_v, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], target[:, :0])
        return [
            PromptLogprob(token_id=t, logprob=lp, rank=r,
                          top=list(zip(ids, values, strict=True)))
            for t, lp, r, ids, values in zip(
                targets, chosen[:, 0].tolist(), ranks.tolist(), top_i.tolist(),
                top_v.tolist(), strict=True)
        ]

    def prepare(self, plan: StepPlan) -> tuple[torch.Tensor, ForwardBatch]:
        """Apply the plan's table updates and build the step's tensors."""
        for u in plan.updates:
            self.tables[u.group][u.row, u.first : u.first + len(u.blocks)] = torch.tensor(
                u.blocks, dtype=torch.int32)
        dev = self.device
        row_index = torch.tensor(plan.rows, dtype=torch.int64)
        groups = tuple(
            GroupTables(
                block_tables=self.tables[g].index_select(0, row_index).to(dev),
                slot_mapping=torch.tensor(plan.slots[g], dtype=torch.int64).to(dev),
                window=self.windows[g],
                ring_blocks=self.rings[g],
            )
            for g in range(len(self.rings))
        )
        early = plan.early_writes
        batch = ForwardBatch(
            positions=torch.tensor(plan.positions, dtype=torch.int64).to(dev),
            query_start_loc=torch.tensor(plan.query_starts, dtype=torch.int32).to(dev),
            context_lens=torch.tensor(plan.context_lens, dtype=torch.int32).to(dev),
            groups=groups,
            logits_indices=torch.tensor(plan.logits_rows, dtype=torch.int64).to(dev),
            max_position=max(plan.positions) + 1,
            early_writes=torch.tensor(early, dtype=torch.int64).to(dev) if early else None,
            decode_only=(not early and min(plan.context_lens, default=0) >= 1
                         and plan.query_starts == list(range(len(plan.query_starts)))),
        )
        return torch.tensor(plan.input_ids, dtype=torch.int64).to(dev), batch


def plain_greedy(item: ScheduledSeq) -> bool:
    """Whether a sequence's token is its logits' first maximum and nothing else is read
    from them: temperature 0, no logprobs, no grammar, nothing that changes the logits
    (`SamplingParams.processes_logits`)."""
    seq, params = item.seq, item.seq.params
    return (params.greedy and not params.processes_logits and params.logprobs is None
            and seq.grammar is None)
