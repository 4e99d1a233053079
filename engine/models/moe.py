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

from ringserve.engine.models.config import ModelConfig
from ringserve.engine.models.layers import ACTIVATIONS, rms_unit


class Router(nn.Module):
    """Logits of every expert: ``x @ weight.T + bias``."""

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden))
        self.bias = nn.Parameter(torch.zeros(experts))


class ExpertWeights(nn.Module):
    """The experts' stacked weights, as the checkpoint holds them: gpt-oss's [E, in, out]
    with biases, or (``out_in``: Gemma 4) [E, out, in] without."""

    def __init__(self, experts: int, hidden: int, intermediate: int, *,
                 out_in: bool = False) -> None:
        super().__init__()
        self.out_in = out_in
        gate_up, down = (hidden, 2 * intermediate), (intermediate, hidden)
        if out_in:
            gate_up, down = gate_up[::-1], down[::-1]
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, *gate_up))
        self.down_proj = nn.Parameter(torch.zeros(experts, *down))
        self.gate_up_proj_bias: nn.Parameter | None = None
        self.down_proj_bias: nn.Parameter | None = None
        if not out_in:
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(experts, 2 * intermediate))
            self.down_proj_bias = nn.Parameter(torch.zeros(experts, hidden))


class ExpertLinears(nn.Module):
    """Each expert's two projections as linears ([out, in]): `nn.Linear` s made once from
    the stacked weights after loading (`from_stacked`), so that every path a linear takes
    serves them (oneDNN-packed or compact bf16 on the CPU, int8/int4 with
    ``--quantization``), or quantized linears made straight from an MXFP4 checkpoint's
    blocks (`engine.loading.build`)."""

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module]) -> None:
        super().__init__()
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)

    @classmethod
    def from_stacked(cls, stacked: ExpertWeights) -> ExpertLinears:
        experts = range(stacked.gate_up_proj.shape[0])

        def bias(b: nn.Parameter | None, e: int) -> torch.Tensor | None:
            return None if b is None else b[e]

        return cls(
            [_linear(stacked.gate_up_proj[e], bias(stacked.gate_up_proj_bias, e),
                     stacked.out_in) for e in experts],
            [_linear(stacked.down_proj[e], bias(stacked.down_proj_bias, e), stacked.out_in)
             for e in experts])


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, out_in: bool) -> nn.Linear:
    """A Linear of ``weight`` ([in, out], or [out, in] with ``out_in``) and ``bias``."""
    weight = weight.detach() if out_in else weight.detach().t()
    with torch.device("meta"):  # no random init to overwrite
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
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
        self.linears = ExpertLinears.from_stacked(self.experts)
        del self.experts

    def activate(self, h: torch.Tensor) -> torch.Tensor:
        """gpt-oss: (up + 1) * gate * sigmoid(alpha * gate), gate and up interleaved, gate
        capped above and up both ways."""
        gate = h[..., 0::2].clamp(max=self.limit)
        up = h[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """gpt-oss: the k largest router logits, weighted by their softmax: per token,
        ([T, k] weights, [T, k] experts)."""
        logits = torch.nn.functional.linear(flat, self.router.weight, self.router.bias)
        top, chosen = logits.topk(self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), chosen

    def forward(self, x: torch.Tensor, route_from: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' weighted sum for ``x``, routed by ``route_from`` (default ``x``)."""
        flat = x.reshape(-1, x.shape[-1])
        top, chosen = self.route(flat if route_from is None else
                                 route_from.reshape(-1, route_from.shape[-1]))
        weights = top.reshape(-1)
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
            y = self.linears.down[expert](self.activate(h))
            # NOTE: index_put_ with accumulate (a token is at most once in `tokens`): the
            # same sums as index_add_, which took 65-190 us a call for one 2880-wide row
            # against 11 (~3 ms of a 4-layer gpt-oss decode step, AVX2 EPYC, 2026-12-07).
            out.index_put_((tokens,), (y * weights[taken, None]).to(out.dtype),
                           accumulate=True)
        return out.view(x.shape)


class Gemma4Router(nn.Module):
    """Gemma 4's router: a weightless RMS norm, times a learned scale and 1/sqrt(hidden),
    then the logits (transformers' names: ``router.proj``, ``scale``, ``per_expert_scale``)."""

    def __init__(self, hidden: int, experts: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.proj = nn.Linear(hidden, experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(experts))


class Gemma4MoE(MoE):
    """Gemma 4's mixture of experts (26B-A4B), beside each layer's dense MLP: the softmax
    over every expert, its top k renormalised to sum to 1 and scaled per expert; experts
    ``down(gelu(gate) * up)`` with gate and up the two halves of one projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.top_k = cfg.experts_per_token
        self.num_experts = cfg.num_experts
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.gemma_router = Gemma4Router(cfg.hidden_size, cfg.num_experts, cfg.rms_norm_eps)
        self.experts = ExpertWeights(cfg.num_experts, cfg.hidden_size,
                                     cfg.moe_intermediate_size, out_in=True)
        self.linears = None

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.gemma_router
        h = rms_unit(flat, r.eps) * r.scale * flat.shape[-1] ** -0.5
        probs = torch.softmax(r.proj(h), dim=-1, dtype=torch.float32)
        top, chosen = probs.topk(self.top_k, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        return (top * r.per_expert_scale[chosen]).to(flat.dtype), chosen

    def activate(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        out: torch.Tensor = self.act(gate) * up
        return out


def split_experts(model: nn.Module) -> int:
    """`MoE.split` every mixture of experts in ``model``; returns how many."""
    moes = [m for m in model.modules() if isinstance(m, MoE) and m.linears is None]
    for moe in moes:
        moe.split()
    return len(moes)
