"""Decode steps with the quantized weights and copies, and the KV slabs, on 2 MiB pages
against 4 KiB pages, in one engine: the two placements alternate, so that both see the
same machine (docs/cpu.md, "Huge pages for the copies a step streams").

    python benchmarks/huge_pages.py --batch 1
    python benchmarks/huge_pages.py --batch 32 --what kv --context 1000

The engine starts with ``RINGSERVE_HUGE_PAGES=0`` (every tensor on ordinary pages); then
`place_on_huge_pages` (``--what weights``) or a copy of the KV slabs from `huge_zeros`
(``--what kv``) makes the other placement, and rounds of ``--steps`` decode steps alternate
between the two, each starting with the other's turn. Prints each round's median step and
the medians of the rounds. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ["RINGSERVE_HUGE_PAGES"] = "0"

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ringserve.engine import LLM, SamplingParams
from ringserve.engine.models import linear_copies, quant_linear
from ringserve.engine.models.quant_linear import QuantLinear
from ringserve.kernels import hugepages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    ap.add_argument("--what", choices=("weights", "kv"), default="weights")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps a round")
    args = ap.parse_args()
    llm = LLM(model=args.model, kv_cache_memory="2GiB", packed_rows="auto",
              max_model_len=args.context + args.rounds * 2 * (args.steps + 1) + 16,
              max_num_seqs=args.batch, max_num_batched_tokens=max(512, args.batch))
    engine = llm.engine
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=args.rounds * 2 * (args.steps + 1) + 8,
                            temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        ids = [(7919 * j + 104729 * i) % (vocab - 10) + 5 for j in range(args.context)]
        engine.add_request(f"pages-{i}", {"prompt_token_ids": ids}, params)
    while engine.scheduler.waiting or any(
            s.num_computed < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    os.environ["RINGSERVE_HUGE_PAGES"] = "1"
    if not hugepages.offered():
        sys.exit("transparent huge pages are not offered here: nothing to compare")
    if args.what == "weights":
        layers = [m for m in engine.model.modules() if isinstance(m, QuantLinear)]
        names = (*linear_copies.MOVED_BUFFERS, *linear_copies.MOVED_COPIES)

        def snapshot() -> list[dict[str, object]]:
            return [{n: getattr(m, n) for n in names} for m in layers]

        small = snapshot()
        print(linear_copies.place_on_huge_pages(engine.model))
        huge = snapshot()

        def use(placement: list[dict[str, object]]) -> None:
            for m, held in zip(layers, placement, strict=True):
                for n, t in held.items():
                    setattr(m, n, t)
                m._qw = None
            quant_linear.copies_moved()
    else:
        four_k = engine.runner.caches
        slabs = {id(t._base): t._base for kv in four_k for t in kv}
        copies = {i: hugepages.huge_zeros(tuple(s.shape), s.dtype) for i, s in slabs.items()}
        on_huge = [tuple(copies[id(t._base)].as_strided(t.shape, t.stride(), t.storage_offset())
                         for t in kv) for kv in four_k]
        current = [four_k]

        def use(placement: list[dict[str, object]]) -> None:  # the caches hold the K/V so far
            target = on_huge if placement is huge else four_k
            if target is not current[0]:
                for i, s in slabs.items():
                    (copies[i] if target is on_huge else s).copy_(
                        s if target is on_huge else copies[i])
                engine.runner.caches = current[0] = target
        small, huge = [{}], [{}]

    def steps() -> float:
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    rounds: dict[str, list[float]] = {"4 KiB": [], "2 MiB": []}
    for r in range(args.rounds):
        order = [("4 KiB", small), ("2 MiB", huge)]
        for name, placement in order if r % 2 == 0 else order[::-1]:
            use(placement)
            engine.step()  # the first after a switch: paths chosen again, caches refilled
            rounds[name].append(steps())
    for name, times in rounds.items():
        print(f"{args.model} batch {args.batch}, context {args.context}, {args.what} on "
              f"{name} pages, {torch.get_num_threads()} threads: decode step "
              f"{' '.join(f'{t * 1e3:.1f}' for t in times)} ms; median "
              f"{statistics.median(times) * 1e3:.1f}")


if __name__ == "__main__":
    main()
