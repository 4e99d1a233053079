"""Building blocks shared by every family: norms, rotary embeddings, MLPs, paged attention."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ringserve import kernels
from ringserve.engine.forward_batch import ForwardBatch
from ringserve.engine.models.config import ModelConfig, RopeConfig, UnsupportedConfigError
from ringserve.kernels import cpu_act, cpu_norm

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


class WideningEmbedding(nn.Embedding):
    """An embedding whose table is held in its stored dtype (bf16) under wider activations
    (float32): only the looked-up rows are widened, exactly.

    Args:
        weight: the table (its parameter is shared, e.g. with a tied head).
        out_dtype: the activations' dtype.
    """

    def __init__(self, weight: nn.Parameter, out_dtype: torch.dtype) -> None:
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight, _freeze=True,
                         device="meta")
        self.weight = weight
        self.out_dtype = out_dtype

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.embedding(input, self.weight).to(self.out_dtype)


class RMSNorm(nn.Module):
    """RMSNorm in fp32. ``plus_one``: Gemma's ``x * (1 + w)``, cast after the multiply.

    bf16 CPU tensors take one compiled pass (`kernels.cpu_norm`), multiplying by the weight
    in float32 before the one rounding, and so do float32 ones where ``float32_kernel`` is
    set (a model with int16 activations is no longer bit-faithful to float32 anyway);
    everything else runs transformers' op sequence.
    """

    def __init__(self, dim: int, eps: float, *, plus_one: bool = False,
                 weight_float32: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.plus_one = plus_one
        self.weight_float32 = weight_float32  # Gemma 4: ``w`` in float32, then the cast
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))
        self.float32_kernel = False  # float32 in the compiled pass too (see cpu_norm.supports)
        self._scale: tuple[int, torch.Tensor] | None = None

    def scale(self) -> torch.Tensor:
        """The effective weight in float32 (``1 + w`` or ``w``), kept until w changes."""
        version = self.weight._version
        if self._scale is None or self._scale[0] != version:
            w = self.weight.detach().float()
            self._scale = (version, (1.0 + w) if self.plus_one else w.clone())
        return self._scale[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_norm.supports(x, self.float32_kernel):
            return cpu_norm.rms_norm(x, self.scale(), self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            return (h * (1.0 + self.weight.float())).type_as(x)
        if self.weight_float32:
            return (h * self.weight.float()).type_as(x)
        return self.weight * h.to(x.dtype)


def rms_unit(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, in float32 (Gemma 4's value norm)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class LayerNorm(nn.Module):
    """Cohere's LayerNorm: mean-centred, no bias, in float32, times the weight before the
    one cast back (transformers' op sequence)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        centred = h - h.mean(-1, keepdim=True)
        h = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    """The family's norm over ``dim`` features: RMSNorm (``(1 + w)`` for Gemma) or, with
    ``cfg.layer_norm``, Cohere's LayerNorm."""
    if cfg.layer_norm:
        return LayerNorm(dim, cfg.rms_norm_eps)
    return RMSNorm(dim, cfg.rms_norm_eps, plus_one=cfg.norm_plus_one,
                   weight_float32=cfg.norm_weight_float32)


class Rotary:
    """cos/sin tables of one RoPE configuration, computed once and indexed per step.

    The table is built in float32 exactly as transformers computes it per call
    (``position * inv_freq``, then cos/sin), so indexing it gives the same numbers.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, interleaved: bool = False) -> None:
        self.rot_dim = head_dim if rope.proportional else int(head_dim * rope.partial_factor)
        self.interleaved = interleaved  # each frequency twice in a row (Cohere), not halves
        # NOTE: on the CPU explicitly: models are built under the meta device.
        exponents = torch.arange(0, self.rot_dim, 2, dtype=torch.int64, device="cpu").float()
        exponents = exponents / self.rot_dim
        if rope.proportional:  # the first pairs rotate, the others keep frequency 0
            angles = int(rope.partial_factor * head_dim // 2)
            inv = 1.0 / (rope.theta ** exponents[:angles])
            rest = torch.zeros(head_dim // 2 - angles, device="cpu")
            self.inv_freq = torch.cat((inv, rest)) / rope.factor
        elif rope.yarn_original:
            self.inv_freq = yarn_inv_freq(rope, self.rot_dim, rope.theta**exponents)
        elif rope.llama3:
            self.inv_freq = llama3_inv_freq(rope, 1.0 / (rope.theta**exponents))
        else:
            self.inv_freq = 1.0 / (rope.theta**exponents) / rope.factor
        self.attention_factor = rope.attention_factor
        self._tables: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def _table(self, length: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        table = self._tables.get((device, dtype))
        if table is None or table.shape[1] < length:  # [cos/sin, positions, rot_dim]
            size = max(length, 2 * (0 if table is None else table.shape[1]), 4096)
            positions = torch.arange(size, dtype=torch.float32)
            freqs = positions[:, None] * self.inv_freq
            emb = (freqs.repeat_interleave(2, dim=-1) if self.interleaved
                   else torch.cat((freqs, freqs), dim=-1))
            table = torch.stack((emb.cos(), emb.sin()))
            if self.attention_factor != 1.0:  # YaRN scales q.k through both rotations
                table = table * self.attention_factor
            table = table.to(device=device, dtype=dtype)
            self._tables[(device, dtype)] = table
        return table

    def cos_sin(self, positions: torch.Tensor, max_position: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [tokens, 1, rot_dim] for ``positions`` (all below ``max_position``)."""
        table = self._table(max_position, positions.device, dtype)
        picked = table[:, positions][:, :, None, :]
        return picked[0], picked[1]


def llama3_inv_freq(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3's frequencies: a pair that turns fewer than ``low`` times over the original
    context is slowed by ``factor``, one that turns more than ``high`` times is kept, and the
    pairs between blend the two by where their turn count lies between ``low`` and ``high``."""
    assert rope.llama3 is not None
    low, high, original = rope.llama3
    turns = original * inv_freq / (2 * math.pi)  # = original / wavelength
    slowed = inv_freq / rope.factor
    blend = ((turns - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - blend) * slowed + blend * inv_freq


def yarn_inv_freq(rope: RopeConfig, dim: int, wavelengths: torch.Tensor) -> torch.Tensor:
    """YaRN's "NTK-by-parts" frequencies (arXiv 2309.00071, section 3.2): dimension pairs
    that turn more than ``beta_fast`` times over the original context keep their frequency
    (extrapolate), those that turn fewer than ``beta_slow`` times are divided by the factor
    (interpolate), and a linear ramp blends the pairs between.

    Args:
        wavelengths: theta ** (2i / dim) for the dim / 2 pairs, float32.
    """
    def pair_of(turns: float) -> float:  # the pair index that turns `turns` times
        return (dim * math.log(rope.yarn_original / (turns * 2 * math.pi))
                / (2 * math.log(rope.theta)))

    low, high = pair_of(rope.beta_fast), pair_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-pair ramp
    ramp = (torch.arange(dim // 2, dtype=torch.float32, device=wavelengths.device) - low)
    ramp = (ramp / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate (divided)
    return (1.0 / (rope.factor * wavelengths)) * (1 - keep) + (1.0 / wavelengths) * keep


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool = False) -> torch.Tensor:
    """Rotate the first ``rot_dim`` features of ``x`` [tokens, heads, head_dim]: the pairs
    (i, i + rot_dim / 2) (half-split), or (2i, 2i + 1) where ``interleaved``."""
    rot_dim = cos.shape[-1]
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    if interleaved:
        rotated = torch.stack((-rot[..., 1::2], rot[..., ::2]), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., : rot_dim // 2], rot[..., rot_dim // 2 :]
        rotated = torch.cat((-x2, x1), dim=-1)
    out = rot * cos + rotated * sin
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


class MLP(nn.Module):
    """Gated MLP ``down(act(gate(x)) * up(x))``; phi3 keeps gate and up fused."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        if cfg.hidden_act not in ACTIVATIONS:
            raise UnsupportedConfigError(f"activation {cfg.hidden_act!r} is not implemented")
        self.act = ACTIVATIONS[cfg.hidden_act]
        # the tanh GELU's act(gate) * up takes one compiled pass on bf16 CPU rows
        self.gelu_tanh = cfg.hidden_act in ("gelu_pytorch_tanh", "gelu_new")
        self.fused = cfg.fused_qkv
        h, i, bias = cfg.hidden_size, cfg.intermediate_of(layer), cfg.mlp_bias
        if self.fused:
            self.gate_up_proj = nn.Linear(h, 2 * i, bias=False)
        else:
            self.gate_proj = nn.Linear(h, i, bias=bias)
            self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        h = cpu_act.gelu_tanh_mul(gate, up) if self.gelu_tanh else None
        out: torch.Tensor = self.down_proj(self.act(gate) * up if h is None else h)
        return out


class Attention(nn.Module):
    """Self-attention over the ring: attend to cache + fresh K/V first, write K/V after.

    A layer keeps K/V of its own (``kv_mode`` "own"; "k_is_v" where the values are the
    keys' projection before their norm and rotary, Gemma 4's full layers) or attends to the
    K/V another layer wrote this step ("shared": Gemma 4's last layers), which it gets
    through ``shared`` and neither computes nor writes.
    """

    def __init__(self, cfg: ModelConfig, layer: int, group: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_heads
        self.num_kv_heads, self.head_dim = cfg.kv_heads_of(layer), cfg.head_dim_of(layer)
        self.group = group
        self.window = cfg.layer_windows[layer]
        self.scale = cfg.scale
        self.softcap = cfg.attn_softcap
        self.kv_source = cfg.kv_source_of(layer)
        self.kv_mode = ("shared" if self.kv_source != layer else
                        "k_is_v" if cfg.k_is_v(layer) else "own")
        # K/V a later layer attends to are written after it has (`CausalLM.forward`): a
        # ring may not hold a chunk's new tokens beside the window its first query reads
        self.defer_write = any(cfg.kv_source_of(j) == layer
                               for j in range(layer + 1, cfg.num_layers))
        self.eps = cfg.rms_norm_eps
        self.v_norm = cfg.v_norm
        h = cfg.hidden_size
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.proj_names = {"own": ["q_proj", "k_proj", "v_proj"], "k_is_v": ["q_proj", "k_proj"],
                           "shared": ["q_proj"]}[self.kv_mode]  # fmt: skip
        self.proj_sizes = [q_size, kv_size, kv_size][: len(self.proj_names)]
        self.fused = cfg.fused_qkv
        if self.fused:
            self.qkv_proj = nn.Linear(h, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        else:
            for name, size in zip(self.proj_names, self.proj_sizes, strict=True):
                setattr(self, name, nn.Linear(h, size, bias=cfg.qkv_bias))
        self.o_proj = nn.Linear(q_size, h, bias=cfg.o_bias)
        self.float32_kernel = False  # float32 norm + rotary compiled too (cpu_norm.supports)
        # gpt-oss: a learned logit per head that joins the softmax's denominator
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.attn_sinks else None
        self.interleaved = cfg.rotary_interleaved  # the compiled pass is half-split only
        self.qk_norm, self.qk_norm_full = cfg.qk_norm, cfg.qk_norm_full
        if self.qk_norm or self.qk_norm_full:  # per head, or over the whole projection
            q_dim, k_dim = (self.head_dim, self.head_dim) if self.qk_norm else (q_size, kv_size)
            self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps, plus_one=cfg.norm_plus_one,
                                  weight_float32=cfg.norm_weight_float32)
            if self.kv_mode != "shared":
                self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps, plus_one=cfg.norm_plus_one,
                                      weight_float32=cfg.norm_weight_float32)

    def _project(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.fused:
            return list(self.qkv_proj(x).split(self.proj_sizes, dim=-1))
        return [getattr(self, name)(x) for name in self.proj_names]

    def _rotate(self, x: torch.Tensor, norm: RMSNorm | None,
                cos_sin: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
        """(Per-head norm and) rotary of q or k [tokens, heads, head_dim]."""
        if cos_sin is None:  # NoPE: the per-head norm alone
            return x if norm is None else norm(x)
        cos, sin = cos_sin
        if not self.interleaved and cpu_norm.supports(x, self.float32_kernel):  # one pass
            eps = 0.0 if norm is None else norm.eps
            return cpu_norm.norm_rope(x, None if norm is None else norm.scale(), cos, sin, eps)
        if norm is not None:
            x = norm(x)
        return apply_rotary(x, cos, sin, self.interleaved)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, ...] | None,
        batch: ForwardBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """``cos_sin`` None: a layer without rotary embedding (NoPE). ``shared``: the
        step's K/V by layer, for the layers that attend to another's."""
        tokens = x.shape[0]
        parts = self._project(x)
        q = parts[0]
        if self.qk_norm_full:
            q = self.q_norm(q)
        q = self._rotate(q.view(tokens, self.num_heads, self.head_dim),
                         self.q_norm if self.qk_norm else None, cos_sin)
        key_cache, value_cache = kv_cache
        tables = batch.groups[self.group]
        if self.kv_mode == "shared":
            assert shared is not None, "a layer that shares K/V needs the step's"
            k, v = shared[self.kv_source]
        else:
            k = parts[1]
            v = k if self.kv_mode == "k_is_v" else parts[2]
            if self.qk_norm_full:
                k = self.k_norm(k)
            v = v.view(tokens, self.num_kv_heads, self.head_dim)
            if self.v_norm:
                v = rms_unit(v, self.eps)
            k = self._rotate(k.view(tokens, self.num_kv_heads, self.head_dim),
                             self.k_norm if self.qk_norm else None, cos_sin)
            if shared is not None:
                shared[self.layer] = (k, v)
            if batch.early_writes is not None:
                first = batch.early_writes
                kernels.write_kv(k[first], v[first], key_cache, value_cache,
                                 tables.slot_mapping[first])
        out = kernels.paged_attention(
            q, k, v, key_cache, value_cache, tables.block_tables, batch.query_start_loc,
            batch.context_lens, scale=self.scale, sliding_window=self.window,
            ring_blocks=tables.ring_blocks, softcap=self.softcap,
            sinks=None if self.sinks is None else self.sinks.float(),
        )
        if self.kv_mode != "shared" and not self.defer_write:
            self.write(k, v, batch, kv_cache)
        result: torch.Tensor = self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))
        return result

    def write(self, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
              kv_cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The step's K/V into this layer's cache, once every layer reading it has read."""
        kernels.write_kv(k, v, kv_cache[0], kv_cache[1], batch.groups[self.group].slot_mapping)
