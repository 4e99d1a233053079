"""A decode step's layers without their modules: the same compiled ops, called directly.

A decode step on the CPU spends a third of its time in Python at one row (docs/benchmarks.md,
"Where the served step loses"): per layer ~14 module calls and ~30 wrappers that check their
arguments and choose a path (which kernel a linear takes, whether a norm is compiled, the
attention's plan) before each compiled op. Those choices are the same for every layer of
every decode step of one batch size, so `FastDecode` makes them once per layer (the linears'
path per row count, the norms' scales, the heads' shapes) and once per step (the attention
plan and int32 tables of each layer group, the rotary tables' flat views), and runs the
layer as a flat sequence of op calls, two of them fused for this path: `qkv_rope` (the
fused projection split, q and k normed and rotated, v made contiguous) and `add_rms_norm`
(the residual add after a sandwich norm), each rounding as the ops it replaces.

It computes exactly what the modules compute (the same ops on the same tensors in the same
order, so the same bits; `tests/test_fast_decode.py` compares the two), and takes only
what it was written for: a bf16 model on the CPU (or float32 with int16 activations, whose
norms and rotary are compiled too: the AVX2 default) whose layers are "sandwich" (Gemma 2 and
3: four RMSNorms) with their own K/V, rotary embeddings and fused q/k/v and gate/up
projections, in steps where every row is one decode token. Anything else runs the
modules. ``RINGSERVE_FAST_DECODE=0`` turns it off (to compare the two).

Where every op of a layer is one of our compiled ones, the loop itself runs in C++
(`kernels/csrc/decode_layers.cpp`): the same op calls through torch's dispatcher, without
~2-3 us of Python a call (~0.7 ms of a one-row step of gemma-3-270m on a Zen 3). That is
float32 rows over int16-activation linears with the compiled float32 GELU (the AVX2 class's
default), and bf16 rows over the few-row quantized linears (or a weight's integer tiles,
`int8_tiles_linear`) with the compiled bf16 GELU in steps below the row count from which
any linear's call changes (`QuantLinear.direct_call`: one row, with the served defaults).
``RINGSERVE_DECODE_LAYERS=0`` keeps the loop here (to compare the two).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ringserve.engine.forward_batch import ForwardBatch
from ringserve.engine.models import quant_linear
from ringserve.engine.models.layers import MLP, Attention, RMSNorm
from ringserve.engine.models.quant_linear import QuantLinear
from ringserve.kernels import cpu_act, cpu_build, cpu_norm
from ringserve.kernels.cpu_attention import dense_rows

logger = logging.getLogger("ringserve.engine")

Linear = Callable[[torch.Tensor], torch.Tensor]
# The linears' ops the compiled loop calls, as decode_layers.cpp's enum Op numbers them.
LINEAR_OPS = {"int16_act_linear": 0, "quant_linear": 1, "compact_linear": 2,
              "int8_tiles_linear": 3}


def enabled() -> bool:
    return os.environ.get("RINGSERVE_FAST_DECODE", "1") != "0"


def compiled_loop_enabled() -> bool:
    return os.environ.get("RINGSERVE_DECODE_LAYERS", "1") != "0"


def _linear(module: nn.Module, dtype: torch.dtype) -> Linear | None:
    """``module``'s forward for rows of ``dtype`` with its choices made once
    (`QuantLinear.fixed_forward`); a module of another kind keeps its own forward (no module
    call around it)."""
    if isinstance(module, QuantLinear):
        return module.fixed_forward(dtype)
    forward: Linear = module.forward
    return forward


def _act_mul(mlp: MLP, dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor],
                                                      torch.Tensor]:
    """``act(gate) * up`` as `MLP.forward` computes it for CPU rows of ``dtype``: the
    compiled tanh GELU pass where `cpu_act.gelu_tanh_mul` takes them (bf16 with the width
    a multiple of its vector, or float32 on a vector build), else torch's two ops."""
    half = mlp.gate_up_proj.out_features // 2
    op = None
    if mlp.gelu_tanh and dtype == torch.bfloat16 and half % cpu_act._VECTOR == 0:
        op = cpu_act._op()
    elif mlp.gelu_tanh and dtype == torch.float32:
        op = cpu_act.f32_op()
    if op is not None:
        compiled: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = op
        return compiled
    act = mlp.act

    def torch_ops(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = act(gate) * up
        return out
    return torch_ops


@dataclass
class _Layer:
    attn: Attention
    norms: tuple[RMSNorm, ...]  # input, post-attention, pre-feedforward, post-feedforward
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    act_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # the four linears' calls (`QuantLinear.direct_call`: op, tile_rows, the row count
    # from which another call serves, the arguments after the rows) where the layer can
    # run in the compiled loop (its GELU a compiled pass too)
    direct: list[tuple[str, int, int | None, tuple[Any, ...]]] | None = None
    mods: list[RMSNorm] = field(default_factory=list)  # the four, then q_norm and k_norm
    scales: tuple[torch.Tensor, ...] = ()
    # what the step reads of the modules, read once here: every read of a module attribute
    # in the step runs with caches the weights just swept (docs/cpu.md, "A decode step's
    # small ops run with cold caches")
    eps: tuple[float, ...] = ()  # the four norms', then q_norm's and k_norm's (0: none)
    shape: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        attn = self.attn
        self.mods = [*self.norms, *([attn.q_norm, attn.k_norm] if attn.qk_norm else [])]
        self.eps = (*(m.eps for m in self.norms),
                    *((attn.q_norm.eps, attn.k_norm.eps) if attn.qk_norm else (0.0, 0.0)))
        self.shape = (attn.group, attn.num_heads, attn.num_kv_heads,
                      attn.head_dim, attn.scale, attn.window or 0, attn.softcap or 0.0,
                      attn.qk_norm)

    def fetch_scales(self) -> None:
        """The norms' effective weights (`RMSNorm.scale`), fetched again."""
        self.scales = tuple(m.scale() for m in self.mods)


class FastDecode:
    """The decode path of one model's layers (None from `build` where it does not apply)."""

    def __init__(self, layers: list[_Layer], ops: Any, dtype: torch.dtype,
                 below: int | None = None) -> None:
        self.layers = layers
        self.ops = ops
        self.dtype = dtype
        # the norms' weights, whose versions say when a scale must be fetched again (one
        # check a step, not one per layer)
        self._weights = [m.weight for layer in layers for m in layer.mods]
        self._versions: list[int] = []
        self._rows: dict[int, torch.Tensor] = {}  # arange(n) int64: decode rows' indices
        self._caches: list[Any] | None = None  # the caches `takes` last found fit
        # the compiled loop (`decode_layers.cpp`) where every layer can take it: made on the
        # first step, again when the norms' scales are fetched again; steps of `below` rows
        # or more (where some linear's call changes) run the Python loop
        self._compiled_ok = all(layer.direct is not None for layer in layers)
        self._below = below
        self._compiled: Any = None
        self._compiled_ropes: list[int] = []
        self._flat: tuple[list[Any], list[torch.Tensor]] | None = None  # caches, flattened

    def _norm_scales(self) -> None:
        versions = [w._version for w in self._weights]
        if versions != self._versions:
            for layer in self.layers:
                layer.fetch_scales()
            self._versions = versions
            self._compiled = None

    def _compiled_loop(self, ropes: list[int]) -> Any:
        """The `DecodeLayers` object of these layers (their constants as of now; layer i
        rotated by table ``ropes[i]``)."""
        none = torch.empty(0)
        tensors: list[torch.Tensor] = []
        floats: list[float] = []
        ints: list[int] = []
        for i, layer in enumerate(self.layers):
            group, heads, kv_heads, dim, scale, window, softcap, qk_norm = layer.shape
            scales = layer.scales
            tensors += [*scales[:4], *((scales[4], scales[5]) if qk_norm else (none, none))]
            assert layer.direct is not None
            ints += [heads, kv_heads, dim, group, window, ropes[i]]
            for name, tile_rows, _, args in layer.direct:
                if name == "int8_tiles_linear":  # (the copy's three tensors, its shape)
                    tiles, tscales, tmins, bits, wgroup, n, bias = args
                    tensors += [tiles, tscales, tmins]
                else:
                    weight, wscales, mins, bits, wgroup, bias = args
                    tensors += [weight, wscales, none if mins is None else mins]
                    n = weight.shape[0]
                tensors.append(none if bias is None else bias)
                ints += [LINEAR_OPS[name], bits, wgroup, n, tile_rows]
            floats += [*layer.eps, scale, softcap]
        table = cpu_act.table() if self.dtype == torch.bfloat16 else none
        return getattr(torch.classes, self.ops.name).DecodeLayers(tensors, floats, ints, table)

    @staticmethod
    def signature(model: Any) -> tuple[Any, ...]:
        """What `build` read that may change after a forward: the copies made since
        (`--packed-rows` adds them after loading) and the projection modules (loading
        replaces them, every layer in one pass: the first and last layers' stand for all)."""
        layers = model.model.layers
        ends = (layers[0], layers[-1]) if len(layers) else ()
        return (quant_linear.copy_epoch(), *(id(m) for layer in ends for parent in (
            layer.self_attn._modules, layer.mlp._modules) for m in parent.values()))

    @classmethod
    def build(cls, model: Any, dtype: torch.dtype) -> FastDecode | None:
        if dtype not in (torch.bfloat16, torch.float32) or not cpu_build.available():
            return None
        # float32 rows only where the norms and rotary take their compiled float32 pass
        # (with int16 activations, engine.loading.quantize); elsewhere torch's ops serve them
        f32 = dtype == torch.float32
        if not cpu_norm.supports(torch.empty(1, 64, dtype=dtype), f32):
            return None
        ops = cpu_build.ops()
        layers = []
        tops: list[int] = []  # row counts from which some linear's call changes
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if (layer.placement != "sandwich" or layer.moe is not None
                    or layer.per_layer_input or layer.layer_scalar is not None
                    or not isinstance(attn, Attention) or not isinstance(mlp, MLP)):
                return None
            if (attn.kv_mode != "own" or attn.defer_write or not attn.fused
                    or attn.qk_norm_full or attn.v_norm or attn.interleaved
                    or attn.sinks is not None or not mlp.fused
                    or (f32 and not attn.float32_kernel)):
                return None
            norms = tuple(getattr(layer, name) for name in (
                "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm"))
            heads = [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
            if not all(isinstance(n, RMSNorm) and n.float32_kernel == f32
                       for n in [*norms, *(heads if attn.qk_norm else [])]):
                return None
            linears = [_linear(m, dtype) for m in (attn.qkv_proj, attn.o_proj,
                                                        mlp.gate_up_proj, mlp.down_proj)]
            if any(f is None for f in linears):
                return None
            qkv, o, gate_up, down = (f for f in linears if f is not None)
            modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            calls: list[tuple[str, int, int | None, tuple[Any, ...]] | None] = [
                m.direct_call(dtype) if isinstance(m, QuantLinear) else None for m in modules]
            act_mul = _act_mul(mlp, dtype)
            compiled_act = cpu_act.f32_op() if f32 else cpu_act._op()
            direct = None
            # the compiled loop: every linear one op of ours (for bf16 rows a few-row op or
            # the integer tiles', for float32 rows int16_act_linear: `direct_call`), and the
            # GELU the compiled pass `_act_mul` chose
            if (mlp.gelu_tanh and compiled_act is not None and (f32 or act_mul is compiled_act)
                    and all(c is not None and c[0] in LINEAR_OPS for c in calls)):
                direct = [c for c in calls if c is not None]
                tops += [c[2] for c in direct if c[2] is not None]
            layers.append(_Layer(attn, norms, qkv, o, gate_up, down, act_mul, direct))
        below = min(tops, default=None)
        if all(layer.direct is not None for layer in layers):
            counts: dict[str, int] = {}
            for layer in layers:
                for name, *_ in layer.direct or ():
                    counts[name] = counts.get(name, 0) + 1
            logger.info("decode steps: the layers' compiled ops called from one compiled loop "
                        "(kernels/csrc/decode_layers.cpp; linears: %s%s; "
                        "RINGSERVE_DECODE_LAYERS=0 for the Python loop, RINGSERVE_FAST_DECODE=0 "
                        "for the modules)", ", ".join(f"{n} {name}" for name, n in counts.items()),
                        f"; steps of fewer than {below} rows" if below else "")
        else:
            logger.info("decode steps: each layer's compiled ops called in one flat sequence "
                        "(engine/models/fast_decode.py; RINGSERVE_FAST_DECODE=0 for the "
                        "modules)")
        return cls(layers, ops, dtype, below)

    def takes(self, x: torch.Tensor, batch: ForwardBatch, kv_caches: list[Any],
              rope_of_layer: list[int | None]) -> bool:
        """Whether this step is one it serves: rows of its dtype on the CPU, every row one
        decode token after a cached context (`ForwardBatch.decode_only`), every layer with
        rotary tables, caches of the rows' dtype (or bf16 under float32 rows)."""
        if (not enabled() or not batch.decode_only or x.dtype != self.dtype
                or x.device.type != "cpu" or x.shape[0] == 0
                or any(r is None for r in rope_of_layer)):
            return False
        # NOTE: the engine passes the same list of caches every step: checked once
        if kv_caches is self._caches:
            return True
        ok = all(dense_rows(k) and dense_rows(v) and v.dtype == k.dtype
                 and k.dtype in (x.dtype, torch.bfloat16) for k, v in kv_caches)
        if ok:
            self._caches = kv_caches
        return ok

    def run(self, x: torch.Tensor, tables: list[tuple[torch.Tensor, torch.Tensor]],
            rope_of_layer: list[int | None], batch: ForwardBatch,
            kv_caches: list[Any]) -> torch.Tensor:
        ops, n = self.ops, x.shape[0]
        x = x.contiguous()
        rotary = [(c.reshape(-1, c.shape[-1]).contiguous(), s.reshape(-1, s.shape[-1])
                   .contiguous()) for c, s in tables]
        # every row is one decode token (`takes`): row i is sequence i's token i
        rows = self._rows.get(n)
        if rows is None:
            rows = self._rows[n] = torch.arange(n, dtype=torch.int64)
        ctxs = batch.context_lens.to(torch.int64)
        group_tables = [(g.block_tables.to(torch.int32).contiguous(), g.slot_mapping,
                         g.ring_blocks or 0) for g in batch.groups]
        self._norm_scales()
        below = self._below
        if self._compiled_ok and compiled_loop_enabled() and (below is None or n < below):
            ropes = [r for r in rope_of_layer if r is not None]
            if self._compiled is None or ropes != self._compiled_ropes:
                self._compiled, self._compiled_ropes = self._compiled_loop(ropes), ropes
            flat = self._flat
            if flat is None or flat[0] is not kv_caches:
                flat = self._flat = (kv_caches, [c for kv in kv_caches for c in kv])
            out: torch.Tensor = self._compiled.run(
                x, [c for c, _ in rotary], [s for _, s in rotary], [t for t, _, _ in group_tables],
                [s for _, s, _ in group_tables], [r for _, _, r in group_tables], rows, ctxs,
                flat[1])
            return out
        for i, layer in enumerate(self.layers):
            group, heads, kv_heads, dim, scale, window, softcap, qk_norm = layer.shape
            table, slots, ring = group_tables[group]
            rope = rope_of_layer[i]
            assert rope is not None
            cos, sin = rotary[rope]
            scales = layer.scales
            e_in, e_post_attn, e_pre_ff, e_post_ff, q_eps, k_eps = layer.eps
            h = ops.rms_norm(x, scales[0], e_in)
            q_scale, k_scale = (scales[4], scales[5]) if qk_norm else (None, None)
            q, k, v = ops.qkv_rope(layer.qkv(h), q_scale, k_scale, cos, sin, q_eps, k_eps,
                                   heads, kv_heads)
            key_cache, value_cache = kv_caches[i]
            out = torch.empty_like(q)
            ops.paged_decode(q, k, v, key_cache, value_cache, table, rows, rows, ctxs, out,
                             scale, window, ring, softcap, None)
            ops.write_kv(k, v, key_cache, value_cache, slots)
            # (x + rms_norm(a) in one op, rounded as the two are)
            x = ops.add_rms_norm(x, layer.o(out.view(n, heads * dim)), scales[1], e_post_attn)
            gate, up = layer.gate_up(ops.rms_norm(x, scales[2], e_pre_ff)).chunk(2, dim=-1)
            x = ops.add_rms_norm(x, layer.down(layer.act_mul(gate, up)), scales[3], e_post_ff)
        return x
