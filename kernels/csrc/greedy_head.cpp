// Greedy decoding's output head without multiplying the whole head at full precision
// (docs/cpu.md, "The greedy head").
//
// A greedy row only needs its first maximum. An approximate pass over the int8 head (its own
// values q and group scales, exact) against x rounded to int8 at one scale a row gives each
// vocabulary row r a value a_r with
//
//     |sum_d w_rd x_d - a_r| <= ||w_r|| ||x - x^||       (Cauchy-Schwarz; x^: x as rounded)
//
// widened by the exact path's own float and bf16 rounding: b_r. Every r whose exact logit
// can reach the largest lower bound, a_r + b_r >= max_s (a_s - b_s), is a candidate; every
// first maximum of the exact logits is among them. The caller multiplies only the
// candidates exactly, through the head's own path, so its pick is the full head's, bit for
// bit. The batch's kOut largest dims (a hidden state's few huge values would set the scale
// of every other) are left out of the rounding and multiplied in float.
//
// The multiply is vpdpbusd: 64 one-byte products a vector, twice dpbf16's 32, reading one
// byte a weight (the bf16 copy large steps read is two). The copy holds q + 128 as unsigned
// bytes in tiles of 16 rows x 4 values (a lane's four bytes are one row's four values), x
// rides as the signed, broadcast operand; each group's sums start at -128 * sum(x digits),
// which takes off what the offset adds.
//
// Builds with AVX2 but no AVX512-VNNI run the same pass on the same copy with vpmaddubsw
// (unsigned bytes times signed bytes, pairs summed to int16) and vpmaddwd by ones (int16
// pairs to int32): three instructions for 32 byte products. x is rounded to 7 bits there
// (|digit| <= 63), so that a pair's sum, at most 2 x 255 x 63 = 32130, cannot saturate
// int16; the coarser rounding only widens the bound (more candidates, the same pick).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#if defined(__AVX512VNNI__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "amx.h"
#include "ops.h"
#include "prefetch.h"
#include "thread_pool.h"

#include "bf16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

namespace {

constexpr int64_t kRows = 16;     // vocabulary rows a tile: one vector of int32 sums
constexpr int64_t kOut = 8;       // the batch's largest dims, multiplied in float apart
constexpr int64_t kBlock = 8;     // x rows a pass over a tile
constexpr int64_t kChunks = 64;   // work items of the vocabulary (their lists are merged)
constexpr size_t kCompact = 4096; // a chunk's list is filtered again past this many
#if defined(__AVX512VNNI__)
constexpr double kDigit = 127.0;  // x's largest digit: vpdpbusd sums in int32
constexpr bool kGroupScales = false;
#else
constexpr double kDigit = 63.0;  // vpmaddubsw's int16 pair sums: 2 x 255 x 63 < 32767
// NOTE: a scale a weight group, not one a row: on gemma-3-270m's hidden states 7-bit digits
// at one scale a row left ||x - x^|| at 3.2 (||x|| 160) and a row kept a median of 76-194
// candidates; a scale a group of 32 halves the error (1.5, what 8 bits at one scale a row
// give), for one multiply a group and x row.
constexpr bool kGroupScales = true;
#endif

// One x row, rounded: signed-byte digits (|digit| <= kDigit) at one scale a row, or one a
// weight group (kGroupScales), with the batch's kOut dims zeroed (those are multiplied in
// float), the offsets the unsigned weights add (-128 * the digits' sum, a group at a time),
// and what the bound needs.
struct XRow {
  std::vector<int32_t> main;    // k / 4 quads of 4 signed bytes
  std::vector<int32_t> offset;  // per group: -128 * sum of its digits
  std::vector<float> outs;      // x at the batch's outlier dims
  std::vector<float> gscale;    // per group: its digits' scale (all equal without kGroupScales)
  float scale = 0.f;            // the row's scale (1 with kGroupScales: gscale holds them)
  // ||x - x^|| widened by room for the exact path's own errors: its float sums (k terms,
  // each product exact: 2^-12 ||x|| in norm, a few times over), the int16 blocks x is
  // rounded to on the one-byte path and on float32 rows' int16 path (2^-16 sqrt(k) max|x|,
  // twice over); the bf16 its logits are rounded to (2^-9 of the value) is the kernel's
  // 2^-8 (|a_r| + b_r).
  float room = 0.f;
};

template <typename T>
XRow round_row(const T* x, int64_t k, int64_t group, const std::vector<int64_t>& dims) {
  XRow r;
  std::vector<double> v(static_cast<size_t>(k));
  for (int64_t d = 0; d < k; ++d) v[d] = static_cast<double>(ringserve::to_f(x[d]));
  std::vector<bool> out(static_cast<size_t>(k), false);
  for (int64_t d : dims) {
    out[d] = true;
    r.outs.push_back(static_cast<float>(v[d]));
  }
  const int64_t groups = k / group;
  double top = 0, all = 0, norm2 = 0;
  std::vector<double> gtop(static_cast<size_t>(groups), 0.0);
  for (int64_t d = 0; d < k; ++d) {
    if (!out[d]) {
      top = std::max(top, std::abs(v[d]));
      gtop[d / group] = std::max(gtop[d / group], std::abs(v[d]));
    }
    all = std::max(all, std::abs(v[d]));
    norm2 += v[d] * v[d];
  }
  // NOTE: the rounding done with the float scales the kernel multiplies by, so that the
  // error measured below is the one its sums carry.
  r.scale = kGroupScales ? 1.f : static_cast<float>(top / kDigit);
  for (int64_t g = 0; g < groups; ++g)
    r.gscale.push_back(kGroupScales ? static_cast<float>(gtop[g] / kDigit) : r.scale);
  std::vector<int8_t> q(static_cast<size_t>(k), 0);
  double err2 = 0;
  for (int64_t d = 0; d < k; ++d) {
    if (out[d]) continue;
    const double s = r.gscale[d / group];
    const double n = s > 0 ? std::nearbyint(v[d] / s) : 0.0;
    q[d] = static_cast<int8_t>(std::max(-kDigit, std::min(kDigit, n)));
    const double e = v[d] - static_cast<double>(q[d]) * s;
    err2 += e * e;
  }
  r.main.resize(static_cast<size_t>(k / 4));
  for (int64_t p = 0; p < k / 4; ++p) {
    uint32_t u = 0;
    for (int i = 0; i < 4; ++i)
      u |= static_cast<uint32_t>(static_cast<uint8_t>(q[p * 4 + i])) << (8 * i);
    r.main[p] = static_cast<int32_t>(u);
  }
  for (int64_t g = 0; g < k / group; ++g) {
    int32_t sum = 0;
    for (int64_t d = g * group; d < (g + 1) * group; ++d) sum += q[d];
    r.offset.push_back(-128 * sum);
  }
  // rounded up, so that the bound stays a bound
  const double err = std::sqrt(err2) * (1 + 0x1p-8);
  r.room = static_cast<float>((err + 0x1p-12 * std::sqrt(norm2) +
                               0x1p-15 * std::sqrt(static_cast<double>(k)) * all) * (1 + 1e-6));
  return r;
}

struct Found {
  std::vector<int32_t> index;
  std::vector<float> high;
  float floor = -std::numeric_limits<float>::infinity();  // what the list was last cut by
  size_t next = 64;  // cut again past this many

  // Appends the tile's rows whose bit `keep` has (rows r0, r0 + 1, ...) and whose upper
  // bounds reach floor_now(), the lanes' largest lower bound so far; past `next` entries,
  // cuts the list by it.
  // NOTE: the floor is brought up to date on every take (a reduction across the lanes), not
  // only at a cut: with a stale floor a row whose logits climb through the vocabulary kept
  // appending until the next cut (on AMX's looser bound, a pass took 30 ms instead of 20).
  template <typename Floor>
  void take(uint32_t keep, int64_t r0, const float* highs, Floor floor_now) {
    floor = std::max(floor, floor_now());
    while (keep != 0) {
      const int i = __builtin_ctz(keep);
      keep &= keep - 1;
      if (highs[i] < floor) continue;
      index.push_back(static_cast<int32_t>(r0 + i));
      high.push_back(highs[i]);
    }
    if (index.size() > next) {
      compact();
      next = std::max(kCompact, 2 * index.size());
    }
  }

  void compact() {
    size_t n = 0;
    for (size_t i = 0; i < index.size(); ++i)
      if (high[i] >= floor) {
        index[n] = index[i];
        high[n] = high[i];
        ++n;
      }
    index.resize(n);
    high.resize(n);
  }
};

struct Head {
  const uint8_t* tiles;  // [T, k / 4, 16, 4]: q + 128
  const float* scales;   // [T, groups, 16]
  const float* norms;    // [T * 16]: ||w_r||, rounded up
  int64_t k, group, vocab;
};

#if defined(__AVX512VNNI__)
#define RINGSERVE_GREEDY_PASS 1

// A tile's 16 rows' largest lower bounds so far, for one x row.
using Lane = __m512;
inline Lane lane_init() { return _mm512_set1_ps(-std::numeric_limits<float>::infinity()); }
inline float lane_max(const Lane& l) { return _mm512_reduce_max_ps(l); }

// acc += w (unsigned bytes) . x (four signed bytes, broadcast from memory).
// NOTE: inline assembly for the embedded broadcast ({1to16}), where GCC emits a
// vpbroadcastd of its own; measured no faster on Zen 4 (docs/cpu.md), kept as the one
// instruction the loop needs.
inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int32_t* x) {
#if defined(RINGSERVE_EMULATE_AVX512)  // emulate_avx512.h: no assembly, the same sums
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(*x));
#else
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
#endif
}

// Rows [16 t, 16 t + 16) against x rows [m0, m0 + MB); lanes: those rows' largest lower
// bounds so far, a lane each; outs: their values at the outlier dims, [kOut][kBlock].
template <int MB>
void tile_rows(const Head& h, int64_t t, const std::vector<XRow>& xs,
               const std::vector<int64_t>& dims, int64_t m0, std::vector<Found>& found,
               __m512* lanes, const float* outs, const int32_t* digits, const int32_t* offsets) {
  const int64_t k = h.k, groups = k / h.group, per_group = h.group / 4;
  const uint8_t* tile = h.tiles + t * k * kRows;
  // NOTE: the first pass over a tile asks for the next tile's lines, one for each it
  // multiplies: the hottest instruction was the first vpdpbusd after each weight load
  // (+10% in a copy of the loop streaming from memory; docs/cpu.md).
  const uint8_t* ahead = m0 == 0 && t + 1 < (h.vocab + kRows - 1) / kRows ? tile + k * kRows : nullptr;
  const float* sc = h.scales + t * groups * kRows;
  // NOTE: the block's digits interleaved, [k / 4][kBlock] (and offsets [groups][kBlock]):
  // one pointer for all rows, where a pointer a row took more registers than x86 has.
  const int32_t* xq = digits;
  const int32_t* xo = offsets;
  __m512 f[MB];
  for (int j = 0; j < MB; ++j) f[j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i a[MB];
#pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) a[j] = _mm512_set1_epi32(xo[g * kBlock + j]);
    // NOTE: four quads at a time, unrolled: a loop of one quad a turn made GCC copy every
    // sum between registers on each turn (and spill one).
    const int64_t p1 = (g + 1) * per_group;
    for (int64_t p = g * per_group; p < p1; p += 4) {
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        if (ahead != nullptr) _mm_prefetch(reinterpret_cast<const char*>(ahead + (p + u) * 64), _MM_HINT_T0);
        const __m512i w = _mm512_loadu_si512(tile + (p + u) * 64);
#pragma GCC unroll 8
        for (int j = 0; j < MB; ++j)
          a[j] = dpbusd_bcast(a[j], w, xq + (p + u) * kBlock + j);
      }
    }
    const __m512 s = _mm512_loadu_ps(sc + g * kRows);
#pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) f[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[j]), s, f[j]);
  }
  // NOTE: no call among the vector sums (a push_back there made GCC keep every sum on
  // the stack); the lists are filled after.
  float scale[MB], room[MB], floor[MB];
  for (int j = 0; j < MB; ++j) {
    scale[j] = xs[m0 + j].scale;
    room[j] = xs[m0 + j].room;
    floor[j] = found[m0 + j].floor;
  }
#pragma GCC unroll 8
  for (int j = 0; j < MB; ++j) f[j] = _mm512_mul_ps(f[j], _mm512_set1_ps(scale[j]));
  for (size_t o = 0; o < dims.size(); ++o) {  // the outlier dims, in float
    const int64_t d = dims[o];
    const __m512i w = _mm512_loadu_si512(tile + (d / 4) * 64);
    const __m512i q = _mm512_sub_epi32(
        _mm512_and_si512(_mm512_srli_epi32(w, static_cast<unsigned>(8 * (d % 4))),
                         _mm512_set1_epi32(0xFF)),
        _mm512_set1_epi32(128));
    const __m512 wd = _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_loadu_ps(sc + (d / h.group) * kRows));
    const float* xo = outs + o * kBlock;
#pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) f[j] = _mm512_fmadd_ps(wd, _mm512_set1_ps(xo[j]), f[j]);
  }
  const int64_t r0 = t * kRows;
  const __mmask16 valid = h.vocab - r0 >= kRows
                              ? static_cast<__mmask16>(0xFFFF)
                              : static_cast<__mmask16>((1u << (h.vocab - r0)) - 1);
  const __m512 n = _mm512_loadu_ps(h.norms + r0);
  __mmask16 keeps[MB];
  __m512 highs[MB];
  bool any = false;
#pragma GCC unroll 8
  for (int j = 0; j < MB; ++j) {
    const __m512 a = f[j];
    // b = ||w_r|| ||x - x^|| plus room for the exact path's own errors (XRow::room)
    const __m512 b = _mm512_fmadd_ps(
        n, _mm512_set1_ps(room[j]),
        _mm512_fmadd_ps(_mm512_abs_ps(a), _mm512_set1_ps(0x1p-8f), _mm512_set1_ps(1e-4f)));
    lanes[j] = _mm512_mask_max_ps(lanes[j], valid, lanes[j], _mm512_sub_ps(a, b));
    highs[j] = _mm512_add_ps(a, b);
    keeps[j] = _mm512_mask_cmp_ps_mask(valid, highs[j], _mm512_set1_ps(floor[j]), _CMP_GE_OQ);
    any = any || keeps[j] != 0;
  }
  if (!any) return;
  for (int j = 0; j < MB; ++j) {
    const __mmask16 keep = keeps[j];
    if (keep == 0) continue;
    alignas(64) float hs[kRows];
    _mm512_store_ps(hs, highs[j]);
    found[m0 + j].take(keep, r0, hs, [&] { return lane_max(lanes[j]); });
  }
}

void tile_block(const Head& h, int64_t t, const std::vector<XRow>& xs,
                const std::vector<int64_t>& dims, int64_t m0, int64_t mb,
                std::vector<Found>& found, Lane* lanes, const float* outs,
                const int32_t* digits, const int32_t* offsets) {
  switch (mb) {
    case 1: tile_rows<1>(h, t, xs, dims, m0, found, lanes, outs, digits, offsets); break;
    case 2: tile_rows<2>(h, t, xs, dims, m0, found, lanes, outs, digits, offsets); break;
    case 3: tile_rows<3>(h, t, xs, dims, m0, found, lanes, outs, digits, offsets); break;
    case 4: tile_rows<4>(h, t, xs, dims, m0, found, lanes, outs, digits, offsets); break;
    case 5: tile_rows<5>(h, t, xs, dims, m0, found, lanes, outs, digits, offsets); break;
    case 6: tile_rows<6>(h, t, xs, dims, m0, found, lanes, outs, digits, offsets); break;
    case 7: tile_rows<7>(h, t, xs, dims, m0, found, lanes, outs, digits, offsets); break;
    default: tile_rows<8>(h, t, xs, dims, m0, found, lanes, outs, digits, offsets); break;
  }
}

#elif defined(__AVX2__)
#define RINGSERVE_GREEDY_PASS 1

// A tile's 16 rows' largest lower bounds so far, for one x row: rows 0-7 and 8-15.
struct Lane {
  __m256 lo, hi;
};
inline Lane lane_init() {
  const __m256 v = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  return {v, v};
}
inline float lane_max(const Lane& l) {
  alignas(32) float v[8];
  _mm256_store_ps(v, _mm256_max_ps(l.lo, l.hi));
  return *std::max_element(v, v + 8);
}

constexpr int kSub = 2;  // x rows a pass: 2 x 2 int32 and 2 x 2 float sums, in 16 registers

// acc += the 4-byte dot products of w's lanes (unsigned) with x's (signed, broadcast).
inline __m256i dot4(__m256i acc, __m256i w, __m256i x, __m256i ones) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
}

// tile_rows of the AVX-512 build for x rows [m0, m0 + MB) (MB <= kSub), each tile as two
// halves of 8 rows; digits, offsets, outs and lanes point at the block's row m0.
template <int MB>
void tile_rows(const Head& h, int64_t t, const std::vector<XRow>& xs,
               const std::vector<int64_t>& dims, int64_t m0, std::vector<Found>& found,
               Lane* lanes, const float* outs, const int32_t* digits, const int32_t* offsets) {
  const int64_t k = h.k, groups = k / h.group, per_group = h.group / 4;
  const uint8_t* tile = h.tiles + t * k * kRows;
  // the next tile's lines, one a quad, on the first pass over this one (as the AVX-512 loop)
  const uint8_t* ahead = m0 == 0 && t + 1 < (h.vocab + kRows - 1) / kRows ? tile + k * kRows : nullptr;
  const float* sc = h.scales + t * groups * kRows;
  const __m256i ones = _mm256_set1_epi16(1);
  const float* gsc[MB];  // each x row's group scales
  __m256 f0[MB], f1[MB];
  for (int j = 0; j < MB; ++j) {
    f0[j] = f1[j] = _mm256_setzero_ps();
    gsc[j] = xs[m0 + j].gscale.data();
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m256i a0[MB], a1[MB];
    for (int j = 0; j < MB; ++j) a0[j] = a1[j] = _mm256_set1_epi32(offsets[g * kBlock + j]);
    const int64_t p1 = (g + 1) * per_group;
    for (int64_t p = g * per_group; p < p1; p += 4) {
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        if (ahead != nullptr) _mm_prefetch(reinterpret_cast<const char*>(ahead + (p + u) * 64), _MM_HINT_T0);
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + (p + u) * 64));
        const __m256i w1 =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + (p + u) * 64 + 32));
        for (int j = 0; j < MB; ++j) {
          const __m256i x = _mm256_set1_epi32(digits[(p + u) * kBlock + j]);
          a0[j] = dot4(a0[j], w0, x, ones);
          a1[j] = dot4(a1[j], w1, x, ones);
        }
      }
    }
    // the weight rows' group scales times the x row's (kGroupScales)
    const __m256 s0 = _mm256_loadu_ps(sc + g * kRows), s1 = _mm256_loadu_ps(sc + g * kRows + 8);
    for (int j = 0; j < MB; ++j) {
      const __m256 xsc = _mm256_set1_ps(gsc[j][g]);
      f0[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a0[j]), _mm256_mul_ps(s0, xsc), f0[j]);
      f1[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a1[j]), _mm256_mul_ps(s1, xsc), f1[j]);
    }
  }
  for (size_t o = 0; o < dims.size(); ++o) {  // the outlier dims, in float
    const int64_t d = dims[o];
    const __m256i shift = _mm256_set1_epi32(static_cast<int>(8 * (d % 4)));
    __m256 wd[2];
    for (int half = 0; half < 2; ++half) {
      const __m256i w = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(tile + (d / 4) * 64 + half * 32));
      const __m256i q = _mm256_sub_epi32(
          _mm256_and_si256(_mm256_srlv_epi32(w, shift), _mm256_set1_epi32(0xFF)),
          _mm256_set1_epi32(128));
      wd[half] = _mm256_mul_ps(_mm256_cvtepi32_ps(q),
                               _mm256_loadu_ps(sc + (d / h.group) * kRows + half * 8));
    }
    for (int j = 0; j < MB; ++j) {
      const __m256 v = _mm256_set1_ps(outs[o * kBlock + j]);
      f0[j] = _mm256_fmadd_ps(wd[0], v, f0[j]);
      f1[j] = _mm256_fmadd_ps(wd[1], v, f1[j]);
    }
  }
  const int64_t r0 = t * kRows;
  const int valid = h.vocab - r0 >= kRows ? 0xFFFF : (1 << (h.vocab - r0)) - 1;
  // rows past the vocabulary: their lower bounds must not count
  const __m256 lo_ok = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
      _mm256_set1_epi32(static_cast<int>(h.vocab - r0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  const __m256 hi_ok = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
      _mm256_set1_epi32(static_cast<int>(h.vocab - r0)),
      _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)));
  const __m256 n0 = _mm256_loadu_ps(h.norms + r0), n1 = _mm256_loadu_ps(h.norms + r0 + 8);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int j = 0; j < MB; ++j) {
    const __m256 room = _mm256_set1_ps(xs[m0 + j].room);
    const __m256 floor = _mm256_set1_ps(found[m0 + j].floor);
    alignas(32) float hs[kRows];
    int keep = 0;
    for (int half = 0; half < 2; ++half) {
      const __m256 a = half == 0 ? f0[j] : f1[j];
      // b = ||w_r|| ||x - x^|| plus room for the exact path's own errors (XRow::room)
      const __m256 b = _mm256_fmadd_ps(
          half == 0 ? n0 : n1, room,
          _mm256_fmadd_ps(_mm256_and_ps(a, absmask), _mm256_set1_ps(0x1p-8f),
                          _mm256_set1_ps(1e-4f)));
      const __m256 low = _mm256_blendv_ps(ninf, _mm256_sub_ps(a, b), half == 0 ? lo_ok : hi_ok);
      __m256& lane = half == 0 ? lanes[j].lo : lanes[j].hi;
      lane = _mm256_max_ps(lane, low);
      const __m256 high = _mm256_add_ps(a, b);
      _mm256_store_ps(hs + half * 8, high);
      keep |= _mm256_movemask_ps(_mm256_cmp_ps(high, floor, _CMP_GE_OQ)) << (half * 8);
    }
    keep &= valid;
    if (keep != 0)
      found[m0 + j].take(static_cast<uint32_t>(keep), r0, hs, [&] { return lane_max(lanes[j]); });
  }
}

void tile_block(const Head& h, int64_t t, const std::vector<XRow>& xs,
                const std::vector<int64_t>& dims, int64_t m0, int64_t mb,
                std::vector<Found>& found, Lane* lanes, const float* outs,
                const int32_t* digits, const int32_t* offsets) {
  for (int64_t s = 0; s < mb; s += kSub) {
    if (mb - s >= 2)
      tile_rows<2>(h, t, xs, dims, m0 + s, found, lanes + s, outs + s, digits + s, offsets + s);
    else
      tile_rows<1>(h, t, xs, dims, m0 + s, found, lanes + s, outs + s, digits + s, offsets + s);
  }
}

#endif

#if defined(RINGSERVE_GREEDY_PASS)
// The batch's outlier dims (the kOut largest of max |x| over its rows) and its rows rounded.
template <typename T>
void round_rows(const T* xp, int64_t m, int64_t k, int64_t group, std::vector<int64_t>& dims,
                std::vector<XRow>& xs) {
  std::vector<float> top(static_cast<size_t>(k), 0.f);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t d = 0; d < k; ++d)
      top[d] = std::max(top[d], std::abs(ringserve::to_f(xp[i * k + d])));
  dims.resize(static_cast<size_t>(k));
  std::iota(dims.begin(), dims.end(), 0);
  const int64_t n_out = std::min(kOut, k);
  std::partial_sort(dims.begin(), dims.begin() + n_out, dims.end(),
                    [&](int64_t a, int64_t b) { return top[a] > top[b]; });
  dims.resize(static_cast<size_t>(n_out));
  xs.reserve(static_cast<size_t>(m));
  for (int64_t i = 0; i < m; ++i) xs.push_back(round_row(xp + i * k, k, group, dims));
}
#endif

#if defined(RINGSERVE_AMX) && defined(RINGSERVE_GREEDY_PASS)
// The pass by AMX-INT8 (docs/cpu.md, "The greedy head on AMX"). AMX multiplies 16 rows by 16
// vocabulary rows by 64 values an instruction (TDPBSSD, int32 sums), but scaling each weight
// group's sums on their way out of the tile unit costs more than the multiply (as in
// quant_gemm.cpp's AMX path). So AMX reads a copy of its own: each head row w_r as int8
// values q_r at one scale s_r a row (w^_r = s_r q_r; GreedyHead._pack_amx), whose sums leave
// the tiles once, after all of k. And x needs no outlier dims kept apart: each x row is two
// rows of digits, x^ = a z + (a / 254) z' (z rounds x at one scale a row, z' what that
// left; ||x - x^|| ~ 2^-16 of max |x| a value), both multiplied by AMX. The copy's own error
// enters the bound instead: for any set O of x's dims,
//
//   w_r . x - w^_r . x^ = e_r . x + w^_r . (x - x^)                  (e_r = w_r - w^_r)
//   |...| <= ||e_r|| ||x without O|| + max|e_r| sum_O |x_o| + ||w^_r|| ||x - x^||
//
// with O each x row's largest values, as many as make ||x without O|| + rho sum_O |x_o|
// least (rho: the copy's typical max|e_r| / ||e_r||). Plus the room for the exact path's
// own rounding (XRow::room, on max(||w_r||, ||w^_r||)) and this pass's float sums (2^-18
// ||x|| on the same norm).
struct RowHead {
  const int8_t* tiles;  // [T, kp / 4, 16, 4]: q, kp = k rounded up to 64 (zeros past k)
  const float* scale;   // [T * 16]: s_r
  const float* norm;    // [T * 16]: max(||w_r||, ||w^_r||), rounded up
  const float* err;     // [T * 16]: ||e_r||, rounded up
  const float* maxerr;  // [T * 16]: max_d |e_rd|, rounded up
  int64_t kp, vocab;
};

// One x row as AMX's two rows of digits, and what its bound needs.
struct XPair {
  float scale = 0.f;  // a: z's scale
  float fine = 0.f;   // z''s: a / 254
  float room = 0.f;   // ||x - x^|| and room for the float sums (XRow::room's terms), up
  float rest = 0.f;   // ||x without O||, rounded up
  float out1 = 0.f;   // sum_O |x_o|, rounded up
};

constexpr double kFine = 254.0;  // z's scale over z''s: |x - a z| <= a / 2 = 127 (a / 254)

// x row `x` into digits z (to) and z' (to + kp) and its XPair.
template <typename T>
XPair pair_row(const T* x, int64_t k, int64_t kp, float rho, int8_t* to) {
  XPair r;
  std::vector<double> v(static_cast<size_t>(k)), mag(static_cast<size_t>(k));
  double top = 0, norm2 = 0;
  for (int64_t d = 0; d < k; ++d) {
    v[d] = static_cast<double>(ringserve::to_f(x[d]));
    mag[d] = std::abs(v[d]);
    top = std::max(top, mag[d]);
    norm2 += v[d] * v[d];
  }
  // NOTE: rounded with the float scales the kernel multiplies by, so that the error measured
  // below is the one its sums carry.
  const float a = static_cast<float>(top / 127.0), fine = static_cast<float>(a / kFine);
  r.scale = a;
  r.fine = fine;
  double err2 = 0;
  for (int64_t d = 0; d < k; ++d) {
    double z = 0, zf = 0;
    if (a > 0) {
      z = std::max(-127.0, std::min(127.0, std::nearbyint(v[d] / a)));
      zf = std::max(-127.0, std::min(127.0, std::nearbyint((v[d] - z * a) / fine)));
    }
    to[d] = static_cast<int8_t>(z);
    to[kp + d] = static_cast<int8_t>(zf);
    const double e = v[d] - z * static_cast<double>(a) - zf * static_cast<double>(fine);
    err2 += e * e;
  }
  // O: the j largest |x_d| for the j (up to 64) that makes ||x without O|| + rho sum_O least
  std::sort(mag.begin(), mag.end(), std::greater<double>());
  double rest2 = norm2, out1 = 0, best = std::sqrt(norm2), best_rest = best, best_out = 0;
  for (int64_t j = 0; j < std::min<int64_t>(64, k); ++j) {
    rest2 = std::max(0.0, rest2 - mag[j] * mag[j]);
    out1 += mag[j];
    const double cost = std::sqrt(rest2) + rho * out1;
    if (cost < best) {
      best = cost;
      best_rest = std::sqrt(rest2);
      best_out = out1;
    }
  }
  const double norm = std::sqrt(norm2);
  r.rest = static_cast<float>(best_rest * (1 + 1e-6) + 1e-30);
  r.out1 = static_cast<float>(best_out * (1 + 1e-6));
  r.room = static_cast<float>((std::sqrt(err2) * (1 + 0x1p-8) + 0x1p-12 * norm +
                               0x1p-15 * std::sqrt(static_cast<double>(k)) * top +
                               0x1p-18 * norm) * (1 + 1e-6));
  return r;
}

// NOTE: the tiles kAhead tiles on are asked for into L2 while these are multiplied, 2 KiB
// a step of k: AMX's tile loads wait for their lines (and AMX's tile registers are not
// renamed, so no load runs ahead of the multiply before it), and the L2 streamer stops at
// every 4 KiB page. With the copy on 2 MiB pages (kernels/hugepages.py) a 32-row pass took
// 12.0-12.4 ms against 12.7-13.2 without this and 13.4-13.7 on 4 KiB pages (AMX machine).
constexpr int64_t kAhead = 4;

// tmm0-3: sums of digit block i (16 digit rows: 8 x rows) by vocabulary tile j as
// tmm(2 i + j); tmm4 / tmm5: the two digit blocks' 64 values; tmm6 / tmm7: the two
// vocabulary tiles' 64 values.
ringserve::TileConfig row_config() {
  ringserve::TileConfig c;
  for (int i = 0; i < 8; ++i) c.set(i, 16, 64);
  return c;
}

// The int32 sums of up to two 16-row digit blocks (xd, rows kp bytes apart) by up to two
// vocabulary tiles (w0, w1), stored as sums[2 i + j][16 digit rows][16 vocabulary rows].
template <bool TWO_X, bool TWO_W>
__attribute__((target("amx-tile,amx-int8"))) void row_sums(const int8_t* xd, const int8_t* w0,
                                                           const int8_t* w1, int64_t kp,
                                                           ringserve::Ahead& ahead,
                                                           int32_t (*sums)[256]) {
  _tile_zero(0);
  if constexpr (TWO_W) _tile_zero(1);
  if constexpr (TWO_X) _tile_zero(2);
  if constexpr (TWO_X && TWO_W) _tile_zero(3);
  for (int64_t c = 0; c < kp; c += 64) {
    ahead.fetch();  // 2 KiB of the tiles ahead (16 x 64 values of each of two tiles)
    _tile_loadd(4, xd + c, kp);
    _tile_loadd(6, w0 + c * 16, 64);
    _tile_dpbssd(0, 4, 6);
    if constexpr (TWO_W) {
      _tile_loadd(7, w1 + c * 16, 64);
      _tile_dpbssd(1, 4, 7);
    }
    if constexpr (TWO_X) {
      _tile_loadd(5, xd + 16 * kp + c, kp);
      _tile_dpbssd(2, 5, 6);
      if constexpr (TWO_W) _tile_dpbssd(3, 5, 7);
    }
  }
  _tile_stored(0, sums[0], 64);
  if constexpr (TWO_W) _tile_stored(1, sums[1], 64);
  if constexpr (TWO_X) _tile_stored(2, sums[2], 64);
  if constexpr (TWO_X && TWO_W) _tile_stored(3, sums[3], 64);
}

// Bounds and candidates of vocabulary tile t for x rows [m0, m0 + mr) (mr <= 8), from their
// digit rows' sums (sums[(2 i + u) * 16 + r]: z (u = 0) or z' (u = 1) of x row m0 + i by
// vocabulary row 16 t + r).
void row_bounds(const RowHead& h, int64_t t, const int32_t* sums, int64_t m0, int64_t mr,
                const std::vector<XPair>& xs, std::vector<Found>& found, __m512* lanes) {
  const int64_t r0 = t * kRows;
  const __mmask16 valid = h.vocab - r0 >= kRows
                              ? static_cast<__mmask16>(0xFFFF)
                              : static_cast<__mmask16>((1u << (h.vocab - r0)) - 1);
  const __m512 s = _mm512_loadu_ps(h.scale + r0), n = _mm512_loadu_ps(h.norm + r0),
               e = _mm512_loadu_ps(h.err + r0), me = _mm512_loadu_ps(h.maxerr + r0);
  for (int64_t i = 0; i < mr; ++i) {
    const XPair& x = xs[m0 + i];
    const __m512 coarse = _mm512_cvtepi32_ps(_mm512_load_si512(sums + 2 * i * kRows));
    const __m512 fine = _mm512_cvtepi32_ps(_mm512_load_si512(sums + (2 * i + 1) * kRows));
    const __m512 a = _mm512_mul_ps(s, _mm512_fmadd_ps(coarse, _mm512_set1_ps(x.scale),
                                                      _mm512_mul_ps(fine, _mm512_set1_ps(x.fine))));
    const __m512 b0 = _mm512_fmadd_ps(
        n, _mm512_set1_ps(x.room),
        _mm512_fmadd_ps(e, _mm512_set1_ps(x.rest), _mm512_mul_ps(me, _mm512_set1_ps(x.out1))));
    // widened for the bf16 the exact logits are rounded to, as tile_rows
    const __m512 b = _mm512_fmadd_ps(
        b0, _mm512_set1_ps(1 + 0x1p-8f),
        _mm512_fmadd_ps(_mm512_abs_ps(a), _mm512_set1_ps(0x1p-8f), _mm512_set1_ps(1e-4f)));
    __m512& lane = lanes[m0 + i];
    lane = _mm512_mask_max_ps(lane, valid, lane, _mm512_sub_ps(a, b));
    const __m512 high = _mm512_add_ps(a, b);
    const __mmask16 keep = _mm512_mask_cmp_ps_mask(valid, high,
                                                   _mm512_set1_ps(found[m0 + i].floor), _CMP_GE_OQ);
    if (keep == 0) continue;
    alignas(64) float hs[kRows];
    _mm512_store_ps(hs, high);
    found[m0 + i].take(keep, r0, hs, [&] { return lane_max(lane); });
  }
}

// One chunk of vocabulary tiles [t0, t1) against every x row (xd: [2 m rounded up to 16][kp]
// digits): two tiles and two digit blocks (16 x rows) a turn, from the tile registers.
void row_chunk(const RowHead& h, int64_t t0, int64_t t1, const int8_t* xd, int64_t m,
               const std::vector<XPair>& xs, std::vector<Found>& found, __m512* lanes) {
  const int64_t kp = h.kp, dp = (2 * m + 15) / 16 * 16;
  alignas(64) int32_t sums[4][256];
  for (int64_t t = t0; t < t1; t += 2) {
    const bool two_w = t + 1 < t1;
    const int8_t* w0 = h.tiles + t * kp * kRows;
    const int8_t* w1 = w0 + kp * kRows;
    for (int64_t d0 = 0; d0 < dp; d0 += 32) {
      const bool two_x = dp - d0 > 16;
      const int8_t* x0 = xd + d0 * kp;
      ringserve::Ahead ahead;
      if (d0 == 0 && t + kAhead + 1 < t1) {  // 2 KiB a step of the call's
        const int64_t steps = (kp + 63) / 64;
        ahead = ringserve::Ahead(w0 + kAhead * kp * kRows, 2048 * steps, steps);
      }
      if (two_x && two_w) row_sums<true, true>(x0, w0, w1, kp, ahead, sums);
      else if (two_x) row_sums<true, false>(x0, w0, w1, kp, ahead, sums);
      else if (two_w) row_sums<false, true>(x0, w0, w1, kp, ahead, sums);
      else row_sums<false, false>(x0, w0, w1, kp, ahead, sums);
      for (int i = 0; i < (two_x ? 2 : 1); ++i) {
        const int64_t b0 = d0 / 2 + 8 * i, mr = std::min<int64_t>(8, m - b0);
        if (mr <= 0) break;
        for (int j = 0; j < (two_w ? 2 : 1); ++j)
          row_bounds(h, t + j, sums[2 * i + j], b0, mr, xs, found, lanes);
      }
    }
  }
}

// One x row over vocabulary tiles [t0, t1) by AVX512-VNNI instead of AMX, on the same copy
// and digits, for the same int32 sums (exact either way, so the same bounds and candidates):
// the copy's tiles are [kp / 4][16 rows][4 values], a vector of vpdpbusd's 16 int32 lanes
// a row each. vpdpbusd multiplies unsigned bytes by signed ones: the digits ride as
// u = z + 128 (xu: kp / 4 quads of z, then of z'), and each row's sum of its values Q_r
// (a third vpdpbusd, by ones) takes the offset back off: sum z q_r = sum u q_r - 128 Q_r.
// Why: at one x row AMX multiplies 15 zero rows, and its tile loads wait for their lines
// (no load runs ahead of the multiply before it), so the pass read the copy at 25-27 GB/s
// inside a step; these are plain vector loads, which run ahead of the multiplies and let
// the hardware prefetchers stream the copy (docs/cpu.md, "One greedy row without AMX").
// NOTE: 4 tiles a turn, their 12 sums' chains interleaved (vpdpbusd's latency would bind
// one tile's three chains); 2 or 8 a turn, or a software prefetch 1-4 KiB ahead of each
// tile's stream, measured no better (one engine, alternating, AMX machine).
constexpr int64_t kOneTiles = 4;

template <int NT>
void one_row_turn(const RowHead& h, int64_t t, const int32_t* xu, const std::vector<XPair>& xs,
                  std::vector<Found>& found, __m512* lanes) {
  const int64_t kp = h.kp, quads = kp / 4;
  const int8_t* w = h.tiles + t * kp * kRows;
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i a[NT], b[NT], q[NT];
  for (int j = 0; j < NT; ++j) a[j] = b[j] = q[j] = _mm512_setzero_si512();
  for (int64_t p = 0; p < quads; ++p) {
    const __m512i u = _mm512_set1_epi32(xu[p]), uf = _mm512_set1_epi32(xu[quads + p]);
    for (int j = 0; j < NT; ++j) {
      const __m512i v = _mm512_loadu_si512(w + j * kp * kRows + p * 64);
      a[j] = _mm512_dpbusd_epi32(a[j], u, v);
      b[j] = _mm512_dpbusd_epi32(b[j], uf, v);
      q[j] = _mm512_dpbusd_epi32(q[j], ones, v);
    }
  }
  alignas(64) int32_t sums[2 * kRows];
  for (int j = 0; j < NT; ++j) {
    const __m512i off = _mm512_slli_epi32(q[j], 7);
    _mm512_store_si512(sums, _mm512_sub_epi32(a[j], off));
    _mm512_store_si512(sums + kRows, _mm512_sub_epi32(b[j], off));
    row_bounds(h, t + j, sums, 0, 1, xs, found, lanes);
  }
}

void one_row_chunk(const RowHead& h, int64_t t0, int64_t t1, const int32_t* xu,
                   const std::vector<XPair>& xs, std::vector<Found>& found, __m512* lanes) {
  int64_t t = t0;
  for (; t + kOneTiles <= t1; t += kOneTiles) one_row_turn<kOneTiles>(h, t, xu, xs, found, lanes);
  for (; t < t1; ++t) one_row_turn<1>(h, t, xu, xs, found, lanes);
}

// x row 0's digit rows (xd: z, then z' kp bytes on) as vpdpbusd's unsigned quads, u = z + 128.
std::vector<int32_t> unsigned_quads(const int8_t* xd, int64_t kp) {
  std::vector<int32_t> xu(static_cast<size_t>(kp / 2));
  for (int64_t i = 0; i < 2 * kp; i += 4) {
    uint8_t u[4];
    for (int e = 0; e < 4; ++e) u[e] = static_cast<uint8_t>(xd[i + e] + 128);
    std::memcpy(&xu[i / 4], u, 4);
  }
  return xu;
}

// x's rows as AMX digit rows ([2 m rounded up to 16][kp], zeros past them) and XPairs.
template <typename T>
std::vector<XPair> pair_rows(const T* xp, int64_t m, int64_t k, int64_t kp, float rho,
                             std::vector<int8_t>& xd) {
  xd.assign(static_cast<size_t>((2 * m + 15) / 16 * 16 * kp), 0);
  std::vector<XPair> xs;
  xs.reserve(static_cast<size_t>(m));
  for (int64_t i = 0; i < m; ++i) xs.push_back(pair_row(xp + i * k, k, kp, rho, xd.data() + 2 * i * kp));
  return xs;
}
#endif

#if defined(RINGSERVE_GREEDY_PASS)
// The chunks' lists as (index int32 [c], offsets int64 [m + 1]): each x row's candidates,
// ascending, cut by the row's largest lower bound over all chunks.
std::vector<at::Tensor> merged(const std::vector<std::vector<Found>>& parts, int64_t m,
                               const at::Tensor& x) {
  auto offsets = at::empty({m + 1}, x.options().dtype(at::kLong));
  int64_t* op = offsets.data_ptr<int64_t>();
  std::vector<int32_t> all;
  op[0] = 0;
  for (int64_t i = 0; i < m; ++i) {
    float floor = -std::numeric_limits<float>::infinity();
    for (const auto& part : parts) floor = std::max(floor, part[i].floor);
    for (const auto& part : parts) {
      const Found& f = part[i];
      for (size_t j = 0; j < f.index.size(); ++j)
        if (f.high[j] >= floor) all.push_back(f.index[j]);
    }
    op[i + 1] = static_cast<int64_t>(all.size());
  }
  auto index = at::empty({static_cast<int64_t>(all.size())}, x.options().dtype(at::kInt));
  std::copy(all.begin(), all.end(), index.data_ptr<int32_t>());
  return {index, offsets};
}
#endif

// x: [m, k] bf16 or float32; tiles: [T, k * 16] uint8 (T = ceil(vocab / 16)); scales: [T, groups * 16]
// float32; norms: [T * 16] float32 (||w_r||, rounded up). Returns (index int32 [c], offsets
// int64 [m + 1]): x row i's candidates, ascending, are index[offsets[i]:offsets[i+1]].
std::vector<at::Tensor> greedy_head_candidates(const at::Tensor& x, const at::Tensor& tiles,
                                               const at::Tensor& scales, const at::Tensor& norms,
                                               int64_t group, int64_t vocab) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "greedy_head_candidates: x must be contiguous bf16 or float32 [m, k]");
  const int64_t m = x.size(0), k = x.size(1), count = (vocab + kRows - 1) / kRows;
  TORCH_CHECK(group > 0 && group % 16 == 0 && k % group == 0,
              "greedy_head_candidates: group must be a multiple of 16 dividing k");
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.is_contiguous() && tiles.dim() == 2 &&
                  tiles.size(0) == count && tiles.size(1) == k * kRows,
              "greedy_head_candidates: tiles must be uint8 [ceil(vocab / 16), k * 16]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == count * (k / group) * kRows,
              "greedy_head_candidates: scales must be float32 [tiles, groups * 16]");
  TORCH_CHECK(norms.scalar_type() == at::kFloat && norms.is_contiguous() &&
                  norms.numel() == count * kRows,
              "greedy_head_candidates: norms must be float32 [tiles * 16]");
  TORCH_CHECK(vocab < std::numeric_limits<int32_t>::max(), "greedy_head_candidates: vocab too large");
#if defined(RINGSERVE_GREEDY_PASS)
  std::vector<int64_t> dims;
  std::vector<XRow> xs;
  if (x.scalar_type() == at::kFloat)
    round_rows(x.data_ptr<float>(), m, k, group, dims, xs);
  else
    round_rows(x.data_ptr<c10::BFloat16>(), m, k, group, dims, xs);
  const Head h{tiles.data_ptr<uint8_t>(), scales.data_ptr<float>(), norms.data_ptr<float>(),
               k, group, vocab};
  const int64_t chunks = std::min(kChunks, count);
  std::vector<std::vector<Found>> parts(static_cast<size_t>(chunks),
                                        std::vector<Found>(static_cast<size_t>(m)));
  const int64_t blocks = (m + kBlock - 1) / kBlock;
  std::vector<float> outs(static_cast<size_t>(blocks * kOut * kBlock), 0.f);
  for (int64_t i = 0; i < m; ++i)
    for (size_t o = 0; o < dims.size(); ++o)
      outs[(i / kBlock) * kOut * kBlock + o * kBlock + i % kBlock] = xs[i].outs[o];
  const int64_t quads = k / 4, groups = k / group;
  std::vector<int32_t> digits(static_cast<size_t>(blocks * quads * kBlock), 0),
      starts(static_cast<size_t>(blocks * groups * kBlock), 0);
  for (int64_t i = 0; i < m; ++i) {
    const int64_t b = i / kBlock, j = i % kBlock;
    for (int64_t p = 0; p < quads; ++p) digits[(b * quads + p) * kBlock + j] = xs[i].main[p];
    for (int64_t g = 0; g < groups; ++g) starts[(b * groups + g) * kBlock + j] = xs[i].offset[g];
  }
  ringserve::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<Lane> lanes(static_cast<size_t>(m));
    for (int64_t c = c0; c < c1; ++c) {
      std::fill(lanes.begin(), lanes.end(), lane_init());
      const int64_t t0 = count * c / chunks, t1 = count * (c + 1) / chunks;
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t i = 0; i < m; i += kBlock)
          tile_block(h, t, xs, dims, i, std::min(kBlock, m - i), parts[c], lanes.data() + i,
                     outs.data() + (i / kBlock) * kOut * kBlock,
                     digits.data() + (i / kBlock) * quads * kBlock,
                     starts.data() + (i / kBlock) * groups * kBlock);
      for (int64_t i = 0; i < m; ++i)
        parts[c][i].floor = std::max(parts[c][i].floor, lane_max(lanes[i]));
    }
  });
  return merged(parts, m, x);
#else
  (void)m;  // the portable build has no pass
  TORCH_CHECK(false, "greedy_head_candidates: this build has neither AVX512-VNNI nor AVX2");
#endif
}

// The AMX pass: x [m, k] bf16 or float32; tiles int8 [T, kp * 16] (kp: k rounded up to 64);
// meta float32 [4, T * 16]: RowHead's scale, norm, err and maxerr; rho: the copy's typical
// max|e_r| / ||e_r|| (chooses each x row's O; any value gives a bound). Returns as
// greedy_head_candidates.
std::vector<at::Tensor> greedy_head_candidates_amx(const at::Tensor& x, const at::Tensor& tiles,
                                                   const at::Tensor& meta, int64_t vocab,
                                                   double rho) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "greedy_head_candidates_amx: x must be contiguous bf16 or float32 [m, k]");
  const int64_t m = x.size(0), k = x.size(1), count = (vocab + kRows - 1) / kRows,
                kp = (k + 63) / 64 * 64;
  TORCH_CHECK(k % 4 == 0, "greedy_head_candidates_amx: k must be a multiple of 4");
  TORCH_CHECK(tiles.scalar_type() == at::kChar && tiles.is_contiguous() && tiles.dim() == 2 &&
                  tiles.size(0) == count && tiles.size(1) == kp * kRows,
              "greedy_head_candidates_amx: tiles must be int8 [ceil(vocab / 16), kp * 16]");
  TORCH_CHECK(meta.scalar_type() == at::kFloat && meta.is_contiguous() &&
                  meta.numel() == 4 * count * kRows,
              "greedy_head_candidates_amx: meta must be float32 [4, tiles * 16]");
  TORCH_CHECK(vocab < std::numeric_limits<int32_t>::max(),
              "greedy_head_candidates_amx: vocab too large");
#if defined(RINGSERVE_AMX) && defined(RINGSERVE_GREEDY_PASS)
  TORCH_CHECK(ringserve::amx_granted(),
              "greedy_head_candidates_amx: this process has no AMX tile state (use_amx)");
  std::vector<int8_t> xd;
  const std::vector<XPair> xs =
      x.scalar_type() == at::kFloat
          ? pair_rows(x.data_ptr<float>(), m, k, kp, static_cast<float>(rho), xd)
          : pair_rows(x.data_ptr<c10::BFloat16>(), m, k, kp, static_cast<float>(rho), xd);
  const float* mp_ = meta.data_ptr<float>();
  const RowHead h{tiles.data_ptr<int8_t>(), mp_, mp_ + count * kRows, mp_ + 2 * count * kRows,
                  mp_ + 3 * count * kRows, kp, vocab};
  const int64_t chunks = std::min(kChunks, count);
  std::vector<std::vector<Found>> parts(static_cast<size_t>(chunks),
                                        std::vector<Found>(static_cast<size_t>(m)));
  if (m == 1) {  // one row: plain vector loads (one_row_chunk)
    const std::vector<int32_t> xu = unsigned_quads(xd.data(), kp);
    ringserve::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      std::vector<Lane> lanes(1);
      for (int64_t c = c0; c < c1; ++c) {
        lanes[0] = lane_init();
        one_row_chunk(h, count * c / chunks, count * (c + 1) / chunks, xu.data(), xs, parts[c],
                      lanes.data());
        parts[c][0].floor = std::max(parts[c][0].floor, lane_max(lanes[0]));
      }
    });
    return merged(parts, m, x);
  }
  ringserve::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    const ringserve::AmxScope tiles_on(row_config());
    std::vector<Lane> lanes(static_cast<size_t>(m));
    for (int64_t c = c0; c < c1; ++c) {
      std::fill(lanes.begin(), lanes.end(), lane_init());
      row_chunk(h, count * c / chunks, count * (c + 1) / chunks, xd.data(), m, xs, parts[c],
                lanes.data());
      for (int64_t i = 0; i < m; ++i)
        parts[c][i].floor = std::max(parts[c][i].floor, lane_max(lanes[i]));
    }
  });
  return merged(parts, m, x);
#else
  (void)m;
  TORCH_CHECK(false, "greedy_head_candidates_amx: this build has no AMX");
#endif
}

bool greedy_head_amx_supported() {
#if defined(RINGSERVE_AMX) && defined(RINGSERVE_GREEDY_PASS)
  return true;
#else
  return false;
#endif
}

// Whether every value of x (bf16 or float32, contiguous) is finite: the pick's guard (a row
// holding NaN or inf is left to the full head), one op where torch's isfinite, all and
// the read of its answer took ~0.1 ms of a one-row step with the caches the weights swept.
bool greedy_head_finite(const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "greedy_head_finite: x must be contiguous bf16 or float32");
  const int64_t n = x.numel();
  bool ok = true;
  if (x.scalar_type() == at::kFloat) {
    const float* p = x.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) ok &= std::isfinite(p[i]);
  } else {
    // bf16: finite unless its exponent bits are all ones
    const auto* p = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
    for (int64_t i = 0; i < n; ++i) ok &= (p[i] & 0x7F80) != 0x7F80;
  }
  return ok;
}

// The one-byte copy of an int8 head (qweight [n, k] int8, scales [n, k / group] float16,
// no mins) that greedy_head_candidates reads, packed in one pass: tiles [T, k * 16] uint8 of
// q + 128, tile t holding rows 16t..16t + 15 as [k / 4][16][4] (rows past n are 128: zero),
// and norms [T * 16] float32, each row's ||w_r|| = sqrt(sum_g s_g^2 sum_j q_j^2) in double
// (integer squares, exact), rounded up by 1e-6 (0 for the padding rows).
void greedy_head_pack_int8(const at::Tensor& qweight, const at::Tensor& scales, int64_t group,
                           at::Tensor& tiles, at::Tensor& norms) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "greedy_head_pack_int8: qweight must be int8 [n, k], contiguous");
  const int64_t n = qweight.size(0), k = qweight.size(1);
  TORCH_CHECK(group > 0 && k % group == 0 && k % 4 == 0, "greedy_head_pack_int8: bad group");
  const int64_t groups = k / group, count = tiles.size(0);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.numel() == n * groups,
              "greedy_head_pack_int8: scales must be float16 [n, k / group], contiguous");
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.is_contiguous() &&
                  tiles.numel() == count * k * 16 && count * 16 >= n,
              "greedy_head_pack_int8: tiles must be uint8 [ceil(n / 16), k * 16]");
  TORCH_CHECK(norms.scalar_type() == at::kFloat && norms.is_contiguous() &&
                  norms.numel() == count * 16,
              "greedy_head_pack_int8: norms must be float32 [tiles * 16]");
  const int8_t* q = qweight.data_ptr<int8_t>();
  const c10::Half* sc = scales.data_ptr<c10::Half>();
  uint8_t* out = tiles.data_ptr<uint8_t>();
  float* norm = norms.data_ptr<float>();
  ringserve::parallel_for(0, count, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      uint8_t* tile = out + t * k * 16;
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t r = t * 16 + i;
        if (r >= n) {
          for (int64_t c = 0; c < k / 4; ++c) std::memset(tile + c * 64 + i * 4, 128, 4);
          norm[r] = 0.f;
          continue;
        }
        const int8_t* row = q + r * k;
        double total = 0.0;
        for (int64_t g = 0; g < groups; ++g) {
          int64_t squares = 0;
          for (int64_t j = g * group; j < (g + 1) * group; ++j)
            squares += static_cast<int64_t>(row[j]) * row[j];
          const double s = static_cast<float>(sc[r * groups + g]);
          total += s * s * static_cast<double>(squares);
        }
        norm[r] = static_cast<float>(std::sqrt(total) * (1 + 1e-6));  // rounded up
        for (int64_t c = 0; c < k / 4; ++c) {
          uint32_t four;
          std::memcpy(&four, row + c * 4, 4);
          four ^= 0x80808080u;  // q + 128, as bytes
          std::memcpy(tile + c * 64 + i * 4, &four, 4);
        }
      }
    }
  });
}

bool greedy_head_supported() {
#if defined(RINGSERVE_GREEDY_PASS)
  return true;
#else
  return false;
#endif
}

}  // namespace

RINGSERVE_FRAGMENT(RINGSERVE_NS, m) {
  m.def("greedy_head_candidates(Tensor x, Tensor tiles, Tensor scales, Tensor norms, int group, "
        "int vocab) -> Tensor[]");
  m.def("greedy_head_supported() -> bool", &greedy_head_supported);
  m.def("greedy_head_candidates_amx(Tensor x, Tensor tiles, Tensor meta, int vocab, float rho) -> "
        "Tensor[]");
  m.def("greedy_head_amx_supported() -> bool", &greedy_head_amx_supported);
  m.def("greedy_head_finite(Tensor x) -> bool", &greedy_head_finite);
  m.def("greedy_head_pack_int8(Tensor qweight, Tensor scales, int group, Tensor(a!) tiles, "
        "Tensor(b!) norms) -> ()");
}

RINGSERVE_IMPL(RINGSERVE_NS, m) {
  m.impl("greedy_head_candidates", &greedy_head_candidates);
  m.impl("greedy_head_candidates_amx", &greedy_head_candidates_amx);
  m.impl("greedy_head_pack_int8", &greedy_head_pack_int8);
}
