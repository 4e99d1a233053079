// y = x w^T + b for steps of 1-16 x rows over a copy of an int8 or 4-bit weight's integers
// in the pair layout of the bf16 tiles (quant_gemm.cpp's run_tiles): each tile holds 32
// weight rows, pairs of k interleaved across them (int8: byte 64 p + 2 i + e is
// w[i][2 p + e]; 4-bit: two values a byte, byte 32 p + 2 i + e holds row i's value low and
// row 16 + i's high, i < 16). A pass widens each pair's values to int16 (one vpmovsxbw or
// vpmovzxbw per 16 rows) and multiplies them with x rounded to int16 blocks (int16_acts.h)
// by vpdpwssd: 16 outputs of two products each an instruction, int32 sums exact; each 16-
// or 32-value segment's sums are scaled by the weight group's scale times the x block's
// scale into float32.
//
// Why: at 1-16 x rows a step's large matrices cost their read from memory. The bf16 tiles
// copy (2 bytes a value) read at ~26 GB/s took 13 ms of gemma-3-270m's 8-row step for its
// 262144 x 640 head alone (docs/cpu.md, "At 8 rows the head is its copy's read"); this copy
// is half those bytes (int8) or a quarter (4-bit: the weight's own bytes; at one byte a
// value, as until 2026-12-07, an 8-row step read its 4-bit layers twice over: docs/cpu.md,
// "Half-byte tiles for 4-bit weights"), for about the same instructions a value.
//
// Numbers: as int16_act_gemm.cpp's, so kernels/quant.py's `int16_act_matmul_reference`
// states them in float64 (x blocks of 32, exact integer sums, 4-bit mins times the exact
// float32 sums of x over each group). Groups: 16 (int8) or a multiple of 32.
// Builds without AVX-512 BW have no such path: `int8_tiles_fast()` says which.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "bf16.h"
#include "int16_acts.h"
#include "prefetch.h"
#include "ops.h"
#include "quant_layout.h"
#include "thread_pool.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kTile = 32;  // weight rows a tile: two vectors of 16 outputs
constexpr int kPassRows = 6;   // x rows a pass: 12 integer and 12 float sums in registers

// The weight's value j of row `row` (int8 as is; 4-bit as its 0..15).
inline int8_t value_at(const uint8_t* row, int64_t j, int64_t bits) {
  if (bits == 8) return static_cast<int8_t>(row[j]);
  return static_cast<int8_t>((row[(j >> 6) * 32 + (j & 31)] >> ((j & 32) >> 3)) & 0xF);
}

// qweight [n, k'] (kernels/quant.py's layout) -> tiles int8 [nt, k / 2 * 64] (4-bit:
// [nt, k / 2 * 32]), scales and (4-bit) mins float16 [nt, groups * 32]: the 32 rows' values
// of group g side by side. Rows past the last are 0.
std::vector<at::Tensor> int8_tiles(const at::Tensor& qweight, const at::Tensor& scales,
                                   const std::optional<at::Tensor>& mins, int64_t bits,
                                   int64_t group) {
  const int64_t n = qweight.size(0), k = bits == 8 ? qweight.size(1) : qweight.size(1) * 2;
  ringserve::check_layout(qweight, scales, mins, bits, group, k);
  TORCH_CHECK(group % ringserve::kActBlock == 0 || (bits == 8 && group == 16),
              "int8_tiles: the weight group must be a multiple of 32 (or 16 for int8)");
  const int64_t nt = (n + kTile - 1) / kTile, kp = k / 2, groups = k / group;
  const int64_t row_bytes = qweight.size(1);
  // (4-bit: two values a byte, the low nibble row i's, the high row 16 + i's)
  const int64_t tile_bytes = bits == 8 ? kp * 2 * kTile : kp * kTile;
  auto tiles = at::empty({nt, tile_bytes}, qweight.options().dtype(at::kChar));
  auto tsc = at::zeros({nt, groups * kTile}, scales.options());
  auto tmn = bits == 4 ? at::zeros({nt, groups * kTile}, scales.options())
                       : at::empty({0, groups * kTile}, scales.options());
  const auto* q = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  const auto* s = scales.data_ptr<c10::Half>();
  const c10::Half* mn = bits == 4 ? mins->data_ptr<c10::Half>() : nullptr;
  auto* tp = tiles.data_ptr<int8_t>();
  auto* sp = tsc.data_ptr<c10::Half>();
  auto* mp = bits == 4 ? tmn.data_ptr<c10::Half>() : nullptr;
  ringserve::parallel_for(0, nt, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int8_t* tile = tp + t * tile_bytes;
      for (int64_t i = 0; i < kTile; ++i) {
        const int64_t r = t * kTile + i;
        const uint8_t* row = r < n ? q + r * row_bytes : nullptr;
        for (int64_t p = 0; p < kp; ++p)
          for (int64_t e = 0; e < 2; ++e) {
            const int8_t v = row == nullptr ? 0 : value_at(row, 2 * p + e, bits);
            if (bits == 8) {
              tile[p * 2 * kTile + 2 * i + e] = v;
            } else {  // byte b of a pair's 32: the pair layout's byte b low, byte 32 + b high
              const int64_t b = p * kTile + 2 * (i % 16) + e;
              const uint8_t old = i < 16 ? 0 : static_cast<uint8_t>(tile[b]);
              tile[b] = static_cast<int8_t>(i < 16 ? v : (old | (v << 4)));
            }
          }
        if (row == nullptr) continue;
        for (int64_t g = 0; g < groups; ++g) {
          sp[t * groups * kTile + g * kTile + i] = s[r * groups + g];
          if (mp != nullptr) mp[t * groups * kTile + g * kTile + i] = mn[r * groups + g];
        }
      }
    }
  });
  return {tiles, tsc, tmn};
}

#if defined(__AVX512BW__)

// acc + the pairwise int16 products of x and w (exact: |x| <= 32767, |w| <= 128).
inline __m512i dot_pairs(__m512i acc, __m512i x, __m512i w) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, x, w);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(x, w));
#endif
}

inline __m512 halves16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 float32 -> bf16 with round-to-nearest-even (finite values, as ringserve::from_f).
inline __m256i narrow16(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}

inline void store16(c10::BFloat16* p, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(p, mask, narrow16(v));
}
inline void store16(float* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }

struct TileArgs {
  const int8_t* tiles;      // [nt, kp * 64]
  const c10::Half* scales;  // [nt, groups * 32]
  const c10::Half* mins;    // [nt, groups * 32] (4-bit) or null
  const float* bias;        // [n] or null
  int64_t k, group, groups, n;
  int64_t tile_bytes;  // k * 32 (one byte a value) or k * 16 (4-bit: two a byte)
};

// out[m, tile t's rows] for x rows [0, MR) of `a` starting at row m0. SEG: values a
// segment, whose integer sums share one weight scale and one x scale: 16 (group 16) or 32.
// `ahead`: the next tile's lines, some asked for every segment.
template <int MR, int SEG, bool NIB, typename Out>
void tile_pass(const TileArgs& w, const ringserve::Acts& a, int64_t m0, int64_t t, Out* out,
               ringserve::Ahead ahead = {}) {
  const int64_t k = w.k, kp = k / 2, blocks = a.blocks;
  const int8_t* tile = w.tiles + t * w.tile_bytes;
  const c10::Half* sc = w.scales + t * w.groups * kTile;
  const int16_t* xq = a.q.data() + m0 * k;
  const float* xd = a.d.data() + m0 * blocks;
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  constexpr int64_t kSegPairs = SEG / 2;
  const int32_t* xr[MR];  // x row m's int16 pairs
  for (int m = 0; m < MR; ++m) xr[m] = reinterpret_cast<const int32_t*>(xq + m * k);
  // NOTE: the segment's weight group and x block counted, not divided: an idiv a segment
  // cost ~10% at 4 x rows.
  const int64_t segs_per_group = w.group / SEG;
  int64_t g = 0, in_group = 0;
  for (int64_t j = 0; j < k; j += SEG) {
    ahead.fetch();
    __m512i ip[MR][2];
    for (int m = 0; m < MR; ++m) ip[m][0] = ip[m][1] = _mm512_setzero_si512();
    const int64_t p0 = j / 2;
    for (int64_t p = p0; p < p0 + kSegPairs; ++p) {
      __m512i w0, w1;
      if constexpr (NIB) {  // the pair's 32 bytes: rows 0-15's values low, 16-31's high
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + p * kTile));
        const __m256i low = _mm256_set1_epi8(0x0F);
        w0 = _mm512_cvtepu8_epi16(_mm256_and_si256(v, low));
        w1 = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low));
      } else {
        const int8_t* tp = tile + p * 2 * kTile;
        w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tp)));
        w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tp + 32)));
      }
      for (int m = 0; m < MR; ++m) {
        int32_t pair;
        std::memcpy(&pair, xr[m] + p, sizeof(pair));
        const __m512i xv = _mm512_set1_epi32(pair);
        ip[m][0] = dot_pairs(ip[m][0], w0, xv);
        ip[m][1] = dot_pairs(ip[m][1], w1, xv);
      }
    }
    const int64_t b = j / ringserve::kActBlock;  // (a shift)
    const __m512 s0 = halves16(sc + g * kTile), s1 = halves16(sc + g * kTile + 16);
    for (int m = 0; m < MR; ++m) {
      const __m512 d = _mm512_set1_ps(xd[m * blocks + b]);
      acc[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ip[m][0]), _mm512_mul_ps(s0, d), acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ip[m][1]), _mm512_mul_ps(s1, d), acc[m][1]);
    }
    if (++in_group == segs_per_group) {
      in_group = 0;
      ++g;
    }
  }
  if (w.mins != nullptr) {  // 4-bit: each group's min times the exact sum of x over it
    const c10::Half* mn = w.mins + t * w.groups * kTile;
    const float* gs = a.gsum.data() + m0 * a.gpad;
    for (int64_t g = 0; g < w.groups; ++g) {
      const __m512 n0 = halves16(mn + g * kTile), n1 = halves16(mn + g * kTile + 16);
      for (int m = 0; m < MR; ++m) {
        const __m512 xs = _mm512_set1_ps(gs[m * a.gpad + g]);
        acc[m][0] = _mm512_fmadd_ps(xs, n0, acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(xs, n1, acc[m][1]);
      }
    }
  }
  const int64_t r0 = t * kTile, valid = std::min(kTile, w.n - r0);
  for (int h = 0; h < 2; ++h) {
    const int64_t left = valid - h * 16;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    const __m512 bv = w.bias != nullptr ? _mm512_maskz_loadu_ps(mask, w.bias + r0 + h * 16)
                                        : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m)
      store16(out + (m0 + m) * w.n + r0 + h * 16, _mm512_add_ps(acc[m][h], bv), mask);
  }
}

template <int SEG, bool NIB, typename Out>
void run(const TileArgs& w, const ringserve::Acts& a, int64_t rows, Out* out) {
  const int64_t nt = (w.n + kTile - 1) / kTile;
  // NOTE: each thread's tiles are one stream in memory; a tile (20 KiB at k = 640) stays in
  // L1/L2 across the passes of kPassRows x rows.
  // NOTE: the rows split evenly over the passes (8 rows: 4 + 4, not 6 + 2): a pass widens
  // the tile's values once for all its rows.
  const int64_t passes = (rows + kPassRows - 1) / kPassRows, per = (rows + passes - 1) / passes;
  // NOTE: the next tile asked for into L2 a few lines a segment of the first pass.
  const int64_t tile_bytes = w.tile_bytes;
  ringserve::parallel_for(0, nt, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m0 = 0; m0 < rows; m0 += per) {
        const ringserve::Ahead ahead =
            m0 == 0 && t + 1 < t1
                ? ringserve::Ahead(w.tiles + (t + 1) * tile_bytes, tile_bytes, w.k / SEG)
                : ringserve::Ahead();
        ringserve::with_rows<kPassRows>(std::min(per, rows - m0), [&](auto r) {
          tile_pass<decltype(r)::value, SEG, NIB>(w, a, m0, t, out, ahead);
        });
      }
  });
}

#endif  // __AVX512BW__

// x: [m, k] bf16 or float32; tiles, scales, mins: `int8_tiles`' copy of an [n, k] weight;
// bias: [n] or None. Returns [m, n] in x's dtype.
at::Tensor int8_tiles_linear(const at::Tensor& x, const at::Tensor& tiles,
                             const at::Tensor& scales, const at::Tensor& mins, int64_t bits,
                             int64_t group, int64_t n, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "int8_tiles_linear: x must be bf16 or float32 [m, k]");
  const int64_t k = x.size(1), rows = x.size(0), nt = (n + kTile - 1) / kTile;
  TORCH_CHECK(bits == 4 || bits == 8, "int8_tiles_linear: bits must be 4 or 8");
  TORCH_CHECK(k % ringserve::kActBlock == 0 && group > 0 && k % group == 0 &&
                  (group % ringserve::kActBlock == 0 || (bits == 8 && group == 16)),
              "int8_tiles_linear: k a multiple of 32, group 16 (int8) or a multiple of 32 "
              "dividing k");
  const int64_t groups = k / group;
  TORCH_CHECK(tiles.scalar_type() == at::kChar && tiles.is_contiguous() && tiles.dim() == 2 &&
                  tiles.size(0) == nt && tiles.size(1) == (bits == 8 ? k : k / 2) * kTile,
              "int8_tiles_linear: tiles must come from int8_tiles for this k and n");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.size(0) == nt && scales.size(1) == groups * kTile,
              "int8_tiles_linear: scales must come from int8_tiles");
  TORCH_CHECK(bits == 8 || (mins.scalar_type() == at::kHalf && mins.is_contiguous() &&
                            mins.sizes() == scales.sizes()),
              "int8_tiles_linear: 4-bit tiles need their mins");
  TORCH_CHECK(!bias.has_value() || bias->numel() == n, "int8_tiles_linear: bias must be [n]");
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
#if defined(__AVX512BW__)
  // NOTE: x read as it is (bf16 widened exactly as quantized), not converted to a float32
  // tensor first: at one decode row that conversion was one more ATen call a linear
  const at::Tensor xc = x.contiguous();
  const std::optional<at::Tensor> bf =
      bias.has_value() ? std::optional<at::Tensor>(bias->to(at::kFloat).contiguous())
                       : std::nullopt;
  const ringserve::Acts a =
      x.scalar_type() == at::kBFloat16
          ? ringserve::quantize_acts(xc.data_ptr<c10::BFloat16>(), rows, k, group, bits == 4)
          : ringserve::quantize_acts(xc.data_ptr<float>(), rows, k, group, bits == 4);
  const TileArgs w{tiles.data_ptr<int8_t>(), scales.data_ptr<c10::Half>(),
                   bits == 4 ? mins.data_ptr<c10::Half>() : nullptr,
                   bf.has_value() ? bf->data_ptr<float>() : nullptr, k, group, groups, n,
                   tiles.size(1)};
  const auto go = [&](auto* op) {
    if (group == 16)
      run<16, false>(w, a, rows, op);  // (int8 only)
    else if (bits == 8)
      run<32, false>(w, a, rows, op);
    else
      run<32, true>(w, a, rows, op);
  };
  if (x.scalar_type() == at::kBFloat16)
    go(out.data_ptr<c10::BFloat16>());
  else
    go(out.data_ptr<float>());
  return out;
#else
  TORCH_CHECK(false, "int8_tiles_linear: this build has no AVX-512 BW");
#endif
}

// Whether this build multiplies int8 tiles (AVX-512 BW; vpdpwssd where it has VNNI).
bool int8_tiles_fast() {
#if defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

}  // namespace

RINGSERVE_FRAGMENT(RINGSERVE_NS, m) {
  m.def("int8_tiles(Tensor qweight, Tensor scales, Tensor? mins, int bits, int group) -> Tensor[]");
  m.def("int8_tiles_linear(Tensor x, Tensor tiles, Tensor scales, Tensor mins, int bits, "
        "int group, int n, Tensor? bias) -> Tensor");
  m.def("int8_tiles_fast() -> bool", &int8_tiles_fast);
}

RINGSERVE_IMPL(RINGSERVE_NS, m) {
  m.impl("int8_tiles", &int8_tiles);
  m.impl("int8_tiles_linear", &int8_tiles_linear);
}
