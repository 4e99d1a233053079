"""A few rows times a bf16 weight at memory speed, and bf16 weights on CPUs without bf16
arithmetic.

Two compiled paths (`kernels/csrc`):
- `linear_small` (`small_gemm.cpp`, the avx512_bf16 variant only): bf16 rows dotted with
  each weight row by AVX512-BF16's dpbf16 (exact products, float32 sums, one bf16 rounding).
- `compact_linear` (`compact_gemm.cpp`, every variant): the weight stays bf16 in memory and
  is widened in registers (a shift), every product and sum float32 FMA, for float32 or bf16
  activations and any number of rows. It serves the bf16 linears where torch's oneDNN
  packing is refused (AVX2-only CPUs) or capped off (`kernels.cpu_isa`).
"""

from __future__ import annotations

import torch

from ringserve.kernels.cpu_build import available, ops

# NOTE: up to this many rows each weight row is widened in registers per pass of 8 rows;
# more rows widen blocks of the weight into float32 tiles (measured here on gemma-3-270m's
# widths, AVX2 variant: even at 8-16 rows, the tiles ahead from 16 on).
COMPACT_TILE_ROWS = 8


def supports(weight: torch.Tensor) -> bool:
    """Whether `linear_small` runs its own loop for this weight: a bf16 CPU tensor, and a
    build of the CPU ops with AVX512-BF16 (elsewhere callers keep their GEMM)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and available()
            and int(ops().linear_small_max()) > 0)  # fmt: skip


def linear_small(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for x of at most 8 rows.

    Args:
        x: [m, k] bf16, m <= 8.
        weight: [n, k] bf16.
        bias: [n] bf16 or None.

    Returns:
        [m, n] bf16.
    """
    out: torch.Tensor = ops().linear_small(x.contiguous(), weight.contiguous(), bias)
    return out


def compact_supports(weight: torch.Tensor) -> bool:
    """Whether `compact_linear` serves this weight: bf16 on the CPU, with the ops built."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and available()


def compact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   variant: str | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in float32 arithmetic over a bf16 weight.

    Args:
        x: [m, k] float32 or bf16, any m.
        weight: [n, k] bf16, contiguous.
        bias: [n] or None.
        variant: the kernel variant (`kernels.cpu_isa.VARIANTS`); default this CPU's.

    Returns:
        [m, n] in x's dtype, each value one float32 sum rounded once.
    """
    out: torch.Tensor = ops(variant).compact_linear(x, weight, None, None, 16, 0, bias,
                                                    COMPACT_TILE_ROWS)
    return out


def mxfp4_linear(x: torch.Tensor, blocks: torch.Tensor, exponents: torch.Tensor,
                 bias: torch.Tensor | None, variant: str | None = None,
                 split: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias`` over an MXFP4 weight read as a checkpoint stores it: each
    value its exact E2M1 value times its block's power of two, float32 FMA.

    Args:
        x: [m, k] float32 or bf16 (k a multiple of 32).
        blocks: uint8 [n, k / 32, 16]: two E2M1 codes a byte, value 2i in byte i's low
            nibble and 2i + 1 in its high one (transformers' order), or with ``split``
            (GGUF's order) value i in byte i's low nibble and 16 + i in its high one.
        exponents: uint8 [n, k / 32]: E8M0, the block's 2^(e - 127).
        bias: [n] or None.
        variant: the kernel variant (`kernels.cpu_isa.VARIANTS`); default this CPU's.

    Returns:
        [m, n] in x's dtype, each value one float32 sum rounded once.
    """
    out: torch.Tensor = ops(variant).mxfp4_linear(x, blocks, exponents, bias, COMPACT_TILE_ROWS,
                                                  split)
    return out


def int16_act_mxfp4_linear(x: torch.Tensor, blocks: torch.Tensor, exponents: torch.Tensor,
                           bias: torch.Tensor | None, variant: str | None = None,
                           split: bool = False) -> torch.Tensor:
    """`mxfp4_linear` for a model that runs with int16 activations (CPUs without bf16
    arithmetic, `engine.loading.quantize.pick_int16_activations`): x rounded to int16 blocks
    of 32 values (`kernels.quant.quantize_activations`), each weight value twice its E2M1
    value as an integer, integer dot products scaled by half the block's power of two
    (csrc/int16_act_gemm.cpp): the rounded x times the dequantized weight, up to float32
    sums of exact int32 block sums.

    Args:
        x: [m, k] float32 (k a multiple of 32).
        blocks, exponents, bias, split: as `mxfp4_linear`.
        variant: the kernel variant (`kernels.cpu_isa.VARIANTS`); default this CPU's.

    Returns:
        [m, n] float32.
    """
    out: torch.Tensor = ops(variant).int16_act_mxfp4_linear(x, blocks, exponents, bias, split)
    return out
