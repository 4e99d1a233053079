// y = x w^T + b with the weight kept compact in memory (bf16, int8 or 4-bit in
// kernels/quant.py's layout, or MXFP4 as checkpoints store it) and every product and sum in
// float32: the linear layers of CPUs without bf16 arithmetic (AVX2, AVX-512 without BF16,
// aarch64), of float32 activations on any CPU, and MXFP4 experts on every CPU.
//
// One source for every kernel variant (kernels/cpu_isa.py): GCC vector types of VW floats
// (16 where the build targets AVX-512, 8 elsewhere) compile to AVX-512, AVX2+FMA, SSE2 or
// NEON code by the variant's target flags alone; no x86 intrinsics, so aarch64 builds it.
//
// Few x rows (decode, run_rows): each weight row is read once, widened in registers to its
// real value (bf16: a 16-bit shift; int8: a conversion times the group's scale; 4-bit: a
// shift and a mask of the packed byte, a conversion, times the scale plus the min; MXFP4:
// a block's 16 bytes split into 32 codes, each looked up as twice its E2M1 value by a
// byte shuffle, a conversion, times half the block's power of two) and
// dotted with every x row by FMA. Up to four weight rows go side by side so that one x row
// still has independent sums (an FMA's latency is four of its issue slots).
// Many x rows (prefill, large batches: run_tiles): the weight is compute-bound there, so
// blocks of weight rows are widened once into a float32 tile in cache, and every block of
// MR x rows is dotted with every NR rows of the tile: MR * NR FMAs per MR + NR loads.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "ops.h"
#include "thread_pool.h"
#include "quant_layout.h"
#include "mxfp4.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int VW = 16;
#else
constexpr int VW = 8;
#endif
typedef float vf __attribute__((vector_size(VW * sizeof(float))));
typedef uint32_t vu32 __attribute__((vector_size(VW * sizeof(uint32_t))));
typedef uint16_t vu16 __attribute__((vector_size(VW * sizeof(uint16_t))));
typedef int32_t vi32 __attribute__((vector_size(VW * sizeof(int32_t))));
typedef int8_t vi8 __attribute__((vector_size(VW)));
typedef uint8_t vu8 __attribute__((vector_size(VW)));

constexpr int kBF16 = 16, kInt8 = 8, kInt4 = 4;  // the weight kinds (bits a value)
constexpr int kMxfp4 = 1;  // OCP MXFP4: E2M1 codes, two a byte, an E8M0 exponent per 32
constexpr int64_t kMaxRows = 8;                  // x rows a pass of run_rows

template <typename V>
inline V load(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < VW; ++i) s += v[i];
  return s;
}

inline float half_to_f(c10::Half h) { return static_cast<float>(h); }

struct Weight {
  const uint8_t* data;  // row r at data + r * row_bytes
  int64_t row_bytes, k, group, groups;
  const c10::Half* scales;  // [n, groups] (int8, 4-bit)
  const c10::Half* mins;    // [n, groups] (4-bit)
  const uint8_t* exponents;  // [n, groups] (MXFP4: E8M0, the block's 2^(e - 127))
  bool split;  // MXFP4 nibble order: GGUF's (value i low, 16 + i high) or transformers'
};

// VW values as stored (before scale and min), from p: bf16 and int8 at their own offset;
// 4-bit from the 32 bytes of a chunk of 64 values, value 64c + i in byte 32c + i's low
// nibble and value 64c + 32 + i in its high nibble (kernels/quant.py), so `shift` is 0
// for a chunk's first half and 4 for its second.
// NOTE: GCC turns a vector conversion from 8-bit or 16-bit lanes into scalar code (one
// cvtsi2ss a value: ~5x slower, measured); the x86 variants widen with the instructions
// made for it, the portable one goes through 32-bit lanes.
// MXFP4: the 32 values of one block from its 16 bytes (mxfp4.h) into out[0 .. 32 / VW),
// each twice its E2M1 value (one byte table lookup, then one conversion; the block's scale
// is halved to match, `e8m0_half`), in order.
using ringserve::e8m0_half;

inline void decode_fp4(const uint8_t* p, bool split, vf* out) {
#if defined(__AVX2__) || defined(__AVX512F__)
  __m128i v0, v1;  // values 0-15, 16-31
  ringserve::fp4_block_int8(p, split, v0, v1);
#if defined(__AVX512F__)
  out[0] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v0));
  out[1] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v1));
#else
  out[0] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0));
  out[1] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v0, 8)));
  out[2] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1));
  out[3] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v1, 8)));
#endif
#else
  for (int u = 0; u < 32 / VW; ++u)
    for (int i = 0; i < VW; ++i)
      out[u][i] = ringserve::kE2M1x2[ringserve::fp4_code(p, split, u * VW + i)];
#endif
}

template <int KIND>
inline vf raw(const uint8_t* p, int shift) {
#if defined(__AVX512F__)
  if constexpr (KIND == kBF16)
    return (vf)_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (KIND == kInt8)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  return (vf)_mm512_cvtepi32_ps(_mm512_and_si512(
      _mm512_srl_epi32(_mm512_cvtepu8_epi32(b), _mm_cvtsi32_si128(shift)),
      _mm512_set1_epi32(0xF)));
#elif defined(__AVX2__)
  if constexpr (KIND == kBF16)
    return (vf)_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (KIND == kInt8)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  return (vf)_mm256_cvtepi32_ps(_mm256_and_si256(
      _mm256_srl_epi32(_mm256_cvtepu8_epi32(b), _mm_cvtsi32_si128(shift)),
      _mm256_set1_epi32(0xF)));
#else
  if constexpr (KIND == kBF16) {
    return (vf)(__builtin_convertvector(load<vu16>(p), vu32) << 16);
  } else if constexpr (KIND == kInt8) {
    return __builtin_convertvector(__builtin_convertvector(load<vi8>(p), vi32), vf);
  } else {
    const vu32 b = __builtin_convertvector(load<vu8>(p), vu32);
    return __builtin_convertvector((vi32)((b >> static_cast<uint32_t>(shift)) & 0xFu), vf);
  }
#endif
}

// Values a step of the quantized loops covers: a 4-bit step is one half of a chunk (one
// byte address and shift), an int8 step one vector.
template <int KIND>
constexpr int64_t kStep = KIND == kInt4 || KIND == kMxfp4 ? 32 : VW;

// The first byte of step j's values in a row, and their shift.
template <int KIND>
inline const uint8_t* step_bytes(const uint8_t* row, uint64_t j) {
  return KIND == kInt4 ? row + (j >> 6) * 32 : row + j;
}
inline int step_shift(uint64_t j) { return static_cast<int>((j & 32) >> 3); }

// The scales (and mins) of rows [r, r + R) as floats: sc[i * groups + g].
template <int KIND, int R>
inline void row_scales(const Weight& w, int64_t r, float* sc, float* mn) {
  if constexpr (KIND == kMxfp4) {
    for (int64_t i = 0; i < R * w.groups; ++i) sc[i] = e8m0_half(w.exponents[r * w.groups + i]);
  } else if constexpr (KIND != kBF16) {
    for (int64_t i = 0; i < R * w.groups; ++i) {
      sc[i] = half_to_f(w.scales[r * w.groups + i]);
      if constexpr (KIND == kInt4) mn[i] = half_to_f(w.mins[r * w.groups + i]);
    }
  }
}

// Weight rows [r, r + R) dotted with x rows [0, M): out[m * n + r + i], float32.
template <int KIND, int M, int R>
inline void dot_rows(const Weight& w, const float* x, int64_t r, int64_t n, const float* bias,
                     float* sc, float* mn, float* out) {
  const int64_t k = w.k;
  const uint8_t* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = w.data + (r + i) * w.row_bytes;
  vf acc[R][M];
  for (int i = 0; i < R; ++i)
    for (int m = 0; m < M; ++m) acc[i][m] = vf{};
  float tail[R][M] = {};
  if constexpr (KIND == kBF16) {
    const int64_t full = k / VW * VW;
    for (int64_t j = 0; j < full; j += VW)
      for (int i = 0; i < R; ++i) {
        const vf wv = raw<KIND>(rows[i] + 2 * j, 0);
        for (int m = 0; m < M; ++m) acc[i][m] += wv * load<vf>(x + m * k + j);
      }
    for (int64_t j = full; j < k; ++j)  // widths that are not a multiple of VW
      for (int i = 0; i < R; ++i) {
        uint16_t h;
        std::memcpy(&h, rows[i] + 2 * j, 2);
        const uint32_t bits = static_cast<uint32_t>(h) << 16;
        float wj;
        std::memcpy(&wj, &bits, 4);
        for (int m = 0; m < M; ++m) tail[i][m] += wj * x[m * k + j];
      }
  } else {
    row_scales<KIND, R>(w, r, sc, mn);
    for (int64_t g = 0; g < w.groups; ++g) {
      vf s[R], mv[R];
      for (int i = 0; i < R; ++i) {
        s[i] = vf{} + sc[i * w.groups + g];
        if constexpr (KIND == kInt4) mv[i] = vf{} + mn[i * w.groups + g];
      }
      for (int64_t j = g * w.group; j < (g + 1) * w.group; j += kStep<KIND>) {
        if constexpr (KIND == kMxfp4) {
          // a block a step: each weight row's 32 values decoded once, dotted with every x
          // row unscaled, and the block's sum scaled once (the scale is a power of two:
          // the same float32 products and sums as scaling each value, bar overflow)
          for (int i = 0; i < R; ++i) {
            vf wv[32 / VW];
            decode_fp4(rows[i] + j / 2, w.split, wv);
            for (int m = 0; m < M; ++m) {
              vf block = wv[0] * load<vf>(x + m * k + j);
              for (int u = 1; u < 32 / VW; ++u) block += wv[u] * load<vf>(x + m * k + j + u * VW);
              acc[i][m] += block * s[i];
            }
          }
          continue;
        }
        const int shift = step_shift(j);
        for (int64_t t = 0; t < kStep<KIND>; t += VW)
          for (int i = 0; i < R; ++i) {
            vf wv = raw<KIND>(step_bytes<KIND>(rows[i], j) + t, shift) * s[i];
            if constexpr (KIND == kInt4) wv += mv[i];
            for (int m = 0; m < M; ++m) acc[i][m] += wv * load<vf>(x + m * k + j + t);
          }
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    const float b = bias != nullptr ? bias[r + i] : 0.f;
    for (int m = 0; m < M; ++m) out[m * n + r + i] = hsum(acc[i][m]) + tail[i][m] + b;
  }
}

// Weight rows [n0, n1) for x rows [0, M).
template <int KIND, int M>
void dot_block(const Weight& w, const float* x, int64_t n0, int64_t n1, int64_t n,
               const float* bias, float* sc, float* mn, float* out) {
  // NOTE: weight rows side by side give one x row independent sums; past four x rows
  // the sums are independent already and more rows would spill registers.
  constexpr int R = M == 1 ? 4 : (M <= 3 ? 2 : 1);
  int64_t r = n0;
  for (; r + R <= n1; r += R) dot_rows<KIND, M, R>(w, x, r, n, bias, sc, mn, out);
  for (; r < n1; ++r) dot_rows<KIND, M, 1>(w, x, r, n, bias, sc, mn, out);
}

template <int KIND>
void run_rows(const Weight& w, const float* x, int64_t rows, int64_t n, const float* bias,
              float* out) {
  // NOTE: 16 weight rows a task at least: 10-40 KiB of weights for k = 640.
  ringserve::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> sc(static_cast<size_t>(4 * w.groups + 1)), mn(sc.size());
    // NOTE: blocks of 64 weight rows stay in cache across passes of kMaxRows x rows.
    for (int64_t b0 = begin; b0 < end; b0 += 64) {
      const int64_t b1 = std::min(end, b0 + 64);
      for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows)
        ringserve::with_rows<kMaxRows>(rows - m0, [&](auto mr) {
          dot_block<KIND, decltype(mr)::value>(w, x + m0 * w.k, b0, b1, n, bias, sc.data(),
                                               mn.data(), out + m0 * n);
        });
    }
  });
}

// The many-row path. A tile holds NR weight rows widened to float32, row-major; the
// micro-kernel dots MR x rows with NRB tile rows at a time (MR * NRB sums in registers:
// 9 of AVX2's 16, 16 of AVX-512's 32).
constexpr int NRB = VW == 16 ? 4 : 3;
constexpr int MR = VW == 16 ? 4 : 3;
constexpr int64_t NR = NRB * 8;

template <int KIND>
void widen_tile(const Weight& w, int64_t r0, int64_t valid, float* sc, float* mn,
                float* tile) {
  const int64_t k = w.k;
  for (int64_t i = 0; i < NR; ++i) {
    float* t = tile + i * k;
    if (i >= valid) {
      std::fill(t, t + k, 0.f);
      continue;
    }
    const uint8_t* row = w.data + (r0 + i) * w.row_bytes;
    if constexpr (KIND == kBF16) {
      int64_t j = 0;
      for (; j + VW <= k; j += VW) {
        const vf v = raw<KIND>(row + 2 * j, 0);
        std::memcpy(t + j, &v, sizeof(v));
      }
      for (; j < k; ++j) {
        uint16_t h;
        std::memcpy(&h, row + 2 * j, 2);
        const uint32_t bits = static_cast<uint32_t>(h) << 16;
        std::memcpy(t + j, &bits, 4);
      }
    } else {
      row_scales<KIND, 1>(w, r0 + i, sc, mn);
      for (int64_t g = 0; g < w.groups; ++g) {
        const vf s = vf{} + sc[g];
        const vf mv = vf{} + (KIND == kInt4 ? mn[g] : 0.f);
        for (int64_t j = g * w.group; j < (g + 1) * w.group; j += kStep<KIND>) {
          if constexpr (KIND == kMxfp4) {
            vf block[32 / VW];
            decode_fp4(row + j / 2, w.split, block);
            for (int u = 0; u < 32 / VW; ++u) {
              const vf v = block[u] * s;
              std::memcpy(t + j + u * VW, &v, sizeof(v));
            }
            continue;
          }
          for (int64_t u = 0; u < kStep<KIND>; u += VW) {
            vf v = raw<KIND>(step_bytes<KIND>(row, j) + u, step_shift(j)) * s;
            if constexpr (KIND == kInt4) v += mv;
            std::memcpy(t + j + u, &v, sizeof(v));
          }
        }
      }
    }
  }
}

// out[m * n + r0 + i] for x rows [0, M) and tile rows [i0, i0 + NRB).
template <int M>
inline void tile_kernel(const float* x, int64_t k, const float* tile, int64_t i0,
                        int64_t valid, const float* bias, int64_t r0, int64_t n, float* out) {
  vf acc[M][NRB];
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < NRB; ++i) acc[m][i] = vf{};
  const int64_t full = k / VW * VW;
  for (int64_t j = 0; j < full; j += VW) {
    vf wv[NRB];
    for (int i = 0; i < NRB; ++i) wv[i] = load<vf>(tile + (i0 + i) * k + j);
    for (int m = 0; m < M; ++m) {
      const vf xv = load<vf>(x + m * k + j);
      for (int i = 0; i < NRB; ++i) acc[m][i] += xv * wv[i];
    }
  }
  for (int i = 0; i < NRB && i0 + i < valid; ++i) {
    const float b = bias != nullptr ? bias[r0 + i0 + i] : 0.f;
    for (int m = 0; m < M; ++m) {
      float s = hsum(acc[m][i]) + b;
      for (int64_t j = full; j < k; ++j) s += x[m * k + j] * tile[(i0 + i) * k + j];
      out[m * n + r0 + i0 + i] = s;
    }
  }
}

template <int KIND>
void run_tiles(const Weight& w, const float* x, int64_t rows, int64_t n, const float* bias,
               float* out) {
  const int64_t k = w.k;
  ringserve::parallel_for(0, (n + NR - 1) / NR, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> tile(static_cast<size_t>(NR * k));
    std::vector<float> sc(static_cast<size_t>(w.groups + 1)), mn(sc.size());
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r0 = t * NR, valid = std::min(NR, n - r0);
      widen_tile<KIND>(w, r0, valid, sc.data(), mn.data(), tile.data());
      for (int64_t m0 = 0; m0 < rows; m0 += MR)
        ringserve::with_rows<MR>(rows - m0, [&](auto mr) {
          for (int64_t i0 = 0; i0 < valid; i0 += NRB)
            tile_kernel<decltype(mr)::value>(x + m0 * k, k, tile.data(), i0, valid, bias, r0,
                                             n, out + m0 * n);
        });
    }
  });
}

template <int KIND>
void run(const Weight& w, const float* x, int64_t rows, int64_t n, const float* bias,
         int64_t tile_rows, float* out) {
  if (rows > tile_rows)
    run_tiles<KIND>(w, x, rows, n, bias, out);
  else
    run_rows<KIND>(w, x, rows, n, bias, out);
}

// ``x @ w^T + bias`` by ``f(x, bias, out)`` over float32 copies (x, bias) and a float32
// [m, n] result, returned in x's dtype (each value one float32 sum rounded once).
template <typename F>
at::Tensor in_float32(const at::Tensor& x, const std::optional<at::Tensor>& bias, int64_t n,
                      F&& f) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const std::optional<at::Tensor> bf =
      bias.has_value() ? std::optional<at::Tensor>(bias->to(at::kFloat).contiguous())
                       : std::nullopt;
  auto out = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
  if (x.size(0) == 0 || n == 0) return out.to(x.scalar_type());
  f(xf.data_ptr<float>(), bf.has_value() ? bf->data_ptr<float>() : nullptr,
    out.data_ptr<float>());
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// x: [m, k] float32 or bf16. bits 16: weight bf16 [n, k] (scales, mins, group unused);
// bits 8 / 4: the kernels/quant.py layout. bias: [n] or None. Returns [m, n] in x's dtype,
// each output one float32 sum rounded once. More than `tile_rows` x rows take the tiles.
at::Tensor compact_linear(const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& scales,
                          const std::optional<at::Tensor>& mins, int64_t bits, int64_t group,
                          const std::optional<at::Tensor>& bias, int64_t tile_rows) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "compact_linear: x must be float32 or bf16 [m, k]");
  const int64_t k = x.size(1), n = weight.size(0), rows = x.size(0);
  Weight w{};
  w.k = k;
  w.data = reinterpret_cast<const uint8_t*>(weight.data_ptr());
  if (bits == 16) {
    TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 &&
                    weight.is_contiguous() && weight.size(1) == k,
                "compact_linear: a bits-16 weight must be bf16 [n, k], contiguous");
    w.row_bytes = 2 * k;
    w.group = k;
    w.groups = 1;
  } else {
    TORCH_CHECK(scales.has_value(), "compact_linear: quantized weights need scales");
    ringserve::check_layout(weight, *scales, mins, bits, group, k);
    w.row_bytes = bits == 8 ? k : k / 2;
    w.group = group;
    w.groups = k / group;
    w.scales = scales->data_ptr<c10::Half>();
    w.mins = bits == 4 ? mins->data_ptr<c10::Half>() : nullptr;
    TORCH_CHECK(group % VW == 0, "compact_linear: group must be a multiple of ", VW);
  }
  TORCH_CHECK(!bias.has_value() || bias->numel() == n, "compact_linear: bias must be [n]");
  return in_float32(x, bias, n, [&](const float* xp, const float* bp, float* op) {
    switch (bits) {
      case 16: run<kBF16>(w, xp, rows, n, bp, tile_rows, op); break;
      case 8: run<kInt8>(w, xp, rows, n, bp, tile_rows, op); break;
      default: run<kInt4>(w, xp, rows, n, bp, tile_rows, op); break;
    }
  });
}

// x: [m, k] float32 or bf16; blocks: uint8 [n, k / 32, 16] or [n, k / 2], as an MXFP4
// checkpoint stores one matrix (two E2M1 codes a byte: value 2i in byte i's low nibble, or
// with `split`, GGUF's order, value i in byte i's low nibble and 16 + i in its high one);
// exponents: uint8 [n, k / 32] (E8M0, 255 is NaN); bias: [n] or None. Returns [m, n] in x's
// dtype: every weight is its exact value (E2M1 times 2^(e - 127), a float32), every
// product and sum float32. More than `tile_rows` x rows take the tiles.
at::Tensor mxfp4_linear(const at::Tensor& x, const at::Tensor& blocks,
                        const at::Tensor& exponents, const std::optional<at::Tensor>& bias,
                        int64_t tile_rows, bool split) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "mxfp4_linear: x must be float32 or bf16 [m, k]");
  const int64_t k = x.size(1), n = blocks.size(0), rows = x.size(0);
  TORCH_CHECK(k % 32 == 0, "mxfp4_linear: k must be a multiple of 32");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.numel() == n * k / 2,
              "mxfp4_linear: blocks must be uint8 [n, k / 32, 16], contiguous");
  TORCH_CHECK(exponents.scalar_type() == at::kByte && exponents.is_contiguous() &&
                  exponents.numel() == n * k / 32,
              "mxfp4_linear: exponents must be uint8 [n, k / 32], contiguous");
  TORCH_CHECK(!bias.has_value() || bias->numel() == n, "mxfp4_linear: bias must be [n]");
  Weight w{};
  w.k = k;
  w.data = blocks.data_ptr<uint8_t>();
  w.row_bytes = k / 2;
  w.group = 32;
  w.groups = k / 32;
  w.exponents = exponents.data_ptr<uint8_t>();
  w.split = split;
  return in_float32(x, bias, n, [&](const float* xp, const float* bp, float* op) {
    run<kMxfp4>(w, xp, rows, n, bp, tile_rows, op);
  });
}

// The vector width this build multiplies at (floats): 16 for AVX-512, 8 elsewhere.
int64_t compact_vector_width() { return VW; }

}  // namespace

RINGSERVE_FRAGMENT(RINGSERVE_NS, m) {
  m.def("compact_linear(Tensor x, Tensor weight, Tensor? scales, Tensor? mins, int bits, "
        "int group, Tensor? bias, int tile_rows=8) -> Tensor");
  m.def("compact_vector_width() -> int", &compact_vector_width);
  m.def("mxfp4_linear(Tensor x, Tensor blocks, Tensor exponents, Tensor? bias, "
        "int tile_rows=8, bool split=False) -> Tensor");
}

RINGSERVE_IMPL(RINGSERVE_NS, m) {
  m.impl("compact_linear", &compact_linear);
  m.impl("mxfp4_linear", &mxfp4_linear);
}
