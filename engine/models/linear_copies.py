"""The copies a quantized linear may keep beside its compact weight, model-wide: what
`--packed-head-rows`, `--packed-rows` (and its "auto") and `--rounded-copy-rows` give each
`QuantLinear` (`add_packed_copy`, `add_rounded_copy`), checked and logged at start-up.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ringserve.engine.memory_plan import available_memory
from ringserve.engine.models import quant_linear
from ringserve.engine.models.packed_linear import can_pack
from ringserve.engine.models.quant_linear import INT8_TILE_ROWS, QuantLinear
from ringserve.kernels import cpu_quant, hugepages


def pack_head_copy(model: nn.Module, rows: int, dtype: torch.dtype) -> str:
    """``--packed-head-rows``: give a quantized output head a bf16 copy (widened once) for
    steps of ``rows`` rows or more (`QuantLinear.add_packed_copy`); what was done, for the
    log.

    Raises:
        ValueError: the model has no quantized head, its activations (``dtype``) are not
            bf16, or this CPU cannot pack bf16 for oneDNN (AVX2-only, or under a
            RINGSERVE_CPU_ISA cap).
    """
    head = getattr(model, "lm_head", None)
    if not isinstance(head, QuantLinear):
        raise ValueError("--packed-head-rows needs a quantized output head (this model's "
                         "head is not quantized: it is already a bf16 or float32 GEMM)")
    _check_packable("--packed-head-rows", dtype, head.qweight.device)
    size = head.add_packed_copy(rows)
    return (f"output head: a bf16 copy (widened once) for steps of >= {rows} rows"
            f"{_one_byte([head])} (+{size / 2**20:.1f} MiB resident; fewer rows read the "
            "quantized weight)")


def pack_linear_copies(model: nn.Module, rows: int, dtype: torch.dtype) -> str:
    """``--packed-rows``: give every quantized linear a bf16 copy (widened once) for steps
    of ``rows`` rows or more (`QuantLinear.add_packed_copy`): large decode batches and
    prefill chunks then multiply without widening, and fewer rows read the quantized
    weights. A head that
    ``--packed-head-rows`` gave a copy keeps its own row count. What was done, for the log.

    Raises:
        ValueError: the model has no quantized linear, its activations (``dtype``) are not
            bf16, or this CPU cannot pack bf16 for oneDNN.
    """
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not layers:
        raise ValueError("--packed-rows needs quantized linears (this model's are bf16 or "
                         "float32 GEMMs already)")
    _check_packable("--packed-rows", dtype, layers[0].qweight.device)
    size = sum(layer.add_packed_copy(rows) for layer in layers if layer.packed_rows is None)
    return (f"{len(layers)} quantized linears: bf16 copies (widened once) for steps of >= {rows} "
            f"rows{_one_byte(layers)} (+{size / 2**20:.1f} MiB resident; fewer rows read the "
            "quantized weights)")


def pack_rounded_copies(model: nn.Module, rows: int, dtype: torch.dtype) -> str:
    """``--rounded-copy-rows``: give every quantized linear but the output head a copy of
    its weight rounded to bf16 and packed for oneDNN (`QuantLinear.add_rounded_copy`), for
    steps (prefill chunks, mostly) of ``rows`` rows or more; smaller steps keep the exact
    paths. The head is left out: a prefill reaches it with one row a sequence, and its
    copy would be the largest (vocab x hidden x 2 bytes). What was done, for the log.

    Raises:
        ValueError: the model has no quantized linear besides its head, its activations
            (``dtype``) are not bf16, or this CPU cannot pack bf16 for oneDNN.
    """
    head = getattr(model, "lm_head", None)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear) and m is not head]
    if not layers:
        raise ValueError("--rounded-copy-rows needs quantized linears besides the output head "
                         "(this model's are bf16 or float32 GEMMs already)")
    _check_packable("--rounded-copy-rows", dtype, layers[0].qweight.device)
    size = sum(layer.add_rounded_copy(rows) for layer in layers)
    return (f"{len(layers)} quantized linears: copies rounded to bf16 for oneDNN for steps of "
            f">= {rows} rows (+{size / 2**20:.1f} MiB resident; inexact: 8 significant bits a "
            "weight; fewer rows keep the exact paths)")


def _one_byte(layers: list[QuantLinear]) -> str:
    """What the log says of the integer tiles among ``layers``' copies."""
    have = sum(layer.tiles8 is not None for layer in layers)
    if not have:
        return ""
    which = "" if have == len(layers) else f" for {have} of them"
    return (f", and the integers alone (int8 one byte a value, 4-bit two a byte){which} for "
            f"steps of up to {INT8_TILE_ROWS} rows")


# ``packed_rows="auto"`` (the served default): the row count from which the copies serve,
# and the share of the available memory they may take. Served on 2 Zen 4 cores, gemma-3-270m,
# conc 32, two interleaved rounds: 311.3 / 402.3 tok/s without, 376.9 / 482.0 with (+536
# MiB). From 8 rows: a decode step with the copies against the quantized weights, the two
# interleaved in one engine (`benchmarks/packed_rows_bench.py`), 4 rows 24.4 / 20.0 ms,
# 6 rows 23.8 / 23.1, 8 rows 26.8 / 30.1, 12 rows 31.1 / 38.9, 16 rows 35.0 / 48.4: below 8
# rows the quantized weights' smaller read wins, from 8 the copies' cheaper multiply.
AUTO_PACKED_ROWS = 8
AUTO_MEMORY_SHARE = 0.25
# The output head's own row count under "auto" (as `--packed-head-rows` sets it): a
# 262144 x 640 head is half of a small step, and its copy wins from fewer rows than the
# layers' linears do. One engine, gemma-3-270m on 2 Zen 4 cores, steps alternating between
# the head's copy and its quantized weight (the layers' copies from 8 rows in both), median
# step: 3 rows 28.4 / 26.5 ms (1.07), 4 rows 29.8 / 28.9 (1.03), 5 rows 32.6 / 35.5
# (0.92), 6 rows 35.1-36.0 / 40.1-40.7 (0.88), 7 rows 43.1 / 48.9 (0.88) (2026-12-04).
AUTO_PACKED_HEAD_ROWS = 5
# Both under "auto" where the build has the one-byte copies (`cpu_quant.has_int8_tiles`):
# from 2 rows every quantized linear, head included, multiplies by them (up to
# INT8_TILE_ROWS, then by the bf16 tiles). One engine, steps alternating (layers from 8 and
# head from 5 / both from 2 or 3, median ms): 2 rows 17.6 / 15.1, 4 rows 28.7 / 23.8, 6
# rows 30.5 / 26.2; from 1 row 17.3 against 17.0 from 3 (the one-row path stays). Served at
# concurrency 8 (16 prompts of 128 tokens, 128 out), with and without the one-byte copies,
# two rounds: 159 / 142 and 186 / 167 tok/s (Zen 4, 2026-12-04).
AUTO_INT8_ROWS = 2


def auto_head_rows(model: nn.Module) -> int | None:
    """The head's row count under ``packed_rows="auto"`` (where auto packs the layers):
    AUTO_INT8_ROWS where the one-byte copies are, else AUTO_PACKED_HEAD_ROWS, for a
    quantized head; None for another head."""
    if not isinstance(getattr(model, "lm_head", None), QuantLinear):
        return None
    return AUTO_INT8_ROWS if cpu_quant.has_int8_tiles() else AUTO_PACKED_HEAD_ROWS


def auto_packed_rows(model: nn.Module, dtype: torch.dtype) -> tuple[int | None, str]:
    """``packed_rows="auto"``: (AUTO_INT8_ROWS where the one-byte copies are, else
    AUTO_PACKED_ROWS, or None; why), for the log. On where the
    copies would be the kernels' own bf16 tiles (the path measured faster) and fit in
    AUTO_MEMORY_SHARE of the available memory."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not layers:
        return None, "no quantized linears"
    if dtype != torch.bfloat16 or layers[0].qweight.device.type != "cpu":
        return None, "needs bf16 activations on the CPU"
    if not (layers[0].kernel and cpu_quant.has_tiles()):
        return None, "this CPU class has no bf16 tiles (AVX512-BF16 or AMX)"
    if not can_pack(dtype, layers[0].qweight.device):  # the copies past the tiles' rows
        return None, "this CPU's oneDNN does not pack bf16"
    # bf16 tiles (2 bytes a value) and, for steps up to INT8_TILE_ROWS, the integer tiles
    # (an int8 weight's one byte a value, a 4-bit weight's half)
    small = 1.0 if cpu_quant.has_int8_tiles() else 0.0
    need = int(sum((2 + (small if m.bits == 8 else small / 2)) * m.in_features * m.out_features
                   for m in layers))
    free = available_memory()
    if free is None or need > AUTO_MEMORY_SHARE * free:
        have = "unknown" if free is None else f"{free / 2**20:.0f} MiB"
        return None, (f"the copies (~{need / 2**20:.0f} MiB) would take more than "
                      f"{AUTO_MEMORY_SHARE:.0%} of the memory available ({have})")
    rows = AUTO_INT8_ROWS if cpu_quant.has_int8_tiles() else AUTO_PACKED_ROWS
    return rows, (f"copies ~{need / 2**20:.0f} MiB, within "
                              f"{AUTO_MEMORY_SHARE:.0%} of {free / 2**20:.0f} MiB available")


def _check_packable(flag: str, dtype: torch.dtype, device: torch.device) -> None:
    if dtype != torch.bfloat16 or not can_pack(dtype, device):
        raise ValueError(f"{flag} needs bf16 activations and a CPU whose oneDNN packs bf16 "
                         "(AVX-512 or AMX; not an AVX2-only CPU or a RINGSERVE_CPU_ISA cap "
                         "below avx512)")


# what `place_on_huge_pages` moves of each `QuantLinear`: buffers, then tuples of copies
MOVED_BUFFERS = ("qweight", "scale_bits", "min_bits")
MOVED_COPIES = ("tiles", "tiles8")


def _move(m: QuantLinear, place: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace each tensor `place_on_huge_pages` moves of ``m`` by ``place(it)``."""
    for name in MOVED_BUFFERS:
        t = getattr(m, name)
        if t is not None:
            setattr(m, name, place(t))
    for name in MOVED_COPIES:
        copies = getattr(m, name)
        if copies is not None:
            setattr(m, name, tuple(place(t) for t in copies))
    m._qw = None  # the layout object viewed the old buffers


def place_on_huge_pages(model: nn.Module) -> str:
    """Move every CPU `QuantLinear`'s compact weight (values, scales, mins) and the copies
    `pack_*` gave it (our tiles) into one `hugepages.HugeArena`; what was done, for the log.

    A decode step streams them from memory, and with 4 KiB pages in a virtual machine each
    4 KiB is a TLB miss that walks two page tables (docs/cpu.md, "Huge pages for the
    copies a step streams"). Each tensor is copied and its module's reference replaced
    before the next, so memory peaks at the arena plus one tensor. oneDNN's packed copies
    (opaque tensors) stay where oneDNN put them.
    """
    layers = [m for m in model.modules()
              if isinstance(m, QuantLinear) and m.qweight.device.type == "cpu"]
    if not layers:
        return "huge pages: no quantized linears on the CPU"
    if not hugepages.offered():
        return ("huge pages: not offered (transparent huge pages are never here, or "
                "RINGSERVE_HUGE_PAGES=0): the quantized weights keep 4 KiB pages")
    spans: list[int] = []

    def measured(t: torch.Tensor) -> torch.Tensor:
        spans.append(hugepages.HugeArena.span(t))
        return t

    for m in layers:  # the same walk as the move, each tensor given back as it was
        _move(m, measured)
    arena = hugepages.HugeArena(sum(spans))
    for m in layers:
        _move(m, arena.place)
    quant_linear.copies_moved()
    return (f"huge pages: {len(layers)} quantized linears' weights and copies in one mapping "
            f"advised for 2 MiB pages ({arena.nbytes / 2**20:.1f} MiB; RINGSERVE_HUGE_PAGES=0 "
            "keeps 4 KiB pages)")
