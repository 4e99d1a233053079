"""MXFP4 expert weights (gpt-oss checkpoints), read as they are stored and widened once.

An MXFP4 tensor ``name`` is stored as two: ``name_blocks`` [..., rows, G, 16] uint8, each
byte two FP4 (E2M1) values of a block of 32 (element 2i in the low nibble, 2i + 1 in the
high), and ``name_scales`` [..., rows, G] uint8, one power of two a block, biased by 127
(the OCP microscaling format's E8M0). The weight is [..., rows, G * 32] in that layout;
gpt-oss's parameters hold its transpose ([experts, in, out]), as transformers' do.

`merge_mxfp4` turns each pair of a checkpoint's tensors into the float tensor the model's
parameter takes (widened once at load: the experts then run in the model's dtype), where
no CPU kernels are built (CUDA). A CPU serves the pairs as they are stored, 4.25 bits a
weight (`engine.models.packed_linear.Mxfp4Linear`, `engine.loading.build`).
`quantize_mxfp4` is the inverse, for tests that make MXFP4 checkpoints of their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from ringserve.engine.loading.errors import ModelLoadError

# E2M1: sign, two exponent bits, one mantissa bit; codes 0-7 positive, 8-15 their negatives
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip
BLOCK = 32
_BLOCKS, _SCALES = "_blocks", "_scales"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., G, 16] uint8 codes and [..., G] uint8 exponents -> float32 [..., G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ModelLoadError("mxfp4 blocks and scales must be uint8")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ModelLoadError(f"mxfp4 blocks {list(blocks.shape)} do not match scales "
                             f"{list(scales.shape)}")  # fmt: skip
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., G, 16, 2]
    values = table[codes].flatten(-2)  # [..., G, 32]: low nibble first
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., K] (K % 32 == 0) -> (blocks, scales): each block's power of two puts its
    largest value in [4, 8), and every value is rounded to the nearest FP4 magnitude (ties
    to the smaller one; beyond 6 it is 6)."""
    *lead, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"mxfp4 needs the last dim a multiple of {BLOCK}, got {k}")
    blocks = weight.detach().float().reshape(*lead, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1).clamp(min=2.0**-126)
    exponent = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    scaled = blocks / torch.ldexp(torch.ones_like(amax), exponent.int()).unsqueeze(-1)
    table = torch.tensor(FP4_VALUES[:8])
    nearest = (scaled.abs().unsqueeze(-1) - table).abs().argmin(-1)  # magnitude code 0-7
    codes = (nearest + 8 * (scaled < 0).long()).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exponent + 127).to(torch.uint8).contiguous()


def merge_mxfp4(weights: Iterable[tuple[str, torch.Tensor]],
                transpose: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every ``X_blocks`` / ``X_scales`` pair replaced by
    ``X``, widened to float32 (its last two dims swapped when ``transpose``, to the
    [experts, in, out] layout of the parameters); other tensors pass through, and so does a
    lone ``_blocks`` or ``_scales`` tensor (at the end), which is then not MXFP4.
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        kind = _BLOCKS if name.endswith(_BLOCKS) else _SCALES if name.endswith(_SCALES) else ""
        if not kind:
            yield name, tensor
            continue
        base = name[: -len(kind)]
        parts = pending.setdefault(base, {})
        parts[kind] = tensor
        if len(parts) == 2:
            del pending[base]
            full = dequantize_mxfp4(parts[_BLOCKS], parts[_SCALES])
            yield base, (full.transpose(-1, -2).contiguous() if transpose else full)
    for base, parts in pending.items():
        for kind, tensor in parts.items():
            yield base + kind, tensor
