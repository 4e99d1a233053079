"""CPU classes, the RINGSERVE_CPU_ISA cap, the thread count, and what a user sees at start.

The flag sets are the /proc/cpuinfo flags of the three machines this project has run on
(an AVX2-only AMD EPYC, an AMD Zen 4, an Intel Sapphire Rapids), cut to what matters.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib

import pytest
import torch

from ringserve.engine import LLM
from ringserve.engine.cpu_threads import cgroup_quota, choose_threads, kernel_spin_mode
from ringserve.engine.errors import InvalidRequestError
from ringserve.kernels import cpu_build, cpu_isa, cpu_quant
from tests.tiny_models import make_checkpoint

BASE = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}
EPYC_AVX2 = frozenset(BASE)
ZEN4 = frozenset(BASE | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                         "avx512_bf16"})
SPR = frozenset(ZEN4 | {"amx_bf16", "amx_tile", "amx_int8", "avx512_fp16"})
SKYLAKE_X = frozenset(BASE | {"avx512f", "avx512bw", "avx512vl", "avx512dq"})


@pytest.mark.parametrize(("arch", "flags", "cls"), [
    ("x86_64", EPYC_AVX2, "avx2"),
    ("x86_64", SKYLAKE_X, "avx512"),
    ("x86_64", ZEN4, "avx512_bf16"),
    ("x86_64", SPR, "amx"),
    ("x86_64", ZEN4 - {"avx512_vnni"}, "avx512"),  # the bf16 build multiplies with VNNI too
    ("x86_64", frozenset({"sse4_2", "avx"}), "portable"),  # pre-Haswell
    ("x86_64", frozenset(BASE - {"fma"} | {"avx512f"}), "portable"),  # a hole below
    ("aarch64", frozenset({"fp", "asimd", "sve"}), "portable"),
])
def test_classify(arch: str, flags: frozenset[str], cls: str) -> None:
    assert cpu_isa.classify(arch, flags) == cls


@pytest.fixture
def fresh_info(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """`cpu_isa.info()` read anew under the environment a test sets.

    NOTE: a cap sets ONEDNN_MAX_CPU_ISA, which oneDNN reads once per process: the setenv
    makes monkeypatch restore its absence, or every later test would run oneDNN capped."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "unset")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    cpu_isa.info.cache_clear()
    yield monkeypatch
    cpu_isa.info.cache_clear()


def test_cap_lowers_the_class(fresh_info: pytest.MonkeyPatch) -> None:
    detected = cpu_isa.info().detected
    fresh_info.setenv(cpu_isa.ENV, "AVX2")
    cpu_isa.info.cache_clear()
    info = cpu_isa.info()
    if detected in ("portable",):
        assert info.cls == "portable"  # a cap above the CPU is ignored
        return
    assert (info.cls, info.variant, info.cap, info.detected) == ("avx2", "avx2", "avx2", detected)
    assert cpu_isa.runnable_variants() == ["portable", "avx2"]
    assert not cpu_isa.onednn_bf16_linear() and not cpu_isa.bf16_arithmetic()
    assert "CPU class avx2, capped by RINGSERVE_CPU_ISA=avx2" in info.describe()
    if detected != "avx2":
        assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"


def test_cap_above_the_cpu_is_ignored(fresh_info: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    fresh_info.setattr(cpu_isa, "_cpuinfo", lambda: ("an old CPU", EPYC_AVX2))
    fresh_info.setattr(cpu_isa.platform, "machine", lambda: "x86_64")
    fresh_info.setenv(cpu_isa.ENV, "amx")
    with caplog.at_level(logging.WARNING, logger="ringserve.kernels"):
        info = cpu_isa.info()
    assert info.cls == info.detected == "avx2"
    assert "above this CPU's class" in caplog.text


@pytest.mark.parametrize("value", ["avx3", "sse", "1"])
def test_a_bad_cap_names_the_variable(value: str) -> None:
    with pytest.raises(ValueError, match="RINGSERVE_CPU_ISA"):
        cpu_isa.parse_cap(value)
    assert cpu_isa.parse_cap("native") is None and cpu_isa.parse_cap(None) is None


def test_engine_refuses_a_bad_cap(fresh_info: pytest.MonkeyPatch,
                                  tmp_path: pathlib.Path) -> None:
    fresh_info.setenv(cpu_isa.ENV, "avx1024")
    path = make_checkpoint("mistral", tmp_path)
    with pytest.raises(InvalidRequestError, match="RINGSERVE_CPU_ISA") as err:
        LLM(str(path), kv_cache_memory="4MiB", max_model_len=64)
    assert err.value.param == "environment"


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


# -- threads ------------------------------------------------------------------------------

def _cgroup(tmp_path: pathlib.Path, v2: str | None = None,
            v1: tuple[str, str] | None = None) -> tuple[pathlib.Path, pathlib.Path]:
    root = tmp_path / "cgroup"
    proc = tmp_path / "proc-self-cgroup"
    if v2 is not None:
        leaf = root / "kubepods" / "pod1"
        leaf.mkdir(parents=True)
        (leaf / "cpu.max").write_text(v2)
        (root / "kubepods" / "cpu.max").write_text("max 100000\n")
        proc.write_text("0::/kubepods/pod1\n")
    else:
        assert v1 is not None
        leaf = root / "cpu,cpuacct" / "docker" / "abc"
        leaf.mkdir(parents=True)
        (leaf / "cpu.cfs_quota_us").write_text(v1[0])
        (leaf / "cpu.cfs_period_us").write_text(v1[1])
        proc.write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
    return root, proc


def test_cgroup_v2_quota(tmp_path: pathlib.Path) -> None:
    root, proc = _cgroup(tmp_path, v2="200000 100000\n")
    assert cgroup_quota(root, proc) == 2.0
    root, proc = _cgroup(tmp_path / "b", v2="max 100000\n")
    assert cgroup_quota(root, proc) is None


def test_cgroup_v1_quota(tmp_path: pathlib.Path) -> None:
    root, proc = _cgroup(tmp_path, v1=("150000", "100000"))
    assert cgroup_quota(root, proc) == 1.5
    root, proc = _cgroup(tmp_path / "b", v1=("-1", "100000"))
    assert cgroup_quota(root, proc) is None


def test_threads_follow_quota_affinity_and_override() -> None:
    # Kubernetes limits.cpu: 2 on a 64-core node
    assert choose_threads({}, affinity=64, quota=2.0).threads == 2
    assert choose_threads({}, affinity=64, quota=2.5).threads == 2  # rounded down
    assert choose_threads({}, affinity=64, quota=0.5).threads == 1  # at least one
    assert choose_threads({}, affinity=3, quota=8.0).threads == 3  # taskset 0-2
    assert choose_threads({}, affinity=4, quota=None, read_quota=False).threads == 4
    forced = choose_threads({"RINGSERVE_NUM_THREADS": "5"}, affinity=2, quota=1.0)
    assert forced.threads == 5 and "RINGSERVE_NUM_THREADS" in forced.why
    assert choose_threads({"OMP_NUM_THREADS": "3"}, affinity=64, quota=2.0).threads == 3
    with pytest.raises(ValueError, match="RINGSERVE_NUM_THREADS"):
        choose_threads({"RINGSERVE_NUM_THREADS": "0"}, affinity=2)


def test_kernel_spin_mode_is_checked() -> None:
    assert kernel_spin_mode({}) == "auto"
    assert kernel_spin_mode({"RINGSERVE_KERNEL_SPIN": " never "}) == "never"
    with pytest.raises(ValueError, match="RINGSERVE_KERNEL_SPIN='sometimes'"):
        kernel_spin_mode({"RINGSERVE_KERNEL_SPIN": "sometimes"})


def test_start_up_log_names_class_kernels_and_threads(
        tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In a container with a 2-CPU quota on a bigger machine the log shows 2 threads."""
    from ringserve.engine import cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("RINGSERVE_NUM_THREADS", raising=False)
    monkeypatch.delenv("RINGSERVE_KERNEL_SPIN", raising=False)
    monkeypatch.setattr(cpu_threads, "affinity_cpus", lambda: 64)
    monkeypatch.setattr(cpu_threads, "cgroup_quota", lambda: 2.0)
    before = torch.get_num_threads()
    path = make_checkpoint("gemma3_text", tmp_path)
    try:
        with caplog.at_level(logging.INFO, logger="ringserve.engine"):
            LLM(str(path), kv_cache_memory="4MiB", max_model_len=64, quantization="int8")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    text = caplog.text
    assert "threads 2 (cgroup CPU quota 2 of 64 CPUs in the affinity mask)" in text
    assert "our kernels' threads: spin while no other process is runnable" in text
    assert f"CPU class {cpu_isa.info().cls}" in text
    assert f"{cpu_isa.info().variant} kernels" in text
    # dtype auto: bf16 by dpbf16 with bf16 arithmetic, int16 activations where the build has
    # the SIMD dot, float32 FMA on the portable build
    path_taken = {"avx2": "int8 int16-activation dot", "avx512": "int8 int16-activation dot",
                  "portable": "int8 float32 FMA"}.get(cpu_isa.info().cls, "int8 dpbf16")
    assert f"linears: 17 {path_taken}" in text


# -- every dtype and quantization either serves or is refused by name ---------------------

@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16", "float16"])
@pytest.mark.parametrize("quantization", ["auto", "none", "int8", "int4", "gguf"])
def test_no_runtime_error_from_any_option(tmp_path_factory: pytest.TempPathFactory,
                                          cpu_variant: str, dtype: str,
                                          quantization: str) -> None:
    from ringserve.engine import SamplingParams

    path = make_checkpoint("gemma3_text", tmp_path_factory.mktemp("ckpt"))
    try:
        llm = LLM(str(path), dtype=dtype, quantization=quantization, kv_cache_memory="4MiB",
                  max_model_len=64)
    except InvalidRequestError as err:
        assert quantization == "gguf" and err.param == "quantization"  # no GGUF blocks here
        return
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=6, temperature=0,
                                                       ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6


# -- a bf16 KV cache under float32 activations -------------------------------------------

def test_bf16_kv_cache_under_a_float32_model(tmp_path: pathlib.Path) -> None:
    """Twice the blocks in the same memory, and the served logits as close to the float32
    cache's as bf16 rounding of K and V allows (teacher-forced past the window)."""
    from ringserve.engine import SamplingParams

    path = make_checkpoint("gemma3_text", tmp_path)
    kw = {"dtype": "float32", "kv_cache_memory": "4MiB", "max_model_len": 160}
    exact = LLM(str(path), **kw)
    half = LLM(str(path), kv_cache_dtype="bfloat16", **kw)
    assert exact.engine.kv_dtype == torch.float32 and half.engine.kv_dtype == torch.bfloat16
    assert half.engine.kv.pool.num_blocks == 2 * exact.engine.kv.pool.num_blocks
    prompt = list(range(3, 120))
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=1)
    a = exact.generate([prompt], params)[0].outputs[0]
    b = half.generate([prompt], params)[0].outputs[0]
    same = sum(x == y for x, y in zip(a.token_ids, b.token_ids, strict=True))
    assert same >= 16, (a.token_ids, b.token_ids)
    first = [out.logprobs[0].logprob for out in (a, b)]
    assert abs(first[0] - first[1]) < 0.05, first


@pytest.mark.parametrize(("dtype", "kv", "ok"), [
    ("float32", "auto", True), ("bfloat16", "bfloat16", True), ("float32", "bf16", True),
    ("bfloat16", "float32", False), ("float32", "float16", False), ("float32", "fp8", False),
])
def test_kv_cache_dtype_serves_or_is_refused_by_name(tmp_path: pathlib.Path, dtype: str,
                                                     kv: str, ok: bool) -> None:
    path = make_checkpoint("mistral", tmp_path)
    kw = {"dtype": dtype, "kv_cache_dtype": kv, "kv_cache_memory": "4MiB",
          "max_model_len": 64}
    if ok:
        LLM(str(path), **kw)
        return
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype") as err:
        LLM(str(path), **kw)
    assert err.value.param == "kv_cache_dtype"
