"""A few bf16 rows times a weight-only quantized weight, at memory speed (CPU).

`csrc/quant_gemm.cpp` reads the packed weight (`kernels/quant.py`'s layout) once, widens it
in registers and dots it with every row by AVX512-BF16's dpbf16 (exact products, float32
sums); steps of many rows widen it block by block into cache-sized tiles.
"""

from __future__ import annotations

import torch

from kernels.cpu_build import available
from kernels.quant import QuantizedWeight


def supports(qw: QuantizedWeight) -> bool:
    """Whether the compiled kernel serves this weight: a CPU weight in a layout it reads, and
    a build of the CPU ops with AVX512-BF16."""
    k = qw.shape[1]
    return (qw.qweight.device.type == "cpu" and k % (64 if qw.bits == 4 else 32) == 0
            and available() and bool(torch.ops.ringserve.quant_linear_supported()))  # fmt: skip


def quant_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None,
                 tile_rows: int = 8) -> torch.Tensor:
    """``x @ dequantize(qw).T + bias`` for bf16 x [m, k]; [m, n] bf16, any m.

    Up to ``tile_rows`` rows read the packed weight (widened in registers, per pass of 8
    rows); more rows widen blocks of it to bf16 once and read those from cache.
    """
    out: torch.Tensor = torch.ops.ringserve.quant_linear(
        x, qw.qweight, qw.scales, qw.mins, qw.bits, qw.group, bias, tile_rows)
    return out
