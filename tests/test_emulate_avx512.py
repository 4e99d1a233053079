"""kernels/csrc/emulate_avx512.h's own intrinsics against references we did not write (torch's
round-to-nearest-even bf16 conversion, numpy's float16 and integer conversions) or that
follow Intel's description step by step (vdpbf16ps: the odd pair, then the even one).

The emulated AVX-512 builds (`kernels.cpu_build.emulated`) are how an AVX2 machine tests the
AVX-512 kernels; the intrinsics SIMDe lacks are ours, and a subtle error in one (truncating
where the hardware rounds, a pair added in the other order) would pass kernel tests whose
tolerances are a bf16 ulp. Here each is compared bit for bit, in a small program built with
the emulation headers alone (no torch), on x86-64 machines with SIMDe installed.
"""

from __future__ import annotations

import os
import pathlib
import platform
import subprocess

import numpy as np
import pytest
import torch

from ringserve.kernels import cpu_build, cpu_isa

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or not cpu_build.simde_found(),
    reason="the emulation needs an x86-64 CPU (AVX2) and SIMDe's headers (libsimde-dev)")

_PROGRAM = r"""
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>

// stdin: n, then n chunks of 64 floats (as bits); stdout: each chunk's results.
int main() {
  int64_t n = 0;
  if (std::fread(&n, sizeof(n), 1, stdin) != 1) return 1;
  std::vector<float> in(64);
  for (int64_t c = 0; c < n; ++c) {
    if (std::fread(in.data(), sizeof(float), 64, stdin) != 64) return 1;
    const __m512 a = _mm512_loadu_ps(in.data()), b = _mm512_loadu_ps(in.data() + 16);
    uint16_t two[32], one[16];
    __m512bh ab = _mm512_cvtne2ps_pbh(a, b);
    std::memcpy(two, &ab, sizeof(two));
    __m256bh a16 = _mm512_cvtneps_pbh(a);
    std::memcpy(one, &a16, sizeof(one));
    std::fwrite(two, sizeof(two), 1, stdout);
    std::fwrite(one, sizeof(one), 1, stdout);
    // acc = in[32:48]; the bf16 pairs: the high halves of in[0:32]'s and in[32:64]'s bits
    __m512bh x, y;
    uint16_t xs[32], ys[32];
    for (int i = 0; i < 32; ++i) {
      uint32_t bx, by;
      std::memcpy(&bx, &in[i], 4);
      std::memcpy(&by, &in[32 + i], 4);
      xs[i] = static_cast<uint16_t>(bx >> 16);
      ys[i] = static_cast<uint16_t>(by >> 16);
    }
    std::memcpy(&x, xs, sizeof(xs));
    std::memcpy(&y, ys, sizeof(ys));
    float dp[16];
    _mm512_storeu_ps(dp, _mm512_dpbf16_ps(_mm512_loadu_ps(in.data() + 32), x, y));
    std::fwrite(dp, sizeof(dp), 1, stdout);
    float sums[2] = {_mm512_reduce_add_ps(a), _mm512_reduce_max_ps(a)};
    std::fwrite(sums, sizeof(sums), 1, stdout);
    // the integer moves over in[48:64]'s bytes
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(in.data() + 48);
    const __m128i b16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
    const __m256i b32 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
    int32_t w[5][16];
    _mm512_storeu_si512(w[0], _mm512_cvtepi8_epi32(b16));
    _mm512_storeu_si512(w[1], _mm512_cvtepu8_epi32(b16));
    _mm512_storeu_si512(w[2], _mm512_cvtepu16_epi32(b32));
    _mm512_storeu_si512(w[3], _mm512_cvtepi8_epi16(b32));
    _mm512_storeu_si512(w[4], _mm512_cvtepu8_epi16(b32));
    std::fwrite(w, sizeof(w), 1, stdout);
    float halves[16];
    _mm512_storeu_ps(halves, _mm512_cvtph_ps(b32));
    std::fwrite(halves, sizeof(halves), 1, stdout);
    float conv[16];
    _mm512_storeu_ps(conv, _mm512_cvtepi32_ps(_mm512_loadu_si512(bytes)));
    std::fwrite(conv, sizeof(conv), 1, stdout);
    int16_t narrow[16];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(narrow),
                        _mm512_cvtepi32_epi16(_mm512_loadu_si512(bytes)));
    std::fwrite(narrow, sizeof(narrow), 1, stdout);
    // masks from the first byte pair; masked lanes of a load read as zero, of a store kept
    __mmask16 k;
    std::memcpy(&k, bytes, 2);
    float loaded[16], stored[16];
    _mm512_storeu_ps(loaded, _mm512_maskz_loadu_ps(k, in.data()));
    std::memcpy(stored, in.data() + 16, sizeof(stored));
    _mm512_mask_storeu_ps(stored, k, a);
    int32_t lo = _mm512_mask_reduce_min_epi32(k, _mm512_loadu_si512(bytes));
    std::fwrite(loaded, sizeof(loaded), 1, stdout);
    std::fwrite(stored, sizeof(stored), 1, stdout);
    std::fwrite(&lo, sizeof(lo), 1, stdout);
  }
  return 0;
}
"""

# The inputs and, by name, what the program gave for them.
Run = tuple[np.ndarray, dict[str, np.ndarray]]

# Per chunk, in the program's order: the record's fields and their sizes in bytes.
_FIELDS = [("two", "<u2", 32), ("one", "<u2", 16), ("dp", "<f4", 16), ("sums", "<f4", 2),
           ("widen", "<i4", 80), ("halves", "<f4", 16), ("conv", "<f4", 16),
           ("narrow", "<i2", 16), ("loaded", "<f4", 16), ("stored", "<f4", 16),
           ("lo", "<i4", 1)]


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    where = tmp_path_factory.mktemp("emu")
    src = where / "emu.cpp"
    src.write_text(_PROGRAM)
    exe = where / "emu"
    csrc = pathlib.Path(cpu_build.__file__).parent / "csrc"
    subprocess.run([os.environ.get("CXX", "c++"), "-O1", "-std=c++17", *cpu_build._X86_V3,
                    *cpu_build._EMULATED["avx512_bf16"],
                    "-include", str(csrc / cpu_build._EMULATION_HEADER),
                    "-include", str(csrc / cpu_build._EMULATION_MACROS),
                    "-Wno-psabi", str(src), "-o", str(exe)], check=True)
    return exe


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The same program for the real instructions (the avx512_bf16 variant's flags)."""
    where = tmp_path_factory.mktemp("native")
    src = where / "native.cpp"
    src.write_text("#include <immintrin.h>\n" + _PROGRAM)
    exe = where / "native"
    subprocess.run([os.environ.get("CXX", "c++"), "-O1", "-std=c++17",
                    *cpu_build.FLAGS["avx512_bf16"], str(src), "-o", str(exe)], check=True)
    return exe


def _inputs(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, 64)) * np.exp2(rng.integers(-20, 20, (n, 64)))).astype("<f4")
    bits = x.view("<u4")
    # ties for the rounding (the low 16 bits exactly half), bf16 values with low bits set,
    # and the special values: denormals, zeros, infinities, a NaN
    bits[: n // 4, :8] = (bits[: n // 4, :8] & 0xFFFF0000) | 0x8000
    bits[: n // 4, 8:16] = (bits[: n // 4, 8:16] & 0xFFFF0000) | rng.integers(
        0, 0x10000, (n // 4, 8), dtype=np.uint32)
    special = np.array([1e-40, -1e-40, 0.0, -0.0, np.inf, -np.inf, np.nan, 3.0e38],
                       dtype="<f4")
    x[n // 4: n // 2, 16:24] = special
    return x


def _run(program: pathlib.Path, x: np.ndarray) -> dict[str, np.ndarray]:
    data = np.int64(len(x)).tobytes() + x.tobytes()
    out = subprocess.run([str(program)], input=data, capture_output=True, check=True).stdout
    dtype = np.dtype([(name, kind, (count,)) for name, kind, count in _FIELDS])
    rec = np.frombuffer(out, dtype=dtype)
    assert len(rec) == len(x)
    return {name: rec[name] for name, _, _ in _FIELDS}


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """torch's round-to-nearest-even bf16 of x, denormal inputs as (signed) zero first."""
    x = x.copy()
    denormal = (x.view("<u4") & 0x7F800000) == 0
    x[denormal] = np.copysign(0.0, x[denormal])
    t = torch.from_numpy(x).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view("<u2")


@pytest.fixture(scope="module")
def run(program: pathlib.Path) -> Run:
    x = _inputs(256, seed=0)
    return x, _run(program, x)


def test_bf16_conversions_round_to_nearest_even(run: Run) -> None:
    x, got = run
    a, b = x[:, :16], x[:, 16:32]
    for out, expect_from in ((got["two"][:, :16], b), (got["two"][:, 16:], a),
                             (got["one"], a)):
        expect = _bf16_bits(expect_from)
        nan = np.isnan(expect_from)
        assert np.array_equal(out[~nan], expect[~nan])
        # a NaN stays a NaN, quiet (its payload's top bit set)
        assert np.all((out[nan] & 0x7FC0) == 0x7FC0)


def test_dpbf16_adds_the_odd_pair_then_the_even(run: Run) -> None:
    x, got = run
    xs = (x[:, :32].view("<u4") >> 16).astype(np.uint32)
    ys = (x[:, 32:64].view("<u4") >> 16).astype(np.uint32)

    def as_f32(bits: np.ndarray) -> np.ndarray:
        v = (bits << 16).astype("<u4").view("<f4")
        return np.where((bits & 0x7F80) == 0, np.copysign(np.float32(0), v), v)

    def daz(v: np.ndarray) -> np.ndarray:
        return np.where((v.view("<u4") & 0x7F800000) == 0, np.copysign(np.float32(0), v), v)

    fx, fy = as_f32(xs).astype(np.float64), as_f32(ys).astype(np.float64)
    acc = daz(x[:, 32:48].copy())
    with np.errstate(all="ignore"):
        # an FMA: the product exact in float64 (16 significant bits), the sum rounded once
        # to float32 (through float64: a second rounding that can differ only at ties this
        # data does not hit)
        acc = daz((acc + fx[:, 1::2] * fy[:, 1::2]).astype(np.float32))
        acc = daz((acc + fx[:, 0::2] * fy[:, 0::2]).astype(np.float32))
    same = (got["dp"] == acc) | (np.isnan(got["dp"]) & np.isnan(acc))
    assert same.all(), np.argwhere(~same)[:5]


def test_reductions(run: Run) -> None:
    x, got = run
    a = x[:, :16].astype(np.float32)
    finite = np.isfinite(a).all(axis=1)
    # GCC's order: halves, quarters, then the pairs (0, 2) and (1, 3)
    t = a[:, 8:] + a[:, :8]
    q = t[:, 4:] + t[:, :4]
    tree = (q[:, 0] + q[:, 2]) + (q[:, 1] + q[:, 3])
    assert np.array_equal(got["sums"][finite, 0], tree[finite])
    assert np.array_equal(got["sums"][finite, 1], a[finite].max(axis=1))


def test_integer_and_half_moves(run: Run) -> None:
    x, got = run
    raw = x[:, 48:64].copy().view(np.uint8)  # 64 bytes a chunk
    assert np.array_equal(got["widen"][:, 0:16], raw[:, :16].view(np.int8).astype(np.int32))
    assert np.array_equal(got["widen"][:, 16:32], raw[:, :16].astype(np.int32))
    assert np.array_equal(got["widen"][:, 32:48], raw[:, :32].view("<u2").astype(np.int32))
    # 32 int16 lanes stored as 16 int32s: compare as int16
    i16 = got["widen"][:, 48:64].copy().view("<i2")
    u16 = got["widen"][:, 64:80].copy().view("<i2")
    assert np.array_equal(i16, raw[:, :32].view(np.int8).astype(np.int16))
    assert np.array_equal(u16, raw[:, :32].astype(np.int16))
    halves = raw[:, :32].view("<f2").astype(np.float32)
    assert np.array_equal(got["halves"], halves, equal_nan=True)
    ints = raw.view("<i4")
    assert np.array_equal(got["conv"], ints.astype(np.float32))  # round to nearest
    assert np.array_equal(got["narrow"], ints.astype(np.int16))  # truncation (vpmovdw)


def test_masked_loads_stores_and_min(run: Run) -> None:
    x, got = run
    raw = x[:, 48:64].copy().view(np.uint8)
    k = raw[:, :2].copy().view("<u2")[:, 0]
    lanes = ((k[:, None] >> np.arange(16)) & 1).astype(bool)
    a = x[:, :16]
    assert np.array_equal(got["loaded"], np.where(lanes, a, 0.0), equal_nan=True)
    assert np.array_equal(got["stored"], np.where(lanes, a, x[:, 16:32]), equal_nan=True)
    ints = raw.view("<i4")
    expect = np.where(lanes, ints, np.iinfo(np.int32).max).min(axis=1)
    assert np.array_equal(got["lo"][:, 0], expect)


_HARDWARE = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}


@pytest.mark.skipif(not cpu_isa.info().flags >= _HARDWARE,
                    reason="comparing the emulation with the hardware needs AVX512-BF16 (and "
                    "VNNI, F/BW/VL/DQ), which this CPU lacks")
def test_the_emulation_gives_the_hardwares_bits(program: pathlib.Path,
                                                native: pathlib.Path) -> None:
    """Where the instructions exist, the emulated program and the native one agree: the
    bits of every result (a NaN's payload aside: which NaN an FMA passes on is not ours to
    follow)."""
    x = _inputs(256, seed=1)
    got, real = _run(program, x), _run(native, x)
    differ = [name for name, kind, _ in _FIELDS
              if not np.array_equal(got[name], real[name], equal_nan=kind == "<f4")]
    assert not differ, differ
