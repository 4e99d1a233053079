"""Weight-only quantization: the layout, the kernels, the layers, and whole models.

References: a float64 matmul of the dequantized weight for the kernels; transformers
(float32, eager) running the very weights we quantized, dequantized, for the models.
"""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
import pytest
import torch

from ringserve.engine.errors import InvalidRequestError
from ringserve.engine.loading import load_model
from ringserve.engine.loading.quantize import (
    INT4_GROUP,
    INT8_GROUP,
    pick_quantization,
    weight_bytes,
)
from ringserve.engine.models.quant_fuse import concat_rows
from ringserve.engine.models.quant_linear import TILE_ROWS, QuantEmbedding, QuantLinear
from ringserve.kernels import cpu_build, cpu_quant
from ringserve.kernels.quant import (
    QuantizedWeight,
    dequantize,
    pack_int4,
    quant_matmul_reference,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from tests.model_harness import RingHarness
from tests.tiny_models import B, W, hf_reference, make_checkpoint, random_tokens

# (k, n) of every linear of the five families' real models, n cut to 96 rows (the kernel
# splits rows over threads; k is what shapes its inner loop): gemma-3-270m 640/1024/2048,
# SmolLM2 (llama) 576/1536, Qwen2-0.5B 896/4864, Qwen3-0.6B 1024/3072, Phi-3-mini 3072/8192.
FAMILY_WIDTHS = sorted({640, 1024, 2048, 576, 1536, 896, 4864, 3072, 8192})
LAYOUTS = [("int8", None), ("int8", 32), ("int8", 16), ("int4", 32), ("int4", 64),
           ("int4", 128)]

kernel_only = pytest.mark.skipif(
    not cpu_quant.supports(quantize_int8(torch.ones(32, 64))),
    reason="the compiled quantized kernels need a C++ compiler")


def make(kind: str, group: int | None, weight: torch.Tensor,
         search: bool = True) -> QuantizedWeight:
    if kind == "int8":
        return quantize_int8(weight, group)
    return quantize_int4(weight, group or 32, search=search)


def fits(kind: str, group: int | None, k: int) -> bool:
    return k % (group or k) == 0 and (kind == "int8" or k % 64 == 0)


def fitting(widths: list[int], layouts: list[tuple[str, int | None]] | None = None,
            ) -> list[tuple[str, int | None, int]]:
    """(kind, group, k) for every layout (default `LAYOUTS`) and width that fit (a group must
    divide k): no test case is made for a width a layout cannot take."""
    return [(kind, group, k) for kind, group in (layouts or LAYOUTS) for k in widths
            if fits(kind, group, k)]


# -- the layout ---------------------------------------------------------------------------

def test_int4_packing_round_trips() -> None:
    values = torch.randint(0, 16, (5, 192), dtype=torch.uint8)
    packed = pack_int4(values)
    assert packed.shape == (5, 96)
    assert torch.equal(unpack_int4(packed), values)
    # the documented chunk layout: byte i of a chunk holds values i and 32 + i
    assert int(packed[0, 3]) == int(values[0, 3]) | int(values[0, 35]) << 4
    assert int(packed[1, 32 + 7]) == int(values[1, 64 + 7]) | int(values[1, 96 + 7]) << 4


@pytest.mark.parametrize(("kind", "group"), LAYOUTS)
def test_quantize_dequantize_within_half_a_step(kind: str, group: int | None) -> None:
    torch.manual_seed(0)
    weight = torch.randn(48, 256) * 0.05
    qw = make(kind, group, weight, search=False)  # min-max: every value within the grid
    err = (dequantize(qw) - weight).abs().view(48, -1, qw.group)
    step = qw.scales.float().unsqueeze(-1)
    # half a step, plus float32 rounding of q * scale + min
    assert bool((err <= step / 2 * (1 + 1e-3) + 1e-6).all())
    assert qw.nbytes < weight.numel() * (1.2 if kind == "int8" else 0.7)


@pytest.mark.parametrize("group", [32, 64])
def test_int4_grid_search_lowers_the_error(group: int) -> None:
    torch.manual_seed(2)
    weight = torch.randn(64, 512) * 0.05
    weight[:, 5] *= 10  # an outlier column, as real layers have
    plain = quantize_int4(weight, group, search=False)
    searched = quantize_int4(weight, group)
    mse = [float(((dequantize(q) - weight) ** 2).mean()) for q in (plain, searched)]
    assert mse[1] < 0.9 * mse[0], mse
    # chunked passes over the rows give the same weight
    again = quantize_int4(weight, group, rows_per_pass=7)
    assert torch.equal(again.qweight, searched.qweight)
    assert torch.equal(again.scales, searched.scales) and torch.equal(again.mins, searched.mins)


def test_layout_is_checked() -> None:
    with pytest.raises(ValueError, match="group"):
        QuantizedWeight(8, 24, torch.zeros(2, 48, dtype=torch.int8),
                        torch.zeros(2, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize_int4(torch.randn(4, 96), 32)
    with pytest.raises(ValueError, match="mins"):
        QuantizedWeight(4, 32, torch.zeros(2, 32, dtype=torch.uint8),
                        torch.zeros(2, 2, dtype=torch.float16))


def test_concat_rows_needs_one_layout() -> None:
    a, b = quantize_int8(torch.randn(8, 64), 32), quantize_int8(torch.randn(4, 64), 32)
    both = concat_rows([a, b])
    assert both is not None and both.shape == (12, 64)
    assert torch.equal(dequantize(both), torch.cat([dequantize(a), dequantize(b)]))
    assert concat_rows([a, quantize_int8(torch.randn(4, 64))]) is None


# -- the kernels --------------------------------------------------------------------------

def assert_matches_reference(out: torch.Tensor, x: torch.Tensor, qw: QuantizedWeight,
                             bias: torch.Tensor | None = None) -> None:
    """bf16 output rounding (2^-8 relative) plus float32 summation over k."""
    ref = quant_matmul_reference(x, qw)
    if bias is not None:
        ref = ref + bias.double()
    scale = x.double().abs() @ dequantize(qw).double().abs().T
    bound = ref.abs() * 2**-8 + scale * 2**-16 + 1e-6
    assert bool(((out.double() - ref).abs() <= bound).all()), (out.double() - ref).abs().max()


@kernel_only
@pytest.mark.parametrize(("kind", "group", "k"), fitting(FAMILY_WIDTHS))
def test_kernel_against_float64_per_family_width(cpu_variant: str, k: int, kind: str,
                                                 group: int | None) -> None:
    """bf16 activations: dpbf16 on the avx512_bf16 variant, float32 FMA on the others."""
    torch.manual_seed(k)
    qw = make(kind, group, torch.randn(96, k) * 0.05)
    for rows in (1, 3, 8, 13):  # 13: a second pass of x rows
        x = torch.randn(rows, k).to(torch.bfloat16)
        assert_matches_reference(cpu_quant.quant_linear(x, qw, None, tile_rows=16), x, qw)
    for rows in (1, 7, 21):  # tiles (any row count; passes of 6), 96 rows: a partial tile
        x = torch.randn(rows, k).to(torch.bfloat16)
        assert_matches_reference(cpu_quant.quant_linear(x, qw, None, tile_rows=0), x, qw)


@kernel_only
@pytest.mark.parametrize(("kind", "group", "k"), fitting([576, 640, 3072]))
def test_float32_kernel_against_float64(cpu_variant: str, k: int, kind: str,
                                        group: int | None) -> None:
    """float32 activations (the default on CPUs without bf16 arithmetic): the compact
    kernel of every variant, both paths, within float32 rounding of the float64 product."""
    torch.manual_seed(k + 1)
    qw = make(kind, group, torch.randn(101, k) * 0.05)
    ref_w = dequantize(qw, torch.float32).double()
    for rows, tile_rows in ((1, 8), (2, 8), (5, 8), (8, 8), (3, 0), (13, 0), (40, 8)):
        x = torch.randn(rows, k)
        out = cpu_quant.quant_linear(x, qw, None, tile_rows=tile_rows, variant=cpu_variant)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), x.double() @ ref_w.T, rtol=1e-5, atol=1e-4)


@kernel_only
@pytest.mark.parametrize(("kind", "group"), LAYOUTS)
def test_kernel_bias_both_paths(cpu_variant: str, kind: str, group: int | None) -> None:
    torch.manual_seed(1)
    qw = make(kind, group, torch.randn(40, 128))
    x = torch.randn(2, 128).to(torch.bfloat16)
    bias = torch.randn(40).to(torch.bfloat16)
    assert_matches_reference(cpu_quant.quant_linear(x, qw, bias), x, qw, bias)
    assert_matches_reference(cpu_quant.quant_linear(x, qw, bias, tile_rows=0), x, qw, bias)


@kernel_only
def test_kernel_refuses_a_bad_layout(cpu_variant: str) -> None:
    qw = quantize_int8(torch.randn(8, 64))
    ops = cpu_build.ops(cpu_variant)
    with pytest.raises(RuntimeError, match="scales"):
        ops.quant_linear(torch.randn(1, 64).bfloat16(), qw.qweight, qw.scales.float(), None,
                         8, 64, None)
    with pytest.raises(RuntimeError, match="scales"):
        ops.compact_linear(torch.randn(1, 64), qw.qweight, qw.scales.float(), None, 8, 64,
                           None)


# -- the layers ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kind", "group"), [("int8", None), ("int8", 32), ("int4", 64)])
@pytest.mark.parametrize("rows", [1, TILE_ROWS, TILE_ROWS + 5, 70])
def test_quant_linear_every_path(dtype: torch.dtype, kind: str, group: int | None,
                                 rows: int) -> None:
    torch.manual_seed(rows)
    qw = make(kind, group, torch.randn(72, 128) * 0.1)
    layer = QuantLinear(qw, None)
    x = torch.randn(rows, 128).to(dtype)
    out = layer(x.view(1, rows, 128))
    assert out.shape == (1, rows, 72) and out.dtype == dtype
    if dtype == torch.bfloat16 and layer.kernel:
        assert_matches_reference(out[0], x, qw)
    else:  # the dense path multiplies by the weight rounded to x's dtype
        ref = x.double() @ dequantize(qw, dtype).double().T
        torch.testing.assert_close(out[0].double(), ref, atol=1e-2 if dtype != torch.float32
                                   else 1e-4, rtol=1e-2 if dtype != torch.float32 else 1e-4)


def test_quant_embedding_reads_rows_of_the_table() -> None:
    qw = quantize_int4(torch.randn(50, 64), 32)
    head = QuantLinear(qw, None)
    embed = QuantEmbedding(head, torch.float32)
    ids = torch.tensor([[3, 49, 0], [7, 7, 21]])
    assert torch.equal(embed(ids), dequantize(qw)[ids])
    assert not list(embed.parameters()) and not list(embed.buffers())  # the head owns it


# -- choosing a method --------------------------------------------------------------------

def test_pick_quantization(tmp_path: pathlib.Path) -> None:
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert pick_quantization("auto", folder=tmp_path, device=cpu, dtype=bf16)[0] == "none"
    assert pick_quantization("INT8", folder=tmp_path, device=cpu, dtype=bf16)[0] == "int8"
    with pytest.raises(InvalidRequestError, match="int4") as bad:
        pick_quantization("int3", folder=tmp_path, device=cpu, dtype=bf16)
    assert bad.value.param == "quantization"
    with pytest.raises(InvalidRequestError, match=r"read from a \.gguf"):
        pick_quantization("gguf", folder=tmp_path, device=cpu, dtype=bf16)
    with pytest.raises(InvalidRequestError, match="CPU only"):
        pick_quantization("int8", folder=tmp_path, device=torch.device("cuda"), dtype=bf16)
    assert pick_quantization("none", folder=tmp_path, device=torch.device("cuda"),
                             dtype=bf16)[0] == "none"
    # a model folder read from a GGUF file that stores a matrix in Q8_0 blocks
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    blocks = gguf.quants.quantize(np.ones((4, 64), np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", blocks, raw_shape=blocks.shape,
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tmp_path / "ringserve-source.json").write_text('{"gguf_weights": "m.gguf"}')
    # float32 activations take the compact kernels (every CPU class), bf16 too
    assert pick_quantization("auto", folder=tmp_path, device=cpu,
                             dtype=torch.float32)[0] == "gguf"
    assert pick_quantization("auto", folder=tmp_path, device=cpu, dtype=bf16)[0] == "gguf"
    assert pick_quantization("auto", folder=tmp_path, device=cpu,
                             dtype=torch.float16)[0] == "none"


# -- whole models against transformers ------------------------------------------------------

def _fake(weight: torch.Tensor, kind: str,
          dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """Our quantization of ``weight`` [out, in] (rounded to ``dtype`` first), dequantized;
    None for a width the kernels do not read (the layer stays float)."""
    k, weight = weight.shape[1], weight.to(dtype)
    if kind == "int8" and k % 32 == 0:
        return dequantize(quantize_int8(weight, INT8_GROUP))
    if kind == "int4" and k % 64 == 0:
        return dequantize(quantize_int4(weight, INT4_GROUP))
    return None


def transformers_with(path: pathlib.Path, kind: str,
                      dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' model (float32) with every linear weight (and a tied embedding)
    replaced by our quantization of it, dequantized: the weights our quantized model must
    be running. A model loaded in ``dtype`` quantizes its weights rounded to ``dtype``."""
    hf = hf_reference(path)

    def fake(weight: torch.Tensor) -> torch.Tensor | None:
        return _fake(weight, kind, dtype)

    with torch.no_grad():
        for module in hf.modules():
            if isinstance(module, torch.nn.Linear) and (new := fake(module.weight)) is not None:
                module.weight.copy_(new)
            for name in ("gate_up_proj", "down_proj"):  # gpt-oss's stacked [E, in, out]
                stacked = getattr(module, name, None)
                if isinstance(stacked, torch.nn.Parameter) and stacked.dim() == 3:
                    for e in range(stacked.shape[0]):
                        if (new := fake(stacked[e].t())) is not None:
                            stacked[e].copy_(new.t())
    return hf


@pytest.mark.parametrize("family", ["gemma3_text", "llama", "phi3", "gpt_oss"])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_model_matches_transformers(tmp_path: pathlib.Path, family: str,
                                              kind: str, cpu_variant: str) -> None:
    """float32 activations over quantized weights: the compact kernels of every variant
    (gpt-oss: each expert's projections quantized like any linear)."""
    path = make_checkpoint(family, tmp_path)
    ids = random_tokens(6 * W, seed=3)
    with torch.no_grad():
        expected = transformers_with(path, kind)(torch.tensor([ids])).logits[0]
        plain = hf_reference(path)(torch.tensor([ids])).logits[0]
    model = load_model(path, dtype=torch.float32, quantization=kind)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert layers, "nothing was quantized"
    assert all(m.kernel for m in layers)
    if family == "gemma3_text":  # tied: the embedding reads the head's quantized table
        assert isinstance(model.model.embed_tokens, QuantEmbedding)
    got = RingHarness(model, B, 6 * W).logits_in_chunks(ids, [W, 1, 2 * W])
    # NOTE: gpt-oss's random experts (weights ~0.3, a clamp at 1) amplify float32 rounding:
    # on these int4 weights our float model and transformers' differ by 1.3e-3 (2e-6 on the
    # original ones), so the quantized kernels are also held to our float model running
    # the same dequantized weights, which they must equal to float32 rounding
    tol = 2e-3 if family == "gpt_oss" and kind == "int4" else 2e-4
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    if family == "gpt_oss":
        same = load_model(path, dtype=torch.float32, pack=False)
        with torch.no_grad():
            for m in same.modules():
                if isinstance(m, torch.nn.Linear) and (new := _fake(m.weight, kind)) is not None:
                    m.weight.copy_(new)
        floats = RingHarness(same, B, 6 * W).logits_in_chunks(ids, [W, 1, 2 * W])
        torch.testing.assert_close(got, floats, atol=2e-5, rtol=2e-5)
    # the unquantized model would fail the same check: quantization changed the weights
    assert not torch.allclose(plain, expected, atol=tol, rtol=tol)
    sizes = weight_bytes(model)
    full = weight_bytes(load_model(path, dtype=torch.float32))
    assert sizes.per_token < full.per_token
    params = sum(p.numel() for p in load_model(path, dtype=torch.float32).parameters())
    # float32 reads every weight (the embedding only where the head is tied to it; of the
    # experts, the k of E a token is routed to)
    cfg = model.config
    embed = cfg.vocab_size * cfg.hidden_size
    tied = family == "gemma3_text"
    experts = 0
    if cfg.num_experts:
        h, i = cfg.hidden_size, cfg.intermediate_size
        experts = cfg.num_layers * cfg.num_experts * (h * 2 * i + 2 * i + i * h + h)
        assert any(isinstance(m, QuantLinear) for m in model.model.layers[0].mlp.modules())
    unread = round(experts * (1 - cfg.experts_per_token / max(cfg.num_experts, 1)))
    assert abs(full.per_token - 4 * (params - (0 if tied else embed) - unread)) <= 4 * 64


def agreement(got: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """Top-1 agreement and mean KL(expected || got) per position."""
    top1 = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    kl = torch.nn.functional.kl_div(got.float().log_softmax(-1), expected.log_softmax(-1),
                                    log_target=True, reduction="batchmean").item()
    return top1, kl


def assert_as_close_as_bf16(path: pathlib.Path, ids: list[int], got: torch.Tensor,
                            expected: torch.Tensor) -> None:
    """``got`` agrees with ``expected`` (transformers on the same weights) as well as plain
    bf16 activations agree with plain float32 on this checkpoint, within a margin."""
    with torch.no_grad():
        plain_fp32 = hf_reference(path)(torch.tensor([ids])).logits[0]
    plain_bf16 = RingHarness(load_model(path, dtype=torch.bfloat16), B, len(ids)).logits_in_chunks(
        ids, [W, 1, 1, 2 * W])
    top1, kl = agreement(got, expected)
    base_top1, base_kl = agreement(plain_bf16, plain_fp32)
    assert top1 >= min(0.9, base_top1 - 0.05) and kl <= 3 * base_kl + 1e-5, (
        top1, kl, base_top1, base_kl)


def test_weight_bytes_of_a_packed_tied_head(tmp_path: pathlib.Path) -> None:
    """bf16 packs the head (a PackedLinear over the tied embedding): a decode step still
    reads the whole table, once."""
    path = make_checkpoint("gemma3_text", tmp_path)
    model = load_model(path, dtype=torch.bfloat16)
    params = sum(p.numel() for p in load_model(path, dtype=torch.float32).parameters())
    assert weight_bytes(model).per_token == 2 * params


def test_weight_bytes_leave_out_gemma4s_per_layer_table(tmp_path: pathlib.Path) -> None:
    """Gemma 4's per-layer input embeddings are looked up, a row a token: a decode step
    does not read the table (the real E2B's holds 2.3 G values)."""
    path = make_checkpoint("gemma4_text", tmp_path)
    model = load_model(path, dtype=torch.float32, pack=False)
    table = model.model.embed_tokens_per_layer.weight
    params = sum(p.numel() for p in model.parameters())
    sizes = weight_bytes(model)
    assert sizes.resident == 4 * params
    assert sizes.per_token == 4 * (params - table.numel())  # the tied head reads the other


@kernel_only
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_bf16_quantized_model_close_to_transformers(tmp_path: pathlib.Path, kind: str,
                                                   cpu_variant: str) -> None:
    """The bf16 kernel path: as close to transformers running the same quantized weights
    in float32 as plain bf16 is to plain float32 (bf16 activations round either way)."""
    path = make_checkpoint("gemma3_text", tmp_path)
    ids = random_tokens(160, seed=5)
    with torch.no_grad():
        expected = transformers_with(path, kind, torch.bfloat16)(torch.tensor([ids])).logits[0]
    model = load_model(path, dtype=torch.bfloat16, quantization=kind)
    assert any(m.kernel for m in model.modules() if isinstance(m, QuantLinear))
    got = RingHarness(model, B, 160).logits_in_chunks(ids, [W, 1, 1, 2 * W])
    assert_as_close_as_bf16(path, ids, got, expected)
