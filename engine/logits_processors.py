"""What a request asks of the logits before a token is picked, in vLLM's order.

0. ``bad_words`` (vLLM's extra, tokenized once per request into `Sequence.bad_words_ids`):
   a word's last token is masked wherever the tokens generated last are the word's others
   (a one-token word: always);
1. ``min_tokens``: end-of-sequence and stop token ids are masked until that many tokens
   were generated;
2. ``logit_bias``: added to the named tokens' logits;
3. penalties: ``repetition_penalty`` (vLLM's extra, as transformers: a positive logit of a
   token seen in the prompt or the output is divided by it, a negative one multiplied),
   then OpenAI's ``frequency_penalty`` (times how often the token was generated) and
   ``presence_penalty`` (once if it was), subtracted;
4. after temperature, ``min_p``: tokens under ``min_p`` times the likeliest one's probability
   are dropped (then top-k and top-p, in the sampler).

Rows are processed as one batch; only the rows of requests that ask for any of it.
"""

from __future__ import annotations

from collections.abc import Collection
from collections.abc import Sequence as Seq

import torch

from ringserve.engine.sequence import Sequence


def apply(logits: torch.Tensor, seqs: Seq[Sequence], eos_token_ids: Collection[int]) -> None:
    """Steps 0 to 3 on float ``logits`` [len(seqs), vocab], in place."""
    vocab = logits.shape[-1]
    for row, seq in enumerate(seqs):
        params = seq.params
        if seq.bad_words_ids:
            banned = _bad_words(seq)
            if banned:
                logits[row, banned] = float("-inf")
        if params.min_tokens and seq.num_output_tokens < params.min_tokens:
            banned = [t for t in (*eos_token_ids, *params.stop_token_ids) if t < vocab]
            logits[row, banned] = float("-inf")
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.int64)
            bias = torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype)
            logits[row].index_add_(0, ids.to(logits.device), bias.to(logits.device))
    _penalties(logits, seqs)


def _bad_words(seq: Sequence) -> list[int]:
    """The last tokens of the bad words whose other tokens were just generated (vLLM:
    only generated tokens count, not the prompt)."""
    output = seq.token_ids[seq.num_prompt_tokens :]
    banned = []
    for word in seq.bad_words_ids:
        prefix = len(word) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or output[-prefix:] == word[:-1]:
            banned.append(word[-1])
    return banned


def _penalties(logits: torch.Tensor, seqs: Seq[Sequence]) -> None:
    rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
    if not rows:
        return
    vocab, dev = logits.shape[-1], logits.device
    counts = torch.zeros((len(rows), vocab), dtype=logits.dtype, device=dev)
    seen = torch.zeros((len(rows), vocab), dtype=torch.bool, device=dev)
    for r, i in enumerate(rows):
        seq = seqs[i]
        output = torch.tensor(seq.token_ids[seq.num_prompt_tokens :], dtype=torch.int64,
                              device=dev)
        counts[r].index_add_(0, output, torch.ones_like(output, dtype=logits.dtype))
        seen[r, torch.tensor(seq.token_ids, dtype=torch.int64, device=dev)] = True
    sub = logits[rows]
    rep = _column(seqs, rows, "repetition_penalty", sub)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub -= _column(seqs, rows, "frequency_penalty", sub) * counts
    sub -= _column(seqs, rows, "presence_penalty", sub) * (counts > 0).to(sub.dtype)
    logits[rows] = sub


def min_p_mask(logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
    """Step 4 on temperature-scaled ``logits``: -inf where a row's probability is under
    ``min_p`` times its likeliest token's."""
    min_p = torch.tensor([s.params.min_p for s in seqs], dtype=logits.dtype,
                         device=logits.device)
    if not bool((min_p > 0).any()):
        return logits
    probs = torch.softmax(logits, dim=-1)
    top = probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < min_p[:, None] * top, float("-inf"))


def _column(seqs: Seq[Sequence], rows: list[int], name: str,
            like: torch.Tensor) -> torch.Tensor:
    values = [float(getattr(seqs[i].params, name)) for i in rows]
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]
