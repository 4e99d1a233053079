"""One generated continuation: its tokens, progress through the cache, and how it ended."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from ringserve.engine.detokenizer import IncrementalDetokenizer
from ringserve.engine.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    """Order encodes meaning: everything after RUNNING is finished."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ABORTED = 4

    @property
    def is_finished(self) -> bool:
        return self > SequenceStatus.RUNNING

    @property
    def finish_reason(self) -> str | None:
        return {
            SequenceStatus.FINISHED_STOPPED: "stop",
            SequenceStatus.FINISHED_LENGTH: "length",
            SequenceStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass
class TokenLogprob:
    """The sampled token's log-probability and the top alternatives at one step."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class PromptLogprob:
    """A prompt token's log-probability given the tokens before it (the model's own
    distribution, unprocessed), its 1-based rank there, and the top tokens there, best
    first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(eq=False)
class Sequence:
    """A prompt and one continuation of it.

    ``token_ids`` holds prompt then output; ``num_computed`` counts the positions whose K/V
    are in the cache, so ``num_tokens - num_computed`` is what the next step must feed.
    """

    seq_id: int
    request_id: str
    index: int  # which of the request's n continuations
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    max_tokens: int  # resolved: never past max_model_len
    detokenizer: IncrementalDetokenizer | None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    prompt_chain: list[bytes] | None = None  # its prompt's block names while it waits
    times_passed: int = 0  # admissions that went before it while it waited (lpm)
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    text: str = ""
    sent_text_len: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    blocks_held: int = 0  # KV blocks it held when it finished (all groups)
    grammar: Any = None  # xgrammar.GrammarMatcher under structured outputs
    spec_misses: int = 0  # speculative decodes in a row that kept no draft
    spec_wait: int = 0  # decodes left before the next draft (back-off)
    spec_acceptance: float = 1.0  # drafted tokens kept, recent average (optimistic start)
    # prompt logprobs: computed by the request's first sequence only, with this many top
    # tokens; [None] (the first prompt token has none) then one record per prompt token
    prompt_logprobs_k: int | None = None
    prompt_logprobs: list[PromptLogprob | None] = field(default_factory=list)
    bad_words_ids: list[list[int]] = field(default_factory=list)  # bad_words, tokenized

    def __post_init__(self) -> None:
        if not 0 < self.num_prompt_tokens <= len(self.token_ids):
            raise ValueError("a sequence needs a non-empty prompt")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.num_prompt_tokens

    @property
    def reserved_tokens(self) -> int:
        """Tokens its KV reservation covers: prompt + max_tokens."""
        return self.num_prompt_tokens + self.max_tokens
