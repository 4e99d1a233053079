"""The process's memory, planned once at start-up: weights, their copies, the KV pool and a
workspace, against one budget (docs/design.md §12).

    budget = pick_budget(config.memory_budget)        # what the machine or cgroup has
    check_fits(estimate_weights(folder), budget, ...)  # before anything is loaded
    with loading_allocations():                        # each big tensor back to the OS
        model = load_model(...)                        # when it is freed
    plan = MemoryPlan(budget, weights=..., copies=..., workspace=..., kv=...)
    logger.info("%s", plan.describe())                 # and /metrics: ringserve:memory_*
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import math
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ringserve.block_manager.budget import parse_size

MiB = 2**20
GiB = 2**30
# "auto": the share of the memory this process may take (the machine's available memory,
# or what its cgroup leaves) that the plan spends, as vLLM's --gpu-memory-utilization 0.9
AUTO_SHARE = 0.9
# glibc's mallopt parameter and the thresholds (docs/design.md §12)
_M_MMAP_THRESHOLD = -3
LOADING_MMAP_THRESHOLD = 256 * 1024
SERVING_MMAP_THRESHOLD = 32 * MiB  # glibc's own ceiling for its dynamic threshold


def available_memory() -> int | None:
    """Bytes this process may still take: the machine's MemAvailable, less where a cgroup
    (v2) limit leaves less; None where /proc cannot say."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        free = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            free = min(free, int(limit) - used)
    except (OSError, ValueError):
        pass
    return free


def resident_bytes() -> int:
    """This process's resident memory now (VmRSS), 0 where /proc cannot say."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    found = re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE)
    return int(found.group(1)) * 1024 if found else 0


def pick_budget(value: str | int | float | None) -> tuple[int | None, str]:
    """``memory_budget``: (bytes the process may hold, or None where nothing can say; why).

    None or "auto": AUTO_SHARE of what this process holds now plus what the machine (or
    its cgroup) still has available; a fraction in (0, 1]: that share of it; a size
    ("20GiB", bytes): that many bytes.

    Raises:
        ValueError: naming ``memory_budget``, for anything else.
    """
    text = "auto" if value is None else str(value).strip()
    share = None
    if text == "auto":
        share = AUTO_SHARE
    else:
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if 0 < number <= 1:
            share = number
        elif not math.isnan(number) or text[-1:].isalpha():
            try:
                size = parse_size(text)
            except ValueError as err:
                raise ValueError(f"memory_budget: {err}") from None
            if size <= 0:
                raise ValueError(f"memory_budget must be positive; got {value!r}")
            return size, "set"
        else:
            raise ValueError(f"memory_budget must be 'auto', a share in (0, 1] or a size "
                             f"such as 20GiB; got {value!r}")
    free = available_memory()
    if free is None:
        return None, "unknown: /proc/meminfo cannot be read"
    have = free + resident_bytes()
    return int(share * have), (f"{share:.0%} of {have / GiB:.1f} GiB (this process's "
                               "memory plus what the machine or its cgroup has available)")


def _libc() -> Any | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt, libc.malloc_trim  # noqa: B018 (glibc's, not musl's)
    except (OSError, AttributeError):
        return None
    return libc


@contextlib.contextmanager
def loading_allocations() -> Iterator[None]:
    """While loading, every allocation of LOADING_MMAP_THRESHOLD bytes or more is a mapping
    of its own, which goes back to the OS when freed; then what the heap holds free goes
    back too (malloc_trim), and the threshold is set to SERVING_MMAP_THRESHOLD.

    Why: glibc raises its threshold each time a mapped block is freed, so after the first
    freed tensor a load's temporaries (each tensor read, each fused or converted one, every
    original moved into the huge-page arena) came from the heap, where freed memory stays
    this process's: a 4-layer gpt-oss-20b held 13.4 GB serving 9.5 GB of it.
    No-op where the C library is not glibc.
    """
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, LOADING_MMAP_THRESHOLD)
    try:
        yield
    finally:
        if libc is not None:
            libc.malloc_trim(0)
            libc.mallopt(_M_MMAP_THRESHOLD, SERVING_MMAP_THRESHOLD)


@dataclass(frozen=True)
class MemoryPlan:
    """What the engine process holds, decided once at start-up, in bytes."""

    budget: int | None  # what it may hold (None: unknown)
    weights: int  # the weights as served (their stored bytes, or the format they became)
    copies: int  # copies beside them (packed rows, the greedy head's, oneDNN's)
    kv: int  # the KV pool
    workspace: int  # the runtime (interpreter, libraries) and a step's activations

    @property
    def total(self) -> int:
        return self.weights + self.copies + self.kv + self.workspace

    def as_dict(self) -> dict[str, int]:
        out = {k: v for k, v in asdict(self).items() if v is not None}
        out["total"] = self.total
        return out

    def describe(self) -> str:
        budget = "unknown" if self.budget is None else f"{self.budget / GiB:.2f} GiB"
        return (f"memory plan: weights {self.weights / GiB:.2f} GiB + copies "
                f"{self.copies / GiB:.2f} GiB + KV {self.kv / GiB:.2f} GiB + workspace "
                f"{self.workspace / GiB:.2f} GiB = {self.total / GiB:.2f} GiB of a budget of "
                f"{budget}")


_STORED_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                 "I8": 1, "U8": 1, "BOOL": 1}


def estimate_weights(stored: dict[str, tuple[str, tuple[int, ...]]], *, act_bytes: int,
                     keeps_bf16: bool, quantization: str, gguf_blocks: int = 0,
                     mxfp4_native: bool = True) -> int:
    """The bytes the weights will take once loaded, from the checkpoint's headers alone
    (nothing loaded), for the refusal of a model that cannot fit.

    Args:
        stored: name -> (safetensors dtype, shape) (`checkpoint.stored_tensors`).
        act_bytes: bytes of the activations' dtype (float tensors are held in it).
        keeps_bf16: whether bf16 matrices stay bf16 under wider activations
            (`build._keep_stored_bf16`).
        mxfp4_native: whether MXFP4 blocks are served as stored (a CPU with its kernels
            built), else widened to the activations' dtype.
        quantization: the method that runs; "int8" / "int4" hold a matrix at ~1.06 / ~0.63
            bytes a value, "gguf" the folder's repacked blocks (``gguf_blocks`` bytes) in
            place of its matrices.
    """
    total = 0
    for name, (kind, shape) in stored.items():
        count = math.prod(shape)
        if name.endswith(("_blocks", "_scales")) and kind == "U8":  # MXFP4
            widened = 2 * act_bytes * count if name.endswith("_blocks") else 0
            total += count if mxfp4_native else widened
        elif kind in ("F32", "F16", "BF16", "F64") and len(shape) == 2 and quantization in (
                "int8", "int4", "gguf"):
            total += {"int8": count * 34 // 32, "int4": count * 20 // 32, "gguf": 0}[quantization]
        elif kind == "BF16" and len(shape) == 2 and keeps_bf16:
            total += 2 * count
        elif kind in ("F32", "F16", "BF16", "F64"):
            total += act_bytes * count
        else:
            total += _STORED_BYTES.get(kind, 4) * count
    return total + gguf_blocks


def step_activations(*, tokens: int, rows: int, hidden: int, intermediate: int, qkv: int,
                     vocab: int, act_bytes: int) -> int:
    """A rough upper bound on one step's temporaries: ``tokens`` rows through the widest
    layer (the MLP's gate and up projections, their product, the attention's q/k/v) a few
    at a time, and the float32 logits of ``rows`` sampled rows (twice: logits and their
    softmax)."""
    per_token = (3 * intermediate + qkv + 6 * hidden) * act_bytes
    return tokens * per_token + 2 * rows * vocab * 4
