"""Sequences that fit in the KV cache at once, by request length: ringserve and vLLM.

gemma-3-270m (15 sliding layers with w = 512, 3 full layers; 1 KiB of K and V per token and
layer in bf16), 2 GiB of KV, requests of 256, 4,096, 8,192 and 32,768 tokens (prompt +
max_tokens). Columns:

- *bytes allow*: 2 GiB over what one request's K and V take, counted here from the model's
  shape alone: ``15 * min(n, 512) + 3 * n`` KiB.
- *ringserve*: the running engine's own count (its capacity statement), checked by admitting
  requests through its KV manager until the next one does not fit; with prefix caching (the
  default) each ring holds ``b - 1`` tokens of slack (33 blocks instead of 32), and without.
- *per-group pools*: ringserve before issue 12, one pool per layer group sized for
  ``--max-model-len`` sequences, re-derived here (it matches the issue's numbers: 2,080 and
  33,288 blocks, 130 requests of 256 tokens at ``--max-model-len 8192``).
- *vLLM*: its CPU build's own log line, "Maximum concurrency for N tokens per request",
  started with ``--max-model-len N`` and ``VLLM_CPU_KVCACHE_SPACE=2`` (one start per length,
  stopped as soon as the line is out; ``--skip-vllm`` leaves it out).

    .venv/bin/python benchmarks/capacity.py              # ~5 min with vLLM installed
    .venv/bin/python benchmarks/capacity.py --skip-vllm  # seconds
    .venv/bin/python benchmarks/capacity.py --reuse-vllm # vLLM's column from the last run

Writes benchmarks/results/capacity.{json,md,png}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

from paths import LOGS, RESULTS, log  # noqa: E402

from ringserve.block_manager import KVCacheSpec, blocks_for_tokens  # noqa: E402

MEMORY = 2 * 2**30
LENGTHS = (256, 4096, 8192, 32768)
BEFORE_MAX_MODEL_LENS = (8192, 32768)
VLLM_LINE = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


def request_bytes(spec: KVCacheSpec, tokens: int) -> int:
    """K and V bytes of one ``tokens``-token request, counted per layer (no blocks)."""
    g0 = spec.groups[0]
    per_token_layer = 2 * g0.num_kv_heads * g0.head_dim * spec.dtype_bytes
    return per_token_layer * sum(
        len(g.layer_ids) * (tokens if g.window is None else min(tokens, g.window))
        for g in spec.groups)


def per_group_pools(spec: KVCacheSpec, tokens: int, max_model_len: int) -> int | None:
    """Requests of ``tokens`` tokens that fit in ringserve's pools before issue 12: one pool
    per window, each sized for ``max_model_len``-long sequences; None past max_model_len."""
    if tokens > max_model_len:
        return None
    b = spec.block_size
    layers: dict[int | None, int] = {}
    for g in spec.groups:
        layers[g.window] = layers.get(g.window, 0) + len(g.layer_ids)
    g0 = spec.groups[0]
    block_bytes = {w: 2 * b * g0.num_kv_heads * g0.head_dim * spec.dtype_bytes * n
                   for w, n in layers.items()}

    def need(n: int, w: int | None) -> int:
        return blocks_for_tokens(n, b, None if w is None else -(-w // b))

    per_sequence = sum(need(max_model_len, w) * block_bytes[w] for w in layers)
    pools = {w: MEMORY * need(max_model_len, w) // per_sequence for w in layers}
    return min(pools[w] // need(tokens, w) for w in layers)


def ringserve_counts(caching: bool) -> tuple[dict[int, int], dict[int, int], KVCacheSpec]:
    """(capacity statement, admitted until full) per length, and the KV spec."""
    from ringserve.engine import LLM

    llm = LLM(model="gemma-3-270m", dtype="bfloat16", kv_cache_memory=MEMORY,
              max_model_len=max(LENGTHS), enable_prefix_caching=caching)
    kv = llm.engine.kv
    log(f"ringserve (prefix caching {'on' if caching else 'off'}): "
        f"{llm.engine.capacity.description}")
    stated, admitted = {}, {}
    for n in LENGTHS:
        stated[n] = kv.sequences_that_fit(n)
        count = 0
        prompt = list(range(1000, 1000 + n - 1))  # nothing is cached: no hit
        while kv.can_admit(n - 1, 1, prompt):
            kv.admit(("probe", count), n - 1, 1, prompt)
            count += 1
        for i in range(count):
            kv.release(("probe", i))
        admitted[n] = count
    return stated, admitted, kv.spec


def vllm_concurrency(tokens: int) -> float:
    """vLLM's "Maximum concurrency" for ``tokens``-token requests, from its own log."""
    import setup_vllm
    from model_files import hf_folder

    argv = [str(setup_vllm.install()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(hf_folder()), "--dtype", "bfloat16", "--max-model-len",
            str(tokens), "--host", "127.0.0.1", "--port", "8766"]
    LOGS.mkdir(parents=True, exist_ok=True)
    path = LOGS / f"capacity-vllm-{tokens}-{int(time.time())}.log"
    log(f"vLLM --max-model-len {tokens} (log: {path.relative_to(ROOT)})")
    with path.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **setup_vllm.server_env()},
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            m = VLLM_LINE.search(path.read_text(errors="replace"))
            if m:
                assert int(m.group(1).replace(",", "")) == tokens, m.group(0)
                return float(m.group(2))
            if proc.poll() is not None:
                tail = "\n".join(path.read_text(errors="replace").splitlines()[-10:])
                raise RuntimeError(f"vLLM exited {proc.returncode} before its line:\n{tail}")
            time.sleep(1)
        raise RuntimeError(f"no concurrency line from vLLM in 600 s (log {path})")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = [("ringserve (one pool)", "ringserve", "o-"),
              ("what the bytes allow", "bytes_allow", "k:")]
    series += [(f"ringserve before (per-group pools, --max-model-len {m})", f"before_{m}",
                "s--") for m in BEFORE_MAX_MODEL_LENS]
    series.append(("vLLM CPU (its log)", "vllm", "^-"))
    for label, key, style in series:
        pts = [(x, r[key]) for x, r in zip(xs, rows, strict=True) if r.get(key) is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [f"{x:,}" for x in xs])
    ax.set_yticks([10, 20, 50, 100, 200, 500], ["10", "20", "50", "100", "200", "500"])
    ax.minorticks_off()
    ax.set_xlabel("tokens per request (prompt + max_tokens)")
    ax.set_ylabel("requests that fit at once")
    ax.set_title("gemma-3-270m, bf16, 2 GiB of KV")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-vllm", action="store_true", help="leave vLLM's column out")
    parser.add_argument("--reuse-vllm", action="store_true",
                        help="take vLLM's column from the last results/capacity.json")
    args = parser.parse_args()
    stated, admitted, spec = ringserve_counts(caching=True)  # the default
    plain, _, _ = ringserve_counts(caching=False)
    vllm: dict[int, float] = {}
    if args.reuse_vllm:
        last = json.loads((RESULTS / "capacity.json").read_text())["rows"]
        vllm = {r["tokens"]: r["vllm"] for r in last if r["vllm"] is not None}
    elif not args.skip_vllm:
        for n in LENGTHS:
            vllm[n] = vllm_concurrency(n)
    rows: list[dict[str, Any]] = []
    header = ("| tokens | bytes allow | ringserve | ringserve, no prefix caching | "
              "per-group pools (max-model-len 8,192) | per-group pools (32,768) | vLLM | "
              "ringserve / vLLM |")
    lines = [header, "|" + "---|" * 8]
    failures: list[str] = []
    notes: list[str] = []
    for n in LENGTHS:
        ours, v = stated[n], vllm.get(n)
        allow = MEMORY // request_bytes(spec, n)
        # the goal: what the bytes allow less one block per group and request (rounding)
        floor = MEMORY // (request_bytes(spec, n) + len(spec.groups) * spec.block_bytes)
        before = {m: per_group_pools(spec, n, m) for m in BEFORE_MAX_MODEL_LENS}
        rows.append({"tokens": n, "bytes_allow": allow, "goal_floor": floor, "ringserve": ours,
                     "ringserve_admitted": admitted[n], "ringserve_no_caching": plain[n],
                     "vllm": v,
                     **{f"before_{m}": b for m, b in before.items()}})
        ratio = f"{ours / v:.2f}x" if v else "-"
        lines.append(f"| {n:,} | {allow} | {ours} | {plain[n]} | "
                     + " | ".join("refused" if b is None else str(b) for b in before.values())
                     + f" | {'-' if v is None else f'{v:.2f}'} | {ratio} |")
        if admitted[n] != ours:
            failures.append(f"{n}: stated {ours} but admitted {admitted[n]}")
        if ours < floor:
            failures.append(f"{n}: {ours} < {floor}, the bytes less a block per group")
        if v is not None and ours < v:
            failures.append(f"{n}: {ours} < vLLM's {v:.2f}")
        if v is not None and n >= 4096 and ours < 2 * v:
            exact = MEMORY / request_bytes(spec, n)
            notes.append(f"{n} tokens: {ours} < 2 x vLLM's {v:.2f}" + (
                f", out of reach: the bytes allow {exact:.2f}" if exact < 2 * v else ""))
            if exact >= 2 * v:
                failures.append(notes[-1])
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "capacity.json").write_text(json.dumps(
        {"model": "gemma-3-270m", "dtype": "bfloat16", "kv_cache_memory": MEMORY,
         "block_size": spec.block_size, "rows": rows}, indent=2) + "\n")
    (RESULTS / "capacity.md").write_text(
        "gemma-3-270m, bf16, 2 GiB of KV, block 16 (`benchmarks/capacity.py`)\n\n" + table
        + "\n")
    plot(rows, RESULTS / "capacity.png")
    for note in notes:
        print("note: " + note)
    print("goals: " + ("met" if not failures else "NOT met: " + "; ".join(failures)))


if __name__ == "__main__":
    main()
