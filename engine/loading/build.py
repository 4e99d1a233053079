"""Build one of our models from a local HF folder: config, weights, dtype, device.

The last loading step: the folder has been found (and converted) by `resolve_model` and is
read through `checkpoint.py`; here our `CausalLM` is built, filled and packed for oneDNN.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ringserve.engine.kv_cache import model_layer_groups
from ringserve.engine.loading.checkpoint import check_model_type, iter_weights, load_hf_config
from ringserve.engine.loading.mxfp4 import merge_mxfp4
from ringserve.engine.loading.quantize import quantize_model
from ringserve.engine.models import SUPPORTED_MODEL_TYPES, CausalLM, model_config_from_hf
from ringserve.engine.models.moe import split_experts
from ringserve.engine.models.packed_linear import (
    CompactLinear,
    can_compact,
    can_pack,
    fuse_projections,
    pack_linears,
)


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
    # NOTE: built on the meta device so no memory is spent on a random init we overwrite.
    with torch.device("meta"):
        model = CausalLM(cfg, model_layer_groups(cfg))
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    model.load_weights(merge_mxfp4(iter_weights(path)))  # MXFP4 experts widened once
    split_experts(model)  # each expert's projections: linears, packed or quantized below
    # NOTE: float weights are fused before they are quantized; GGUF blocks arrive one
    # tensor at a time and are fused by `quantize_model` where their block types agree.
    if quantization in ("int8", "int4"):
        fuse_projections(model)
    quantize_model(model, quantization, Path(path), int16_activations=int16_activations)
    if pack and can_pack(dtype, torch.device(device)):
        fuse_projections(model)  # whatever is still float (all of it for "none")
        pack_linears(model)
    elif pack and can_compact(dtype, torch.device(device)):
        fuse_projections(model)
        pack_linears(model, CompactLinear)
    return model.eval()
