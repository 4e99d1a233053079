"""Which CPU this is, and which variant of each CPU kernel it runs.

The CPU kernels (`kernels/csrc`) are compiled once per variant with explicit target flags
(`kernels.cpu_build`), never with ``-march=native`` alone, so one machine can build and
test every variant its CPU can execute, and a container moved between machines picks the
variant of the machine it lands on:

    portable      plain C++ with GCC vector types, no x86 intrinsics (any CPU, aarch64 too)
    avx2          the same source for x86-64-v3: AVX2 + FMA + F16C
    avx512        the same source for AVX-512 F/BW/VL/DQ (16 floats a vector)
    avx512_bf16   avx512, plus the dpbf16 paths for bf16 activations (AVX512-BF16) and VNNI

A CPU class is one of those or ``amx`` (AVX512-BF16 plus AMX tiles: oneDNN's bf16 GEMMs
run on AMX there; our own kernels are the avx512_bf16 variant).

``RINGSERVE_CPU_ISA`` (portable, avx2, avx512, avx512_bf16, amx) caps the class: CI on an
AMX machine tests the AVX2 and portable paths through it, and a user can rule out a path
they distrust. A cap above what the CPU has is ignored with a warning. Below avx512 the cap
also stops the oneDNN-packed bf16 linears (torch refuses them on an AVX2-only CPU) and is
passed to oneDNN as ``ONEDNN_MAX_CPU_ISA`` when that is not set already.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("ringserve.kernels")

ENV = "RINGSERVE_CPU_ISA"
CLASSES = ("portable", "avx2", "avx512", "avx512_bf16", "amx")
VARIANTS = ("portable", "avx2", "avx512", "avx512_bf16")

# The /proc/cpuinfo flags each class needs on top of the class below it.
_NEEDS = {
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    # NOTE: every CPU with AVX512-BF16 has AVX512-VNNI too (Cooper Lake, Sapphire Rapids,
    # Zen 4); its build uses both (int8_tiles.cpp's vpdpwssd).
    "avx512_bf16": {"avx512_bf16", "avx512_vnni"},
    "amx": {"amx_bf16", "amx_tile"},
}

# NOTE: oneDNN's names for the same caps (its documented ONEDNN_MAX_CPU_ISA values).
_ONEDNN = {"portable": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE",
           "avx512_bf16": "AVX512_CORE_BF16", "amx": "AVX512_CORE_AMX"}  # fmt: skip


@dataclass(frozen=True)
class CpuInfo:
    """This machine's CPU as the kernels see it."""

    arch: str  # platform.machine(): x86_64, aarch64, ...
    model: str  # the model name /proc/cpuinfo gives, or ""
    flags: frozenset[str]
    detected: str  # the class the CPU has
    cls: str  # the class in use: `detected`, capped by RINGSERVE_CPU_ISA
    cap: str | None  # the cap asked for, if any

    @property
    def variant(self) -> str:
        """The compiled kernel variant this class runs."""
        return "avx512_bf16" if self.cls == "amx" else self.cls

    def has(self, cls: str) -> bool:
        """Whether the CPU itself has ``cls``'s instructions (its detected class, whatever
        the cap or a test's class in use)."""
        return CLASSES.index(self.detected) >= CLASSES.index(cls)

    def at_least(self, cls: str) -> bool:
        """Whether the class in use includes ``cls``'s instructions."""
        return CLASSES.index(self.cls) >= CLASSES.index(cls)

    def describe(self) -> str:
        """One line for the start-up log."""
        cap = f", capped by {ENV}={self.cap}" if self.cap else ""
        model = f" ({self.model})" if self.model else ""
        return f"CPU class {self.cls}{cap}; detected {self.detected} on {self.arch}{model}"


def _cpuinfo() -> tuple[str, frozenset[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "", frozenset()
    model, flags = "", ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = value
    return model, frozenset(flags.split())


def classify(arch: str, flags: frozenset[str]) -> str:
    """The highest class whose flags (and those of every class below it) are all there."""
    if arch not in ("x86_64", "AMD64", "i686", "i386"):
        return "portable"
    best = "portable"
    for cls in CLASSES[1:]:
        if not _NEEDS[cls] <= flags:
            break
        best = cls
    return best


def parse_cap(value: str | None) -> str | None:
    """``RINGSERVE_CPU_ISA``'s value as a class, None when unset or "native".

    Raises:
        ValueError: an unknown name (naming the variable and the choices).
    """
    if value is None or value.strip().lower() in ("", "native"):
        return None
    name = value.strip().lower().replace("-", "_")
    if name not in CLASSES:
        raise ValueError(f"{ENV}={value!r}: must be one of {', '.join(CLASSES)} or native")
    return name


@functools.cache
def info() -> CpuInfo:
    """This CPU's class, read once per process (the cap from the environment at that time)."""
    arch = platform.machine()
    model, flags = _cpuinfo()
    detected = classify(arch, flags)
    cap = parse_cap(os.environ.get(ENV))
    cls = detected
    if cap is not None:
        if CLASSES.index(cap) > CLASSES.index(detected):
            logger.warning("%s=%s is above this CPU's class (%s): using %s", ENV, cap,
                           detected, detected)  # fmt: skip
        else:
            cls = cap
            if cap != detected:
                os.environ.setdefault("ONEDNN_MAX_CPU_ISA", _ONEDNN[cap])
    return CpuInfo(arch, model, flags, detected, cls, cap)


def runnable_variants() -> list[str]:
    """The kernel variants this process may run: those of its class and every class
    below (what the tests compare). Under a cap, those of the capped class: CI with
    RINGSERVE_CPU_ISA=avx2 on a bigger CPU tests what an AVX2-only machine runs."""
    return list(VARIANTS[: VARIANTS.index(info().variant) + 1])


def onednn_bf16_linear() -> bool:
    """Whether torch's oneDNN-packed bf16 linear may be used: it needs AVX-512 BW/VL/DQ (or
    AVX-NE-CONVERT, which no class here relies on); torch raises a RuntimeError on an
    AVX2-only CPU, and the cap keeps it off below avx512 so that the cap tests that path.
    The CPU itself must have them too: a test runs the AVX-512 kernels emulated on an AVX2
    CPU as if its class were avx512 (`kernels.cpu_build.emulated`)."""
    return info().at_least("avx512") and info().has("avx512")


def bf16_arithmetic() -> bool:
    """Whether bf16 matmuls run in hardware (AVX512-BF16 or AMX), as opposed to emulated."""
    return info().at_least("avx512_bf16")
