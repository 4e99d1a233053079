"""benchmarks/gpu_check.sh, the one script run when a CUDA device is lent: its arguments,
its quick skip without CUDA, and (with a stand-in `python` that claims a GPU) that a failed
or timed-out stage is reported while the others still run."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def run(*args: str, env: dict[str, str] | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    # NOTE: an empty CUDA_VISIBLE_DEVICES hides any GPU, so the skip path is what CI sees.
    base = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    base.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT), *args], env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def test_syntax() -> None:
    out = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_shellcheck() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (Debian: apt-get install shellcheck)")
    out = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_help() -> None:
    out = run("--help")
    assert out.returncode == 0
    for word in ("--out", "--stages", "--model", "tests,kernels,e2e", "Exit status"):
        assert word in out.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--stages", "tests,bogus"], "unknown stage 'bogus'"),
    (["--stages", "tests,,e2e"], "unknown stage ''"),
    (["--out"], "--out needs a value"),
    (["--frobnicate"], "unknown argument '--frobnicate'"),
])  # fmt: skip
def test_bad_arguments(args: list[str], message: str, tmp_path: pathlib.Path) -> None:
    out = run(*args, env={"OUT": str(tmp_path)})
    assert out.returncode == 2
    assert message in out.stderr
    assert not (tmp_path / "summary.txt").exists()


def test_without_cuda_every_stage_skips_quickly(tmp_path: pathlib.Path) -> None:
    start = time.monotonic()
    out = run("--out", str(tmp_path / "res"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert time.monotonic() - start < 60  # one `import torch`, nothing else
    for stage in ("tests", "kernels", "e2e"):
        assert f"{stage}: no CUDA device: skipping" in out.stdout
    lines = (tmp_path / "res" / "summary.txt").read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["tests", "kernels", "e2e"]
    assert all("skipped (no CUDA device)" in line for line in lines)


def test_a_gpu_that_torch_cannot_see_fails(tmp_path: pathlib.Path) -> None:
    """nvidia-smi lists a GPU but the python's torch is a CPU build: a set-up error."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    out = run("--out", str(tmp_path / "res"),
              env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": "0"})
    assert out.returncode == 1, out.stdout + out.stderr
    assert "torch does not" in out.stderr
    assert "failed: torch sees no GPU" in (tmp_path / "res" / "summary.txt").read_text()


def test_out_from_environment_and_a_subset_of_stages(tmp_path: pathlib.Path) -> None:
    out = run("--stages", "e2e", env={"OUT": str(tmp_path)})
    assert out.returncode == 0
    assert (tmp_path / "summary.txt").read_text().split()[0] == "e2e"


def test_a_failed_or_timed_out_stage_does_not_stop_the_others(tmp_path: pathlib.Path) -> None:
    """A stand-in `python` claims CUDA: pytest fails, the kernel table prints, e2e hangs."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
case "$*" in
  *cuda.is_available*) echo True ;;
  *"-m pytest"*) echo "1 failed"; exit 3 ;;
  *kernel_bench.py*) echo "bandwidth table"; exit 0 ;;
  *e2e.py*) sleep 60 ;;
  *) exec {sys.executable} "$@" ;;
esac
""")
    fake.chmod(0o755)
    res = tmp_path / "res"
    start = time.monotonic()
    out = run("--out", str(res), env={"PYTHON": str(fake), "GPU_CHECK_TIMEOUT_E2E": "1"})
    assert time.monotonic() - start < 50
    assert out.returncode == 1, out.stdout + out.stderr
    status = {line.split()[0]: line for line in (res / "summary.txt").read_text().splitlines()}
    assert "failed: exit 3" in status["tests"]
    assert "passed" in status["kernels"]
    assert "failed: timed out after 1s" in status["e2e"]
    assert (res / "kernels.log").read_text() == "bandwidth table\n"
    assert "1 failed" in (res / "tests.log").read_text()
    assert "python" in (res / "env.txt").read_text()


@pytest.mark.slow
def test_e2e_script_runs_on_the_cpu(tmp_path: pathlib.Path) -> None:
    """The e2e stage's script on a tiny model with --device cpu, so it cannot rot unseen
    before a GPU run: every peer runs, and the JSON holds their rates."""
    from tests.tiny_models import make_checkpoint

    model = make_checkpoint("mistral", tmp_path)
    report = tmp_path / "e2e.json"
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu" / "e2e.py"), "--device", "cpu",
         "--model", str(model), "--requests", "2", "--prompt-len", "8", "--output-len", "8",
         "--kv-memory", "16MiB", "--json", str(report)],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(report.read_text())
    assert len(result["peers"]) == 3
    assert all(peer["tok_per_s"] > 0 for peer in result["peers"].values()), result
    assert 0 <= result["identical_to_static"] <= 2
