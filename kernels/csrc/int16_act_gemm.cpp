// y = x w^T + b for float32 activations over an int8 or 4-bit weight (kernels/quant.py's
// layout) by integer dot products: each x row is rounded once per call to int16 in blocks
// of 32 values (one float32 scale a block), weight values are widened to int16 in
// registers, and AVX2's madd (16 int16 x int16 products summed in pairs to int32) multiplies
// them; each block's int32 sums are scaled by (weight scale x block scale) into float32.
// From 32 x rows the weight is multiplied by panels of 16 weight rows instead
// (`run_panels`): the same sums, each chunk of a weight group summed whole in int32.
//
// Why: on CPUs without bf16 arithmetic (AVX2-only, AVX-512 without BF16) the float32 FMA
// path (compact_gemm.cpp) spends ~7 instructions widening 8 weight values to float32 before
// its FMA, and a decode step is compute-bound at ~3x its weight-read time; here 16 values
// take one widening and one madd. Why int16 and not int8 activations (llama.cpp's Q8
// blocks, one maddubs per 32 values): int8 blocks cost gemma-3-270m 3 points of top-1
// agreement over bf16 activations (94.3% vs 97.4% against float32, KL 10x;
// benchmarks/results/int16_activations.md); int16 blocks are finer than bf16 (a block's step
// is 1/65534 of its largest value) at about the same instruction count.
//
// Numbers: x block b (values 32b .. 32b + 31) has d_b = max|x| / 32767 and
// q_j = round_half_even(x_j * (1 / d_b)), |q_j| <= 32767 (d_b = 0: all q_j = 0). Then
//   int8 weights:  y = sum_b d_b * sum_{j in b} (s_{g(j)} * w_j) * q_j
//   4-bit weights: y = sum_b d_b * sum_{j in b} (s_{g(j)} * w_j) * q_j + sum_g m_g * X_g
// where X_g is the float32 sum of the unrounded x over weight group g: the mins see x
// exactly. Integer sums are exact (|w| <= 128: a block's 32 products stay below 2^27).
// kernels/quant.py's `int16_act_matmul_reference` computes the same in float64.
//
// Weight groups: 16 (GGUF's Q6_K sub-blocks; int8 only) or a multiple of 32.
// MXFP4 weights (`int16_act_mxfp4_linear`, mxfp4.h) go the int8 way: each block's 32 codes
// decoded by a byte shuffle to twice their E2M1 value (|w| <= 12), its scale half the
// block's power of two: y = sum_b d_b * sum_{j in b} (e8m0_half(e_b) * w_j) * q_j. For
// gpt-oss's experts on AVX2 that is ~3x fewer instructions a weight than the float32 FMA
// path (compact_gemm.cpp), which ran its experts compute-bound at a third of the
// machine's read rate (docs/benchmarks.md, "A GGUF served from its own bytes").
// Builds without AVX2 (the portable variant) compute the same sums in plain C++, slowly:
// `int16_act_fast()` says which, and the engine uses this path only where it is fast.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "bf16.h"
#include "ops.h"
#include "thread_pool.h"
#include "quant_layout.h"
#include "int16_acts.h"
#include "mxfp4.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = ringserve::kActBlock;  // x values per int16 scale
constexpr int64_t kMaxRows = 4;  // x rows a pass over a weight row
// One x row: four weight rows a pass, prefetched into L2 four passes ahead (measured best on
// Zen 4), or as more x rows are (two, L1, two ahead: measured best on Zen 3); dot_rows.
#if defined(__AVX512F__)
constexpr bool kOneRowToL2 = true;
#else
constexpr bool kOneRowToL2 = false;
#endif

using ringserve::Acts;
using ringserve::quantize_acts;

struct Weight {
  const uint8_t* data;  // row r at data + r * row_bytes
  int64_t row_bytes, k, group, groups, gpad;
  int64_t sper;  // a row's scales as `widen_scales` lays them out: groups (16) or blocks
  const c10::Half* scales;  // [n, groups]
  const c10::Half* mins;    // [n, groups] (4-bit) or null
  const uint8_t* exponents;  // [n, groups] (MXFP4: E8M0; `scales` is then null)
  bool split;  // MXFP4 nibble order: GGUF's (value i low, 16 + i high) or transformers'
};

constexpr int kMxfp4 = 1;  // BITS of an MXFP4 weight (the int8 loops, codes decoded)

// A weight row's float16 scales (or mins) as float32, zero-padded to `pad` values.
inline void widen_halves(const c10::Half* h, int64_t count, int64_t pad, float* out) {
  int64_t g = 0;
#if defined(__AVX2__)
  for (; g + 8 <= count; g += 8)
    _mm256_storeu_ps(out + g, _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + g))));
#endif
  for (; g < count; ++g) out[g] = static_cast<float>(h[g]);
  for (; g < pad; ++g) out[g] = 0.f;
}

// A weight row's float16 scales as float32, one per 32-value block (one per 16-value group
// where the group is 16), so that the block loops index them without a division.
// NOTE: the loops had divided the value index by the run-time group, one 64-bit idiv per
// row and block: the int8 head at one x row ran ~1.3x slower from cache for it.
inline void widen_scales(const Weight& w, int64_t row, float* out) {
  if (w.exponents != nullptr) {  // MXFP4: a scale a block of 32
    const uint8_t* e = w.exponents + row * w.groups;
    for (int64_t b = 0; b < w.groups; ++b) out[b] = ringserve::e8m0_half(e[b]);
    return;
  }
  const c10::Half* h = w.scales + row * w.groups;
  if (w.group <= kBlock) {
    widen_halves(h, w.groups, w.groups, out);
    return;
  }
  const int64_t per_group = w.group / kBlock;
  for (int64_t g = 0, b = 0; g < w.groups; ++g) {
    const float s = static_cast<float>(h[g]);
    for (int64_t t = 0; t < per_group; ++t) out[b++] = s;
  }
}

#if defined(__AVX2__)

using ringserve::hsum;

// NOTE: all R rows' block b is widened before any multiply, even for one x row, where the
// AVX2 build then spills registers. A one-row variant that multiplied each weight row as it
// loaded (no spills, the same sums bit for bit) ran 1.5x faster from cache but 1.1-1.3x
// slower from memory, the head at 1 row included (both libraries in one process,
// interleaved, 2026-12-04); a step reads its weights from memory, so the loads stay first.
// The 32 values of block b of R weight rows, as int16 in two halves (values 0-15, 16-31),
// dotted with block b of M x rows into acc, each half scaled by its weight group's scale
// (slo, shi: equal unless the group is 16) and the block by the x block's scale.
template <int M, int R>
inline void mul_block(const __m256i* lo, const __m256i* hi, const __m256* slo,
                      const __m256* shi, bool g16, const int16_t* xq, const float* xd,
                      int64_t k, int64_t blocks, int64_t b, __m256 (&acc)[R][M]) {
  const int64_t j = b * kBlock;
  for (int m = 0; m < M; ++m) {
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * k + j));
    const __m256i x1 =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * k + j + 16));
    const __m256 d = _mm256_set1_ps(xd[m * blocks + b]);
    for (int i = 0; i < R; ++i) {
      const __m256i p0 = _mm256_madd_epi16(lo[i], x0), p1 = _mm256_madd_epi16(hi[i], x1);
      if (g16) {  // two weight groups: each half its own scale
        const __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), slo[i],
                                         _mm256_mul_ps(_mm256_cvtepi32_ps(p1), shi[i]));
        acc[i][m] = _mm256_fmadd_ps(f, d, acc[i][m]);
      } else {
        const __m256 f = _mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1));
        acc[i][m] = _mm256_fmadd_ps(_mm256_mul_ps(f, slo[i]), d, acc[i][m]);
      }
    }
  }
}

inline __m256i load16_epi16(const uint8_t* p, bool is_signed) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return is_signed ? _mm256_cvtepi8_epi16(b) : _mm256_cvtepu8_epi16(b);
}

// A 4-bit row's 64 values from their 32 bytes at p (kernels/quant.py: values 0-31 in the
// low nibbles, 32-63 in the high ones) as int16: values 0-15, 16-31, 32-47, 48-63.
inline void widen_nibbles(const uint8_t* p, __m256i (&v)[4]) {
  const __m256i nibble = _mm256_set1_epi16(0x0F);
  const __m256i a = load16_epi16(p, false), c = load16_epi16(p + 16, false);
  v[0] = _mm256_and_si256(a, nibble);
  v[1] = _mm256_and_si256(c, nibble);
  v[2] = _mm256_srli_epi16(a, 4);
  v[3] = _mm256_srli_epi16(c, 4);
}

// Weight rows [r, r + R) dotted with x rows [0, M) (x rows from `xq` / `xd` / `gs`).
template <int BITS, int M, int R>
inline void dot_rows(const Weight& w, const int16_t* xq, const float* xd, const float* gs,
                     int64_t blocks, int64_t r, int64_t n, const float* bias, float* sf,
                     float* mf, float* out) {
  const int64_t k = w.k;
  // NOTE: the rows a few calls ahead are fetched now: the hardware prefetcher alone streamed
  // gemma's head at ~20 GB/s of the machine's 36 (measured: the same rows from cache ran
  // twice as fast). For one x row they go to L2, four calls ahead: fetched into L1 two calls
  // ahead (as before 2026-12-04) the int8 head at one x row ran at 19-21 GB/s, into L2 at
  // 24-25 against a torch sum's 27-29 in the same process; a step's small 4-bit matrices
  // (o_proj 640 x 1024, half of down 640 x 2048) went from 7.5-8 to 10-11 GB/s (Zen 4, AVX2
  // build, interleaved). The same change made 3 x rows 1.3x slower: those keep L1.
  // On a real AVX2-only CPU (Zen 3) the other way round: one x row with two weight rows a
  // pass and L1 two calls ahead (as for two x rows) took the head from 8.0-10.5 to 6.2-6.8
  // ms and a step's layers from 5.8-6.6 to 4.7-5.3 ms (three runs each, 2026-12-05,
  // kOneRowToL2 below). So the AVX2 build, which AVX2-only CPUs run, keeps L1; the AVX-512
  // builds keep what the Zen 4 measured. Prefetches never fault; the range stops at the
  // weight's end.
  constexpr bool kToL2 = M == 1 && kOneRowToL2;
  constexpr int kPasses = kToL2 ? 4 : 2;
  // NOTE: the hint spelled out in each branch: _mm_prefetch wants a literal (a macro in
  // clang's headers, where there is no _mm_hint type to cast to).
  const auto fetch = [](const char* p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) {
      if constexpr (kToL2)
        _mm_prefetch(p + o, _MM_HINT_T1);
      else
        _mm_prefetch(p + o, _MM_HINT_T0);
    }
  };
  const int64_t ahead = std::min(r + kPasses * R, n);
  const int64_t ahead_rows = std::min<int64_t>(R, n - ahead);
  fetch(reinterpret_cast<const char*>(w.data + ahead * w.row_bytes), ahead_rows * w.row_bytes);
  if (w.exponents != nullptr)
    fetch(reinterpret_cast<const char*>(w.exponents + ahead * w.groups), ahead_rows * w.groups);
  else
    fetch(reinterpret_cast<const char*>(w.scales + ahead * w.groups), ahead_rows * w.groups * 2);
  const uint8_t* rows[R];
  for (int i = 0; i < R; ++i) {
    rows[i] = w.data + (r + i) * w.row_bytes;
    widen_scales(w, r + i, sf + i * w.sper);
    if constexpr (BITS == 4)
      widen_halves(w.mins + (r + i) * w.groups, w.groups, w.gpad, mf + i * w.gpad);
  }
  __m256 acc[R][M];
  for (int i = 0; i < R; ++i)
    for (int m = 0; m < M; ++m) acc[i][m] = _mm256_setzero_ps();
  const bool g16 = w.group == 16;
  __m256i lo[R], hi[R];
  __m256 slo[R], shi[R];
  // Two blocks a pass, `decode(i, b, v)` giving blocks b and b + 1 of weight row i as int16
  // (values 0-15 and 16-31 of each), up to `end`.
  const auto pairs = [&](auto decode, int64_t end) {
    __m256i lo1[R], hi1[R];
    __m256 s1[R];
    for (int64_t b = 0; b < end; b += 2) {
      for (int i = 0; i < R; ++i) {
        __m256i v[4];
        decode(i, b, v);
        lo[i] = v[0];
        hi[i] = v[1];
        lo1[i] = v[2];
        hi1[i] = v[3];
        slo[i] = _mm256_set1_ps(sf[i * w.sper + b]);
        s1[i] = _mm256_set1_ps(sf[i * w.sper + b + 1]);
      }
      mul_block<M, R>(lo, hi, slo, slo, false, xq, xd, k, blocks, b, acc);
      mul_block<M, R>(lo1, hi1, s1, s1, false, xq, xd, k, blocks, b + 1, acc);
    }
  };
  if constexpr (BITS == 4) {
    // A 64-value chunk's 32 bytes hold block b in their low nibbles and block b + 1 in their
    // high nibbles (kernels/quant.py): bytes 0-15 and 16-31 widened once give both.
    pairs([&](int i, int64_t b, __m256i (&v)[4]) {
      widen_nibbles(rows[i] + b * kBlock / 2, v);
    }, blocks);
  } else if constexpr (BITS == kMxfp4) {
    // two blocks a pass (one 256-bit decode for both: 3-15% faster than one at a time at
    // 1 and 2 x rows, gpt-oss's down_proj from memory, AVX2 EPYC), then an odd last one
    pairs([&](int i, int64_t b, __m256i (&v)[4]) {
      ringserve::fp4_pair_int16(rows[i] + b * 16, w.split, v);
    }, blocks & ~int64_t{1});
    for (int64_t b = blocks & ~int64_t{1}; b < blocks; ++b) {
      for (int i = 0; i < R; ++i) {
        __m128i v0, v1;
        ringserve::fp4_block_int8(rows[i] + b * 16, w.split, v0, v1);
        lo[i] = _mm256_cvtepi8_epi16(v0);
        hi[i] = _mm256_cvtepi8_epi16(v1);
        slo[i] = _mm256_set1_ps(sf[i * w.sper + b]);
      }
      mul_block<M, R>(lo, hi, slo, slo, false, xq, xd, k, blocks, b, acc);
    }
  } else {
    // One loop for each group size, so that neither tests the group in its body.
    const auto blocks_of = [&](auto sixteen) {
      constexpr bool G16 = decltype(sixteen)::value;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t j = b * kBlock;
        for (int i = 0; i < R; ++i) {
          lo[i] = load16_epi16(rows[i] + j, true);
          hi[i] = load16_epi16(rows[i] + j + 16, true);
          const float* s = sf + i * w.sper;
          slo[i] = _mm256_set1_ps(G16 ? s[2 * b] : s[b]);
          shi[i] = G16 ? _mm256_set1_ps(s[2 * b + 1]) : slo[i];
        }
        mul_block<M, R>(lo, hi, slo, shi, G16, xq, xd, k, blocks, b, acc);
      }
    };
    if (g16)
      blocks_of(std::true_type{});
    else
      blocks_of(std::false_type{});
  }
  if constexpr (BITS == 4)
    for (int64_t g = 0; g < w.gpad; g += 8)
      for (int i = 0; i < R; ++i) {
        const __m256 mv = _mm256_loadu_ps(mf + i * w.gpad + g);
        for (int m = 0; m < M; ++m)
          acc[i][m] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(gs + m * w.gpad + g), acc[i][m]);
      }
  for (int i = 0; i < R; ++i) {
    const float bv = bias != nullptr ? bias[r + i] : 0.f;
    for (int m = 0; m < M; ++m) out[m * n + r + i] = hsum(acc[i][m]) + bv;
  }
}

// Many x rows (prefill chunks, large decode batches): panels of 16 weight rows widened once
// to int16 pairs, pair p of row i at lane i (two vectors of 8), and x's pair (2p, 2p + 1)
// broadcast as one int32, so that each madd adds 16 products into the int32 sums of 8 weight
// rows; a chunk of min(group, 32) values is summed exactly in int32 before its one float
// step (y += (sum * s) * d, and a 4-bit group's mins once), where the passes above convert
// every 4 products and widen each weight value once per 4 x rows.
// NOTE: measured on Zen 3 (2 cores, 2026-12-05; the library before and after this loaded side
// by side in one process, calls interleaved): gemma's matrices at 128 and 512 x rows
// 1.5-1.7x faster than the passes above for int8 (gate_up, 4096 x 640, at 128 rows 3.4 ms
// against 5.2: ~100 G products a second, where oneDNN's float32 GEMM of the widened weight
// ran 70-83 G) and 1.3-1.5x for 4-bit; at 32 rows 0.97-1.22x, at 16 slower for a group of 16
// (packing a panel costs about what 16 rows' products do): so from 32 rows. A ~300-token
// prefill of gemma-3-270m went from 624-756 ms to 446-516. `benchmarks/quant_linear_bench.py
// --rows 32,128,512` times this path against the float32 FMA one (2.3x at 128 rows).
constexpr int64_t kPanel = 16;          // weight rows a panel
constexpr int MaxPanelRows = 4;         // x rows a pass over a panel's chunk: 8 int32 sums
constexpr int64_t kPanelMinRows = 32;   // x rows from which `run` takes the panels

template <typename T>
T* aligned32(T* p) {
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 31) & ~uintptr_t{31});
}

// Weight rows [n0, n0 + 16) (rows from n on are zero) as `run_panels` reads them: pairs
// of int16 values, each chunk's scales, and (4-bit) each chunk's mins where the chunk starts
// a weight group (0 elsewhere: a group's mins are added once).
template <int BITS>
inline void pack_panel(const Weight& w, int64_t n0, int64_t n, int64_t chunk, int16_t* panel,
                       float* scale, float* mins) {
  const int64_t k = w.k, chunks = k / chunk;
  alignas(32) int16_t wide[64];
  for (int64_t i = 0; i < kPanel; ++i) {
    const int64_t r = n0 + i;
    int32_t* dst = reinterpret_cast<int32_t*>(panel) + i;
    if (r >= n) {
      for (int64_t p = 0; p < k / 2; ++p) dst[p * kPanel] = 0;
      for (int64_t c = 0; c < chunks; ++c) scale[c * kPanel + i] = mins[c * kPanel + i] = 0.f;
      continue;
    }
    const uint8_t* row = w.data + r * w.row_bytes;
    // (k is a multiple of 64 for 4-bit weights, of 32 for int8)
    constexpr int64_t kStep = BITS == 4 ? 64 : 32;
    for (int64_t j = 0; j < k; j += kStep) {
      if constexpr (BITS == kMxfp4) {
        __m128i v0, v1;
        ringserve::fp4_block_int8(row + j / 2, w.split, v0, v1);
        _mm256_store_si256(reinterpret_cast<__m256i*>(wide), _mm256_cvtepi8_epi16(v0));
        _mm256_store_si256(reinterpret_cast<__m256i*>(wide + 16), _mm256_cvtepi8_epi16(v1));
      } else if constexpr (BITS == 4) {
        __m256i parts[4];
        widen_nibbles(row + j / 2, parts);
        for (int t = 0; t < 4; ++t)
          _mm256_store_si256(reinterpret_cast<__m256i*>(wide + 16 * t), parts[t]);
      } else {
        for (int t = 0; t < 2; ++t)
          _mm256_store_si256(reinterpret_cast<__m256i*>(wide + 16 * t),
                             load16_epi16(row + j + 16 * t, true));
      }
      const int32_t* pairs = reinterpret_cast<const int32_t*>(wide);
      for (int64_t t = 0; t < kStep / 2; ++t) dst[(j / 2 + t) * kPanel] = pairs[t];
    }
    if constexpr (BITS == kMxfp4) {  // (chunk = group = 32)
      for (int64_t c = 0; c < chunks; ++c) {
        scale[c * kPanel + i] = ringserve::e8m0_half(w.exponents[r * w.groups + c]);
        mins[c * kPanel + i] = 0.f;
      }
      continue;
    }
    const c10::Half* h = w.scales + r * w.groups;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t g = c * chunk / w.group;
      scale[c * kPanel + i] = static_cast<float>(h[g]);
      mins[c * kPanel + i] = BITS == 4 && c * chunk % w.group == 0
          ? static_cast<float>(w.mins[r * w.groups + g]) : 0.f;
    }
  }
}

// x rows [m0, m0 + M) times one packed panel into y[m, 16] (row stride `ldy`).
template <int BITS, int M>
inline void panel_rows(const int16_t* panel, const float* scale, const float* mins,
                       const Acts& a, int64_t group, int64_t chunk, int64_t m0, float* y,
                       int64_t ldy) {
  const int64_t k = a.k, blocks = a.blocks;
  const int16_t* xq = a.q.data();
  __m256 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const int64_t pairs = chunk / 2;
  for (int64_t c = 0, j = 0; j < k; ++c, j += chunk) {
    __m256i sum[M][2];
    for (int m = 0; m < M; ++m) sum[m][0] = sum[m][1] = _mm256_setzero_si256();
    const int16_t* pp = panel + j * kPanel;
    for (int64_t p = 0; p < pairs; ++p) {
      const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(pp + p * 32));
      const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(pp + p * 32 + 16));
      for (int m = 0; m < M; ++m) {
        int32_t pair;
        std::memcpy(&pair, xq + (m0 + m) * k + j + 2 * p, 4);
        const __m256i xv = _mm256_set1_epi32(pair);
        sum[m][0] = _mm256_add_epi32(sum[m][0], _mm256_madd_epi16(w0, xv));
        sum[m][1] = _mm256_add_epi32(sum[m][1], _mm256_madd_epi16(w1, xv));
      }
    }
    const __m256 s0 = _mm256_load_ps(scale + c * kPanel), s1 = _mm256_load_ps(scale + c * kPanel + 8);
    for (int m = 0; m < M; ++m) {
      const __m256 d = _mm256_set1_ps(a.d[(m0 + m) * blocks + j / kBlock]);
      acc[m][0] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sum[m][0]), s0), d, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sum[m][1]), s1), d, acc[m][1]);
    }
    if (BITS == 4 && j % group == 0) {  // the group's mins times x's float sum over it
      const __m256 m0v = _mm256_load_ps(mins + c * kPanel), m1v = _mm256_load_ps(mins + c * kPanel + 8);
      for (int m = 0; m < M; ++m) {
        const __m256 xs = _mm256_set1_ps(a.gsum[(m0 + m) * a.gpad + j / group]);
        acc[m][0] = _mm256_fmadd_ps(m0v, xs, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(m1v, xs, acc[m][1]);
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    _mm256_storeu_ps(y + (m0 + m) * ldy, acc[m][0]);
    _mm256_storeu_ps(y + (m0 + m) * ldy + 8, acc[m][1]);
  }
}

// `run` for many x rows: panels dealt out over the threads, each packed once and multiplied
// by every x row.
template <int BITS>
inline void run_panels(const Weight& w, const Acts& a, int64_t rows, int64_t n,
                       const float* bias, float* out) {
  const int64_t k = w.k, chunk = std::min<int64_t>(w.group, kBlock);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  ringserve::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    // (32-byte aligned: the panel's vectors are loaded aligned)
    std::vector<int16_t> pbuf(static_cast<size_t>(k * kPanel + 16));
    std::vector<float> sbuf(static_cast<size_t>(2 * (k / chunk * kPanel + 8)));
    int16_t* panel = aligned32(pbuf.data());
    float* scale = aligned32(sbuf.data());
    float* mins = scale + k / chunk * kPanel;
    std::vector<float> y(static_cast<size_t>(rows * kPanel));
    for (int64_t pi = begin; pi < end; ++pi) {
      const int64_t n0 = pi * kPanel, width = std::min(kPanel, n - n0);
      pack_panel<BITS>(w, n0, n, chunk, panel, scale, mins);
      for (int64_t m0 = 0; m0 < rows; m0 += MaxPanelRows)
        ringserve::with_rows<MaxPanelRows>(rows - m0, [&](auto mr) {
          panel_rows<BITS, decltype(mr)::value>(panel, scale, mins, a, w.group, chunk, m0,
                                                y.data(), kPanel);
        });
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t i = 0; i < width; ++i)
          out[m * n + n0 + i] = y[m * kPanel + i] + (bias != nullptr ? bias[n0 + i] : 0.f);
    }
  });
}

#else  // no AVX2: the same sums in plain C++

template <int BITS, int M, int R>
inline void dot_rows(const Weight& w, const int16_t* xq, const float* xd, const float* gs,
                     int64_t blocks, int64_t r, int64_t n, const float* bias, float* sf,
                     float* mf, float* out) {
  const int64_t k = w.k;
  for (int i = 0; i < R; ++i) {
    const uint8_t* row = w.data + (r + i) * w.row_bytes;
    widen_scales(w, r + i, sf);
    if constexpr (BITS == 4) widen_halves(w.mins + (r + i) * w.groups, w.groups, w.gpad, mf);
    for (int m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        float part = 0.f;  // the block's float sum of its groups' int32 sums
        for (int64_t j0 = b * kBlock; j0 < (b + 1) * kBlock;) {
          const int64_t g = j0 / w.group, j1 = std::min((b + 1) * kBlock, (g + 1) * w.group);
          int32_t dot = 0;
          for (int64_t j = j0; j < j1; ++j) {
            const int32_t wq = BITS == kMxfp4
                ? ringserve::kE2M1x2[ringserve::fp4_code(row + (j >> 5) * 16, w.split, j & 31)]
                : BITS == 4 ? (row[(j >> 6) * 32 + (j & 31)] >> ((j & 32) >> 3)) & 0xF
                : static_cast<int8_t>(row[j]);
            dot += wq * xq[m * k + j];
          }
          part += static_cast<float>(dot) * sf[w.group == 16 ? g : b];
          j0 = j1;
        }
        acc += part * xd[m * blocks + b];
      }
      if constexpr (BITS == 4)
        for (int64_t g = 0; g < w.groups; ++g) acc += mf[g] * gs[m * w.gpad + g];
      out[m * n + r + i] = acc + (bias != nullptr ? bias[r + i] : 0.f);
    }
  }
}

#endif

// Weight rows [n0, n1) for x rows [0, M).
template <int BITS, int M>
void dot_block(const Weight& w, const Acts& a, int64_t m0, int64_t n0, int64_t n1, int64_t n,
               const float* bias, float* sf, float* mf, float* out) {
  // NOTE: weight rows side by side give one x row independent sums (four with one row on
  // the AVX-512 builds; two in the AVX2 build: see kOneRowToL2); more would spill AVX2's
  // 16 registers.
  constexpr int R = M == 1 && kOneRowToL2 ? 4 : 2;
  const int16_t* xq = a.q.data() + m0 * a.k;
  const float* xd = a.d.data() + m0 * a.blocks;
  const float* gs = a.gsum.data() + m0 * a.gpad;
  int64_t r = n0;
  for (; r + R <= n1; r += R)
    dot_rows<BITS, M, R>(w, xq, xd, gs, a.blocks, r, n, bias, sf, mf, out + m0 * n);
  for (; r < n1; ++r)
    dot_rows<BITS, M, 1>(w, xq, xd, gs, a.blocks, r, n, bias, sf, mf, out + m0 * n);
}

template <int BITS>
void run(const Weight& w, const Acts& a, int64_t rows, int64_t n, const float* bias,
         float* out) {
#if defined(__AVX2__)
  if (rows >= kPanelMinRows) {
    run_panels<BITS>(w, a, rows, n, bias, out);
    return;
  }
#endif
  // NOTE: 16 weight rows a task at least; blocks of 64 weight rows (20-40 KiB for k = 640)
  // stay in cache across the passes of kMaxRows x rows.
  ringserve::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> sf(static_cast<size_t>(4 * w.sper + 8)), mf(4 * w.gpad + 8);
    for (int64_t b0 = begin; b0 < end; b0 += 64) {
      const int64_t b1 = std::min(end, b0 + 64);
      for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows)
        ringserve::with_rows<kMaxRows>(rows - m0, [&](auto mr) {
          dot_block<BITS, decltype(mr)::value>(w, a, m0, b0, b1, n, bias, sf.data(),
                                               mf.data(), out);
        });
    }
  });
}

// What both entry points hold through a call: x contiguous, the bias as float32 (or none),
// and the output [m, n].
struct Call {
  at::Tensor x, out;
  std::optional<at::Tensor> bias;
  Call(const at::Tensor& x_, int64_t n, const std::optional<at::Tensor>& bias_)
      : x(x_.contiguous()), out(at::empty({x_.size(0), n}, x_.options())),
        bias(bias_.has_value() ? std::optional<at::Tensor>(bias_->to(at::kFloat).contiguous())
                               : std::nullopt) {}
  const float* bias_data() const { return bias.has_value() ? bias->data_ptr<float>() : nullptr; }
};

// x: [m, k] float32; weight, scales, mins: kernels/quant.py's int8 / 4-bit layout with a
// group of 16 (int8) or a multiple of 32; bias: [n] or None. Returns [m, n] float32.
at::Tensor int16_act_linear(const at::Tensor& x, const at::Tensor& qweight,
                           const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                           int64_t bits, int64_t group, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat,
              "int16_act_linear: x must be float32 [m, k]");
  const int64_t k = x.size(1), n = qweight.size(0), rows = x.size(0);
  ringserve::check_layout(qweight, scales, mins, bits, group, k);
  TORCH_CHECK(group % kBlock == 0 || (bits == 8 && group == 16),
              "int16_act_linear: the weight group must be a multiple of 32 (or 16 for int8)");
  TORCH_CHECK(!bias.has_value() || bias->numel() == n, "int16_act_linear: bias must be [n]");
  const Call c(x, n, bias);
  if (rows == 0 || n == 0) return c.out;
  const Acts a = quantize_acts(c.x.data_ptr<float>(), rows, k, group, bits == 4);
  Weight w{};
  w.data = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  w.row_bytes = bits == 8 ? k : k / 2;
  w.k = k;
  w.group = group;
  w.groups = k / group;
  w.sper = group == 16 ? w.groups : k / kBlock;
  w.gpad = a.gpad;
  w.scales = scales.data_ptr<c10::Half>();
  w.mins = bits == 4 ? mins->data_ptr<c10::Half>() : nullptr;
  if (bits == 8)
    run<8>(w, a, rows, n, c.bias_data(), c.out.data_ptr<float>());
  else
    run<4>(w, a, rows, n, c.bias_data(), c.out.data_ptr<float>());
  return c.out;
}

// x: [m, k] float32; blocks: uint8 [n, k / 32, 16] (two E2M1 codes a byte, in GGUF's
// order with `split`, else transformers'); exponents: uint8 [n, k / 32] (E8M0); bias: [n]
// or None. Returns [m, n] float32.
at::Tensor int16_act_mxfp4_linear(const at::Tensor& x, const at::Tensor& blocks,
                                  const at::Tensor& exponents,
                                  const std::optional<at::Tensor>& bias, bool split) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat,
              "int16_act_mxfp4_linear: x must be float32 [m, k]");
  const int64_t k = x.size(1), n = blocks.size(0), rows = x.size(0);
  TORCH_CHECK(k % kBlock == 0, "int16_act_mxfp4_linear: k must be a multiple of 32");
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(1) == k / kBlock && blocks.size(2) == 16,
              "int16_act_mxfp4_linear: blocks must be uint8 [n, k / 32, 16], contiguous");
  TORCH_CHECK(exponents.dim() == 2 && exponents.scalar_type() == at::kByte &&
                  exponents.is_contiguous() && exponents.size(0) == n &&
                  exponents.size(1) == k / kBlock,
              "int16_act_mxfp4_linear: exponents must be uint8 [n, k / 32], contiguous");
  TORCH_CHECK(!bias.has_value() || bias->numel() == n, "int16_act_mxfp4_linear: bias must be [n]");
  const Call c(x, n, bias);
  if (rows == 0 || n == 0) return c.out;
  const Acts a = quantize_acts(c.x.data_ptr<float>(), rows, k, kBlock, false);
  Weight w{};
  w.data = blocks.data_ptr<uint8_t>();
  w.row_bytes = k / 2;
  w.k = k;
  w.group = kBlock;
  w.groups = k / kBlock;
  w.sper = w.groups;
  w.gpad = a.gpad;
  w.exponents = exponents.data_ptr<uint8_t>();
  w.split = split;
  run<kMxfp4>(w, a, rows, n, c.bias_data(), c.out.data_ptr<float>());
  return c.out;
}

// Whether this build multiplies with SIMD integer dot products (AVX2 and up), as opposed
// to the plain C++ sums of the portable build.
bool int16_act_fast() {
#if defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

}  // namespace

RINGSERVE_FRAGMENT(RINGSERVE_NS, m) {
  m.def("int16_act_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int bits, "
        "int group, Tensor? bias) -> Tensor");
  m.def("int16_act_mxfp4_linear(Tensor x, Tensor blocks, Tensor exponents, Tensor? bias, "
        "bool split) -> Tensor");
  m.def("int16_act_fast() -> bool", &int16_act_fast);
}

RINGSERVE_IMPL(RINGSERVE_NS, m) {
  m.impl("int16_act_linear", &int16_act_linear);
  m.impl("int16_act_mxfp4_linear", &int16_act_mxfp4_linear);
}
