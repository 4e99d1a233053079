"""Long prompts arriving while streams decode: the streams' TPOT, the arrivals' TTFT.

Eight requests decode (32-token prompts, 256 tokens each, greedy) while a request with a
long prompt (1024 tokens, 4 output tokens) arrives every 16 steps. Every step that runs
while the eight decode is one token of theirs: its duration is their time per output
token. Reported per engine setting, in the same run, settings interleaved: TPOT p50 / p90
/ p99 / max over those steps, and the arrivals' TTFT (arrival to first token) mean and max.

    .venv/bin/python benchmarks/prefill_interference.py                    # gemma-3-270m
    .venv/bin/python benchmarks/prefill_interference.py --slowdown 2,1.5 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ringserve.engine import LLM, SamplingParams  # noqa: E402
from tests.tiny_models import random_tokens  # noqa: E402


def run(llm: LLM, *, streams: int, stream_tokens: int, long_prompt: int, every: int,
        vocab: int, seed: int) -> dict[str, Any]:
    engine = llm.engine
    decode = SamplingParams(temperature=0.0, max_tokens=stream_tokens, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(streams):
        engine.add_request(f"s{i}", {"prompt_token_ids": random_tokens(32, seed + i, vocab)},
                           decode)
    while any(s.num_output_tokens == 0 for r in engine.requests.values() for s in r.seqs):
        engine.step()  # every stream past its prefill
    steps: list[float] = []
    arrivals: dict[str, float] = {}
    ttft: list[float] = []
    n = 0
    while any(r.request_id.startswith("s") for r in engine.requests.values()):
        if n % every == 0:
            rid = f"long{n}"
            arrivals[rid] = time.perf_counter()
            engine.add_request(rid, {"prompt_token_ids": random_tokens(
                long_prompt, seed + 1000 + n, vocab)}, short)
        streaming = sum(r.request_id.startswith("s") for r in engine.requests.values())
        start = time.perf_counter()
        engine.step()
        now = time.perf_counter()
        if streaming == streams:
            steps.append(now - start)
        for rid in list(arrivals):
            request = engine.requests.get(rid)
            if request is None or request.seqs[0].num_output_tokens > 0:
                ttft.append(now - arrivals.pop(rid))
        n += 1
    while engine.has_unfinished:
        engine.step()
    q = statistics.quantiles(steps, n=100)
    return {"steps": len(steps), "tpot_p50": statistics.median(steps), "tpot_p90": q[89],
            "tpot_p99": q[98], "tpot_max": max(steps), "ttft_mean": statistics.mean(ttft),
            "ttft_max": max(ttft), "arrivals": len(ttft)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--slowdown", default="2", help="comma-separated settings beside off")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-tokens", type=int, default=256)
    parser.add_argument("--long-prompt", type=int, default=1024)
    parser.add_argument("--every", type=int, default=16)
    args = parser.parse_args()
    settings: list[float | None] = [None, *(float(s) for s in args.slowdown.split(","))]
    llms = {s: LLM(args.model, max_model_len=2048, max_num_seqs=16,
                   max_prefill_slowdown=s) for s in settings}
    vocab = next(iter(llms.values())).engine.model.config.vocab_size
    results: dict[float | None, list[dict[str, Any]]] = {s: [] for s in settings}
    for r in range(args.rounds):
        for s in settings:
            results[s].append(run(llms[s], streams=args.streams, stream_tokens=args.stream_tokens,
                                  long_prompt=args.long_prompt, every=args.every, vocab=vocab,
                                  seed=r))
    print(f"{args.model}: {args.streams} streams x {args.stream_tokens} tokens, a "
          f"{args.long_prompt}-token prompt every {args.every} steps; ms, median of "
          f"{args.rounds} round(s)")
    print("| max_prefill_slowdown | TPOT p50 | p90 | p99 | max | arrivals' TTFT mean | max |")
    print("|---|---|---|---|---|---|---|")
    for s in settings:
        def med(key: str, s: float | None = s) -> float:
            return statistics.median(x[key] for x in results[s]) * 1e3
        print(f"| {'off' if s is None else s} | {med('tpot_p50'):.1f} | {med('tpot_p90'):.1f} "
              f"| {med('tpot_p99'):.1f} | {med('tpot_max'):.1f} | {med('ttft_mean'):.0f} "
              f"| {med('ttft_max'):.0f} |")


if __name__ == "__main__":
    main()
