"""Turn a step's logits into tokens: penalties and biases, greedy, temperature, min-p,
top-k, top-p, seeds, logprobs."""

from __future__ import annotations

import itertools
from collections.abc import Collection

import torch

from ringserve.engine import logits_processors
from ringserve.engine.sampling_params import SamplingParams
from ringserve.engine.sequence import Sequence, TokenLogprob
from ringserve.engine.structured_output import StructuredOutputs
from ringserve.kernels.cpu_sample import first_max


class Sampler:
    """Samples one token per row; seeded sequences get their own generator.

    Args:
        eos_token_ids: what ``min_tokens`` masks besides a request's stop token ids.
        structured: masks the rows of sequences under structured outputs.
    """

    def __init__(self, eos_token_ids: Collection[int] = (),
                 structured: StructuredOutputs | None = None) -> None:
        self._generators: dict[int, torch.Generator] = {}
        self.eos_token_ids = tuple(eos_token_ids)
        self.structured = structured

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    def save_state(self, seqs: list[Sequence]) -> dict[int, torch.Tensor | None]:
        """The seeded sequences' generator states, to sample a step again as if the first
        try never ran (`LLMEngine.step` after a fault): None where none exists yet."""
        return {s.seq_id: (None if (g := self._generators.get(s.seq_id)) is None
                           else g.get_state())
                for s in seqs if s.params.seed is not None}

    def restore_state(self, saved: dict[int, torch.Tensor | None]) -> None:
        for seq_id, state in saved.items():
            if state is None:
                self._generators.pop(seq_id, None)
            elif seq_id in self._generators:
                self._generators[seq_id].set_state(state)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[
        list[int], list[TokenLogprob | None]
    ]:
        """Sample a token for each row of ``logits`` [len(seqs), vocab].

        Greedy rows take the first maximum of the logits as given (any float dtype: widening
        bf16 to float32 is exact, so the pick is the same); rows that sample, change their
        logits (penalties, biases, `engine.logits_processors`) or report logprobs are
        widened to float32 first, and only those.

        Rows under structured outputs are masked lazily: the token is picked as if
        unconstrained and kept when the row's grammar allows it; otherwise the row is
        masked and picked again. That is exact: a greedy row's first maximum is the
        masked row's when the grammar allows it; a sampled row draws from ``p``, keeps an
        allowed token, else draws from ``p`` restricted to the allowed set ``A``, so token
        ``a`` in ``A`` comes with ``p(a) + (1 - p(A)) p(a) / p(A) = p(a) / p(A)``. It saves
        masking every row of the vocabulary every step (28 ms for 28 rows of 262,144
        tokens), which a model that already writes what the grammar wants never needs. Rows
        whose truncation (top-k, top-p, min-p) or ``min_tokens``/``bad_words`` interplay
        with the mask are masked first (eagerly), as vLLM does for every row.

        Returns:
            The token ids, and per row the logprob record when the request asked for one
            (log-probabilities of the model's distribution, before any processing).
        """
        # NOTE: the first maximum, as argmax; compiled on the CPU (kernels.cpu_sample: 0.6
        # ms for 32 rows of 262,144 where torch's max took 4.8)
        tokens = first_max(logits)
        grammar = [i for i, s in enumerate(seqs) if s.grammar is not None]
        bitmask = None
        if grammar:
            assert self.structured is not None
            bitmask = self.structured.fill(seqs, grammar)
        eager = {i for i in grammar if _masks_first(seqs[i].params)}
        rows = [i for i, s in enumerate(seqs)
                if not s.params.greedy or s.params.processes_logits or i in eager]
        processed = weights = None
        where: dict[int, int] = {}
        if rows:
            where = {i: r for r, i in enumerate(rows)}
            processed = logits[rows].float()
            first = [where[i] for i in sorted(eager)]
            if first:
                assert self.structured is not None and bitmask is not None
                self.structured.apply(processed, bitmask[sorted(eager)], first)
            picked, weights = self._pick_rows(processed, [seqs[i] for i in rows], first)
            tokens[rows] = picked
        lazy = [i for i in grammar if i not in eager]
        if lazy:
            assert self.structured is not None and bitmask is not None
            allowed = self.structured.allows(bitmask[lazy], tokens[lazy])
            for k in (k for k, ok in enumerate(allowed.tolist()) if not ok):
                i = lazy[k]
                tokens[i] = self._pick_again(i, seqs[i], logits, processed, weights, where,
                                             bitmask[i : i + 1])
        token_list: list[int] = tokens.tolist()
        return token_list, self._logprobs(logits, seqs, token_list)

    def verify(self, logits: torch.Tensor, seq: Sequence, draft: tuple[int, ...]
               ) -> tuple[list[int], list[TokenLogprob | None]]:
        """The tokens a speculative decode emits: drafts kept while they pass, then one
        from the model (a correction, or a bonus token after the last draft).

        ``logits`` [1 + len(draft), vocab]: row ``j`` predicts the token after draft
        ``j - 1`` (row 0: after the sequence's last token). Greedy keeps a draft while it is
        the row's first maximum and emits the first maximum where it is not: the tokens of
        decoding one at a time. Sampling uses the rejection rule for a draft that is one
        token for sure: keep draft ``x`` with probability ``p(x)``, else draw from ``p``
        without ``x`` (renormalised); every emitted token then follows ``p`` exactly, and a
        seeded sequence draws its uniforms from its own generator, so it stays reproducible.
        """
        if seq.params.greedy:
            best = first_max(logits).tolist()
            out = [d for d, _ in itertools.takewhile(lambda x: x[0] == x[1],
                                                     zip(draft, best, strict=False))]
            out.append(best[len(out)])
        else:
            weights = self._weights(logits.to(torch.float32, copy=True), [seq] * len(logits))
            out = []
            for j, token in enumerate(draft):
                row = weights[j]
                keep = float(row[token] / row.sum())
                if float(self._uniforms([seq])[0]) < keep:
                    out.append(token)
                    continue
                row[token] = 0.0
                break
            else:
                row = weights[len(draft)]
            out.append(int(inverse_cdf(row[None], self._uniforms([seq]))[0]))
        lps = self._logprobs(logits[: len(out)], [seq] * len(out), out)
        return out, lps

    def _pick_rows(self, logits: torch.Tensor, seqs: list[Sequence], masked: list[int]
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Process float rows (a copy) in place, then take greedy rows' first maximum and
        sample the others.

        Should the processors leave a row its grammar masked (``masked``) nothing
        (``min_tokens`` masking the stop token a complete grammar allows, say), the grammar
        wins: the row gets its grammar mask alone.

        Returns:
            The tokens, and the sampled rows' weights (all rows; greedy rows' are zero).
        """
        # only min_tokens and bad_words set logits to -inf
        risky = [i for i in masked if seqs[i].params.min_tokens or seqs[i].params.bad_words]
        kept = logits[risky].clone() if risky else None
        logits_processors.apply(logits, seqs, self.eos_token_ids)
        if kept is not None:
            for j, i in enumerate(risky):
                if bool(torch.isneginf(logits[i]).all()):
                    logits[i] = kept[j]
        out = first_max(logits)
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        weights = None
        if rows:
            # NOTE: in place when every row samples (the usual batch): no copy of the rows
            picked = [seqs[i] for i in rows]
            if len(rows) == len(seqs):
                weights = self._weights(logits, picked)
                out = inverse_cdf(weights, self._uniforms(picked))
            else:
                weights = torch.zeros_like(logits)
                weights[rows] = self._weights(logits[rows], picked)
                out[rows] = inverse_cdf(weights[rows], self._uniforms(picked))
        return out, weights

    def _pick_again(self, i: int, seq: Sequence, logits: torch.Tensor,
                    processed: torch.Tensor | None, weights: torch.Tensor | None,
                    where: dict[int, int], bitmask: torch.Tensor) -> int:
        """Row ``i``'s token once its grammar refused the first pick: from the masked
        weights (a second uniform), or the masked row's first maximum."""
        assert self.structured is not None
        if not seq.params.greedy:
            assert weights is not None
            row = weights[where[i]][None].clone()
            self.structured.apply(row, bitmask, [0], fill=0.0)
            return int(inverse_cdf(row, self._uniforms([seq]))[0])
        # NOTE: a copy: ``logits`` is the model's (an inference tensor, and the source of
        # the logprobs), never masked in place.
        row = (processed[where[i]][None] if i in where and processed is not None
               else logits[i][None].to(torch.float32, copy=True))
        self.structured.apply(row, bitmask, [0])
        return int(row.max(dim=-1).indices[0])

    def _weights(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Unnormalised probabilities after temperature, min-p, top-k and top-p (``logits``
        is overwritten)."""
        temps = torch.tensor([s.params.temperature for s in seqs], dtype=logits.dtype,
                             device=logits.device)
        scaled = logits_processors.min_p_mask(logits.div_(temps[:, None]), seqs)
        scaled = _top_k_top_p(scaled, seqs)
        return scaled.sub_(scaled.max(dim=-1, keepdim=True).values).exp_()

    def _uniforms(self, seqs: list[Sequence]) -> torch.Tensor:
        """One uniform per row: from the row's own generator when it has a seed."""
        uniform = torch.empty(len(seqs), dtype=torch.float64)
        unseeded = [i for i, s in enumerate(seqs) if s.params.seed is None]
        if unseeded:
            uniform[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
        for i, s in enumerate(seqs):
            if s.params.seed is not None:
                gen = self._generators.get(s.seq_id)
                if gen is None:
                    gen = torch.Generator()
                    gen.manual_seed(s.params.seed + s.index)
                    self._generators[s.seq_id] = gen
                uniform[i] = torch.rand(1, generator=gen, dtype=torch.float64)[0]
        return uniform

    @staticmethod
    def _logprobs(logits: torch.Tensor, seqs: list[Sequence],
                  tokens: list[int]) -> list[TokenLogprob | None]:
        wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        result: list[TokenLogprob | None] = [None] * len(seqs)
        if not wanted:
            return result
        logp = torch.log_softmax(logits[wanted].float(), dim=-1)
        k = max(seqs[i].params.logprobs or 0 for i in wanted)
        top_v, top_i = logp.topk(max(k, 1), dim=-1)
        chosen = logp.gather(1, torch.tensor([[tokens[i]] for i in wanted],
                                             device=logits.device))
        for row, i in enumerate(wanted):
            n = seqs[i].params.logprobs or 0
            result[i] = TokenLogprob(
                token_id=tokens[i],
                logprob=float(chosen[row, 0]),
                top=list(zip(top_i[row, :n].tolist(), top_v[row, :n].tolist(), strict=True)),
            )
        return result


def _masks_first(params: SamplingParams) -> bool:
    """True when the grammar mask must come before the rest (it changes what top-k, top-p
    and min-p keep, and min_tokens/bad_words may leave nothing but what it allows)."""
    return bool(params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0
                or params.min_tokens or params.bad_words)


def _top_k_top_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p with -inf (at least one kept)."""
    top_k = [s.params.top_k for s in seqs]
    top_p = [s.params.top_p for s in seqs]
    if all(k <= 0 for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=logits.device)
    drop = ranks >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    p = torch.tensor(top_p, dtype=logits.dtype, device=logits.device)
    drop |= before >= p[:, None]
    drop[:, 0] = False
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, masked)


CDF_CHUNK = 1024


def inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the token whose cumulative weight first reaches ``(1 - u)`` of the row's
    total: a draw from the distribution proportional to ``weights`` [rows, vocab] (>= 0,
    each row some > 0) for ``uniform`` [rows] in [0, 1).

    One uniform per row, where `torch.multinomial` (and the exponential race) draw one per
    vocabulary entry: 200 ms for 32 rows of gemma's 262,144 tokens on the 2-core dev CPU,
    against 1.1 ms for this. The running sum has two levels, so float32 rounding does not
    pile up over 262k terms: sums of chunks of ``CDF_CHUNK`` tokens (float32, vectorized),
    their running sum in float64, then the chosen chunk's own running sum in float64. A
    token of weight 0 is never drawn: the target is > 0 and at most the total, and a
    token's running sum equals its neighbour's when its weight is 0.
    """
    rows, vocab = weights.shape
    pad = -vocab % CDF_CHUNK
    w = torch.nn.functional.pad(weights, (0, pad)) if pad else weights
    chunks = w.view(rows, -1, CDF_CHUNK)
    totals = chunks.sum(dim=-1).to(torch.float64).cumsum(dim=-1)  # [rows, chunks]
    target = (1.0 - uniform.to(torch.float64)) * totals[:, -1]
    k = torch.searchsorted(totals, target[:, None]).squeeze(1).clamp_(max=totals.shape[1] - 1)
    before = torch.where(k > 0, totals.gather(1, (k - 1).clamp(min=0)[:, None]).squeeze(1),
                         torch.zeros_like(target))
    inner = chunks[torch.arange(rows, device=w.device), k].to(torch.float64).cumsum(dim=-1)
    rest = torch.minimum(target - before, inner[:, -1])  # rounding may overshoot the chunk
    j = torch.searchsorted(inner, rest[:, None]).squeeze(1).clamp_(max=CDF_CHUNK - 1)
    return k * CDF_CHUNK + j
