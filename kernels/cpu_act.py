"""A gated MLP's ``gelu(gate, approximate="tanh") * up`` in one compiled pass on bf16 CPU
rows (`csrc/act_mul.cpp`): the GELU is looked up in a table of torch's own results for all
65,536 bf16 values (made here once a process, by torch on this CPU), the product rounded as
torch's mul rounds it, so the bits are those of the two torch calls it replaces, on every
kernel variant.

Rather than trust the rounding, the first call per kernel variant compares the op with
torch on every bf16 value of ``gate`` (once) and uses it only if every bit agrees (logged
either way).

Float32 rows (the int16-activation path of AVX2 CPUs, ``--dtype float32``) take
``gelu_tanh_mul_f32``: the GELU computed in vectors as ``x * sigmoid(2u)``, within ~2e-6 of
the float64 value where torch's formula loses every digit on the negative side
(tests/test_act_mul.py), ~4x faster than torch's two ops on a Zen 3 at 32 rows. Not bits
equal to torch's, so the modules and the decode path (engine/models/fast_decode.py) both
take it, and their outputs stay equal. Only builds with a vector pass use it: the portable
build computes the same values in scalar C++, slower than torch's own vectors.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ringserve.kernels import cpu_isa
from ringserve.kernels.cpu_build import available, ops

logger = logging.getLogger(__name__)

# NOTE: torch's vector loop takes two vectors (64 bf16 values on AVX-512) a step and the
# rest of a row through its scalar formula (std::tanh, other bits): rows whose length 64
# divides are vectors only, in torch and here alike
_VECTOR = 64
# variant -> the op over the table, or None where it is not used
_ops: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None] = {}
# variant -> the float32 pass, or None where it is not used (`f32_op`)
_f32_ops: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None] = {}


def _every_bf16() -> torch.Tensor:
    """Every bf16 value, the one with bits b at flat index b, in rows of 1024 (a length
    torch runs through its vectors only)."""
    every = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return every.reshape(64, 1024)


@functools.cache
def table() -> torch.Tensor:
    """torch's ``gelu(x, approximate="tanh")`` of every bf16 value x, at x's bits: [65536]
    bf16."""
    return F.gelu(_every_bf16(), approximate="tanh").reshape(-1).contiguous()


def _bound(variant: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    op, lut = ops(variant).gelu_tanh_mul, table()

    def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = op(gate, up, lut)
        return out
    return gelu_tanh_mul


def _agrees(variant: str) -> bool:
    """Whether the op equals torch's gelu-then-mul on every bf16 value of gate, both as
    contiguous rows and as the halves of one fused [rows, 2n] tensor (the model's gate_up).
    NOTE: torch's own bits can depend on the layout: torch 2.6 and 2.10 on aarch64 gave
    other bits for some of a strided view's values (2.6: ~0.4%) than for the same values
    contiguous (run under qemu, 2026-12-05), so the op, which gives the contiguous ones, is
    used only where torch agrees with itself."""
    every = _every_bf16()
    up = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    op, fused = _bound(variant), torch.cat([every, up], dim=-1)
    for gate, u in ((every, up), fused.chunk(2, dim=-1)):
        got = op(gate, u)
        want = F.gelu(gate, approximate="tanh") * u
        if not bool(((got == want) | (got.isnan() & want.isnan())).all()):
            return False
    return True


def _op() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """This CPU's build of the op where it is used (built, and torch's bits on every
    value), else None."""
    variant = cpu_isa.info().variant
    if variant not in _ops:
        ok = available(variant) and _agrees(variant)
        _ops[variant] = _bound(variant) if ok else None
        logger.info("gelu(gate) * up: %s", "one compiled pass (every bf16 value as torch's)"
                    if ok else "torch's two ops (no compiled pass, or it differs from torch)")
    return _ops[variant]


def usable() -> bool:
    return _op() is not None


def f32_op() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The float32 pass of this CPU's build where it is used (a vector build), else None;
    looked up once per variant (every float32 MLP call asks)."""
    variant = cpu_isa.info().variant
    if variant not in _f32_ops:
        usable = variant != "portable" and available(variant)
        _f32_ops[variant] = ops(variant).gelu_tanh_mul_f32 if usable else None
    return _f32_ops[variant]


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """``gelu(gate, approximate="tanh") * up`` for CPU tensors [rows, n] with unit last
    stride: bf16 with n a multiple of 64 (torch's bits), or float32 (`f32_op`); None where
    the caller's torch ops must serve."""
    if gate.dim() != 2 or gate.device.type != "cpu":
        return None
    if gate.dtype == torch.float32:
        f32 = f32_op()
        if f32 is None or up.dtype != torch.float32 or up.shape != gate.shape or (
                gate.stride(1) != 1 or up.stride(1) != 1):
            return None
        return f32(gate, up)
    if gate.dtype != torch.bfloat16 or gate.shape[1] % _VECTOR:
        return None
    op = _op()
    if op is None or up.dtype != torch.bfloat16 or gate.stride(1) != 1 or up.stride(1) != 1:
        return None
    return op(gate, up)
