"""oneDNN row buckets (engine/models/packed_linear.py: `bucket_rows`) against exact row counts.

A server's steps come in every row count (chunked prefills of every length beside decodes of
every batch size); oneDNN compiles a kernel per row count it has not seen. This runs the
default model (gemma-3-270m, bf16 packed path) on a mixed workload, in a fresh process per
variant, alternating bucketed / exact three times each, and reports per variant:

- cold tok/s: the first pass over the workload (every new row count compiles);
- warm tok/s: the same workload again in the same process (shapes seen before);
- RSS after the two passes.

    python benchmarks/row_buckets.py            # ~5 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(bucketed: bool, requests: int) -> dict[str, float]:
    sys.path.insert(0, str(ROOT))
    from ringserve.engine import LLM, SamplingParams
    from ringserve.engine.models import packed_linear

    if not bucketed:
        packed_linear.bucket_rows = lambda rows: rows  # type: ignore[assignment]
    llm = LLM("gemma-3-270m", max_num_seqs=16, max_num_batched_tokens=512,
              kv_cache_memory="512MiB", enable_prefix_caching=False)
    rng = random.Random(0)
    vocab = 256000
    prompts = [[rng.randrange(1000, vocab) for _ in range(rng.randint(16, 600))]
               for _ in range(requests)]
    params = [SamplingParams(max_tokens=rng.randint(8, 48), ignore_eos=True, temperature=0)
              for _ in range(requests)]
    out: dict[str, float] = {}
    for label in ("cold", "warm"):
        start = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        took = time.perf_counter() - start
        tokens = sum(len(r.outputs[0].token_ids) for r in results)
        out[f"{label}_tok_s"] = tokens / took
    status = Path("/proc/self/status").read_text().splitlines()
    out["rss_mib"] = int(next(x for x in status if x.startswith("VmRSS")).split()[1]) / 1024
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--child", choices=["bucketed", "exact"])
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child == "bucketed", args.requests)))
        return
    runs: dict[str, list[dict[str, float]]] = {"bucketed": [], "exact": []}
    for _ in range(args.rounds):
        for variant in runs:
            done = subprocess.run([sys.executable, __file__, "--child", variant,
                                   "--requests", str(args.requests)],
                                  capture_output=True, text=True, check=True, cwd=ROOT)
            runs[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(variant, runs[variant][-1], flush=True)
    med = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}
    b, e = med["bucketed"], med["exact"]
    print(f"medians of {args.rounds} rounds, {args.requests} requests (prompts 16-600 tokens, "
          "outputs 8-48), gemma-3-270m bf16, max_num_seqs 16, 512 tokens a step:")
    for key in ("cold_tok_s", "warm_tok_s", "rss_mib"):
        print(f"  {key:11s} bucketed {b[key]:8.1f}  exact {e[key]:8.1f}  "
              f"ratio {b[key] / e[key]:.3f}")


if __name__ == "__main__":
    main()
