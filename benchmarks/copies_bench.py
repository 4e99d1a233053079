"""The served copies of a quantized linear side by side: the bf16 tiles (`quant_tiles`, 2 bytes
a value; multiplied by AMX tiles where the CPU has them) and the one-byte tiles (`int8_tiles`,
VNNI), beside oneDNN's bf16 GEMM over the same weight dequantized (a bf16 server's linear),
on gemma-3-270m's layer shapes, for the row counts a decode step and a prefill chunk have.

    python benchmarks/copies_bench.py                         # rows 1,2,4,8,16,32,64,512
    python benchmarks/copies_bench.py --rows 8,32 --quick

Each time is the median of many calls of one linear; "sum" rows add the four linears of a
layer (what a decoder layer multiplies). Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quant_linear_bench import make, median_ms  # (benchmarks/, this script's folder)

from ringserve.kernels import cpu_build, cpu_isa, cpu_quant
from ringserve.kernels.quant import QuantizedWeight, dequantize

# (name, n, k, bits, group): gemma-3-270m's layer linears as its GGUF stores them
# (benchmarks/quant_linear_bench.py's SHAPES, without the head).
SHAPES = [("qkv", 1536, 640, 8, 32), ("o", 640, 1024, 4, 32), ("gate_up", 4096, 640, 8, 32),
          ("down", 640, 2048, 8, 16)]


def timings(qw: QuantizedWeight, copy: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...],
                                              torch.Tensor],
            x: torch.Tensor, seconds: float) -> list[float]:
    """ms of one call: the bf16 tiles, the one-byte tiles, oneDNN over the bf16 weight."""
    tiles, tiles8, dense = copy
    return [median_ms(lambda: cpu_quant.quant_linear_tiles(x, tiles, qw, None), seconds),
            median_ms(lambda: cpu_quant.int8_tiles_linear(x, tiles8, qw, None), seconds),
            median_ms(lambda: torch.nn.functional.linear(x, dense), seconds)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,512")
    ap.add_argument("--quick", action="store_true", help="0.2 s a measurement, not 1 s")
    args = ap.parse_args()
    info = cpu_isa.info()
    variant = info.variant
    if not (cpu_quant.has_tiles() and cpu_quant.has_int8_tiles()):
        sys.exit(f"this CPU's {variant} kernels have no bf16 and one-byte tiles")
    amx = cpu_build.amx(variant)
    seconds = 0.2 if args.quick else 1.0
    print(f"{info.describe()}; {variant} kernels; {torch.get_num_threads()} threads; "
          f"bf16 tiles by {'AMX' if amx else 'dpbf16'}")
    cols = ["bf16 tiles", "1-byte VNNI", "oneDNN bf16"]
    print(f"{'linear':<8} {'rows':>5} " + " ".join(f"{c:>12}" for c in cols) + "   (ms)")
    torch.manual_seed(0)
    weights = [(name, make(n, k, bits, group)) for name, n, k, bits, group in SHAPES]
    copies = []
    for _, qw in weights:
        tiles8 = cpu_quant.int8_tiles(qw)
        assert tiles8 is not None  # (the layer shapes' groups divide k)
        copies.append((cpu_quant.quant_tiles(qw), tiles8, dequantize(qw, torch.bfloat16)))
    for rows in (int(r) for r in args.rows.split(",")):
        total = [0.0] * len(cols)
        for (name, qw), copy in zip(weights, copies, strict=True):
            times = timings(qw, copy, torch.randn(rows, qw.shape[1]).bfloat16(), seconds)
            total = [a + b for a, b in zip(total, times, strict=True)]
            print(f"{name:<8} {rows:>5} " + " ".join(f"{t:>12.3f}" for t in times))
        print(f"{'sum':<8} {rows:>5} " + " ".join(f"{t:>12.3f}" for t in total))

if __name__ == "__main__":
    main()
