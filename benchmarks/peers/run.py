"""`make bench-peers`: ringserve, vLLM's CPU build and llama.cpp's llama-server on the same
gemma-3-270m weights, each alone on the machine, at concurrency 1, 8 and 32.

    .venv/bin/python benchmarks/peers/run.py [--only ringserve,vllm] [--quick] [--setup-only]

Writes benchmarks/results/peers.{md,png,json}. A row whose setup or start fails is recorded
as failed and the others still run. See benchmarks/peers/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import load
import machine_load
import read_limit
import report
import servers
import setup_llamacpp
import setup_vllm
from model_files import hf_folder, parameter_count
from paths import MODEL, RESULTS, ROOT, log

KINDS = ("ringserve", "vllm", "llamacpp-q4", "llamacpp-bf16")
# NOTE: four rows: bf16 weights, the default (the GGUF's own blocks), int8, int4.
DEFAULT_RINGSERVE = "--quantization none; ; --quantization int8; --quantization int4"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(KINDS),
                   help=f"comma-separated rows to run, of: {', '.join(KINDS)}")
    p.add_argument("--ringserve-args", default=os.environ.get("RINGSERVE_ARGS",
                                                                DEFAULT_RINGSERVE),
                   help="';'-separated ringserve serve argument lists, one row each "
                        "(default: env RINGSERVE_ARGS, else %(default)r)")
    p.add_argument("--concurrency", type=_ints, default=[1, 8, 32])
    p.add_argument("--prompts", type=_ints, default=[4, 16, 64],
                   help="requests per concurrency level")
    p.add_argument("--quick", action="store_true",
                   help="one round of requests per level (concurrency-many) and 32 output "
                        "tokens: checks the whole pipeline, not a measurement")
    p.add_argument("--setup-only", action="store_true", help="set up every selected peer, "
                   "check that each serves one completion, and stop")
    p.add_argument("--quiet-wait", type=float, default=600.0,
                   help="seconds each load may wait for other processes to leave the CPUs "
                        "(default: %(default)s)")
    p.add_argument("--retries", type=int, default=2,
                   help="loads measured again when others used the CPUs during them")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every row this many times, rows in alternating order each round, "
                        "and report each load's median over the rounds (a shared machine's "
                        "noise moves one load by 10-20%%)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of the load (default: greedy; OpenAI's "
                        "default is 1)")
    p.add_argument("--cpu-isa", default=None, choices=["avx2"],
                   help="measure as an AVX2-only machine would: ringserve capped by "
                        "RINGSERVE_CPU_ISA, llama.cpp built for x86-64-v3 (vLLM cannot be "
                        "capped: it keeps this CPU's AVX-512/AMX, said in its row)")
    p.add_argument("--out", type=Path, default=RESULTS / "peers",
                   help="output prefix (default: %(default)s)")
    args = p.parse_args()
    unknown = set(args.only.split(",")) - set(KINDS)
    if unknown:
        p.error(f"--only: unknown {', '.join(sorted(unknown))}; choose from {', '.join(KINDS)}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if len(args.prompts) != len(args.concurrency):
        p.error("--prompts needs one number per --concurrency level")
    load.TEMPERATURE = args.temperature
    if args.quick:
        args.prompts = list(args.concurrency)
        load.OUTPUT_LEN = 32
    return args


def setup(kinds: set[str]) -> dict[str, str]:
    """Every selected peer's setup; returns the error of each that failed."""
    errors: dict[str, str] = {}
    steps: dict[str, Callable[[], object]] = {
        "vllm": setup_vllm.main,
        "llamacpp-q4": lambda: (setup_llamacpp.build(), setup_llamacpp.q4_gguf()),
        "llamacpp-bf16": lambda: (setup_llamacpp.build(), setup_llamacpp.bf16_gguf(hf_folder())),
    }
    for kind, step in steps.items():
        if kind in kinds:
            start = time.monotonic()
            try:
                step()
                log(f"setup {kind}: ok ({time.monotonic() - start:.0f} s)")
            except Exception as err:  # a failed peer is a row of the table, not a crash
                errors[kind] = f"setup: {err}"
                log(f"setup {kind} FAILED: {err}")
    return errors


def measure(server: servers.Server, conc: int, prompts: int,
            args: argparse.Namespace) -> dict[str, Any]:
    """One load after a warm-up and a wait for a quiet machine; measured again (up to
    `--retries` times) while other processes took more than 10% of the CPUs during it."""
    best: dict[str, Any] | None = None
    for attempt in range(1 + args.retries):
        load.warm_up(servers.URL, conc, attempt)
        machine_load.wait_quiet(server.pid, args.quiet_wait)
        with machine_load.OthersMeter(server.pid) as others:
            m = load.measure(servers.URL, conc, prompts, attempt)
        log(f"{server.row.name} conc {conc}: {m.output_tok_s:.1f} tok/s, "
            f"TPOT {m.tpot_ms:.1f} ms, TTFT p50 {m.ttft_p50_ms:.0f} ms; "
            f"others used {others.share:.0%} of the CPUs")
        if best is None or others.share < best["others_cpu"]:
            best = {**m.as_dict(), "others_cpu": others.share}
        if others.share <= 0.10:
            break
        if attempt < args.retries:
            log("measuring again: the machine was not quiet")
    assert best is not None
    return best


def run_row(row: servers.Row, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"name": row.name, "kind": row.kind, "measurements": [],
                           "error": "", "command": "", "weights": row.weights,
                           "load_average": os.getloadavg()}
    try:
        server = servers.Server(row)
        out["command"] = server.describe()
        with server:
            out["weights"] = server.weights
            out["decode_bytes"] = server.decode_bytes
            for conc, n in zip(args.concurrency, args.prompts, strict=True):
                out["measurements"].append(measure(server, conc, n, args))
    except Exception as err:  # recorded in the table; the next row runs
        out["error"] = str(err)
        log(f"{row.name} FAILED: {err}")
        traceback.print_exc()
    return out


MEDIAN_FIELDS = ("output_tok_s", "tpot_ms", "ttft_p50_ms", "duration_s", "others_cpu")


def merge_rounds(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One row's results over several rounds as one: each load's median of every timing,
    the fewest successes, the first error; each round's output tok/s kept in ``rounds``."""
    out = dict(results[0])
    out["error"] = next((r["error"] for r in results if r["error"]), "")
    done = [r for r in results if r["measurements"]]
    if not done:
        return out
    out.update({k: done[0][k] for k in ("command", "weights", "decode_bytes") if k in done[0]})
    merged = []
    for i in range(min(len(r["measurements"]) for r in done)):
        ms = [r["measurements"][i] for r in done]
        m = dict(ms[0])
        m.update({k: statistics.median(x[k] for x in ms) for k in MEDIAN_FIELDS})
        m["ok"] = min(x["ok"] for x in ms)
        m["error"] = next((x["error"] for x in ms if x["error"]), "")
        m["rounds"] = [{k: x[k] for k in ("output_tok_s", "tpot_ms", "ttft_p50_ms")}
                       for x in ms]
        merged.append(m)
    out["measurements"] = merged
    return out


def smoke(row: servers.Row) -> str:
    """Start the row and ask for one greedy completion; the text, or the error."""
    import httpx

    try:
        with servers.Server(row):
            r = httpx.post(f"{servers.URL}/v1/completions", timeout=300, json={
                "model": MODEL, "prompt": "Once upon a time, there was a little girl named",
                "max_tokens": 16, "temperature": 0})
            r.raise_for_status()
            return "ok: " + repr(r.json()["choices"][0]["text"])
    except Exception as err:
        return f"FAILED: {err}"


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    from ringserve.kernels import (
        cpu_isa,  # the CPU class decides ringserve's kernels (and vLLM's bf16)
    )

    info = cpu_isa.info()
    flags = " ".join(sorted(f for f in info.flags if f.startswith(("avx", "amx", "fma", "f16c"))))
    return (f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB; CPU class {info.cls} "
            f"({flags or info.arch})")


def main() -> None:
    args = parse_args()
    if args.cpu_isa:  # inherited by ringserve's server and read by setup_llamacpp
        os.environ["RINGSERVE_CPU_ISA"] = args.cpu_isa
    kinds = set(args.only.split(","))
    ringserve_args = [a.strip() for a in args.ringserve_args.split(";")]
    rows = [r for r in servers.default_rows(ringserve_args, hf_folder) if r.kind in kinds]
    if args.cpu_isa:
        rows = [dataclasses.replace(r, name=f"{r.name} (uncapped: this CPU's own ISA)")
                if r.kind == "vllm" else r for r in rows]  # fmt: skip
    errors = setup(kinds)
    if args.setup_only:
        for row in rows:
            log(f"{row.name}: {errors.get(row.kind) or smoke(row)}")
        return
    folder = hf_folder()
    params = parameter_count(folder)
    machine_load.wait_quiet(None, args.quiet_wait)
    pages = read_limit.read_bandwidths()
    bandwidth = max(pages.values())
    log(f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s ("
        + ", ".join(f"{v / 1e9:.1f} on {k} pages" for k, v in pages.items())
        + f"); {params:,} parameters")
    context = load.INPUT_LEN + load.OUTPUT_LEN // 2
    rounds: dict[str, list[dict[str, Any]]] = {row.name: [] for row in rows}
    for rnd in range(args.rounds):
        if args.rounds > 1:
            log(f"round {rnd + 1} of {args.rounds}")
        for row in (rows if rnd % 2 == 0 else rows[::-1]):
            if row.kind in errors:
                rounds[row.name].append({
                    "name": row.name, "kind": row.kind, "measurements": [], "command": "",
                    "error": errors[row.kind], "weights": row.weights,
                    "load_average": os.getloadavg()})
            else:
                rounds[row.name].append(run_row(row, args))
    results = []
    for row in rows:
        result = merge_rounds(rounds[row.name])
        result["weight_bytes"], result["ceilings"] = 0, []
        fmt = result["weights"]
        if result.get("decode_bytes") or fmt in read_limit.BYTES or (
                fmt == "gguf" and row.kind not in errors):
            weights = result.get("decode_bytes") or read_limit.weight_bytes(
                fmt, params, row.gguf() if row.gguf else None)
            kv = read_limit.kv_bytes_per_token(
                folder, read_limit.kv_element_bytes(fmt.split("+")[0]))
            result["weight_bytes"] = weights
            result["ceilings"] = [read_limit.ceiling(c, weights, kv, context, bandwidth)
                                  for c in args.concurrency]
        results.append(result)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True, check=False).stdout.strip()
    data = {"meta": {
        "model": MODEL, "date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": machine(),
        "bandwidth_gb_s": bandwidth / 1e9,
        "bandwidth_by_page_gb_s": {k: v / 1e9 for k, v in pages.items()},
        "parameters": params, "quick": args.quick,
        "concurrency": args.concurrency, "prompts": args.prompts,
        "input_len": load.INPUT_LEN, "output_len": load.OUTPUT_LEN, "context_tokens": context,
        "temperature": load.TEMPERATURE,
        "invocation": shlex.join(["python", *sys.argv]), "commit": commit,
        "quiet_wait": args.quiet_wait, "rounds": args.rounds,
        "hf_folder": str(folder)}, "rows": results}
    report.write(data, args.out)
    log(f"wrote {args.out}.md, .png and .json")


if __name__ == "__main__":
    main()
