"""The real preset models, read once per checkout and shared by every test that needs one.

    from tests.presets import preset_path, preset_gguf
    path = preset_path("gemma-3-270m")   # its model folder: config, tokenizer (no weights)
    file = preset_gguf("gemma-3-270m")   # the GGUF file the weights are read from

The first call for a preset reads its GGUF's metadata (and, for Gemma, assembles the file)
into `.cache/ringserve-test/` at the repository root (git-ignored); later calls, in this run
or the next, reuse it. A missing package fails with the command that installs it (`make
test` installs both). Tests compare against transformers reading the same GGUF file.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
import transformers

from ringserve.engine.loading import resolve_model
from ringserve.engine.loading.find import gguf_weights_file

ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = ROOT / ".cache" / "ringserve-test"
PRESETS = ("gemma-3-270m", "smollm2-135m-instruct")


@functools.cache
def preset_path(name: str) -> Path:
    """The model folder of a preset from configs/models.yaml (made on first use)."""
    return resolve_model(name, cache_dir=CACHE_DIR).path


def preset_gguf(name: str) -> Path:
    """The GGUF file a preset's weights are read from."""
    file = gguf_weights_file(preset_path(name))
    assert file is not None, name
    return file


def transformers_from_gguf(name: str, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' own model of a preset's GGUF file (it dequantizes every tensor)."""
    file = preset_gguf(name)
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=dtype, attn_implementation="sdpa",
        local_files_only=True).eval()
