"""Build the CPU kernels (`kernels/csrc/*.cpp`) with the machine's own C++ compiler, once.

The build (about 15-60 s) lands in torch's extension cache (TORCH_EXTENSIONS_DIR), keyed by
the sources, the flags and this CPU's features, and is loaded from there afterwards. Where
it cannot be built (no compiler, no ninja) or RINGSERVE_CPU_KERNELS=0 is set, `available()`
is False and every caller keeps its torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger("ringserve.kernels")

_SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
_lock = threading.Lock()
_state: dict[str, bool] = {}


def _cpu_tag() -> str:
    """A short hash of this CPU's feature flags: a build made for another CPU is not reused."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), "")  # fmt: skip
    except OSError:
        flags = ""
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def available() -> bool:
    """Whether the compiled CPU ops (`torch.ops.ringserve.*`) are loaded; builds them once."""
    if "ok" in _state:
        return _state["ok"]
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _build()
    return _state["ok"]


def _build() -> bool:
    if os.environ.get("RINGSERVE_CPU_KERNELS", "1") == "0":
        logger.info("CPU kernels off (RINGSERVE_CPU_KERNELS=0): torch paths")
        return False
    logger.info("loading the CPU kernels (built once per machine and source: 15-60 s)")
    try:
        from torch.utils.cpp_extension import load

        # NOTE: -fopenmp so ATen's inline parallel_for really runs in parallel; the OpenMP
        # calls resolve to torch's own runtime when the library loads.
        load(name=f"ringserve_cpu_{_cpu_tag()}", sources=[str(p) for p in _SOURCES],
             extra_cflags=["-O3", "-march=native", "-fopenmp"], is_python_module=False,
             verbose=False)  # fmt: skip
    except Exception as err:  # no compiler, no ninja, a build error: serve with torch
        lines = str(err).strip().splitlines()
        logger.warning("CPU kernels unavailable, using the torch paths: %s",
                       lines[-1] if lines else repr(err))
        return False
    return True
