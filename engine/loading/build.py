"""Build one of our models from a local HF folder: config, weights, dtype, device.

The last loading step: the folder has been found (and converted) by `resolve_model` and is
read through `checkpoint.py`; here our `CausalLM` is built, filled and packed for oneDNN.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ringserve.engine.kv_cache import model_layer_groups
from ringserve.engine.loading.checkpoint import (
    check_model_type,
    iter_weights,
    load_hf_config,
    stored_tensors,
)
from ringserve.engine.loading.errors import ModelLoadError
from ringserve.engine.loading.find import gguf_weights_file
from ringserve.engine.loading.gguf_file import open_gguf
from ringserve.engine.loading.gguf_weights import GgufWeights, PendingLinear, saved_parameters
from ringserve.engine.loading.mxfp4 import merge_mxfp4
from ringserve.engine.loading.quantize import apply_int16_activations, quantize_model
from ringserve.engine.models import SUPPORTED_MODEL_TYPES, CausalLM, model_config_from_hf
from ringserve.engine.models.layers import WideningEmbedding
from ringserve.engine.models.moe import ExpertLinears, MoE, split_experts
from ringserve.engine.models.packed_linear import (
    CompactLinear,
    Mxfp4Linear,
    can_compact,
    can_pack,
    fuse_projections,
    pack_linears,
)
from ringserve.kernels import cpu_build


def load_model(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    hf_config: Any | None = None,
    pack: bool = True,
    quantization: str = "none",
    int16_activations: bool = False,
) -> CausalLM:
    """Our `CausalLM` for the checkpoint in ``path``, weights loaded, in eval mode.

    Args:
        path: a local HF folder (see `engine.loading.resolve_model`).
        dtype: parameter dtype (float32, bfloat16 or float16).
        device: where the parameters live.
        hf_config: the folder's transformers config, if already loaded.
        pack: reorder bf16 linear weights once for oneDNN where the CPU allows it
            (`engine.models.packed_linear.can_pack`), or serve them by our float32-FMA
            kernel where it does not (`can_compact`: AVX2-only CPUs).
        quantization: a method `quantize.pick_quantization` returned: "none", "int8",
            "int4" or "gguf" (the folder's repacked GGUF blocks).
        int16_activations: whether the quantized linears round float32 activations to int8
            blocks (`quantize.pick_int16_activations`).

    Raises:
        UnsupportedModelError: the model_type is not implemented (named in the message).
        UnsupportedConfigError: the config asks for a feature we do not implement.
        ValueError: the weights do not match the config.
    """
    hf_config = hf_config if hf_config is not None else load_hf_config(path)
    check_model_type(hf_config, SUPPORTED_MODEL_TYPES)
    cfg = model_config_from_hf(hf_config)
    # NOTE: built on the meta device so no memory is spent on a random init we overwrite,
    # and with torch's initializers skipped: on the meta device their first call imports
    # torch's decompositions (~3 s and ~100 MB of a process's start, measured)
    with torch.device("meta"), _no_init():
        model = CausalLM(cfg, model_layer_groups(cfg)).to(dtype)
    source = gguf_weights_file(path)  # a GGUF's metadata folder: weights from the file
    gguf = GgufWeights(open_gguf(source), hf_config, saved_parameters(Path(path))) \
        if source is not None else None
    stored = gguf.stored() if gguf is not None else stored_tensors(path)
    # MXFP4 experts: served as stored on a CPU (never widened), widened once elsewhere
    native = torch.device(device).type == "cpu" and cpu_build.available()
    compact = _mxfp4_moes(model, stored) if native else {}
    for moe in compact.values():  # their stacked float weights are never made
        del moe.experts.gate_up_proj, moe.experts.down_proj
    kept = _keep_stored_bf16(model, stored, dtype, torch.device(device), pack)
    # GGUF blocks served as stored: their linears never get a float weight
    pending = _pend_blocks(model, gguf) if gguf is not None and quantization == "gguf" else set()
    model = model.to_empty(device=device)
    model.tie_weights()
    blocks: dict[str, list[nn.Module]] = {}
    # read in place where the stored format is the parameter's
    into = {n: p.data for n, p in model.named_parameters()}
    # a GGUF's MXFP4 blocks stay in its nibble order where our kernels serve them
    # a folder's MXFP4 experts are served as the file's own pages (`file_read.map_at`)
    read = gguf.iter_weights(skip=pending, into=into, mxfp4_split=bool(compact)) \
        if gguf is not None else iter_weights(path, into=into, mapped=_mxfp4_names(compact).keys())
    weights = _take_mxfp4(read, compact, blocks, split=gguf is not None)
    model.load_weights(merge_mxfp4(weights))
    _attach_experts(compact, blocks)
    split_experts(model)  # each expert's projections: linears, packed or quantized below
    # NOTE: float weights are fused before they are quantized; GGUF blocks arrive one
    # tensor at a time and are fused by `quantize_model` where their block types agree.
    if quantization in ("int8", "int4"):
        fuse_projections(model)
    quantize_model(model, quantization, gguf)
    apply_int16_activations(model, int16_activations)
    if pack and can_pack(dtype, torch.device(device)):
        fuse_projections(model)  # whatever is still float (all of it for "none")
        pack_linears(model)
    elif pack and (kept or can_compact(dtype, torch.device(device))):
        fuse_projections(model)
        pack_linears(model, CompactLinear, bf16_only=True)
    return model.eval()


def _pend_blocks(model: nn.Module, gguf: GgufWeights) -> set[str]:
    """Put a `PendingLinear` (on the meta device, no weight) in place of every linear, and of
    the token embedding, whose GGUF blocks will be served as stored (`quantize_model` reads
    them); their weight names, to leave out of the float loading. A tied head is pending
    with its embedding (the same blocks)."""
    embed: Any = model.model.embed_tokens  # type: ignore[union-attr]
    targets: dict[str, Any] = {f"{prefix}.weight": module
                               for prefix, module in model.named_modules()
                               if type(module) is nn.Linear or module is embed}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if tied:
        targets.pop("lm_head.weight", None)  # follows the embedding
    served = gguf.servable_blocks(targets)
    for name in served:
        module = targets[name]
        shape = (module.num_embeddings, module.embedding_dim) if module is embed \
            else (module.out_features, module.in_features)
        _set_module(model, name.removesuffix(".weight"),
                    PendingLinear(*shape, getattr(module, "bias", None)))
    if tied and "model.embed_tokens.weight" in served:
        head: Any = model.lm_head
        model.lm_head = PendingLinear(head.out_features, head.in_features, None)
    return served


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """torch's parameter initializers as no-ops (every parameter is loaded after)."""
    names = ("kaiming_uniform_", "uniform_", "normal_")
    saved = {name: getattr(nn.init, name) for name in names}
    try:
        for name in names:
            setattr(nn.init, name, lambda tensor, *_args, **_kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _keep_stored_bf16(model: nn.Module, stored: dict[str, tuple[str, tuple[int, ...]]],
                      dtype: torch.dtype, device: torch.device, pack: bool) -> int:
    """Under float32 activations on a CPU, give every linear and the token embedding whose
    checkpoint stores bf16 a bf16 parameter (still on the meta device): the weights are then
    held in the bytes they are stored in, not widened to twice them. Linears multiply it by
    `CompactLinear` (float32 FMA over the bf16 weight widened in registers: the same
    numbers as the widened weight), the embedding widens the rows it looks up
    (`WideningEmbedding`). How many were kept (0 where the activations are not float32,
    the device is not a CPU, or the CPU kernels are not built).
    """
    if dtype != torch.float32 or device.type != "cpu" or not pack or not cpu_build.available():
        return 0
    bf16 = {name for name, (kind, _) in stored.items() if kind == "BF16"}
    embed: Any = model.model.embed_tokens  # type: ignore[union-attr]
    count = 0
    for prefix, module in model.named_modules():
        # NOTE: the token embedding alone of the tables: another (Gemma 4's per-layer one)
        # is read by the model itself, which would then compute in bf16
        kind_ok = type(module) is nn.Linear or module is embed
        if not kind_ok or f"{prefix}.weight" not in bf16:
            continue
        module.weight = nn.Parameter(module.weight.to(torch.bfloat16), requires_grad=False)
        count += 1
    if embed.weight.dtype == torch.bfloat16:
        model.model.embed_tokens = WideningEmbedding(embed.weight, dtype)  # type: ignore[union-attr]
    if getattr(model.config, "tie_word_embeddings", False):  # the head reads the same table
        model.lm_head.weight = model.model.embed_tokens.weight  # type: ignore[union-attr]
    return count


_PROJECTIONS = ("gate_up_proj", "down_proj")


def _mxfp4_moes(model: nn.Module, stored: dict[str, Any]) -> dict[str, MoE]:
    """gpt-oss's mixtures of experts whose stacked projections the checkpoint holds in
    MXFP4, by module name (read from the files' headers, no tensor loaded)."""
    names = set(stored)
    return {name: module for name, module in model.named_modules()
            if type(module) is MoE and all(f"{name}.experts.{p}_{part}" in names
                                            for p in _PROJECTIONS
                                            for part in ("blocks", "scales"))}


def _mxfp4_names(moes: dict[str, MoE]) -> dict[str, tuple[str, str]]:
    """The stored names of the MXFP4 blocks and scales of ``moes``: each one's projection
    (``<moe>.<projection>``) and part ("blocks" or "scales")."""
    return {f"{m}.experts.{p}_{part}": (f"{m}.{p}", part) for m in moes for p in _PROJECTIONS
            for part in ("blocks", "scales")}


def _take_mxfp4(weights: Iterator[tuple[str, torch.Tensor]], moes: dict[str, MoE],
                out: dict[str, list[nn.Module]], *,
                split: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass every tensor on but the MXFP4 blocks and scales of ``moes``: each pair becomes
    one `Mxfp4Linear` an expert, over views of the tensors as they were read (the stored
    bytes, never widened or copied), into ``out`` under ``<moe>.<projection>``; ``split``:
    the blocks' nibbles are in GGUF's order."""
    wanted = _mxfp4_names(moes)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        if name not in wanted:
            yield name, tensor
            continue
        key, part = wanted[name]
        parts = pending.setdefault(key, {})
        parts[part] = tensor
        if len(parts) < 2:
            continue
        del pending[key]
        blocks, scales = parts["blocks"], parts["scales"]
        if blocks.dim() != 4 or blocks.shape[:3] != scales.shape or blocks.shape[3] != 16:
            raise ModelLoadError(f"{key}: mxfp4 blocks {list(blocks.shape)} do not match "
                                 f"scales {list(scales.shape)}")
        out[key] = [Mxfp4Linear(codes, exps, split=split)
                    for codes, exps in zip(blocks, scales, strict=True)]


def _attach_experts(moes: dict[str, MoE], linears: dict[str, list[nn.Module]]) -> None:
    """Give each MXFP4 mixture its experts' linears, with the biases the checkpoint loaded."""
    for name, moe in moes.items():
        per_projection = []
        for projection in _PROJECTIONS:
            if f"{name}.{projection}" not in linears:
                raise ValueError(f"checkpoint lacks {name}.experts.{projection}")
            bias = getattr(moe.experts, f"{projection}_bias")
            modules = linears[f"{name}.{projection}"]
            for e, module in enumerate(modules):
                if bias is not None:
                    module.bias = nn.Parameter(bias[e].detach().clone(), requires_grad=False)
            per_projection.append(modules)
        moe.linears = ExpertLinears(*per_projection)
        del moe.experts
