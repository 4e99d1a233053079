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

    .venv/bin/python benchmarks/multiturn.py --vllm               # and vLLM's CPU build

``--vllm`` runs the same sessions against vLLM's CPU build (`make bench-peers`' venv,
`benchmarks/peers/setup_vllm.py`) with the same KV bytes (``--kv-cache-memory-bytes``),
``--max-num-seqs`` and prefix caching on (its default), its hit rate read from
``vllm:prefix_cache_hits_total`` over ``vllm:prefix_cache_queries_total`` (tokens, as ours).
Writes benchmarks/results/multiturn.md.
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
import setup_vllm
from model_files import hf_folder

VLLM_SERIES = {pc.HITS: "vllm:prefix_cache_hits_total",
               pc.QUERIES: "vllm:prefix_cache_queries_total"}


async def scrape(client: httpx.AsyncClient, url: str, vllm: bool) -> dict[str, float | None]:
    """Our three series, under vLLM's names for vLLM (it has no read-miss counter)."""
    if not vllm:
        return await pc.scrape(client, url)
    r = await client.get(f"{url}/metrics")
    r.raise_for_status()
    out = {ours: pc.parse_counter(r.text, theirs) for ours, theirs in VLLM_SERIES.items()}
    return {**out, pc.READ_MISSES: None}


async def sessions(url: str, args: argparse.Namespace, vllm: bool = False
                   ) -> list[dict[str, Any]]:
    """Every session's turns, the sessions of one turn sent at once; per turn its stats."""
    prompts = [pc.random_ids(10_000 + s, args.first_turn) for s in range(args.sessions)]
    rows = []
    limits = httpx.Limits(max_connections=args.sessions + 4)
    async with httpx.AsyncClient(timeout=pc.REQUEST_TIMEOUT, limits=limits) as client:
        await serve_bench.one_request(client, url, pc.MODEL, pc.random_ids(1, 16), 4)
        for turn in range(args.turns):
            before = await scrape(client, url, vllm)
            start = time.perf_counter()
            results = await asyncio.gather(*(serve_bench.one_request(
                client, url, pc.MODEL, p, args.output) for p in prompts))
            wall = time.perf_counter() - start
            after = await scrape(client, url, vllm)
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
    """``on`` / ``off``: ringserve with prefix caching on / off; ``lpm``: on, with
    ``--scheduling-policy lpm``; ``vllm``: vLLM's CPU build (caching on)."""
    if setting == "vllm":
        return run_vllm(args)
    policy = "--scheduling-policy lpm" if setting == "lpm" else ""
    argv = pc.server_argv("off" if setting == "off" else "on",
                          f"--kv-cache-memory {args.kv_cache_memory} --max-num-seqs "
                          f"{args.sessions} {policy} {args.server_args}", True)
    row = servers.Row(name=f"ringserve caching {setting}", kind="ringserve", weights="auto",
                      command=lambda: argv, start_timeout=pc.START_TIMEOUT)
    with servers.Server(row):
        return asyncio.run(sessions(servers.URL, args))


def run_vllm(args: argparse.Namespace) -> list[dict[str, Any]]:
    from ringserve.block_manager.budget import parse_size

    base = servers.vllm_row(hf_folder)
    extra = ["--kv-cache-memory-bytes", str(parse_size(args.kv_cache_memory)),
             "--max-num-seqs", str(args.sessions),
             # its default 4096 needs more than such a pool (it checks one sequence fits)
             "--max-model-len", str(args.first_turn + args.turns * (args.answer + args.user)
                                    + args.output + 64)]
    # NOTE: VLLM_CPU_KVCACHE_SPACE (GiB) would override the bytes: left out here.
    row = servers.Row(name="vLLM caching on", kind="vllm", weights="bfloat16",
                      command=lambda: [*base.command(), *extra],
                      env=lambda: {k: v for k, v in setup_vllm.server_env().items()
                                   if k != "VLLM_CPU_KVCACHE_SPACE"},
                      start_timeout=base.start_timeout)
    with servers.Server(row):
        return asyncio.run(sessions(servers.URL, args, vllm=True))


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
    parser.add_argument("--vllm", action="store_true", help="vLLM's CPU build too")
    args = parser.parse_args()
    # NOTE: vLLM first: a failed start of its server ends the run before ours take minutes
    settings = [*(["vllm"] if args.vllm else []), "on", "lpm", "off"]
    runs = {s: run(s, args) for s in settings}
    names = {"on": "caching on", "lpm": "on, lpm", "off": "caching off", "vllm": "vLLM"}
    lines = [f"`benchmarks/multiturn.py`: {args.sessions} sessions x {args.turns} turns, "
             f"turn 0 {args.first_turn} tokens, +{args.answer + args.user} a turn, "
             f"{args.output} output tokens, KV pool {args.kv_cache_memory}; "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             "Hit rate (prompt tokens found cached) and TTFT p50 / p99 ms, per turn:", "",
             "| turn | prompt tokens | " + " | ".join(names[s] for s in settings)
             + " | off / on p50 | off / lpm p50 |",
             "|---|---|" + "---|" * (len(settings) + 2)]
    for t in range(args.turns):
        cells = []
        for s_ in settings:
            r = runs[s_][t]
            cells.append(f"{r['hit_rate']:.2f}, {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}")
        off = runs["off"][t]["ttft_p50_ms"]
        ratios = [f"{off / runs[k][t]['ttft_p50_ms']:.2f}x" if runs[k][t]["ttft_p50_ms"]
                  else "n/a" for k in ("on", "lpm")]
        lines.append(f"| {t} | {runs['on'][t]['prompt_tokens']} | " + " | ".join(cells)
                     + " | " + " | ".join(ratios) + " |")
    misses = [r["read_misses"] for k, rs in runs.items() if k != "vllm" for r in rs]
    lines += ["", f"read misses: {max(m or 0 for m in misses):.0f}"]
    text = "\n".join(lines)
    print(text)
    (pc.RESULTS / "multiturn.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
