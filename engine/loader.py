"""Find a model on local disk and read it: config, tokenizer, safetensors weights.

`resolve_model` turns what a user passes as `model` (a preset name from
`configs/models.yaml`, a local Hugging Face folder, or a `.gguf` file) into a local folder
holding `config.json`, `*.safetensors` and tokenizer files. GGUF files and presets are
converted once into a cache folder (`engine/gguf_convert.py`). Nothing is ever fetched from
a model hub: every transformers call is local-only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeAlias

import torch

# NOTE: huggingface_hub reads this once, when it is first imported; `local_files_only=True`
# below covers the case where something imported it earlier.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

Source: TypeAlias = Literal["preset", "folder", "gguf"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
_INDEX_FILE = "model.safetensors.index.json"
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class ModelLoadError(ValueError):
    """A model cannot be found, converted or read; the message says what to do."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint is readable, but its `model_type` is not one we implement."""


@dataclass(frozen=True, kw_only=True)
class ResolvedModel:
    """A model on local disk, ready to load.

    Attributes:
        path: a folder with config.json, *.safetensors and tokenizer files.
        name: the default served model name (the preset name, or the folder / file stem).
        source: what the user passed: a preset name, an HF folder, or a GGUF file.
    """

    path: Path
    name: str
    source: Source


def default_cache_dir() -> Path:
    """Where converted models live: `$RINGSERVE_CACHE`, else `~/.cache/ringserve`."""
    env = os.environ.get("RINGSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ringserve"


def resolve_model(
    model: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None
) -> ResolvedModel:
    """Turn a preset name, an HF folder or a `.gguf` file into a checked local HF folder.

    Preset names win over a path of the same spelling (`./NAME` always means the path).
    A GGUF file or a preset is converted on first use (about a minute, with progress) and
    then served from the cache.

    Args:
        model: a preset name from `configs/models.yaml`, a folder, or a `.gguf` file.
        cache_dir: where conversions are kept; default `default_cache_dir()`.

    Returns:
        The folder (already passed through `check_files`) and a default served name.

    Raises:
        ModelLoadError: unknown name, missing path or package, or an incomplete folder.
    """
    # NOTE: imported here, not at the top: gguf_convert imports this module's errors.
    from engine import gguf_convert

    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    spelled = os.fspath(model)
    presets = gguf_convert.load_presets()
    if spelled in presets:
        preset = presets[spelled]
        folder = gguf_convert.convert_preset(preset, cache)
        return _checked(folder, name=preset.served_name, source="preset")
    path = Path(spelled).expanduser()
    if path.is_dir():
        path = path.resolve()
        return _checked(path, name=path.name, source="folder")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"model {spelled!r} is a file but not a .gguf file; pass a Hugging Face folder "
                "(config.json, *.safetensors, tokenizer files), a .gguf file or a preset name"
            )
        folder = gguf_convert.convert_gguf_file(path.resolve(), cache)
        return _checked(folder, name=path.stem, source="gguf")
    raise ModelLoadError(
        f"model {spelled!r} is neither a preset ({', '.join(sorted(presets))}) nor an existing "
        "path (a Hugging Face folder or a .gguf file)"
    )


def _checked(path: Path, *, name: str, source: Source) -> ResolvedModel:
    check_files(path)
    return ResolvedModel(path=path, name=name, source=source)


def check_files(path: str | os.PathLike[str]) -> None:
    """Check that a folder holds a loadable model, naming the first thing missing.

    Args:
        path: the model folder.

    Raises:
        ModelLoadError: missing folder, config.json, safetensors weights or tokenizer files.
    """
    folder = Path(path)
    if not folder.exists():
        raise ModelLoadError(f"model folder {folder} does not exist")
    if not folder.is_dir():
        raise ModelLoadError(f"model path {folder} is not a folder")
    if not (folder / "config.json").is_file():
        raise _no_config(folder)
    _weight_files(folder)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(
            f"{folder} has no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})"
        )


def _no_config(folder: Path) -> ModelLoadError:
    return ModelLoadError(f"{folder} has no config.json: it is not a Hugging Face model folder")


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files to read: the index's shards when there is one, else all."""
    index = folder / _INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {err}") from err
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists missing shards: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in folder.glob("*") if p.suffix in {".bin", ".pt", ".pth"})
        hint = f" (found {', '.join(others)}: only safetensors are loaded)" if others else ""
        raise ModelLoadError(f"{folder} has no *.safetensors weights{hint}")
    return files


def iter_weights(path: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of a folder's safetensors checkpoint, sharded or not.

    Tensors come in their stored dtype, on the CPU, one file open at a time.

    Args:
        path: the model folder.

    Returns:
        An iterator of `(name, tensor)` pairs, names as stored (e.g. `model.embed_tokens.weight`).

    Raises:
        ModelLoadError: no safetensors files, or one tensor name stored twice.
    """
    from safetensors import safe_open

    seen: set[str] = set()
    for file in _weight_files(Path(path)):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                if name in seen:
                    raise ModelLoadError(f"tensor {name!r} is stored twice (again in {file.name})")
                seen.add(name)
                yield name, handle.get_tensor(name)


def load_hf_config(path: str | os.PathLike[str]) -> PretrainedConfig:
    """Read a folder's config.json with transformers' AutoConfig, local files only.

    Args:
        path: the model folder.

    Returns:
        The model's `PretrainedConfig` subclass (e.g. `LlamaConfig`, `Gemma3TextConfig`).

    Raises:
        ModelLoadError: no or unreadable config.json.
        UnsupportedModelError: a `model_type` that transformers itself does not know.
    """
    from transformers import AutoConfig

    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise _no_config(Path(path))
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{config_file} is not valid JSON: {err}") from err
    try:
        config: PretrainedConfig = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError) as err:
        model_type = raw.get("model_type") if isinstance(raw, dict) else None
        raise UnsupportedModelError(
            f"{config_file} has model_type {model_type!r}, which transformers cannot read: {err}"
        ) from err
    return config


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Load a folder's tokenizer (with its chat template, if any), local files only.

    Args:
        path: the model folder.

    Returns:
        The tokenizer transformers' AutoTokenizer picks for the folder.

    Raises:
        ModelLoadError: the tokenizer files are missing or unreadable.
    """
    from transformers import AutoTokenizer

    try:
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            str(path), local_files_only=True
        )
    except (OSError, ValueError, KeyError) as err:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {err}") from err
    return tokenizer


def check_model_type(config: PretrainedConfig, supported: Collection[str]) -> None:
    """Refuse a config whose `model_type` has no implementation here.

    Args:
        config: the model's config (from `load_hf_config`).
        supported: the model types we implement.

    Raises:
        UnsupportedModelError: naming the model type and listing the supported ones.
    """
    model_type = getattr(config, "model_type", None) or ""
    if model_type not in supported:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(supported))}"
        )


def parse_dtype(name: str | torch.dtype, config: PretrainedConfig | None = None) -> torch.dtype:
    """Turn a user's `dtype` into a torch dtype.

    Args:
        name: "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16", "auto", or a torch dtype.
        config: used by "auto": the checkpoint's own dtype (float32 when it names none).

    Returns:
        torch.float32, torch.bfloat16 or torch.float16.

    Raises:
        ValueError: naming the parameter `dtype` and the accepted values.
    """
    if isinstance(name, torch.dtype) and name in _DTYPES.values():
        return name
    key = name.lower() if isinstance(name, str) else str(name)
    if key in _DTYPES:
        return _DTYPES[key]
    if key == "auto":
        stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(stored, torch.dtype) and stored in _DTYPES.values():
            return stored
        if isinstance(stored, str):
            return _DTYPES.get(stored.removeprefix("torch.").lower(), torch.float32)
        return torch.float32
    raise ValueError(f"dtype must be 'auto' or one of {', '.join(_DTYPES)}; got {name!r}")
