"""Multi-turn chat under memory pressure, without a model: the scheduler and the block
manager alone, step by step (issue 26's workload, `benchmarks/multiturn.py`'s shape).

The served benchmark needs minutes a setting and the host's noise moves its TTFT; which
sessions hit, and how many prompt tokens they find cached, depend only on what the
scheduler admits and what the pool evicts. This drives the real `Scheduler` and
`KVCacheManager` of gemma-3-270m's layout (5:1 sliding:full layers, window 512, one KV head
of 256, bf16: 48 KiB a block of 16 tokens) through the same sessions and turns, each step
feeding its scheduled tokens and "sampling" a random token for every sequence that
completes its prompt; a step costs ``--step-ms`` plus ``--token-ms`` per token fed, so TTFT
is a modelled time (steps, not seconds measured). Prints hit rate and modelled TTFT p50
per turn, for each policy, with caching off beside.

    .venv/bin/python benchmarks/multiturn_sim.py
    .venv/bin/python benchmarks/multiturn_sim.py --kv-cache-memory 64MiB --sessions 16
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ringserve.block_manager import KVCacheManager, KVCacheSpec, group_layers, ring_slack
from ringserve.block_manager.budget import parse_size, plan_num_blocks
from ringserve.engine.sampling_params import SamplingParams
from ringserve.engine.scheduler import Scheduler
from ringserve.engine.sequence import Sequence, SequenceStatus


def gemma3_270m_spec(prefix_caching: bool, block_size: int = 16) -> KVCacheSpec:
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    return KVCacheSpec(block_size=block_size, dtype_bytes=2,
                       ring_slack=ring_slack(block_size, prefix_caching),
                       groups=group_layers(windows, num_kv_heads=1, head_dim=256))


@dataclass
class TurnStats:
    hit_rate: float
    ttft_p50: float
    ttft: list[float]
    hits: int  # sequences that found any prompt token cached


def run(policy: str, caching: bool, args: argparse.Namespace) -> list[TurnStats]:
    spec = gemma3_270m_spec(caching)
    blocks = plan_num_blocks(spec, parse_size(args.kv_cache_memory))
    kv = KVCacheManager(spec, blocks, max_model_len=8192, enable_prefix_caching=caching)
    sched = Scheduler(kv, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      policy=policy if caching else "fcfs")
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.output, ignore_eos=True)
    prompts = [[rng.randrange(1000, 200_000) for _ in range(args.first_turn)]
               for _ in range(args.sessions)]
    out: list[TurnStats] = []
    seq_id = 0
    for _turn in range(args.turns):
        clock = 0.0
        seqs = []
        for prompt in prompts:
            seqs.append(Sequence(seq_id=seq_id, request_id=str(seq_id), index=0,
                                 token_ids=list(prompt), num_prompt_tokens=len(prompt),
                                 params=params, max_tokens=args.output, detokenizer=None))
            seq_id += 1
            sched.add(seqs[-1])
        first: dict[int, float] = {}
        queries = hits = 0
        while sched.has_work:
            scheduled = sched.schedule().scheduled
            for item in scheduled:
                seq, n = item.seq, item.num_new
                kv.append(seq.seq_id, n, seq.token_ids[seq.num_computed : seq.num_computed + n])
            kv.commit()
            clock += args.step_ms + args.token_ms * sum(i.num_new for i in scheduled)
            for item in scheduled:
                seq = item.seq
                seq.num_computed += item.num_new
                if item.samples:
                    seq.token_ids.append(rng.randrange(1000, 200_000))
                    first.setdefault(seq.seq_id, clock)
                    if seq.num_output_tokens >= seq.max_tokens:
                        seq.status = SequenceStatus.FINISHED_LENGTH
                        sched.finish(seq)
        for seq in seqs:
            queries += seq.num_prompt_tokens
            hits += seq.num_cached_tokens
        ttft = [first[s.seq_id] for s in seqs]
        out.append(TurnStats(hits / queries, statistics.median(ttft), ttft,
                             sum(s.num_cached_tokens > 0 for s in seqs)))
        prompts = [p + [rng.randrange(1000, 200_000) for _ in range(args.answer + args.user)]
                   for p in prompts]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--first-turn", type=int, default=400)
    ap.add_argument("--answer", type=int, default=64)
    ap.add_argument("--user", type=int, default=48)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--kv-cache-memory", default="48MiB")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="default: --sessions (as multiturn.py)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--step-ms", type=float, default=25.0,
                    help="modelled cost of a step (default: an 8-row decode step here)")
    ap.add_argument("--token-ms", type=float, default=0.9,
                    help="modelled cost of each token a step feeds")
    args = ap.parse_args(argv)
    if args.max_num_seqs is None:
        args.max_num_seqs = args.sessions
    return args


def main() -> None:
    args = parse_args()
    runs = {name: run(policy, caching, args) for name, policy, caching in
            (("off", "fcfs", False), ("fcfs", "fcfs", True), ("lpm", "lpm", True))}
    print(f"{args.sessions} sessions x {args.turns} turns, pool {args.kv_cache_memory}: "
          "hit rate (sessions hit), modelled TTFT p50 ms, off / policy")
    for t in range(args.turns):
        off = runs["off"][t].ttft_p50
        cells = [f"{name} {r[t].hit_rate:.2f} ({r[t].hits}) {r[t].ttft_p50:.0f} "
                 f"{off / r[t].ttft_p50:.2f}x" for name, r in runs.items() if name != "off"]
        print(f"turn {t}: off {off:.0f} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
