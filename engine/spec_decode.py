"""Speculative decoding by prompt lookup (vLLM's ``ngram`` method): drafts without a second
model.

A sequence's last ``n`` tokens (``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``) are looked up in its own prompt and output; the tokens that followed
their most recent earlier occurrence are the draft. Outputs that repeat their input (code
edits, summaries, extraction, answers quoting a document) find long drafts; others find
none and decode as before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.errors import InvalidRequestError
from engine.sequence import Sequence

MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config``: ``{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": 4, "prompt_lookup_min": 2}``."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

    def __post_init__(self) -> None:
        checks = [
            ("method", self.method == "ngram", "must be 'ngram' (no draft models here)"),
            ("num_speculative_tokens", 1 <= self.num_speculative_tokens
             <= MAX_SPECULATIVE_TOKENS, f"must be in [1, {MAX_SPECULATIVE_TOKENS}]"),
            ("prompt_lookup_min", self.prompt_lookup_min >= 1, "must be >= 1"),
            ("prompt_lookup_max", self.prompt_lookup_max >= self.prompt_lookup_min,
             "must be >= prompt_lookup_min"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise InvalidRequestError(
                    f"speculative_config.{name} {rule}, got {getattr(self, name)!r}",
                    param=f"speculative_config.{name}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None
              ) -> SpeculativeConfig | None:
        """From a dict, its JSON text (the CLI flag), or None (off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise InvalidRequestError(f"speculative_config is not JSON: {err}",
                                          param="speculative_config") from None
        if not isinstance(value, dict):
            raise InvalidRequestError("speculative_config must be a JSON object",
                                      param="speculative_config")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(f"speculative_config: unknown keys {unknown}; known: "
                                      f"{sorted(known)}", param="speculative_config")
        return cls(**value)


def propose(tokens: list[int] | np.ndarray, k: int, lookup_min: int, lookup_max: int
            ) -> list[int]:
    """Up to ``k`` drafted tokens for the sequence ``tokens`` (prompt then output).

    The longest suffix of ``n`` tokens (``lookup_max >= n >= lookup_min``) that also occurs
    earlier wins; of its earlier occurrences the most recent one; the draft is what followed
    it (fewer than ``k`` tokens when it runs into the end). No match: no draft.
    """
    seq = np.asarray(tokens, dtype=np.int64)
    size = len(seq)
    for n in range(min(lookup_max, size - 1), lookup_min - 1, -1):
        pattern = seq[size - n :]
        # windows starting at 0 .. size - n - 1: every occurrence but the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(seq[: size - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return [int(t) for t in seq[start : start + k]]
    return []


def speculates(seq: Sequence) -> bool:
    """Whether a sequence may decode speculatively: its logits see no processing that
    depends on the tokens before each position (penalties, biases, min_tokens, bad words,
    a grammar), which a verified run would have to replay token by token."""
    return not seq.params.processes_logits and seq.grammar is None


MAX_BACK_OFF = 16  # decodes without drafts, at most, after drafts kept failing


def back_off(seq: Sequence, kept: int, drafted: int) -> None:
    """After a speculative decode: a sequence whose drafts were all rejected twice in a row
    or more waits ``2 ** (misses - 2)`` decodes (at most `MAX_BACK_OFF`) before drafting
    again, so a workload that repeats nothing pays little for trying; one kept draft
    resets it. Also keeps the sequence's acceptance (kept / drafted, an average weighted
    to recent steps) for `StepCost.worth`."""
    seq.spec_acceptance = 0.7 * seq.spec_acceptance + 0.3 * kept / max(drafted, 1)
    if kept:
        seq.spec_misses = 0
        return
    seq.spec_misses += 1
    if seq.spec_misses >= 2:
        seq.spec_wait = min(2 ** (seq.spec_misses - 2), MAX_BACK_OFF)


class StepCost:
    """What a step costs per token fed, learned as the engine runs: ``t = a + b * tokens``
    fitted to recent steps (exponentially weighted least squares).

    On a memory-bound device a step's cost barely grows with its tokens (``b`` small), and
    every likely draft pays. Where it grows (a CPU at batch 8 with quantized weights: 14.5
    ms a step plus 3.4 ms a token, measured), a draft token pays only if it is kept with
    probability over ``b`` divided by the plain cost of a token, ``(a + n b) / n`` for
    ``n`` decodes.
    """

    def __init__(self, decay: float = 0.05) -> None:
        self.decay = decay
        self.n = 0.0
        self.sx = self.sy = self.sxx = self.sxy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        keep = 1.0 - self.decay
        self.n = keep * self.n + 1.0
        self.sx = keep * self.sx + tokens
        self.sy = keep * self.sy + seconds
        self.sxx = keep * self.sxx + tokens * tokens
        self.sxy = keep * self.sxy + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None until the steps seen vary enough in size to tell."""
        if self.n < 4:
            return None
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mean_x * mean_x
        if var < 1.0:
            return None
        b = (self.sxy / self.n - mean_x * mean_y) / var
        return max(mean_y - b * mean_x, 0.0), max(b, 0.0)

    def worth(self, acceptance: float, decodes: int) -> bool:
        """Whether drafting pays for a sequence whose drafts are kept at ``acceptance``,
        in a step of ``decodes`` decodes."""
        fitted = self.fit()
        if fitted is None:
            return True
        a, b = fitted
        return acceptance * (a + decodes * b) / decodes > b
