"""A gated MLP's ``gelu(gate, approximate="tanh") * up`` in one compiled pass on bf16 CPU
rows (`csrc/act_mul.cpp`): torch's own GELU code on ATen's vectors, rounded as torch's two
ops round, so the bits are those of the two torch calls it replaces.

That holds where the build's vectors are the ones torch dispatches to; rather than trust
it, the first call per kernel variant compares the op with torch on every bf16 value of
``gate`` (65,536 values, once) and uses it only if every bit agrees (logged either way).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from ringserve.kernels import cpu_isa
from ringserve.kernels.cpu_build import available, ops

logger = logging.getLogger(__name__)

# NOTE: torch's vector loop takes two vectors (64 bf16 values on AVX-512) a step and the
# rest of a row through its scalar formula (std::tanh, other bits): rows whose length 64
# divides are vectors only, in torch and here alike
_VECTOR = 64
_ops: dict[str, Any] = {}  # variant -> its op, or None where it is not used


def _agrees(variant: str) -> bool:
    """Whether the op equals torch's gelu-then-mul on every bf16 value of gate."""
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    gate = gate.view(torch.bfloat16).reshape(64, 1024)
    up = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    try:
        got = ops(variant).gelu_tanh_mul(gate, up)
    except RuntimeError:  # the portable build has no body
        return False
    want = F.gelu(gate, approximate="tanh") * up
    return bool(((got == want) | (got.isnan() & want.isnan())).all())


def _op() -> Any:
    """This CPU's build of the op where it is used (built, and torch's bits on every
    value), else None."""
    variant = cpu_isa.info().variant
    if variant not in _ops:
        ok = available(variant) and _agrees(variant)
        _ops[variant] = ops(variant).gelu_tanh_mul if ok else None
        logger.info("gelu(gate) * up: %s", "one compiled pass (every bf16 value as torch's)"
                    if ok else "torch's two ops (no compiled pass, or it differs from torch)")
    return _ops[variant]


def usable() -> bool:
    return _op() is not None


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """``gelu(gate, approximate="tanh") * up`` for bf16 CPU tensors [rows, n] with unit
    last stride and n a multiple of 64; None where the caller's torch ops must serve."""
    if (gate.dtype != torch.bfloat16 or gate.dim() != 2 or gate.shape[1] % _VECTOR
            or gate.device.type != "cpu"):
        return None
    op = _op()
    if op is None or up.dtype != torch.bfloat16 or gate.stride(1) != 1 or up.stride(1) != 1:
        return None
    out: torch.Tensor = op(gate, up)
    return out
