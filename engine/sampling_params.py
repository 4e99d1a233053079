"""Sampling parameters, as vLLM users know them, checked when they are made."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequestError

MAX_LOGPROBS = 20


@dataclass(kw_only=True)
class SamplingParams:
    """How to sample one request's continuations.

    Args:
        n: continuations per prompt.
        max_tokens: tokens to generate at most; None = until ``max_model_len``.
        temperature: 0 = greedy; otherwise logits are divided by it.
        top_p: nucleus sampling mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 = all.
        seed: makes sampling reproducible per request.
        stop: strings that end the text (not included in it).
        stop_token_ids: token ids that end the generation.
        ignore_eos: keep going past the end-of-sequence token.
        logprobs: also return the log-probabilities of this many top tokens per step
            (0 = only the sampled token's); None = none.
        skip_special_tokens: leave special tokens out of the text.
        presence_penalty: OpenAI's: subtracted once from a token generated before, [-2, 2].
        frequency_penalty: OpenAI's: subtracted per time a token was generated, [-2, 2].
        repetition_penalty: vLLM's (transformers'): a token seen in the prompt or output
            has a positive logit divided by it, a negative one multiplied; 1 = off.
        logit_bias: token id -> added to its logit, [-100, 100].
        min_p: drop tokens under this fraction of the likeliest one's probability.
        min_tokens: end-of-sequence and stop token ids are masked until this many tokens.
    (See `engine.logits_processors` for the order they apply in.)
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_p: float = 0.0
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids)
        checks = [
            ("n", self.n >= 1, "must be >= 1"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be >= 1"),
            ("temperature", self.temperature >= 0.0, "must be >= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 0, "must be -1, 0 or >= 1"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"must be in [0, {MAX_LOGPROBS}]"),
            ("stop", all(isinstance(s, str) and s for s in self.stop),
             "must be non-empty strings"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "must be token ids >= 0"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 100.0,
             "must be in (0, 100]"),
            ("logit_bias", all(isinstance(t, int) and t >= 0 and -100.0 <= b <= 100.0
                               for t, b in (self.logit_bias or {}).items()),
             "must map token ids >= 0 to biases in [-100, 100]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("min_tokens", self.min_tokens >= 0 and (
                self.max_tokens is None or self.min_tokens <= self.max_tokens),
             "must be >= 0 and <= max_tokens"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise InvalidRequestError(f"{name} {rule}, got {getattr(self, name)!r}",
                                          param=name)

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """True when the request changes the logits before a token is picked."""
        return bool(self.has_penalties or self.logit_bias or self.min_p or self.min_tokens)

    @property
    def greedy(self) -> bool:
        """True when temperature is 0: the sampler takes the argmax."""
        return self.temperature == 0.0
