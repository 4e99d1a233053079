"""Automatic prefix caching on gemma-3-270m: TTFT, throughput and hit rate, caching on and off.

Starts a ringserve server per setting (``--enable-prefix-caching`` and
``--no-enable-prefix-caching``) and runs two workloads against it over ``/v1/completions``
(token-id prompts, ``ignore_eos``, streamed, through ``serve_bench.one_request``):

- (a) shared system prompt: 32 requests at once, each a common 2,000-token prefix and its own
  64-token question, 64 output tokens each (after one warm-up request with another prompt).
- (b) conversation: 10 turns one at a time, 32 output tokens each; turn 0 is 500 tokens and
  every turn's prompt is the last one plus a 64-token "answer" and a 64-token "user" message
  (random ids standing for the model's answer and the user's reply).

After each workload it reads ``/metrics``: the hit rate is the workload's delta of
``ringserve:prefix_cache_hits_total`` over ``ringserve:prefix_cache_queries_total`` (tokens),
and ``ringserve:kv_read_misses_total`` must stay 0. Prints a markdown table, the off/on
ratios and whether the goals are met (TTFT p50 of (a) >= 5x lower with caching, total
throughput of (a) >= 2x, zero read misses).

    .venv/bin/python benchmarks/prefix_cache.py                     # both settings, ~minutes
    .venv/bin/python benchmarks/prefix_cache.py --only on
    .venv/bin/python benchmarks/prefix_cache.py --quick             # smoke test: 8 requests
    .venv/bin/python benchmarks/prefix_cache.py --server-args "--max-num-seqs 32"

Writes benchmarks/results/prefix_cache.{md,json} (a ``--quick`` run writes
.cache/peers/prefix_cache-quick.{md,json} instead, leaving the full results alone).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

import serve_bench
import servers

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
CACHE = ROOT / ".cache" / "peers"
RESULTS = BENCH / "results"
MODEL = "gemma-3-270m"
VOCAB = (1000, 200_000)  # ordinary tokens of gemma-3's 262,144: no special or control ids
START_TIMEOUT = 600.0
REQUEST_TIMEOUT = 1800.0
SETTINGS = ("on", "off")
HITS = "ringserve:prefix_cache_hits_total"
QUERIES = "ringserve:prefix_cache_queries_total"
READ_MISSES = "ringserve:kv_read_misses_total"
TTFT_GOAL = 5.0  # (a): TTFT p50 off / on at least this
THROUGHPUT_GOAL = 2.0  # (a): total tok/s on / off at least this


@dataclass(frozen=True)
class Config:
    """The two workloads' sizes."""

    requests: int = 32  # (a): all sent at once
    prefix_len: int = 2000  # (a): the shared "system prompt"
    question_len: int = 64  # (a): each request's own suffix
    output_len: int = 64  # (a)
    turns: int = 10  # (b)
    first_turn_len: int = 500  # (b): turn 0's prompt
    answer_len: int = 64  # (b): ids standing for the model's answer, added each turn
    user_len: int = 64  # (b): the next user message, added each turn
    turn_output_len: int = 32  # (b)


QUICK = Config(requests=8, prefix_len=1000, turns=4)


def log(message: str) -> None:
    print(f"[prefix-cache {time.strftime('%H:%M:%S')}] {message}", flush=True)


def random_ids(seed: int, n: int) -> list[int]:
    """`n` token ids drawn from `VOCAB` by a generator seeded with `seed`."""
    rng = random.Random(seed)
    return [rng.randrange(*VOCAB) for _ in range(n)]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (as serve_bench's p99), 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- the server ---------------------------------------------------------------------------


def server_argv(setting: str, extra: str, with_flag: bool) -> list[str]:
    argv = [str(ROOT / ".venv" / "bin" / "ringserve"), "serve", "--port", str(servers.PORT),
            "--served-model-name", MODEL]
    if with_flag:
        argv.append("--enable-prefix-caching" if setting == "on"
                    else "--no-enable-prefix-caching")
    return [*argv, *shlex.split(extra)]


# --- /metrics -----------------------------------------------------------------------------


def parse_counter(text: str, name: str) -> float | None:
    """The sum of `name`'s samples over its label sets, or None if the series is absent."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)", re.MULTILINE)
    values = [float(m.group(1)) for m in pattern.finditer(text)]
    return sum(values) if values else None


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float | None]:
    r = await client.get(f"{url}/metrics")
    r.raise_for_status()
    return {name: parse_counter(r.text, name) for name in (HITS, QUERIES, READ_MISSES)}


def cache_stats(before: dict[str, float | None],
                after: dict[str, float | None]) -> dict[str, Any]:
    """The workload's hit rate (0 when nothing was queried or the series is absent) and the
    read misses counted so far (None when the series is absent)."""
    hits = _delta(before[HITS], after[HITS])
    queries = _delta(before[QUERIES], after[QUERIES])
    rate = hits / queries if hits is not None and queries else 0.0
    return {"hit_rate": rate, "hit_tokens": hits, "query_tokens": queries,
            "read_misses": after[READ_MISSES]}


def _delta(before: float | None, after: float | None) -> float | None:
    if before is None or after is None:
        return None
    return after - before


# --- the workloads ------------------------------------------------------------------------


def summarize(results: list[serve_bench.Result], prompt_lens: list[int],
              wall: float) -> dict[str, Any]:
    """TTFT percentiles (ms) and throughput over the requests that succeeded."""
    ok = [(r, n) for r, n in zip(results, prompt_lens, strict=True) if r.ok]
    ttft = [1000 * r.ttft for r, _ in ok]
    out_tokens = sum(r.output_tokens for r, _ in ok)
    in_tokens = sum(n for _, n in ok)
    errors = [r.error for r in results if not r.ok]
    if errors:
        log(f"warning: {len(errors)} of {len(results)} requests failed, first: {errors[0]}")
    return {"requests": len(results), "ok": len(ok), "first_error": errors[0] if errors else "",
            "ttft_p50_ms": statistics.median(ttft) if ttft else 0.0,
            "ttft_p99_ms": percentile(ttft, 0.99),
            "ttft_mean_ms": statistics.fmean(ttft) if ttft else 0.0,
            "wall_s": wall, "prompt_tokens": in_tokens, "output_tokens": out_tokens,
            "total_tok_s": (in_tokens + out_tokens) / wall if wall else 0.0,
            "output_tok_s": out_tokens / wall if wall else 0.0}


async def shared_prefix(client: httpx.AsyncClient, url: str, cfg: Config) -> dict[str, Any]:
    """(a): `cfg.requests` requests sharing one prefix, all sent at once."""
    prefix = random_ids(0, cfg.prefix_len)
    prompts = [prefix + random_ids(1000 + i, cfg.question_len) for i in range(cfg.requests)]
    start = time.perf_counter()
    results = await asyncio.gather(*(serve_bench.one_request(client, url, MODEL, p,
                                                             cfg.output_len)
                                     for p in prompts))
    wall = time.perf_counter() - start
    return summarize(list(results), [len(p) for p in prompts], wall)


def conversation_prompts(cfg: Config) -> list[list[int]]:
    """(b)'s prompts: each the previous one plus an "answer" and a "user" message."""
    prompts = [random_ids(2000, cfg.first_turn_len)]
    for turn in range(1, cfg.turns):
        added = (random_ids(3000 + turn, cfg.answer_len)
                 + random_ids(4000 + turn, cfg.user_len))
        prompts.append(prompts[-1] + added)
    return prompts


async def conversation(client: httpx.AsyncClient, url: str, cfg: Config) -> dict[str, Any]:
    """(b): `cfg.turns` turns of one conversation, one request at a time."""
    prompts = conversation_prompts(cfg)
    results = []
    start = time.perf_counter()
    for prompt in prompts:
        results.append(await serve_bench.one_request(client, url, MODEL, prompt,
                                                     cfg.turn_output_len))
    wall = time.perf_counter() - start
    summary = summarize(results, [len(p) for p in prompts], wall)
    summary["ttft_per_turn_ms"] = [1000 * r.ttft if r.ok else None for r in results]
    return summary


async def warm_up(client: httpx.AsyncClient, url: str, cfg: Config) -> None:
    """One request that shares no prefix with the workloads, so start-up is not measured."""
    prompt = random_ids(999_999, cfg.prefix_len + cfg.question_len)
    result = await serve_bench.one_request(client, url, MODEL, prompt, cfg.output_len)
    if not result.ok:
        raise RuntimeError(f"warm-up request failed: {result.error}")
    log(f"warm-up: TTFT {1000 * result.ttft:.0f} ms")


async def run_workloads(url: str, cfg: Config) -> dict[str, dict[str, Any]]:
    limits = httpx.Limits(max_connections=cfg.requests + 4)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT, limits=limits) as client:
        await warm_up(client, url, cfg)
        out: dict[str, dict[str, Any]] = {}
        for key, workload in (("a", shared_prefix), ("b", conversation)):
            before = await scrape(client, url)
            summary = await workload(client, url, cfg)
            summary.update(cache_stats(before, await scrape(client, url)))
            log(f"({key}): TTFT p50 {summary['ttft_p50_ms']:.0f} ms, p99 "
                f"{summary['ttft_p99_ms']:.0f} ms, {summary['total_tok_s']:.0f} tok/s, "
                f"hit rate {summary['hit_rate']:.2f}, read misses {summary['read_misses']}")
            out[key] = summary
    return out


def run_setting(setting: str, cfg: Config, args: argparse.Namespace) -> dict[str, Any]:
    """One server (the peers benchmark's `servers.Server`: its own process group, /health,
    the whole group stopped after), both workloads against it."""
    argv = server_argv(setting, args.server_args, with_flag=not args.no_flag)
    log(f"caching {setting}")
    row = servers.Row(name=f"ringserve prefix caching {setting}", kind="ringserve",
                      weights="auto", command=lambda: argv, start_timeout=START_TIMEOUT)
    with servers.Server(row):
        results = asyncio.run(run_workloads(servers.URL, cfg))
    return {"server_argv": argv, **results}


# --- the report ---------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def ratios(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """TTFT p50 off/on and total tok/s on/off per workload (None without both settings)."""
    out: dict[str, dict[str, float | None]] = {}
    for key in ("a", "b"):
        on, off = (runs.get(s, {}).get(key) for s in SETTINGS)
        if on is None or off is None:
            out[key] = {"ttft_p50_off_over_on": None, "total_tok_s_on_over_off": None}
            continue
        out[key] = {
            "ttft_p50_off_over_on": (off["ttft_p50_ms"] / on["ttft_p50_ms"]
                                     if on["ttft_p50_ms"] else None),
            "total_tok_s_on_over_off": (on["total_tok_s"] / off["total_tok_s"]
                                        if off["total_tok_s"] else None)}
    return out


def goals(runs: dict[str, dict[str, Any]],
          rat: dict[str, dict[str, float | None]]) -> dict[str, str]:
    def met(value: float | None, goal: float) -> str:
        if value is None:
            return "n/a (needs both settings)"
        return "met" if value >= goal else "NOT met"

    misses = [runs[s][k]["read_misses"] for s in runs for k in ("a", "b")]
    if any(m is None for m in misses):
        zero = "unknown (series absent)"
    else:
        zero = "met" if all(m == 0 for m in misses) else "NOT met"
    return {"ttft": met(rat["a"]["ttft_p50_off_over_on"], TTFT_GOAL),
            "throughput": met(rat["a"]["total_tok_s_on_over_off"], THROUGHPUT_GOAL),
            "zero_read_misses": zero}


def table(runs: dict[str, dict[str, Any]], cfg: Config) -> str:
    rat = ratios(runs)
    met = goals(runs, rat)
    lines = [f"Prefix caching on {MODEL}: (a) {cfg.requests} requests at once, a shared "
             f"{cfg.prefix_len}-token prefix + {cfg.question_len}-token question, "
             f"{cfg.output_len} output tokens; (b) {cfg.turns} turns, {cfg.first_turn_len} "
             f"tokens + {cfg.answer_len + cfg.user_len} per turn, {cfg.turn_output_len} "
             "output tokens.", "",
             "| workload | caching | TTFT p50 ms | TTFT p99 ms | total tok/s | hit rate "
             "| read misses |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for key in ("a", "b"):
        for setting in SETTINGS:
            if setting not in runs:
                continue
            r = runs[setting][key]
            lines.append(f"| ({key}) | {setting} | {r['ttft_p50_ms']:.1f} | "
                         f"{r['ttft_p99_ms']:.1f} | {r['total_tok_s']:.1f} | "
                         f"{r['hit_rate']:.3f} | {_fmt(r['read_misses'], '.0f')} |")
    lines.append("")
    for setting in SETTINGS:
        if setting in runs:
            lines.append(f"(b) caching {setting}: TTFT per turn mean "
                         f"{runs[setting]['b']['ttft_mean_ms']:.1f} ms, wall "
                         f"{runs[setting]['b']['wall_s']:.2f} s")
    for key in ("a", "b"):
        lines.append(f"ratios ({key}): TTFT p50 off/on "
                     f"{_ratio(rat[key]['ttft_p50_off_over_on'])}, total tok/s on/off "
                     f"{_ratio(rat[key]['total_tok_s_on_over_off'])}")
    lines += ["", f"goals: TTFT p50 >= {TTFT_GOAL:g}x lower with caching (a): {met['ttft']}; "
              f"throughput >= {THROUGHPUT_GOAL:g}x (a): {met['throughput']}; "
              f"zero read misses: {met['zero_read_misses']}"]
    return "\n".join(lines) + "\n"


def write_results(runs: dict[str, dict[str, Any]], cfg: Config,
                  args: argparse.Namespace) -> None:
    text = table(runs, cfg)
    print(text, end="")
    folder, stem = (CACHE, "prefix_cache-quick") if args.quick else (RESULTS, "prefix_cache")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.md").write_text(text)
    rat = ratios(runs)
    raw = {"model": MODEL, "quick": args.quick, "server_args": args.server_args,
           "caching_flag": not args.no_flag, "config": asdict(cfg), "runs": runs,
           "ratios": rat, "goals": goals(runs, rat)}
    (folder / f"{stem}.json").write_text(json.dumps(raw, indent=2) + "\n")
    log(f"wrote {(folder / stem).relative_to(ROOT)}.{{md,json}}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("on", "off", "both"), default="both",
                        help="which caching setting to run (default: both)")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: {QUICK.requests} requests, a {QUICK.prefix_len}-token "
                             f"prefix, {QUICK.turns} turns")
    parser.add_argument("--server-args", default="",
                        help='extra `ringserve serve` flags, e.g. "--max-num-seqs 32"')
    # for servers without the flag (ringserve before prefix caching, peers): leave it out
    parser.add_argument("--no-flag", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cfg = QUICK if args.quick else Config()
    settings = SETTINGS if args.only == "both" else (args.only,)
    runs = {setting: run_setting(setting, cfg, args) for setting in settings}
    write_results(runs, cfg, args)


if __name__ == "__main__":
    main()
