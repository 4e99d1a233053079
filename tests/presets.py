"""The real preset models, converted once per checkout and shared by every test that needs one.

    from tests.presets import preset_path
    path = preset_path("gemma-3-270m")   # a local HF folder

The first call for a preset converts its GGUF (about 30 s for SmolLM2, 100 s for Gemma on
two cores) into `.cache/ringserve-test/` at the repository root (git-ignored); later calls,
in this run or the next, reuse it. A missing package fails with the command that installs it
(`make test` installs both).
"""

from __future__ import annotations

import functools
from pathlib import Path

from ringserve.engine.loading import resolve_model

ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = ROOT / ".cache" / "ringserve-test"
PRESETS = ("gemma-3-270m", "smollm2-135m-instruct")


@functools.cache
def preset_path(name: str) -> Path:
    """The converted HF folder of a preset from configs/models.yaml (converting on first use)."""
    return resolve_model(name, cache_dir=CACHE_DIR).path
