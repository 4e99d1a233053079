"""Where a decode step's time goes: torch's profiler over a few engine steps.

    python benchmarks/step_profile.py --batch 8                  # gemma-3-270m, dtype auto
    python benchmarks/step_profile.py --batch 32 --context 400 --shapes
    python benchmarks/step_profile.py --batch 1 --quantization int8
    python benchmarks/step_profile.py --batch 32 --packed-rows off   # the quantized weights alone
    python benchmarks/step_profile.py --batch 32 --profile-prefill   # where the prefill goes
    python benchmarks/step_profile.py --batch 32 --step-tokens 512 --rounded-copy-rows 128

Prefills ``--batch`` prompts of ``--context`` token ids, then times ``--steps`` decode steps
(median and fastest) and prints the profiler's table of one more batch of steps, so the
ops that cost the most are named beside the step time. Run it alone on the machine: on a
busy CPU every parallel region waits for a descheduled thread and the table says little.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

# NOTE: as the server runs (engine/__init__.py), set before torch loads: torch's OpenMP
# threads sleep between regions and our kernels run on their own pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ringserve.engine import LLM, SamplingParams


def _rows(text: str) -> int | str | None:
    """``--packed-rows``: "off" -> None, "auto" as is, else a row count."""
    return None if text == "off" else text if text == "auto" else int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto", help="auto, none, int8, int4 or gguf")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps")
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--packed-head-rows", type=int, default=None,
                    help="as `ringserve serve --packed-head-rows`")
    ap.add_argument("--packed-rows", default="auto",
                    help="as `ringserve serve --packed-rows`: a row count, auto (the "
                    "server's default) or off")
    ap.add_argument("--rounded-copy-rows", type=int, default=None,
                    help="as `ringserve serve --rounded-copy-rows` (default off)")
    ap.add_argument("--step-tokens", type=int, default=2048,
                    help="as `ringserve serve --max-num-batched-tokens` (the server's CPU "
                    "default is 512)")
    ap.add_argument("--int16-activations", default="auto",
                    help="as `ringserve serve --int16-activations`")
    ap.add_argument("--greedy-head", default="auto",
                    help="as `ringserve serve --greedy-head`: auto or off")
    ap.add_argument("--shapes", action="store_true", help="group the table by input shapes")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--profile-prefill", action="store_true",
                    help="the profiler's table covers the prefill (every chunk) instead of "
                    "the decode steps")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    total = args.context + args.steps + args.profile_steps + 8
    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization,
              kv_cache_memory="2GiB",
              max_model_len=max(total, 256), max_num_seqs=max(args.batch, 1),
              packed_head_rows=args.packed_head_rows, packed_rows=_rows(args.packed_rows),
              rounded_copy_rows=args.rounded_copy_rows,
              max_num_batched_tokens=max(args.step_tokens, args.batch),
              int16_activations=args.int16_activations, greedy_head=args.greedy_head)
    engine = llm.engine
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=total - args.context, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        ids = [(7919 * j + 104729 * i) % (vocab - 10) + 5 for j in range(args.context)]
        engine.add_request(f"profile-{i}", {"prompt_token_ids": ids}, params)
    from torch.profiler import ProfilerActivity, profile

    def prefill_all() -> float:
        start = time.perf_counter()
        while engine.scheduler.waiting or any(
                s.num_computed < s.num_prompt_tokens for s in engine.scheduler.running):
            engine.step()
        return time.perf_counter() - start

    if args.profile_prefill:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=args.shapes) as prof:
            prefill = prefill_all()
        print(prof.key_averages(group_by_input_shape=args.shapes).table(
            sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=36,
            max_shapes_column_width=70))
    else:
        prefill = prefill_all()
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    if not args.profile_prefill:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=args.shapes) as prof:
            for _ in range(args.profile_steps):
                engine.step()
        print(prof.key_averages(group_by_input_shape=args.shapes).table(
            sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=36,
            max_shapes_column_width=70))
    median = statistics.median(times)
    print(f"{args.model} {engine.dtype} {engine.quantization} batch {args.batch}, "
          f"context {args.context}, packed rows {args.packed_rows}, rounded copy rows "
          f"{args.rounded_copy_rows}, step tokens {args.step_tokens}, greedy head "
          f"{args.greedy_head}, "
          f"{torch.get_num_threads()} threads: prefill {prefill * 1e3:.0f} ms; decode step "
          f"median {median * 1e3:.1f} ms, fastest {min(times) * 1e3:.1f} ms "
          f"({args.batch / median:.1f} tok/s); the table covers "
          f"{'the prefill' if args.profile_prefill else f'{args.profile_steps} steps'}")


if __name__ == "__main__":
    main()
