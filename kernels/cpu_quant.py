"""Rows times a weight-only quantized weight, at memory speed (CPU).

Two compiled paths read the packed weight (`kernels/quant.py`'s layout) once and widen it
in registers:
- bf16 activations on the avx512_bf16 variant (`csrc/quant_gemm.cpp`): dotted with every
  row by AVX512-BF16's dpbf16 (exact products, float32 sums); steps of many rows widen it
  block by block into cache-sized bf16 tiles.
- everything else (`csrc/compact_gemm.cpp`, every variant: AVX2, AVX-512, portable):
  each value widened to float32, scaled (plus its min) and multiplied by FMA; float32 or
  bf16 activations; many rows widen blocks into float32 tiles.
"""

from __future__ import annotations

import functools

import torch

from kernels import cpu_isa
from kernels.cpu_build import available, ops
from kernels.quant import QuantizedWeight


def supports(qw: QuantizedWeight) -> bool:
    """Whether a compiled kernel serves this weight: a CPU weight in a layout they read,
    and a build of the CPU ops (any variant)."""
    k = qw.shape[1]
    return (qw.qweight.device.type == "cpu" and k % (64 if qw.bits == 4 else 32) == 0
            and available())  # fmt: skip


@functools.cache
def _has_dpbf16(variant: str) -> bool:
    return bool(ops(variant).quant_linear_supported())


def dpbf16(x: torch.Tensor, variant: str | None = None) -> bool:
    """Whether ``x`` takes the dpbf16 path: bf16, on a variant built with AVX512-BF16
    (asked of the build once per variant, not on every call of the decode step)."""
    return x.dtype == torch.bfloat16 and _has_dpbf16(variant or cpu_isa.info().variant)


def quant_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None,
                 tile_rows: int = 8, variant: str | None = None) -> torch.Tensor:
    """``x @ dequantize(qw).T + bias`` for x [m, k] (bf16, or float32); [m, n] in x's dtype,
    any m.

    Up to ``tile_rows`` rows read the packed weight (widened in registers, per pass of 8
    rows); more rows widen blocks of it once and read those from cache. ``variant``: the
    kernel variant (`kernels.cpu_isa.VARIANTS`), default this CPU's.
    """
    if dpbf16(x, variant):
        out: torch.Tensor = ops(variant).quant_linear(
            x, qw.qweight, qw.scales, qw.mins, qw.bits, qw.group, bias, tile_rows)
    else:
        out = ops(variant).compact_linear(x, qw.qweight, qw.scales, qw.mins, qw.bits,
                                          qw.group, bias, min(tile_rows, 8))
    return out
