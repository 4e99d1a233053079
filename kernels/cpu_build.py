"""Build the CPU kernels (`kernels/csrc/*.cpp`) with the machine's own C++ compiler, once per
variant.

Each variant (`kernels.cpu_isa`) is one library compiled from the same sources with
explicit target flags and its own op namespace, ``torch.ops.ringserve_<variant>``, so
several variants load side by side in one process (tests compare them). The process serves
with the variant of its CPU class; `ops()` returns that namespace.

A build (torch's extension build, the torch headers precompiled once: 10-60 s, ~60 on a
2-core AVX2 VM) lands in torch's extension cache (TORCH_EXTENSIONS_DIR) under a folder named
by what makes the library (`build_key`: the sources, the flags, the compiler, torch, the CPU
model), and later starts load it from there without running the build again, whichever copy
of the sources they run: a clone at another path or a wheel installed elsewhere finds the
same build. Where it cannot be built (no compiler, no ninja) or RINGSERVE_CPU_KERNELS=0 is
set, `available()` is False and every caller keeps its torch path.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ringserve.kernels import cpu_isa

logger = logging.getLogger("ringserve.kernels")

# NOTE: the sources include <ATen/core/Tensor.h> and the op headers they call, not
# <ATen/ATen.h>: parsing the latter took ~9 s of each source's 8-14 (Zen 3), and a variant's
# build went from 86 to 73 s without it (two jobs). torch/library.h, ~6 s, is the floor.
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = sorted(_CSRC.glob("*.cpp"))
_lock = threading.Lock()
_state: dict[str, bool] = {}

# NOTE: explicit targets, not -march=native: a build for one variant runs on every CPU of
# that class, and a bigger CPU can build (and test) the smaller variants. x86-64-v3 is
# AVX2 + FMA + F16C (+ BMI/LZCNT/MOVBE); "portable" is the compiler's default target (SSE2 on
# x86-64, the base ISA on aarch64), which our code reaches through GCC vector types only.
_X86_V3 = ["-mavx", "-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-mlzcnt"]
_AVX512 = [*_X86_V3, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
FLAGS: dict[str, list[str]] = {
    "portable": [],
    "avx2": _X86_V3,
    "avx512": _AVX512,
    "avx512_bf16": [*_AVX512, "-mavx512bf16", "-mavx512vnni"],
}
# NOTE: -mtune=native picks the machine's cost model (unrolling, vector widths of the loops
# the compiler vectorises itself), never its instructions. With generic tuning the norms'
# and attention's float32 sums ran in another order than the -march=native builds before,
# and greedy gemma-3-270m parted at a near-tie (README's "... named Mary" became "... a man
# named John"); with it the outputs are those of before.
_TUNE = ["-mtune=native"]


# The AVX-512 variants in software, for a CPU below them (x86-64-v3 code that reads csrc's
# emulate_avx512.h after the torch headers): what the tests run on an AVX2 machine so that
# the AVX-512 branches execute on every CI run, not only on AVX-512 machines. SIMDe
# (Debian's libsimde-dev, which the Makefile installs) gives most intrinsics.
_EMULATED = {"avx512": ["-DRINGSERVE_EMULATE_AVX512"],
             "avx512_bf16": ["-DRINGSERVE_EMULATE_AVX512", "-DRINGSERVE_EMULATE_BF16"]}
_EMULATION_HEADER = "emulate_avx512.h"
_EMULATION_MACROS = "emulate_avx512_macros.h"
_SIMDE = "simde/x86/avx512.h"


def emulated(variant: str) -> bool:
    """Whether ``variant``'s library is the software AVX-512 build: an AVX-512 variant above
    this x86-64 CPU's own class. Only tests ask for one; a server runs its class's variant."""
    cpu = cpu_isa.info()
    return variant in _EMULATED and cpu.arch in ("x86_64", "AMD64") and not cpu.has(variant)


def emulated_variants() -> list[str]:
    """The AVX-512 variants the tests run emulated here: those above this x86-64 CPU's
    class, where SIMDe's headers are installed and no RINGSERVE_CPU_ISA cap is set (a cap
    asks for the capped class's variants only)."""
    if cpu_isa.info().cap is not None or not simde_found():
        return []
    return [v for v in _EMULATED if emulated(v)]


def simde_found() -> bool:
    """Whether SIMDe's AVX-512 header is where the compiler looks (CPATH, the system's)."""
    include = [Path(p) for p in os.environ.get("CPATH", "").split(":") if p]
    return any((d / _SIMDE).exists() for d in [*include, Path("/usr/local/include"),
                                               Path("/usr/include")])


def tested_variants() -> list[str]:
    """The variants the tests run here: those this CPU executes, then the emulated ones."""
    return [*cpu_isa.runnable_variants(), *emulated_variants()]


def _flags(variant: str, native: bool = False) -> list[str]:
    """``variant``'s compiler flags: its emulated build's where `emulated`, unless
    ``native`` (the real targets, for a compile that is never run)."""
    if variant != "portable" and platform.machine() not in ("x86_64", "AMD64"):
        raise ValueError(f"kernel variant {variant} is x86-64 only")
    # NOTE: -fopenmp so ATen's inline parallel_for really runs in parallel; the OpenMP
    # calls resolve to torch's own runtime when the library loads.
    tune = _TUNE if platform.machine() in ("x86_64", "AMD64") else []
    isa = [*_X86_V3, *_EMULATED[variant]] if emulated(variant) and not native else FLAGS[variant]
    # NOTE: -O3 for the emulated builds too: -O1 built in 50 s instead of 66, but their
    # tests ran 3.5x longer (SIMDe's 512-bit operations left as loops of lanes).
    return ["-O3", "-fopenmp", *isa, *tune, f"-DRINGSERVE_NS=ringserve_{variant}"]


def build_key(variant: str) -> str:
    """What the library of ``variant`` is made from, hashed: every file of ``csrc`` (headers
    too) by name and content, the flags, the compiler (CXX), the Python and torch it builds
    against (torch's headers and libraries; the folder too, since ninja's commands name it),
    and the CPU model, which ``-mtune=native`` reads. Never the sources' own path."""
    h = hashlib.sha256()
    for path in sorted(_CSRC.iterdir()):
        h.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        h.update(path.read_bytes())
    for part in (*_flags(variant), _TORCH_HEADERS, os.environ.get("CXX", "c++"),
                 platform.machine(), sysconfig.get_paths()["include"], torch.__version__,
                 str(Path(torch.__file__).parent), cpu_isa.info().model):
        h.update(f"{part}\0".encode())
    return h.hexdigest()[:16]


def build_dir(variant: str) -> Path:
    """Where the library of ``variant`` is built from its own copy of the sources: one
    folder per `build_key` in torch's extension cache (TORCH_EXTENSIONS_DIR when set)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    return root / "ringserve" / f"{variant}-{build_key(variant)}"


# A source change makes a new folder; the folders of a variant not loaded the longest past
# this many go (about 4 MiB each).
_KEEP = 8


def _prepare(variant: str) -> Path:
    """The build folder of ``variant`` with the sources copied in (each file written whole
    and renamed into place, so a process beside this one never reads half of one), the
    folder marked as used now, and the variant's least recently used folders past `_KEEP`
    removed."""
    where = build_dir(variant)
    src = where / "src"
    src.mkdir(parents=True, exist_ok=True)
    for path in sorted(_CSRC.iterdir()):
        target, data = src / path.name, path.read_bytes()
        if not target.exists() or target.read_bytes() != data:
            tmp = target.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_bytes(data)
            os.replace(tmp, target)
    (where / "used").touch()

    def last_used(folder: Path) -> float:
        try:
            return (folder / "used").stat().st_mtime
        except OSError:  # not marked yet, or removed meanwhile by another process
            return 0.0

    others = sorted((d for d in where.parent.glob(f"{variant}-*") if d != where), key=last_used)
    for old in others[:max(0, len(others) - (_KEEP - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    return where


def available(variant: str | None = None) -> bool:
    """Whether the compiled CPU ops of ``variant`` (default: this CPU class's) are loaded;
    builds them once."""
    variant = variant or cpu_isa.info().variant
    if variant in _state:
        return _state[variant]
    with _lock:
        if variant not in _state:
            _state[variant] = _build(variant)
    return _state[variant]


def ops(variant: str | None = None) -> Any:
    """``torch.ops.ringserve_<variant>``: the ops of ``variant`` (default: this CPU's).
    Callers check `available()` first."""
    return getattr(torch.ops, f"ringserve_{variant or cpu_isa.info().variant}")


def _build(variant: str) -> bool:
    if os.environ.get("RINGSERVE_CPU_KERNELS", "1") == "0":
        logger.info("CPU kernels off (RINGSERVE_CPU_KERNELS=0): torch paths")
        return False
    logger.info("loading the %s CPU kernels%s (built once per machine and source: 10-60 s)",
                variant, " (AVX-512 in software: tests only)" if emulated(variant) else "")
    try:
        where = _prepare(variant)
        library = where / f"ringserve_{variant}.so"
        if _built(where, library):  # no ninja run (and no compiler needed) once built
            _load_library(library)
        else:
            with _folder_lock(where):
                _compile(variant, where)
    except Exception as err:  # no compiler, no ninja, a build error: serve with torch
        lines = str(err).strip().splitlines()
        logger.warning("%s CPU kernels unavailable, using the torch paths: %s", variant,
                       lines[-1] if lines else repr(err))  # fmt: skip
        return False
    ops(variant).use_kernel_pool(libgomp_sleeps())
    _amx[variant] = bool(ops(variant).use_amx(amx_wanted(variant)))
    return True


_amx: dict[str, bool] = {}


def amx_wanted(variant: str) -> bool:
    """Whether ``variant``'s many-row bf16 multiplies should take AMX tiles: the variant this
    CPU runs, a class (capped or not) of `amx`, and RINGSERVE_AMX not 0."""
    info = cpu_isa.info()
    return (variant == info.variant and info.cls == "amx" and not emulated(variant)
            and os.environ.get("RINGSERVE_AMX", "1") != "0")


def amx(variant: str | None = None) -> bool:
    """Whether ``variant``'s build (default this CPU's) multiplies many rows by AMX tiles."""
    variant = variant or cpu_isa.info().variant
    return available(variant) and _amx.get(variant, False)


def set_amx(on: bool, variant: str | None = None) -> bool:
    """Turn ``variant``'s AMX path on or off (tests compare the two); on only where the CPU
    and the kernel give the tile state. Returns whether it is on."""
    variant = variant or cpu_isa.info().variant
    _amx[variant] = available(variant) and bool(ops(variant).use_amx(on))
    return _amx[variant]


def _built(where: Path, library: Path) -> bool:
    return (where / "built").exists() and library.exists()


def _load_library(library: Path) -> None:
    torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def _folder_lock(where: Path) -> Iterator[None]:
    """One build a folder at a time across processes (the precompiled header is written
    before torch's own lock is taken)."""
    with open(where / "build.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# The torch headers every source includes first (through -include): precompiled once a
# build, they are parsed once instead of once a source.
_TORCH_HEADERS = "#pragma once\n" + "".join(
    f"#include <{h}>\n" for h in ("ATen/core/Tensor.h", "ATen/Parallel.h", "torch/library.h"))


# The C++ standards torch's extension build has used (C++17 to torch 2.10, C++20 since).
_STANDARDS = ("c++20", "c++17")


def header_flags(variant: str, std: str, native: bool = False) -> list[str]:
    """The flags torch's extension build gives each source of ``variant`` (its build.ninja:
    the name, the API define, its include folders, -fPIC, the standard, ours), but for
    the -include of the precompiled headers; ``native``: as `_flags`."""
    from torch.utils.cpp_extension import include_paths

    flags = [f"-DTORCH_EXTENSION_NAME=ringserve_{variant}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    for folder in [*include_paths(), sysconfig.get_paths()["include"]]:
        flags += ["-isystem", folder]
    return [*flags, "-fPIC", f"-std={std}", *_flags(variant, native)]


def _precompile(variant: str, header: Path, gch: Path,
                standards: tuple[str, ...] = _STANDARDS, native: bool = False) -> None:
    """``header`` precompiled for each of ``standards``, side by side in the folder
    ``gch``: the compiler takes the one valid for a source's flags. Where none is (flags
    this function does not know), each source parses the header itself: slower, the same
    library. Measured on the Zen 3 (two jobs): a variant's build 73 -> ~60 s."""
    cxx = os.environ.get("CXX", "c++")
    gch.mkdir(exist_ok=True)
    procs = []
    try:
        for std in standards:
            procs.append(subprocess.Popen(
                [cxx, *header_flags(variant, std, native), "-x", "c++-header", str(header),
                 "-o", str(gch / f"{std}.gch")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for proc in procs:
            proc.wait(timeout=600)
    except (OSError, subprocess.SubprocessError) as err:
        logger.info("precompiled torch headers unavailable (%s): each source parses them",
                    err)  # fmt: skip
        for proc in procs:
            proc.kill()


def _compile(variant: str, where: Path) -> None:
    """Build the library of ``variant`` in ``where`` with torch's extension build and load
    it; mark the folder built. The caller holds the folder's lock."""
    from torch.utils.cpp_extension import load

    library = where / f"ringserve_{variant}.so"
    if _built(where, library):  # another process built it while this one waited
        _load_library(library)
        return
    name = f"ringserve_{variant}"
    header = where / "src" / "torch_headers.h"
    # NOTE: an emulated build's sources read the emulation after the torch headers (it
    # must not change them), precompiled with them (SIMDe is ~1 s of parsing a source),
    # and then its AVX-512 macros, which a precompiled header does not keep.
    emulation = f'#include "{_EMULATION_HEADER}"\n' if emulated(variant) else ""
    header.write_text(_TORCH_HEADERS + emulation)
    gch = header.with_name(header.name + ".gch")
    _precompile(variant, header, gch)
    after = ["-include", str(header.with_name(_EMULATION_MACROS))] if emulation else []
    try:
        # NOTE: built from the copy in the build folder, so that ninja's commands are the
        # same whichever copy of the sources asked (a path in them would rebuild the lot).
        load(name=name, sources=[str(where / "src" / p.name) for p in _SOURCES],
             extra_cflags=[*_flags(variant), "-include", str(header), *after],
             build_directory=str(where),
             is_python_module=False, verbose=False)  # fmt: skip
    finally:
        shutil.rmtree(gch, ignore_errors=True)  # 100s of MiB, needed only while compiling
    (where / "built").write_text(f"{library.name}\n")


def libgomp_sleeps(env: dict[str, str] | None = None) -> bool:
    """Whether torch's OpenMP threads sleep as soon as they wait: libgomp read
    ``OMP_WAIT_POLICY=PASSIVE`` (or ``GOMP_SPINCOUNT=0``) when torch loaded. `engine` sets
    PASSIVE only where it loads torch itself, so the environment says what libgomp saw.

    Where they sleep, our kernels run on their own pool (kernels/csrc/thread_pool.h), whose
    threads spin while the machine is otherwise idle; where libgomp's threads spin, ours
    would spin beside them on the same CPUs, so the kernels run on libgomp's threads.
    """
    env = dict(os.environ) if env is None else env
    spin = env.get("GOMP_SPINCOUNT", "").strip()
    if spin:
        return spin == "0"
    return env.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"
