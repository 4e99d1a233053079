"""A decode step against its weight-read limit, the two measured in turns in one process.

    python benchmarks/one_row_limit.py                 # gemma-3-270m, one row, 6 pairs
    python benchmarks/one_row_limit.py --rows 8 --pairs 4

Issue 23 asks a one-row decode step to take at most 1.5x the time its weights take to read
at the machine's memory bandwidth. Both vary by the minute on a shared host, so each pair
measures the bandwidth (`peers/read_limit.read_bandwidth`: the faster of 4 KiB and 2 MiB
pages, 2 threads) and then times ``--steps`` engine steps; the limit is the weight bytes a
step reads (the start-up log's figure, `weight_bytes`) over that bandwidth. Prints each
pair and the median ratio. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

# NOTE: as the server runs (engine/__init__.py): torch's OpenMP threads sleep between
# regions and our kernels run on their own pool
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

import read_limit

from ringserve.engine import LLM, SamplingParams
from ringserve.engine.loading.quantize import weight_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--rows", type=int, default=1, help="sequences decoding together")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--steps", type=int, default=60, help="timed steps a pair")
    args = ap.parse_args()
    llm = LLM(model=args.model, max_num_seqs=max(8, args.rows), kv_cache_memory="2GiB",
              max_model_len=4096)
    engine = llm.engine
    step_bytes = weight_bytes(engine.model).per_token
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=4096 - 200, temperature=0.0, ignore_eos=True)
    for i in range(args.rows):
        ids = [(7919 * j + 104729 * i) % (vocab - 10) + 5 for j in range(128)]
        engine.add_request(f"limit-{i}", {"prompt_token_ids": ids}, params)
    for _ in range(10):  # the prefill and a few steps
        engine.step()
    threads = torch.get_num_threads()
    ratios = []
    for pair in range(args.pairs):
        bandwidth = read_limit.read_bandwidth(threads=threads)
        torch.set_num_threads(threads)
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        step, limit = statistics.median(times), step_bytes / bandwidth
        ratios.append(step / limit)
        print(f"pair {pair}: read {bandwidth / 1e9:.1f} GB/s, limit {limit * 1e3:.2f} ms "
              f"({step_bytes / 1e6:.0f} MB), step median {step * 1e3:.2f} ms: "
              f"{step / limit:.2f}x", flush=True)
    print(f"{args.model}, {args.rows} row(s), {threads} threads: step / read limit "
          f"{min(ratios):.2f}-{max(ratios):.2f}x, median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
