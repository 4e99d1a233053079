"""Read a checked local HF folder: config, tokenizer, safetensors weights, dtype.

Every folder read here has passed `find.check_files` (a preset or `.gguf` file has been
converted into one first, `convert.py`). Quantizing and building the model both read the
weights through `iter_weights`. Every transformers call is local-only.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ringserve.engine.loading.errors import ModelLoadError, UnsupportedModelError
from ringserve.engine.loading.file_read import map_at, read_at
from ringserve.engine.loading.find import no_config_error, weight_files

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


# safetensors' dtype names -> torch's
_STORED: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


def safetensors_header(file: Path) -> tuple[int, dict[str, Any]]:
    """(where the data starts, the header's tensor entries) of one safetensors file, read
    from its first bytes alone.

    Raises:
        ModelLoadError: the file is too short for its header or the header is not JSON.
    """
    with file.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ModelLoadError(f"{file.name} is not a safetensors file (truncated)")
        (size,) = struct.unpack("<Q", raw)
        text = f.read(size)
    try:
        if len(text) < size:
            raise ValueError("truncated header")
        header = json.loads(text)
    except ValueError as err:
        raise ModelLoadError(f"{file.name}: unreadable safetensors header ({err})") from err
    header.pop("__metadata__", None)
    return 8 + size, header


def stored_tensors(path: str | os.PathLike[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every stored tensor's (safetensors dtype, shape), from the files' headers alone."""
    return {name: (entry["dtype"], tuple(entry["shape"]))
            for file in weight_files(Path(path))
            for name, entry in safetensors_header(file)[1].items()}


def iter_weights(path: str | os.PathLike[str], into: Mapping[str, torch.Tensor] | None = None,
                 mapped: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of a folder's safetensors checkpoint, sharded or not.

    Tensors come in their stored dtype, on the CPU, each read into memory of its own as it
    is yielded (in file order, through a small window mapped for the copy alone:
    `file_read.read_at`): a loader that moves each into its
    place before the next holds at most one tensor beyond the model, and the file's pages
    stay page cache, never this process's resident memory (docs/design.md §12).

    Args:
        path: the model folder.
        into: tensors by stored name to read into where one has the stored dtype and shape
            and is contiguous (a model's parameters): that tensor itself is yielded, and the
            bytes never exist twice.
        mapped: stored names to yield as the file's own pages, mapped copy-on-write
            (`file_read.map_at`), never read: for tensors served exactly as stored that a
            step reads only in part (gpt-oss's MXFP4 experts: 12 of its 13 GB).

    Returns:
        An iterator of `(name, tensor)` pairs, names as stored (e.g. `model.embed_tokens.weight`).

    Raises:
        ModelLoadError: no safetensors files, one tensor name stored twice, a dtype this
            reader does not know, or a file shorter than its header says (a truncated shard).
    """
    seen: set[str] = set()
    for file in weight_files(Path(path)):
        start, header = safetensors_header(file)
        size = file.stat().st_size
        entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        with file.open("rb", buffering=0) as f:
            for name, entry in entries:
                if name in seen:
                    raise ModelLoadError(f"tensor {name!r} is stored twice (again in {file.name})")
                seen.add(name)
                dtype = _STORED.get(entry["dtype"])
                if dtype is None:
                    raise ModelLoadError(f"{file.name}: tensor {name!r} has dtype "
                                         f"{entry['dtype']}, which ringserve cannot read")
                begin, end = entry["data_offsets"]
                if start + end > size:
                    raise ModelLoadError(f"{file.name} is truncated: tensor {name!r} ends at "
                                         f"byte {start + end}, the file has {size}")
                if name in mapped and end > begin:
                    yield name, map_at(f.fileno(), start + begin, dtype, entry["shape"])
                    continue
                tensor = (into or {}).get(name)
                if tensor is None or tensor.dtype != dtype or tensor.device.type != "cpu" \
                        or list(tensor.shape) != entry["shape"] or not tensor.is_contiguous():
                    tensor = torch.empty(entry["shape"], dtype=dtype)
                if end > begin:
                    buffer: Any = tensor.view(-1).view(torch.uint8).numpy()
                    if not read_at(f.fileno(), start + begin, buffer):
                        raise ModelLoadError(f"{file.name}: short read of tensor {name!r}")
                yield name, tensor


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
        raise no_config_error(Path(path))
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
    return language_config(config)


MULTIMODAL = {"gemma4": "gemma4_text"}
"""Multimodal model types whose language model we serve alone: its text config's type."""


def language_config(config: PretrainedConfig) -> PretrainedConfig:
    """The text model's config of a multimodal checkpoint (Gemma 4's towers are left out;
    their weights are skipped at load), else the config itself. The checkpoint's dtype
    carries over where the text config names none."""
    text = getattr(config, "text_config", None)
    if config.model_type not in MULTIMODAL or text is None or \
            text.model_type != MULTIMODAL[config.model_type]:
        return config
    if getattr(text, "dtype", None) is None:
        text.dtype = getattr(config, "dtype", None)
    result: PretrainedConfig = text
    return result


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


class TokenizerLoad:
    """`load_tokenizer` in a thread, for a start to do other work meanwhile (the weights'
    load in the core, the core's whole load in the API process: 1.4-1.8 s for gpt-oss's
    200k-token vocabulary, AVX2 EPYC). `result` joins it and returns the tokenizer or
    raises what the load raised."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._value: PreTrainedTokenizerBase | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(path,),
                                         name="ringserve-tokenizer", daemon=True)
        self._thread.start()

    def _run(self, path: str | os.PathLike[str]) -> None:
        try:
            self._value = load_tokenizer(path)
        except BaseException as err:  # raised again in `result`, on the caller's thread
            self._error = err

    def result(self) -> PreTrainedTokenizerBase:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value


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
