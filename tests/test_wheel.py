"""One import namespace (issue 27): the wheel installs ``ringserve`` and nothing else, and a
plain (non-editable) install of it, run from outside the repository, serves the default
model with ``python -m ringserve``."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import zipfile

import httpx

from tests.presets import CACHE_DIR
from tests.server_utils import ROOT, Server, free_port, wait_ready


def build_wheel(out: pathlib.Path) -> pathlib.Path:
    """The wheel of a copy of the repository's files (a build writes build/ beside them)."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    src = out / "src"
    for name in files:
        source, target = ROOT / name, src / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the work tree
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(src)], check=True)
    (wheel,) = out.glob("ringserve-*.whl")
    return wheel


def test_the_wheel_installs_one_top_level_name(tmp_path: pathlib.Path) -> None:
    names = zipfile.ZipFile(build_wheel(tmp_path)).namelist()
    assert {n.split("/")[0] for n in names} == {"ringserve", "ringserve-0.1.0.dist-info"}
    for path in ("ringserve/__main__.py", "ringserve/engine/llm.py",
                 "ringserve/server/routes/chat.py", "ringserve/configs/server.yaml",
                 "ringserve/kernels/csrc/paged_decode.cpp", "ringserve/block_manager/ring.py"):
        assert path in names, path
    top_level = next(n for n in names if n.endswith("top_level.txt"))
    assert zipfile.ZipFile(build_wheel(tmp_path / "again")).read(top_level).split() == \
        [b"ringserve"]


def test_a_plain_install_outside_the_repository_serves(tmp_path: pathlib.Path) -> None:
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), str(build_wheel(tmp_path / "wheel"))], check=True)
    env = {**os.environ, "PYTHONPATH": str(site), "RINGSERVE_CACHE": str(CACHE_DIR)}
    where = subprocess.run(
        [sys.executable, "-c", "import ringserve.engine, ringserve; "
         "print(ringserve.engine.__file__); print(ringserve.LLM.__module__)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert where[0].startswith(str(site)) and where[1] == "ringserve.engine.llm"
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "ringserve", "serve", "--port", str(port),
                                 "--log-level", "warning", "--max-model-len", "512",
                                 "--kv-cache-memory", "64MiB"],
                                cwd=tmp_path, env=env, stdout=fh, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        wait_ready(server, 600)
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert r.json()["model"] == "gemma-3-270m"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
