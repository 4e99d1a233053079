"""How many threads the CPU path runs: the CPUs this process may use, not the machine's.

torch starts one OpenMP thread per visible core. In a container limited by a CPU quota
(Kubernetes ``limits.cpu: 2`` on a 64-core node) that is 64 threads sharing 2 CPUs' worth
of time: every parallel region waits for threads the kernel has throttled. So the count is
the smallest of
- the CPUs in this process's affinity mask (``taskset``, cpusets, ``docker --cpuset-cpus``),
- the cgroup quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``, the
  tightest along the cgroup's ancestors), rounded down, at least 1,
unless ``RINGSERVE_NUM_THREADS`` (or ``OMP_NUM_THREADS``) says otherwise.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("ringserve.engine")

ENV = "RINGSERVE_NUM_THREADS"


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count and, for the start-up log, where it came from."""

    threads: int
    why: str


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (all of the machine's where it cannot be read)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[tuple[str, Path]]:
    """(version, directory) of this process's cgroup and its ancestors, innermost first."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found: list[tuple[str, Path]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            base, version = root, "v2"
        elif "cpu" in controllers.split(","):
            base, version = root / controllers, "v1"
            if not base.is_dir():
                base = root / "cpu"
        else:
            continue
        rel = Path(path.lstrip("/"))
        chain = [rel, *rel.parents]
        found += [(version, base / p) for p in chain]
    return found


def cgroup_quota(root: Path = Path("/sys/fs/cgroup"),
                 proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (e.g. 2.0), or None without one."""
    quotas: list[float] = []
    for version, directory in _cgroup_dirs(root, proc_cgroup):
        try:
            if version == "v2":
                quota, period = (directory / "cpu.max").read_text().split()[:2]
                if quota != "max":
                    quotas.append(int(quota) / int(period))
            else:
                quota = (directory / "cpu.cfs_quota_us").read_text().strip()
                period = (directory / "cpu.cfs_period_us").read_text().strip()
                if int(quota) > 0:
                    quotas.append(int(quota) / int(period))
        except (OSError, ValueError):
            continue
    return min(quotas) if quotas else None


def choose_threads(env: dict[str, str] | None = None, *, affinity: int | None = None,
                   quota: float | None = None, read_quota: bool = True) -> ThreadChoice:
    """The thread count for this process (see the module's doc).

    Raises:
        ValueError: RINGSERVE_NUM_THREADS is not a positive integer (naming it).
    """
    env = dict(os.environ) if env is None else env
    for name in (ENV, "OMP_NUM_THREADS"):
        value = env.get(name, "").strip()
        if value:
            try:
                threads = int(value.split(",")[0])
            except ValueError:
                threads = 0
            if threads < 1:
                raise ValueError(f"{name}={value!r}: must be a positive integer")
            return ThreadChoice(threads, f"{name}={value}")
    cpus = affinity_cpus() if affinity is None else affinity
    if quota is None and read_quota:
        quota = cgroup_quota()
    if quota is not None and max(1, math.floor(quota)) < cpus:
        threads = max(1, math.floor(quota))
        return ThreadChoice(threads, f"cgroup CPU quota {quota:g} of {cpus} CPUs in the "
                                     "affinity mask")  # fmt: skip
    return ThreadChoice(cpus, f"{cpus} CPUs in the affinity mask" +
                        (f", cgroup quota {quota:g}" if quota is not None else ""))


SPIN_ENV = "RINGSERVE_KERNEL_SPIN"
# How our kernels' threads wait between calls (kernels/csrc/thread_pool.h reads it once).
SPIN_MODES = {
    "auto": "spin while no other process is runnable, else sleep",
    "always": "spin",
    "never": "sleep",
}


def kernel_spin_mode(env: dict[str, str] | None = None) -> str:
    """``RINGSERVE_KERNEL_SPIN`` (default auto), checked.

    Raises:
        ValueError: it is not auto, always or never (naming it).
    """
    env = dict(os.environ) if env is None else env
    mode = env.get(SPIN_ENV, "").strip() or "auto"
    if mode not in SPIN_MODES:
        raise ValueError(f"{SPIN_ENV}={mode!r}: must be one of {', '.join(SPIN_MODES)}")
    return mode


def apply_threads() -> ThreadChoice:
    """Set torch's intra-op thread count from `choose_threads` and log it once.

    Raises:
        ValueError: RINGSERVE_NUM_THREADS or RINGSERVE_KERNEL_SPIN is malformed.
    """
    choice = choose_threads()
    mode = kernel_spin_mode()
    torch.set_num_threads(choice.threads)
    wait = os.environ.get("OMP_WAIT_POLICY") or (
        f"GOMP_SPINCOUNT={os.environ['GOMP_SPINCOUNT']}" if "GOMP_SPINCOUNT" in os.environ
        else "runtime default")  # fmt: skip
    from ringserve.kernels.cpu_build import libgomp_sleeps

    ours = (f"{SPIN_MODES[mode]} ({SPIN_ENV}={mode})" if libgomp_sleeps() else
            "torch's (they spin: torch was loaded before ringserve.engine without "
            "OMP_WAIT_POLICY=PASSIVE)")
    logger.info("threads %d (%s); our kernels' threads: %s; torch's OpenMP threads: %s",
                choice.threads, choice.why, ours, wait)  # fmt: skip
    return choice
