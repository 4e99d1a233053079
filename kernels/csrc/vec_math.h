// A vector of float32 lanes written once for the AVX2 and AVX-512 builds (`Vec`: 8 lanes
// with AVX2 + FMA, 16 with AVX-512), and exp over it: shared by the attention rows
// (attention_rows.h) and the gated MLP's float32 GELU (act_mul.cpp). Builds without AVX2
// have none of it; their callers keep scalar loops.

#pragma once

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "bf16.h"

#include <cstdint>

#ifndef RINGSERVE_NS
#define RINGSERVE_NS ringserve
#endif

namespace ringserve {
namespace RINGSERVE_NS {  // this variant's library's own copy (built with its flags)

#if defined(__AVX2__)
#if defined(__AVX512F__)
struct Vec {
  using V = __m512;
  static constexpr int64_t W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V loadf(const float* p) { return _mm512_loadu_ps(p); }
  template <typename C>
  static V load(const C* p) { return ringserve::load16(p); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V round(V a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static V scale2n(V p, V n) { return _mm512_scalef_ps(p, n); }  // p * 2^n
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  // a >= b ? x : y, lane by lane (false where either of a, b is NaN)
  static V select_ge(V a, V b, V x, V y) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_GE_OQ), y, x);
  }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
};
#else
struct Vec {
  using V = __m256;
  static constexpr int64_t W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V loadf(const float* p) { return _mm256_loadu_ps(p); }
  template <typename C>
  static V load(const C* p) { return ringserve::load8(p); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V round(V a) {
    return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  // p * 2^n with 2^n built in the exponent bits (AVX2 has no scalef); n >= -126 after
  // exp_nonpositive's clamp, so 2^n is a normal float
  static V scale2n(V p, V n) {
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  // a >= b ? x : y, lane by lane (false where either of a, b is NaN)
  static V select_ge(V a, V b, V x, V y) {
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_GE_OQ));
  }
  static float sum(V v) { return ringserve::hsum(v); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
};
#endif

// exp(x) for x <= 0 (softmax after subtracting the max), relative error ~2e-7: a degree-6
// polynomial of the remainder after 2^n, scaled back by 2^n.
inline Vec::V exp_nonpositive(Vec::V x) {
  x = Vec::max(x, Vec::set1(-87.0f));
  const Vec::V n = Vec::round(Vec::mul(x, Vec::set1(1.44269504f)));
  Vec::V r = Vec::fnmadd(n, Vec::set1(0.693145751953125f), x);
  r = Vec::fnmadd(n, Vec::set1(1.428606765330187e-06f), r);
  Vec::V p = Vec::set1(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = Vec::fmadd(p, r, Vec::set1(c));
  return Vec::scale2n(p, n);
}

#endif  // __AVX2__

}  // namespace RINGSERVE_NS
}  // namespace ringserve
