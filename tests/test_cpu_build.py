"""The CPU kernels' builds (`kernels.cpu_build`): one library per variant, keyed by what
makes it, the torch headers precompiled with torch's own flags, the AVX-512 variants
compiled at their real flags and run in software where this CPU lacks them."""

from __future__ import annotations

import dataclasses
import os
import pathlib

import pytest

from ringserve.kernels import cpu_build, cpu_isa, cpu_quant

# -- the kernels of each variant are separate builds -----------------------------------

def test_variants_are_separate_libraries(cpu_variant: str) -> None:
    """One op namespace per variant; the vector width is the variant's own, not the
    machine's (an avx2 build on an AVX-512 CPU still multiplies 8 floats at a time)."""
    width = int(cpu_build.ops(cpu_variant).compact_vector_width())
    assert width == (16 if cpu_variant.startswith("avx512") else 8)
    assert bool(cpu_build.ops(cpu_variant).quant_linear_supported()) == (
        cpu_variant == "avx512_bf16")
    assert cpu_build.FLAGS["portable"] == []  # no target flags: the compiler's default ISA


def test_the_build_key_follows_the_sources_not_their_path(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same files at another path are the same build; a changed header, another variant
    or another CPU model (-mtune=native reads it) are another."""
    import shutil

    variant = cpu_isa.info().variant
    key = cpu_build.build_key(variant)
    copy = tmp_path / "elsewhere" / "csrc"
    shutil.copytree(cpu_build._CSRC, copy)
    monkeypatch.setattr(cpu_build, "_CSRC", copy)
    assert cpu_build.build_key(variant) == key
    header = sorted(copy.glob("*.h"))[0]
    original = header.read_bytes()
    header.write_bytes(original + b"\n")
    assert cpu_build.build_key(variant) != key
    header.write_bytes(original)
    assert cpu_build.build_key(variant) == key
    if variant != "portable":
        assert cpu_build.build_key("portable") != key
    real = cpu_isa.info()
    monkeypatch.setattr(cpu_isa, "info", lambda: dataclasses.replace(real, model="other CPU"))
    assert cpu_build.build_key(variant) != key


def test_a_copy_of_the_package_elsewhere_loads_the_same_build(tmp_path: pathlib.Path) -> None:
    """A clone at another path, or a wheel installed elsewhere, finds the library this
    process built and loads it as it is: ninja builds from the build folder's own copy of
    the sources, so nothing in its commands names where they came from."""
    import shutil
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    variant = cpu_isa.info().variant
    assert cpu_build.available(variant)
    library = cpu_build.build_dir(variant) / f"ringserve_{variant}.so"
    built = library.stat().st_mtime_ns
    shutil.copytree(root / "ringserve", tmp_path / "ringserve",
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run(
        [sys.executable, "-c", "from ringserve.kernels import cpu_build as b, cpu_isa as i; "
         "v = i.info().variant; print(b.__file__); print(b.build_dir(v)); print(b.available(v))"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True, text=True, check=True, timeout=600).stdout.split()
    assert out[0].startswith(str(tmp_path)), out
    assert out[1:] == [str(cpu_build.build_dir(variant)), "True"]
    assert library.stat().st_mtime_ns == built, "the copy rebuilt the library"


# The variants this process cannot run: AVX-512 ones on an AVX2 machine (none on an AMX
# machine without a cap, where every variant is built and tested for real; x86-64 only).
_NOT_RUN_HERE = [v for v in cpu_build.FLAGS
                 if v not in cpu_isa.runnable_variants() and cpu_isa.info().arch == "x86_64"]
# NOTE: where both AVX-512 variants also run emulated, the largest alone goes through the
# front end (~30 s): its flags hold the other's, and the emulated avx512 build compiles the
# few branches only it takes (no VNNI, no BF16).
_FRONT_END = (_NOT_RUN_HERE[-1:] if set(_NOT_RUN_HERE) <= set(cpu_build.emulated_variants())
              else _NOT_RUN_HERE)


def _torch_flags(variant: str) -> list[str]:
    """The flags torch's extension build gave each source of ``variant`` (its build.ninja)."""
    import shlex

    assert cpu_build.available(variant)
    ninja = (cpu_build.build_dir(variant) / "build.ninja").read_text()
    (line,) = [ln for ln in ninja.splitlines() if ln.startswith("cflags = ")]
    return shlex.split(line.removeprefix("cflags = "))


@pytest.mark.parametrize("variant", [cpu_isa.info().variant, *cpu_build.emulated_variants()])
def test_the_precompiled_headers_are_built_with_torchs_flags(variant: str) -> None:
    """The torch headers are precompiled before torch's build runs, with flags of our own
    making (`cpu_build.header_flags`); the compiler takes a precompiled header only where
    they are the flags each source gets, and otherwise parses the header in every source
    (a build ~20 s slower here, nothing else). So they must be torch's, with one of the
    standards precompiled, and the -include of the header after them. (An emulated build's
    header reads the emulation too.)"""
    flags = _torch_flags(variant)
    (std,) = [f.removeprefix("-std=") for f in flags if f.startswith("-std=")]
    assert std in cpu_build._STANDARDS
    header = cpu_build.build_dir(variant) / "src" / "torch_headers.h"
    after = (["-include", str(header.with_name("emulate_avx512_macros.h"))]
             if cpu_build.emulated(variant) else [])
    assert flags == [*cpu_build.header_flags(variant, std), "-include", str(header), *after]
    assert "#include <torch/library.h>" in header.read_text()
    assert ('#include "emulate_avx512.h"' in header.read_text()) == cpu_build.emulated(variant)


def _front_end_errors(variants: list[str], tmp_path: pathlib.Path) -> list[str]:
    """Each source of each variant through the compiler's front end (types, template
    instantiation, the intrinsics' signatures; no code generated) at the variant's flags
    and the standard torch's build uses here; the compiler's output where it failed."""
    import subprocess

    native = cpu_isa.info().variant
    (std,) = [f.removeprefix("-std=") for f in _torch_flags(native) if f.startswith("-std=")]
    cxx = os.environ.get("CXX", "c++")
    sources = sorted(cpu_build._CSRC.glob("*.cpp"))
    assert len(sources) > 10
    jobs: list[tuple[str, list[str]]] = []
    for variant in variants:
        # NOTE: the torch headers once a variant, precompiled, as in the real build.
        header = tmp_path / variant / "torch_headers.h"
        header.parent.mkdir()
        header.write_text(cpu_build._TORCH_HEADERS)
        cpu_build._precompile(variant, header, header.with_name(header.name + ".gch"), (std,),
                              native=True)
        jobs += [(f"{variant} {src.name}",
                  [cxx, *cpu_build.header_flags(variant, std, native=True), "-include", str(header),
                   "-Winvalid-pch", "-fsyntax-only", str(src)]) for src in sources]
    width = max(1, len(os.sched_getaffinity(0)))
    failed = []
    for start in range(0, len(jobs), width):
        procs = [(name, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         text=True)) for name, cmd in jobs[start:start + width]]
        for name, proc in procs:
            out, _ = proc.communicate(timeout=600)
            if proc.returncode != 0:
                failed.append(f"{name}:\n{out[-3000:]}")
    return failed


# NOTE: defined only where some variant cannot run: elsewhere every variant's library is
# built and tested for real (the cpu_variant fixture), and a skip would name no missing
# feature.
if _NOT_RUN_HERE:
    def test_the_variants_this_cpu_cannot_run_still_compile(tmp_path: pathlib.Path) -> None:
        """On an AVX2 machine the AVX-512 code (``#if __AVX512F__`` branches in most
        sources) runs only emulated (`cpu_build.emulated`: SIMDe's types and functions
        for the intrinsics, no inline assembly), so an edit there that GCC's own AVX-512
        headers refuse would pass CI here and break every AVX-512 and AMX machine: each
        source of those variants goes through the compiler's front end at their real
        flags here."""
        failed = _front_end_errors(_FRONT_END, tmp_path)
        assert not failed, "\n".join(failed)


def test_the_avx512_variants_this_cpu_lacks_run_emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below AVX-512 (x86-64, no cap) the tests run the AVX-512 variants in software
    (conftest's `cpu_variant` over `cpu_build.tested_variants`): SIMDe's headers must be
    there (the Makefile installs libsimde-dev), or those branches would only be compiled;
    the library built is the AVX-512 code (its one-byte tiles exist only there); and as
    that class, oneDNN's packing still follows the real CPU."""
    cpu = cpu_isa.info()
    lacking = [v for v in ("avx512", "avx512_bf16")
               if cpu.arch == "x86_64" and not cpu.has(v)]
    assert cpu_build.emulated_variants() == (lacking if cpu.cap is None else [])
    for variant in cpu_build.emulated_variants():
        assert cpu_build.emulated(variant) and cpu_build.available(variant)
        assert cpu_quant.has_int8_tiles(variant)
        monkeypatch.setattr(cpu_isa, "info", lambda v=variant: dataclasses.replace(cpu, cls=v))
        assert cpu_isa.onednn_bf16_linear() == cpu.has("avx512")
