"""One decoder-only transformer for every supported family, with HF parameter names."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ringserve.engine.forward_batch import ForwardBatch
from ringserve.engine.models.config import ModelConfig
from ringserve.engine.models.fast_decode import FastDecode
from ringserve.engine.models.layers import ACTIVATIONS, MLP, Attention, RMSNorm, Rotary, make_norm
from ringserve.engine.models.moe import Gemma4MoE, MoE
from ringserve.kernels import cpu_norm

_LAYER_MOE = re.compile(r"^(model\.layers\.\d+\.)(router|experts)\.")


def _moe_name(m: re.Match[str]) -> str:
    """Gemma 4's layer-level ``router.`` / ``experts.`` under our ``moe`` module."""
    return f"{m.group(1)}moe.{'gemma_router' if m.group(2) == 'router' else 'experts'}."

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer, its group's (key_cache, value_cache): [num_blocks, block_size, kv_heads, dim]."""


class DecoderLayer(nn.Module):
    # the norms a placement has (see __init__), under transformers' names
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module
    pre_feedforward_layernorm: nn.Module
    post_feedforward_layernorm: nn.Module
    post_feedforward_layernorm_1: nn.Module  # Gemma 4's experts beside the MLP
    pre_feedforward_layernorm_2: nn.Module
    post_feedforward_layernorm_2: nn.Module

    def __init__(self, cfg: ModelConfig, layer: int, group: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, group)
        self.mlp: nn.Module = (MoE(cfg) if cfg.num_experts and not cfg.moe_parallel
                               else MLP(cfg, layer))
        # Gemma 4 26B-A4B: experts beside the dense MLP, each branch normed before the sum
        self.moe = Gemma4MoE(cfg) if cfg.moe_parallel else None
        if self.moe is not None:
            for name in ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
                         "post_feedforward_layernorm_2"):
                setattr(self, name, make_norm(cfg, cfg.hidden_size))
        self.placement = cfg.norm_placement
        names = {"pre": ["input_layernorm", "post_attention_layernorm"],
                 "sandwich": ["input_layernorm", "post_attention_layernorm",
                              "pre_feedforward_layernorm", "post_feedforward_layernorm"],
                 "post": ["post_attention_layernorm", "post_feedforward_layernorm"],
                 "parallel": ["input_layernorm"]}
        if self.placement not in names:
            raise ValueError(f"norm_placement {self.placement!r}")
        for name in names[self.placement]:  # transformers' names, as the checkpoints have
            setattr(self, name, make_norm(cfg, cfg.hidden_size))
        self.per_layer_input = cfg.per_layer_input
        if self.per_layer_input:  # Gemma 4: a gated residual from the layer's own embedding
            self.act = ACTIVATIONS[cfg.hidden_act]
            self.per_layer_input_gate = nn.Linear(cfg.hidden_size, cfg.per_layer_input,
                                                  bias=False)
            self.per_layer_projection = nn.Linear(cfg.per_layer_input, cfg.hidden_size,
                                                  bias=False)
            self.post_per_layer_input_norm = make_norm(cfg, cfg.hidden_size)
        # Gemma 4: the layer's output times a learned scalar
        self.layer_scalar = nn.Parameter(torch.ones(1)) if cfg.layer_scalar else None

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, ...] | None,
        batch: ForwardBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        per_layer_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = self._blocks(x, cos_sin, batch, kv_cache, shared)
        if per_layer_input is not None:
            gate = self.act(self.per_layer_input_gate(out)) * per_layer_input
            out = out + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        if self.layer_scalar is not None:
            out = out * self.layer_scalar
        return out

    def _blocks(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, ...] | None,
        batch: ForwardBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> torch.Tensor:
        if self.placement == "post":  # each sublayer's output normed before the residual add
            x = _add_normed(x, self.self_attn(x, cos_sin, batch, kv_cache, shared),
                            self.post_attention_layernorm)
            return _add_normed(x, self.mlp(x), self.post_feedforward_layernorm)
        if self.placement == "parallel":  # attention and MLP both read one norm of x
            normed = self.input_layernorm(x)
            attn = self.self_attn(normed, cos_sin, batch, kv_cache, shared)
            both: torch.Tensor = x + attn + self.mlp(normed)
            return both
        h: torch.Tensor = self.self_attn(self.input_layernorm(x), cos_sin, batch, kv_cache,
                                         shared)
        if self.placement == "sandwich":
            x = _add_normed(x, h, self.post_attention_layernorm)
            h = self.mlp(self.pre_feedforward_layernorm(x))
            if self.moe is not None:  # the experts read (and are routed by) x itself
                experts = self.moe(self.pre_feedforward_layernorm_2(x), route_from=x)
                h = self.post_feedforward_layernorm_1(h) + \
                    self.post_feedforward_layernorm_2(experts)
            return _add_normed(x, h, self.post_feedforward_layernorm)
        x = x + h
        h = self.mlp(self.post_attention_layernorm(x))
        return x + h


def _add_normed(x: torch.Tensor, h: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """``x + norm(h)``: one compiled pass where the norm's own forward would take its
    compiled pass (the same two roundings; `kernels.cpu_norm.add_rms_norm`), instead of
    a norm and torch's add, which re-reads both out of memory (a 512-token prefill step of
    gemma-3-270m spent ~10 ms in those adds)."""
    if (isinstance(norm, RMSNorm) and cpu_norm.supports(h, norm.float32_kernel)
            and x.dtype == h.dtype and x.shape == h.shape and x.is_contiguous()):
        return cpu_norm.add_rms_norm(x, h, norm.scale(), norm.eps)
    out: torch.Tensor = x + norm(h)
    return out


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_groups: list[int]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, g) for i, g in enumerate(layer_groups)
        )
        self.norm = make_norm(cfg, cfg.hidden_size)
        if cfg.per_layer_input:  # Gemma 4's per-layer inputs: one packed table for all
            size = cfg.num_layers * cfg.per_layer_input
            self.embed_tokens_per_layer = nn.Embedding(cfg.per_layer_vocab, size)
            self.per_layer_model_projection = nn.Linear(cfg.hidden_size, size, bias=False)
            self.per_layer_projection_norm = make_norm(cfg, cfg.per_layer_input)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor,
                         cfg: ModelConfig) -> torch.Tensor:
        """Gemma 4: per layer, the token's own embedding for it plus a normed projection of
        the scaled input embedding ``x``, over sqrt(2): [tokens, layers, size]."""
        shape = (x.shape[0], cfg.num_layers, cfg.per_layer_input)
        table = self.embed_tokens_per_layer.weight
        own = F.embedding(input_ids, table) * torch.tensor(cfg.per_layer_input**0.5,
                                                           dtype=table.dtype)
        projected = self.per_layer_model_projection(x) * cfg.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.reshape(shape))
        both: torch.Tensor = (projected + own.reshape(shape)) * 2.0**-0.5
        return both


class CausalLM(nn.Module):
    """A causal LM whose attention reads and writes the ring KV cache.

    Args:
        cfg: the architecture.
        layer_groups: per layer, the index of its KV layer group (block_manager's order).
    """

    def __init__(self, cfg: ModelConfig, layer_groups: list[int]) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, layer_groups)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        # One rotary table per distinct RoPE config (Gemma-3: local and global).
        # (a NoPE layer, rope None, takes no table)
        # (and head size: Gemma 4's full layers have their own)
        keys = [None if r is None else (r, cfg.head_dim_of(i))
                for i, r in enumerate(cfg.layer_ropes)]
        self._ropes = list(dict.fromkeys(k for k in keys if k is not None))
        self._rotaries = [Rotary(r, d, cfg.rotary_interleaved) for r, d in self._ropes]
        self._layer_rope = [None if k is None else self._ropes.index(k) for k in keys]
        # layers whose K/V a later layer attends to (Gemma 4's KV sharing)
        self._deferred = sorted({cfg.kv_source_of(i) for i in range(cfg.num_layers)
                                 if cfg.kv_source_of(i) != i})
        self._kv_shared = bool(self._deferred)
        self._fast: tuple[tuple[Any, ...], FastDecode | None] | None = None

    def _fast_decode(self, dtype: torch.dtype) -> FastDecode | None:
        """The layers' decode path without their modules (`fast_decode`), built for the
        model as it is now: built again after a linear gained a copy or loading replaced
        the projections (`FastDecode.signature`)."""
        sign = FastDecode.signature(self)
        if self._fast is None or self._fast[0] != (dtype, sign):
            self._fast = ((dtype, sign), FastDecode.build(self, dtype))
        return self._fast[1]

    def tie_weights(self) -> None:
        """Share the embedding with the output head where the checkpoint ties them (a head
        and embedding that both wait for a GGUF file's blocks share those instead)."""
        embed = self.model.embed_tokens
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear) \
                and hasattr(embed, "weight"):
            self.lm_head.weight = embed.weight

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch,
                kv_caches: KVCaches) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm, caches updated."""
        x = self.model.embed_tokens(input_ids)
        if self.config.scale_embeddings:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        tables = [rot.cos_sin(batch.positions, batch.max_position, x.dtype)
                  for rot in self._rotaries]
        per_layer = (self.model.per_layer_inputs(input_ids, x, self.config)
                     if self.config.per_layer_input else None)
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = (
            {} if self._kv_shared else None)
        fast = self._fast_decode(x.dtype)
        if fast is not None and fast.takes(x, batch, kv_caches, self._layer_rope):
            normed: torch.Tensor = self.model.norm(fast.run(x, tables, self._layer_rope, batch,
                                                            kv_caches))
            return normed
        for i, layer in enumerate(self.model.layers):
            rope = self._layer_rope[i]
            x = layer(x, None if rope is None else tables[rope], batch, kv_caches[i], shared,
                      None if per_layer is None else per_layer[:, i])
        for i in self._deferred:  # K/V later layers attended to, written after them
            assert shared is not None
            attention = self.model.layers[i].self_attn
            assert isinstance(attention, Attention)
            attention.write(*shared[i], batch, kv_caches[i])
        out: torch.Tensor = self.model.norm(x)
        return out

    def compute_logits(self, hidden: torch.Tensor, *, upcast: bool = True) -> torch.Tensor:
        """Logits of the given rows, with the final soft-cap where the family has one.

        Args:
            upcast: return float32 (the default). With False the logits stay in the
                model's dtype unless a soft-cap needs float32: a greedy pick is the same
                on them (widening is exact), and the sampler widens only the rows it samples.
        """
        logits: torch.Tensor = self.lm_head(hidden)
        if self.config.logit_scale != 1.0:
            logits = logits * self.config.logit_scale
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits.float() / cap) * cap
        return logits.float() if upcast else logits

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the parameters; every parameter must be given once.

        Raises:
            ValueError: a parameter is missing, or a tensor's shape does not match.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            # a multimodal checkpoint's language model (Gemma 4); its towers are skipped
            name = name.replace("model.language_model.", "model.", 1)
            if self.config.moe_parallel:  # Gemma 4 keeps them on the layer; ours in .moe
                name = _LAYER_MOE.sub(_moe_name, name)
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied to the embedding, which is loaded under its own name
            if name not in params:
                continue  # rotary buffers and other non-parameters of some checkpoints
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(
                    f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model "
                    f"{tuple(param.shape)}"
                )
            if tensor.data_ptr() != param.data_ptr():  # else read in place
                param.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)  # a tied lm_head is not listed on its own
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:5]}")
