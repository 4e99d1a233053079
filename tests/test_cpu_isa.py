"""CPU classes, the RINGSERVE_CPU_ISA cap, the thread count, and what a user sees at start.

The flag sets are the /proc/cpuinfo flags of the three machines this project has run on
(an AVX2-only AMD EPYC, an AMD Zen 4, an Intel Sapphire Rapids), cut to what matters.
"""

from __future__ import annotations

import logging
import os
import pathlib

import pytest
import torch

from ringserve.engine import LLM
from ringserve.engine.cpu_threads import cgroup_quota, choose_threads, kernel_spin_mode
from ringserve.engine.errors import InvalidRequestError
from ringserve.kernels import cpu_isa
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
