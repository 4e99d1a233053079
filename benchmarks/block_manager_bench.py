"""Appends per second of the ring block manager, and whether an append's cost grows with length.

Decode-style: every step, each of ``--sequences`` sequences appends one token, until each
holds ``--tokens`` tokens; once for a sliding group (window 4096) and once for a
full-attention group, block size 16. Prints appends/s over the whole run and the ratio of
the median time per step in the last 10% of steps to the first 10% (1.0 = flat).

    python benchmarks/block_manager_bench.py            # 1,000 sequences x 100k tokens
    python benchmarks/block_manager_bench.py --quick    # 100 x 20k, a few seconds
"""

from __future__ import annotations

import argparse
import statistics
import time

from block_manager import KVCacheManager, KVCacheSpec, group_layers


def run(window: int | None, sequences: int, tokens: int, block_size: int) -> tuple[float, float]:
    spec = KVCacheSpec(block_size=block_size, dtype_bytes=2,
                       groups=group_layers([window], num_kv_heads=8, head_dim=128))
    need = spec.blocks_needed(tokens)[0]
    kv = KVCacheManager(spec, [need * sequences], max_model_len=tokens)
    for s in range(sequences):
        kv.admit(s, 1, tokens - 1)
    tenth = max(1, tokens // 10)
    first: list[float] = []
    last: list[float] = []
    append = kv.append
    ids = range(sequences)
    begin = time.perf_counter()
    for step in range(tokens):
        t0 = time.perf_counter()
        for s in ids:
            append(s, 1)
        dt = time.perf_counter() - t0
        if step < tenth:
            first.append(dt)
        elif step >= tokens - tenth:
            last.append(dt)
    total = time.perf_counter() - begin
    # NOTE: medians, so that a pause of this shared machine in one step does not decide it.
    return sequences * tokens / total, statistics.median(last) / statistics.median(first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="100 sequences x 20k tokens")
    args = parser.parse_args()
    if args.quick:
        args.sequences, args.tokens = 100, 20_000
    print(f"{args.sequences} sequences x {args.tokens} tokens, block size {args.block_size}")
    print(f"{'group':>14} {'appends/s':>12} {'last10%/first10%':>18}")
    for label, window in (("sliding 4096", 4096), ("full", None)):
        rate, ratio = run(window, args.sequences, args.tokens, args.block_size)
        print(f"{label:>14} {rate:12,.0f} {ratio:18.2f}")


if __name__ == "__main__":
    main()
