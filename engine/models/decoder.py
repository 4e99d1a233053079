"""One decoder-only transformer for every supported family, with HF parameter names."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.forward_batch import ForwardBatch
from engine.models.config import ModelConfig
from engine.models.layers import MLP, Attention, Rotary, make_norm
from engine.models.moe import MoE

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer, its group's (key_cache, value_cache): [num_blocks, block_size, kv_heads, dim]."""


class DecoderLayer(nn.Module):
    # the norms a placement has (see __init__), under transformers' names
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module
    pre_feedforward_layernorm: nn.Module
    post_feedforward_layernorm: nn.Module

    def __init__(self, cfg: ModelConfig, layer: int, group: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, group)
        self.mlp: nn.Module = MoE(cfg) if cfg.num_experts else MLP(cfg)
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

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, ...] | None,
        batch: ForwardBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        if self.placement == "post":  # each sublayer's output normed before the residual add
            x = x + self.post_attention_layernorm(self.self_attn(x, cos_sin, batch, kv_cache))
            out: torch.Tensor = x + self.post_feedforward_layernorm(self.mlp(x))
            return out
        if self.placement == "parallel":  # attention and MLP both read one norm of x
            normed = self.input_layernorm(x)
            attn = self.self_attn(normed, cos_sin, batch, kv_cache)
            both: torch.Tensor = x + attn + self.mlp(normed)
            return both
        h: torch.Tensor = self.self_attn(self.input_layernorm(x), cos_sin, batch, kv_cache)
        if self.placement == "sandwich":
            x = x + self.post_attention_layernorm(h)
            h = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
            return x + h
        x = x + h
        h = self.mlp(self.post_attention_layernorm(x))
        return x + h


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_groups: list[int]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, g) for i, g in enumerate(layer_groups)
        )
        self.norm = make_norm(cfg, cfg.hidden_size)


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
        self._ropes = sorted({r for r in cfg.layer_ropes if r is not None},
                             key=cfg.layer_ropes.index)
        self._rotaries = [Rotary(r, cfg.head_dim, cfg.rotary_interleaved) for r in self._ropes]
        self._layer_rope = [None if r is None else self._ropes.index(r) for r in cfg.layer_ropes]

    def tie_weights(self) -> None:
        """Share the embedding with the output head where the checkpoint ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch,
                kv_caches: KVCaches) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm, caches updated."""
        x = self.model.embed_tokens(input_ids)
        if self.config.scale_embeddings:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        tables = [rot.cos_sin(batch.positions, batch.max_position, x.dtype)
                  for rot in self._rotaries]
        for i, layer in enumerate(self.model.layers):
            rope = self._layer_rope[i]
            x = layer(x, None if rope is None else tables[rope], batch, kv_caches[i])
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
            param.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)  # a tied lm_head is not listed on its own
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:5]}")
