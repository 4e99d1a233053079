"""Rows times a weight-only quantized weight, at memory speed (CPU).

Two compiled paths read the packed weight (`kernels/quant.py`'s layout) once and widen it
in registers:
- bf16 activations on the avx512_bf16 variant (`csrc/quant_gemm.cpp`): dotted with every
  row by AVX512-BF16's dpbf16 (exact products, float32 sums); steps of many rows widen it
  block by block into cache-sized bf16 tiles.
- float32 activations rounded to int16 blocks (`csrc/int16_act_gemm.cpp`, where the
  model runs with int16 activations: `int16_act_linear`): weight values widened to int16
  and multiplied by AVX2's madd, 16 a instruction; the default for quantized weights on
  CPUs without bf16 arithmetic.
- bf16 steps of a few rows over a copy of the integers alone, int8 one byte a value and
  4-bit two a byte (`csrc/int8_tiles.cpp`, `int8_tiles_linear`): x rounded to int16 blocks
  as above, the copy's values widened to int16 and multiplied by AVX-512's vpdpwssd; half
  (int8) or a quarter (4-bit) of the bf16 tiles' bytes.
- everything else (`csrc/compact_gemm.cpp`, every variant: AVX2, AVX-512, portable):
  each value widened to float32, scaled (plus its min) and multiplied by FMA; float32 or
  bf16 activations; many rows widen blocks into float32 tiles.
"""

from __future__ import annotations

import functools

import torch

from ringserve.kernels import cpu_isa
from ringserve.kernels.cpu_build import available, ops
from ringserve.kernels.quant import QuantizedWeight


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


def int16_act_fast(variant: str | None = None) -> bool:
    """Whether ``variant``'s build (default this CPU's) has the SIMD int16-activation kernel
    (AVX2 and up; the portable build computes the same sums in plain C++, slowly)."""
    return _int16_act_fast(variant or cpu_isa.info().variant)


@functools.cache
def _int16_act_fast(variant: str) -> bool:
    return available(variant) and bool(ops(variant).int16_act_fast())


def int16_act_supports(qw: QuantizedWeight) -> bool:
    """Whether `int16_act_linear` reads this weight: groups of 16 (int8) or of 32n."""
    return qw.group % 32 == 0 or (qw.bits == 8 and qw.group == 16)


def int16_act_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None,
                    variant: str | None = None) -> torch.Tensor:
    """``x @ dequantize(qw).T + bias`` with x [m, k] float32 rounded to int16 blocks of 32
    values (`kernels.quant.int16_act_matmul_reference` is exactly what it computes, up to
    float32 sums); [m, n] float32."""
    out: torch.Tensor = ops(variant).int16_act_linear(x, qw.qweight, qw.scales, qw.mins,
                                                     qw.bits, qw.group, bias)
    return out


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


def has_tiles(variant: str | None = None) -> bool:
    """Whether ``variant``'s build (default this CPU's) can keep a weight widened into
    tiles (`quant_tiles`): the dpbf16 builds."""
    v = variant or cpu_isa.info().variant
    return available(v) and _has_dpbf16(v)


def has_int8_tiles(variant: str | None = None) -> bool:
    """Whether ``variant``'s build (default this CPU's) multiplies `int8_tiles` copies (the
    AVX-512 builds: vpdpwssd, or madd where there is no VNNI)."""
    return _has_int8_tiles(variant or cpu_isa.info().variant)


@functools.cache
def _has_int8_tiles(variant: str) -> bool:
    return available(variant) and bool(ops(variant).int8_tiles_fast())


def int8_tiles(qw: QuantizedWeight, variant: str | None = None) -> tuple[torch.Tensor, ...] | None:
    """``qw``'s values copied once into tiles of 32 weight rows in dpbf16's pair layout, one
    byte a value (4-bit: two a byte, rows 0-15 of a tile in the low half, 16-31 in the high),
    float16 scales (and 4-bit mins) beside them (`int8_tiles_linear`); None for a layout
    they do not take (groups other than 16 for int8 or a multiple of 32)."""
    if not int16_act_supports(qw):
        return None
    return tuple(ops(variant).int8_tiles(qw.qweight, qw.scales, qw.mins, qw.bits, qw.group))


def int8_tiles_linear(x: torch.Tensor, tiles: tuple[torch.Tensor, ...], qw: QuantizedWeight,
                      bias: torch.Tensor | None, variant: str | None = None) -> torch.Tensor:
    """``x @ dequantize(qw).T + bias`` for x [m, k] (bf16 or float32) rounded to int16 blocks
    of 32 values (`kernels.quant.int16_act_matmul_reference`, up to float32 sums), over
    `int8_tiles`' copy of ``qw``; [m, n] in x's dtype."""
    out: torch.Tensor = ops(variant).int8_tiles_linear(x, *tiles, qw.bits, qw.group,
                                                       qw.shape[0], bias)
    return out


def quant_tiles(qw: QuantizedWeight, variant: str | None = None) -> tuple[torch.Tensor, ...]:
    """``qw`` widened once into the bf16 tiles the many-row path builds on every call
    (tiles, scales, mins; about 2 bytes a value): `quant_linear_tiles` then multiplies
    without widening, with the same sums as `quant_linear`'s many-row path."""
    return tuple(ops(variant).quant_tiles(qw.qweight, qw.scales, qw.mins, qw.bits, qw.group))


def quant_linear_tiles(x: torch.Tensor, tiles: tuple[torch.Tensor, ...], qw: QuantizedWeight,
                       bias: torch.Tensor | None, variant: str | None = None) -> torch.Tensor:
    """``x @ dequantize(qw).T + bias`` for bf16 x [m, k] over `quant_tiles`' copy of ``qw``."""
    out: torch.Tensor = ops(variant).quant_linear_tiles(x, *tiles, qw.bits, qw.group,
                                                        qw.shape[0], bias)
    return out
