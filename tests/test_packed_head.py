"""``--packed-head-rows`` and ``--packed-rows``: packed bf16 copies of a quantized output
head, or of every quantized linear, for large steps.

References: a float64 matmul of the dequantized weight (rounded to bf16, the copy's
weight) for the layer; transformers running the same quantized weights for the model.
"""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch

from ringserve.engine import LLM, InvalidRequestError, SamplingParams
from ringserve.engine.loading import load_model
from ringserve.engine.loading.quantize import weight_bytes
from ringserve.engine.models import linear_copies, quant_linear
from ringserve.engine.models.linear_copies import pack_head_copy, pack_linear_copies
from ringserve.engine.models.packed_linear import can_pack
from ringserve.engine.models.quant_linear import QuantLinear
from ringserve.kernels import cpu_isa, cpu_quant
from ringserve.kernels.quant import (
    dequantize,
    int16_act_matmul_reference,
    quantize_int4,
    quantize_int8,
)
from tests.model_harness import RingHarness
from tests.test_quant import assert_as_close_as_bf16, transformers_with
from tests.tiny_models import B, W, make_checkpoint, random_tokens

packs = pytest.mark.skipif(
    not can_pack(torch.bfloat16, torch.device("cpu")),
    reason="oneDNN bf16 packing needs AVX-512 (avx512bw/vl/dq) or AMX, which this CPU (or "
    "its RINGSERVE_CPU_ISA cap) lacks")


real_quant_linear = cpu_quant.quant_linear


def int8_model(tmp_path: pathlib.Path, seed: int) -> tuple[pathlib.Path, list[int], torch.Tensor,
                                                            torch.nn.Module]:
    """A tiny gemma3 checkpoint, 160 random tokens, transformers' logits over them with
    the checkpoint's int8 weights (the reference), and our int8 model (bf16 activations)."""
    path = make_checkpoint("gemma3_text", tmp_path)
    ids = random_tokens(160, seed=seed)
    with torch.no_grad():
        expected = transformers_with(path, "int8", torch.bfloat16)(torch.tensor([ids])).logits[0]
    return path, ids, expected, load_model(path, dtype=torch.bfloat16, quantization="int8")


def _no_quantized_call_at(layer: QuantLinear | None, rows: int,
                          monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the quantized kernel fail for ``layer`` (None: any) in steps of ``rows`` or
    more; the rows it ran for it."""
    seen: list[int] = []
    real = quant_linear.cpu_quant.quant_linear

    def guarded(x: torch.Tensor, qw: object, *args: object) -> torch.Tensor:
        if layer is None or qw is layer.qw:
            assert x.shape[0] < rows, f"a quantized linear ran {x.shape[0]} rows"
            seen.append(x.shape[0])
        return real(x, qw, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(quant_linear.cpu_quant, "quant_linear", guarded)
    return seen


@packs
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_large_steps_multiply_by_the_packed_copy(kind: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    weight = torch.randn(300, 128) * 0.1
    qw = quantize_int8(weight, 32) if kind == "int8" else quantize_int4(weight, 32)
    layer = QuantLinear(qw, None)
    tiles, one_byte = cpu_quant.has_tiles(), cpu_quant.has_int8_tiles()
    size = layer.add_packed_copy(16)
    # our tiles: 10 of 32 rows, 2 bytes a value, float32 scales (and mins) of 4 groups;
    # beside them (AVX-512) the integer tiles, one byte a value (4-bit: two a byte), float16
    # scales (and mins); oneDNN's copy: the bf16 weight
    sets = 2 if kind == "int4" else 1
    values = 320 * 128 if kind == "int8" else 320 * 64
    one = values + 320 * 4 * 2 * sets if tiles and one_byte else 0
    assert size == (320 * 128 * 2 + 320 * 4 * 4 * sets + one if tiles else 300 * 128 * 2)
    assert (layer.tiles8 is not None) == (tiles and one_byte)
    # the integer tiles (the weight's own bytes in the tiles' order) serve it from one row
    from_one = tiles and one_byte
    assert layer.copy_for(1, torch.bfloat16) == ("tiles8" if from_one else None)
    seen = _no_quantized_call_at(layer, 16, monkeypatch)
    exact, rounded = dequantize(qw).double(), dequantize(qw, torch.bfloat16).double()
    for rows in (1, 15, 16, 17, 40):
        x = torch.randn(rows, 128).to(torch.bfloat16)
        out = layer(x)
        integer = tiles and one_byte and (rows == 16 or (from_one and rows < 16))
        # oneDNN's copy holds the weight rounded to bf16; our tiles the exact values; the
        # integer tiles (up to 16 rows) multiply x rounded to int16 blocks (their float64
        # reference: tests/test_int16_activations.py checks the kernel against it)
        dense = rounded if rows >= 16 and not tiles else exact
        ref = (int16_act_matmul_reference(x.float(), qw) if integer
               else x.double() @ dense.T)
        bound = ref.abs() * 2**-8 + (x.double().abs() @ dense.abs().T) * 2**-16 + 1e-6
        assert bool(((out.double() - ref).abs() <= bound).all()), rows
        if integer:  # the int16 blocks' sums
            assert torch.equal(out, cpu_quant.int8_tiles_linear(x, layer.tiles8, qw, None))
        elif tiles and rows >= 16:  # the sums of the many-row path that widens every call
            assert torch.equal(out, real_quant_linear(x, qw, None, 0))
    assert seen == ([1, 15] if layer.kernel and not from_one else [])


@packs
def test_a_model_with_the_packed_head_is_as_close_to_transformers(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, ids, expected, model = int8_model(tmp_path, seed=5)
    before = weight_bytes(model)
    message = pack_head_copy(model, 2, torch.bfloat16)
    after = weight_bytes(model)
    head = model.lm_head
    size = sum(t.numel() * t.element_size() for t in head.copies())
    assert size >= head.out_features * head.in_features * 2
    assert after.resident - before.resident == size
    assert after.per_token == before.per_token  # a decode step reads one of the two
    assert f"+{size / 2**20:.1f} MiB" in message
    seen = _no_quantized_call_at(head, 2, monkeypatch)
    got = RingHarness(model, B, 160).logits_in_chunks(ids, [W, 1, 1, 2 * W])
    assert_as_close_as_bf16(path, ids, got, expected)
    # the one-row steps kept the quantized head, or (AVX-512) its one-byte copy: an int8
    # weight's own bytes
    assert (1 in seen) == (head.copy_for(1, torch.bfloat16) is None)
    assert (head.copy_for(1, torch.bfloat16) == "tiles8") == (
        cpu_quant.has_tiles() and cpu_quant.has_int8_tiles())  # (beside the bf16 tiles)


@pytest.mark.parametrize(("flag", "without"), [("packed_head_rows", "quantized output head"),
                                               ("packed_rows", "needs quantized linears")])
def test_the_flags_say_where_they_cannot_work(tmp_path: pathlib.Path,
                                              monkeypatch: pytest.MonkeyPatch, flag: str,
                                              without: str) -> None:
    path = make_checkpoint("gemma3_text", tmp_path)
    with pytest.raises(InvalidRequestError, match=without) as err:
        LLM(str(path), dtype="float32", quantization="none", **{flag: 16},
            kv_cache_memory="4MiB", max_model_len=64)
    assert err.value.param == flag
    with pytest.raises(InvalidRequestError, match=flag):
        LLM(str(path), quantization="int8", **{flag: 0}, kv_cache_memory="4MiB",
            max_model_len=64)
    real = cpu_isa.info()  # as an AVX2-only CPU runs (the conftest's cpu_variant way)
    monkeypatch.setattr(cpu_isa, "info", lambda: dataclasses.replace(real, cls="avx2"))
    with pytest.raises(InvalidRequestError, match="packs bf16") as err:
        LLM(str(path), dtype="bfloat16", quantization="int8", **{flag: 16},
            kv_cache_memory="4MiB", max_model_len=64)
    assert err.value.param == flag



@packs
def test_every_quantized_linear_runs_its_copy_in_large_steps(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--packed-rows``: steps of 2+ rows never reach the quantized kernel; one-row steps
    do, unless (AVX-512) the int8 weights' one-byte copies serve them; the logits stay as
    close to transformers as the quantized model's."""
    path, ids, expected, model = int8_model(tmp_path, seed=6)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    before = weight_bytes(model)
    message = pack_linear_copies(model, 2, torch.bfloat16)
    after = weight_bytes(model)
    copies = sum(t.numel() * t.element_size() for m in layers for t in m.copies())
    assert all(m.copies() and m.packed_rows == 2 for m in layers)
    assert copies >= sum(m.out_features * m.in_features * 2 for m in layers)
    assert after.resident - before.resident == copies
    assert after.per_token == before.per_token
    assert f"{len(layers)} quantized linears" in message and f"+{copies / 2**20:.1f} MiB" in message
    rows_seen = _no_quantized_call_at(None, 2, monkeypatch)
    got = RingHarness(model, B, 160).logits_in_chunks(ids, [W, 1, 1, 2 * W])
    assert_as_close_as_bf16(path, ids, got, expected)
    if cpu_quant.has_tiles() and cpu_quant.has_int8_tiles():
        assert rows_seen == []
        assert all(m.copy_for(1, torch.bfloat16) == "tiles8" for m in layers)
    else:
        assert rows_seen and set(rows_seen) == {1}


@packs
def test_a_head_packed_on_its_own_keeps_its_rows(tmp_path: pathlib.Path) -> None:
    model = load_model(make_checkpoint("gemma3_text", tmp_path), dtype=torch.bfloat16,
                       quantization="int8")
    pack_head_copy(model, 8, torch.bfloat16)
    pack_linear_copies(model, 16, torch.bfloat16)
    assert model.lm_head.packed_rows == 8
    others = [m for m in model.modules() if isinstance(m, QuantLinear) and m is not model.lm_head]
    assert others and all(m.packed_rows == 16 for m in others)


def _linears(llm: LLM) -> list[QuantLinear]:
    return [m for m in llm.engine.model.modules() if isinstance(m, QuantLinear)]


@pytest.mark.skipif(not cpu_quant.has_tiles(), reason="packed_rows='auto' packs only where "
                    "the kernels have bf16 tiles: AVX512-BF16 or AMX, which this CPU (or its "
                    "RINGSERVE_CPU_ISA cap) lacks")
def test_auto_packs_every_quantized_linear_where_the_tiles_are(
        tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_checkpoint("gemma3_text", tmp_path)
    with caplog.at_level("INFO", logger="ringserve.engine"):
        llm = LLM(str(path), dtype="bfloat16", quantization="int8", packed_rows="auto",
                  kv_cache_memory="4MiB", max_model_len=64)
    head = llm.engine.model.lm_head
    assert isinstance(head, QuantLinear)  # (a tied int8 head)
    layers = [m for m in _linears(llm) if m is not head]
    one_byte = cpu_quant.has_int8_tiles()
    # with the one-byte copies (AVX-512) every linear from 2 rows; without, the head's bf16
    # copy from fewer rows than the layers' (it is half a small step)
    rows = linear_copies.AUTO_INT8_ROWS if one_byte else linear_copies.AUTO_PACKED_ROWS
    head_rows = linear_copies.AUTO_INT8_ROWS if one_byte else linear_copies.AUTO_PACKED_HEAD_ROWS
    assert layers and all(m.packed_rows == rows and m.copies() for m in layers)
    assert all((m.tiles8 is not None) == one_byte for m in [*layers, head])
    assert head.packed_rows == head_rows and head.copies()
    assert linear_copies.AUTO_PACKED_HEAD_ROWS < linear_copies.AUTO_PACKED_ROWS
    assert f"packed rows auto: {rows}" in caplog.text
    assert ("the integers alone (int8 one byte a value, 4-bit two a byte) for steps of up "
            "to 16 rows" in caplog.text) == one_byte
    head_seen = _no_quantized_call_at(head, head_rows, monkeypatch)
    one_byte_rows: list[int] = []
    real_int8 = quant_linear.cpu_quant.int8_tiles_linear

    def spied(x: torch.Tensor, *args: object) -> torch.Tensor:
        one_byte_rows.append(x.shape[0])
        return real_int8(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(quant_linear.cpu_quant, "int8_tiles_linear", spied)
    llm.generate([{"prompt_token_ids": random_tokens(8, seed=i)} for i in range(6)],
                 SamplingParams(max_tokens=3, ignore_eos=True))  # 6-row steps: its copy
    assert head_seen == [] or max(head_seen) < head_rows
    # the head (a module call) took its one-byte copy in the 6-row steps
    assert (6 in one_byte_rows) == one_byte
    monkeypatch.undo()
    seen = _no_quantized_call_at(None, rows, monkeypatch)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": random_tokens(8, seed=i)} for i in range(20)],
                       params)  # 20-row steps: the copies serve them
    assert all(len(o.outputs[0].token_ids) == 3 for o in out)
    assert seen == [] or max(seen) < rows


def test_auto_stays_off_where_the_copies_would_not_pay(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """float32 activations, a class without bf16 tiles (as an AVX2-only CPU runs), or too
    little memory: no copies, and the log says why."""
    path = make_checkpoint("gemma3_text", tmp_path)
    kw = {"quantization": "int8", "packed_rows": "auto", "kv_cache_memory": "4MiB",
          "max_model_len": 64}
    with caplog.at_level("INFO", logger="ringserve.engine"):
        llm = LLM(str(path), dtype="float32", **kw)
    assert not any(m.copies() for m in _linears(llm))
    assert "packed rows auto: off (needs bf16 activations" in caplog.text
    monkeypatch.setattr(linear_copies, "available_memory", lambda: 2**20)
    caplog.clear()
    with caplog.at_level("INFO", logger="ringserve.engine"):
        llm = LLM(str(path), dtype="bfloat16", **kw)
    assert not any(m.copies() for m in _linears(llm))
    if cpu_quant.has_tiles():
        assert "off (" in caplog.text and "of the memory available (1 MiB)" in caplog.text
    else:  # the class is the first reason (an AVX2-only CPU, or a cap below avx512_bf16)
        assert "no bf16 tiles" in caplog.text
    real = cpu_isa.info()
    monkeypatch.setattr(cpu_isa, "info", lambda: dataclasses.replace(real, cls="avx2"))
    monkeypatch.setattr(linear_copies, "available_memory", lambda: 2**40)
    caplog.clear()
    with caplog.at_level("INFO", logger="ringserve.engine"):
        llm = LLM(str(path), dtype="bfloat16", **kw)
    assert not any(m.copies() for m in _linears(llm))
    assert "no bf16 tiles" in caplog.text


def test_packed_rows_takes_a_count_auto_or_off() -> None:
    from ringserve.server import cli

    def served(*flags: str) -> object:
        return cli._serve_args(cli.build_parser().parse_args(["serve", *flags])).packed_rows

    assert served() == "auto"  # configs/server.yaml
    assert served("--packed-rows", "32") == 32
    assert served("--packed-rows", "off") is None
    with pytest.raises(SystemExit):
        served("--packed-rows", "0")
    with pytest.raises(InvalidRequestError, match="packed_rows") as err:
        LLM("unused", packed_rows="sometimes")
    assert err.value.param == "packed_rows"
