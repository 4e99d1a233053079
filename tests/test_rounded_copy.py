"""``--rounded-copy-rows``: every quantized linear but the head multiplied, in steps of N+
rows, by oneDNN's GEMM over a copy of its weight rounded to bf16.

References: a float64 matmul of the dequantized weight rounded to bf16 (the copy's weight)
for the layer; transformers running the same quantized weights for the model. The copy is
not exact, so the exact paths must keep every smaller step: the tests check which path
each row count took, not only that the sums are close.
"""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch

from ringserve.engine import LLM, InvalidRequestError, SamplingParams
from ringserve.engine.loading.quantize import weight_bytes
from ringserve.engine.models import quant_linear
from ringserve.engine.models.linear_copies import pack_rounded_copies
from ringserve.engine.models.packed_linear import can_pack
from ringserve.engine.models.quant_linear import QuantLinear
from ringserve.engine.startup import describe_cpu_kernels
from ringserve.kernels import cpu_isa
from ringserve.kernels.quant import dequantize, quantize_int4, quantize_int8
from tests.model_harness import RingHarness
from tests.test_packed_head import int8_model
from tests.test_quant import assert_as_close_as_bf16
from tests.tiny_models import B, W, make_checkpoint, random_tokens

packs = pytest.mark.skipif(
    not can_pack(torch.bfloat16, torch.device("cpu")),
    reason="oneDNN bf16 packing needs AVX-512 (avx512bw/vl/dq) or AMX, which this CPU (or "
    "its RINGSERVE_CPU_ISA cap) lacks")


def _count_rounded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row counts the rounded copies multiply from now on."""
    seen: list[int] = []
    real = quant_linear.onednn_linear

    def counted(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        seen.append(x.shape[0])
        return real(x, packed, bias)

    monkeypatch.setattr(quant_linear, "onednn_linear", counted)
    return seen


@packs
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("packed", [False, True], ids=["alone", "beside-packed-copies"])
def test_steps_of_n_rows_multiply_by_the_rounded_weight(
        kind: str, packed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    weight = torch.randn(300, 128) * 0.1
    qw = quantize_int8(weight, 32) if kind == "int8" else quantize_int4(weight, 32)
    layer = QuantLinear(qw, torch.randn(300).to(torch.bfloat16))
    plain = QuantLinear(qw, torch.randn(300).to(torch.bfloat16))  # the same, without it
    plain.bias = bias = layer.bias
    assert bias is not None
    if packed:
        layer.add_packed_copy(2)
        plain.add_packed_copy(2)
    size = layer.add_rounded_copy(40)
    assert layer.rounded is not None and layer.rounded_rows == 40
    shared = layer.packed is not None  # AVX-512 without BF16: the packed copy is this one
    assert size == (0 if shared else 300 * 128 * 2)
    seen = _count_rounded(monkeypatch)
    rounded = dequantize(qw, torch.bfloat16).double()
    assert not torch.equal(dequantize(qw).double(), rounded)  # the copy's weight is not the layer's
    fixed = layer.fixed_forward(torch.bfloat16)
    for rows in (1, 8, 39, 40, 100):
        x = torch.randn(rows, 128).to(torch.bfloat16)
        out = layer(x)
        if rows < 40:  # the exact paths, untouched
            assert torch.equal(out, plain(x)), rows
        else:
            ref = x.double() @ rounded.T + bias.double()
            bound = ref.abs() * 2**-8 + (x.double().abs() @ rounded.abs().T) * 2**-16 + 1e-6
            assert bool(((out.double() - ref).abs() <= bound).all()), rows
        if fixed is not None:  # the decode layers' call makes the same choice, same bits
            assert torch.equal(fixed(x), out), rows
    assert seen == ([40, 40, 100, 100] if fixed is not None else [40, 100])


@packs
def test_a_model_with_rounded_copies_is_as_close_to_transformers(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, ids, expected, model = int8_model(tmp_path, seed=7)
    before = weight_bytes(model)
    message = pack_rounded_copies(model, 2 * W, torch.bfloat16)
    after = weight_bytes(model)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear) and m is not model.lm_head]
    assert model.lm_head.rounded is None  # the head is left out
    assert layers and all(m.rounded is not None and m.rounded_rows == 2 * W for m in layers)
    size = sum(m.in_features * m.out_features * 2 for m in layers)
    assert after.resident - before.resident == size
    assert after.per_token == before.per_token  # a decode step reads one of them
    assert f"{len(layers)} quantized linears" in message and f"+{size / 2**20:.1f} MiB" in message
    assert "inexact" in message
    assert f"bf16-rounded copy from {2 * W} rows" in describe_cpu_kernels(model, torch.bfloat16)
    seen = _count_rounded(monkeypatch)
    got = RingHarness(model, B, 160).logits_in_chunks(ids, [2 * W, 1, 1, 2 * W])
    assert_as_close_as_bf16(path, ids, got, expected)
    # the prefill chunks of 2W rows took the copies, one per layer linear; one-row steps not
    assert seen and set(seen) == {2 * W}


@packs
def test_served_with_rounded_copies(tmp_path: pathlib.Path) -> None:
    """The flag through `LLM`: prompts longer than N rows prefill through the copies and
    generate what the engine without them does, as often as bf16 rounding allows."""
    path = make_checkpoint("gemma3_text", tmp_path)
    prompts = [{"prompt_token_ids": random_tokens(48, seed=s)} for s in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = []
    for rows in (None, 16):
        llm = LLM(str(path), dtype="bfloat16", quantization="int8", rounded_copy_rows=rows,
                  kv_cache_memory="8MiB", max_model_len=96, max_num_batched_tokens=64)
        linears = [m for m in llm.engine.model.modules() if isinstance(m, QuantLinear)]
        assert any(m.rounded is not None for m in linears) == (rows is not None)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        llm.engine.close()
    same = sum(a == b for a, b in zip(*outs, strict=True))
    assert all(len(t) == 6 for t in outs[1])
    assert same >= 3, outs  # bf16-rounded weights may flip a near tie, not every prompt


def test_the_flag_says_where_it_cannot_work(tmp_path: pathlib.Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_checkpoint("gemma3_text", tmp_path)
    with pytest.raises(InvalidRequestError, match="rounded_copy_rows") as err:
        LLM(str(path), quantization="int8", rounded_copy_rows=0, kv_cache_memory="4MiB",
            max_model_len=64)
    assert err.value.param == "rounded_copy_rows"
    with pytest.raises(InvalidRequestError, match="besides the output head") as err:
        LLM(str(path), dtype="float32", quantization="none", rounded_copy_rows=64,
            kv_cache_memory="4MiB", max_model_len=64)
    assert err.value.param == "rounded_copy_rows"
    real = cpu_isa.info()  # as an AVX2-only CPU runs (the conftest's cpu_variant way)
    monkeypatch.setattr(cpu_isa, "info", lambda: dataclasses.replace(real, cls="avx2"))
    with pytest.raises(InvalidRequestError, match="packs bf16") as err:
        LLM(str(path), dtype="bfloat16", quantization="int8", rounded_copy_rows=64,
            kv_cache_memory="4MiB", max_model_len=64)
    assert err.value.param == "rounded_copy_rows"


def test_rounded_copy_rows_takes_a_count_or_off() -> None:
    from ringserve.server import cli

    def served(*flags: str) -> object:
        return cli._serve_args(cli.build_parser().parse_args(["serve", *flags])).rounded_copy_rows

    assert served() is None  # off by default: the copy is not exact
    assert served("--rounded-copy-rows", "128") == 128
    assert served("--rounded-copy-rows", "off") is None
    for bad in ("0", "auto"):
        with pytest.raises(SystemExit):
            served("--rounded-copy-rows", bad)
