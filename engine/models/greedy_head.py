"""Greedy rows' tokens without the whole output head at full precision (docs/cpu.md, "The
greedy head").

A greedy row needs only its logits' first maximum. `kernels/csrc/greedy_head.cpp` runs an
int8 pass over a one-byte copy of the head (`GreedyHead.pack`) that bounds every
vocabulary row's exact logit and keeps the rows that can still be the maximum (a handful
for a real model's hidden state); those are multiplied here through the head's own path
(the same kernel call `QuantLinear.forward` makes for this many rows, on the candidate rows
only: each output of those paths is one row's sum, whatever rows sit beside it). So the
token is the full head's first maximum, bit for bit, for a fraction of its multiplies.

Only for a quantized head without bias, on a build with AVX512-VNNI or AVX2 (the pass's two
variants), for bf16 or float32 activations, where the head's path for the step's rows is
one of our kernels (not oneDNN's packed GEMM), and for rows that take the plain first
maximum (`engine.llm_engine` decides which).

On a CPU with AMX-INT8 whose kernels take AMX tiles (`cpu_build.amx()`), the pass is AMX's
instead, over a copy of its own: each head row's values at one scale a row (`_pack_amx`),
whose error from the head's own values is a term of the bound (docs/cpu.md, "The greedy
head on AMX").
"""

from __future__ import annotations

import torch

from ringserve.engine.models.quant_linear import QuantLinear, uncopied_linear
from ringserve.kernels import cpu_build, cpu_isa, cpu_quant
from ringserve.kernels.cpu_build import available, ops
from ringserve.kernels.cpu_sample import first_max
from ringserve.kernels.hugepages import huge_copy, huge_empty
from ringserve.kernels.quant import QuantizedWeight, dequantize

TILE = 16  # vocabulary rows a tile of the copy (greedy_head.cpp's kRows)
# Steps with fewer greedy rows keep the full head: there it reads the same bytes at the
# same speed as the pass, and the candidates' exact pass is pure overhead. With AVX512-VNNI
# that is one row (Zen 4); with the AVX2 pass up to three, where the full head's int16 loop
# keeps up with memory (Zen 3, `benchmarks/greedy_head_pass.py --rows 1,2,3,4`: pick /
# full head 6.8-7.7 / 6.7 ms at 2 rows, 8.6-8.9 / 8.4-8.5 at 3, 9.9-10.3 / 11.0 at 4).
# A wide head is another matter: there the full head's int16 loop at one row no longer keeps
# up with memory, and the pass (three instructions per 32 products, not nine) does. For
# gpt-oss-20b's head (201,088 x 2,880, Q8_0) the pick beat the full head from one row (AVX2
# EPYC, Zen 3, 2026-12-07, `benchmarks/greedy_head_pass.py --rows 1,2,4`: 51 / 62 ms at 1
# row, 55 / 69 at 2, 71 / 91 at 4), so from `WIDE_HEAD_K` inputs the AVX2 pass starts at one.
GREEDY_HEAD_ROWS = 2
GREEDY_HEAD_ROWS_AVX2 = 4
GREEDY_HEAD_ROWS_AVX2_WIDE = 1
WIDE_HEAD_K = 2048
# The AMX pass reads one byte a head value as the VNNI pass does, but only the copy (no group
# scales): from one row it beats the full head's one-row multiply (AMX machine,
# `benchmarks/greedy_head_pass.py --rows 1`: pick 7.8 against 9.3 ms).
GREEDY_HEAD_ROWS_AMX = 1
PACK_ROWS = 16384  # rows dequantized at a time while packing


def supported() -> bool:
    """Whether this process's kernel build has the int8 pass (AVX512-VNNI or AVX2)."""
    return available() and bool(ops().greedy_head_supported())


def min_rows(amx: bool | None = None, k: int = 0) -> int:
    """The fewest greedy rows a step picks with the pass on this CPU class (``amx``: with the
    AMX pass; None: where `amx_pass()`), for a head of ``k`` inputs."""
    if amx_pass() if amx is None else amx:
        return GREEDY_HEAD_ROWS_AMX
    if cpu_isa.info().variant == "avx512_bf16":
        return GREEDY_HEAD_ROWS
    return GREEDY_HEAD_ROWS_AVX2_WIDE if k >= WIDE_HEAD_K else GREEDY_HEAD_ROWS_AVX2


def amx_pass() -> bool:
    """Whether the pass runs on AMX tiles here: the amx class, on a CPU with AMX-INT8, whose
    kernels take AMX tiles for many rows (`cpu_build.amx()`: RINGSERVE_AMX=0 turns it off)."""
    info = cpu_isa.info()
    return (info.cls == "amx" and "amx_int8" in info.flags and cpu_build.amx()
            and bool(ops().greedy_head_amx_supported()))


class GreedyHead:
    """The one-byte copy of a quantized head and the pick over it.

    Args:
        head: the model's quantized output head.
        amx: pass by AMX tiles over a copy at one scale a row; None: where `amx_pass()`.
    """

    def __init__(self, head: QuantLinear, amx: bool | None = None) -> None:
        self.head = head
        self.vocab, self.k = head.out_features, head.in_features
        self.amx = amx_pass() if amx is None else amx
        self.min_rows = min_rows(self.amx, self.k)
        if self.amx:
            self._pack_amx(head.qw)
        else:
            self._pack(head.qw)

    @staticmethod
    def can_serve(head: object, dtype: torch.dtype) -> str | None:
        """None where `GreedyHead(head)` can serve a model running in ``dtype``, else why
        not (for the log)."""
        if dtype not in (torch.bfloat16, torch.float32):
            return "needs bf16 or float32 activations"
        if not isinstance(head, QuantLinear) or head.bits != 8:
            return "the output head is not int8-quantized"
        if head.bias is not None:
            return "the output head has a bias"
        if head.packed is not None:
            return "the head's large steps run oneDNN's GEMM"
        if not head.kernel or head.qweight.device.type != "cpu":
            return "no compiled kernel serves the head"
        if head.in_features % 4:
            return "the head's width is not a multiple of 4"
        if not supported():
            return "this CPU class has neither AVX512-VNNI nor AVX2"
        return None

    def nbytes(self) -> int:
        held = (self.tiles, self.meta) if self.amx else (self.tiles, self.scales, self.norms)
        return sum(int(t.numel() * t.element_size()) for t in held)

    def _pack(self, qw: QuantizedWeight) -> None:
        """The copy `greedy_head.cpp` reads: tiles [T, k * 16] uint8 of q + 128 in tiles of
        16 rows x 4 values, scales [T, groups * 16] float32, norms [T * 16] float32
        (||w_r||, rounded up); T = ceil(vocab / 16)."""
        n, k, group = self.vocab, self.k, qw.group
        count = -(-n // TILE)
        # [rows, k] -> [T, k / 4, 16, 4] and the norms, in one pass of the kernels (in
        # Python, a 201k-row head's copy took 7-10 s of a start on 2 cores)
        tiles = huge_empty((count, k // 4, TILE, 4), torch.uint8)  # the pack writes all
        scales = torch.zeros(count * TILE, k // group, dtype=torch.float32)
        norms = torch.empty(count * TILE, dtype=torch.float32)
        scales[:n] = qw.scales.float()
        ops().greedy_head_pack_int8(qw.qweight.contiguous(), qw.scales.contiguous(), group,
                                    tiles.view(count, k * TILE), norms)
        self.tiles = tiles.view(count, k * TILE)
        self.scales = scales.view(count, TILE, k // group).permute(0, 2, 1).contiguous() \
            .view(count, -1)
        self.norms = norms
        self.group = group

    def _pack_amx(self, qw: QuantizedWeight) -> None:
        """The copy the AMX pass reads: tiles [T, kp * 16] int8 (kp: k rounded up to 64, zeros
        past k) of each row's values q_r at one scale s_r = max |w_r| / 127 a row, in tiles of
        16 rows x 4 values (AMX-INT8's B operand, 16 rows of 64 bytes for 64 values); meta
        [4, T * 16] float32: s_r, max(||w_r||, ||s_r q_r||), ||w_r - s_r q_r|| and
        max |w_r - s_r q_r|, each norm rounded up; rho, the median of the last over the
        median of the one before."""
        n, k = self.vocab, self.k
        kp, count = -(-k // 64) * 64, -(-n // TILE)
        tiles = torch.zeros(count * TILE, kp, dtype=torch.int8)
        meta = torch.zeros(4, count * TILE, dtype=torch.float32)
        up = 1 + 1e-6
        for lo in range(0, n, PACK_ROWS):
            hi = min(n, lo + PACK_ROWS)
            w = dequantize(qw.rows(torch.arange(lo, hi)), torch.float32).double()
            top = w.abs().amax(dim=1)
            scale = torch.where(top > 0, top / 127, torch.ones_like(top)).float()
            q = torch.round(w / scale.double()[:, None]).clamp(-127, 127)
            err = w - q * scale.double()[:, None]
            tiles[lo:hi, :k] = q.to(torch.int8)
            meta[0, lo:hi] = scale
            meta[1, lo:hi] = (torch.maximum(w.norm(dim=1), (w - err).norm(dim=1)) * up).float()
            meta[2, lo:hi] = (err.norm(dim=1) * up).float()
            meta[3, lo:hi] = (err.abs().amax(dim=1) * up).float()
        # each x row's O (greedy_head.cpp, pair_row) is chosen by the typical ratio
        self.rho = float(meta[3, :n].median() / meta[2, :n].median().clamp(min=1e-30))
        # [rows, kp] -> [T, kp / 4, 16, 4]
        self.tiles = huge_copy(tiles.view(count, TILE, kp // 4, 4).permute(0, 2, 1, 3)) \
            .view(count, kp * TILE)
        self.meta = meta

    def candidates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(index int32, offsets int64 [m + 1]): the vocabulary rows that may hold each x
        row's maximum, ascending (`greedy_head.cpp`)."""
        if self.amx:
            index, offsets = ops().greedy_head_candidates_amx(x.contiguous(), self.tiles,
                                                              self.meta, self.vocab, self.rho)
        else:
            index, offsets = ops().greedy_head_candidates(x.contiguous(), self.tiles,
                                                          self.scales, self.norms, self.group,
                                                          self.vocab)
        return index, offsets

    def pick(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each bf16 or float32 row's first maximum of ``head(x)``, int64 [m]; None where
        this cannot answer (a non-finite value in x: the full head's pick handles NaN its own
        way)."""
        if x.dtype not in (torch.bfloat16, torch.float32):
            return None
        x = x.contiguous()
        if not ops().greedy_head_finite(x):
            return None
        index, _ = self.candidates(x)
        # (one row's candidates are already ascending and distinct: no torch.unique, ~0.1 ms
        # of a one-row step with the caches the weights swept)
        union = index.long() if len(x) == 1 else torch.unique(index.long())
        exact = self._exact(x, union)
        # every first maximum of a row is among its own candidates, and the union's other
        # rows hold exact logits too, so the union's first maximum is the row's
        out: torch.Tensor = union[first_max(exact)]
        return out

    def _exact(self, x: torch.Tensor, union: torch.Tensor) -> torch.Tensor:
        """head(x)[:, union], through the call `QuantLinear.forward` makes for ``len(x)``
        rows, over the union's rows alone."""
        head = self.head
        rows = head.qw.rows(union)
        # NOTE: no module: making one cost ~0.5 ms of a one-row step, with the caches the
        # step's weights just swept; only the copy `forward` reads at this many rows, made
        # for the union's rows
        out: torch.Tensor
        copy = head.copy_for(len(x), x.dtype)
        if copy == "tiles8":
            tiles8 = cpu_quant.int8_tiles(rows)
            assert tiles8 is not None  # (the head's own copy was made alike)
            out = cpu_quant.int8_tiles_linear(x, tiles8, rows, None)
        elif copy == "tiles":
            out = cpu_quant.quant_linear_tiles(x, cpu_quant.quant_tiles(rows), rows, None)
        else:
            # (no oneDNN copy: `can_serve` refuses a head with one, and the rounded copies
            # leave the head out)
            assert copy is None
            out = uncopied_linear(x, rows, None, kernel=head.kernel,
                                  int16_acts=head.int16_acts)
        return out

