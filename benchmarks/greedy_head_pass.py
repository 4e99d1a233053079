"""The greedy head's int8 pass against the full head, on a real model's hidden states
(docs/cpu.md, "The greedy head").

Greedy generation over the seed article records the rows the greedy head picks for; then,
for 1, 8 and 32 (`--rows`) of those rows at a time, the median time of the candidates pass alone, of
the whole pick (pass, candidates' exact logits, first maximum) and of the full head, and
how many candidates a row kept. Where the pass runs on AMX tiles, the AVX512-VNNI pass over
its own copy is timed beside it on the same rows.

    python benchmarks/greedy_head_pass.py                 # gemma-3-270m, serve's defaults
    python benchmarks/greedy_head_pass.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ringserve.engine import LLM, SamplingParams
from ringserve.engine.models.greedy_head import GreedyHead

SEED_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "seed"


def _ms(fn: Callable[[], object], repeats: list[float]) -> None:
    start = time.perf_counter()
    fn()
    repeats.append((time.perf_counter() - start) * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--calls", type=int, default=8, help="timed calls for each row count")
    ap.add_argument("--rows", default="1,8,32", help="row counts, comma-separated")
    ap.add_argument("--text", type=Path, default=None,
                    help=f"UTF-8 text to continue (default: {SEED_DIR}/*.txt)")
    args = ap.parse_args()
    files = [args.text] if args.text else sorted(SEED_DIR.glob("*.txt"))
    if not files:
        ap.error(f"no text: {SEED_DIR} has no *.txt; pass --text FILE")
    llm = LLM(model=args.model, dtype=args.dtype)
    picker = llm.engine.runner.greedy_head
    if picker is None:
        raise SystemExit("the greedy head is off for this model and machine (the log says why)")
    rows: list[torch.Tensor] = []
    pick = picker.pick

    def recording(x: torch.Tensor) -> torch.Tensor | None:
        rows.append(x.detach().clone())
        return pick(x)

    picker.pick = recording  # type: ignore[method-assign]
    text = "".join(p.read_text(encoding="utf-8") for p in files)
    prompts = [text[i * 300 : i * 300 + 600] for i in range(32)]
    llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    hidden = torch.cat(rows)
    print(f"{args.model} {hidden.dtype}: {len(hidden)} recorded rows, min_rows "
          f"{picker.min_rows}")
    picker.pick = pick  # type: ignore[method-assign]
    pickers = {"amx" if picker.amx else "int8": picker}
    if picker.amx:
        pickers["vnni"] = GreedyHead(picker.head, amx=False)
    for m in (int(r) for r in args.rows.split(",")):
        for label, p in pickers.items():
            times: dict[str, list[float]] = {"pass": [], "pick": [], "full": []}
            kept: list[float] = []
            for call in range(args.calls):
                start = call * 32 % max(1, len(hidden) - m)
                x = hidden[start : start + m].contiguous()
                for name, fn in (("pass", p.candidates), ("pick", p.pick), ("full", p.head)):
                    _ms(functools.partial(fn, x), times[name])
                _, offsets = p.candidates(x)
                kept += (offsets[1:] - offsets[:-1]).tolist()
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"{m:>2} rows, {label} pass {med['pass']:.2f} ms, pick {med['pick']:.2f} ms, "
                  f"full head {med['full']:.2f} ms; candidates a row: median "
                  f"{statistics.median(kept):.0f}, max {max(kept):.0f}")


if __name__ == "__main__":
    main()
