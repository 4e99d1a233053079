"""The bf16 tiles (`--packed-rows` copies) by row count: where a weight's multiply stops
reading at the machine's rate and starts waiting on dpbf16.

    python benchmarks/tiles_bench.py                       # gemma-3-270m's head shape
    python benchmarks/tiles_bench.py --n 4096 --rows 8,32  # a gate_up-sized weight

A random int8 weight [n, k] in 32-value groups (the layout of a GGUF Q8_0 head) is widened
once into tiles (`kernels.cpu_quant.quant_tiles`), then ``quant_linear_tiles`` runs at each
row count, median of ``--reps``; a torch sum of 256 MB before each round says what the
memory reads now (this host's speed moves by minutes). AVX512-BF16 / AMX builds only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_bench import cpu_seconds

from ringserve.kernels import cpu_quant
from ringserve.kernels.quant import QuantizedWeight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=262144, help="weight rows (outputs)")
    ap.add_argument("--k", type=int, default=640, help="weight columns (inputs)")
    ap.add_argument("--rows", default="1,2,4,6,8,12,16,24,32", help="x rows, comma-separated")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_quant.has_tiles():
        sys.exit("tiles_bench: this CPU's kernels have no bf16 tiles (AVX512-BF16 or AMX)")
    n, k = args.n, args.k
    qw = QuantizedWeight(8, 32, torch.randint(-127, 128, (n, k), dtype=torch.int8),
                         (torch.rand(n, k // 32) * 0.01).half())
    tiles = cpu_quant.quant_tiles(qw)
    read = sum(t.numel() * t.element_size() for t in tiles)
    big = torch.ones(64 * 2**20)
    print(f"{n} x {k} int8/32 as tiles ({read / 2**20:.0f} MiB), "
          f"{torch.get_num_threads()} threads")
    for r in range(args.rounds):
        gbs = big.numel() * 4 / cpu_seconds(big.sum, args.reps) / 1e9
        print(f"round {r + 1}: memory read {gbs:.1f} GB/s (torch sum)")
        print("| rows | ms | GB/s of the tiles | GFLOP/s |")
        print("|---|---|---|---|")
        for m in (int(x) for x in args.rows.split(",")):
            x = torch.randn(m, k).bfloat16()
            ms = 1e3 * cpu_seconds(lambda x=x: cpu_quant.quant_linear_tiles(x, tiles, qw, None),
                                   args.reps)
            print(f"| {m} | {ms:.2f} | {read / ms / 1e6:.1f} | {2 * m * n * k / ms / 1e6:.0f} |")


if __name__ == "__main__":
    main()
