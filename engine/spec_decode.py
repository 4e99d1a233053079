"""Speculative decoding by prompt lookup (vLLM's ``ngram`` method): drafts without a second
model.

A sequence's last ``n`` tokens (``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``) are looked up in its own prompt and output; the tokens that followed
their most recent earlier occurrence are the draft. Outputs that repeat their input (code
edits, summaries, extraction, answers quoting a document) find long drafts; others find
none and decode as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ringserve.engine.config import json_object
from ringserve.engine.errors import InvalidRequestError
from ringserve.engine.sequence import Sequence

MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config``: ``{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": 4, "prompt_lookup_min": 2}``, plus ours: ``"cost_gate": false``
    drafts whenever the lookup finds a draft, without `StepCost`'s check that it pays (its
    estimate is learned from measured step times, so what it drafts moves with the
    machine's load: benchmarks of acceptance and tests that count drafts turn it off)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    cost_gate: bool = True

    def __post_init__(self) -> None:
        checks = [
            ("method", self.method == "ngram", "must be 'ngram' (no draft models here)"),
            ("num_speculative_tokens", 1 <= self.num_speculative_tokens
             <= MAX_SPECULATIVE_TOKENS, f"must be in [1, {MAX_SPECULATIVE_TOKENS}]"),
            ("prompt_lookup_min", self.prompt_lookup_min >= 1, "must be >= 1"),
            ("prompt_lookup_max", self.prompt_lookup_max >= self.prompt_lookup_min,
             "must be >= prompt_lookup_min"),
            ("cost_gate", isinstance(self.cost_gate, bool), "must be true or false"),
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
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                 "cost_gate"}
        return cls(**json_object(value, "speculative_config", known))


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
    """What a step costs, learned as the engine runs: ``t = a + b * tokens + c * rows``
    fitted to recent steps (exponentially weighted least squares), ``rows`` counting the
    speculative decodes (a verification row takes the attention path of a short chunk,
    which costs more than a decode's).

    On a memory-bound device a step's cost barely grows with its tokens, and every likely
    draft pays. Where it grows (this CPU at batch 8 with quantized weights: about 14.5 ms a
    step, 3.4 ms a token, 3.5 ms a verification row), ``d`` drafts pay only if the tokens
    they are expected to keep, ``acceptance * d``, each worth what a token costs plainly,
    ``(a + n b) / n`` for ``n`` decodes, outweigh ``c + b d``.
    """

    def __init__(self, decay: float = 0.05) -> None:
        self.decay = decay
        self.gram = np.zeros((3, 3))  # sums of x x^T, x = (1, tokens, rows)
        self.moment = np.zeros(3)  # sums of x t
        self._fitted: tuple[float, float, float] | None = None
        self._stale = True  # fitted once per step, not once per drafting sequence

    def observe(self, tokens: int, rows: int, seconds: float) -> None:
        x = np.array([1.0, tokens, rows])
        self.gram = (1.0 - self.decay) * self.gram + np.outer(x, x)
        self.moment = (1.0 - self.decay) * self.moment + x * seconds
        self._stale = True

    def fit(self) -> tuple[float, float, float] | None:
        """(a, b, c), or None until the steps seen vary enough to tell them apart."""
        if self._stale:
            self._stale = False
            self._fitted = None
            if self.gram[0, 0] >= 4 and np.linalg.cond(self.gram) <= 1e8:
                a, b, c = np.linalg.solve(self.gram, self.moment)
                self._fitted = max(float(a), 0.0), max(float(b), 0.0), max(float(c), 0.0)
        return self._fitted

    def worth(self, acceptance: float, decodes: int, drafts: int) -> bool:
        """Whether ``drafts`` drafts pay for a sequence whose drafts are kept at
        ``acceptance``, in a step of ``decodes`` decodes."""
        fitted = self.fit()
        if fitted is None:
            return True
        a, b, c = fitted
        return acceptance * drafts * (a + decodes * b) / decodes > c + b * drafts
