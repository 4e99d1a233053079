"""What the engine hands back: vLLM's RequestOutput / CompletionOutput shapes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ringserve.engine.sampling_params import SamplingParams
from ringserve.engine.sequence import PromptLogprob, Sequence, TokenLogprob


@dataclass
class Logprob:
    """vLLM's: a token's log-probability, its 1-based rank, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, Logprob] | None]


def prompt_logprobs_dicts(records: list[PromptLogprob | None], k: int,
                          decode: Callable[[int], str] | None) -> PromptLogprobs:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else the actual token
    then the ``k`` likeliest at its position, token id -> `Logprob` (``decode`` gives a
    token's text; None leaves decoded_token None)."""
    cache: dict[int, str | None] = {}

    def text(token_id: int) -> str | None:
        if decode is None:
            return None
        if token_id not in cache:
            cache[token_id] = decode(token_id)
        return cache[token_id]

    out: PromptLogprobs = []
    for r in records:
        if r is None:
            out.append(None)
            continue
        entry = {r.token_id: Logprob(r.logprob, r.rank, text(r.token_id))}
        for rank, (t, v) in enumerate(r.top[:k], start=1):
            entry.setdefault(t, Logprob(v, rank, text(t)))
        out.append(entry)
    return out


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(eq=False)
class Request:
    """One API request: a prompt and its ``n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    error: BaseException | None = None
    extra: dict[str, object] = field(default_factory=dict)
    prompt_logprobs_sent: bool = False  # streaming: the delta carrying them went out

    @property
    def finished(self) -> bool:
        return all(s.status.is_finished for s in self.seqs)

    @property
    def prompt_logprob_records(self) -> list[PromptLogprob | None] | None:
        """The prompt logprobs once all computed (by the first sequence), else None."""
        first = self.seqs[0]
        if first.prompt_logprobs_k is None or len(first.prompt_logprobs) < len(
                self.prompt_token_ids):
            return None
        return first.prompt_logprobs

    def output(self) -> RequestOutput:
        """The request's state now, whole (not a delta)."""
        want_logprobs = self.params.logprobs is not None
        records = self.prompt_logprob_records
        tokenizer: Any = getattr(self.seqs[0].detokenizer, "tokenizer", None)
        prompt_logprobs = None if records is None else prompt_logprobs_dicts(
            records, self.params.prompt_logprobs or 0,
            (lambda t: str(tokenizer.decode([t]))) if tokenizer is not None else None)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=s.index,
                    text=s.text,
                    token_ids=s.output_token_ids,
                    finish_reason=s.status.finish_reason,
                    stop_reason=s.stop_reason,
                    logprobs=list(s.logprobs) if want_logprobs else None,
                    cumulative_logprob=s.cumulative_logprob if want_logprobs else None,
                )
                for s in self.seqs
            ],
            finished=self.finished,
            prompt_logprobs=prompt_logprobs,
        )
