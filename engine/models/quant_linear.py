"""Linear layers and embedding lookups over weight-only quantized weights (`kernels/quant.py`).

A decode step reads every weight once, so its floor is the weight bytes over the memory
bandwidth: int8 halves bf16's bytes and 4-bit nearly quarters them. Activations stay in
the model's dtype.

Paths, by what the step is and what the machine has (`kernels.cpu_quant`):
- bf16 activations on a CPU with AVX512-BF16 (`kernels/csrc/quant_gemm.cpp`): a few rows
  (decode) read the packed weight once and widen it in registers; many rows (prefill,
  large batches) widen it block by block into cache-sized bf16 tiles, where arithmetic,
  not the weight read, is the cost.
- with `--packed-rows` (served default: auto), copies made once at start: steps of 1-16
  rows multiply by the weight's integers in the tiles' layout (int8 one byte a value, 4-bit
  two values a byte) against x rounded to int16 blocks (`kernels/csrc/int8_tiles.cpp`,
  AVX-512), more rows by the bf16 tiles (`add_packed_copy`).
- with `--rounded-copy-rows N` (off by default): steps of N+ rows (prefill chunks) multiply
  by oneDNN's GEMM over a copy of the weight rounded to bf16 (`add_rounded_copy`): faster
  than the AMX tiles from ~150 rows, and not exact.
- float32 or bf16 activations on any other CPU, AVX2 and aarch64 included
  (`kernels/csrc/compact_gemm.cpp`): the same two shapes with float32 FMA.
- float32 activations rounded to int16 blocks of 32 values (`int16_acts`, the default on
  CPUs without bf16 arithmetic: `engine.loading.quantize.pick_int16_activations`):
  integer dot products (`kernels/csrc/int16_act_gemm.cpp`).
- without a compiler (or float16 activations): the weight is widened to the activations'
  dtype on every call, correct and slow (the start-up log warns). torch's own packed
  low-bit CPU kernels were measured for this place and left out: `_weight_int8pack_mm`
  read gemma's head at 13 GB/s with one row (ours: 23), and `_weight_int4pack_mm_for_cpu`,
  18 GB/s at one row, took 16 ms for the head at 8 rows where bf16 takes 14 (its cost
  grows with every row).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ringserve.engine.models.packed_linear import bucket_rows
from ringserve.kernels import cpu_build, cpu_quant
from ringserve.kernels.quant import QuantizedWeight, dequantize

logger = logging.getLogger("ringserve.engine")

# NOTE: steps of at most this many rows read the packed weight, widened in registers; more
# rows widen it once per block of 32 weight rows into a bf16 tile and multiply from cache.
# Measured on gemma-3-270m's shapes (2 cores, AVX512-BF16): the two are about even at 8-12
# rows, the tiles 1.4-2.5x faster from 32 rows on (within 1.2x of oneDNN's packed bf16 GEMM
# at 256 rows).
TILE_ROWS = 12
# NOTE: steps of `packed_rows` up to this many rows multiply by the one-byte copy
# (`cpu_quant.int8_tiles`) where the build has it; more rows by the bf16 tiles. The head
# (262144 x 640 int8, group 16) read from memory, one process, int8 copy / bf16 copy, ms:
# 4 rows 6.7 / 12.6, 8 rows 12.1 / 17.1, 16 rows 20.8 / 23.3, 32 rows 37.7 / 38.5, 128 rows
# 172 / 160; a 2048 x 640 weight (the layers' size, compute-bound) at 32 rows 0.53 / 0.40:
# the int8 copy halves the bytes read for ~1.3x the instructions (Zen 4, 2026-12-04).
INT8_TILE_ROWS = 16
# NOTE: the integer tiles hold the weight's own values in the tiles' order, int8 one byte a
# value and 4-bit two a byte (no more bytes than the weight), so they serve its steps from
# one row on. At one x row the few-row dpbf16 pass over int8 is bound by its widening (int8
# -> float32 -> bf16: ~10 GB/s a core with the weight in cache, AMX machine), the tiles'
# int16 pass is not (~25): forty 4096 x 640 int8 weights streamed at 19-21 GB/s against
# 24-31 on 2 cores, and a one-row step of gemma-3-270m went from 15.8 to 14.7 ms greedy,
# 16.9 to 14.4 sampled (the head's full multiply too) (docs/cpu.md, "An int8 weight's
# one-byte copy from one row"). A 4-bit weight's tiles were one byte a value until
# 2026-12-07 (twice its bytes, from 2 rows); at two values a byte an 8-row step of
# gemma-3-270m's Q4_K_M took 22.96-25.51 ms against 26.17-30.14 (docs/cpu.md, "Half-byte
# tiles for 4-bit weights").


class QuantLinear(nn.Module):
    """`nn.Linear` over a `QuantizedWeight` (plus an optional bias in the model's dtype).

    Args:
        qw: the weight.
        bias: the bias, or None.
    """

    qweight: torch.Tensor
    scale_bits: torch.Tensor
    min_bits: torch.Tensor | None

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = qw.shape
        self.bits, self.group = qw.bits, qw.group
        # NOTE: float16 scales and mins are kept as their int16 bits, so that a
        # `model.to(dtype)` (which casts every floating buffer) cannot round them.
        self.register_buffer("qweight", qw.qweight)
        self.register_buffer("scale_bits", qw.scales.view(torch.int16))
        self.register_buffer("min_bits", None if qw.mins is None else qw.mins.view(torch.int16))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.kernel = cpu_quant.supports(qw)
        # NOTE: float32 activations rounded to int16 blocks for integer dot products
        # (`kernels/csrc/int16_act_gemm.cpp`); set by `engine.loading.quantize` when chosen.
        self.int16_acts = False
        self._qw: QuantizedWeight | None = None
        # A bf16 copy packed for oneDNN, for steps of at least `packed_rows` rows
        # (`add_packed_copy`: a large batch's head, where our tiles are compute-bound).
        self.register_buffer("packed", None)
        self.packed_rows: int | None = None
        # NOTE: a plain attribute, not buffers: the copy follows the quantized weight's
        # device and is made after loading (`add_packed_copy`).
        self.tiles: tuple[torch.Tensor, ...] | None = None
        # The integers alone (int8 one byte a value, 4-bit two a byte), for steps of 1 to
        # INT8_TILE_ROWS rows.
        self.tiles8: tuple[torch.Tensor, ...] | None = None
        # An output head's `engine.models.greedy_head.GreedyHead`, where the engine made one.
        self.greedy: Any = None
        # `--rounded-copy-rows`: the dequantized weight rounded to bf16 and packed for
        # oneDNN, for steps of at least `rounded_rows` rows (`add_rounded_copy`).
        self.rounded: torch.Tensor | None = None
        self.rounded_rows: int | None = None

    def add_packed_copy(self, rows: int) -> int:
        """Keep a copy of the weight widened to bf16 once, which steps of ``rows`` rows or
        more multiply by instead of widening the quantized weight on every call; the
        quantized weight stays for smaller steps and the embedding lookup.

        Where the kernels have dpbf16 the copy is our own tiles (`cpu_quant.quant_tiles`:
        the exact integer values and float32 scales, so the same sums as the quantized
        many-row path, on the kernels' thread pool). Measured for gemma-3-270m's linears
        (2 cores, Zen 4, rows 16 / 32): head 2.1 / 4.0 ms a 65536-row quarter against 5.3 /
        7.2 widening each call and 2.6 / 4.1 for oneDNN's packed bf16; gate_up 0.12 / 0.23
        against 0.19 / 0.30 and 0.11 / 0.21. Elsewhere (AVX-512 without BF16) it is a bf16
        weight packed for oneDNN's GEMM (the dequantized weight rounded to bf16). Beside
        our tiles, a second copy of the integers alone (`cpu_quant.int8_tiles`: one byte a
        value, 4-bit two a byte) serves steps of 1 to INT8_TILE_ROWS rows, where the read,
        not the multiply, is the cost (the NOTE after INT8_TILE_ROWS).

        Returns:
            The copy's bytes.
        """
        self.packed_rows = rows
        _copies[0] += 1
        if self.kernel and cpu_quant.has_tiles():
            self.tiles = cpu_quant.quant_tiles(self.qw)
            if rows <= INT8_TILE_ROWS and cpu_quant.has_int8_tiles():
                self.tiles8 = cpu_quant.int8_tiles(self.qw)
            return sum(int(t.numel() * t.element_size())
                       for t in (*self.tiles, *(self.tiles8 or ())))
        dense = dequantize(self.qw, torch.bfloat16)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(dense, None)
        return int(self.packed.numel() * self.packed.element_size())

    def add_rounded_copy(self, rows: int) -> int:
        """Keep the weight dequantized (in float32, exactly), rounded to bf16 once and
        packed for oneDNN, which steps of ``rows`` rows or more multiply by: oneDNN's GEMM,
        1.9x our AMX tiles at 512 rows (from ~150 rows faster), where each group of 32
        values' sums leave the tile unit to be scaled (`benchmarks/copies_bench.py`). Not
        this layer's weight: each value keeps 8 significant bits (a relative error of at
        most 2**-9, below an int8 group's step), and a step's rows then depend on the step
        they share (docs/cpu.md, "A rounded copy for prefill chunks").

        Returns:
            The copy's bytes (none where oneDNN's copy from `add_packed_copy` is this one).
        """
        self.rounded_rows = rows
        _copies[0] += 1
        if self.packed is not None:  # already the rounded weight, packed the same way
            self.rounded = self.packed
            return 0
        dense = dequantize(self.qw, torch.bfloat16)
        self.rounded = torch.ops.mkldnn._reorder_linear_weight(dense, None)
        return int(self.rounded.numel() * self.rounded.element_size())

    def copies(self) -> list[torch.Tensor]:
        """The tensors of the copies `add_packed_copy` and `add_rounded_copy` made."""
        out = [*(self.tiles or ()), *(self.tiles8 or ())]
        if self.packed is not None:
            out.append(self.packed)
        if self.rounded is not None and self.rounded is not self.packed:
            out.append(self.rounded)
        return out

    @property
    def qw(self) -> QuantizedWeight:
        """The weight, as the layout object (made once: a decode step calls every layer,
        and checking the layout on each call cost ~1 ms a step)."""
        if self._qw is None:
            mins = None if self.min_bits is None else self.min_bits.view(torch.float16)
            self._qw = QuantizedWeight(self.bits, self.group, self.qweight,
                                       self.scale_bits.view(torch.float16), mins)
        return self._qw

    def _apply(self, fn: Any, recurse: bool = True) -> QuantLinear:
        self._qw = None  # `.to(device)` and friends replace the buffers
        return super()._apply(fn, recurse)  # type: ignore[no-any-return,no-untyped-call]

    def copy_for(self, rows: int, dtype: torch.dtype) -> str | None:
        """The copy `forward` multiplies a step of ``rows`` rows of ``dtype`` by: "rounded"
        (`add_rounded_copy`), "tiles8", "tiles" or "packed" (`add_packed_copy`), or None
        (the quantized weight itself). The copies serve bf16 rows only."""
        if dtype != torch.bfloat16:
            return None
        if self.rounded is not None and self.rounded_rows is not None \
                and rows >= self.rounded_rows:
            return "rounded"
        if self.tiles8 is not None and rows <= INT8_TILE_ROWS:
            return "tiles8"
        if self.packed_rows is None or rows < self.packed_rows:
            return None
        if self.tiles is not None:
            return "tiles"
        return "packed" if self.packed is not None else None

    def _copy_edges(self, above: int) -> list[int]:
        """The row counts above ``above`` at which `copy_for` may change, ascending."""
        return sorted({r for r in (self.packed_rows, self.rounded_rows,
                                   INT8_TILE_ROWS + 1) if r is not None and r > above})

    def _next_copy(self, rows: int, dtype: torch.dtype) -> int | None:
        """The smallest row count above ``rows`` whose steps `copy_for` gives another copy
        (None: none)."""
        now = self.copy_for(rows, dtype)
        return next((r for r in self._copy_edges(rows) if self.copy_for(r, dtype) != now), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: `fixed_forward` makes these choices once for the fast decode layers
        flat = x.reshape(-1, self.in_features)
        out: torch.Tensor
        copy = self.copy_for(flat.shape[0], flat.dtype)
        if copy == "rounded":
            assert self.rounded is not None
            out = onednn_linear(flat, self.rounded, self.bias)
        elif copy == "tiles8":
            assert self.tiles8 is not None
            out = cpu_quant.int8_tiles_linear(flat, self.tiles8, self.qw, self.bias)
        elif copy == "tiles":
            assert self.tiles is not None
            out = cpu_quant.quant_linear_tiles(flat, self.tiles, self.qw, self.bias)
        elif copy == "packed":
            assert self.packed is not None
            out = onednn_linear(flat, self.packed, self.bias)
        else:
            out = uncopied_linear(flat, self.qw, self.bias, kernel=self.kernel,
                                  int16_acts=self.int16_acts)
        return out.view(*x.shape[:-1], self.out_features)

    def direct_call(self, dtype: torch.dtype) -> tuple[str, int, int | None,
                                                        tuple[Any, ...]] | None:
        """The compiled call `fixed_forward` makes for one-row steps of ``dtype``, for a
        caller that makes the call itself (the compiled decode layers,
        `engine.models.fast_decode`): (the op's name, its ``tile_rows`` argument (-1: it
        has none), the row count from which another call takes over (None: none), and the
        arguments after the rows). None where that call is not one op of ours (float32
        rows without int16 activations, oneDNN's packed copy, no compiled kernel)."""
        qw = self.qw
        args = (qw.qweight, qw.scales, qw.mins, qw.bits, qw.group, self.bias)
        if dtype == torch.float32:  # (the copies serve bf16 rows only)
            return ("int16_act_linear", -1, None, args) if self.int16_acts else None
        if dtype != torch.bfloat16 or self.packed is not None or not self.kernel:
            return None
        above = self._next_copy(1, dtype)
        copy = self.copy_for(1, dtype)
        if copy == "tiles8" and self.tiles8 is not None:
            return ("int8_tiles_linear", -1, above,
                    (*self.tiles8, qw.bits, qw.group, self.out_features, self.bias))
        if copy is not None:
            return None
        # (as `uncopied_linear` multiplies bf16 rows: dpbf16 where the build has it)
        if cpu_quant.dpbf16(torch.empty(0, dtype=torch.bfloat16)):
            return "quant_linear", TILE_ROWS, above, args
        return "compact_linear", min(TILE_ROWS, 8), above, args

    def fixed_forward(self, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """`forward` for 2-D rows of ``dtype``, its choices made now: the kernel call it
        would make for each row count, for a caller that runs it every step
        (`engine.models.fast_decode`). None where `forward` takes a path this does not
        (oneDNN's packed copy, no compiled kernel). The same calls as `forward`: change the
        two together (tests/test_fast_decode.py compares their bits)."""
        ops = cpu_build.ops()
        qw, bias, n = self.qw, self.bias, self.out_features
        call = self.direct_call(dtype)  # (the one choice of op, shared with the compiled loop)
        if call is None:
            if dtype != torch.float32 or not self.kernel:
                return None

            def widened(x: torch.Tensor) -> torch.Tensor:
                out: torch.Tensor = ops.compact_linear(x, qw.qweight, qw.scales, qw.mins,
                                                       qw.bits, qw.group, bias, min(TILE_ROWS, 8))
                return out
            return widened
        name, tile_rows, above, args = call
        op = getattr(ops, name)
        if tile_rows < 0:  # (int16_act_linear, int8_tiles_linear: no tile_rows)
            def few(x: torch.Tensor) -> torch.Tensor:
                out: torch.Tensor = op(x, *args)
                return out
        else:
            def few(x: torch.Tensor) -> torch.Tensor:
                out: torch.Tensor = op(x, *args, tile_rows)
                return out
        if above is None:
            return few
        # the copy of each range of row counts from `above` on, the last range first
        plan = [(r, self.copy_for(r, dtype)) for r in [above, *self._copy_edges(above)][::-1]]
        tiles, tiles8, rounded = self.tiles, self.tiles8, self.rounded

        def either(x: torch.Tensor) -> torch.Tensor:
            rows = x.shape[0]
            if rows < above:
                return few(x)
            copy = next(c for r, c in plan if rows >= r)
            out: torch.Tensor
            if copy == "rounded" and rounded is not None:
                out = onednn_linear(x, rounded, bias)
            elif copy == "tiles8" and tiles8 is not None:
                out = ops.int8_tiles_linear(x, *tiles8, qw.bits, qw.group, n, bias)
            elif copy == "tiles" and tiles is not None:
                out = ops.quant_linear_tiles(x, *tiles, qw.bits, qw.group, n, bias)
            else:
                out = uncopied_linear(x, qw, bias, kernel=self.kernel,
                                      int16_acts=self.int16_acts)
            return out
        return either

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, group={self.group}")  # fmt: skip


def uncopied_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, *,
                    kernel: bool, int16_acts: bool) -> torch.Tensor:
    """``x`` (2-D) by ``qw`` as `QuantLinear.forward` multiplies a step that none of its
    copies serves, for a layer with these `kernel` and `int16_acts` flags (also the greedy
    head's exact logits of a few vocabulary rows, `engine.models.greedy_head`, which need
    no module around the rows)."""
    out: torch.Tensor
    if int16_acts and x.dtype == torch.float32:
        out = cpu_quant.int16_act_linear(x, qw, bias)
    elif kernel and x.dtype in (torch.bfloat16, torch.float32):
        out = cpu_quant.quant_linear(x, qw, bias, TILE_ROWS)
    else:
        out = F.linear(x, dequantize(qw, x.dtype), bias)
    return out


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` (2-D, bf16) by a weight packed for oneDNN, its rows padded to the bucket
    oneDNN's kernel cache keys (`packed_linear.bucket_rows`)."""
    rows = x.shape[0]
    padded = bucket_rows(rows)
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out[:rows]


_copies = [0]  # copies made so far in this process (`copy_epoch`)


def copies_moved() -> None:
    """The linears' weights or copies were replaced by others holding the same values
    (`engine.models.linear_copies.place_on_huge_pages`): paths chosen with the old tensors
    are chosen again (`copy_epoch`)."""
    _copies[0] += 1


def copy_epoch() -> int:
    """How many linears have been given a copy (`QuantLinear.add_packed_copy`) so far: a
    path chosen before a copy was made (`engine.models.fast_decode`) is chosen again."""
    return _copies[0]


class QuantEmbedding(nn.Module):
    """An embedding lookup from a quantized table: only the looked-up rows are widened.

    A tied output head and its embedding share one quantized table (``head``), so the
    model holds the table once, quantized.

    Args:
        head: the quantized layer whose weight is the table ([vocab, hidden]).
        dtype: the dtype of the rows returned.
        owned: the table is this embedding's alone (a GGUF's untied embedding, in its
            blocks): its tensors are this module's buffers, only looked up.
    """

    def __init__(self, head: QuantLinear, dtype: torch.dtype, owned: bool = False) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.dtype = dtype
        # NOTE: a plain attribute, not a submodule: a tied head is registered once, as
        # lm_head; an owned table's tensors are registered here, never as a linear's.
        self._head = [head]
        self.owned = owned
        if owned:
            self.register_buffer("qweight", head.qweight)
            self.register_buffer("scale_bits", head.scale_bits)
            self.register_buffer("min_bits", head.min_bits)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self._head[0].qw.rows(ids.reshape(-1))
        return dequantize(rows, self.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        head = self._head[0]
        return (f"{self.num_embeddings}, {self.embedding_dim}, bits={head.bits}, "
                f"group={head.group}, {'its own table' if self.owned else 'tied to lm_head'}")
