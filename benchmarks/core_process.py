"""The served decode step against the offline one, with the engine core in its own process
and in a thread of the API process (issue 25's goal: served within 1.05x of offline).

    python benchmarks/core_process.py                          # gemma-3-270m, conc 8 and 32
    python benchmarks/core_process.py --concurrency 8 --output-len 64

For each concurrency ``c``: ``2c`` requests of ``--input-len`` random ids and
``--output-len`` forced tokens, ``c`` at a time, offline (`LLMEngine.step` in a loop: no
HTTP, no process boundary) and through a `ringserve serve` for each ``--engine-core``
(`serve_bench.py`'s streaming client, ``c`` in flight). It prints each one's TPOT (median
over requests) and the served TPOT over the offline one, and output tokens a second.
Run it alone on the machine; the ratios are within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import serve_bench  # noqa: E402


class Offline:
    """The served workload without a server: requests through `LLMEngine.step` in a loop,
    at most ``c`` running (the scheduler's max_num_seqs, as the client's c in flight)."""

    def __init__(self, model: str, max_len: int, max_seqs: int) -> None:
        from ringserve.engine import LLM

        # NOTE: packed_rows="auto" and 512-token steps, as `ringserve serve` defaults to on
        # the CPU (the offline LLM's defaults are off and 2048): the same step either side.
        self.engine = LLM(model=model, kv_cache_memory="2GiB", max_model_len=max_len,
                          max_num_seqs=max_seqs, packed_rows="auto",
                          max_num_batched_tokens=512).engine
        self.ids = itertools.count()

    def run(self, concurrency: int, input_len: int, output_len: int,
            seed: int) -> tuple[float, float]:
        """(TPOT median over ``2c`` requests in seconds, output tokens a second)."""
        from ringserve.engine import SamplingParams

        engine = self.engine
        engine.scheduler.max_num_seqs = concurrency
        rng = random.Random(seed)
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        requests = [engine.add_request(f"o{next(self.ids)}", {"prompt_token_ids": [
            rng.randint(100, 5000) for _ in range(input_len)]}, params)
            for _ in range(2 * concurrency)]
        while engine.has_unfinished:
            engine.step()
        duration = time.perf_counter() - start
        tpots = [(s.last_token_time - s.first_token_time) / (s.num_output_tokens - 1)
                 for s in (r.seqs[0] for r in requests)]
        return statistics.median(tpots), 2 * concurrency * output_len / duration


@contextlib.contextmanager
def server(model: str, mode: str, max_num_seqs: int) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "ringserve.server.cli", "serve", "--model", model,
           "--port", str(port), "--log-level", "warning", "--engine-core", mode,
           "--max-num-seqs", str(max_num_seqs)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the {mode} server exited with {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def served(url: str, concurrency: int, input_len: int, output_len: int,
           seed: int) -> tuple[float, float]:
    """(TPOT median over requests in seconds, output tokens a second)."""
    args = argparse.Namespace(url=url, model=None, num_prompts=2 * concurrency,
                              concurrency=concurrency, input_len=input_len,
                              output_len=output_len, vocab_low=100, vocab_high=5000, seed=seed,
                              temperature=0.0, timeout=900.0)
    asyncio.run(serve_bench.run(warm_up(args, seed)))
    results, duration = asyncio.run(serve_bench.run(args))
    ok = [r for r in results if r.ok and r.output_tokens > 1]
    tpot = statistics.median((r.latency - r.ttft) / (r.output_tokens - 1) for r in ok)
    return tpot, sum(r.output_tokens for r in ok) / duration


def warm_up(args: argparse.Namespace, seed: int) -> argparse.Namespace:
    """``c`` short requests before a load, with prompts of their own.

    NOTE: the warm-up once drew its prompts from the load's own seed, so the first ``c``
    prompts of the load hit the prefix cache and their prefills (half the load's) were
    skipped: served TPOT at 32 came out ~15% under a load of fresh prompts."""
    return argparse.Namespace(**{**vars(args), "num_prompts": args.concurrency,
                                 "output_len": 8, "seed": 1_000_000 + seed})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds of offline, process, thread (interleaved: the machine's "
                    "noise falls on all three); medians reported")
    args = ap.parse_args()
    top = max(max(args.concurrency), 8)
    runs: dict[tuple[str, int], list[tuple[float, float]]] = {}
    base = Offline(args.model, args.input_len + args.output_len + 8, top)
    # Every load draws prompts no earlier load has sent (prefix caching is on, as served):
    # a seed for each load, never reused.
    seeds = itertools.count(1)
    base.run(top, args.input_len, 8, 1_000_000)  # the offline engine's warm-up
    with server(args.model, "process", top) as process_url, \
            server(args.model, "thread", top) as thread_url:
        for _ in range(args.repeats):
            for c in args.concurrency:
                runs.setdefault(("offline", c), []).append(
                    base.run(c, args.input_len, args.output_len, next(seeds)))
                for mode, url in (("process", process_url), ("thread", thread_url)):
                    runs.setdefault((mode, c), []).append(
                        served(url, c, args.input_len, args.output_len, next(seeds)))
    print(f"\n{args.model}, {os.cpu_count()} CPUs; input {args.input_len}, output "
          f"{args.output_len}, 2c requests c at a time, {args.repeats} interleaved rounds; "
          "TPOT median over requests (x: over offline), output tok/s; medians of rounds")
    print("| conc | offline TPOT, tok/s | core process TPOT (x), tok/s | "
          "thread TPOT (x), tok/s |")
    print("|---|---|---|---|")
    for c in args.concurrency:
        cells = []
        off = statistics.median(t for t, _ in runs[("offline", c)])
        for mode in ("offline", "process", "thread"):
            tpot = statistics.median(t for t, _ in runs[(mode, c)])
            tps = statistics.median(x for _, x in runs[(mode, c)])
            ratio = "" if mode == "offline" else f" ({tpot / off:.2f}x)"
            cells.append(f"{tpot * 1e3:.1f} ms{ratio}, {tps:.1f}")
        print(f"| {c} | " + " | ".join(cells) + " |")
    print("rounds (TPOT ms):", {f"{m}@{c}": [round(t * 1e3, 1) for t, _ in v]
                                for (m, c), v in runs.items()})


if __name__ == "__main__":
    main()
