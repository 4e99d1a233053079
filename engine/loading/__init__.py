"""Loading a model, in the order it arrives: find, convert, quantize, build.

Each file imports only the ones before it:

    errors.py       ModelLoadError, UnsupportedModelError: what every step raises
    find.py         presets, the cache folder, what a loadable HF folder must hold
    gguf_blocks.py  a GGUF file's quantized blocks repacked into `kernels/quant.py`'s layout
    convert.py      a preset or .gguf file -> a cached bfloat16 safetensors HF folder, plus
                    the file's own blocks beside it; `resolve_model`, which finds and (for
                    presets and .gguf) converts
    checkpoint.py   reading a folder: config, tokenizer, weights, dtype
    quantize.py     which weight-only method runs (none, int8, int4, gguf) and swapping the
                    model's linears for quantized ones; the bytes the weights cost
    build.py        our `CausalLM`, built, filled with the weights, quantized and packed

A caller resolves first, then builds:

    resolved = resolve_model("gemma-3-270m")  # converted once, then read from the cache
    model = load_model(resolved.path, dtype=parse_dtype("bf16"))
"""

from ringserve.engine.loading.build import load_model
from ringserve.engine.loading.checkpoint import (
    TokenizerLoad,
    check_model_type,
    iter_weights,
    load_hf_config,
    load_tokenizer,
    parse_dtype,
)
from ringserve.engine.loading.convert import CONVERT_VERSION, resolve_model
from ringserve.engine.loading.errors import ModelLoadError, UnsupportedModelError
from ringserve.engine.loading.find import (
    Preset,
    ResolvedModel,
    check_files,
    default_cache_dir,
    load_presets,
)

__all__ = [
    "CONVERT_VERSION",
    "ModelLoadError",
    "Preset",
    "ResolvedModel",
    "TokenizerLoad",
    "UnsupportedModelError",
    "check_files",
    "check_model_type",
    "default_cache_dir",
    "iter_weights",
    "load_hf_config",
    "load_model",
    "load_presets",
    "load_tokenizer",
    "parse_dtype",
    "resolve_model",
]
