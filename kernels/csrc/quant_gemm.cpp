// y = x w^T + b for bf16 activations and a weight-only int8 or 4-bit weight (kernels/quant.py
// defines the layout).
//
// A decode step reads every weight once; with 1 byte (int8) or half a byte (4-bit) a value
// instead of bf16's 2, it reads 2x or ~3.5x fewer bytes. Steps of a few rows (run_rows):
// each chunk of a weight row is loaded once, widened to bf16 in registers and dotted with
// every x row by AVX512-BF16's dpbf16 (exact products, float32 sums); a group's partial
// sums are multiplied by its scale once; 4-bit mins are added as min * sum(x over the
// group), the sums precomputed once per call. The 4-bit values become bf16 with two bit
// operations (see widen_int4): a decode step's cost is the instructions spent per weight
// byte as much as the bytes themselves.
//
// Steps of many rows (run_tiles: prefill, large batches) are compute-bound: blocks of 32
// weight rows are widened once into cache-sized tiles in dpbf16's pair layout, against
// which each x row is broadcast, 16 outputs an instruction. Weight rows are split over
// threads in both.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "ops.h"
#include "thread_pool.h"

#include "bf16.h"
#include "prefetch.h"
#include "quant_layout.h"

#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

// AMX tiles for the many-row path, where the CPU has them (amx.h: RINGSERVE_AMX).
#include "amx.h"

namespace {

constexpr int64_t kMaxRows = 8;  // x rows a pass; more rows run in passes of 8
constexpr int64_t kTile = 32;     // weight rows a tile: two vectors of 16 outputs
// Bytes of the weight asked for ahead of the one-row multiply (quant_row): one cache line
// per 64 values, into L1, this far ahead in the rows' one stream.
constexpr int64_t kAheadBytes = 2560;

#if defined(__AVX512BF16__)

// 32 int8 values -> 32 bf16 (exact: |q| <= 128 has at most 8 significant bits).
// NOTE: two 16-byte loads, each folded into its sign extension (vpmovsxbd zmm, m128): one
// 32-byte load split by vextracti128 cost a shuffle for every 32 values, in a loop that at
// one x row is bound by its shuffles and conversions, not by memory.
inline __m512bh widen_int8(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// 32 bytes of packed nibbles -> values 0-31 (low nibbles) and 32-63 (high) as bf16 of
// 128 + q: in [128, 256) bf16 steps by 1, so 128 + q is the bits 0x4300 | q, one
// vpternlog (and, or) per 32 values. The 128 * sum(x) this adds is taken off with the mins.
constexpr float kInt4Offset = 128.f;
inline void widen_int4(const uint8_t* p, __m512bh& lo, __m512bh& hi) {
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i nibble = _mm512_set1_epi16(0x000F), exponent = _mm512_set1_epi16(0x4300);
  // NOTE: 0xEA is (a & b) | c for vpternlog's operand order (a, b, c).
  lo = (__m512bh)_mm512_ternarylogic_epi32(v, nibble, exponent, 0xEA);
  hi = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), nibble, exponent, 0xEA);
}

// Values j..j+63 of a row (j a multiple of 64) as two bf16 vectors.
template <int BITS>
inline void widen64(const uint8_t* row, int64_t j, __m512bh& w0, __m512bh& w1) {
  if constexpr (BITS == 8) {
    w0 = widen_int8(reinterpret_cast<const int8_t*>(row) + j);
    w1 = widen_int8(reinterpret_cast<const int8_t*>(row) + j + 32);
  } else {
    widen_int4(row + j / 2, w0, w1);
  }
}

// n float16 values -> float32, 16 at a time (F16C through AVX-512's vcvtph2ps).
inline void halves_to_floats(const c10::Half* src, int64_t n, float* dst) {
  const auto* p = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i))));
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(dst + i, tail, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tail, p + i)));
  }
}

// Weight row r of out [M, n] for x [M, k]; xsum [M, groups] (4-bit only); sc: scratch of
// `groups` floats. Two sets of sums alternate halves of a 64-value step (and groups), so
// consecutive FMAs do not wait on each other.
// NOTE: two or four weight rows side by side (more independent sums for one x row)
// measured 1.5-2.5x slower here: the unrolled blocks spill.
template <int M, int BITS>
inline void quant_row(const uint16_t* x, const uint8_t* qw, const c10::Half* scales,
                      const c10::Half* mins, const float* xsum, const c10::BFloat16* bias,
                      int64_t r, int64_t k, int64_t group, int64_t n, float* sc,
                      c10::BFloat16* out) {
  const int64_t groups = k / group;
  const uint8_t* row = qw + r * (BITS == 8 ? k : k / 2);
  halves_to_floats(scales + r * groups, groups, sc);
  // NOTE: one x row multiplies fast enough that the hardware prefetcher alone left it
  // waiting on memory; each 64-value step asks for the line kAheadBytes further on (the
  // rows are one stream), up to the weight's end. The whole next row at once instead
  // stalled rows of 2 KiB (a burst of 32 prefetches), 0.74x. Many x rows keep the
  // hardware's pace.
  const uint8_t* end = qw + n * (BITS == 8 ? k : k / 2);
  const auto fetch_ahead = [end](const uint8_t* p) {
    if constexpr (M == 1) {
      if (end - p > kAheadBytes)  // (no pointer formed past the weight's end)
        _mm_prefetch(reinterpret_cast<const char*>(p + kAheadBytes), _MM_HINT_T0);
    }
  };
  __m512 t0[M], t1[M];
  for (int m = 0; m < M; ++m) t0[m] = t1[m] = _mm512_setzero_ps();
  // One scale per 32-value half, or (group 16, GGUF's Q6_K) two: lanes 0-7 and 8-15 of
  // a dpbf16 hold values 0-15 and 16-31. One loop for each group size (G16), so that its
  // body does not test the group.
  const auto small_groups = [&](auto sixteen) {
    constexpr bool G16 = decltype(sixteen)::value;
    auto scale = [&](int64_t j) {
      return G16 ? _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(sc[j / 16]),
                                        _mm512_set1_ps(sc[j / 16 + 1]))
                 : _mm512_set1_ps(sc[j / 32]);
    };
    int64_t j = 0;
    for (; j + 64 <= k; j += 64) {
      fetch_ahead(row + j * BITS / 8);
      __m512bh w0, w1;
      widen64<BITS>(row, j, w0, w1);
      const __m512 s0 = scale(j), s1 = scale(j + 32);
      for (int m = 0; m < M; ++m) {
        const __m512bh x0 = (__m512bh)_mm512_loadu_si512(x + m * k + j);
        const __m512bh x1 = (__m512bh)_mm512_loadu_si512(x + m * k + j + 32);
        t0[m] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), x0, w0), s0, t0[m]);
        t1[m] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), x1, w1), s1, t1[m]);
      }
    }
    if (j < k) {  // int8 only: k % 64 == 32
      const __m512bh w0 = widen_int8(reinterpret_cast<const int8_t*>(row) + j);
      const __m512 s0 = scale(j);
      for (int m = 0; m < M; ++m)
        t0[m] = _mm512_fmadd_ps(
            _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(x + m * k + j), w0),
            s0, t0[m]);
    }
  };
  if (group == 16) {
    small_groups(std::true_type{});
  } else if (group == 32) {
    small_groups(std::false_type{});
  } else {
    for (int64_t g = 0; g < groups; ++g) {
      __m512 p0[M], p1[M];
      for (int m = 0; m < M; ++m) p0[m] = p1[m] = _mm512_setzero_ps();
      const int64_t j1 = (g + 1) * group;
      int64_t j = g * group;
      for (; j + 64 <= j1; j += 64) {
        fetch_ahead(row + j * BITS / 8);
        __m512bh w0, w1;
        widen64<BITS>(row, j, w0, w1);
        for (int m = 0; m < M; ++m) {
          p0[m] = _mm512_dpbf16_ps(p0[m], (__m512bh)_mm512_loadu_si512(x + m * k + j), w0);
          p1[m] = _mm512_dpbf16_ps(p1[m], (__m512bh)_mm512_loadu_si512(x + m * k + j + 32), w1);
        }
      }
      if (j < j1) {  // int8 only: group % 64 == 32
        const __m512bh w0 = widen_int8(reinterpret_cast<const int8_t*>(row) + j);
        for (int m = 0; m < M; ++m)
          p0[m] = _mm512_dpbf16_ps(p0[m], (__m512bh)_mm512_loadu_si512(x + m * k + j), w0);
      }
      const __m512 s = _mm512_set1_ps(sc[g]);
      for (int m = 0; m < M; ++m) {
        if (g & 1)
          t1[m] = _mm512_fmadd_ps(_mm512_add_ps(p0[m], p1[m]), s, t1[m]);
        else
          t0[m] = _mm512_fmadd_ps(_mm512_add_ps(p0[m], p1[m]), s, t0[m]);
      }
    }
  }
  if constexpr (BITS == 4) {
    // The mins, less the 128 * scale that widen_int4's offset added, times sum(x) over each
    // group: 16 groups a vector, straight from float16, into the same sums.
    const auto* mh = reinterpret_cast<const uint16_t*>(mins + r * groups);
    const auto* sh = reinterpret_cast<const uint16_t*>(scales + r * groups);
    for (int64_t g = 0; g < groups; g += 16) {
      const __mmask16 mask = groups - g >= 16 ? 0xFFFF
                                              : static_cast<__mmask16>((1u << (groups - g)) - 1);
      const __m512 coef = _mm512_fnmadd_ps(
          _mm512_set1_ps(kInt4Offset), _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, sh + g)),
          _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mh + g)));
      for (int m = 0; m < M; ++m)
        t1[m] = _mm512_fmadd_ps(coef, _mm512_maskz_loadu_ps(mask, xsum + m * groups + g), t1[m]);
    }
  }
  const float b = bias != nullptr ? ringserve::to_f(bias[r]) : 0.f;
  for (int m = 0; m < M; ++m)
    out[m * n + r] =
        ringserve::from_f<c10::BFloat16>(_mm512_reduce_add_ps(_mm512_add_ps(t0[m], t1[m])) + b);
}

// Weight rows [n0, n1), one at a time.
template <int M, int BITS>
void quant_rows(const uint16_t* x, const uint8_t* qw, const c10::Half* scales,
                const c10::Half* mins, const float* xsum, const c10::BFloat16* bias,
                int64_t n0, int64_t n1, int64_t k, int64_t group, int64_t n,
                c10::BFloat16* out) {
  std::vector<float> sc(static_cast<size_t>(k / group) + 1);
  for (int64_t r = n0; r < n1; ++r)
    quant_row<M, BITS>(x, qw, scales, mins, xsum, bias, r, k, group, n, sc.data(), out);
}

template <int BITS>
void run_rows(const uint16_t* x, int64_t rows, const uint8_t* qw, const c10::Half* scales,
              const c10::Half* mins, const float* xsum, const c10::BFloat16* bias, int64_t k,
              int64_t group, int64_t n, c10::BFloat16* out) {
  const int64_t groups = k / group;
  // NOTE: 16 weight rows a task at least: 10-20 KiB of weights for k = 640.
  ringserve::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    // NOTE: blocks of 64 weight rows (<= 64 KiB at k = 1024) stay in L2 across passes.
    for (int64_t b0 = begin; b0 < end; b0 += 64) {
      const int64_t b1 = std::min(end, b0 + 64);
      for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
        const uint16_t* xp = x + m0 * k;
        const float* xs = xsum != nullptr ? xsum + m0 * groups : nullptr;
        c10::BFloat16* op = out + m0 * n;
        ringserve::with_rows<kMaxRows>(rows - m0, [&](auto r) {
          quant_rows<decltype(r)::value, BITS>(xp, qw, scales, mins, xs, bias, b0, b1, k,
                                               group, n, op);
        });
      }
    }
  });
}

// Steps with many x rows (prefill chunks, large decode batches) are compute-bound: there
// each block of 32 weight rows is widened once into a tile in the layout dpbf16 multiplies
// best, pairs of k interleaved across the 32 rows (tile[p][i] = w[i][2p, 2p+1]), and each
// x row's pair is broadcast against 16 rows at a time: 16 outputs a dpbf16 and no
// horizontal sums (the layout oneDNN's bf16 GEMM packs its weights into). The tile holds
// the integer values themselves (4-bit as 128 + q, as widen_int4 makes them), exact in
// bf16; each group's partial sums are multiplied by the 32 rows' scales as one vector, and
// the mins added from the x sums, so the many-row path rounds what the few-row path does.
constexpr int kTileMR = 6;     // x rows a pass: 12 sums and 12 partial sums in registers

// In place: r[i] lane j -> r[j] lane i (a 16 x 16 transpose of 32-bit values).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
  }
}

// Values j..j+31 of a row as exact bf16 integers (4-bit: 128 + q).
template <int BITS>
inline __m512i exact32(const uint8_t* row, int64_t j) {
  if constexpr (BITS == 8) {
    return (__m512i)widen_int8(reinterpret_cast<const int8_t*>(row) + j);
  } else {
    const __m512i v = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (j / 64) * 32)));
    const __m512i nibble = _mm512_set1_epi16(0x000F), exponent = _mm512_set1_epi16(0x4300);
    const __m512i q = (j % 64) < 32 ? v : _mm512_srli_epi16(v, 4);
    return _mm512_ternarylogic_epi32(q, nibble, exponent, 0xEA);
  }
}

// out[m, r0 + i] for x rows [0, MR) and the tile's rows. sct, mnt: [groups][kTile] scales
// and (4-bit) mins less 128 * scale; xsum: [MR][groups] (4-bit only).
template <int MR, int BITS>
void tile_rows(const uint16_t* x, int64_t k, int64_t group, const uint32_t* tile,
               const float* sct, const float* mnt, const float* xsum, int64_t groups,
               int64_t valid, const c10::BFloat16* bias, int64_t r0, int64_t n,
               c10::BFloat16* out) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const int64_t gp = group / 2;  // pairs a group
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[MR][2];
    for (int m = 0; m < MR; ++m) part[m][0] = part[m][1] = _mm512_setzero_ps();
    for (int64_t p = g * gp; p < (g + 1) * gp; ++p) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(tile + p * kTile);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(tile + p * kTile + 16);
      for (int m = 0; m < MR; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * k + 2 * p, sizeof(pair));
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        part[m][0] = _mm512_dpbf16_ps(part[m][0], xv, w0);
        part[m][1] = _mm512_dpbf16_ps(part[m][1], xv, w1);
      }
    }
    const __m512 s0 = _mm512_loadu_ps(sct + g * kTile), s1 = _mm512_loadu_ps(sct + g * kTile + 16);
    for (int m = 0; m < MR; ++m) {
      acc[m][0] = _mm512_fmadd_ps(part[m][0], s0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(part[m][1], s1, acc[m][1]);
    }
    if constexpr (BITS == 4) {
      const __m512 m0 = _mm512_loadu_ps(mnt + g * kTile), m1 = _mm512_loadu_ps(mnt + g * kTile + 16);
      for (int m = 0; m < MR; ++m) {
        const __m512 xs = _mm512_set1_ps(xsum[m * groups + g]);
        acc[m][0] = _mm512_fmadd_ps(xs, m0, acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(xs, m1, acc[m][1]);
      }
    }
  }
  __m512 b[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  if (bias != nullptr) {
    for (int h = 0; h < 2; ++h) {
      alignas(64) float bv[16] = {};
      for (int i = 0; i < 16 && h * 16 + i < valid; ++i) bv[i] = ringserve::to_f(bias[r0 + h * 16 + i]);
      b[h] = _mm512_load_ps(bv);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 2; ++h) {
      const int64_t left = valid - h * 16;
      if (left <= 0) break;
      const __mmask16 mask = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
      const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][h], b[h]));
      _mm256_mask_storeu_epi16(out + m * n + r0 + h * 16, mask, v);
    }
}

// Tile t (weight rows t * kTile ...) of the weight in the layout tile_rows reads: the values
// as exact bf16 integers, pairs of k interleaved across the tile's rows, into `tile`
// [kp][kTile]; its scales (and 4-bit mins less 128 * scale) as float32 into sct, mnt
// [groups][kTile]. Rows past the weight's last are 0.
template <int BITS>
void widen_tile(const uint8_t* qw, const c10::Half* scales, const c10::Half* mins, int64_t t,
                int64_t k, int64_t group, int64_t n, uint32_t* tile, float* sct, float* mnt) {
  const int64_t groups = k / group, row_bytes = BITS == 8 ? k : k / 2;
  const int64_t r0 = t * kTile, valid = std::min(kTile, n - r0);
  // Scales (and mins less 128 * scale) as float32, transposed 16 groups x 16 rows at a
  // time; 0 past the last row.
  const auto* sh = reinterpret_cast<const uint16_t*>(scales);
  const auto* mh = reinterpret_cast<const uint16_t*>(mins);
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    const int64_t width = std::min<int64_t>(16, groups - g0);
    const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1);
    for (int64_t h = 0; h < kTile; h += 16) {
      __m512i sb[16], mb[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t r = r0 + h + i;
        const bool in = h + i < valid;
        const __m512 sv = in ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, sh + r * groups + g0))
                             : _mm512_setzero_ps();
        sb[i] = _mm512_castps_si512(sv);
        if constexpr (BITS == 4) {
          const __m512 mv = in ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mh + r * groups + g0))
                               : _mm512_setzero_ps();
          mb[i] = _mm512_castps_si512(_mm512_fnmadd_ps(_mm512_set1_ps(kInt4Offset), sv, mv));
        }
      }
      transpose16(sb);
      if constexpr (BITS == 4) transpose16(mb);
      for (int64_t c = 0; c < width; ++c) {
        _mm512_storeu_si512(sct + (g0 + c) * kTile + h, sb[c]);
        if constexpr (BITS == 4) _mm512_storeu_si512(mnt + (g0 + c) * kTile + h, mb[c]);
      }
    }
  }
  for (int64_t j = 0; j < k; j += 32)  // 16 pairs of 16 rows a transpose
    for (int64_t h = 0; h < kTile; h += 16) {
      __m512i block[16];
      for (int i = 0; i < 16; ++i)
        block[i] = h + i < valid ? exact32<BITS>(qw + (r0 + h + i) * row_bytes, j)
                                 : _mm512_setzero_si512();
      transpose16(block);
      for (int c = 0; c < 16; ++c)
        _mm512_storeu_si512(tile + (j / 2 + c) * kTile + h, block[c]);
    }
}

// out[:, tile t's rows] for every x row, in passes of kTileMR rows.
template <int BITS>
void tile_passes(const uint16_t* x, int64_t rows, const float* xsum, const c10::BFloat16* bias,
                 int64_t t, int64_t k, int64_t group, int64_t n, const uint32_t* tile,
                 const float* sct, const float* mnt, c10::BFloat16* out) {
  const int64_t groups = k / group, r0 = t * kTile, valid = std::min(kTile, n - r0);
  for (int64_t m0 = 0; m0 < rows; m0 += kTileMR) {
    const uint16_t* xp = x + m0 * k;
    const float* xs = xsum != nullptr ? xsum + m0 * groups : nullptr;
    c10::BFloat16* op = out + m0 * n;
    ringserve::with_rows<kTileMR>(rows - m0, [&](auto r) {
      tile_rows<decltype(r)::value, BITS>(xp, k, group, tile, sct, mnt, xs, groups, valid,
                                          bias, r0, n, op);
    });
  }
}

#if defined(RINGSERVE_AMX)
// AMX (Sapphire Rapids on): the tile's multiply by TDPBF16PS, 16 x rows by 16 outputs by up
// to 32 values an instruction, where dpbf16 takes 16 outputs by 2 values. The tile is read
// as it is: its [pairs][32] layout is AMX's B operand (pairs of k across the columns), two
// B tiles of 16 columns at a 128-byte stride. Each group's sums leave the tile unit
// (TILESTORED) and are scaled and added up as in tile_rows, so only the summation inside a
// group differs: AMX adds a group's products in an order and at a precision of its own, not
// dpbf16's (measured on this project's AMX machine, neither product order of the
// instructions' description matched its bits), so these sums agree with tile_rows' to
// float32 rounding, not bit for bit; both paths of one linear (run_tiles and
// quant_linear_tiles) take it, and agree with each other bit for bit.
// The tiles: tmm0 / tmm1 16 x rows by `pairs` pairs of k (A); tmm2 / tmm3 `pairs` pairs by
// 16 outputs of the tile (B: its two halves); tmm4-7 a group's sums, 16 x rows by 16
// outputs (float32). `amx_quad` multiplies both A by both B into all four sums; `amx_half`
// runs two sets (tmm0, tmm2, tmm4 and tmm1, tmm3, tmm5), so that one group's multiply runs
// while the last one's sums are scaled.
ringserve::TileConfig amx_config(int64_t pairs) {
  ringserve::TileConfig c;
  for (int i : {0, 1}) {
    c.set(i, 16, static_cast<int>(pairs * 4));
    c.set(i + 2, static_cast<int>(pairs), 64);
  }
  for (int i = 4; i < 8; ++i) c.set(i, 16, 64);
  return c;
}

// Pairs of k a TDPBF16PS takes for this group size (a tile holds 16 rows of 64 bytes).
inline int64_t amx_pairs(int64_t group) { return std::min<int64_t>(group / 2, 16); }

// Group g's sums into tile C (0 or 3), through A (1 or 4) and B (2 or 5).
#define RINGSERVE_AMX_GROUP(C, A, B, g)                                          \
  do {                                                                       \
    _tile_zero(C);                                                           \
    for (int64_t p = (g) * gp; p < ((g) + 1) * gp; p += step) {              \
      _tile_loadd(A, x + 2 * p, k * 2);                                      \
      _tile_loadd(B, tile + p * kTile + h * 16, kTile * 4);                  \
      _tile_dpbf16ps(C, A, B);                                               \
    }                                                                        \
  } while (0)

// x rows [m0, m0 + 16) of `x` (16 rows readable) by the tile's half `h`, for MR valid rows:
// acc[m] (16 outputs) = sum over groups of scale * the group's sums (+ 4-bit mins * x sums).
// `ahead`: the next tile's lines, some asked for every second group.
template <int MR, int BITS>
__attribute__((target("amx-tile,amx-bf16"))) void amx_half(
    const uint16_t* x, int64_t k, int64_t group, const uint32_t* tile, const float* sct,
    const float* mnt, const float* xsum, int64_t groups, int h, __m512* acc, ringserve::Ahead& ahead) {
  alignas(64) float part[2][16 * 16];
  const int64_t gp = group / 2, step = amx_pairs(group);
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  auto add = [&](const float* pt, int64_t g) {
    const __m512 s = _mm512_loadu_ps(sct + g * kTile + h * 16);
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_fmadd_ps(_mm512_load_ps(pt + m * 16), s, acc[m]);
    if constexpr (BITS == 4) {
      const __m512 mn = _mm512_loadu_ps(mnt + g * kTile + h * 16);
      for (int m = 0; m < MR; ++m)
        acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[m * groups + g]), mn, acc[m]);
    }
  };
  RINGSERVE_AMX_GROUP(4, 0, 2, 0);
  for (int64_t g = 0; g < groups; g += 2) {
    ahead.fetch();
    if (g + 1 < groups) RINGSERVE_AMX_GROUP(5, 1, 3, g + 1);
    _tile_stored(4, part[0], 64);
    add(part[0], g);
    if (g + 1 < groups) {
      if (g + 2 < groups) RINGSERVE_AMX_GROUP(4, 0, 2, g + 2);
      _tile_stored(5, part[1], 64);
      add(part[1], g + 1);
    }
  }
}
#undef RINGSERVE_AMX_GROUP

// Group g's sums of x rows [0, 32) (two blocks of 16, at x and x + 16 * k) by both halves
// of the tile into tmm4-7: four independent multiplies a group, where `amx_half` has one
// (two with its second set), so the tile unit's latency is hidden, and each A and B tile
// loaded serves two multiplies.
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_quad_group(
    const uint16_t* x, int64_t k, const uint32_t* tile, int64_t g, int64_t gp, int64_t step) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t p = g * gp; p < (g + 1) * gp; p += step) {
    _tile_loadd(0, x + 2 * p, k * 2);
    _tile_loadd(2, tile + p * kTile, kTile * 4);
    _tile_loadd(3, tile + p * kTile + 16, kTile * 4);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    _tile_loadd(1, x + 16 * k + 2 * p, k * 2);
    _tile_dpbf16ps(6, 1, 2);
    _tile_dpbf16ps(7, 1, 3);
  }
}

// x rows [0, 32) of `x` (32 rows readable) by both halves of the tile: acc[b][m][h] (16
// outputs) = sum over groups of scale * the group's sums (+ 4-bit mins * x sums), for the
// MR0 (MR1) valid rows of block b = 0 (1). The same sums, scaled and added in the same
// order, as `amx_half` for each block and half: the same bits. Each group's four sums go
// to `part` and are added up kQuadGroups groups at a time, a quarter at a time with its
// rows' sums in registers, while the next group multiplies.
constexpr int kQuadGroups = 2;

template <int BITS>
__attribute__((target("amx-tile,amx-bf16"))) void amx_quad(
    const uint16_t* x, int64_t k, int64_t group, const uint32_t* tile, const float* sct,
    const float* mnt, const float* xsum, int64_t groups, int mr0, int mr1, float* acc,
    ringserve::Ahead& ahead) {
  alignas(64) float part[kQuadGroups][4][16 * 16];
  const int64_t gp = group / 2, step = amx_pairs(group);
  const int mr[2] = {mr0, mr1};
  for (int i = 0; i < 2 * 16 * 2 * 16; i += 16) _mm512_store_ps(acc + i, _mm512_setzero_ps());
  // groups [g0, g1) from part into acc
  auto add = [&](int64_t g0, int64_t g1) {
    for (int b = 0; b < 2; ++b)
      for (int h = 0; h < 2; ++h) {
        float* a = acc + (b * 16 * 2 + h) * 16;  // [b][m][h][16]: row m at a + m * 32
        __m512 r[16];
        for (int m = 0; m < 16; ++m) r[m] = _mm512_load_ps(a + m * 32);
        for (int64_t g = g0; g < g1; ++g) {
          const float* pt = part[g - g0][b * 2 + h];
          const __m512 sc = _mm512_loadu_ps(sct + g * kTile + h * 16);
          for (int m = 0; m < 16; ++m) r[m] = _mm512_fmadd_ps(_mm512_load_ps(pt + m * 16), sc, r[m]);
          if constexpr (BITS == 4) {
            const __m512 mn = _mm512_loadu_ps(mnt + g * kTile + h * 16);
            const float* xs = xsum + b * 16 * groups;
            for (int m = 0; m < mr[b]; ++m)
              r[m] = _mm512_fmadd_ps(_mm512_set1_ps(xs[m * groups + g]), mn, r[m]);
          }
        }
        for (int m = 0; m < 16; ++m) _mm512_store_ps(a + m * 32, r[m]);
      }
  };
  amx_quad_group(x, k, tile, 0, gp, step);
  int64_t first = 0;  // the first group in part
  for (int64_t g = 0; g < groups; ++g) {
    ahead.fetch();
    ahead.fetch();
    float(*pg)[16 * 16] = part[g - first];
    _tile_stored(4, pg[0], 64);
    _tile_stored(5, pg[1], 64);
    _tile_stored(6, pg[2], 64);
    _tile_stored(7, pg[3], 64);
    if (g + 1 < groups) amx_quad_group(x, k, tile, g + 1, gp, step);
    if (g + 1 - first == kQuadGroups || g + 1 == groups) {
      add(first, g + 1);
      first = g + 1;
    }
  }
}

// tile_passes by AMX for x rows [m_begin, m_end) (m_begin a multiple of 16): x has a
// multiple of 16 rows readable (amx_rows). The caller has configured this thread's tiles
// (amx_config(amx_pairs(group))).
template <int BITS>
void amx_tile_passes(const uint16_t* x, int64_t m_begin, int64_t m_end, const float* xsum,
                     const c10::BFloat16* bias, int64_t t, int64_t k, int64_t group, int64_t n,
                     const uint32_t* tile, const float* sct, const float* mnt,
                     c10::BFloat16* out, ringserve::Ahead ahead = {}) {
  const int64_t groups = k / group, r0 = t * kTile, valid = std::min(kTile, n - r0);
  __mmask16 masks[2];
  __m512 bv[2];
  for (int h = 0; h < 2; ++h) {
    const int64_t left = std::max<int64_t>(0, valid - h * 16);
    masks[h] = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    alignas(64) float b[16] = {};
    for (int i = 0; i < 16 && i < left && bias != nullptr; ++i)
      b[i] = ringserve::to_f(bias[r0 + h * 16 + i]);
    bv[h] = _mm512_load_ps(b);
  }
  // NOTE: 32 x rows by both halves at once where there are more than 16 rows left and
  // the tile has both halves (`amx_quad`); else both halves of the tile for one block of
  // 16 x rows in turn, so that the block's rows are read from L1 the second time.
  int64_t m0 = m_begin;
  if (masks[1] != 0)
    for (; m_end - m0 > 16; m0 += 32) {
      alignas(64) float acc[2 * 16 * 2 * 16];
      const float* xs = xsum != nullptr ? xsum + m0 * groups : nullptr;
      const int mr1 = static_cast<int>(std::min<int64_t>(16, m_end - m0 - 16));
      amx_quad<BITS>(x + m0 * k, k, group, tile, sct, mnt, xs, groups, 16, mr1, acc, ahead);
      for (int b = 0; b < 2; ++b)
        for (int64_t m = 0; m < (b == 0 ? 16 : mr1); ++m)
          for (int h = 0; h < 2; ++h) {
            const __m512 v = _mm512_load_ps(acc + ((b * 16 + m) * 2 + h) * 16);
            const __m256i o = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(v, bv[h]));
            _mm256_mask_storeu_epi16(out + (m0 + b * 16 + m) * n + r0 + h * 16, masks[h], o);
          }
    }
  for (; m0 < m_end; m0 += 16) {
    const float* xs = xsum != nullptr ? xsum + m0 * groups : nullptr;
    const int64_t mr = std::min<int64_t>(16, m_end - m0);
    for (int h = 0; h < 2; ++h) {
      if (masks[h] == 0) break;
      __m512 acc[16];
      ringserve::with_rows<16>(mr, [&](auto r) {
        amx_half<decltype(r)::value, BITS>(x + m0 * k, k, group, tile, sct, mnt, xs, groups, h,
                                           acc, ahead);
      });
      for (int64_t m = 0; m < mr; ++m) {
        const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m], bv[h]));
        _mm256_mask_storeu_epi16(out + (m0 + m) * n + r0 + h * 16, masks[h], v);
      }
    }
  }
}

// The AMX path's blocking: tiles a panel (~1 MiB of widened weights, kept in L2 while a
// block of x rows is multiplied by each of its tiles in turn) and x rows a block. Without
// it every tile streamed all of x from L3 (2.6 MB for a prefill chunk of 2048 rows).
constexpr int64_t kPanelBytes = 1 << 20;
constexpr int64_t kRowBlock = 64;

inline int64_t amx_panel(int64_t k) { return std::max<int64_t>(1, kPanelBytes / (kTile * k * 2)); }

// x with its rows padded with zeros to a multiple of 16, where they are not one already
// (AMX loads 16 rows a tile): the rows to read, and the copy that holds them (if any).
const uint16_t* amx_rows(const uint16_t* x, int64_t rows, int64_t k, std::vector<uint16_t>& pad) {
  if (rows % 16 == 0) return x;
  pad.assign(static_cast<size_t>((rows + 15) / 16 * 16 * k), 0);
  std::memcpy(pad.data(), x, static_cast<size_t>(rows * k) * sizeof(uint16_t));
  return pad.data();
}

#endif  // RINGSERVE_AMX

template <int BITS>
void run_tiles(const uint16_t* x, int64_t rows, const uint8_t* qw, const c10::Half* scales,
               const c10::Half* mins, const float* xsum, const c10::BFloat16* bias, int64_t k,
               int64_t group, int64_t n, c10::BFloat16* out) {
  const int64_t kp = k / 2, groups = k / group, row_bytes = BITS == 8 ? k : k / 2;
  // NOTE: the next tile's weight rows into L2 while this one is widened and multiplied:
  // 32 rows read side by side are more streams than the hardware prefetcher follows, and
  // without this a head of 262144 rows (read from memory, not cache) took 1.2-1.3x as long
  // at 16-32 x rows (benchmarks/quant_linear_bench.py, Zen 4).
  auto prefetch_next = [&](int64_t t, int64_t t1) {
    if (t + 1 >= t1) return;
    const int64_t r0 = t * kTile;
    const auto* next = reinterpret_cast<const char*>(qw + (r0 + kTile) * row_bytes);
    const int64_t bytes = std::min(kTile, n - r0 - kTile) * row_bytes;
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(next + off, _MM_HINT_T1);
  };
  const int64_t count = (n + kTile - 1) / kTile;
#if defined(RINGSERVE_AMX)
  if (ringserve::amx_wanted()) {  // panels of tiles widened, then blocks of x rows
    std::vector<uint16_t> pad;
    const uint16_t* xa = amx_rows(x, rows, k, pad);
    const int64_t panel = amx_panel(k);
    ringserve::parallel_for(0, count, 1, [&](int64_t t0, int64_t t1) {
      const ringserve::AmxScope tiles_on(amx_config(amx_pairs(group)));
      const int64_t held = std::min(panel, t1 - t0);
      std::vector<uint32_t> tiles(static_cast<size_t>(held * kTile * kp));
      std::vector<float> sct(static_cast<size_t>(held * kTile * groups)), mnt(sct.size());
      for (int64_t p0 = t0; p0 < t1; p0 += panel) {
        const int64_t p1 = std::min(t1, p0 + panel);
        for (int64_t t = p0; t < p1; ++t) {
          prefetch_next(t, t1);
          const int64_t i = t - p0;
          widen_tile<BITS>(qw, scales, mins, t, k, group, n, tiles.data() + i * kTile * kp,
                           sct.data() + i * kTile * groups, mnt.data() + i * kTile * groups);
        }
        for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock)
          for (int64_t t = p0; t < p1; ++t) {
            const int64_t i = t - p0;
            amx_tile_passes<BITS>(xa, m0, std::min(rows, m0 + kRowBlock), xsum, bias, t, k,
                                  group, n, tiles.data() + i * kTile * kp,
                                  sct.data() + i * kTile * groups,
                                  mnt.data() + i * kTile * groups, out);
          }
      }
    });
    return;
  }
#endif
  ringserve::parallel_for(0, count, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint32_t> tile(static_cast<size_t>(kTile * kp));
    std::vector<float> sct(static_cast<size_t>(kTile * groups)), mnt(sct.size());
    for (int64_t t = t0; t < t1; ++t) {
      prefetch_next(t, t1);
      widen_tile<BITS>(qw, scales, mins, t, k, group, n, tile.data(), sct.data(), mnt.data());
      tile_passes<BITS>(x, rows, xsum, bias, t, k, group, n, tile.data(), sct.data(),
                        mnt.data(), out);
    }
  });
}
#endif  // __AVX512BF16__

#if defined(__AVX512BF16__)
// Sum of each x row over each group of `group` values (4-bit weights: for the mins).
std::vector<float> group_sums(const at::Tensor& xc, int64_t group) {
  const int64_t rows = xc.size(0), k = xc.size(1), groups = k / group;
  std::vector<float> xsum(static_cast<size_t>(rows * groups), 0.f);
  const auto* xp = xc.data_ptr<c10::BFloat16>();
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t j = g * group; j < (g + 1) * group; ++j) s += ringserve::to_f(xp[m * k + j]);
      xsum[m * groups + g] = s;
    }
  return xsum;
}

// What both linears read: x and the bias contiguous, the output [rows, n], and (4-bit)
// x's group sums.
struct Operands {
  at::Tensor xc;
  std::optional<at::Tensor> bc;
  at::Tensor out;
  std::vector<float> xsum;
  const uint16_t* xp = nullptr;
  const c10::BFloat16* bp = nullptr;  // null: no bias
  c10::BFloat16* op = nullptr;
  const float* sums() const { return xsum.empty() ? nullptr : xsum.data(); }
};
Operands operands(const at::Tensor& x, const std::optional<at::Tensor>& bias, int64_t n,
                  int64_t bits, int64_t group) {
  Operands o;
  o.xc = x.contiguous();
  if (bias.has_value()) o.bc = bias->contiguous();
  o.out = at::empty({x.size(0), n}, x.options());
  if (bits == 4) o.xsum = group_sums(o.xc, group);
  o.xp = reinterpret_cast<const uint16_t*>(o.xc.data_ptr<c10::BFloat16>());
  o.bp = o.bc.has_value() ? o.bc->data_ptr<c10::BFloat16>() : nullptr;
  o.op = o.out.data_ptr<c10::BFloat16>();
  return o;
}
#endif

// x: [m, k] bf16; the weight in the kernels/quant.py layout; bias [n] bf16 or None.
// Returns [m, n] bf16. Steps of more than `tile_rows` x rows widen blocks of the weight to
// bf16 once (run_tiles); fewer read it packed (run_rows). Where this build has no
// AVX512-BF16, it raises: callers check `quant_linear_supported()` first.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins, int64_t bits, int64_t group,
                        const std::optional<at::Tensor>& bias, int64_t tile_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "quant_linear: x must be bf16 [m, k]");
  const int64_t k = x.size(1), n = qweight.size(0), rows = x.size(0);
  ringserve::check_layout(qweight, scales, mins, bits, group, k);
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->numel() == n),
              "quant_linear: bias must be bf16 [n]");
#if defined(__AVX512BF16__)
  const Operands prep = operands(x, bias, n, bits, group);
  const uint16_t* xp = prep.xp;
  const c10::BFloat16* bp = prep.bp;
  c10::BFloat16* op = prep.op;
  const float* xsum = prep.sums();
  const auto* qp = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  const auto* sp = scales.data_ptr<c10::Half>();
  const c10::Half* mp = bits == 4 ? mins->data_ptr<c10::Half>() : nullptr;
  if (rows > tile_rows && bits == 8)
    run_tiles<8>(xp, rows, qp, sp, mp, nullptr, bp, k, group, n, op);
  else if (rows > tile_rows)
    run_tiles<4>(xp, rows, qp, sp, mp, xsum, bp, k, group, n, op);
  else if (bits == 8)
    run_rows<8>(xp, rows, qp, sp, mp, nullptr, bp, k, group, n, op);
  else
    run_rows<4>(xp, rows, qp, sp, mp, xsum, bp, k, group, n, op);
  return prep.out;
#else
  TORCH_CHECK(false, "quant_linear: this build has no AVX512-BF16");
#endif
}

// The weight widened once, as run_tiles widens it on every call: (tiles [T, k / 2 * 32]
// int32, scales [T, groups * 32] float32, mins less 128 * scale (4-bit; else empty)), T =
// ceil(n / 32). A copy for steps of many rows (QuantLinear.add_packed_copy): about 2 bytes
// a value, and the same sums as run_tiles.
std::vector<at::Tensor> quant_tiles(const at::Tensor& qweight, const at::Tensor& scales,
                                    const std::optional<at::Tensor>& mins, int64_t bits,
                                    int64_t group) {
  const int64_t n = qweight.size(0), k = bits == 8 ? qweight.size(1) : qweight.size(1) * 2;
  ringserve::check_layout(qweight, scales, mins, bits, group, k);
  TORCH_CHECK(k % 32 == 0, "quant_tiles: k must be a multiple of 32");
  const int64_t tiles = (n + kTile - 1) / kTile, groups = k / group;
  auto opts = qweight.options();
  auto t = at::empty({tiles, k / 2 * kTile}, opts.dtype(at::kInt));
  auto sc = at::empty({tiles, groups * kTile}, opts.dtype(at::kFloat));
  auto mn = at::empty({bits == 4 ? tiles : 0, groups * kTile}, opts.dtype(at::kFloat));
#if defined(__AVX512BF16__)
  const auto* qp = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  const auto* sp = scales.data_ptr<c10::Half>();
  const c10::Half* mp = bits == 4 ? mins->data_ptr<c10::Half>() : nullptr;
  auto* tp = reinterpret_cast<uint32_t*>(t.data_ptr<int32_t>());
  float* scp = sc.data_ptr<float>();
  float* mnp = bits == 4 ? mn.data_ptr<float>() : nullptr;
  ringserve::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scratch(static_cast<size_t>(groups * kTile));
    for (int64_t i = t0; i < t1; ++i) {
      float* m = mnp != nullptr ? mnp + i * groups * kTile : scratch.data();
      if (bits == 8)
        widen_tile<8>(qp, sp, mp, i, k, group, n, tp + i * (k / 2) * kTile,
                      scp + i * groups * kTile, m);
      else
        widen_tile<4>(qp, sp, mp, i, k, group, n, tp + i * (k / 2) * kTile,
                      scp + i * groups * kTile, m);
    }
  });
  return {t, sc, mn};
#else
  TORCH_CHECK(false, "quant_tiles: this build has no AVX512-BF16");
#endif
}

// y = x w^T + b over quant_tiles' copy of w: run_tiles without its widening.
at::Tensor quant_linear_tiles(const at::Tensor& x, const at::Tensor& tiles,
                              const at::Tensor& scales, const at::Tensor& mins, int64_t bits,
                              int64_t group, int64_t n, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "quant_linear_tiles: x must be bf16 [m, k]");
  const int64_t k = x.size(1), rows = x.size(0), groups = k / group;
  const int64_t count = (n + kTile - 1) / kTile;
  TORCH_CHECK(bits == 8 || bits == 4, "quant_linear_tiles: bits must be 8 or 4");
  TORCH_CHECK(tiles.is_contiguous() && tiles.scalar_type() == at::kInt &&
                  tiles.size(0) == count && tiles.size(1) == k / 2 * kTile,
              "quant_linear_tiles: tiles must come from quant_tiles for this k and n");
  TORCH_CHECK(scales.is_contiguous() && scales.size(0) == count && scales.size(1) == groups * kTile,
              "quant_linear_tiles: scales must come from quant_tiles");
  TORCH_CHECK(bits == 8 || (mins.is_contiguous() && mins.size(0) == count),
              "quant_linear_tiles: 4-bit tiles need their mins");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->numel() == n),
              "quant_linear_tiles: bias must be bf16 [n]");
#if defined(__AVX512BF16__)
  const Operands prep = operands(x, bias, n, bits, group);
  const uint16_t* xp = prep.xp;
  const float* xsum = prep.sums();
  const auto* tp = reinterpret_cast<const uint32_t*>(tiles.data_ptr<int32_t>());
  const float* sp = scales.data_ptr<float>();
  const float* mp = bits == 4 ? mins.data_ptr<float>() : nullptr;
#if defined(RINGSERVE_AMX)
  if (ringserve::amx_wanted()) {  // panels of tiles (read from the copy), then blocks of x rows
    std::vector<uint16_t> pad;
    const uint16_t* xa = amx_rows(xp, rows, k, pad);
    const int64_t panel = amx_panel(k);
    ringserve::parallel_for(0, count, 1, [&](int64_t t0, int64_t t1) {
      const ringserve::AmxScope tiles_on(amx_config(amx_pairs(group)));
      for (int64_t p0 = t0; p0 < t1; p0 += panel) {
        const int64_t p1 = std::min(t1, p0 + panel);
        for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock)
          for (int64_t t = p0; t < p1; ++t) {
            const uint32_t* tile = tp + t * (k / 2) * kTile;
            const float* sct = sp + t * groups * kTile;
            // NOTE: on the panel's first pass, the next tile into L2 while this one is
            // multiplied, a few lines every second group: AMX takes a tile faster than the
            // hardware prefetcher brings the next from memory, and the whole tile asked for
            // at once stalled the core until the requests drained.
            ringserve::Ahead ahead;
            if (m0 == 0 && t + 1 < t1)  // fetch() calls: 16-row blocks x halves x pairs of groups
              ahead = ringserve::Ahead(tile + (k / 2) * kTile, k * 2 * kTile,
                                       (std::min(rows, kRowBlock) + 15) / 16 * 2 *
                                           ((groups + 1) / 2));
            const int64_t m1 = std::min(rows, m0 + kRowBlock);
            if (bits == 8)
              amx_tile_passes<8>(xa, m0, m1, nullptr, prep.bp, t, k, group, n, tile, sct,
                                 nullptr, prep.op, ahead);
            else
              amx_tile_passes<4>(xa, m0, m1, xsum, prep.bp, t, k, group, n, tile, sct,
                                 mp + t * groups * kTile, prep.op, ahead);
          }
      }
    });
    return prep.out;
  }
#endif
  ringserve::parallel_for(0, count, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint32_t* tile = tp + t * (k / 2) * kTile;
      const float* sct = sp + t * groups * kTile;
      if (bits == 8)
        tile_passes<8>(xp, rows, nullptr, prep.bp, t, k, group, n, tile, sct, nullptr, prep.op);
      else
        tile_passes<4>(xp, rows, xsum, prep.bp, t, k, group, n, tile, sct,
                       mp + t * groups * kTile, prep.op);
    }
  });
  return prep.out;
#else
  TORCH_CHECK(false, "quant_linear_tiles: this build has no AVX512-BF16");
#endif
}

// Whether the many-row path multiplies by AMX tiles (`on`: where the CPU has them): asks
// Linux for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA), which a CPU or
// kernel without AMX refuses. Returns whether AMX is now in use.
bool use_amx(bool on) {
#if defined(RINGSERVE_AMX)
  const bool ok = on && ringserve::amx_request();
  ringserve::amx_wanted_flag().store(ok);
  return ok;
#else
  (void)on;
  return false;
#endif
}

bool quant_linear_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

}  // namespace

RINGSERVE_FRAGMENT(RINGSERVE_NS, m) {
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int bits, "
        "int group, Tensor? bias, int tile_rows=8) -> Tensor");
  m.def("quant_linear_supported() -> bool", &quant_linear_supported);
  m.def("use_amx(bool on) -> bool", &use_amx);
  m.def("quant_tiles(Tensor qweight, Tensor scales, Tensor? mins, int bits, int group) -> Tensor[]");
  m.def("quant_linear_tiles(Tensor x, Tensor tiles, Tensor scales, Tensor mins, int bits, "
        "int group, int n, Tensor? bias) -> Tensor");
}

RINGSERVE_IMPL(RINGSERVE_NS, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_tiles", &quant_tiles);
  m.impl("quant_linear_tiles", &quant_linear_tiles);
}
