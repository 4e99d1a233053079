"""How OpenMP's waiting threads should wait: alone on the machine, and beside a busy process.

torch's CPU build runs its parallel regions on GNU OpenMP (libgomp). Between regions a
thread spins for GOMP_SPINCOUNT iterations (300,000 by default, billions with
OMP_WAIT_POLICY=ACTIVE, none with PASSIVE) before it sleeps on a futex. Alone on the
machine spinning saves a wake-up per region; beside another CPU-bound process a spinning
thread burns the time slice the thread it waits for needs, and a decode step of ~36 parallel
regions collapses. Both settings are read once, when libgomp loads, so each variant runs in
a fresh process.

For each setting: engine throughput (gemma-3-270m preset, the server's defaults, 8 requests
of 64 greedy tokens at once) alone and beside one `while True: pass` process; and, in the
same run, transformers' `generate` (bf16 where the CPU has bf16 units, float32 elsewhere,
the same 8 requests as one batch) alone and beside it, the reference the issue sets.

    python benchmarks/omp_wait.py                    # ~5 min on 2 cores
    python benchmarks/omp_wait.py --out benchmarks/results/omp_wait.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SETTINGS = {
    "spin (libgomp default, 300k)": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "short spin (GOMP_SPINCOUNT=10000)": {"GOMP_SPINCOUNT": "10000"},
    "short spin (GOMP_SPINCOUNT=50000)": {"GOMP_SPINCOUNT": "50000"},
}

ENGINE = """
import json, sys, time
from ringserve.engine import LLM, SamplingParams
llm = LLM("gemma-3-270m")
prompts = [f"Request {i}: tell me a story about the number {i}." for i in range(8)]
params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0))  # warm-up
t = time.perf_counter()
outs = llm.generate(prompts, params)
dt = time.perf_counter() - t
print(json.dumps({"tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / dt}))
"""

TRANSFORMERS = """
import json, time, torch, transformers
from ringserve.engine.loading.convert import export_hf_folder
from ringserve.engine.startup import cpu_bf16_units
path = export_hf_folder("gemma-3-270m")
dtype = torch.bfloat16 if cpu_bf16_units() else torch.float32
model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
tok = transformers.AutoTokenizer.from_pretrained(path)
tok.padding_side = "left"
prompts = [f"Request {i}: tell me a story about the number {i}." for i in range(8)]
batch = tok(prompts, return_tensors="pt", padding=True)
with torch.no_grad():
    model.generate(**batch, max_new_tokens=4, do_sample=False)
    t = time.perf_counter()
    out = model.generate(**batch, max_new_tokens=64, min_new_tokens=64, do_sample=False)
    dt = time.perf_counter() - t
print(json.dumps({"tok_s": 8 * 64 / dt}))
"""


def run(code: str, env: dict[str, str], busy: bool) -> float:
    neighbour = None
    if busy:
        neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.5)
    try:
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                             cwd=ROOT, capture_output=True, text=True, timeout=900,
                             check=True)  # fmt: skip
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    return float(json.loads(out.stdout.strip().splitlines()[-1])["tok_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cpu = subprocess.run(["grep", "-o", "-m1", "model name.*", "/proc/cpuinfo"],
                         capture_output=True, text=True).stdout.strip()  # fmt: skip
    from ringserve.kernels import cpu_isa

    print(f"{cpu}; {cpu_isa.info().describe()}; {os.cpu_count()} CPUs")
    rows = []
    ref = {busy: run(TRANSFORMERS, {}, busy) for busy in (False, True)}
    rows.append(("transformers generate (libgomp default)", ref[False], ref[True]))
    for name, env in SETTINGS.items():
        alone, beside = run(ENGINE, env, False), run(ENGINE, env, True)
        rows.append((f"ringserve, {name}", alone, beside))
    print(f"{'setting':48s} {'alone':>8s} {'beside':>8s} {'fall':>6s}")
    for name, alone, beside in rows:
        print(f"{name:48s} {alone:8.1f} {beside:8.1f} {alone / beside:5.2f}x")
    if args.out:
        args.out.write_text(json.dumps({"cpu": cpu, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
