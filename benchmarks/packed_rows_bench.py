"""From how many rows a step should multiply by the bf16 copies (`--packed-rows N`) instead
of widening the quantized weights: both in one engine, interleaved.

    python benchmarks/packed_rows_bench.py                      # batches 4, 6, 8, 12, 16
    python benchmarks/packed_rows_bench.py --batch 8 --rounds 20

For each ``--batch``: one engine with the copies made (`--packed-rows 1`), ``--batch``
prompts of 128 ids prefilled, then rounds of decode steps, each round once with the copies
serving (threshold 1) and once without (threshold above the batch): the same weights, cache
and sequences, so the machine's noise falls on both. Prints each one's median step and the
ratio; `engine.models.linear_copies.AUTO_PACKED_ROWS` is the first batch where the copies
win. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ringserve.engine import LLM, SamplingParams
from ringserve.engine.models.quant_linear import QuantLinear


def steps(batch: int, model: str, rounds: int, per_round: int) -> tuple[list[float], list[float]]:
    """(step seconds with the copies, without), ``rounds`` x ``per_round`` each."""
    llm = LLM(model=model, kv_cache_memory="2GiB", max_model_len=1024, max_num_seqs=batch,
              packed_rows=1)
    engine = llm.engine
    layers = [m for m in engine.model.modules() if isinstance(m, QuantLinear)]
    if not layers or not layers[0].copies():
        raise SystemExit("no bf16 copies here (needs quantized linears, bf16 activations and "
                         "a CPU with AVX512-BF16 or AMX tiles, or AVX-512 for oneDNN's)")
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=2 * rounds * (per_round + 2) + 8, temperature=0.0,
                            ignore_eos=True)
    for i in range(batch):
        ids = [(7919 * j + 104729 * i) % (vocab - 10) + 5 for j in range(128)]
        engine.add_request(f"b{i}", {"prompt_token_ids": ids}, params)
    while engine.scheduler.waiting or any(
            s.num_computed < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    timed: dict[int, list[float]] = {1: [], batch + 1: []}
    for _ in range(rounds):
        for threshold, out in timed.items():
            for layer in layers:
                layer.packed_rows = threshold
            engine.step()
            engine.step()
            for _ in range(per_round):
                start = time.perf_counter()
                engine.step()
                out.append(time.perf_counter() - start)
    return timed[1], timed[batch + 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 6, 8, 12, 16])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=8, help="timed steps a round")
    args = ap.parse_args()
    print("| rows | copies ms | quantized ms | copies / quantized |")
    print("|---|---|---|---|")
    for batch in args.batch:
        copies, quantized = steps(batch, args.model, args.rounds, args.steps)
        a, b = statistics.median(copies), statistics.median(quantized)
        print(f"| {batch} | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
