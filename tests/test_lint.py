"""ruff is part of the suite, so style breaks CI like any other failure."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_ruff_is_clean() -> None:
    ruff = shutil.which("ruff", path=str(pathlib.Path(sys.executable).parent)) or shutil.which(
        "ruff"
    )
    if ruff is None:
        pytest.fail("ruff is not installed: `make test` installs it with the test extras")
    out = subprocess.run([ruff, "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
