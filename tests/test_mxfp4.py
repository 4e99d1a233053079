"""MXFP4 expert weights: our reading against transformers' own dequantisation, and a gpt-oss
checkpoint stored in MXFP4 served as transformers runs it."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

import gguf
import pytest
import safetensors.torch
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from ringserve.engine.loading import file_read, mxfp4
from ringserve.engine.loading.mxfp4 import (
    FP4_VALUES,
    dequantize_mxfp4,
    merge_mxfp4,
    quantize_mxfp4,
)
from ringserve.engine.models.moe import ExpertLinears, ExpertWeights
from ringserve.engine.models.packed_linear import Mxfp4Linear
from ringserve.kernels import cpu_gemm
from ringserve.kernels.quant import quantize_activations
from tests.model_harness import RingHarness, load_ours
from tests.tiny_models import B, W, hf_reference, make_checkpoint, random_tokens


@pytest.mark.parametrize("shape", [(2, 6, 64), (3, 96, 32), (1, 5, 128)])
def test_dequantize_matches_transformers(shape: tuple[int, ...]) -> None:
    """On weights we quantise ourselves: transformers' convert_moe_packed_tensors (which
    also transposes to [experts, in, out]) and our merge read the same numbers."""
    torch.manual_seed(sum(shape))
    weight = torch.randn(*shape) * torch.rand(*shape[:-1], 1) * 3
    blocks, scales = quantize_mxfp4(weight)
    ours = dequantize_mxfp4(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    torch.testing.assert_close(ours.transpose(1, 2), theirs, rtol=0, atol=0)
    merged = dict(merge_mxfp4([("x_scales", scales), ("y", weight), ("x_blocks", blocks)]))
    torch.testing.assert_close(merged["x"], theirs, rtol=0, atol=0)
    assert torch.equal(merged["y"], weight)


def test_quantizer_is_the_nearest_code() -> None:
    """Every value lands on the FP4 grid times its block's power of two, at the nearest
    grid point, and exact grid values survive."""
    grid = torch.tensor(FP4_VALUES)
    exact = grid[torch.randint(16, (4, 64))] * 2.0**-3
    exact[:, ::32] = 6 * 2.0**-3  # each block's largest value sets its exponent
    blocks, scales = quantize_mxfp4(exact)
    assert torch.equal(dequantize_mxfp4(blocks, scales), exact)
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    blocks, scales = quantize_mxfp4(x)
    step = torch.ldexp(torch.ones(8, 2), scales.int() - 127).repeat_interleave(32, dim=1)
    got = dequantize_mxfp4(blocks, scales)
    candidates = (grid.abs().unique()[None, None, :] * step[..., None])
    best = (x.abs()[..., None] - candidates).abs().min(-1).values
    torch.testing.assert_close((x.abs() - got.abs()).abs(), best)


def test_lone_pieces_pass_through() -> None:
    t = torch.zeros(2, dtype=torch.uint8)
    assert dict(merge_mxfp4([("a_scales", t)])) == {"a_scales": t}


def mxfp4_experts(weights: dict[str, torch.Tensor],
                  edit: Callable[[str, torch.Tensor], None] | None = None,
                  ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A gpt-oss checkpoint's weights with the experts as MXFP4 blocks and scales (scales
    first passed to ``edit``), and the same weights with the experts as transformers'
    convert_moe_packed_tensors dequantises those blocks (the reference)."""
    packed: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))  # stored [E, out, in]
            if edit is not None:
                edit(name, scales)
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            plain[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            packed[name] = plain[name] = tensor
    return packed, plain


def published_gpt_oss(root: pathlib.Path, overrides: dict[str, Any] | None = None, *,
                      edit: Callable[[str, torch.Tensor], None] | None = None,
                      config_says: bool = False) -> tuple[pathlib.Path, pathlib.Path]:
    """The tiny gpt-oss as openai publishes its models (experts as MXFP4 blocks and scales;
    with ``config_says`` also ``quant_method: mxfp4`` in its config), and beside it a folder
    of the same weights with the experts dequantised by transformers' own
    convert_moe_packed_tensors: (the published folder, the reference folder)."""
    path = make_checkpoint("gpt_oss", root, overrides=overrides)
    (file,) = path.glob("*.safetensors")
    packed, plain = mxfp4_experts(safetensors.torch.load_file(str(file)), edit)
    ref_dir = root / "ref"
    ref_dir.mkdir()
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            (ref_dir / f.name).write_bytes(f.read_bytes())
    safetensors.torch.save_file(plain, str(ref_dir / file.name), metadata={"format": "pt"})
    safetensors.torch.save_file(packed, str(file), metadata={"format": "pt"})
    if config_says:
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "mxfp4"}
        (path / "config.json").write_text(json.dumps(config))
    return path, ref_dir


def assert_int16_experts_within_bounds(served: pathlib.Path, reference: pathlib.Path,
                                       llm_kwargs: dict[str, Any]) -> None:
    """``served`` with float32 activations rounded to int16 blocks (``llm_kwargs`` beside
    them): every expert an `Mxfp4Linear` on the int16 dot product, and the logits within the
    accuracy bounds of every quantized variant against ``reference`` in float32
    (tests/test_accuracy.py's text and bounds)."""
    from benchmarks.accuracy import Variant, compare_logits, served_model, variant_logits
    from tests.model_harness import teacher_forced_logits
    from tests.test_accuracy import CHUNK, NUM_TOKENS, within_bounds

    ids = [1, *random_tokens(NUM_TOKENS - 1, seed=0)]
    fp32 = Variant("float32", {"dtype": "float32", "kv_cache_memory": "16MiB"})
    ref = variant_logits(reference, fp32, ids, CHUNK, B)[:-1]
    int16 = Variant("int16", {"dtype": "float32", "int16_activations": "on",
                              "kv_cache_memory": "16MiB", **llm_kwargs})
    model, kv_dtype = served_model(served, int16, len(ids) + 1, B)
    experts = [lin for m in model.modules() if isinstance(m, ExpertLinears)
               for lin in [*m.gate_up, *m.down]]
    assert experts and all(isinstance(lin, Mxfp4Linear) and lin.int16_acts for lin in experts)
    logits = teacher_forced_logits(model, ids, CHUNK, B, kv_dtype)
    a = compare_logits(ref, logits[:-1], torch.tensor(ids[1:]))
    assert within_bounds(a), a


def gguf_order(blocks: torch.Tensor) -> torch.Tensor:
    """transformers' MXFP4 bytes (values 2i, 2i + 1 in byte i) in GGUF's nibble order
    (value i in byte i's low nibble, 16 + i in its high one)."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., 32]
    return codes[..., :16] | (codes[..., 16:] << 4)


@pytest.mark.parametrize("split", [False, True], ids=["hf-order", "gguf-order"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mxfp4_linear_matches_float64(cpu_variant: str, rows: int, dtype: torch.dtype,
                                      split: bool) -> None:
    """The blocks as stored, multiplied in registers (both paths: weight rows side by side
    for few x rows, float32 tiles for many), against float64 over the weight as
    transformers' own convert_moe_packed_tensors dequantises it: every exponent a real
    checkpoint may hold, tiny and huge blocks included (float32 holds each 2^(e - 127)).
    In GGUF's nibble order too, which gguf-py's own dequantisation of the 17-byte blocks
    confirms is the same weight."""
    torch.manual_seed(rows)
    weight = torch.randn(3, 67, 192) * torch.rand(3, 67, 1) * 4
    blocks, scales = quantize_mxfp4(weight)
    scales[0, 0, 0], scales[0, 1, 1], scales[0, 2, 5] = 127 - 30, 127 + 20, 127 - 100
    x = torch.randn(rows, 192).to(dtype)
    bias = torch.randn(67)
    reference = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)[0].T
    if split:
        blocks = gguf_order(blocks)
        stored = torch.cat((scales[0, ..., None], blocks[0]), dim=-1)  # GGUF's 17 bytes
        theirs = gguf.quants.dequantize(stored.reshape(67, -1).numpy(),
                                        gguf.GGMLQuantizationType.MXFP4)
        assert torch.equal(torch.from_numpy(theirs), reference)
    got = cpu_gemm.mxfp4_linear(x, blocks[0].contiguous(), scales[0], bias,
                                variant=cpu_variant, split=split)
    expected = x.double() @ reference.double().T + bias.double()
    assert got.dtype == dtype and got.shape == (rows, 67)
    # float32 sums of 192 products: each off by at most ~192 float32 roundings of the sum
    # of the products' magnitudes (a block of huge weights makes some sums huge); bf16
    # output rounds once more
    terms = x.double().abs() @ reference.double().abs().T + bias.double().abs()
    bound = 192 * 2**-24 * terms + (2**-8 * expected.abs() if dtype == torch.bfloat16 else 0)
    assert bool(((got.double() - expected).abs() <= bound + 1e-6).all())


@pytest.mark.parametrize("split", [False, True], ids=["hf-order", "gguf-order"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 40])
def test_int16_act_mxfp4_linear_matches_float64(cpu_variant: str, rows: int,
                                                split: bool) -> None:
    """The int16-activation path (integer dot products over the stored codes, both loops:
    weight rows side by side for few x rows, packed panels from 32), against float64: x
    rounded to its int16 blocks (`quantize_activations`, the rounding the kernel states)
    times the weight as transformers' convert_moe_packed_tensors dequantises it. Each
    block's int32 sum is exact, so the only error is float32's in summing the blocks."""
    torch.manual_seed(100 + rows)
    weight = torch.randn(3, 67, 192) * torch.rand(3, 67, 1) * 4
    blocks, scales = quantize_mxfp4(weight)
    scales[0, 0, 0], scales[0, 1, 1], scales[0, 2, 5] = 127 - 30, 127 + 20, 127 - 100
    x = torch.randn(rows, 192) * torch.rand(rows, 1) * 3
    x[0, 32:64] = 0.0  # a block of zeros: its scale is 0
    bias = torch.randn(67)
    reference = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)[0].T.double()
    stored = gguf_order(blocks[0]) if split else blocks[0]
    got = cpu_gemm.int16_act_mxfp4_linear(x, stored.contiguous(), scales[0], bias,
                                          variant=cpu_variant, split=split)
    q, d = quantize_activations(x)
    rounded = (q.double().view(rows, 6, 32) * d.double().unsqueeze(-1)).view(rows, 192)
    expected = rounded @ reference.T + bias.double()
    assert got.dtype == torch.float32 and got.shape == (rows, 67)
    # six block sums, each exact in int32 then rounded to float32 a few times
    terms = (rounded.abs() @ reference.abs().T) + bias.double().abs()
    assert bool(((got.double() - expected).abs() <= 16 * 2**-24 * terms + 1e-6).all())
    # and the rounding is what it claims: within int16's step of the float32 product
    exact = x.double() @ reference.T + bias.double()
    step = (x.double().abs().view(rows, 6, 32).amax(-1) / 32767).repeat_interleave(32, -1)
    assert bool(((got.double() - exact).abs() <= (step / 2) @ reference.abs().T
                 + 16 * 2**-24 * terms + 1e-6).all())


def test_mxfp4_linear_holds_the_stored_bytes() -> None:
    """A linear made from a checkpoint's blocks keeps them (4.25 bits a weight), and refuses
    blocks that do not match their exponents."""
    blocks, scales = quantize_mxfp4(torch.randn(5, 64))
    layer = Mxfp4Linear(blocks, scales)
    assert layer.blocks.data_ptr() == blocks.data_ptr()
    assert layer.blocks.nbytes + layer.exponents.nbytes == 5 * 64 * 4.25 / 8
    with pytest.raises(ValueError, match="do not match"):
        Mxfp4Linear(blocks[:, :1], scales)


@pytest.mark.parametrize("out_of_range", [False, True], ids=["mxfp4", "tiny-block"])
def test_gpt_oss_in_mxfp4_serves_like_transformers(tmp_path: pathlib.Path, out_of_range: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny gpt-oss with its expert weights stored as MXFP4 blocks and scales: our model
    reads them and matches transformers running the same weights dequantised by its own
    convert_moe_packed_tensors, in a plain checkpoint beside it. On the CPU every expert is
    served from its blocks as stored (`Mxfp4Linear`) and nothing is widened, a block of
    tiny weights (an exponent no float16 holds half of) included."""
    def tiny_block(name: str, scales: torch.Tensor) -> None:
        if out_of_range and name == "model.layers.1.mlp.experts.down_proj":
            scales[2, 0, 0] = 127 - 30  # expert 2: a block of tiny weights

    path, ref_dir = published_gpt_oss(tmp_path, edit=tiny_block)
    ids = random_tokens(6 * W, seed=4)
    with torch.no_grad():
        expected = hf_reference(ref_dir)(torch.tensor([ids])).logits[0]
    def widened(*_args: object) -> None:
        raise AssertionError("an MXFP4 expert was widened")
    monkeypatch.setattr(mxfp4, "dequantize_mxfp4", widened)
    model = load_ours(str(path))
    experts = [m for m in model.modules() if isinstance(m, ExpertLinears)]
    assert experts and not [m for m in model.modules() if isinstance(m, ExpertWeights)]
    kinds = {type(lin).__name__ for e in experts for lin in [*e.gate_up, *e.down]}
    assert kinds == {"Mxfp4Linear"}, kinds
    # served as the checkpoint file's own pages (`file_read.map_at`), never copied
    files = {mapped_file(lin.blocks) for e in experts for lin in [*e.gate_up, *e.down]}
    assert files == {str(f.resolve()) for f in path.glob("*.safetensors")}, files
    got = RingHarness(model, B, 6 * W).logits_in_chunks(ids, [W, 1, 2 * W])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def mapped_file(t: torch.Tensor) -> str | None:
    """The file whose mapping holds ``t``'s first byte (/proc/self/maps), or None."""
    ptr = t.data_ptr()
    for line in pathlib.Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(v, 16) for v in fields[0].split("-"))
        if start <= ptr < end:
            return fields[5] if len(fields) == 6 and fields[5].startswith("/") else None
    return None


def test_map_at_is_the_files_pages_and_never_writes_it(tmp_path: pathlib.Path) -> None:
    data = torch.arange(3 * 4096 + 40, dtype=torch.int32)
    path = tmp_path / "x.bin"
    path.write_bytes(b"\1" * 100 + data.numpy().tobytes())
    with path.open("rb") as handle:
        t = file_read.map_at(handle.fileno(), 100 + 8, torch.int32, [3, 4096])
    assert torch.equal(t, data[2:2 + 3 * 4096].view(3, 4096))  # the file closed, still read
    assert mapped_file(t) == str(path.resolve())
    t[0, 0] = -1  # copy-on-write: this process's page changes, the file does not
    assert t[0, 0] == -1 and path.read_bytes()[108:112] == data[2:3].numpy().tobytes()


def test_gpt_oss_as_published_with_int16_activations(tmp_path: pathlib.Path) -> None:
    """gpt-oss as openai publishes it (MXFP4 experts, `quant_method: mxfp4` in its config,
    no quantization method of ours) served with float32 activations rounded to int16 blocks,
    what `int16_activations auto` picks on a CPU without bf16 arithmetic: the experts take the
    integer dot product over their stored codes, and the logits stay within the accuracy
    bounds of every quantized variant against the same model in float32 (transformers'
    dequantisation of the experts; gpt-oss at its real weight scale, as in
    tests/test_accuracy.py)."""
    from tests.test_accuracy import OVERRIDES

    path, ref_dir = published_gpt_oss(tmp_path, OVERRIDES.get("gpt_oss"), config_says=True)
    assert_int16_experts_within_bounds(path, ref_dir, {})
