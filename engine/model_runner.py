"""Scheduled sequences in, logits out: the one place block ids become tensors.

Block tables live in persistent host tensors, one row per running sequence; a step copies
only the entries a sequence gained since the last step (a ring row stops changing once the
ring is full), then gathers the batch's rows.
"""

from __future__ import annotations

import torch

from ringserve.block_manager import KVCacheManager
from ringserve.engine.forward_batch import ForwardBatch, GroupTables
from ringserve.engine.models import CausalLM, KVCaches
from ringserve.engine.scheduler import ScheduledSeq
from ringserve.engine.sequence import PromptLogprob

# NOTE: prompt positions reduced to logprobs at once: bounds the float32 [rows, vocab]
# logits a long prompt's chunk materialises (64 x 262k x 4 bytes = 64 MiB).
PROMPT_LOGPROBS_ROWS = 64


class ModelRunner:
    """Runs the model on a scheduled step.

    Args:
        model: our model, on ``device``.
        kv: the KV cache manager (block tables, slot mappings).
        caches: per layer, its (key_cache, value_cache).
        max_num_seqs: rows of the persistent block tables.
        max_model_len: the longest sequence (width of full-attention tables).
        device: where the model runs.
    """

    def __init__(self, model: CausalLM, kv: KVCacheManager, caches: KVCaches, *,
                 max_num_seqs: int, max_model_len: int, device: torch.device) -> None:
        self.model = model
        self.kv = kv
        self.caches = caches
        self.device = device
        spec = kv.spec
        self.windows = [g.window for g in spec.groups]
        self.rings = list(kv.ring_blocks)
        widths = [r if r is not None else -(-max_model_len // spec.block_size)
                  for r in self.rings]
        self.tables = [torch.zeros((max_num_seqs, w), dtype=torch.int32) for w in widths]
        self._row: dict[int, int] = {}
        self._synced: dict[int, list[int]] = {}
        self._swaps: dict[int, list[int]] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence's table row."""
        row = self._row.pop(seq_id, None)
        if row is not None:
            self._free_rows.append(row)
            del self._synced[seq_id], self._swaps[seq_id]

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> tuple[
        torch.Tensor, dict[int, list[PromptLogprob]]
    ]:
        """Feed the step's tokens through the model, writing their K/V into the ring.

        Returns:
            logits [rows, vocab] in the model's dtype (float32 where the model soft-caps
            them), in the order of ``scheduled`` restricted to the entries whose `samples`
            is true: one row each, ``1 + len(draft)`` rows for a speculative decode;
            and, by sequence id, the prompt logprobs of this step's prompt positions for
            sequences that ask for them (see `prompt_logprobs`).
        """
        input_ids, batch = self.prepare(scheduled)
        try:
            hidden = self.model(input_ids, batch, self.caches)
        except BaseException:
            self.kv.discard()  # what this step wrote is not to be found by later prompts
            raise
        self.kv.commit()
        logits = self.model.compute_logits(hidden[batch.logits_indices], upcast=False)
        return logits, self.prompt_logprobs(scheduled, hidden)

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

    def prepare(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, ForwardBatch]:
        """Append the step's positions to the block manager and build the tensors."""
        ids: list[int] = []
        positions: list[int] = []
        starts = [0]
        context: list[int] = []
        logits_rows: list[int] = []
        slots: list[list[int]] = [[] for _ in self.rings]
        rows: list[int] = []
        early: list[int] = []
        for item in scheduled:
            seq, n = item.seq, item.num_new
            start = seq.num_computed
            self.kv.check_reads(seq.seq_id, start)
            # NOTE: the rows the step reads are taken before its append: attention reads
            # only positions before `start`, and with prefix caching the append may give a
            # ring entry a fresh block (for positions this step writes) while the step's
            # first queries still read the old one.
            row = self._sync_row(seq.seq_id)
            tokens = seq.token_ids[start : start + n - len(item.draft)] + list(item.draft)
            for g, mapping in enumerate(self.kv.append(seq.seq_id, n, tokens,
                                                       drafts=len(item.draft))):
                slots[g] += mapping
            if item.draft:
                # NOTE: a verification row: each of its n queries is served as a decode
                # (the compiled decode kernel, not a chunk's slower path) reading the row's
                # earlier tokens from the cache, so they are written first, through the row
                # as this append left it (an entry may have taken a fresh block; what the
                # old one held has expired for these queries: the speculative slack).
                self._sync_row(seq.seq_id)
                early += range(len(ids), len(ids) + n)
                rows += [row] * n
                context += range(start, start + n)
                starts += range(starts[-1] + 1, starts[-1] + n + 1)
            else:
                rows.append(row)
                context.append(start)
                starts.append(starts[-1] + n)
            ids += tokens
            positions += range(start, start + n)
            if item.samples:  # a verified run: every position's next-token logits
                logits_rows += range(starts[-1] - 1 - len(item.draft), starts[-1])
        dev = self.device
        row_index = torch.tensor(rows, dtype=torch.int64)
        groups = tuple(
            GroupTables(
                block_tables=self.tables[g].index_select(0, row_index).to(dev),
                slot_mapping=torch.tensor(slots[g], dtype=torch.int64).to(dev),
                window=self.windows[g],
                ring_blocks=self.rings[g],
            )
            for g in range(len(self.rings))
        )
        batch = ForwardBatch(
            positions=torch.tensor(positions, dtype=torch.int64).to(dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32).to(dev),
            context_lens=torch.tensor(context, dtype=torch.int32).to(dev),
            groups=groups,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64).to(dev),
            max_position=max(positions) + 1,
            early_writes=torch.tensor(early, dtype=torch.int64).to(dev) if early else None,
        )
        return torch.tensor(ids, dtype=torch.int64).to(dev), batch

    def _sync_row(self, seq_id: int) -> int:
        """Copy the block ids a sequence gained since last step into its table row (the
        whole row where a ring entry took a fresh block)."""
        row = self._row.get(seq_id)
        if row is None:
            row = self._free_rows.pop()
            self._row[seq_id] = row
            self._synced[seq_id] = [0] * len(self.rings)
            self._swaps[seq_id] = [0] * len(self.rings)
        synced, seen = self._synced[seq_id], self._swaps[seq_id]
        swaps = self.kv.row_swaps(seq_id)
        for g, blocks in enumerate(self.kv.block_tables(seq_id)):
            first = synced[g]
            if swaps[g] != seen[g]:
                first, seen[g] = 0, swaps[g]
            if len(blocks) > first:
                self.tables[g][row, first : len(blocks)] = torch.tensor(blocks[first:],
                                                                        dtype=torch.int32)
                synced[g] = len(blocks)
        return row
