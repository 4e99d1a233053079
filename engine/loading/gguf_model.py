"""Our own GGUF reader for the sliding-window families transformers cannot read from GGUF.

transformers (the version we pin) reads no GGUF of `olmo2` (OLMo 2 and 3), `exaone4` or
`cohere2`, fails on `gpt-oss` and `gemma4` files, and reads Gemma 2 files without their
soft-caps or `query_pre_attn_scalar` (its mapping drops them). This module reads such a
file's config from its metadata (`hf_config`); the weights are read by `gguf_weights` (by
gguf-py's tensor name map) and the tokenizer by transformers' own GGUF tokenizer builder
(which reads any architecture). `convert` writes the whole Hugging Face folder (for
`convert.export_hf_folder`).

A GGUF file does not say everything a config.json says. What it leaves out, llama.cpp (the
runtime these files are made for) fills in per architecture when it loads them, and so do we,
with the same values (`gguf_archs.ARCHS`, one entry per architecture):

- which layers slide: the file's `attention.sliding_window_pattern` (one flag per layer)
  where it has one; else llama.cpp's period for the architecture: every `period`-th layer
  (1-based) is full, the others slide (Gemma 2 and gpt-oss: 2; OLMo 3, EXAONE 4 and
  Cohere 2: 4);
- the rotary base of the sliding layers: `rope.freq_base_swa` where present, else the full
  layers' base; and OLMo's sliding layers leave out the full layers' rotary scaling;
- Gemma 2's query scale: `head_dim`, except the 46-layer 27B whose scale is
  `hidden / heads`, as llama.cpp (and Gemma's reference code) have it;
- gpt-oss's SwiGLU clamp (7.0) and its un-truncated YaRN, the released checkpoints' values;
- Gemma 4's full-layer rotary fraction, which the converter writes as frequency factors.

Tensors undo what llama.cpp's converter did to them (`gguf_weights`): Gemma's norm weights
were stored with the `1 +` of its RMSNorm folded in (we subtract 1 again, in float32, as
transformers does for Gemma 3 files), gpt-oss's expert gate and up projections were split
out of the interleaved `gate_up_proj` (we interleave them back).
Checked by `tests/test_gguf_families.py`: tiny random checkpoints converted to GGUF by
llama.cpp's own `convert_hf_to_gguf.py`, read back here, token-exact with transformers on the
original folders.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import gguf
import torch

from ringserve.engine.loading.errors import ModelLoadError
from ringserve.engine.loading.gguf_archs import ARCHS, Fields, read_tensor
from ringserve.engine.loading.gguf_file import GgufFile

__all__ = ["ARCHS", "convert", "describe_storage", "hf_config", "reads"]

def reads(reader: gguf.GGUFReader | GgufFile) -> bool:
    """Whether this module (rather than transformers) reads the file."""
    return str(reader.fields["general.architecture"].contents()) in ARCHS


def _fields(reader: gguf.GGUFReader | GgufFile, arch: str) -> Fields:
    out: Fields = {}
    for key, value in reader.fields.items():
        if key.startswith(f"{arch}."):
            out[key.removeprefix(f"{arch}.")] = value.contents()
        elif key.startswith(("general.", "tokenizer.ggml.")) and not key.endswith(
                ("tokens", "merges", "token_type", "scores")):
            out[key] = value.contents()
    return out


def _llama3_rope(factors: torch.Tensor, theta: float, dim: int) -> dict[str, Any]:
    """llama3 rotary scaling from the per-pair frequency factors llama.cpp's converter wrote
    (`rope_freqs`) in place of its four parameters.

    Pairs whose wavelength is short keep factor 1, long ones take `factor`, and between them
    1 / f = (1 - s) / factor + s with s = old / (wavelength (high - low)) - low / (high - low),
    linear in 1 / wavelength. Its two coefficients come from the pairs in between; the four
    parameters are then one set with those coefficients (low = 1), which gives every pair
    the same factor as the original set.
    """
    f = factors.double()
    factor = float(f.max())
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if factor <= 1.0:
        return rope
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    x = inv / (2 * math.pi)  # 1 / wavelength
    mid = (f > 1 + 1e-6) & (f < factor * (1 - 1e-6))
    if len(f) != len(inv) or int(mid.sum()) < 2:
        raise ModelLoadError("GGUF rope_freqs: not a llama3 rotary scaling this reader can "
                             "recover (fewer than two interpolated frequencies)")
    smooth = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
    design = torch.stack((x[mid], -torch.ones_like(x[mid])), dim=1)
    a, c = (float(v) for v in torch.linalg.lstsq(design, smooth[:, None]).solution[:, 0])
    if a <= 0 or c <= 0:
        raise ModelLoadError("GGUF rope_freqs: not a llama3 rotary scaling")
    old = a / c
    return rope | {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                   "high_freq_factor": round(1.0 + 1.0 / c, 6),
                   "original_max_position_embeddings": round(old) if abs(old - round(old)) < 1e-3
                   else old}


def _rope(f: Fields, theta: float, truncate: bool) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    kind = f.get("rope.scaling.type")
    if kind in (None, "none"):
        return rope
    if kind == "yarn":
        rope.update(rope_type="yarn", factor=float(f["rope.scaling.factor"]),
                    original_max_position_embeddings=int(
                        f["rope.scaling.original_context_length"]),
                    beta_fast=float(f.get("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(f.get("rope.scaling.yarn_beta_slow", 1.0)))
        if "rope.scaling.yarn_attn_factor" in f:
            rope["attention_factor"] = float(f["rope.scaling.yarn_attn_factor"])
        if not truncate:
            rope["truncate"] = False
        return rope
    if kind == "linear":
        return rope | {"rope_type": "linear", "factor": float(f["rope.scaling.factor"])}
    raise ModelLoadError(f"GGUF rope scaling {kind!r} is not supported for this architecture")


def _first(value: Any) -> int:
    """A per-layer array's first entry, or the scalar (an architecture's `extra` decides
    what the others mean)."""
    return int(value[0] if isinstance(value, list) else value)


def hf_config(reader: gguf.GGUFReader | GgufFile) -> Any:
    """The transformers config of a file this module reads (`reads`)."""
    import transformers

    arch_name = str(reader.fields["general.architecture"].contents())
    arch = ARCHS[arch_name]
    f = _fields(reader, arch_name)
    layers = int(f["block_count"])
    tensors = {t.name: t for t in reader.tensors}
    vocab = int(tensors["token_embd.weight"].shape[1])
    window = int(f.get("attention.sliding_window", 0) or 0)
    pattern = f.get("attention.sliding_window_pattern")
    if window <= 0 or arch.period is None:
        slides = [False] * layers
    elif isinstance(pattern, list):
        slides = [bool(p) for p in pattern]
    else:
        period = int(pattern) if pattern is not None else arch.period
        slides = [(i + 1) % period != 0 for i in range(layers)]
    if len(slides) != layers:
        raise ModelLoadError(f"GGUF sliding_window_pattern has {len(slides)} flags for "
                             f"{layers} layers")
    heads = int(f["attention.head_count"])
    theta = float(f.get("rope.freq_base", 10000.0))
    theta_swa = float(f.get("rope.freq_base_swa", theta))
    rope = _rope(f, theta, arch.yarn_truncate)
    if "rope_freqs.weight" in tensors and arch.rope_freqs_are_llama3:
        dim = int(f.get("attention.key_length", f["embedding_length"] // heads))
        rope = _llama3_rope(read_tensor(tensors["rope_freqs.weight"]), theta, dim)
    rope_parameters: dict[str, Any] = rope
    if theta_swa != theta or (arch.swa_unscaled and rope["rope_type"] != "default"):
        rope_parameters = {"full_attention": rope,
                           "sliding_attention": {"rope_type": "default", "rope_theta": theta_swa}}
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=int(f["embedding_length"]), num_hidden_layers=layers,
        intermediate_size=_first(f["feed_forward_length"]), num_attention_heads=heads,
        num_key_value_heads=_first(f.get("attention.head_count_kv", heads)),
        max_position_embeddings=int(f["context_length"]),
        sliding_window=window if any(slides) else None,
        layer_types=["sliding_attention" if s else "full_attention" for s in slides],
        rope_parameters=rope_parameters,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=f.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=f.get("tokenizer.ggml.padding_token_id"),
    )
    if "attention.layer_norm_rms_epsilon" in f:
        kwargs["rms_norm_eps"] = float(f["attention.layer_norm_rms_epsilon"])
    kwargs.update(arch.extra(f, layers, tensors))
    config = getattr(transformers, arch.config_class)(**kwargs)
    config.architectures = [arch.config_class.removesuffix("Config") + "ForCausalLM"]
    return config


def describe_storage(config: Any, file: GgufFile) -> None:
    """Set what a folder's config says of how its weights are stored: ``dtype``, the type
    most matrices are stored in (F32 and F16 their own; BF16 and block types bfloat16), and
    gpt-oss's MXFP4 ``quantization_config`` where its experts are MXFP4."""
    kinds = {gguf.GGMLQuantizationType.F32: torch.float32,
             gguf.GGMLQuantizationType.F16: torch.float16}
    found = [kinds.get(t.tensor_type, torch.bfloat16) for t in file.tensors
             if len(t.shape) == 2]
    config.dtype = max(set(found), key=found.count) if found else torch.bfloat16
    if any(t.tensor_type == gguf.GGMLQuantizationType.MXFP4 for t in file.tensors):
        config.quantization_config = {"quant_method": "mxfp4"}  # as gpt-oss's own folders


def convert(gguf_file: str | os.PathLike[str], out: str | os.PathLike[str]) -> None:
    """Write the Hugging Face folder of a file this module reads: config.json, the weights
    as safetensors shards of one layer each (with their index: a layer at a time in memory),
    the tokenizer files."""
    from safetensors.torch import save_file
    from transformers import PreTrainedTokenizerFast

    from ringserve.engine.loading.gguf_weights import GgufWeights

    path = Path(gguf_file)
    file = GgufFile(path)
    config = hf_config(file)
    describe_storage(config, file)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_key: str | None = None

    def flush() -> None:
        file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file({n: t.contiguous() for n, t in shard.items()}, str(folder / file),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        shard.clear()

    weights = GgufWeights(file, config)
    stored = weights.stored()
    for name, value in weights.iter_weights():
        if stored[name][0] not in ("F32", "F16", "BF16", "U8"):  # dequantized blocks
            value = value.to(torch.bfloat16)
        key = ".".join(name.split(".")[:3]) if ".layers." in name else "rest"
        if shard and key != shard_key:
            flush()
        shard_key = key
        shard[name] = value
    if shard:
        flush()
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n",
                                                         encoding="utf-8")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(folder)
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n",
                                                   encoding="utf-8")
