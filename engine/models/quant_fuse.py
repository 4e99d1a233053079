"""Fusing quantized projections at load time: q/k/v and gate/up `QuantLinear`s that
arrive one by one (a GGUF file's blocks) become one module each where their layouts agree,
the quantized twin of `packed_linear.fuse_projections`."""

from __future__ import annotations

import torch
from torch import nn

from ringserve.engine.models.layers import MLP, Attention
from ringserve.engine.models.quant_linear import QuantLinear
from ringserve.kernels.quant import QuantizedWeight


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight | None:
    """One weight computing ``weights`` side by side (outputs concatenated), or None where
    their layouts differ (bits, group or width), so they cannot be one matmul."""
    first = weights[0]
    if any((w.bits, w.group, w.shape[1]) != (first.bits, first.group, first.shape[1])
           for w in weights):  # fmt: skip
        return None
    mins = None if first.mins is None else torch.cat([w.mins for w in weights])  # type: ignore[misc]
    return QuantizedWeight(first.bits, first.group, torch.cat([w.qweight for w in weights]),
                           torch.cat([w.scales for w in weights]), mins)


def _concat_linears(layers: list[QuantLinear]) -> QuantLinear | None:
    fused = concat_rows([layer.qw for layer in layers])
    if fused is None:
        return None
    biases = [layer.bias for layer in layers]
    bias = None if biases[0] is None else torch.cat(biases)  # type: ignore[arg-type]
    return QuantLinear(fused, bias)


def fuse_quantized(model: nn.Module) -> int:
    """Fuse q/k/v and gate/up `QuantLinear`s into one each where their layouts agree.

    The quantized twin of `packed_linear.fuse_projections`, for weights that arrive
    quantized one by one (a GGUF file's blocks): a GGUF may store q and v in different
    block types, and those stay separate.

    Returns:
        The number of modules fused.
    """
    count = 0
    for module in model.modules():
        if isinstance(module, Attention) and not module.fused:
            names = module.proj_names  # q, k, v; q, k where the values are the keys
            target = "qkv_proj"
        elif isinstance(module, MLP) and not module.fused:
            names, target = ["gate_proj", "up_proj"], "gate_up_proj"
        else:
            continue
        parts = [getattr(module, name) for name in names]
        if len(parts) < 2 or not all(isinstance(p, QuantLinear) for p in parts):
            continue
        fused = _concat_linears(parts)
        if fused is None:
            continue
        setattr(module, target, fused)
        for name in names:
            delattr(module, name)
        module.fused = True
        count += 1
    return count
