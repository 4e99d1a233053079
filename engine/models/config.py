"""What our models need from a transformers config, read once and checked.

Each family maps its HF config onto one `ModelConfig`: the decoder code then has no
`model_type` branches, only flags. A config that asks for something we do not implement
(an unknown RoPE scaling, a bidirectional Gemma) is refused here, at load, with the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3", "proportional")


class UnsupportedConfigError(ValueError):
    """The checkpoint's config asks for a feature ringserve does not implement."""


@dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary embedding of one layer: ``theta``, linear ``factor`` and the rotated fraction;
    for YaRN (``yarn_original`` > 0) the context it was trained for, the ramp's rotation
    bounds, whether they are rounded out, and the cos/sin scale (`engine.models.layers`)."""

    theta: float
    factor: float = 1.0
    partial_factor: float = 1.0
    yarn_original: int = 0  # YaRN's original_max_position_embeddings; 0: not YaRN
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0  # cos and sin are multiplied by it
    # Gemma 4's "proportional" rotary: the first partial_factor of the frequency pairs of
    # the whole head, exponents over the whole head size, the other pairs unrotated
    proportional: bool = False
    # Llama 3's scaling (EXAONE 4 too): (low_freq_factor, high_freq_factor,
    # original_max_position_embeddings); long wavelengths divided by ``factor``, short ones
    # kept, a smooth blend between (`engine.models.layers.llama3_inv_freq`)
    llama3: tuple[float, float, float] | None = None


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The architecture of a decoder-only model, family differences reduced to flags."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    layer_windows: tuple[int | None, ...]
    layer_ropes: tuple[RopeConfig | None, ...]  # None: no rotary on that layer (NoPE)
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    fused_qkv: bool = False  # phi3: one qkv_proj, one gate_up_proj
    attn_scale: float = 0.0  # 0 = head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    norm_plus_one: bool = False  # RMSNorm multiplies by (1 + w) (Gemma)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    # where a layer's norms sit: "pre" (before attention and MLP: llama), "sandwich"
    # (Gemma: also after each), "post" (after each only, on its output: OLMo 2/3, EXAONE 4),
    # "parallel" (one norm whose output feeds attention and MLP side by side: Cohere 2)
    norm_placement: str = "pre"
    layer_norm: bool = False  # mean-centred LayerNorm without bias instead of RMSNorm (Cohere)
    rotary_interleaved: bool = False  # rotate features (2i, 2i + 1), not (i, i + d/2) (Cohere)
    logit_scale: float = 1.0  # logits times this (Cohere)
    attn_sinks: bool = False  # a learned sink logit per head in the softmax (gpt-oss)
    num_experts: int = 0  # > 0: the MLP is a top-k mixture of experts (gpt-oss)
    experts_per_token: int = 0
    swiglu_limit: float = 7.0  # the experts' clamp
    swiglu_alpha: float = 1.702
    qk_norm: bool = False  # RMSNorm of each q and k head before the rotary (Gemma 3, EXAONE 4)
    qk_norm_full: bool = False  # RMSNorm over the whole q and k projections (OLMo 2/3)
    eos_token_ids: tuple[int, ...] = ()
    # Gemma 4 (empty tuples: every layer as the scalar fields say)
    layer_head_dims: tuple[int, ...] = ()  # per layer, its head size
    layer_kv_heads: tuple[int, ...] = ()  # per layer, its KV heads
    layer_kv_source: tuple[int, ...] = ()  # per layer, the layer whose K/V it attends to
    layer_k_is_v: tuple[bool, ...] = ()  # per layer: values are the keys' projection
    layer_intermediate: tuple[int, ...] = ()  # per layer, its MLP's intermediate size
    norm_weight_float32: bool = False  # RMSNorm multiplies by w in float32, then casts
    v_norm: bool = False  # values RMS-normed per head, without a weight
    per_layer_input: int = 0  # > 0: per-layer input embeddings of this size
    per_layer_vocab: int = 0  # their vocabulary
    layer_scalar: bool = False  # each layer's output times a learned scalar
    moe_parallel: bool = False  # a mixture of experts beside the dense MLP (Gemma 4 26B-A4B)
    moe_intermediate_size: int = 0

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim**-0.5

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.hidden_size) if self.scale_embeddings else 1.0

    def head_dim_of(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_kv_heads

    def kv_source_of(self, layer: int) -> int:
        """The layer whose K/V ``layer`` attends to: itself, or (Gemma 4's last layers)
        the last earlier layer of its kind that keeps its own."""
        return self.layer_kv_source[layer] if self.layer_kv_source else layer

    def k_is_v(self, layer: int) -> bool:
        return bool(self.layer_k_is_v) and self.layer_k_is_v[layer]

    def intermediate_of(self, layer: int) -> int:
        return self.layer_intermediate[layer] if self.layer_intermediate else \
            self.intermediate_size


def _rope(params: dict[str, Any] | None, where: str) -> RopeConfig:
    params = params or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedConfigError(
            f"rope_scaling type {kind!r} ({where}) is not implemented; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    theta = float(params.get("rope_theta", 10000.0))
    partial = float(params.get("partial_rotary_factor", 1.0))
    if kind == "proportional":
        return RopeConfig(theta=theta, partial_factor=partial, proportional=True,
                          factor=float(params.get("factor", 1.0)))
    if kind == "llama3":
        return RopeConfig(theta=theta, partial_factor=partial, factor=float(params["factor"]),
                          llama3=(float(params["low_freq_factor"]),
                                  float(params["high_freq_factor"]),
                                  float(params["original_max_position_embeddings"])))
    if kind != "yarn":
        return RopeConfig(theta=theta, partial_factor=partial,
                          factor=float(params.get("factor", 1.0)) if kind == "linear" else 1.0)
    if not params.get("factor") or not params.get("original_max_position_embeddings"):
        raise UnsupportedConfigError(f"yarn rope ({where}) needs factor and "
                                     "original_max_position_embeddings")  # fmt: skip
    factor = float(params["factor"])
    attention = params.get("attention_factor")
    if attention is None:  # YaRN's sqrt(1/t) = 0.1 ln(s) + 1, or a ratio of two such terms
        def mscale(m: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(m) / mscale(m_all) if m and m_all else mscale(1.0)
    return RopeConfig(
        theta=theta, factor=factor, partial_factor=partial,
        yarn_original=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)), attention_factor=float(attention),
    )


def _windows(cfg: Any, model_type: str) -> tuple[int | None, ...]:
    """Per-layer sliding window, exactly as the HF modeling code of each family reads it."""
    n: int = cfg.num_hidden_layers
    window: int | None = getattr(cfg, "sliding_window", None)
    if model_type in ("mistral", "phi3"):  # one window for every layer, if set
        return (window,) * n
    if model_type in ("qwen2", "gemma2", "gemma3_text", "olmo3", "exaone4", "cohere2",
                      "gpt_oss", "gemma4_text"):
        types = list(cfg.layer_types)
        for t in types:
            if t not in ("sliding_attention", "full_attention"):
                raise UnsupportedConfigError(f"layer type {t!r} is not implemented")
        # NOTE: a window on a config whose layers are all full attention is ignored, as
        # transformers does (vLLM once applied it to every layer).
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (None,) * n  # llama has no window


def _eos(cfg: Any) -> tuple[int, ...]:
    eos = getattr(cfg, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def model_config_from_hf(cfg: Any) -> ModelConfig:
    """Translate a transformers config of a supported family into a `ModelConfig`.

    Raises:
        UnsupportedConfigError: an unknown family or a feature we do not implement.
    """
    model_type = cfg.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedConfigError(
            f"model_type {model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    gemma = model_type in ("gemma2", "gemma3_text")
    gemma4 = model_type == "gemma4_text"
    # NOTE: Gemma 4's config refuses to say one head size: its first layer's stands for all
    # (the per-layer ones are in `_gemma4_fields`)
    shape = cfg.per_layer_config[0] if gemma4 else cfg
    head_dim = getattr(shape, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if (gemma or gemma4) and getattr(cfg, "use_bidirectional_attention", False):
        raise UnsupportedConfigError("use_bidirectional_attention is not implemented")
    windows = _windows(cfg, model_type)
    # NOTE: llama and gemma put `attention_bias` on q, k, v and o; qwen2 always has q/k/v bias.
    attention_bias = model_type in ("llama", "gemma2", "gemma3_text", "olmo3",
                                    "cohere2", "gpt_oss", "gemma4_text") and bool(
        getattr(cfg, "attention_bias", False)
    )
    params = cfg.rope_parameters
    ropes: tuple[RopeConfig | None, ...]
    if isinstance(params, dict) and "full_attention" in params:  # a rotary per layer type
        ropes = tuple(_rope(params["sliding_attention" if w else "full_attention"], model_type)
                      for w in windows)  # fmt: skip
    else:
        ropes = (_rope(params, model_type),) * cfg.num_hidden_layers
    if model_type in ("exaone4", "cohere2") and getattr(cfg, "sliding_window", None):
        # these rotate only their sliding layers; the full layers have no position code
        ropes = tuple(r if w else None for r, w in zip(ropes, windows, strict=True))
    fields: dict[str, Any] = dict(
        model_type=model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=getattr(shape, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=getattr(cfg, "rms_norm_eps", None) or cfg.layer_norm_eps,
        hidden_act=cfg.hidden_activation if gemma or gemma4 else cfg.hidden_act,
        layer_windows=windows,
        layer_ropes=ropes,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        fused_qkv=model_type == "phi3",
        attn_scale=cfg.query_pre_attn_scalar**-0.5 if gemma else 1.0 if gemma4 else 0.0,
        attn_softcap=getattr(cfg, "attn_logit_softcapping", None),
        final_softcap=getattr(cfg, "final_logit_softcapping", None),
        norm_plus_one=gemma,
        scale_embeddings=gemma or gemma4,
        norm_placement=("sandwich" if gemma or gemma4 else
                        "post" if model_type in ("olmo3", "exaone4") else
                        "parallel" if model_type == "cohere2" else "pre"),
        layer_norm=model_type == "cohere2",
        rotary_interleaved=model_type == "cohere2",
        logit_scale=float(getattr(cfg, "logit_scale", None) or 1.0),
        attn_sinks=model_type == "gpt_oss",
        num_experts=int(getattr(cfg, "num_local_experts", None) or 0),
        experts_per_token=int(getattr(cfg, "num_experts_per_tok", 0) or 0),
        swiglu_limit=float(getattr(cfg, "swiglu_limit", 7.0)),
        swiglu_alpha=float(getattr(cfg, "swiglu_alpha", 1.702)),
        qk_norm=model_type in ("gemma3_text", "exaone4", "gemma4_text"),
        qk_norm_full=model_type == "olmo3",
        eos_token_ids=_eos(cfg),
    )
    if gemma4:  # its per-layer shapes (and mixture of experts) override the generic reading
        fields.update(_gemma4_fields(cfg, windows))
    return ModelConfig(**fields)


def _gemma4_fields(cfg: Any, windows: tuple[int | None, ...]) -> dict[str, Any]:
    """Gemma 4's per-layer shapes: full layers with their own head size and KV heads (and
    values equal to the keys' projection with ``attention_k_eq_v``), the last
    ``num_kv_shared_layers`` attending to the K/V of the last earlier layer of their kind,
    those with twice the MLP where ``use_double_wide_mlp``, per-layer input embeddings, and
    (``enable_moe_block``: 26B-A4B) a mixture of experts beside each dense MLP.
    """
    n = cfg.num_hidden_layers
    moe = bool(getattr(cfg, "enable_moe_block", False))
    per_layer = [cfg.per_layer_config[i] for i in range(n)]
    modes = cfg.kv_sharing_modes
    sources = list(range(n))
    for i, mode in enumerate(modes):
        if mode == "reuse":  # the last earlier layer of its kind that keeps its own K/V
            sources[i] = max(j for j in range(i) if modes[j] != "reuse"
                             and cfg.layer_types[j] == cfg.layer_types[i])
    wide = bool(getattr(cfg, "use_double_wide_mlp", False))
    return dict(
        layer_head_dims=tuple(int(c.head_dim) for c in per_layer),
        layer_kv_heads=tuple(int(c.num_key_value_heads) for c in per_layer),
        layer_kv_source=tuple(sources),
        layer_k_is_v=tuple(bool(cfg.attention_k_eq_v) and w is None for w in windows),
        layer_intermediate=tuple(cfg.intermediate_size * (2 if wide and m == "reuse" else 1)
                                 for m in modes),
        norm_weight_float32=True,
        v_norm=True,
        per_layer_input=int(cfg.hidden_size_per_layer_input or 0),
        per_layer_vocab=int(cfg.vocab_size_per_layer_input or 0),
        layer_scalar=True,
        moe_parallel=moe,
        num_experts=int(cfg.num_experts or 0) if moe else 0,
        experts_per_token=int(cfg.top_k_experts or 0) if moe else 0,
        moe_intermediate_size=int(cfg.moe_intermediate_size or 0) if moe else 0,
    )


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "phi3", "gemma2", "gemma3_text", "olmo3",
                         "exaone4", "cohere2", "gpt_oss", "gemma4_text")
