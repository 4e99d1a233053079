"""Drive one of our models over the ring for tests: chunked prefill, decode, greedy loops.

The caches start full of NaN, so any read of a slot the step did not write shows up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ringserve.block_manager import KVCacheManager
from ringserve.engine.forward_batch import ForwardBatch, GroupTables
from ringserve.engine.kv_cache import allocate_kv_caches, kv_cache_spec, model_kv_sources
from ringserve.engine.loading import load_model
from ringserve.engine.models import CausalLM


class RingHarness:
    """One model, one KV manager (debug mode), NaN-poisoned caches."""

    def __init__(self, model: CausalLM, block_size: int, max_tokens: int,
                 num_seqs: int = 1, kv_dtype: torch.dtype | None = None) -> None:
        self.model = model
        cfg = model.config
        # the caches' dtype: the activations' (a WideningEmbedding's table keeps its stored
        # bf16 under float32 activations)
        embed = model.model.embed_tokens
        dtype = kv_dtype or getattr(embed, "out_dtype", None) or next(model.parameters()).dtype
        self.spec = kv_cache_spec(cfg, block_size, dtype)
        blocks = self.spec.pool_blocks_needed(max_tokens) * num_seqs
        self.kv = KVCacheManager(self.spec, blocks, max_model_len=max_tokens, debug=True)
        self.caches = allocate_kv_caches(self.spec, blocks, cfg.num_layers, dtype, "cpu",
                                         model_kv_sources(cfg))
        for k, v in self.caches:
            k.fill_(float("nan"))
            v.fill_(float("nan"))
        self.windows = [g.window for g in self.spec.groups]
        self.rings = [self.spec.ring_blocks(i) for i in range(len(self.spec.groups))]
        self.max_tokens = max_tokens

    @torch.no_grad()
    def step(self, chunks: dict[int, Sequence[int]],
             last_only: bool = False) -> dict[int, torch.Tensor]:
        """Run one packed step; returns each sequence's logits at every new token (or at
        its last new token only)."""
        steps, ids = [], []
        for sid, tokens in chunks.items():
            if sid not in self.kv:
                self.kv.admit(sid, self.max_tokens, 0)
            ctx = self.kv.num_tokens(sid)
            assert self.kv.check_reads(sid, ctx) == 0
            slots = self.kv.append(sid, len(tokens))
            steps.append(SeqStep(ctx, len(tokens), self.kv.block_tables(sid), slots))
            ids += list(tokens)
        batch = build_forward_batch(steps, self.windows, self.rings)
        hidden = self.model(torch.tensor(ids), batch, self.caches)
        out, start = {}, 0
        for sid, tokens in chunks.items():
            rows = hidden[start + len(tokens) - 1 if last_only else start : start + len(tokens)]
            out[sid] = self.model.compute_logits(rows)
            start += len(tokens)
        return out

    def logits_in_chunks(self, tokens: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        """Feed ``tokens`` in chunks of the given sizes (the last size repeats)."""
        parts, pos, i = [], 0, 0
        while pos < len(tokens):
            n = sizes[min(i, len(sizes) - 1)]
            parts.append(self.step({0: tokens[pos : pos + n]})[0])
            pos, i = pos + n, i + 1
        return torch.cat(parts)

    def greedy(self, prompt: Sequence[int], new_tokens: int, sid: int = 0) -> list[int]:
        """Prefill ``prompt`` in one chunk, then decode greedily one token a step."""
        logits = self.step({sid: prompt}, last_only=True)[sid][-1]
        out = []
        for _ in range(new_tokens):
            token = int(torch.argmax(logits))
            out.append(token)
            if len(out) == new_tokens:
                break
            logits = self.step({sid: [token]}, last_only=True)[sid][-1]
        assert self.kv.stats().read_misses == 0
        return out


def teacher_forced_logits(model: CausalLM, tokens: Sequence[int], chunk: int,
                          block_size: int = 16,
                          kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """fp32 logits [len(tokens), vocab] at every position of ``tokens``, fed through the
    ring in prefill chunks of ``chunk`` tokens (a `RingHarness`: NaN-poisoned caches in
    ``kv_dtype``, default the model's, every cached read checked).

    Raises:
        RuntimeError: a read of an overwritten slot, or a logit that is not finite.
    """
    harness = RingHarness(model, block_size, len(tokens), kv_dtype=kv_dtype)
    logits = harness.logits_in_chunks(tokens, [chunk])
    misses = harness.kv.stats().read_misses
    if misses or not bool(torch.isfinite(logits).all()):
        raise RuntimeError(f"teacher forcing read {misses} overwritten slots or produced "
                           "non-finite logits")
    return logits


def load_ours(path: str, dtype: torch.dtype = torch.float32) -> CausalLM:
    """Our model for an HF folder, through the engine's own loader."""
    return load_model(path, dtype=dtype)


@dataclass(frozen=True)
class SeqStep:
    """One sequence of a step, host side: a plain packing path independent of the runner."""

    context_len: int
    num_new: int
    block_tables: Sequence[Sequence[int]]  # per group
    slot_mappings: Sequence[Sequence[int]]  # per group, num_new entries each
    wants_logits: bool = True


def build_forward_batch(
    steps: Sequence[SeqStep],
    windows: Sequence[int | None],
    ring_blocks: Sequence[int | None],
    device: torch.device | str = "cpu",
) -> ForwardBatch:
    """Pack the host-side description of a step into the tensors a forward pass reads.

    Args:
        steps: one entry per scheduled sequence, in batch order.
        windows: per layer group, its sliding window (None = full attention).
        ring_blocks: per layer group, its ring length R (None = full attention).
        device: where the tensors go.

    Returns:
        The `ForwardBatch`; logits rows are the last new token of each sequence that wants
        logits (a prefill chunk that does not end the prompt samples nothing).
    """
    num_new = [s.num_new for s in steps]
    starts = [0]
    for n in num_new:
        starts.append(starts[-1] + n)
    positions = torch.cat(
        [torch.arange(s.context_len, s.context_len + s.num_new) for s in steps]
    ) if steps else torch.zeros(0, dtype=torch.int64)
    groups = []
    for g, (window, ring) in enumerate(zip(windows, ring_blocks, strict=True)):
        # NOTE: ring rows are padded to R columns (a short sequence holds fewer blocks);
        # padding is never read, since every cached position maps into a held entry.
        width = max([len(s.block_tables[g]) for s in steps] + [ring or 1])
        table = torch.zeros((len(steps), width), dtype=torch.int32)
        for i, s in enumerate(steps):
            row = s.block_tables[g]
            if row:
                table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        slots = [slot for s in steps for slot in s.slot_mappings[g]]
        groups.append(
            GroupTables(
                block_tables=table.to(device),
                slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
                window=window,
                ring_blocks=ring,
            )
        )
    logits_rows = [starts[i + 1] - 1 for i, s in enumerate(steps) if s.wants_logits and s.num_new]
    return ForwardBatch(
        positions=positions.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        context_lens=torch.tensor([s.context_len for s in steps], dtype=torch.int32,
                                  device=device),
        groups=tuple(groups),
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=device),
        max_position=max((s.context_len + s.num_new for s in steps), default=0),
        decode_only=bool(steps) and all(s.num_new == 1 and s.context_len >= 1 for s in steps),
    )
