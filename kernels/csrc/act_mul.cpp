// A gated MLP's middle, act(gate) * up, in one pass over bf16 rows: torch's own
// tanh-approximated GELU (ATen/native/cpu/Gelu.h, on ATen's vectors of this build's
// width), rounded to bf16 as torch's gelu rounds it, times up, rounded again as torch's
// mul rounds it. So the bits are torch's `gelu(gate, approximate="tanh") * up` wherever
// this build's vectors are the ones torch dispatches to (kernels/cpu_act.py checks every
// bf16 value once against torch before using it); it saves the two ops' separate passes
// and parallel regions (gelu took ~180 us for 32 x 2048 values on a 2-core VM).

// NOTE: x86 vector builds only. The portable build (the compiler's default target, aarch64
// too) has no op body: ATen's scalar vectors use std::tanh, not torch's bits, and its vector
// headers are not worth a build that could fail on an unknown target.
#if defined(__AVX512F__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#define RINGSERVE_ACT_MUL 1
#elif defined(__AVX2__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#define RINGSERVE_ACT_MUL 1
#endif

#include <ATen/ATen.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(RINGSERVE_ACT_MUL)
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/cpu/Gelu.h>
#endif
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "ops.h"
#include "thread_pool.h"

#include "bf16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

using Bf16 = c10::BFloat16;

#if defined(RINGSERVE_ACT_MUL)
using VecF = at::vec::Vectorized<float>;

// NOTE: the bf16 <-> float conversions are ours (a shift; round-to-nearest-even as torch's
// for finite values): ATen's convert_to_float / convert_from_float are not all inline
// and did not link from an extension.
// bf16 of f as torch rounds it, NaN kept NaN (ringserve::from_f takes finite values only)
inline Bf16 narrow(float f) {
  return std::isnan(f) ? Bf16(static_cast<uint16_t>(0x7FC0), Bf16::from_bits())
                       : ringserve::from_f<Bf16>(f);
}

#if defined(__AVX512F__)
using ringserve::load16;

// Round to nearest even, NaN to a quiet NaN.
inline void narrow16(__m512 f, Bf16* p) {
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q),
                            _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
inline __m512 round16(__m512 f) {  // f as the bf16 it rounds to, widened again
  alignas(32) Bf16 tmp[16];
  narrow16(f, tmp);
  return load16(tmp);
}
#endif

void gelu_tanh_mul_row(const Bf16* g, const Bf16* u, int64_t n, Bf16* o) {
  constexpr int64_t kW = VecF::size();
  int64_t i = 0;
#if defined(__AVX512F__)
  static_assert(kW == 16, "AVX-512 vectors of 16 floats");
  for (; i + kW <= n; i += kW) {
    const VecF act = at::native::vectorized_gelu_approximated_with_tanh(VecF(load16(g + i)));
    // the gelu's own rounding to bf16, then the product's
    narrow16(_mm512_mul_ps(round16(act), load16(u + i)), o + i);
  }
#else
  float gf[kW], of[kW];
  for (; i + kW <= n; i += kW) {
    for (int64_t j = 0; j < kW; ++j) gf[j] = ringserve::to_f(g[i + j]);
    const VecF act = at::native::vectorized_gelu_approximated_with_tanh(VecF::loadu(gf));
    act.store(of);
    for (int64_t j = 0; j < kW; ++j)  // the gelu's own rounding to bf16, then the product's
      o[i + j] = narrow(ringserve::to_f(narrow(of[j])) * ringserve::to_f(u[i + j]));
  }
#endif
  for (; i < n; ++i) {  // torch's scalar tail: the same formula with std::tanh
    const Bf16 act = narrow(
        at::native::scalar_gelu_approximated_with_tanh(ringserve::to_f(g[i])));
    o[i] = narrow(ringserve::to_f(act) * ringserve::to_f(u[i]));
  }
}

// gate, up: bf16 [rows, n], unit stride in n (views of one fused projection are fine).
at::Tensor gelu_tanh_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() && gate.stride(1) == 1 &&
                  up.stride(1) == 1,
              "gelu_tanh_mul: gate and up must be [rows, n] alike, unit stride in n");
  TORCH_CHECK(gate.scalar_type() == at::kBFloat16 && up.scalar_type() == at::kBFloat16,
              "gelu_tanh_mul: bfloat16 gate and up");
  const int64_t rows = gate.size(0), n = gate.size(1);
  auto out = at::empty({rows, n}, gate.options());
  const Bf16* g = gate.data_ptr<Bf16>();
  const Bf16* u = up.data_ptr<Bf16>();
  Bf16* o = out.data_ptr<Bf16>();
  const int64_t gs = gate.stride(0), us = up.stride(0);
  // NOTE: pieces of 1024 values a work item, so that few rows still use every thread
  constexpr int64_t kPiece = 1024;
  const int64_t pieces = (n + kPiece - 1) / kPiece;
  ringserve::parallel_for(0, rows * pieces, 4, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t r = w / pieces, lo = (w % pieces) * kPiece;
      const int64_t len = std::min(kPiece, n - lo);
      gelu_tanh_mul_row(g + r * gs + lo, u + r * us + lo, len, o + r * n + lo);
    }
  });
  return out;
}
#else
at::Tensor gelu_tanh_mul(const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "gelu_tanh_mul: not in the portable build (x86 vector builds only)");
}
#endif

}  // namespace

RINGSERVE_FRAGMENT(RINGSERVE_NS, m) {
  m.def("gelu_tanh_mul(Tensor gate, Tensor up) -> Tensor");
}

RINGSERVE_IMPL(RINGSERVE_NS, m) { m.impl("gelu_tanh_mul", &gelu_tanh_mul); }
