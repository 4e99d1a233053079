"""What the engine hands back: vLLM's RequestOutput / CompletionOutput shapes."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, TokenLogprob


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

    @property
    def finished(self) -> bool:
        return all(s.status.is_finished for s in self.seqs)

    def output(self) -> RequestOutput:
        """The request's state now, whole (not a delta)."""
        want_logprobs = self.params.logprobs is not None
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
        )
