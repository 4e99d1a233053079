"""Speculative decoding by prompt lookup against plain decoding, on gemma-3-270m.

Two engines on the same weights, one with `--speculative-config` and one without, measured
in the same run, rounds interleaved (the machine is shared and noisy). Two workloads:

- echo: the answer repeats long spans of the prompt (a paragraph, then the instruction to
  copy it and its first words), where drafts found in the prompt keep being right;
- random: random prompt token ids, sampled at temperature 1 (greedy decoding of random
  prompts falls into loops, which drafts then predict): drafts mostly fail, and the
  sequence backs off from drafting.

At concurrency 1 (one request at a time) and 8 (eight in one batch), 128 output tokens
(ignore_eos); echo greedy. TPOT is vLLM's: (last token - first token) / (output tokens - 1), the
median over requests; output tok/s = generated tokens / wall time; acceptance = drafted
tokens kept / drafted tokens verified.

    .venv/bin/python benchmarks/speculative.py              # k = 5, both workloads
    .venv/bin/python benchmarks/speculative.py --quick      # 32 tokens, one round
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ringserve.engine import LLM, SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PARAGRAPHS = [
    "Once upon a time, there was a little girl named Lily. She lived in a small house near "
    "the forest with her mother, her father and a very old dog called Max. Every morning she "
    "walked to the river to watch the fish and the birds, and every evening she told her "
    "mother what she had seen.",
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion about the costs of the new building, the members agreed to postpone the "
    "decision until the engineers had finished their report on the foundations.",
    "To install the package, download the archive, unpack it into a folder of your choice "
    "and run the setup script from a terminal. The script checks the dependencies, builds "
    "the native extensions and copies the files into place.",
    "The river rises in the mountains to the north, flows through three lakes and reaches the "
    "sea after some four hundred kilometres. Its valley has been farmed for thousands of "
    "years, and the old towns along its banks still hold markets every week.",
]


def echo_prompt(i: int) -> str:
    text = PARAGRAPHS[i % len(PARAGRAPHS)]
    first = " ".join(text.split()[:6])
    return f"{text}\n\nThe same text, copied word for word:\n\n{first}"


def random_prompt(llm: LLM, i: int, n: int = 128) -> dict[str, list[int]]:
    import random

    rng = random.Random(i)
    return {"prompt_token_ids": [rng.randrange(100, 5000) for _ in range(n)]}


def run(llm: LLM, prompts: list[Any], concurrency: int, tokens: int,
        temperature: float) -> dict[str, float]:
    """Serve ``prompts`` ``concurrency`` at a time; TPOT median, tok/s, acceptance."""
    engine = llm.engine
    before = engine.stats()
    params = SamplingParams(temperature=temperature, seed=0, max_tokens=tokens,
                            ignore_eos=True)
    tpots, made = [], 0
    start = time.perf_counter()
    for lo in range(0, len(prompts), concurrency):
        requests = [engine.add_request(f"b{time.perf_counter_ns()}-{j}", p, params)
                    for j, p in enumerate(prompts[lo : lo + concurrency])]
        while engine.has_unfinished:
            engine.step()
        for request in requests:
            seq = request.seqs[0]
            n = seq.num_output_tokens
            made += n
            assert seq.first_token_time is not None and seq.last_token_time is not None
            tpots.append((seq.last_token_time - seq.first_token_time) / (n - 1))
    wall = time.perf_counter() - start
    after = engine.stats()
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    kept = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    return {"tpot_ms": statistics.median(tpots) * 1e3, "tok_s": made / wall,
            "acceptance": kept / drafted if drafted else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "speculative.json"))
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.rounds = 32, 1
    common: dict[str, Any] = dict(kv_cache_memory="1GiB", max_model_len=2048, max_num_seqs=8)
    plain = LLM(args.model, **common)
    spec = LLM(args.model, speculative_config={
        "method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}, **common)
    workloads = {"echo": [echo_prompt(i) for i in range(8)],
                 "random": [random_prompt(plain, i) for i in range(8)]}
    for llm in (plain, spec):  # warm up outside the timing
        llm.generate(echo_prompt(0), SamplingParams(max_tokens=8, temperature=0.0))
    rows = []
    temperatures = {"echo": 0.0, "random": 1.0}
    for name, prompts in workloads.items():
        for concurrency in (1, 8):
            use = prompts[:4] if concurrency == 1 else prompts
            offs, ons = [], []
            for r in range(args.rounds):
                offs.append(run(plain, use, concurrency, args.tokens, temperatures[name]))
                ons.append(run(spec, use, concurrency, args.tokens, temperatures[name]))
                print(f"{name} c={concurrency} round {r}: TPOT off {offs[-1]['tpot_ms']:.1f} ms"
                      f", on {ons[-1]['tpot_ms']:.1f} ms (acceptance "
                      f"{ons[-1]['acceptance']:.2f})", flush=True)
            rows.append({
                "workload": name, "concurrency": concurrency,
                "tpot_off_ms": statistics.median(o["tpot_ms"] for o in offs),
                "tpot_on_ms": statistics.median(o["tpot_ms"] for o in ons),
                "tok_s_off": statistics.median(o["tok_s"] for o in offs),
                "tok_s_on": statistics.median(o["tok_s"] for o in ons),
                "acceptance": statistics.median(o["acceptance"] for o in ons),
            })
    print(f"\nk = {args.k}, {args.tokens} output tokens; echo greedy, random at "
          "temperature 1\n")
    print("| workload | concurrency | TPOT off (ms) | TPOT on (ms) | TPOT off / on | "
          "tok/s off | tok/s on | acceptance |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['concurrency']} | {r['tpot_off_ms']:.1f} | "
              f"{r['tpot_on_ms']:.1f} | {r['tpot_off_ms'] / r['tpot_on_ms']:.2f}x | "
              f"{r['tok_s_off']:.1f} | {r['tok_s_on']:.1f} | {r['acceptance']:.2f} |")
    Path(args.out).write_text(json.dumps({"model": args.model, "k": args.k,
                                          "tokens": args.tokens, "rows": rows}, indent=1)
                              + "\n")


if __name__ == "__main__":
    main()
