"""Turn a step's logits into tokens: penalties and biases, greedy, temperature, min-p,
top-k, top-p, seeds, logprobs."""

from __future__ import annotations

from collections.abc import Collection

import torch

from engine import logits_processors
from engine.sequence import Sequence, TokenLogprob
from engine.structured_output import StructuredOutputs


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

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[
        list[int], list[TokenLogprob | None]
    ]:
        """Sample a token for each row of ``logits`` [len(seqs), vocab].

        Greedy rows take the first maximum of the logits as given (any float dtype: widening
        bf16 to float32 is exact, so the pick is the same); rows that sample, change their
        logits (penalties, biases, `engine.logits_processors`) or report logprobs are
        widened to float32 first, and only those.

        Returns:
            The token ids, and per row the logprob record when the request asked for one
            (log-probabilities of the model's distribution, before any processing).
        """
        # NOTE: max().indices is the first maximum like argmax, and measured faster on CPU.
        tokens = logits.max(dim=-1).indices
        rows = [i for i, s in enumerate(seqs)
                if not s.params.greedy or s.params.processes_logits]
        if rows:
            picked = self._pick_rows(logits[rows].float(), [seqs[i] for i in rows])
            tokens[rows] = picked
        token_list: list[int] = tokens.tolist()
        return token_list, self._logprobs(logits, seqs, token_list)

    def _pick_rows(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Process float rows (a copy) in place, then take greedy rows' first maximum and
        sample the others.

        The grammar mask comes first (as in vLLM). Should the processors then leave a
        grammar row nothing (``min_tokens`` masking the stop token a complete grammar
        allows, say), the grammar wins: the row gets its grammar mask alone.
        """
        masked = self.structured.mask(logits, seqs) if self.structured else []
        # only min_tokens and bad_words set logits to -inf
        risky = [i for i in masked if seqs[i].params.min_tokens or seqs[i].params.bad_words]
        kept = logits[risky].clone() if risky else None
        logits_processors.apply(logits, seqs, self.eos_token_ids)
        if kept is not None:
            for j, i in enumerate(risky):
                if bool(torch.isneginf(logits[i]).all()):
                    logits[i] = kept[j]
        out = logits.max(dim=-1).indices
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if rows:
            out[rows] = self._sample_rows(logits[rows], [seqs[i] for i in rows])
        return out

    def _sample_rows(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        temps = torch.tensor([s.params.temperature for s in seqs], dtype=logits.dtype,
                             device=logits.device)
        scaled = logits_processors.min_p_mask(logits / temps[:, None], seqs)
        probs = torch.softmax(_top_k_top_p(scaled, seqs), dim=-1)
        out = torch.empty(len(seqs), dtype=torch.int64, device=logits.device)
        unseeded = [i for i, s in enumerate(seqs) if s.params.seed is None]
        if unseeded:
            out[unseeded] = torch.multinomial(probs[unseeded], 1).squeeze(1)
        for i, s in enumerate(seqs):
            if s.params.seed is not None:
                gen = self._generators.get(s.seq_id)
                if gen is None:
                    gen = torch.Generator(device=logits.device)
                    gen.manual_seed(s.params.seed + s.index)
                    self._generators[s.seq_id] = gen
                out[i] = torch.multinomial(probs[i], 1, generator=gen)[0]
        return out

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
