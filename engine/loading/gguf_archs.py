"""What each GGUF architecture `gguf_model` reads needs beyond the metadata all share.

One `Arch` an architecture (`ARCHS`, by GGUF `general.architecture`): transformers' config
class, llama.cpp's sliding pattern for files without one, the norm shift its converter
folded in, the config fields of its own (from the metadata and tensors), and the tensors
gguf-py's name map does not find (gpt-oss's experts, split and transposed by the
converter; Gemma 4's router scales). The values are those llama.cpp uses when it loads such
a file (see `gguf_model`'s notes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np
import torch

from ringserve.engine.loading.errors import ModelLoadError
from ringserve.engine.loading.gguf_file import GgufTensor

__all__ = ["ARCHS", "Arch", "Fields", "Tensors", "read_tensor"]

Fields = dict[str, Any]  # the file's metadata, `arch.` prefix removed from its own keys
Tensors = dict[str, gguf.ReaderTensor | GgufTensor]  # the file's tensors by GGUF name


@dataclass(frozen=True)
class Arch:
    """What one GGUF architecture needs beyond the metadata every architecture shares."""

    config_class: str  # transformers' config class
    period: int | None  # llama.cpp's sliding pattern without one in the file (None: no SWA)
    norm_shift: float = 0.0  # added to `*norm.weight` by the converter (Gemma's `1 +`)
    # config fields of this architecture: (metadata, layers, tensors) -> kwargs
    extra: Callable[[Fields, int, Tensors], dict[str, Any]] = field(
        default=lambda _f, _n, _t: {})
    # tensors the name map does not find: (tensors, transformers name) -> tensor, or None
    special: Callable[[Tensors, str], torch.Tensor | None] = field(
        default=lambda _t, _n: None)
    yarn_truncate: bool = True  # transformers' YaRN default; gpt-oss's checkpoints say False
    rope_freqs_are_llama3: bool = True  # a `rope_freqs` tensor encodes llama3 scaling
    swa_unscaled: bool = False  # rotary scaling on the full layers only (llama.cpp's OLMo 2)


def read_tensor(reader_tensor: gguf.ReaderTensor | GgufTensor) -> torch.Tensor:
    """A tensor of the file as torch, in numpy's (outermost-first) order, dequantized."""
    kind = reader_tensor.tensor_type
    data = np.asarray(reader_tensor.data)
    if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return torch.from_numpy(data.copy())
    if kind == gguf.GGMLQuantizationType.BF16:
        return torch.from_numpy(data.copy()).view(torch.bfloat16)
    return torch.from_numpy(gguf.quants.dequantize(data, kind)).to(torch.bfloat16)


def _expert_tensor(tensors: Tensors, name: str) -> torch.Tensor | None:
    """gpt-oss's experts as transformers holds them: [E, in, out], with the gate and up
    projections interleaved along `out` (llama.cpp's converter split them apart)."""
    if ".mlp.experts." not in name:
        return None
    block, part = name.split(".")[2], name.rsplit(".", 1)[-1]

    def read(kind: str, bias: bool) -> torch.Tensor:
        return read_tensor(tensors[f"blk.{block}.ffn_{kind}_exps.{'bias' if bias else 'weight'}"])

    if part in ("gate_up_proj", "gate_up_proj_bias"):
        bias = part.endswith("bias")
        gate, up = read("gate", bias), read("up", bias)
        if not bias:
            gate, up = gate.transpose(-1, -2), up.transpose(-1, -2)
        return torch.stack((gate, up), dim=-1).flatten(-2).contiguous()
    if part == "down_proj":
        return read("down", False).transpose(-1, -2).contiguous()
    if part == "down_proj_bias":
        return read("down", True)
    return None


def _gemma2(f: Fields, layers: int, _t: Tensors) -> dict[str, Any]:
    head_dim = int(f["attention.key_length"])
    scalar = f["embedding_length"] // f["attention.head_count"] if layers == 46 else head_dim
    return dict(head_dim=head_dim, query_pre_attn_scalar=scalar,
                attn_logit_softcapping=f.get("attn_logit_softcapping"),
                final_logit_softcapping=f.get("final_logit_softcapping"))


def _cohere2(f: Fields, _layers: int, _t: Tensors) -> dict[str, Any]:
    head_dim = f["embedding_length"] // f["attention.head_count"]
    if int(f.get("rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError("cohere2 GGUF: partial rotary (rope.dimension_count "
                             f"{f['rope.dimension_count']} of {head_dim}) is not supported")
    return dict(layer_norm_eps=f["attention.layer_norm_epsilon"],
                logit_scale=f.get("logit_scale", 1.0))


def _gpt_oss(f: Fields, _layers: int, _t: Tensors) -> dict[str, Any]:
    return dict(head_dim=int(f["attention.key_length"]), num_local_experts=f["expert_count"],
                num_experts_per_tok=f["expert_used_count"],
                intermediate_size=f["expert_feed_forward_length"], swiglu_limit=7.0)


def _gemma4(f: Fields, layers: int, tensors: Tensors) -> dict[str, Any]:
    """Gemma 4: two head sizes and KV-head counts, KV shared by the last layers, values equal
    to keys on full layers (no `attn_v` there), per-layer inputs, double-wide MLPs, and the
    full layers' proportional rotary (llama.cpp writes it as frequency factors: 1 for the
    rotated pairs, 1e30 for the others)."""
    slides = [bool(p) for p in f["attention.sliding_window_pattern"]]
    shared = int(f.get("attention.shared_kv_layers", 0))
    full = [i for i in range(layers - shared) if not slides[i]]
    kv_heads = f["attention.head_count_kv"]
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    ff = f["feed_forward_length"]
    ff = ff if isinstance(ff, list) else [ff] * layers
    head_dim, global_head_dim = int(f["attention.key_length_swa"]), int(f["attention.key_length"])
    factors = read_tensor(tensors["rope_freqs.weight"]).float()
    rotated = int((factors == 1.0).sum())
    swa_rot = int(f.get("rope.dimension_count_swa", head_dim))
    sliding_rope: dict[str, Any] = {"rope_type": "default",
                                    "rope_theta": float(f.get("rope.freq_base_swa", 10000.0))}
    if swa_rot != head_dim:
        sliding_rope["partial_rotary_factor"] = swa_rot / head_dim
    experts = int(f.get("expert_count", 0) or 0)
    per_layer = int(f.get("embedding_length_per_layer_input", 0) or 0)
    kwargs: dict[str, Any] = dict(
        head_dim=head_dim, global_head_dim=global_head_dim,
        num_key_value_heads=int(kv_heads[slides.index(True)]),
        num_global_key_value_heads=int(kv_heads[full[0]]) if full else None,
        attention_k_eq_v=bool(full) and all(f"blk.{i}.attn_v.weight" not in tensors
                                            for i in full),
        num_kv_shared_layers=shared, intermediate_size=int(ff[0]),
        use_double_wide_mlp=any(int(n) == 2 * int(ff[0]) for n in ff[layers - shared:]),
        hidden_size_per_layer_input=per_layer,
        vocab_size_per_layer_input=int(tensors["per_layer_token_embd.weight"].shape[1]
                                       if per_layer else tensors["token_embd.weight"].shape[1]),
        final_logit_softcapping=f.get("final_logit_softcapping"),
        rope_parameters={"sliding_attention": sliding_rope, "full_attention": {
            "rope_type": "proportional", "rope_theta": float(f.get("rope.freq_base", 1e6)),
            "partial_rotary_factor": 2 * rotated / global_head_dim}},
    )
    if experts:
        kwargs.update(enable_moe_block=True, num_experts=experts,
                      top_k_experts=int(f["expert_used_count"]),
                      moe_intermediate_size=int(f["expert_feed_forward_length"]))
    return kwargs


def _gemma4_special(tensors: Tensors, name: str) -> torch.Tensor | None:
    block = name.split(".")[2] if ".layers." in name else ""
    if name.endswith("router.scale"):
        return read_tensor(tensors[f"blk.{block}.ffn_gate_inp.scale"])
    if name.endswith("router.per_expert_scale"):
        return read_tensor(tensors[f"blk.{block}.ffn_down_exps.scale"])
    return None


ARCHS: dict[str, Arch] = {
    "gemma2": Arch("Gemma2Config", period=2, norm_shift=1.0, extra=_gemma2),
    "olmo2": Arch("Olmo3Config", period=4, swa_unscaled=True),
    "exaone4": Arch("Exaone4Config", period=4),
    "cohere2": Arch("Cohere2Config", period=4, extra=_cohere2),
    "gpt-oss": Arch("GptOssConfig", period=2, extra=_gpt_oss, special=_expert_tensor,
                    yarn_truncate=False),
    "gemma4": Arch("Gemma4TextConfig", period=6, extra=_gemma4, special=_gemma4_special,
                   rope_freqs_are_llama3=False),
}


