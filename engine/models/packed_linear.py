"""Linear layers with their weights reordered once for oneDNN, for the CPU.

`F.linear` on a plain bf16 weight lets oneDNN reorder the weight into its blocked layout
on every call, and its small-batch paths are slow: on the 2-core machines here Gemma's
262144 x 640 head took 37 ms at batch 1 and 47 ms at batch 8 eagerly, against 20-25 ms
with the weight reordered once (`benchmarks/linear_bench.py` measures every shape and
batch). Reordering once at load is what inductor's freezing does for compiled models;
doing it here keeps the eager model as fast without a compile.

The packed weight replaces the plain one (no second copy), except where a weight is tied
to the embedding, whose rows the lookup still reads.
"""

from __future__ import annotations

import torch
from torch import nn

from ringserve.engine.models.layers import MLP, Attention
from ringserve.kernels import cpu_build, cpu_gemm, cpu_isa


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether linears of this dtype on this device take the packed path.

    bfloat16 on a CPU with oneDNN whose class is AVX-512 or above (`kernels.cpu_isa`):
    torch refuses to pack bf16 weights on an AVX2-only CPU (a RuntimeError), and the
    RINGSERVE_CPU_ISA cap keeps packing off below avx512 so that the cap tests what such a
    CPU runs. float32 keeps `F.linear` (MKL), the very kernel transformers runs, so the
    float32 path stays token-exact with it.
    """
    return (device.type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
            and cpu_isa.onednn_bf16_linear())  # fmt: skip


def can_compact(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether bf16 linears that cannot be packed take `CompactLinear` (our float32-FMA
    kernel over the bf16 weight) instead of `F.linear`'s emulated bf16 GEMM."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and not can_pack(dtype, device)
            and cpu_build.available())  # fmt: skip


# NOTE: decode steps of at most this many rows take the compiled small-batch GEMV
# (`kernels/csrc/small_gemm.cpp`), which streams the plain weight at memory speed;
# measured (2 threads, gemma-3-270m shapes): 1.6-2x oneDNN's packed GEMM at 1-2 rows,
# about even at 4, slower at 8 (it turns compute-bound), so larger batches keep oneDNN.
SMALL_ROWS = 4


def bucket_rows(rows: int) -> int:
    """The row count a oneDNN GEMM of ``rows`` rows runs at: exact up to 32, then eight
    buckets per power of two (at most 1/8 padding; ~85 sizes up to 4096 rows).

    oneDNN JIT-compiles a kernel for every distinct row count (measured: 7 ms for a first
    call against 0.7 ms cached, for a 2048 x 640 weight) and keeps up to 1024 of them,
    ~85 KB each. A server's steps come in every row count, so without buckets each new one
    paid the compile and the cache grew the process by ~100 MB under load (found by
    tests/test_soak.py), then thrashed once weights x row counts passed 1024. Small counts
    stay exact: there the head's GEMM (262144 x 640 for gemma-3) is compute-bound on a few
    cores, and padding 9 rows to 16 would cost most of a step.
    """
    if rows <= 32:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return (rows + step - 1) // step * step


class PackedLinear(nn.Module):
    """`nn.Linear` (same `in_features`, `out_features`, bias) over a oneDNN-packed weight.

    Batches of up to `SMALL_ROWS` rows run the compiled GEMV over the plain weight, which
    is kept beside the packed one for that (for a head tied to the embedding it is the
    embedding itself, so it costs nothing).

    Args:
        linear: the layer to pack.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # NOTE: batch size None: one layout for every batch size (decode and prefill).
        self.packed = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight, None),
                                   requires_grad=False)
        self.weight = linear.weight
        self.bias = linear.bias
        self.small = cpu_gemm.supports(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.small and flat.shape[0] <= SMALL_ROWS:
            out = cpu_gemm.linear_small(flat, self.weight, self.bias)
        else:
            rows = flat.shape[0]
            padded = bucket_rows(rows)
            if padded != rows:
                flat = nn.functional.pad(flat, (0, 0, 0, padded - rows))
            out = torch.ops.mkldnn._linear_pointwise(
                flat, self.packed, self.bias, "none", [], "")[:rows]
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


class CompactLinear(nn.Module):
    """`nn.Linear` over a bf16 weight on a CPU without bf16 arithmetic: the weight stays
    bf16 in memory and `kernels.cpu_gemm.compact_linear` widens it in registers (float32
    FMA), for every batch size.

    Args:
        linear: the layer (bf16 weight).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = cpu_gemm.compact_linear(flat, self.weight.detach(), self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, compact"


class Mxfp4Linear(nn.Module):
    """A linear whose weight stays in the MXFP4 blocks a checkpoint stores (gpt-oss's
    experts): 4.25 bits a weight, never widened in memory; `kernels.cpu_gemm.mxfp4_linear`
    widens each value in registers to its exact float32 value.

    Args:
        blocks: uint8 [out, in / 32, 16] (two E2M1 codes a byte).
        exponents: uint8 [out, in / 32] (E8M0).
        bias: [out] or None.
        split: the blocks' nibbles in GGUF's order (value i in byte i's low nibble, 16 + i
            in its high one), else transformers' (2i and 2i + 1 in byte i's).

    ``int16_acts`` (set at load with the model's quantized linears,
    `engine.loading.quantize.quantize_model`): float32 x rounded to int16 blocks and
    multiplied by integer dot products (`kernels.cpu_gemm.int16_act_mxfp4_linear`).
    """

    def __init__(self, blocks: torch.Tensor, exponents: torch.Tensor,
                 bias: torch.Tensor | None = None, split: bool = False) -> None:
        super().__init__()
        self.split = split
        self.int16_acts = False
        self.out_features, groups = exponents.shape
        self.in_features = groups * 32
        if blocks.shape != (self.out_features, groups, 16) or blocks.dtype != torch.uint8 \
                or exponents.dtype != torch.uint8:
            raise ValueError(f"mxfp4 blocks {list(blocks.shape)} do not match exponents "
                             f"{list(exponents.shape)} (uint8 [out, in / 32, 16] and "
                             "[out, in / 32])")
        self.blocks: torch.Tensor
        self.exponents: torch.Tensor
        self.register_buffer("blocks", blocks.contiguous(), persistent=False)
        self.register_buffer("exponents", exponents.contiguous(), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.int16_acts and flat.dtype == torch.float32:
            out = cpu_gemm.int16_act_mxfp4_linear(flat, self.blocks, self.exponents, self.bias,
                                                  split=self.split)
        else:
            out = cpu_gemm.mxfp4_linear(flat, self.blocks, self.exponents, self.bias,
                                        split=self.split)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        order = ", GGUF nibble order" if self.split else ""
        acts = ", int16 activations" if self.int16_acts else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"mxfp4{order}{acts}")


def _concat(layers: list[nn.Linear]) -> nn.Linear:
    """One linear computing ``layers`` side by side (outputs concatenated in order)."""
    first = layers[0]
    has_bias = first.bias is not None
    # NOTE: made on the meta device and given the concatenation: a real one's random init
    # of a 12B model's fused projections took 5.5 s of its load, and a copy
    with torch.device("meta"):
        fused = nn.Linear(first.in_features, sum(lin.out_features for lin in layers),
                          bias=has_bias, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight = nn.Parameter(torch.cat([lin.weight for lin in layers]),
                                    requires_grad=False)
        if has_bias:
            fused.bias = nn.Parameter(torch.cat([lin.bias for lin in layers]),  # type: ignore[misc]
                                      requires_grad=False)
    return fused


def fuse_projections(model: nn.Module) -> int:
    """Turn separate q/k/v and gate/up projections into one GEMM each, in place.

    The result is the layout phi3 checkpoints already have (`qkv_proj`, `gate_up_proj`,
    `fused = True`), which `Attention` and `MLP` run unchanged: three GEMMs and then two
    become one, and a decode step makes 4 calls a layer instead of 7.

    Returns:
        The number of modules fused.
    """
    count = 0
    for module in model.modules():
        if isinstance(module, Attention) and not module.fused:
            names, target = module.proj_names, "qkv_proj"  # q, k(, v)
        elif isinstance(module, MLP) and not module.fused:
            names, target = ["gate_proj", "up_proj"], "gate_up_proj"
        else:
            continue
        parts = [getattr(module, name) for name in names]
        if len(parts) < 2 or any(type(part) is not nn.Linear for part in parts):
            continue  # some already quantized (engine.models.quant_linear fuses those)
        setattr(module, target, _concat(parts))
        for name in names:
            delattr(module, name)
        module.fused = True
        count += 1
    return count


def pack_linears(model: nn.Module, kind: type[nn.Module] = PackedLinear,
                 bf16_only: bool = False) -> int:
    """Replace every `nn.Linear` in ``model`` (with ``bf16_only``, every one whose weight is
    bf16) by a ``kind`` (`PackedLinear` or `CompactLinear`) made from it, in place.

    Returns:
        The number of layers replaced.
    """
    targets = [(parent, name, child)
               for parent in model.modules()
               for name, child in parent.named_children()
               if type(child) is nn.Linear
               and (not bf16_only or child.weight.dtype == torch.bfloat16)]  # fmt: skip
    for parent, name, child in targets:
        setattr(parent, name, kind(child))
    return len(targets)
