"""One load at one concurrency, through `benchmarks/serve_bench.py`, after a warm-up."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import serve_bench
from paths import MODEL

INPUT_LEN = 128
OUTPUT_LEN = 128
TEMPERATURE = 0.0  # greedy unless run.py --temperature says otherwise


@dataclass(frozen=True)
class Measurement:
    concurrency: int
    prompts: int
    ok: int
    output_tok_s: float
    tpot_ms: float  # median time per output token after the first
    ttft_p50_ms: float
    duration_s: float
    error: str = ""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _args(url: str, concurrency: int, prompts: int, input_len: int, output_len: int,
          seed: int) -> argparse.Namespace:
    return argparse.Namespace(url=url, model=MODEL, num_prompts=prompts,
                              concurrency=concurrency, input_len=input_len,
                              output_len=output_len, vocab_low=100, vocab_high=5000,
                              seed=seed, timeout=900.0, temperature=TEMPERATURE)


# NOTE: every load and warm-up on one server draws prompts none before it sent: with one
# seed for all, each concurrency's first prompts were the previous load's, hit the prefix
# cache (ringserve's and vLLM's are on by default) and skipped their prefills.
def seed_of(concurrency: int, attempt: int, warm: bool = False) -> int:
    """The prompts' seed of a load (or its warm-up) at `concurrency`, measured for the
    `attempt`-th time (from 0) on one server."""
    return (500_000 if warm else 0) + 1000 * attempt + concurrency


def warm_up(url: str, concurrency: int, attempt: int = 0) -> None:
    """`concurrency` short requests at once, so the batch shapes of the load have been seen;
    raises when none of them succeeds."""
    seed = seed_of(concurrency, attempt, warm=True)
    with contextlib.redirect_stdout(io.StringIO()):
        results, _ = asyncio.run(serve_bench.run(_args(url, concurrency, concurrency, 16, 8,
                                                       seed=seed)))
    if not any(r.ok for r in results):
        raise RuntimeError(f"warm-up failed: {results[0].error}")


def measure(url: str, concurrency: int, prompts: int, attempt: int = 0) -> Measurement:
    results, duration = asyncio.run(serve_bench.run(_args(
        url, concurrency, prompts, INPUT_LEN, OUTPUT_LEN, seed=seed_of(concurrency, attempt))))
    ok = [r for r in results if r.ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = [r.error for r in results if not r.ok]
    return Measurement(
        concurrency=concurrency, prompts=prompts, ok=len(ok),
        output_tok_s=sum(r.output_tokens for r in ok) / duration,
        tpot_ms=1000 * statistics.median(tpot) if tpot else 0.0,
        ttft_p50_ms=1000 * statistics.median([r.ttft for r in ok]) if ok else 0.0,
        duration_s=duration, error=errors[0] if errors else "")
