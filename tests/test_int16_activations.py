"""float32 activations rounded to int16 blocks over quantized weights (integer dot products).

References: the kernel against a float64 computation of the same rounding
(`int16_act_matmul_reference`), that reference against the float64 product of the
unrounded x within the rounding's own bound, and whole models against transformers running
the very weights we quantized.
"""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch

from ringserve.engine import LLM, SamplingParams
from ringserve.engine.errors import InvalidRequestError
from ringserve.engine.loading import load_model
from ringserve.engine.loading.quantize import pick_int16_activations
from ringserve.engine.models.quant_linear import QuantLinear
from ringserve.kernels import cpu_build, cpu_isa, cpu_quant
from ringserve.kernels.quant import (
    QuantizedWeight,
    dequantize,
    int16_act_matmul_reference,
    quant_matmul_reference,
    quantize_activations,
    quantize_int4,
    quantize_int8,
)
from tests.model_harness import RingHarness
from tests.test_quant import assert_as_close_as_bf16, fitting, transformers_with
from tests.tiny_models import B, W, make_checkpoint, random_tokens

kernel_only = pytest.mark.skipif(not cpu_build.available(),
                                 reason="the compiled CPU kernels need a C++ compiler")
# int8 per 16 (GGUF's Q6_K), per 32, per output channel; 4-bit per 32 (Q4_K) and 64
LAYOUTS = [("int8", 16), ("int8", 32), ("int8", None), ("int4", 32), ("int4", 64)]


def make(kind: str, group: int | None, weight: torch.Tensor) -> QuantizedWeight:
    if kind == "int8":
        return quantize_int8(weight, group)
    return quantize_int4(weight, group or 32, search=False)


def bound(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """float32 summation over k of the magnitudes the kernel adds."""
    q, d = quantize_activations(x)
    k = x.shape[1]
    xq = (q.double().view(-1, k // 32, 32) * d.double().unsqueeze(-1)).view(-1, k)
    mag = xq.abs() @ dequantize(qw).double().abs().T
    if qw.mins is not None:
        sums = x.double().abs().view(-1, k // qw.group, qw.group).sum(-1)
        mag = mag + sums @ qw.mins.double().abs().T
    return mag * 2**-18 + 1e-6


@kernel_only
@pytest.mark.parametrize(("kind", "group", "k"), fitting([640, 2048, 576], LAYOUTS))
def test_kernel_matches_its_float64_reference(cpu_variant: str, k: int, kind: str,
                                              group: int | None) -> None:
    torch.manual_seed(k)
    qw = make(kind, group, torch.randn(75, k) * 0.05)
    bias = torch.randn(75)
    # passes of 4 x rows, 4 / 2 / 1 weight rows a pass; from 32 rows (int8) panels of 16
    # weight rows (75 = 4 x 16 + 11: a part panel) by 4 / 3 / 2 / 1 x rows
    for rows in (1, 2, 3, 4, 5, 9, 13, 32, 39):
        x = torch.randn(rows, k)
        x[:, 7] *= 40.0  # an outlier channel: its block's scale is coarse
        x[0, 64:96] = 0.0  # an all-zero block (d = 0)
        out = cpu_quant.int16_act_linear(x, qw, bias, variant=cpu_variant)
        assert out.dtype == torch.float32 and out.shape == (rows, 75)
        ref = int16_act_matmul_reference(x, qw) + bias.double()
        err = (out.double() - ref).abs()
        assert bool((err <= bound(x, qw)).all()), err.max()
        # the rounding is real: the unrounded product is farther off than the kernel
        full = quant_matmul_reference(x, qw) + bias.double()
        assert (full - ref).abs().max() > 4 * err.max()


def test_reference_within_the_roundings_bound() -> None:
    """|sum w (x - xq)| <= sum |w| d / 2: each x value moves by at most half its block's step."""
    torch.manual_seed(3)
    for kind, group in LAYOUTS:
        qw = make(kind, group, torch.randn(40, 640) * 0.05)
        x = torch.randn(6, 640) * torch.rand(6, 640) * 3
        _, d = quantize_activations(x)
        step = d.double().repeat_interleave(32, dim=1) / 2
        limit = step @ dequantize(qw).double().abs().T
        diff = (int16_act_matmul_reference(x, qw) - quant_matmul_reference(x, qw)).abs()
        assert bool((diff <= limit * (1 + 1e-9) + 1e-9).all())


def test_activation_blocks() -> None:
    x = torch.tensor([[0.5] * 31 + [-2.0] + [0.0] * 32])
    q, d = quantize_activations(x)
    assert d[0].tolist() == [pytest.approx(2.0 / 32767), 0.0]
    assert q[0, 31] == -32767 and q[0, 0] == round(0.5 * 32767 / 2.0) and not q[0, 32:].any()


@kernel_only
def test_int8_weights_of_minus_128(cpu_variant: str) -> None:
    """GGUF's Q8_0 holds -128 (our quantizer never makes it): |w| = 128 is still exact."""
    qw = QuantizedWeight(8, 32, torch.full((4, 64), -128, dtype=torch.int8),
                         torch.full((4, 2), 0.01, dtype=torch.float16))
    x = torch.full((1, 64), 3.0)
    out = cpu_quant.int16_act_linear(x, qw, None, variant=cpu_variant)
    torch.testing.assert_close(out.double(), int16_act_matmul_reference(x, qw), rtol=1e-6,
                               atol=1e-6)


@kernel_only
def test_kernel_refuses_what_it_cannot_read(cpu_variant: str) -> None:
    ops = cpu_build.ops(cpu_variant)
    qw = quantize_int8(torch.randn(8, 96), 48)
    with pytest.raises(RuntimeError, match="group"):
        ops.int16_act_linear(torch.randn(1, 96), qw.qweight, qw.scales, None, 8, 48, None)
    qw = quantize_int8(torch.randn(8, 64), 32)
    with pytest.raises(RuntimeError, match="float32"):
        ops.int16_act_linear(torch.randn(1, 64).bfloat16(), qw.qweight, qw.scales, None, 8,
                            32, None)
    assert not cpu_quant.int16_act_supports(quantize_int8(torch.randn(8, 96), 48))
    assert cpu_quant.int16_act_supports(quantize_int8(torch.randn(8, 96), 16))


# -- choosing it --------------------------------------------------------------------------

def _as_class(monkeypatch: pytest.MonkeyPatch, cls: str) -> None:
    real = cpu_isa.info()
    monkeypatch.setattr(cpu_isa, "info", lambda: dataclasses.replace(real, cls=cls))


@kernel_only
@pytest.mark.parametrize("cls", ["portable", "avx2", "avx512", "avx512_bf16"])
def test_auto_follows_the_cpu_class(monkeypatch: pytest.MonkeyPatch, cls: str) -> None:
    if cls not in cpu_build.tested_variants():
        pytest.skip(f"this CPU ({cpu_isa.info().cls}) cannot run the {cls} kernels")
    _as_class(monkeypatch, cls)
    on, why = pick_int16_activations("auto", quantization="gguf", dtype=torch.float32)
    # portable has no SIMD dot; avx512_bf16 has bf16 arithmetic for its activations
    assert on == (cls in ("avx2", "avx512")), why
    assert not pick_int16_activations("auto", quantization="none", dtype=torch.float32)[0]
    # gpt-oss as published: no method, but MXFP4 experts served as stored
    experts, why = pick_int16_activations("auto", quantization="none", dtype=torch.float32,
                                          mxfp4=True)
    assert experts == on and (not on or "MXFP4" in why), why
    assert not pick_int16_activations("auto", quantization="int4", dtype=torch.bfloat16)[0]
    assert not pick_int16_activations("off", quantization="int4", dtype=torch.float32)[0]
    assert pick_int16_activations("ON", quantization="int4", dtype=torch.float32)[0]


@pytest.mark.parametrize(("value", "quantization", "dtype", "says"), [
    ("yes", "int4", torch.float32, "one of"),
    ("on", "none", torch.float32, "not quantized"),
    ("on", "int8", torch.bfloat16, "bfloat16"),
])
def test_refused_naming_the_option(value: str, quantization: str, dtype: torch.dtype,
                                   says: str) -> None:
    with pytest.raises(InvalidRequestError, match=says) as err:
        pick_int16_activations(value, quantization=quantization, dtype=dtype)
    assert err.value.param == "int16_activations"


# -- whole models -------------------------------------------------------------------------

@kernel_only
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_model_close_to_transformers(tmp_path: pathlib.Path, kind: str,
                                     cpu_variant: str) -> None:
    """As close to transformers running the same quantized weights in float32 as bf16
    activations are (the path AVX512-BF16 CPUs serve), past the window and in chunks."""
    path = make_checkpoint("gemma3_text", tmp_path)
    ids = random_tokens(160, seed=5)
    with torch.no_grad():
        expected = transformers_with(path, kind)(torch.tensor([ids])).logits[0]
    model = load_model(path, dtype=torch.float32, quantization=kind, int16_activations=True)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.int16_acts for m in layers)
    got = RingHarness(model, B, 160).logits_in_chunks(ids, [W, 1, 1, 2 * W])
    assert_as_close_as_bf16(path, ids, got, expected)
    # and the rounding is on: the float32 FMA path is much closer
    exact = load_model(path, dtype=torch.float32, quantization=kind)
    fma = RingHarness(exact, B, 160).logits_in_chunks(ids, [W, 1, 1, 2 * W])
    assert (fma - expected).abs().max() < (got - expected).abs().max() / 10


@kernel_only
def test_engine_serves_with_int16_activations(tmp_path: pathlib.Path, cpu_variant: str,
                                             engines: list[LLM]) -> None:
    path = make_checkpoint("gemma3_text", tmp_path)
    kw = {"dtype": "float32", "quantization": "int4", "kv_cache_memory": "4MiB",
          "max_model_len": 128}
    llm = LLM(str(path), **kw)
    engines.append(llm)
    auto = cpu_variant in ("avx2", "avx512")
    assert llm.engine.int16_activations == auto
    # and with them a bf16 KV cache: twice the blocks of the float32 cache in the same memory
    assert llm.engine.kv_dtype == (torch.bfloat16 if auto else torch.float32)
    modules = [m for m in llm.engine.model.modules() if isinstance(m, QuantLinear)]
    assert all(m.int16_acts == auto for m in modules)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    forced = LLM(str(path), int16_activations="on", **kw)
    engines.append(forced)
    off = LLM(str(path), int16_activations="off", **kw)
    engines.append(off)
    prompts = [list(range(3, 60)), [5, 9, 2]]
    assert forced.engine.kv_dtype == torch.bfloat16 and off.engine.kv_dtype == torch.float32
    assert forced.engine.kv.pool.num_blocks == 2 * off.engine.kv.pool.num_blocks
    a = [o.outputs[0].token_ids for o in forced.generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in off.generate(prompts, params)]
    assert all(len(t) == 40 for t in a)
    # a random tiny model's greedy path parts where logits nearly tie; the first tokens agree
    assert a[0][:4] == b[0][:4] and a[1][:4] == b[1][:4], (a, b)


def test_kv_cache_dtype_follows_int16_activations() -> None:
    from ringserve.engine.startup import pick_kv_dtype

    cpu = torch.device("cpu")
    assert pick_kv_dtype("auto", torch.float32, cpu, int16_activations=True)[0] == torch.bfloat16
    assert pick_kv_dtype("auto", torch.float32, cpu)[0] == torch.float32
    assert pick_kv_dtype("float32", torch.float32, cpu,
                         int16_activations=True)[0] == torch.float32  # asked for: kept
    assert pick_kv_dtype("auto", torch.bfloat16, cpu,
                         int16_activations=True)[0] == torch.bfloat16


# -- the one-byte tiles (kernels/csrc/int8_tiles.cpp): the same rounding, another layout ----

int8_tiles_only = pytest.mark.skipif(
    not {"avx512", "avx512_bf16"} & set(cpu_build.tested_variants()),
    reason="the one-byte tiles need AVX-512 BW (the avx512 and avx512_bf16 variants), which "
    "this CPU lacks or its RINGSERVE_CPU_ISA cap rules out, with no emulated build in its "
    "place (none under a cap; it needs SIMDe's headers, libsimde-dev)")


@int8_tiles_only
@pytest.mark.parametrize(("kind", "group", "k"), fitting([640, 2048, 576], LAYOUTS))
def test_int8_tiles_match_the_float64_reference(cpu_variant: str, k: int, kind: str,
                                                group: int | None) -> None:
    if not cpu_quant.has_int8_tiles(cpu_variant):
        pytest.skip(f"the {cpu_variant} variant has no AVX-512 BW: no one-byte tiles")
    torch.manual_seed(k + 7)
    qw = make(kind, group, torch.randn(75, k) * 0.05)  # 75 rows: a partial third tile
    tiles = cpu_quant.int8_tiles(qw, variant=cpu_variant)
    assert tiles is not None  # (one group per row, group None: k, a multiple of 32 here)
    # one byte a value, two a byte for 4-bit (the weight's own bytes in the tiles' order)
    assert tiles[0].dtype == torch.int8
    assert tiles[0].numel() == (96 * k if qw.bits == 8 else 48 * k)
    bias = torch.randn(75)
    for rows in (1, 2, 5, 6, 8, 13, 16):  # passes of up to 6 x rows, split evenly
        x = torch.randn(rows, k)
        x[:, 7] *= 40.0  # an outlier channel: its block's scale is coarse
        x[0, 64:96] = 0.0  # an all-zero block (d = 0)
        ref = int16_act_matmul_reference(x, qw) + bias.double()
        out = cpu_quant.int8_tiles_linear(x, tiles, qw, bias, variant=cpu_variant)
        assert out.dtype == torch.float32 and out.shape == (rows, 75)
        err = (out.double() - ref).abs()
        assert bool((err <= bound(x, qw)).all()), err.max()
        full = quant_matmul_reference(x, qw) + bias.double()
        assert (full - ref).abs().max() > 4 * err.max()  # the int16 rounding, not bf16's
        xb = x.to(torch.bfloat16)  # bf16 rows (the served path): the same sums, bf16 out
        refb = int16_act_matmul_reference(xb.float(), qw) + bias.double()
        outb = cpu_quant.int8_tiles_linear(xb, tiles, qw, bias, variant=cpu_variant)
        assert outb.dtype == torch.bfloat16
        errb = (outb.double() - refb).abs()
        assert bool((errb <= refb.abs() * 2**-8 + bound(xb.float(), qw)).all()), errb.max()


@int8_tiles_only
def test_int8_tiles_refuse_what_they_cannot_read(cpu_variant: str) -> None:
    if not cpu_quant.has_int8_tiles(cpu_variant):
        pytest.skip(f"the {cpu_variant} variant has no AVX-512 BW: no one-byte tiles")
    ops = cpu_build.ops(cpu_variant)
    qw = quantize_int8(torch.randn(40, 128), 32)
    tiles = ops.int8_tiles(qw.qweight, qw.scales, None, 8, 32)
    x = torch.randn(2, 128)
    with pytest.raises(RuntimeError, match="tiles must come from int8_tiles"):
        ops.int8_tiles_linear(x, *tiles, 8, 32, 80, None)  # another n
    with pytest.raises(RuntimeError, match="scales must come from int8_tiles"):
        ops.int8_tiles_linear(x, tiles[0], tiles[1].float(), tiles[2], 8, 32, 40, None)
    with pytest.raises(RuntimeError, match="group"):
        ops.int8_tiles(qw.qweight, quantize_int8(torch.randn(40, 128), 64).scales, None, 8, 64 + 16)
