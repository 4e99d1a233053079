"""A few rows times a bf16 weight, at memory speed: the decode step's GEMV on the CPU.

`csrc/small_gemm.cpp` streams each weight row once and dots it with every input row
(AVX512-BF16's dpbf16: exact products, float32 sums, one bf16 rounding).
"""

from __future__ import annotations

import torch

from kernels.cpu_build import available


def supports(weight: torch.Tensor) -> bool:
    """Whether `linear_small` runs its own loop for this weight: a bf16 CPU tensor, and a
    build of the CPU ops with AVX512-BF16 (elsewhere callers keep their GEMM)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and available()
            and int(torch.ops.ringserve.linear_small_max()) > 0)  # fmt: skip


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
    out: torch.Tensor = torch.ops.ringserve.linear_small(
        x.contiguous(), weight.contiguous(), bias)
    return out
