"""``greedy_head``: greedy rows' tokens from an int8 pass that bounds every logit plus the
exact logits of the candidates (`engine.models.greedy_head`, `kernels/csrc/greedy_head.cpp`).

The claim is exactness: the token is the first maximum of the full head's own logits, bit
for bit, for every row count (each count takes another path of the head: one-row GEMV,
one-byte tiles, bf16 tiles, float32 rows' int16 blocks), in every kernel variant that has
the pass (AVX512-VNNI's and AVX2's, through the `cpu_variant` fixture: an AVX-512 machine
tests the AVX2 pass too; an AMX machine the AMX pass over its own copy as well).
References: the head's own forward with `first_max`, and a float64 matmul of the
dequantized weight for the bound itself.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from typing import Any

import pytest
import torch

from ringserve.engine import LLM, InvalidRequestError, SamplingParams
from ringserve.engine.models import greedy_head
from ringserve.engine.models.greedy_head import GreedyHead
from ringserve.engine.models.quant_linear import QuantLinear
from ringserve.kernels import cpu_build, cpu_isa, cpu_quant
from ringserve.kernels.cpu_sample import first_max
from ringserve.kernels.quant import dequantize, quantize_int8
from tests.tiny_models import make_checkpoint, random_tokens

# The variants whose build has the pass: every x86 one but the portable (conftest's
# `cpu_variant`, restricted; on a CPU without AVX2 the list is empty).
# And "amx" (the avx512_bf16 build with AMX tiles on) where the CPU has AMX-INT8: the AMX pass.
HAS_AMX_PASS = (cpu_isa.info().has("amx") and "amx_int8" in cpu_isa.info().flags
                and cpu_build.available("avx512_bf16"))
PASS_VARIANTS = [v for v in cpu_build.tested_variants() if v != "portable"] + (
    ["amx"] if HAS_AMX_PASS else [])
each_pass = pytest.mark.parametrize("cpu_variant", PASS_VARIANTS, indirect=True)
needs_amx_pass = pytest.mark.skipif(not HAS_AMX_PASS, reason="this CPU has no AMX-INT8 "
                                    "(amx_int8, amx_tile), or no avx512_bf16 kernels were built")

# How the rows reach the head: bf16 activations, or float32 ones through the int16 blocks
# (AVX2's default) or through the float32 FMA path.
ROWS = ("bf16", "float32-int16", "float32")


def _head(vocab: int, k: int, packed: int | None, seed: int = 0, group: int = 32,
          rows: str = "bf16") -> QuantLinear:
    torch.manual_seed(seed)
    weight = torch.randn(vocab, k) * 0.05
    weight[:, 3] *= 8  # a column of large weights, as real heads have
    head = QuantLinear(quantize_int8(weight, group), None)
    head.int16_acts = rows == "float32-int16"
    if packed is not None and cpu_quant.has_tiles():
        head.add_packed_copy(packed)
    return head


def _hidden(m: int, k: int, seed: int, rows: str = "bf16") -> torch.Tensor:
    """Rows like a final norm's output: mostly small values and a few huge ones (which
    the kernel keeps apart), in bf16 or float32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2
    x[:, 7] = 60 + torch.rand(m, generator=g) * 30
    x[:, 40] = -45
    return x.to(torch.bfloat16 if rows == "bf16" else torch.float32)


@each_pass
@pytest.mark.parametrize(("rows", "packed", "group"),
                         [("bf16", None, 32), ("bf16", 2, 32), ("bf16", 2, 16),
                          ("float32-int16", None, 32), ("float32-int16", None, 16),
                          ("float32", None, 32)])
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 16, 17, 33])
def test_the_pick_is_the_full_heads_first_maximum(cpu_variant: str, m: int, rows: str,
                                                  packed: int | None, group: int) -> None:
    # 2503: the last tile is partly past the vocabulary, and the work's chunks hold pairs of
    # tiles and odd ones; group 16: GGUF's Q6_K; k 160: not a multiple of the AMX pass's 64
    vocab, k = 2503, 160
    head = _head(vocab, k, packed, group=group, rows=rows)
    picker = GreedyHead(head)
    assert picker.amx == (cpu_variant == "amx")
    for seed in range(4):
        x = _hidden(m, k, seed, rows)
        full = head(x)
        got = picker.pick(x)
        assert got is not None and torch.equal(got, first_max(full))
        index, offsets = picker.candidates(x)
        dense = x.double() @ dequantize(head.qw).double().T
        for i in range(m):
            mine = index[offsets[i] : offsets[i + 1]].long()
            assert torch.equal(mine, mine.sort().values) and len(mine) < vocab // 10
            # every float64 maximum, and every row the full head ties at its maximum
            assert set(torch.nonzero(dense[i] == dense[i].max()).flatten().tolist()) <= set(
                mine.tolist())
            assert set(torch.nonzero(full[i] == full[i].max()).flatten().tolist()) <= set(
                mine.tolist())


@each_pass
@pytest.mark.parametrize("group", [16, 32])
def test_the_copy_holds_every_row_and_a_bound_on_its_norm(cpu_variant: str, group: int) -> None:
    """The one-byte copy, packed in one pass by the kernels: every row's values + 128 in
    the tile layout, padding rows zero, and each norm at least ||w_r|| (float64 over the
    dequantized row) and at most 2e-6 above it (the pass's candidates rest on it)."""
    vocab, k = 37, 96  # three tiles, the last one with 11 padding rows
    head = _head(vocab, k, None, seed=3, group=group)
    copy = GreedyHead(head, amx=False)
    count = -(-vocab // 16)
    tiles = copy.tiles.view(count, k // 4, 16, 4).permute(0, 2, 1, 3).reshape(count * 16, k)
    want = head.qw.qweight.view(torch.uint8) ^ 0x80
    assert torch.equal(tiles[:vocab], want)
    assert bool((tiles[vocab:] == 128).all())
    exact = dequantize(head.qw, torch.float32).double().norm(dim=1)
    norms = copy.norms.double()
    assert bool((norms[:vocab] >= exact).all()) and bool((norms[vocab:] == 0).all())
    assert bool((norms[:vocab] <= exact * (1 + 2e-6)).all())


@each_pass
@pytest.mark.parametrize("rows", ROWS)
def test_ties_go_to_the_first_row_as_the_full_head_breaks_them(cpu_variant: str,
                                                               rows: str) -> None:
    head = _head(600, 64, None, seed=1)
    qw = head.qw
    # rows 11 and 500 identical, and the largest for an x of their signs
    signs = torch.where(torch.arange(64) % 3 == 0, -1, 1)
    for r in (11, 500):
        qw.qweight[r] = (signs * 120).to(torch.int8)
        qw.scales[r] = qw.scales.max()
    head = QuantLinear(qw, None)
    head.int16_acts = rows == "float32-int16"
    if cpu_quant.has_tiles():
        head.add_packed_copy(2)
    x = signs.float() * torch.tensor([[1.0], [2.0], [0.5]])
    x = x.to(torch.bfloat16) if rows == "bf16" else x
    picker = GreedyHead(head)
    want = first_max(head(x))
    assert want.tolist() == [11, 11, 11]
    got = picker.pick(x)
    assert got is not None and torch.equal(got, want)


@each_pass
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("m", "bad"), [(2, float("nan")), (1, float("nan")),
                                        (1, float("inf")), (3, -float("inf"))])
def test_a_row_with_nan_is_left_to_the_full_head(cpu_variant: str, rows: str, m: int,
                                                 bad: float) -> None:
    head = _head(200, 64, None, rows=rows)
    picker = GreedyHead(head)
    x = _hidden(m, 64, 0, rows)
    assert picker.pick(x) is not None  # (finite rows: picked)
    x[m - 1, 5] = bad
    assert picker.pick(x) is None


def test_it_serves_only_what_it_can_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    head = _head(64, 64, None)
    assert "bf16 or float32" in (GreedyHead.can_serve(head, torch.float16) or "")
    assert "int8" in (GreedyHead.can_serve(torch.nn.Linear(64, 64), torch.bfloat16) or "")
    real = cpu_isa.info()
    for cls in PASS_VARIANTS:
        monkeypatch.setattr(cpu_isa, "info", lambda cls=cls: dataclasses.replace(real, cls=cls))
        assert GreedyHead.can_serve(head, torch.float32) is None
        assert GreedyHead.can_serve(head, torch.bfloat16) is None
        # the AMX pass from one row, where it runs (the amx class with AMX tiles on)
        assert greedy_head.amx_pass() == (cls == "amx" and cpu_build.amx())
        assert greedy_head.min_rows() == (1 if cls == "amx" and cpu_build.amx() else
                                          2 if cls in ("avx512_bf16", "amx") else 4)
        # a wide head (gpt-oss's 2,880 inputs): the AVX2 pass from one row as well
        assert greedy_head.min_rows(k=2880) == (1 if cls == "amx" and cpu_build.amx() else
                                                2 if cls in ("avx512_bf16", "amx") else 1)
    # the portable build has no pass
    monkeypatch.setattr(cpu_isa, "info", lambda: dataclasses.replace(real, cls="portable"))
    assert "neither AVX512-VNNI nor AVX2" in (GreedyHead.can_serve(head, torch.float32) or "")


def test_a_bad_value_is_refused_naming_the_option(tmp_path: pathlib.Path) -> None:
    path = make_checkpoint("gemma3_text", tmp_path)
    with pytest.raises(InvalidRequestError) as err:
        LLM(str(path), greedy_head="always", kv_cache_memory="4MiB", max_model_len=64)
    assert err.value.param == "greedy_head"


@each_pass
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_engine_emits_the_same_tokens_with_and_without_it(
        cpu_variant: str, dtype: str, tmp_path: pathlib.Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """Greedy rows beside rows that sample, report logprobs or change their logits: every
    sequence's tokens (and logprobs) as with the full head, and the greedy rows were picked;
    a lone greedy sequence keeps the full head (fewer rows than `min_rows`) but with the AMX
    pass, which serves from one row."""
    # (gemma-3's own config has no final soft-cap; the tiny one's would turn the head off)
    path = make_checkpoint("gemma3_text", tmp_path, overrides={"final_logit_softcapping": None})
    prompts = [{"prompt_token_ids": random_tokens(12 + i, seed=i)} for i in range(8)]
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * 5 + [
        SamplingParams(max_tokens=20, temperature=0.9, seed=4, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.5,
                       ignore_eos=True)]
    runs, lone = {}, {}
    for mode in ("auto", "off"):
        with caplog.at_level(logging.INFO, logger="ringserve.engine"):
            llm = LLM(str(path), dtype=dtype, quantization="int8", packed_rows="auto",
                      greedy_head=mode, kv_cache_memory="8MiB", max_model_len=64)
        runner = llm.engine.runner
        picks: list[int] = []

        def counting(plan: object, scheduled: object, execute: Any = runner.execute,
                     runner: Any = runner, picks: list[int] = picks) -> object:
            out = execute(plan, scheduled)
            picks.append(len(runner.picked))
            return out

        runner.execute = counting  # type: ignore[method-assign,assignment]
        outs = llm.generate(prompts, params)
        runs[mode] = ([o.outputs[0].token_ids for o in outs],
                      [o.outputs[0].logprobs for o in outs], max(picks))
        picks.clear()
        one = llm.generate(prompts[:1], params[0])
        lone[mode] = (one[0].outputs[0].token_ids, max(picks))
    assert runs["auto"][:2] == runs["off"][:2]
    assert runs["auto"][2] == 5 and runs["off"][2] == 0  # the five plain greedy rows
    assert lone["auto"][0] == lone["off"][0] == runs["off"][0][0]
    # the AMX pass serves a lone row too (`min_rows` 1)
    assert lone["auto"][1] == (1 if cpu_variant == "amx" else 0) and lone["off"][1] == 0
    assert "greedy head: " in caplog.text and "greedy head off (off)" in caplog.text


@each_pass
def test_a_model_that_soft_caps_its_logits_keeps_the_full_head(
        cpu_variant: str, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    """A soft-cap after the head could round two logits to one value, and the first
    maximum is then the first of them, which the head's own maximum need not be."""
    path = make_checkpoint("gemma2", tmp_path)
    with caplog.at_level(logging.INFO, logger="ringserve.engine"):
        llm = LLM(str(path), dtype="bfloat16", quantization="int8", kv_cache_memory="8MiB",
                  max_model_len=64)
    assert llm.engine.runner.greedy_head is None
    assert "greedy head off (the model soft-caps or scales its logits)" in caplog.text



@needs_amx_pass
@pytest.mark.parametrize("cpu_variant", ["amx"], indirect=True)
@pytest.mark.parametrize("m", [1, 2])  # one row: by VNNI over the AMX copy; more: by AMX
def test_the_amx_copys_own_error_is_in_the_bound(cpu_variant: str, m: int) -> None:
    """The AMX pass reads each head row at one int8 scale a row, coarser than the head's own
    groups: there a decoy row (ten values that round up to one step of its row's scale) beats
    the true maximum (22 values that round to nothing), and only the copy's error term in the
    bound keeps the true one a candidate. With that term zeroed the pick goes to the decoy."""
    k, step = 64, 1 / 127  # each row's largest value is 1.0: the copy's step is 1 / 127
    torch.manual_seed(5)
    weight = torch.zeros(40, k)
    weight[:, 0] = 0.5
    weight[:, 32:] = torch.rand(40, 32) * 0.2 * step
    weight[3, 0] = weight[17, 0] = 1.0
    weight[3, 32:42] = 0.51 * step  # the decoy: +10 steps in the copy, +5.1 exactly
    weight[17, 32:] = 0.0
    weight[17, 42:] = 0.45 * step  # the maximum: nothing in the copy, +9.9 exactly
    head = QuantLinear(quantize_int8(weight, 32), None)
    x = torch.ones(m, k, dtype=torch.bfloat16)  # its digits are exact: x's rounding is no help
    want = first_max(head(x))
    assert want.tolist() == [17] * m
    picker = GreedyHead(head)
    assert picker.amx
    got = picker.pick(x)
    assert got is not None and torch.equal(got, want)
    picker.meta[2:] = 0  # ||e_r|| and max |e_r|: as if the copy were the head
    assert picker.pick(x).tolist() == [3] * m  # type: ignore[union-attr]


@needs_amx_pass
@pytest.mark.parametrize("cpu_variant", ["amx"], indirect=True)
@pytest.mark.parametrize("vocab", [262, 4096 + 37])  # a partial last tile; tiles left over
def test_one_row_by_vnni_keeps_the_amx_passs_candidates(cpu_variant: str, vocab: int) -> None:
    """One x row goes through VNNI over the AMX copy (`one_row_chunk`), more rows through
    AMX: the same int32 sums, so a row alone keeps the very candidates it keeps beside
    another row, and they hold its first maximum."""
    head = _head(vocab, 640, None, seed=vocab)
    picker = GreedyHead(head)
    assert picker.amx
    for seed in range(4):
        x = _hidden(2, 640, seed)
        x[1] = x[0] * 0.5 if seed % 2 else _hidden(1, 640, seed + 100)[0]
        alone, alone_at = picker.candidates(x[:1])
        pair, pair_at = picker.candidates(x)
        assert alone_at.tolist() == [0, int(pair_at[1])]
        assert torch.equal(alone, pair[:int(pair_at[1])])
        assert int(first_max(head(x[:1]))[0]) in alone.tolist()
