"""The quantize step: weight-only int8 / 4-bit linears, or a GGUF file's own blocks.

Methods (`--quantization`, `LLM(quantization=...)`):

    none   every weight in the model's dtype
    int8   symmetric int8 per group of `INT8_GROUP` values, every linear and the output head
    int4   4-bit per group of `INT4_GROUP` values with a scale and a min, every linear and
           the output head
    gguf   the blocks of the GGUF file the model is read from, repacked as they are read
           (`gguf_blocks.py`; Q8_0/Q5_0/Q6_K as int8 groups, Q4_0/Q4_1/Q4_K as 4-bit
           groups; `gguf_weights.py`); tensors the file stores in other block types are
           dequantized into the model's dtype
    auto   gguf for a model converted from a GGUF file on a CPU with the compiled kernels
           (every CPU class: bf16 activations by dpbf16 where the CPU has AVX512-BF16,
           float32 FMA elsewhere; what the user installed is what runs); none elsewhere

With float32 activations the quantized linears may also round their input rows to int16
blocks of 32 values and multiply by integer dot products (`--int16-activations`, see
`pick_int16_activations`): finer than bf16, at integer speed.

A tied output head and its embedding share one quantized table; the lookup widens only the
rows it reads. Quantized weights run on the CPU: on CUDA every method but none is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ringserve.engine.errors import InvalidRequestError
from ringserve.engine.loading.find import gguf_weights_file
from ringserve.engine.loading.gguf_blocks import SUPPORTED_TYPES
from ringserve.engine.loading.gguf_file import open_gguf
from ringserve.engine.loading.gguf_weights import GgufWeights, PendingLinear
from ringserve.engine.models.layers import Attention, RMSNorm
from ringserve.engine.models.moe import MoE
from ringserve.engine.models.packed_linear import Mxfp4Linear, PackedLinear
from ringserve.engine.models.quant_fuse import fuse_quantized
from ringserve.engine.models.quant_linear import QuantEmbedding, QuantLinear
from ringserve.kernels import cpu_build, cpu_isa, cpu_quant
from ringserve.kernels.quant import QuantizedWeight, quantize_int4, quantize_int8

logger = logging.getLogger("ringserve.engine")

METHODS = ("auto", "none", "int8", "int4", "gguf")
# NOTE: groups chosen by benchmarks/accuracy.py on gemma-3-270m (teacher forcing, 1,099
# positions of the seed article, against float32): int8 per output channel agreed on 92.1%
# of top-1 tokens, per 32 values 96.6%, per 16 values 97.2% (perplexity within 0.2%); the
# activations' outlier channels make a row-wide scale too coarse. 4-bit per 32 values is the
# finest 4-bit grid here and is still lossy on this model (README, quantization).
INT8_GROUP = 16
INT4_GROUP = 32


def pick_quantization(name: str | None, *, folder: Path, device: torch.device,
                      dtype: torch.dtype) -> tuple[str, str]:
    """The method to run and, for the start-up log, why.

    Raises:
        InvalidRequestError: an unknown method, gguf for a model with no GGUF blocks, or a
            quantized method on CUDA; naming the parameter ``quantization``.
    """
    name = (name or "auto").lower()
    if name not in METHODS:
        raise InvalidRequestError(f"quantization must be one of {', '.join(METHODS)}; got "
                                  f"{name!r}", param="quantization")  # fmt: skip
    has_blocks = has_gguf_blocks(folder)
    if name == "auto":
        if not has_blocks:
            return "none", "auto: not a GGUF model"
        if device.type != "cpu":
            return "none", "auto: quantized weights run on the CPU only"
        if dtype not in (torch.bfloat16, torch.float32) or not cpu_build.available():
            return "none", ("auto: the quantized kernels need float32 or bfloat16 activations "
                            "and the compiled CPU kernels")  # fmt: skip
        return "gguf", "auto: the GGUF file's own blocks"
    if name != "none" and device.type != "cpu":
        raise InvalidRequestError(
            f"quantization {name!r} runs on the CPU only; on {device.type} serve "
            "quantization='none' (bfloat16 or float16 weights)", param="quantization")
    if name == "gguf" and not has_blocks:
        raise InvalidRequestError(
            "quantization 'gguf' needs a model read from a .gguf file (or a preset) that "
            f"stores blocks; {folder} has none", param="quantization")
    return name, "asked for"


def has_gguf_blocks(folder: Path) -> bool:
    """Whether the model is read from a GGUF file that stores matrices in a block type
    served as stored (from the file's header alone)."""
    source = gguf_weights_file(folder)
    return source is not None and any(t.tensor_type in SUPPORTED_TYPES
                                      for t in open_gguf(source).tensors)


INT16_ACTIVATIONS = ("auto", "on", "off")


def pick_int16_activations(name: str | None, *, quantization: str,
                          dtype: torch.dtype, mxfp4: bool = False) -> tuple[bool, str]:
    """Whether the quantized linears round float32 activations to int16 blocks and multiply
    by integer dot products, and, for the start-up log, why.

    auto: on for quantized weights (a quantization method, or ``mxfp4``: MXFP4 experts
    served as stored, as gpt-oss publishes them) with float32 activations on a CPU without
    bf16 arithmetic (AVX2-only, AVX-512 without BF16) whose kernels have the SIMD dot product:
    there the float32 FMA path is compute-bound at ~3x its weight-read time (measured in
    benchmarks/results/int16_activations.md). Elsewhere bf16 activations (dpbf16) or float32
    FMA stay, exact to float32.

    Raises:
        InvalidRequestError: an unknown value, or "on" where no int16-activation path exists
            (no quantized weights, activations not float32, no compiled kernels); naming
            ``int16_activations``.
    """
    name = (name or "auto").lower()
    if name not in INT16_ACTIVATIONS:
        raise InvalidRequestError(f"int16_activations must be one of "
                                  f"{', '.join(INT16_ACTIVATIONS)}; got {name!r}",
                                  param="int16_activations")  # fmt: skip
    if name == "off":
        return False, "off: asked for"
    problem = None
    if quantization == "none" and not mxfp4:
        problem = "the weights are not quantized (quantization none)"
    elif dtype != torch.float32:
        problem = f"the activations are {str(dtype).removeprefix('torch.')}, not float32"
    elif not cpu_build.available():
        problem = "the compiled CPU kernels are not available"
    if name == "on":
        if problem:
            raise InvalidRequestError(f"int16_activations on: {problem}",
                                      param="int16_activations")
        return True, "on: asked for"
    if problem:
        return False, f"auto: {problem}"
    if cpu_isa.bf16_arithmetic():
        return False, "auto: this CPU has bf16 arithmetic; float32 stays float32"
    if not cpu_quant.int16_act_fast():
        return False, f"auto: the {cpu_isa.info().variant} kernels have no SIMD int16 dot"
    experts = " (the MXFP4 experts)" if quantization == "none" else ""
    return True, f"auto: {cpu_isa.info().cls} CPU without bf16 arithmetic{experts}"


def quantize_model(model: nn.Module, method: str, gguf: GgufWeights | None) -> None:
    """Replace the model's linears (and a tied embedding) by quantized ones, in place.

    Runs after the weights are loaded and q/k/v and gate/up are fused, before the
    remaining float linears are packed. ``method`` is what `pick_quantization` returned;
    ``gguf`` the file the model is read from, whose blocks stand in for the
    `PendingLinear` modules ("gguf"). `apply_int16_activations` runs next.
    """
    if method == "none":
        return
    if method == "gguf":
        if gguf is None:
            raise ValueError("quantization gguf needs the GGUF file the model is read from")
        replaced = _from_blocks(model, gguf)
        fuse_quantized(model)
        missing = sorted(n for n, m in model.named_modules() if type(m) is nn.Linear)
        if missing:
            logger.info("gguf: %d linears stored in block types with no layout here stay "
                        "in the model's dtype: %s", len(missing), ", ".join(missing[:4]))
    else:
        def make(_name: str, linear: nn.Linear) -> QuantizedWeight | None:
            return _quantize(linear.weight, method)

        replaced = _replace(model, make)
    logger.info("quantization %s: %d linears quantized", method, replaced)
    slow = [m for m in model.modules() if isinstance(m, QuantLinear) and not m.kernel]
    dtype = next(iter(model.parameters())).dtype
    if slow or dtype not in (torch.bfloat16, torch.float32):
        logger.warning("quantization %s without the compiled kernels (they need float32 or "
                       "bfloat16 activations and a C++ compiler): every step widens the "
                       "weights, slower than quantization='none'", method)


def apply_int16_activations(model: nn.Module, on: bool) -> None:
    """Give every layer the model's int16-activation decision (`pick_int16_activations`):
    the quantized linears whose kernel reads int16 blocks, the MXFP4 experts, and the norms
    and rotary, whatever the quantization method (gpt-oss as published has MXFP4 experts
    and no method)."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.int16_acts = on and module.kernel and cpu_quant.int16_act_supports(module.qw)
        elif isinstance(module, Mxfp4Linear):
            module.int16_acts = on
        elif isinstance(module, (RMSNorm, Attention)):
            # NOTE: rounded activations already part from float32 transformers at the 1e-5
            # level, so the norms and rotary may sum in their compiled order too (one pass
            # instead of ~10 ATen ops each: ~3 ms of a 15 ms gemma-3-270m step on AVX2).
            module.float32_kernel = on


def _from_blocks(model: nn.Module, gguf: GgufWeights) -> int:
    """Give every `PendingLinear` its GGUF blocks (read and repacked one tensor at a time):
    a `QuantLinear` in its place, the token embedding a `QuantEmbedding` over the same
    blocks (the head's where they are tied)."""
    pending = {f"{path}.weight": (path, module) for path, module in model.named_modules()
               if isinstance(module, PendingLinear)}
    blocks = gguf.blocks_for(list(pending))  # a tied head's name: its embedding's blocks
    layers: dict[str, QuantLinear] = {}
    for name, (path, module) in pending.items():
        if name not in blocks:
            raise ValueError(f"{name}: its GGUF blocks could not be repacked")
        qw = blocks[name]
        if qw.shape != module.shape:
            raise ValueError(f"{path}: GGUF blocks {qw.shape} do not match {module.shape}")
        layers[path] = QuantLinear(qw, module.bias)
    for path, layer in layers.items():
        if path != "model.embed_tokens":
            parent, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, layer)
    if "model.embed_tokens" in layers:
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        head = getattr(model, "lm_head", None)
        tied = isinstance(head, QuantLinear) and head.qweight is \
            layers["model.embed_tokens"].qweight
        table = head if tied else layers["model.embed_tokens"]
        model.model.embed_tokens = QuantEmbedding(table, dtype, owned=not tied)  # type: ignore[union-attr,arg-type]
    return len(layers)


def _quantize(weight: torch.Tensor, method: str) -> QuantizedWeight | None:
    k = weight.shape[1]
    if method == "int8" and k % 32 == 0:
        return quantize_int8(weight, INT8_GROUP)
    if method == "int4" and k % 64 == 0 and k % INT4_GROUP == 0:
        return quantize_int4(weight, INT4_GROUP)
    return None  # a width the kernel does not read: the layer stays in the model's dtype


def _embedding(model: nn.Module) -> tuple[nn.Embedding | None, bool]:
    """The model's float embedding (None once quantized) and whether the head reads its
    table (a tied head, plain or packed: `PackedLinear` keeps the plain weight)."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not isinstance(embed, nn.Embedding):
        return None, False
    return embed, getattr(getattr(model, "lm_head", None), "weight", None) is embed.weight


def _replace(model: nn.Module,
             make: Callable[[str, nn.Linear], QuantizedWeight | None]) -> int:
    """Swap every `nn.Linear` for which ``make(weight name, linear)`` gives a weight."""
    embed, tied = _embedding(model)
    head = getattr(model, "lm_head", None)
    targets = [(parent, child_name, child, f"{prefix}.{child_name}".lstrip("."))
               for prefix, parent in model.named_modules()
               for child_name, child in parent.named_children()
               if type(child) is nn.Linear]  # fmt: skip
    count = 0
    for parent, child_name, child, path in targets:
        qw = make(f"{path}.weight", child)
        if qw is None:
            continue
        if qw.shape != tuple(child.weight.shape):
            raise ValueError(f"{path}: quantized weight {qw.shape} does not match "
                             f"{tuple(child.weight.shape)}")  # fmt: skip
        layer = QuantLinear(qw, child.bias)
        setattr(parent, child_name, layer)
        count += 1
        if tied and child is head:
            assert embed is not None  # tied: the head reads its table
            out = getattr(embed, "out_dtype", embed.weight.dtype)  # a WideningEmbedding's
            model.model.embed_tokens = QuantEmbedding(layer, out)  # type: ignore[union-attr,operator]
    return count


@dataclass(frozen=True)
class WeightBytes:
    """What the weights cost: held in memory, and read by one decode step."""

    resident: int
    per_token: int
    copies: int = 0  # of ``resident``: copies beside a weight (packed, widened, the head's)

    def describe(self) -> str:
        return (f"weights {self.resident / 2**20:.1f} MiB; a decode step reads "
                f"{self.per_token / 2**20:.1f} MiB of them")  # fmt: skip


def weight_bytes(model: nn.Module) -> WeightBytes:
    """Bytes of every parameter and buffer (shared ones once), and those a decode step reads:
    all but the embedding tables that are only looked up (Gemma 4's per-layer one too), one
    of a `PackedLinear`'s two copies (the decode path reads the plain one), and of a
    mixture of experts the ``k`` of ``E`` experts a token is routed to."""
    seen: set[int] = set()
    resident = per_token = copies = 0
    embed, tied = _embedding(model)
    lookup_only = {id(embed.weight)} if embed is not None and not tied else set()
    per_layer = getattr(getattr(model, "model", None), "embed_tokens_per_layer", None)
    if isinstance(per_layer, nn.Embedding):
        lookup_only.add(id(per_layer.weight))
    for module in model.modules():  # a GGUF's own embedding table, in blocks
        if isinstance(module, QuantEmbedding) and module.owned:
            lookup_only |= {id(t) for t in module.buffers() if t is not None}
    share: dict[int, float] = {}  # a tensor read by a share of the tokens
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        if moe.linears is not None:
            for tensor in [*moe.linears.parameters(), *moe.linears.buffers()]:
                share[id(tensor)] = moe.top_k / moe.num_experts
    for module in model.modules():
        # a packed copy beside a plain or quantized weight: the decode path reads the other
        skip = module.packed if isinstance(module, (PackedLinear, QuantLinear)) else None
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            size = tensor.numel() * tensor.element_size()
            resident += size
            if tensor is skip:
                copies += size
            if id(tensor) not in lookup_only and tensor is not skip:
                per_token += round(size * share.get(id(tensor), 1.0))
        if isinstance(module, QuantLinear):
            # widened or rounded copies beside the quantized weight (not buffers, but for
            # oneDNN's `packed`, counted above: see QuantLinear)
            extra = sum(t.numel() * t.element_size() for t in module.copies()
                        if t is not module.packed)
            resident += extra
            copies += extra
        if isinstance(module, QuantLinear) and module.greedy is not None:
            resident += module.greedy.nbytes()  # engine.models.greedy_head's copy
            copies += module.greedy.nbytes()
    return WeightBytes(resident, per_token, copies)


