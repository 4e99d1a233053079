"""Multi-turn chat under memory pressure (issue 26): prefix hit rate and TTFT per turn.

Many sessions, several turns each, against a KV pool smaller than their working set:
``--sessions`` conversations run side by side, each turn one request whose prompt is the
session's previous prompt plus an "answer" and a "user" message (random token ids, as in
`benchmarks/prefix_cache.py`), ``ignore_eos``, streamed. After every turn the hit rate of
that turn is read from ``/metrics`` (the delta of ``ringserve:prefix_cache_hits_total``
over ``..._queries_total``, in tokens) and its TTFT p50 / p99 from the streams. One server
with prefix caching on, one with it off, same pool (``--kv-cache-memory``).

    .venv/bin/python benchmarks/multiturn.py                      # ~minutes on 2 cores
    .venv/bin/python benchmarks/multiturn.py --sessions 16 --turns 6 --kv-cache-memory 32MiB

vLLM is not run here (its CPU build lives in `make bench-peers`' venv); the same workload
against it is the comparison issue 26 asks for. Writes benchmarks/results/multiturn.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

import prefix_cache as pc
import serve_bench
import servers


async def sessions(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every session's turns, the sessions of one turn sent at once; per turn its stats."""
    prompts = [pc.random_ids(10_000 + s, args.first_turn) for s in range(args.sessions)]
    rows = []
    limits = httpx.Limits(max_connections=args.sessions + 4)
    async with httpx.AsyncClient(timeout=pc.REQUEST_TIMEOUT, limits=limits) as client:
        await serve_bench.one_request(client, url, pc.MODEL, pc.random_ids(1, 16), 4)
        for turn in range(args.turns):
            before = await pc.scrape(client, url)
            start = time.perf_counter()
            results = await asyncio.gather(*(serve_bench.one_request(
                client, url, pc.MODEL, p, args.output) for p in prompts))
            wall = time.perf_counter() - start
            after = await pc.scrape(client, url)
            ttft = [1000 * r.ttft for r in results if r.ok]
            rows.append({"turn": turn, "prompt_tokens": len(prompts[0]),
                         "ok": len(ttft), "wall_s": wall,
                         "ttft_p50_ms": statistics.median(ttft) if ttft else 0.0,
                         "ttft_p99_ms": pc.percentile(ttft, 0.99),
                         **pc.cache_stats(before, after)})
            pc.log(f"turn {turn}: {rows[-1]['hit_rate']:.2f} hit, "
                   f"TTFT p50 {rows[-1]['ttft_p50_ms']:.0f} ms")
            prompts = [p + pc.random_ids(20_000 + 100 * s + turn, args.answer)
                       + pc.random_ids(30_000 + 100 * s + turn, args.user)
                       for s, p in enumerate(prompts)]
    return rows


def run(setting: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    argv = pc.server_argv(setting, f"--kv-cache-memory {args.kv_cache_memory} "
                          f"--max-num-seqs {args.sessions} {args.server_args}", True)
    row = servers.Row(name=f"ringserve caching {setting}", kind="ringserve", weights="auto",
                      command=lambda: argv, start_timeout=pc.START_TIMEOUT)
    with servers.Server(row):
        return asyncio.run(sessions(servers.URL, args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--first-turn", type=int, default=400)
    parser.add_argument("--answer", type=int, default=64)
    parser.add_argument("--user", type=int, default=48)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--kv-cache-memory", default="48MiB",
                        help="smaller than the sessions' working set: evictions happen")
    parser.add_argument("--server-args", default="")
    args = parser.parse_args()
    runs = {s: run(s, args) for s in ("on", "off")}
    lines = [f"`benchmarks/multiturn.py`: {args.sessions} sessions x {args.turns} turns, "
             f"turn 0 {args.first_turn} tokens, +{args.answer + args.user} a turn, "
             f"{args.output} output tokens, KV pool {args.kv_cache_memory}; "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             "| turn | prompt tokens | hit rate (on) | TTFT p50 / p99 ms (on) | "
             "TTFT p50 / p99 ms (off) | p50 off / on |", "|---|---|---|---|---|---|"]
    for on, off in zip(runs["on"], runs["off"], strict=True):
        ratio = off["ttft_p50_ms"] / on["ttft_p50_ms"] if on["ttft_p50_ms"] else 0.0
        lines.append(f"| {on['turn']} | {on['prompt_tokens']} | {on['hit_rate']:.2f} | "
                     f"{on['ttft_p50_ms']:.0f} / {on['ttft_p99_ms']:.0f} | "
                     f"{off['ttft_p50_ms']:.0f} / {off['ttft_p99_ms']:.0f} | {ratio:.2f}x |")
    misses = [r["read_misses"] for rs in runs.values() for r in rs]
    lines += ["", f"read misses: {max(m or 0 for m in misses):.0f}"]
    text = "\n".join(lines)
    print(text)
    (pc.RESULTS / "multiturn.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
