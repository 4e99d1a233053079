"""The quantized linear paths of one CPU kernel variant side by side, on gemma-3-270m's GGUF
layouts, beside the memory-read ceiling measured in the same run.

Paths (`kernels.cpu_quant`): int16 activations (integer madd), float32 FMA over the weight
widened in registers (compact), and, on a variant with AVX512-BF16, dpbf16 with bf16
activations, beside its peer: torch's bf16 linear (oneDNN) over the same weight dequantized
to bf16, the GEMM a bf16 server runs (GFLOP/s for both). Each time is the median of many
calls; GB/s counts the weight bytes a call must read (values, scales, mins), and "of read"
is that against a 256 MB torch sum with the same threads (the ceiling of a one-row call;
more rows are compute-bound by design).

    python benchmarks/quant_linear_bench.py                     # this CPU's variant
    python benchmarks/quant_linear_bench.py --variant avx2      # as an AVX2-only CPU runs
    python benchmarks/quant_linear_bench.py --rows 1,8,32 --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# NOTE: as the server runs (engine/__init__.py), set before torch loads: torch's OpenMP
# threads sleep between regions and our kernels run on their own pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ringserve.kernels import cpu_build, cpu_isa
from ringserve.kernels.quant import QuantizedWeight, dequantize, quantize_int4, quantize_int8

# (name, n, k, bits, group): gemma-3-270m's linears as its Q4_K_M GGUF stores them
# (tests/test_gemma_preset.py checks these layouts), the head cut from 262,144 rows to
# 65,536 unless --full-head (it is the tied Q6_K embedding: int8 per 16 values).
SHAPES = [
    ("head", 65536, 640, 8, 16),
    ("qkv", 1536, 640, 8, 32),
    ("o", 640, 1024, 4, 32),
    ("gate_up", 4096, 640, 8, 32),
    ("down", 640, 2048, 8, 16),
]


def median_ms(fn: Callable[[], object], seconds: float) -> float:
    fn()
    fn()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 5:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def read_gbs() -> float:
    buffer = torch.ones(64 * 2**20, dtype=torch.float32)
    ms = median_ms(buffer.sum, 1.0)
    return buffer.nbytes / ms / 1e6


def make(n: int, k: int, bits: int, group: int) -> QuantizedWeight:
    weight = torch.randn(n, k) * 0.05
    return quantize_int8(weight, group) if bits == 8 else quantize_int4(weight, group,
                                                                         search=False)


def row(ops: object, name: str, qw: QuantizedWeight, x: torch.Tensor, seconds: float,
        bandwidth: float, dpbf16: bool) -> str:
    """One line of the table: the paths of one weight at ``x``'s row count."""
    (n, k), bits, group = qw.shape, qw.bits, qw.group
    args = (qw.qweight, qw.scales, qw.mins, bits, group, None)
    int16 = median_ms(lambda: ops.int16_act_linear(x, *args), seconds)  # type: ignore[attr-defined]
    fma = median_ms(lambda: ops.compact_linear(x, *args, 8), seconds)  # type: ignore[attr-defined]
    gbs = qw.nbytes / int16 / 1e6
    line = (f"{name:<8} {f'{n}x{k}':>12} {f'int{bits}/{group}':>9} {x.shape[0]:>4} "
            f"{int16:>9.3f} {gbs:>5.1f} {gbs / bandwidth:>7.2f} {fma:>7.3f} "
            f"{fma / int16:>9.2f}")
    if dpbf16:
        xb = x.bfloat16()
        bf = median_ms(lambda: ops.quant_linear(xb, *args, 12), seconds)  # type: ignore[attr-defined]
        # the peer: torch's bf16 linear (oneDNN) over the weight dequantized to bf16, what
        # a bf16 server (vLLM's CPU build) multiplies by
        dense = dequantize(qw, torch.bfloat16)
        peer = median_ms(lambda: torch.nn.functional.linear(xb, dense), seconds)
        flops = 2 * x.shape[0] * n * k
        line += f" {bf:>9.3f} {flops / bf / 1e6:>7.0f} {peer:>8.3f} {flops / peer / 1e6:>8.0f}"
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default=None, choices=cpu_isa.VARIANTS,
                    help="kernel variant (default: this CPU's)")
    ap.add_argument("--rows", default="1,4,8,32", help="x rows per call, comma-separated")
    ap.add_argument("--full-head", action="store_true", help="all 262,144 rows of the head")
    ap.add_argument("--quick", action="store_true", help="0.2 s a measurement, not 1 s")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variant = args.variant or cpu_isa.info().variant
    if variant not in cpu_isa.runnable_variants() or not cpu_build.available(variant):
        ap.error(f"this CPU ({cpu_isa.info().cls}) cannot run the {variant} kernels")
    ops = cpu_build.ops(variant)
    seconds = 0.2 if args.quick else 1.0
    bandwidth = read_gbs()
    print(f"{cpu_isa.info().describe()}; {variant} kernels; {torch.get_num_threads()} threads; "
          f"memory read {bandwidth:.1f} GB/s (64M-float torch sum, median)")
    dpbf16 = bool(ops.quant_linear_supported())
    header = f"{'linear':<8} {'n x k':>12} {'layout':>9} {'rows':>4} {'int16 ms':>9} " \
             f"{'GB/s':>5} {'of read':>7} {'fma ms':>7} {'fma/int16':>9}"
    print(header + (f" {'dpbf16 ms':>9} {'GFLOP/s':>7} {'torch ms':>8} {'GFLOP/s':>8}"
                    if dpbf16 else ""))
    torch.manual_seed(0)
    for name, n, k, bits, group in SHAPES:
        if name == "head" and args.full_head:
            n = 262144
        qw = make(n, k, bits, group)
        for rows in (int(r) for r in args.rows.split(",")):
            print(row(ops, name, qw, torch.randn(rows, k), seconds, bandwidth, dpbf16))


if __name__ == "__main__":
    main()
