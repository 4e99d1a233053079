"""AMX tiles for the many-row quantized multiply (`kernels/csrc/quant_gemm.cpp`, `amx_*`).

On a CPU with AMX-BF16 the avx512_bf16 build multiplies steps of many rows (prefill chunks,
large decode batches) by TDPBF16PS instead of dpbf16. Reference: a float64 matmul of the
dequantized weight. The dpbf16 path (AMX off) is the avx512_bf16 class's, tested through
the `cpu_variant` fixture everywhere.
"""

from __future__ import annotations

import os

import pytest
import torch

from ringserve.kernels import cpu_build, cpu_isa, cpu_quant
from tests.test_quant import FAMILY_WIDTHS, assert_matches_reference, fitting, make

HAS_AMX = cpu_isa.info().has("amx") and cpu_build.available("avx512_bf16")
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX-BF16 (amx_bf16, "
                               "amx_tile), or no avx512_bf16 kernels were built")


def test_amx_is_on_exactly_where_the_cpu_has_it() -> None:
    """On by default where the class in use is amx; elsewhere (no AMX, or a cap, or
    RINGSERVE_AMX=0) off, and asking for it is refused, not a crash."""
    info = cpu_isa.info()
    if not cpu_build.available():
        pytest.skip("no compiled CPU kernels (no C++ compiler)")
    want = info.cls == "amx" and os.environ.get("RINGSERVE_AMX", "1") != "0"
    assert cpu_build.amx() == want
    for variant in cpu_build.tested_variants():
        if variant != info.variant or not info.has("amx"):
            # the variants without the AMX code, and a CPU without AMX (Linux refuses the
            # tile state), say no
            assert cpu_build.set_amx(True, variant) is False, variant


@pytest.fixture
def amx() -> object:
    assert cpu_build.set_amx(True, "avx512_bf16")
    yield
    cpu_build.set_amx(cpu_build.amx_wanted("avx512_bf16"), "avx512_bf16")


@needs_amx
@pytest.mark.parametrize(("kind", "group", "k"), fitting(FAMILY_WIDTHS))
def test_amx_tiles_against_float64(amx: object, k: int, kind: str, group: int | None) -> None:
    """Both many-row paths (widening every call, and the tiles copy) by AMX: within bf16
    output rounding and float32 sums of the float64 product, the two bit for bit alike;
    row counts with a partial block of 16 and several blocks."""
    torch.manual_seed(k)
    qw = make(kind, group, torch.randn(96, k) * 0.05)
    tiles = cpu_quant.quant_tiles(qw, variant="avx512_bf16")
    for rows in (13, 16, 21, 40):
        x = torch.randn(rows, k).to(torch.bfloat16)
        out = cpu_quant.quant_linear(x, qw, None, tile_rows=12, variant="avx512_bf16")
        assert_matches_reference(out, x, qw)
        assert torch.equal(out, cpu_quant.quant_linear_tiles(x, tiles, qw, None,
                                                             variant="avx512_bf16"))


@needs_amx
@pytest.mark.parametrize(("kind", "group"), [("int8", 16), ("int4", 32)])
def test_amx_bias_partial_tile_and_dpbf16(amx: object, kind: str, group: int) -> None:
    """A bias, a last tile of 5 outputs, and the dpbf16 path beside: the two round the same
    sums, so they agree within one bf16 step (in practice on all but a few in 10,000)."""
    torch.manual_seed(3)
    qw = make(kind, group, torch.randn(101, 640) * 0.05)
    bias = torch.randn(101).to(torch.bfloat16)
    x = torch.randn(37, 640).to(torch.bfloat16)
    out = cpu_quant.quant_linear(x, qw, bias, tile_rows=12, variant="avx512_bf16")
    assert_matches_reference(out, x, qw, bias)
    cpu_build.set_amx(False, "avx512_bf16")
    plain = cpu_quant.quant_linear(x, qw, bias, tile_rows=12, variant="avx512_bf16")
    cpu_build.set_amx(True, "avx512_bf16")
    torch.testing.assert_close(out, plain, rtol=2**-7, atol=1e-3)
    assert float((out == plain).float().mean()) > 0.99


@needs_amx
@pytest.mark.parametrize(("kind", "group"), [("int8", 32), ("int4", 32)])
def test_amx_panels_and_row_blocks(amx: object, kind: str, group: int) -> None:
    """Prefill-sized calls: each thread's tiles in more than one panel (k 2048: 8 tiles a
    panel, 19 tiles in all, the last partly past n) and x in several blocks of rows, the
    last partial and not a multiple of 16; against float64, both paths bit for bit alike,
    and one x row alone gives the row it gives among the others."""
    torch.manual_seed(11)
    qw = make(kind, group, torch.randn(600, 2048) * 0.05)
    bias = torch.randn(600).to(torch.bfloat16)
    tiles = cpu_quant.quant_tiles(qw, variant="avx512_bf16")
    x = torch.randn(150, 2048).to(torch.bfloat16)
    out = cpu_quant.quant_linear(x, qw, bias, tile_rows=12, variant="avx512_bf16")
    assert_matches_reference(out, x, qw, bias)
    assert torch.equal(out, cpu_quant.quant_linear_tiles(x, tiles, qw, bias,
                                                         variant="avx512_bf16"))
    for row in (0, 77, 149):  # in a call of 16 rows (the many-row path), at another place
        lo = max(0, row - 15)
        part = cpu_quant.quant_linear(x[lo : lo + 16], qw, bias, tile_rows=12,
                                      variant="avx512_bf16")
        assert torch.equal(part[row - lo], out[row])
