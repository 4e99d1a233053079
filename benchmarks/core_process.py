"""The served decode step against the offline one, with the engine core in its own process
and in a thread of the API process (issue 25's goal: served within 1.05x of offline).

    python benchmarks/core_process.py                          # gemma-3-270m, conc 8 and 32
    python benchmarks/core_process.py --concurrency 8 --output-len 64

For each concurrency ``c``: the offline decode step at batch ``c`` (`LLM`, no HTTP, the
median of ``--steps`` steps after the prompts are in), then a `ringserve serve` for each
``--engine-core`` with ``2c`` streaming requests, ``c`` in flight (`serve_bench.py`'s
client). It prints each server's TPOT (median over requests) over the offline step, and
output tokens a second. Run it alone on the machine; the ratios are within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
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


def offline_step(model: str, batch: int, context: int, steps: int) -> float:
    """Median seconds of a decode step at ``batch`` sequences of ``context`` tokens."""
    from ringserve.engine import LLM, SamplingParams

    total = context + steps + 16
    llm = LLM(model=model, kv_cache_memory="2GiB", max_model_len=max(total, 256),
              max_num_seqs=batch)
    engine = llm.engine
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=total - context, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        ids = [(7919 * j + 104729 * i) % (vocab - 10) + 5 for j in range(context)]
        engine.add_request(f"offline-{i}", {"prompt_token_ids": ids}, params)
    while engine.scheduler.waiting or any(
            s.num_computed < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


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


def served(url: str, concurrency: int, input_len: int, output_len: int) -> tuple[float, float]:
    """(TPOT median over requests in seconds, output tokens a second)."""
    args = argparse.Namespace(url=url, model=None, num_prompts=2 * concurrency,
                              concurrency=concurrency, input_len=input_len,
                              output_len=output_len, vocab_low=100, vocab_high=5000, seed=0,
                              temperature=0.0, timeout=900.0)
    warm = argparse.Namespace(**{**vars(args), "num_prompts": concurrency, "output_len": 8})
    asyncio.run(serve_bench.run(warm))
    results, duration = asyncio.run(serve_bench.run(args))
    ok = [r for r in results if r.ok and r.output_tokens > 1]
    tpot = statistics.median((r.latency - r.ttft) / (r.output_tokens - 1) for r in ok)
    return tpot, sum(r.output_tokens for r in ok) / duration


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    rows = []
    for c in args.concurrency:
        step = offline_step(args.model, c, args.input_len + args.output_len // 2, args.steps)
        row = {"c": c, "offline": step}
        for mode in ("process", "thread"):
            with server(args.model, mode, max(c, 8)) as url:
                row[mode] = served(url, c, args.input_len, args.output_len)
        rows.append(row)
    print(f"\n{args.model}, {os.cpu_count()} CPUs; input {args.input_len}, output "
          f"{args.output_len}; TPOT median over requests / offline step at the same batch")
    print("| conc | offline step | process TPOT (x) tok/s | thread TPOT (x) tok/s |")
    print("|---|---|---|---|")
    for row in rows:
        cells = [f"{row['offline'] * 1e3:.1f} ms"]
        for mode in ("process", "thread"):
            tpot, tps = row[mode]
            cells.append(f"{tpot * 1e3:.1f} ms ({tpot / row['offline']:.2f}x) {tps:.1f}")
        print(f"| {row['c']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
