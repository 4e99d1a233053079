"""gpt-oss's mixture of experts: a top-k router over experts with a clamped SwiGLU.

Each token's hidden state goes to the `k` experts with the largest router logits, weighted
by the softmax of those k logits. The experts run grouped: the step's (token, expert) pairs
are sorted by expert once, and each expert that was picked multiplies its own tokens as one
matrix (no pass over all experts for every token). Parameter names and layouts are
transformers' (`mlp.router.weight`, `mlp.experts.gate_up_proj` [E, H, 2I] with gate and up
interleaved along the last dim, `mlp.experts.down_proj` [E, I, H], and their biases) while
loading; then each expert's projections become `nn.Linear` s (`split_experts`), served as
any linear is (packed, compact or quantized weights on the CPU).
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


class ExpertLinears(nn.Module):
    """Each expert's two projections as biased `nn.Linear` s ([out, in]), made once from
    the stacked weights after loading, so that every path a linear takes serves them:
    oneDNN-packed or compact bf16 on the CPU, int8/int4 with ``--quantization``."""

    def __init__(self, stacked: ExpertWeights) -> None:
        super().__init__()
        self.gate_up = nn.ModuleList(_linear(stacked.gate_up_proj[e], stacked.gate_up_proj_bias[e])
                                     for e in range(stacked.gate_up_proj.shape[0]))
        self.down = nn.ModuleList(_linear(stacked.down_proj[e], stacked.down_proj_bias[e])
                                  for e in range(stacked.down_proj.shape[0]))


def _linear(weight: torch.Tensor, bias: torch.Tensor) -> nn.Linear:
    """A Linear of ``weight`` [in, out] (the checkpoint's layout) and ``bias``."""
    with torch.device("meta"):  # no random init to overwrite
        linear = nn.Linear(weight.shape[0], weight.shape[1])
    linear.weight = nn.Parameter(weight.detach().t().contiguous(), requires_grad=False)
    linear.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return linear


class MoE(nn.Module):
    """The MLP of a gpt-oss layer.

    Args:
        cfg: the model; reads num_experts, experts_per_token, swiglu_limit, swiglu_alpha.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.experts_per_token
        self.limit, self.alpha = cfg.swiglu_limit, cfg.swiglu_alpha
        self.num_experts = cfg.num_experts
        self.router = Router(cfg.hidden_size, cfg.num_experts)
        self.experts = ExpertWeights(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size)
        self.linears: ExpertLinears | None = None  # `split`, once the weights are in

    def split(self) -> None:
        """Turn the stacked (loaded) expert weights into one linear per projection and
        expert, dropping the stacked ones."""
        self.linears = ExpertLinears(self.experts)
        del self.experts

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
        counts = torch.bincount(pairs, minlength=self.num_experts).tolist()
        out = torch.zeros_like(flat)
        assert self.linears is not None, "MoE.split() runs at load"
        start = 0
        for expert, n in enumerate(counts):  # each picked expert once, its tokens as a matrix
            if n == 0:
                continue
            taken = order[start : start + n]
            start += n
            tokens = taken // self.top_k
            h = self.linears.gate_up[expert](flat[tokens])
            y = self.linears.down[expert](self._swiglu(h))
            out.index_add_(0, tokens, (y * weights[taken, None]).to(out.dtype))
        return out.view(x.shape)


def split_experts(model: nn.Module) -> int:
    """`MoE.split` every mixture of experts in ``model``; returns how many."""
    moes = [m for m in model.modules() if isinstance(m, MoE) and m.linears is None]
    for moe in moes:
        moe.split()
    return len(moes)
