"""Where the peers benchmark keeps its files, and the one helper that runs a logged command."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "peers"
LOGS = CACHE / "logs"
RESULTS = ROOT / "benchmarks" / "results"
PROJECT_PY = ROOT / ".venv" / "bin" / "python"
MODEL = "gemma-3-270m"


def log(message: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(cmd: list[str], *, log_name: str, cwd: Path | None = None,
        env: dict[str, str] | None = None) -> None:
    """Run `cmd` to completion with its output in `LOGS/log_name`; raise with the log's tail."""
    LOGS.mkdir(parents=True, exist_ok=True)
    path = LOGS / log_name
    log(f"$ {shlex.join(cmd)}  (log: {path.relative_to(ROOT)})")
    with path.open("w") as out:
        proc = subprocess.run(cmd, cwd=cwd, env={**os.environ, **(env or {})},
                              stdout=out, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = "\n".join(path.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"{shlex.join(cmd[:3])} ... exited {proc.returncode}:\n{tail}")


def python() -> str:
    """The interpreter running this script (the project venv's under `make bench-peers`)."""
    return sys.executable
