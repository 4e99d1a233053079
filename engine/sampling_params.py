"""Sampling parameters, as vLLM users know them, checked when they are made."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from ringserve.engine.errors import InvalidRequestError

MAX_LOGPROBS = 20
# a seed is a signed 64-bit integer (as vLLM's): torch.Generator.manual_seed takes
# [-2**63, 2**64), and the sampler seeds continuation i with seed + i
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# The least temperature and repetition penalty used (smaller positive ones are raised to
# it, as vLLM does for temperature): logits are divided by them, and a float32 logit
# divided by 1e-38 is infinite, which leaves the sampler no finite weight to draw from.
MIN_DIVISOR = 1e-2
_SURROGATE = re.compile("[\ud800-\udfff]")


def _text(s: Any) -> bool:
    """A non-empty str that is valid Unicode (no lone surrogate: it has no UTF-8 and no
    tokenizer takes it)."""
    return isinstance(s, str) and bool(s) and _SURROGATE.search(s) is None


@dataclass(kw_only=True)
class StructuredOutputsParams:
    """One constraint on the output, as vLLM's ``structured_outputs`` (exactly one is set).

    Args:
        json: a JSON schema (dict or its text) the output must validate against.
        json_object: any JSON object.
        regex: a regular expression the whole output must match.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (xgrammar's dialect, GBNF-like; the rule ``root`` starts).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar")
                 if getattr(self, k) is not None] + (["json_object"] if self.json_object else [])
        if len(kinds) != 1:
            raise InvalidRequestError(
                "structured_outputs takes exactly one of json, json_object, regex, choice, "
                f"grammar; got {kinds or 'none'}", param="structured_outputs")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("structured_outputs.choice must be non-empty strings",
                                      param="structured_outputs.choice")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, k) not in (None, False))


@dataclass(kw_only=True)
class SamplingParams:
    """How to sample one request's continuations.

    Args:
        n: continuations per prompt.
        max_tokens: tokens to generate at most; None = until ``max_model_len``.
        temperature: 0 = greedy; otherwise logits are divided by it (one under
            `MIN_DIVISOR` is taken as `MIN_DIVISOR`, as vLLM does).
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
            has a positive logit divided by it, a negative one multiplied; 1 = off (one
            under `MIN_DIVISOR` is taken as `MIN_DIVISOR`).
        logit_bias: token id -> added to its logit, [-100, 100].
        min_p: drop tokens under this fraction of the likeliest one's probability.
        min_tokens: end-of-sequence and stop token ids are masked until this many tokens.
        bad_words: words never generated (vLLM's): each is tokenized with and without a
            leading space; its last token is banned wherever the tokens before it were just
            generated.
        prompt_logprobs: also return, for each prompt token after the first, its
            log-probability and the top ones at its position (vLLM's); None = none.
        structured_outputs: constrain the output to a JSON schema, regex, choice or grammar.
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
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids)
        checks = [
            ("n", self.n >= 1, "must be >= 1"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be >= 1"),
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0.0,
             "must be a finite number >= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 0, "must be -1, 0 or >= 1"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"must be in [0, {MAX_LOGPROBS}]"),
            ("seed", self.seed is None or (isinstance(self.seed, int)
                                           and SEED_MIN <= self.seed <= SEED_MAX),
             f"must be an integer in [{SEED_MIN}, {SEED_MAX}]"),
            ("stop", all(_text(s) for s in self.stop),
             "must be non-empty strings of valid Unicode"),
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
            ("bad_words", all(_text(w) and w.strip() for w in self.bad_words or []),
             "must be non-blank strings of valid Unicode"),
            ("prompt_logprobs", self.prompt_logprobs is None
             or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, f"must be in [0, {MAX_LOGPROBS}]"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise InvalidRequestError(f"{name} {rule}, got {getattr(self, name)!r}",
                                          param=name)
        if 0.0 < self.temperature < MIN_DIVISOR:
            self.temperature = MIN_DIVISOR
        self.repetition_penalty = max(self.repetition_penalty, MIN_DIVISOR)

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """True when the request changes the logits before a token is picked (besides a
        grammar, which the sampler masks lazily)."""
        return bool(self.has_penalties or self.logit_bias or self.min_p or self.min_tokens
                    or self.bad_words)

    @property
    def greedy(self) -> bool:
        """True when temperature is 0: the sampler takes the argmax."""
        return self.temperature == 0.0
