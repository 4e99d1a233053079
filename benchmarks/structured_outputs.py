"""What structured outputs cost: output tokens/s under a JSON schema against the same
requests unconstrained, at batch 1 and batch 32, on gemma-3-270m.

The peer is ringserve itself without the constraint, measured in the same run, rounds of A
and B interleaved (the machine is shared and noisy); the ratio is the median round's. Both
sides decode exactly `--tokens` tokens per sequence: the schema asks for more array items
than fit (`minItems`), so no constrained sequence ends early and shrinks its batch, and the
unconstrained side ignores end-of-sequence. Each step of the constrained side fills every
row's token bitmask from its grammar (xgrammar, 262,144 tokens) and masks the logits.

    .venv/bin/python benchmarks/structured_outputs.py            # batch 1 and 32
    .venv/bin/python benchmarks/structured_outputs.py --quick    # fewer tokens, 1 round
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ringserve.engine import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "city": {"type": "string", "maxLength": 24}},
        "required": ["name", "age", "city"],
    },
    "minItems": 100,
}
PROMPTS = [
    "Here is a list of people, in JSON, with their name, age and city:\n",
    "The customers of the shop, as a JSON array of name, age and city:\n",
    "Characters of the novel (JSON; name, age, city):\n",
    "Members of the club, exported as JSON objects with name, age and city:\n",
]


def run(llm: LLM, batch: int, tokens: int, constrained: bool, seed: int) -> float:
    """Output tokens per second of one batch."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    params = [SamplingParams(
        temperature=0.8, seed=seed + i, max_tokens=tokens, ignore_eos=True,
        structured_outputs=StructuredOutputsParams(json=SCHEMA) if constrained else None)
        for i in range(batch)]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    made = sum(len(o.outputs[0].token_ids) for o in outs)
    assert made == batch * tokens, "every sequence must decode exactly --tokens tokens"
    if constrained:
        text = outs[0].outputs[0].text
        assert text.lstrip().startswith("["), text[:80]
    return made / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "structured_outputs.json"))
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.rounds = 32, 1
    llm = LLM(args.model, kv_cache_memory="1GiB", max_model_len=1024, max_num_seqs=32)
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, structured_outputs=(
        StructuredOutputsParams(json=SCHEMA))))  # compile and warm up outside the timing
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        free, tied = [], []
        for r in range(args.rounds):
            free.append(run(llm, batch, args.tokens, False, seed=r))
            tied.append(run(llm, batch, args.tokens, True, seed=r))
            print(f"batch {batch} round {r}: unconstrained {free[-1]:.1f} tok/s, "
                  f"json_schema {tied[-1]:.1f} tok/s", flush=True)
        ratios = [t / f for t, f in zip(tied, free, strict=True)]
        rows.append({"batch": batch, "tokens": args.tokens, "unconstrained_tok_s": free,
                     "json_schema_tok_s": tied, "ratio_median": statistics.median(ratios)})
    print("\n| batch | unconstrained tok/s | json_schema tok/s | json_schema / unconstrained |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['batch']} | {statistics.median(row['unconstrained_tok_s']):.1f} | "
              f"{statistics.median(row['json_schema_tok_s']):.1f} | "
              f"{row['ratio_median']:.3f} |")
    Path(args.out).write_text(json.dumps({"model": args.model, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
