"""GGUF files of the sliding-window families, made by llama.cpp, served exactly.

For each family transformers cannot read from GGUF (`engine.loading.gguf_model`), a tiny
random checkpoint goes through llama.cpp's own `convert_hf_to_gguf.py`
(`tests.llamacpp_convert`) and comes back through `resolve_model`, as a user's
`ringserve serve --model FILE.gguf` reads it. The reference is transformers on the original
folder, never the converted one:

- the converted config says what the original says (windows, which layers slide, rotary,
  soft-caps, scales, experts);
- the tokenizer splits text as the original does;
- greedy output from an F32 file is token-exact with transformers float32 for 10 windows,
  prompts longer than the ring, chunked prefill, a batch, prefix caching; no read misses;
- a Q8_0 file served from its own blocks (`--quantization gguf`) stays within the accuracy
  bounds of `tests/test_accuracy.py` against float32;
- gpt-oss's MXFP4 experts, as released files hold them, read as transformers reads them.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import gguf
import pytest
import safetensors.torch
import torch
from transformers import AutoConfig, AutoTokenizer

from benchmarks.accuracy import Variant, compare_logits, served_model, variant_logits
from ringserve.engine import SamplingParams
from ringserve.engine.loading.convert import resolve_model
from ringserve.engine.loading.quantize import has_gguf_blocks
from ringserve.engine.models.moe import ExpertLinears
from ringserve.engine.models.packed_linear import Mxfp4Linear
from ringserve.engine.models.quant_linear import QuantLinear
from tests import llamacpp_convert
from tests.model_harness import RingHarness, load_ours, teacher_forced_logits
from tests.test_accuracy import CHUNK, NUM_TOKENS, OVERRIDES, within_bounds
from tests.test_mxfp4 import assert_int16_experts_within_bounds, mxfp4_experts
from tests.tiny_models import CORPUS, B, W, hf_reference, make_checkpoint, make_llm, random_tokens

# case: (family, config overrides). What a GGUF file cannot carry is fixed by llama.cpp per
# architecture, so the tiny checkpoints take those values: gpt-oss's SwiGLU clamp (no GGUF
# field: 7.0, the released models'); Cohere 2's `rotary_pct`, which the converter requires.
# Two more carry rotary scalings: EXAONE 4.0 32B's llama3 (which the converter stores as
# per-pair factors only) and OLMo 3's YaRN with its attention factor, on its full layers only
# (one rotary base for both kinds, so only llama.cpp's rule for OLMo says which).
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2": ("gemma2", {}), "olmo3": ("olmo3", {}), "exaone4": ("exaone4", {}),
    "cohere2": ("cohere2", {"rotary_pct": 1.0}),
    "gpt_oss": ("gpt_oss", {"swiglu_limit": 7.0}),
    "gemma4_text": ("gemma4_text", {}), "gemma4_moe": ("gemma4_moe", {}),
    "exaone4_llama3": ("exaone4", {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 10000.0}}),
    "olmo3_yarn": ("olmo3", {"max_position_embeddings": 64, "initializer_range": 0.15,
                             "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.2,
                           "original_max_position_embeddings": 16, "beta_fast": 32.0,
                           "beta_slow": 1.0, "rope_theta": 10000.0}}}),
}
CONFIG_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size", "sliding_window",
                 "layer_types", "rope_parameters", "tie_word_embeddings",
                 "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
                 "logit_scale", "num_local_experts", "num_experts_per_tok", "swiglu_limit",
                 "rms_norm_eps", "layer_norm_eps", "bos_token_id",
                 # Gemma 4
                 "global_head_dim", "num_global_key_value_heads", "attention_k_eq_v",
                 "num_kv_shared_layers", "hidden_size_per_layer_input", "use_double_wide_mlp",
                 "enable_moe_block", "num_experts", "top_k_experts", "moe_intermediate_size")
NEW = 10 * W


def _prompts() -> list[list[int]]:
    prefix = random_tokens(9, seed=6)
    return [random_tokens(2 * W + 3, seed=7), prefix + random_tokens(4, seed=8),
            prefix + random_tokens(3 * W, seed=10), random_tokens(3 * W + 1, seed=9)]


def _convert(case: str, root: pathlib.Path, outtype: str,
             overrides: dict[str, Any] | None = None) -> tuple[pathlib.Path, pathlib.Path]:
    """(the original folder, the folder `resolve_model` makes of llama.cpp's GGUF of it)."""
    family, own = CASES[case]
    folder = make_checkpoint(family, root, overrides={**own, **(overrides or {})})
    gguf = llamacpp_convert.convert(folder, root / f"{case}-{outtype}.gguf", outtype)
    return folder, resolve_model(gguf, cache_dir=root / "cache").path


@pytest.fixture(scope="module", params=list(CASES))
def f32(request: pytest.FixtureRequest,
        tmp_path_factory: pytest.TempPathFactory) -> tuple[str, pathlib.Path, pathlib.Path]:
    family = request.param
    folder, converted = _convert(family, tmp_path_factory.mktemp("gguf"), "f32")
    return family, folder, converted


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-6 * max(1.0, abs(a))  # GGUF keeps float32
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return bool(a == b)


def test_the_config_says_what_the_checkpoint_says(
        f32: tuple[str, pathlib.Path, pathlib.Path]) -> None:
    _family, folder, converted = f32
    # NOTE: as dicts: Gemma 4's config refuses attribute reads of its per-layer fields
    want = AutoConfig.from_pretrained(folder).to_dict()
    got = AutoConfig.from_pretrained(converted).to_dict()
    assert got["model_type"] == want["model_type"]
    assert "sliding_attention" in want["layer_types"]  # the test means something
    for name in (*CONFIG_FIELDS, "per_layer_config"):
        if name in want:
            assert _close(got.get(name), want[name]), (name, got.get(name), want[name])


def test_the_tokenizer_splits_text_as_the_original(
        f32: tuple[str, pathlib.Path, pathlib.Path]) -> None:
    _family, folder, converted = f32
    want, got = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(converted)
    for text in [*CORPUS, " leading space and  two"]:
        assert got(text)["input_ids"] == want(text)["input_ids"]
        assert got.decode(got(text)["input_ids"]) == want.decode(want(text)["input_ids"])
    assert (got.bos_token, got.eos_token) == (want.bos_token, want.eos_token)


def test_greedy_output_is_token_exact(f32: tuple[str, pathlib.Path, pathlib.Path]) -> None:
    _family, folder, converted = f32
    assert not has_gguf_blocks(converted)  # an F32 file: nothing quantized to serve
    reference = hf_reference(folder)
    expected = []
    with torch.no_grad():
        for prompt in _prompts():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW,
                                     min_new_tokens=NEW, do_sample=False)
            expected.append(out[0, len(prompt):].tolist())
    llm = make_llm(converted, block_size=4)  # w = 6: the ring does not end on a block edge
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    for _round in range(2):  # the second round reads the first one's cached prefixes
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
    stats = llm.stats()
    assert stats["kv_read_misses"] == 0 and stats["prefix_cache_hits"] > 0
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_reserved"] == 0


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss", "olmo3", "gemma4_text"])
def test_q8_0_blocks_stay_within_the_accuracy_bounds(family: str,
                                                     tmp_path: pathlib.Path) -> None:
    # (gpt-oss at its real weight scale, as in tests/test_accuracy.py)
    folder, converted = _convert(family, tmp_path, "q8_0", OVERRIDES.get(family))  # family=case
    ids = [1, *random_tokens(NUM_TOKENS - 1, seed=0)]
    fp32 = Variant("float32", {"dtype": "float32", "kv_cache_memory": "16MiB"})
    ref = variant_logits(folder, fp32, ids, CHUNK, B)[:-1]
    blocks = Variant("gguf", {"dtype": "bfloat16", "quantization": "gguf",
                              "kv_cache_memory": "16MiB"})
    model, kv_dtype = served_model(converted, blocks, len(ids) + 1, B)
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert quantized and all(m.bits == 8 and m.group == 32 for m in quantized)  # Q8_0's own
    logits = teacher_forced_logits(model, ids, CHUNK, B, kv_dtype)
    a = compare_logits(ref, logits[:-1], torch.tensor(ids[1:]))
    assert within_bounds(a), a


def _mxfp4_gguf(root: pathlib.Path, outtype: str,
                overrides: dict[str, Any] | None = None) -> tuple[pathlib.Path, pathlib.Path]:
    """gpt-oss as released (experts in MXFP4 blocks and scales, `quantize_mxfp4`) converted
    by llama.cpp with ``outtype`` for the rest: (the folder holding the same weights with
    the experts dequantised by transformers' own `convert_moe_packed_tensors`, the folder
    `resolve_model` makes of the GGUF)."""
    folder = make_checkpoint("gpt_oss", root,
                             overrides={**CASES["gpt_oss"][1], **(overrides or {})})
    (file,) = folder.glob("*.safetensors")
    packed, plain = mxfp4_experts(safetensors.torch.load_file(str(file)))
    safetensors.torch.save_file(plain, str(file), metadata={"format": "pt"})  # the reference
    mxfp4 = root / "mxfp4"
    shutil.copytree(folder, mxfp4)
    safetensors.torch.save_file(packed, str(mxfp4 / file.name), metadata={"format": "pt"})
    config = json.loads((mxfp4 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (mxfp4 / "config.json").write_text(json.dumps(config))
    gguf_path = llamacpp_convert.convert(mxfp4, root / f"mxfp4-{outtype}.gguf", outtype)
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(gguf_path)).tensors
             if "_exps.weight" in t.name}
    assert kinds == {"MXFP4"}
    converted = resolve_model(gguf_path, cache_dir=root / "cache").path
    assert not list(converted.glob("**/*.safetensors"))  # the weights stay in the file
    return folder, converted


def test_gpt_oss_mxfp4_experts_read_as_transformers_dequantizes_them(
        tmp_path: pathlib.Path) -> None:
    """gpt-oss as released: experts in MXFP4. Our tiny one with its experts quantised to MXFP4
    blocks and scales (`quantize_mxfp4`), converted by llama.cpp (which writes them as GGUF
    MXFP4 tensors), read back here: they are served from the file's MXFP4 blocks as stored
    (their nibbles reordered, never widened), and the logits equal transformers' on the same weights
    dequantised by its own `convert_moe_packed_tensors`."""
    folder, converted = _mxfp4_gguf(tmp_path, "f32")
    ids = random_tokens(6 * W, seed=4)
    with torch.no_grad():
        expected = hf_reference(folder)(torch.tensor([ids])).logits[0]
    model = load_ours(str(converted))
    experts = [lin for m in model.modules() if isinstance(m, ExpertLinears)
               for lin in [*m.gate_up, *m.down]]
    assert experts and all(isinstance(lin, Mxfp4Linear) for lin in experts)
    got = RingHarness(model, B, 6 * W).logits_in_chunks(ids, [W, 1, 2 * W])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_gpt_oss_mxfp4_experts_with_int16_activations(tmp_path: pathlib.Path) -> None:
    """The file llama.cpp makes of gpt-oss as released with ``--outtype q8_0`` (the one its
    users serve: Q8_0 attention, embedding and head, MXFP4 experts), with float32
    activations rounded to int16 blocks (what an AVX2 or AVX-512-without-BF16 CPU serves by
    default): the experts multiply their stored codes by integer dot products too, and the
    logits stay within the accuracy bounds of every quantized variant against the float32
    model (transformers' dequantisation of the same experts; gpt-oss at its real weight
    scale, as in tests/test_accuracy.py)."""
    folder, converted = _mxfp4_gguf(tmp_path, "q8_0", OVERRIDES.get("gpt_oss"))
    assert_int16_experts_within_bounds(converted, folder, {"quantization": "gguf"})
