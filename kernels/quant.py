"""Weight-only quantized linear weights: the layout, quantizers, and the reference matmul.

The one layout every quantized weight takes, whatever made it (our int8/int4 quantizers
here, or GGUF blocks repacked by `engine.loading.gguf_blocks`), and that the compiled CPU
kernel (`kernels/csrc/quant_gemm.cpp`) reads:

    weight [n, k] is cut along k into groups of `group` values (group divides k);
    bits = 8: qweight int8  [n, k],       w[r, j] = q[r, j] * scale[r, j // group]
    bits = 4: qweight uint8 [n, k // 2], q in 0..15,
              w[r, j] = q[r, j] * scale[r, j // group] + min[r, j // group],
              packed 64 values to 32 bytes: for the chunk of 64 values starting at
              j0 = 64 c, byte 32 c + i holds value j0 + i in its low nibble and value
              j0 + 32 + i in its high nibble (i = 0..31).
    scales, mins: float16 [n, k // group] (mins only for bits = 4).

Constraints: k % 32 == 0 (k % 64 == 0 for bits 4); group in {16, 32, 64, ...} dividing k,
a multiple of 32 for bits 4 (16 exists for GGUF's Q6_K, whose 16-value sub-blocks have their
own scales);
group == k is "per output channel". The 4-bit packing puts a chunk's two halves in the low
and high nibbles of the same 32 bytes so that one load, one widening and two bit
operations give the kernel 64 values (`kernels/csrc/quant_gemm.cpp`).

Activations stay in the model's dtype. The decode kernel multiplies them by the integer
values exactly and applies scales and mins in float32 (no rounding of the weight); steps with
many rows multiply by `dequantize`'s weight rounded to the activations' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_CHUNK = 64  # values per 32-byte packing chunk for bits = 4


@dataclass(frozen=True)
class QuantizedWeight:
    """One linear weight [n, k] in the layout above."""

    bits: int
    group: int
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.group <= 0 or k % self.group or self.group % 16:
            raise ValueError(f"group {self.group} must be a multiple of 16 dividing k={k}")
        if self.bits == 8 and self.qweight.dtype != torch.int8:
            raise ValueError("bits=8 needs an int8 qweight [n, k]")
        if self.bits == 4:
            if self.qweight.dtype != torch.uint8 or k % INT4_CHUNK or self.group % 32:
                raise ValueError("bits=4 needs a uint8 qweight [n, k/2], k a multiple of 64 "
                                 "and group of 32")
            if self.mins is None or self.mins.shape != self.scales.shape:
                raise ValueError("bits=4 needs mins shaped like scales")
        if self.scales.shape != (n, k // self.group) or self.scales.dtype != torch.float16:
            raise ValueError(f"scales must be float16 [{n}, {k // self.group}]")

    @property
    def shape(self) -> tuple[int, int]:
        """The [n, k] of the full-precision weight."""
        n, width = self.qweight.shape
        return n, width * 2 if self.bits == 4 else width

    @property
    def nbytes(self) -> int:
        """Bytes a matmul reads: packed values, scales and mins."""
        extra = self.mins.nbytes if self.mins is not None else 0
        return self.qweight.nbytes + self.scales.nbytes + extra

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight of only the rows ``index`` (an embedding lookup of quantized rows).

        NOTE: index_select copies whole rows; advanced indexing (``qweight[index]``) walks
        them value by value: 512 rows of gemma-3-270m's 262k x 640 table warm 0.24 ms
        against 0.017 (AMX machine). In a prefill step the rows come from memory and the two
        measured alike (2.2 s for 32 prompts of 128 tokens either way)."""
        index = index.reshape(-1)
        mins = self.mins.index_select(0, index) if self.mins is not None else None
        return QuantizedWeight(self.bits, self.group, self.qweight.index_select(0, index),
                               self.scales.index_select(0, index), mins)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [n, k/2] in the 32-byte chunk packing -> uint8 values 0..15 [n, k]."""
    n, half = packed.shape
    chunks = packed.view(n, half // 32, 32)
    low, high = chunks & 0x0F, chunks >> 4
    return torch.cat([low, high], dim=-1).reshape(n, half * 2)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [n, k] (k % 64 == 0) -> uint8 [n, k/2] in the chunk packing."""
    n, k = values.shape
    if k % INT4_CHUNK:
        raise ValueError(f"4-bit packing needs k a multiple of 64, got k={k}")
    chunks = values.to(torch.uint8).view(n, k // INT4_CHUNK, INT4_CHUNK)
    return (chunks[..., :32] | (chunks[..., 32:] << 4)).reshape(n, k // 2)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full weight [n, k] in ``dtype``, computed in float32 and rounded once."""
    n, k = qw.shape
    values = unpack_int4(qw.qweight) if qw.bits == 4 else qw.qweight
    grouped = values.float().view(n, k // qw.group, qw.group)
    weight = grouped * qw.scales.float().unsqueeze(-1)
    if qw.mins is not None:
        weight = weight + qw.mins.float().unsqueeze(-1)
    return weight.view(n, k).to(dtype)


def quantize_int8(weight: torch.Tensor, group: int | None = None) -> QuantizedWeight:
    """Symmetric int8, per output channel (``group`` None) or per group of ``group`` values.

    The scale is rounded to float16 first and the values quantized against the rounded
    scale, so `dequantize` reproduces exactly what was rounded.
    """
    n, k = weight.shape
    group = k if group is None else group
    if k % group:
        raise ValueError(f"group {group} must divide k={k}")
    grouped = weight.detach().float().reshape(n, k // group, group)
    scales = (grouped.abs().amax(-1) / 127.0).clamp(min=1e-6).to(torch.float16)
    q = torch.round(grouped / scales.float().unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight(8, group, q.reshape(n, k).contiguous(), scales.contiguous())


def quantize_int4(weight: torch.Tensor, group: int, *, search: bool = True,
                  rows_per_pass: int = 8192) -> QuantizedWeight:
    """Asymmetric 4-bit per group of ``group`` values: q in 0..15, w = q * scale + min.

    With ``search`` each group's (scale, min) is the best of 17 candidate grids around its
    min-max range, each refit by least squares to the values it rounds to (the search
    llama.cpp's k-quants make): on gemma-3-270m it raised top-1 agreement with float32 from
    57% (min-max) to 66% and cut the perplexity excess from 73% to 41%. Scales and mins are
    rounded to float16 before the values are quantized against them.
    """
    n, k = weight.shape
    if k % INT4_CHUNK or k % group:
        raise ValueError(f"4-bit needs k a multiple of 64 and of group {group}, got k={k}")
    packed, scales, mins = [], [], []
    for r0 in range(0, n, rows_per_pass):  # bounded temporaries for a 262144-row head
        grouped = weight[r0:r0 + rows_per_pass].detach().float().reshape(-1, k // group, group)
        scale, low = _int4_grid(grouped, search)
        steps = (grouped - low.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)
        q = torch.round(steps).clamp(0, 15).to(torch.uint8).reshape(-1, k)
        packed.append(pack_int4(q))
        scales.append(scale)
        mins.append(low)
    return QuantizedWeight(4, group, torch.cat(packed), torch.cat(scales).contiguous(),
                           torch.cat(mins).contiguous())


def _int4_grid(grouped: torch.Tensor, search: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 (scale, min) per group of ``grouped`` [rows, groups, group]."""
    low, high = grouped.amin(-1), grouped.amax(-1)
    span = (high - low).clamp(min=1e-6)
    best_scale, best_min = (span / 15).to(torch.float16), low.to(torch.float16)
    if not search:
        return best_scale.clamp(min=1e-6), best_min
    x = grouped
    count = float(x.shape[-1])
    sum_x, sum_xx = x.sum(-1), (x * x).sum(-1)
    best_err = _int4_error(x, best_scale, best_min)
    for step in range(17):
        # candidate grids stretch the min-max range by -1 .. +1 steps
        inv = ((14.0 + step / 8.0) / span).unsqueeze(-1)
        q = torch.round((x - low.unsqueeze(-1)) * inv).clamp(0, 15)
        sum_q, sum_qq, sum_qx = q.sum(-1), (q * q).sum(-1), (q * x).sum(-1)
        det = count * sum_qq - sum_q * sum_q
        ok = det > 0
        safe = torch.where(ok, det, torch.ones_like(det))
        scale16 = torch.where(ok, (count * sum_qx - sum_x * sum_q) / safe,
                              span / 15).clamp(min=1e-6).to(torch.float16)
        min16 = torch.where(ok, (sum_qq * sum_x - sum_q * sum_qx) / safe, low).to(torch.float16)
        # the error of these q on the rounded grid, from the sums (q is not re-rounded to
        # it: the final quantization below is, and is never worse than this estimate)
        sc, mn = scale16.float(), min16.float()
        err = (sc * sc * sum_qq + 2 * sc * mn * sum_q + count * mn * mn
               - 2 * sc * sum_qx - 2 * mn * sum_x + sum_xx)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale16, best_scale)
        best_min = torch.where(better, min16, best_min)
    return best_scale.clamp(min=1e-6), best_min


def _int4_error(x: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Squared error per group of quantizing ``x`` on the grid (scale, min)."""
    s, m = scale.float().unsqueeze(-1), low.float().unsqueeze(-1)
    q = torch.round((x - m) / s).clamp(0, 15)
    return ((q * s + m - x) ** 2).sum(-1)


ACT_BLOCK = 32  # activation values per int16 scale (kernels/csrc/int16_act_gemm.cpp)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 rows [m, k] (k % 32 == 0) in int16 blocks of 32 values, as the int16-activation
    kernel rounds them: d = max|x| / 32767 per block, q = round_half_even(x * (1 / d)).

    Returns:
        q [m, k] (integers -32767..32767, as float32) and d [m, k / 32] float32.
    """
    m, k = x.shape
    blocks = x.float().reshape(m, k // ACT_BLOCK, ACT_BLOCK)
    d = blocks.abs().amax(-1) / 32767.0
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)),
                      torch.zeros_like(d))
    q = torch.round(blocks * inv.unsqueeze(-1)).clamp(-32767, 32767)
    return q.reshape(m, k), d


def int16_act_matmul_reference(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """What the int16-activation kernel computes, in float64: the scaled weight values times
    x rounded to its int16 blocks, plus (4-bit) each group's min times the exact sum of x
    over the group."""
    n, k = qw.shape
    q, d = quantize_activations(x)
    xq = (q.double().view(-1, k // ACT_BLOCK, ACT_BLOCK) * d.double().unsqueeze(-1)).view(-1, k)
    values = unpack_int4(qw.qweight) if qw.bits == 4 else qw.qweight
    groups = k // qw.group
    scaled = (values.double().view(n, groups, qw.group) * qw.scales.double().unsqueeze(-1))
    out = xq @ scaled.view(n, k).T
    if qw.mins is not None:
        out = out + x.double().view(-1, groups, qw.group).sum(-1) @ qw.mins.double().T
    return out


def quant_matmul_reference(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """``x @ dequantize(qw).T`` in float64: what every quantized kernel is checked against.

    The weight is the float32 `dequantize` (exact for int8 and for 4-bit values times a
    float16 scale; one float32 rounding where a min is added), widened to float64.
    """
    weight = dequantize(qw).double()
    return x.double() @ weight.T
