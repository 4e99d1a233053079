"""What prompt chunks add to a step, learned from this machine's steps (`--max-prefill-slowdown`).

Two fits, both exponentially weighted least squares over recent steps:

- a decode-only step: a recency-weighted mean of the steps that fed no prompt (a decode
  step's time barely moves with its batch on a CPU, and a slope fitted from batches of 8
  and 9 decodes is mostly noise: it once predicted 61 ms for a 33 ms step);
- what the chunks add beside the decodes: ``t - (a + b * d) = q * k + p * n + r * n * c``
  for ``k`` chunks of ``n`` tokens in all, read against ``c`` positions of context each
  (``n * c`` summed over the chunks: a chunk's attention grows with what it reads).

The two are fitted apart because a step with decodes and a chunk cannot say which part of
its time is whose: with the same decodes every step, a one-fit model cannot tell the
decodes' share from the chunk's fixed cost. So a step now and then feeds no prompt
(`wants_decode_step`): at first, and again every `DECODE_REFRESH` steps under a steady
stream of prompts. `Scheduler.prefill_budget` asks `chunk_tokens`
how many prompt tokens fit in what a step may spend beyond its decode-only time.
"""

from __future__ import annotations

import numpy as np

DECODE_REFRESH = 64  # steps with prompt chunks between two measured decode-only steps


class _Fit:
    """``t = x . w`` by exponentially weighted least squares over the features seen to vary."""

    def __init__(self, features: int, decay: float, min_seen: float = 4.0) -> None:
        self.decay = decay
        self.min_seen = min_seen  # weighted observations before a solve
        self.gram = np.zeros((features, features))
        self.moment = np.zeros(features)
        self.seen = 0.0  # weighted count of observations
        self._solved: np.ndarray | None = None
        self._stale = True

    def observe(self, x: list[float], t: float) -> None:
        v = np.array(x)
        self.gram = (1.0 - self.decay) * self.gram + np.outer(v, v)
        self.moment = (1.0 - self.decay) * self.moment + v * t
        self.seen = (1.0 - self.decay) * self.seen + 1.0
        self._stale = True

    def solve(self) -> np.ndarray | None:
        """The weights (0 for a feature never seen), or None until the first is determined.

        Features that have not varied apart from the earlier ones (every step with the same
        decodes, say) are left out, last first: the earlier ones then carry their share."""
        if self._stale:
            self._stale = False
            self._solved = None
            active = [i for i in range(len(self.moment)) if self.gram[i, i] > 0]
            while active and self.seen >= self.min_seen:
                gram = self.gram[np.ix_(active, active)]
                if np.linalg.cond(gram) <= 1e6:
                    w = np.zeros(len(self.moment))
                    w[active] = np.maximum(np.linalg.solve(gram, self.moment[active]), 0.0)
                    self._solved = w
                    break
                active.pop()
        return self._solved


class PrefillCost:
    """A decode-only step's time and the cost of prompt chunks beside it (module doc)."""

    def __init__(self, decay: float = 0.05) -> None:
        # NOTE: a faster decay: decode-only steps are rare under a stream of prompts
        self.decode = _Fit(1, max(decay, 0.2), min_seen=3.0)  # (1,): five steps
        self.chunks = _Fit(3, decay)  # (k, n, n * c / 1000)
        self.since_decode_only = 0  # steps since the last one without prompt chunks

    def wants_decode_step(self) -> bool:
        """Whether the next step with decodes should feed no prompt: the decode-only time
        is not known yet, or was last measured `DECODE_REFRESH` steps ago (under a steady
        stream of prompts no step would measure it otherwise)."""
        return self.decode.solve() is None or self.since_decode_only >= DECODE_REFRESH

    def observe(self, decode_tokens: int, chunks: list[tuple[int, int]], seconds: float) -> None:
        """One step: ``decode_tokens`` fed by decodes, and its prompt chunks as (tokens,
        context) pairs."""
        if not chunks:
            self.since_decode_only = 0
            if decode_tokens:
                self.decode.observe([1.0], seconds)
            return
        self.since_decode_only += 1
        base = self.decode_time(decode_tokens)
        if base is None:
            return  # nothing to measure the chunks' share against yet
        self.chunks.observe([len(chunks), sum(n for n, _ in chunks),
                             sum(n * c for n, c in chunks) / 1000.0], seconds - base)

    def decode_time(self, decode_tokens: int) -> float | None:
        """Predicted seconds of a step of ``decode_tokens`` decode tokens and no prompt
        (the recent decode-only steps' mean; the count only says whether there are any)."""
        w = self.decode.solve()
        return None if w is None or decode_tokens == 0 else float(w[0])

    def chunk_seconds(self, tokens: int, context: int) -> float:
        """Predicted seconds one chunk of ``tokens`` at ``context`` adds to a step."""
        w = self.chunks.solve()
        if w is None:
            return 0.0
        return float(w[0] + w[1] * tokens + w[2] * tokens * context / 1000.0)

    def chunk_tokens(self, seconds: float, context: int) -> int | None:
        """Prompt tokens of one chunk at ``context`` that add at most ``seconds`` to a step
        (0 if not even its fixed cost fits); None until learned."""
        w = self.chunks.solve()
        if w is None:
            return None
        q, p, r = (float(x) for x in w)
        per_token = p + r * context / 1000.0
        if seconds < q:
            return 0
        if per_token <= 0:
            return 1 << 30  # tokens that cost nothing measurable: any number fits
        return int((seconds - q) / per_token + 1e-9)
