"""gpt-oss's mixture of experts: a top-k router over experts with a clamped SwiGLU.

Each token's hidden state goes to the `k` experts with the largest router logits, weighted
by the softmax of those k logits. The experts run grouped: the step's (token, expert) pairs
are sorted by expert once, and each expert that was picked multiplies its own tokens as one
matrix (no pass over all experts for every token). Parameter names and layouts are
transformers' (`mlp.router.weight`, `mlp.experts.gate_up_proj` [E, H, 2I] with gate and up
interleaved along the last dim, `mlp.experts.down_proj` [E, I, H], and their biases).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.config import ModelConfig


class Router(nn.Module):
    """Logits of every expert: ``x @ weight.T + bias``."""

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden))
        self.bias = nn.Parameter(torch.zeros(experts))


class ExpertWeights(nn.Module):
    """The experts' stacked weights, as the checkpoint holds them."""

    def __init__(self, experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, hidden, 2 * intermediate))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(experts, 2 * intermediate))
        self.down_proj = nn.Parameter(torch.zeros(experts, intermediate, hidden))
        self.down_proj_bias = nn.Parameter(torch.zeros(experts, hidden))


class MoE(nn.Module):
    """The MLP of a gpt-oss layer.

    Args:
        cfg: the model; reads num_experts, experts_per_token, swiglu_limit, swiglu_alpha.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.experts_per_token
        self.limit, self.alpha = cfg.swiglu_limit, cfg.swiglu_alpha
        self.router = Router(cfg.hidden_size, cfg.num_experts)
        self.experts = ExpertWeights(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size)

    def _swiglu(self, h: torch.Tensor) -> torch.Tensor:
        """(up + 1) * gate * sigmoid(alpha * gate), gate capped above and up both ways."""
        gate = h[..., 0::2].clamp(max=self.limit)
        up = h[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = torch.nn.functional.linear(flat, self.router.weight, self.router.bias)
        top, chosen = logits.topk(self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1).reshape(-1)
        pairs = chosen.reshape(-1)  # pair p is token p // k's choice p % k
        order = torch.argsort(pairs, stable=True)
        counts = torch.bincount(pairs, minlength=self.experts.down_proj.shape[0]).tolist()
        out = torch.zeros_like(flat)
        w = self.experts
        start = 0
        for expert, n in enumerate(counts):  # each picked expert once, its tokens as a matrix
            if n == 0:
                continue
            taken = order[start : start + n]
            start += n
            tokens = taken // self.top_k
            h = flat[tokens] @ w.gate_up_proj[expert] + w.gate_up_proj_bias[expert]
            y = self._swiglu(h) @ w.down_proj[expert] + w.down_proj_bias[expert]
            out.index_add_(0, tokens, (y * weights[taken, None]).to(out.dtype))
        return out.view(x.shape)
