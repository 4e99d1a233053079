"""Prefill attention on the CPU: the compiled kernel (`kernels/csrc/paged_prefill.cpp`)
against the torch path it replaced, in one process, on gemma-3-270m's attention shapes.

    python benchmarks/prefill_attention_bench.py            # bf16, this CPU's variant
    python benchmarks/prefill_attention_bench.py --dtype float32 --variant avx2

Each case is one layer's call (4 query heads over 1 kv head, d 256, blocks of 16) for the
batches a served core prefills: many short prompts, one long prompt, a chunk after a long
context. Times are medians of interleaved calls (the two paths take turns, so this host's
noise falls on both); the ratio is torch over compiled.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = {
    "16 prompts x 128, w 512": ([(0, 128)] * 16, 512),
    "16 prompts x 128, full": ([(0, 128)] * 16, None),
    "1 prompt x 1024, w 512": ([(0, 1024)], 512),
    "1 prompt x 1024, full": ([(0, 1024)], None),
    "chunk 512 after 1500, w 512": ([(1500, 512)], 512),
    "chunk 512 after 1500, full": ([(1500, 512)], None),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--variant", default=None,
                    help="as RINGSERVE_CPU_ISA: the class whose kernels run (avx2, portable)")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    if args.variant:  # read once, when the kernels first load
        os.environ["RINGSERVE_CPU_ISA"] = args.variant
    from ringserve import kernels
    from ringserve.kernels import cpu_attention, cpu_isa
    from tests.kernel_utils import make_case

    dtype = getattr(torch, args.dtype)
    print(f"{cpu_isa.info().describe()}; {torch.get_num_threads()} threads; {args.dtype}")
    print("| case | torch ms | compiled ms | torch / compiled |")
    print("|---|---|---|---|")
    for name, (seqs, window) in CASES.items():
        case = make_case(seqs, num_heads=4, num_kv_heads=1, head_dim=256, block_size=16,
                         window=window, ring=window is not None, dtype=dtype, poison=None, seed=0)
        if not cpu_attention.supports(case.query):  # loads the kernels
            raise SystemExit(f"no compiled CPU kernels for {cpu_isa.info().variant}")
        # NOTE: the compiled kernel explicitly: `backend="cpu"` serves prefill rows on
        # the torch path where the class does not take the kernel (portable)
        tensors, kwargs = case.tensors(), case.kwargs()
        paths = {
            "torch": functools.partial(kernels.paged_attention, *tensors, **kwargs,
                                       backend="torch"),
            "cpu": functools.partial(cpu_attention.paged_attention_cpu, *tensors, **kwargs,
                                     compiled_prefill=True),
        }
        times: dict[str, list[float]] = {"torch": [], "cpu": []}
        for run in paths.values():  # warm
            run()
        for _ in range(args.calls):
            for path, seen in times.items():
                start = time.perf_counter()
                paths[path]()
                seen.append(time.perf_counter() - start)
        ref, ours = (statistics.median(times[b]) * 1e3 for b in ("torch", "cpu"))
        print(f"| {name} | {ref:.2f} | {ours:.2f} | {ref / ours:.2f}x |")


if __name__ == "__main__":
    main()
