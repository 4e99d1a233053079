"""Appends per second of the ring block manager, and whether an append's cost grows with length.

Decode-style: each step, every sequence appends one token; block size 16; once for a
sliding group (window 4096) and once for a full-attention group. ``--sequences`` sequences
are first grown to 90% of ``--tokens`` (untimed), then their last 10% of appends is timed
step by step, interleaved with the first 10% of appends of as many fresh sequences: the two
regimes run side by side under the same machine load, so the ratio of their median step
times (last 10% / first 10%; 1.0 = flat) does not drift with what else the machine does.

    python benchmarks/block_manager_bench.py            # 1,000 sequences x 100k tokens
    python benchmarks/block_manager_bench.py --quick    # 100 x 20k, a few seconds
"""

from __future__ import annotations

import argparse
import statistics
import time

from ringserve.block_manager import KVCacheManager, KVCacheSpec, group_layers


def _step(kv: KVCacheManager, ids: range) -> float:
    append = kv.append
    t0 = time.perf_counter()
    for s in ids:
        append(s, 1)
    return time.perf_counter() - t0


def run(window: int | None, sequences: int, tokens: int,
        block_size: int) -> tuple[float, float, float]:
    """Returns (appends/s over the long sequences' timed steps, same for fresh, ratio)."""
    spec = KVCacheSpec(block_size=block_size, dtype_bytes=2,
                       groups=group_layers([window], num_kv_heads=8, head_dim=128))
    need = spec.blocks_needed(tokens)[0]
    kv = KVCacheManager(spec, need * sequences * 2, max_model_len=tokens)
    long_ids, fresh_ids = range(sequences), range(sequences, 2 * sequences)
    for s in range(2 * sequences):
        kv.admit(s, 1, tokens - 1)
    tenth = max(1, tokens // 10)
    for _ in range(tokens - tenth):
        _step(kv, long_ids)
    late, early = [], []
    for _ in range(tenth):
        late.append(_step(kv, long_ids))
        early.append(_step(kv, fresh_ids))
    rate_late = sequences * tenth / sum(late)
    rate_early = sequences * tenth / sum(early)
    return rate_late, rate_early, statistics.median(late) / statistics.median(early)


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
    print(f"{'group':>14} {'appends/s late':>15} {'appends/s early':>16} "
          f"{'last10%/first10%':>17}")
    for label, window in (("sliding 4096", 4096), ("full", None)):
        late, early, ratio = run(window, args.sequences, args.tokens, args.block_size)
        print(f"{label:>14} {late:15,.0f} {early:16,.0f} {ratio:17.2f}")


if __name__ == "__main__":
    main()
