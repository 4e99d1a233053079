"""GGUF blocks repacked into our layout (engine/loading/gguf_blocks.py) against gguf-py's and
transformers' own dequantization.

Bounds: Q8_0, Q5_0, Q4_0 and Q4_1 carry their float16 scales over as they are, so our
dequantized weight must equal gguf-py's exactly. Q4_K and Q6_K sub-block scales (and Q4_K's
mins) are products d * sc rounded once to float16 (relative error <= 2**-11 each), so the
bound per value w = q * S + M is

    |ours - ref| <= 2**-11 * (1 + 2**-10) * (|q * S| + |M|) + 2**-22 * |ref|

where S, M are our float16 scale and min (|exact| <= |rounded| * (1 + 2**-10)), and the last
term covers the float32 rounding of the final sum on either side. Truncating instead of
rounding to nearest would break it (errors up to 2**-10). Against transformers' bfloat16
folders, each side is also rounded once to bfloat16 (2**-8 relative each).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from ringserve.engine.loading import load_presets
from ringserve.engine.loading.convert import _preset_gguf
from ringserve.engine.loading.gguf_blocks import SUPPORTED_TYPES, read_linears, repack
from ringserve.kernels.quant import INT4_CHUNK, QuantizedWeight, dequantize, unpack_int4
from tests.presets import transformers_from_gguf

EXACT = (Q.Q8_0, Q.Q5_0, Q.Q4_0, Q.Q4_1)
ROUNDED = (Q.Q4_K, Q.Q6_K)
# byte offsets of each type's float16 fields in its block
F16_FIELDS = {Q.Q8_0: (0,), Q.Q5_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q4_K: (0, 2)}
F16_FIELDS[Q.Q6_K] = (208,)
PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def _random_f16(rng: np.random.Generator, size: int) -> npt.NDArray[np.float16]:
    """Signed float16 of magnitudes 2**-24 .. 2**2: subnormals, tiny and ordinary scales."""
    magnitude = 2.0 ** rng.uniform(-24, 2, size) * rng.choice([-1.0, 1.0], size)
    return magnitude.astype(np.float16)


def random_blocks(qtype: Q, n: int, k: int, seed: int = 0) -> npt.NDArray[np.uint8]:
    """Valid raw blocks [n, bytes per row]: every byte random except finite float16 fields."""
    rng = np.random.default_rng(seed)
    per_block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n * k // per_block, block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        field = _random_f16(rng, blocks.shape[0]).view(np.uint8).reshape(-1, 2)
        blocks[:, offset : offset + 2] = field
    return blocks.reshape(n, -1)


def float_blocks(qtype: Q, n: int, k: int, seed: int = 0) -> npt.NDArray[np.uint8]:
    """gguf-py's own quantization of random weights, rows of very different magnitudes,
    one row of zeros and one constant row; random blocks where gguf-py cannot quantize."""
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((n, k)).astype(np.float32)
    weights *= (2.0 ** rng.uniform(-12, 4, (n, 1))).astype(np.float32)
    weights[0] = 0.0
    weights[1] = 0.75
    try:
        raw: npt.NDArray[np.uint8] = gguf.quants.quantize(weights, qtype)
    except NotImplementedError:  # gguf-py 0.19 quantizes no K-quant
        return random_blocks(qtype, n, k, seed + 1)
    return raw


def rounding_bound(qw: QuantizedWeight, ref: torch.Tensor) -> torch.Tensor:
    """The bound of the module docstring, per value, for `qw` against the reference `ref`."""
    n, k = qw.shape
    values = unpack_int4(qw.qweight) if qw.bits == 4 else qw.qweight
    scaled = values.float().view(n, -1, qw.group) * qw.scales.float().unsqueeze(-1)
    spread = scaled.abs()
    if qw.mins is not None:
        spread = spread + qw.mins.float().abs().unsqueeze(-1)
    return 2.0**-11 * (1 + 2.0**-10) * spread.view(n, k) + 2.0**-22 * ref.abs()


@pytest.mark.parametrize("make", [float_blocks, random_blocks], ids=["quantized", "random"])
@pytest.mark.parametrize("qtype", EXACT + ROUNDED, ids=lambda t: t.name)
def test_repack_matches_gguf_dequantize(
    qtype: Q, make: Callable[[Q, int, int], npt.NDArray[np.uint8]]
) -> None:
    n, k = 24, 768  # 3 K-quant super-blocks, 24 blocks of 32 per row
    raw = make(qtype, n, k)
    qw = repack(qtype, raw, (n, k))
    assert qw is not None and qw.shape == (n, k)
    expected = {Q.Q6_K: (8, 16), Q.Q4_K: (4, 32), Q.Q4_0: (4, 32), Q.Q4_1: (4, 32)}
    assert (qw.bits, qw.group) == expected.get(qtype, (8, 32))
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    ours = dequantize(qw)
    if qtype in EXACT:
        assert torch.equal(ours, ref)
        assert torch.equal(dequantize(qw, torch.bfloat16), ref.bfloat16())
    else:
        excess = (ours - ref).abs() - rounding_bound(qw, ref)
        assert excess.max() <= 0, f"{qtype.name}: over the bound by {excess.max():.3g}"


def test_repack_is_chunk_independent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows repacked a few at a time (as for a large embedding) give the same weight."""
    import ringserve.engine.loading.gguf_blocks as blocks

    raw = random_blocks(Q.Q6_K, 40, 512, seed=3)
    whole = repack(Q.Q6_K, raw, (40, 512))
    monkeypatch.setattr(blocks, "_CHUNK_VALUES", 3 * 512)
    pieces = repack(Q.Q6_K, raw, (40, 512))
    assert whole is not None and pieces is not None
    assert torch.equal(whole.qweight, pieces.qweight)
    assert torch.equal(whole.scales, pieces.scales)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q5_K, Q.Q8_K])
def test_types_without_a_layout_give_none(qtype: Q) -> None:
    per_block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros((4, 256 // per_block * block_bytes), np.uint8)
    assert qtype not in SUPPORTED_TYPES
    assert repack(qtype, raw, (4, 256)) is None


@pytest.mark.parametrize(("qtype", "scale"), [(Q.Q6_K, 600.0), (Q.Q4_K, 1100.0), (Q.Q4_0, 9000.0)])
def test_scales_overflowing_float16_give_none(qtype: Q, scale: float) -> None:
    raw = random_blocks(qtype, 2, 256)
    blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    offset = F16_FIELDS[qtype][0]
    blocks[:, offset : offset + 2] = np.full((len(blocks), 1), scale, np.float16).view(np.uint8)
    if qtype == Q.Q6_K:
        blocks[:, 192:208] = 127
    if qtype == Q.Q4_K:
        blocks[:, 4:16] = 0xFF  # every 6-bit scale and min 63
    assert repack(qtype, raw, (2, 256)) is None


def test_4_bit_rows_off_the_packing_chunk_give_none() -> None:
    k = INT4_CHUNK + 32  # whole Q4_0/Q4_1 blocks, but not whole chunks of our packing
    for qtype in (Q.Q4_0, Q.Q4_1):
        assert repack(qtype, float_blocks(qtype, 2, k), (2, k)) is None


def test_wrong_sizes_raise() -> None:
    raw = random_blocks(Q.Q8_0, 4, 64)
    with pytest.raises(ValueError, match="needs"):
        repack(Q.Q8_0, raw[:3], (4, 64))
    with pytest.raises(ValueError, match="multiple"):
        repack(Q.Q6_K, raw, (4, 64))


# --- the preset files, against transformers' dequantization of them -----------------------

GGUF_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["gemma-3-270m", "smollm2-135m-instruct"])
def test_preset_files_match_transformers(preset: str, tmp_path: Path) -> None:
    """Every linear of both presets repacks (none is left to float), equal to the bfloat16
    weights transformers makes of the same file: exact for Q8_0/Q5_0/Q4_1, within the bound
    for Q4_K/Q6_K. SmolLM2 is a llama file: its q/k rows prove the permutation undone."""
    reader = gguf.GGUFReader(_preset_gguf(load_presets()[preset], tmp_path))
    arch = reader.fields["general.architecture"].contents()
    layers = int(reader.fields[f"{arch}.block_count"].contents())
    names = [f"model.layers.{i}.{p}.weight" for i in range(layers) for p in PROJECTIONS]
    names += ["model.embed_tokens.weight", "lm_head.weight"]
    weights = read_linears(reader, names)
    assert sorted(weights) == sorted(names)  # no tensor of either file was left out
    assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]  # tied

    types = {t.name: Q(t.tensor_type) for t in reader.tensors}
    kinds = {"model.embed_tokens.weight": types["token_embd.weight"]}
    for i in (0, 1, 2, 5, layers - 1):  # Gemma: Q5_0 and Q8_0 attn_v, Q4_K and Q6_K ffn_down
        for ours, theirs in zip(PROJECTIONS, GGUF_PROJECTIONS, strict=True):
            kinds[f"model.layers.{i}.{ours}.weight"] = types[f"blk.{i}.{theirs}.weight"]
    hf = transformers_from_gguf(preset, torch.bfloat16).state_dict()
    for name, kind in kinds.items():
        qw, ref = weights[name], hf[name]
        if name == "model.embed_tokens.weight":  # 262144 rows for Gemma: every 16th
            rows = torch.arange(0, qw.shape[0], 16)
            qw, ref = qw.rows(rows), ref[rows]
        ours = dequantize(qw, torch.bfloat16)
        if kind in EXACT:
            assert torch.equal(ours, ref), name
            continue
        wide = dequantize(qw)
        bound = rounding_bound(qw, wide) + 2.0**-8 * 1.01 * (wide.abs() + ref.float().abs())
        assert ((ours.float() - ref.float()).abs() <= bound).all(), name
    expected = {Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K} if arch == "gemma3" else {Q.Q8_0, Q.Q4_1}
    assert set(kinds.values()) == expected
