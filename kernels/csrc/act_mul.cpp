// A gated MLP's middle, act(gate) * up, in one pass over bf16 rows, with torch's bits:
// gelu(gate, approximate="tanh") is looked up in a table of torch's own results for all
// 65,536 bf16 values (kernels/cpu_act.py builds it with torch once a process), then times
// up, rounded to bf16 as torch's mul rounds it. So the result is torch's
// `gelu(gate, approximate="tanh") * up` on every build and CPU, by construction, wherever
// torch itself takes its vector path (rows whose length 64 divides).
//
// NOTE: this replaced a pass that ran ATen's vectorised tanh GELU (Sleef's tanh) on each
// value: ~180 cycles a 16-value vector on Zen 4, 29 ms of a 512-token prefill step of
// gemma-3-270m (18 layers x 512 x 2048 values) and 1.5 ms of a 32-row decode step. The
// table (128 KiB) stays in L2. It also needs no ATen
// vector headers, so the portable build (aarch64 too) has it.
//
// Float32 rows (the AVX2 path's int16 activations, or --dtype float32) take their own pass,
// `gelu_tanh_mul_f32` below: no table can cover float32, so it computes the GELU, closer
// to the exact value than torch's formula.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "ops.h"
#include "thread_pool.h"

#include "bf16.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

using Bf16 = c10::BFloat16;
using ringserve::to_f;

// NOTE: two loops: the look-ups (scalar loads: the compilers do not vectorise them, and
// AVX2 / AVX-512 gathers were no faster) into a buffer, then the products, which the
// compiler vectorises.
void gelu_tanh_mul_row(const Bf16* __restrict g, const Bf16* __restrict u, int64_t n,
                       const Bf16* __restrict table, Bf16* __restrict o) {
  constexpr int64_t kChunk = 256;
  const Bf16 nan(static_cast<uint16_t>(0x7FC0), Bf16::from_bits());  // torch's NaN
  alignas(64) Bf16 act[kChunk];
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t len = std::min(kChunk, n - i0);
    for (int64_t i = 0; i < len; ++i) act[i] = table[g[i0 + i].x];
    for (int64_t i = 0; i < len; ++i) {
      const float f = to_f(act[i]) * to_f(u[i0 + i]);
      o[i0 + i] = f != f ? nan : ringserve::from_f<Bf16>(f);
    }
  }
}

// fn(row, first value, count) over pieces of 1024 values of each of `rows` rows of n, the
// pieces spread over the threads.
// NOTE: pieces, not rows, a work item, so that few rows still use every thread
template <typename Fn>
void for_pieces(int64_t rows, int64_t n, const Fn& fn) {
  constexpr int64_t kPiece = 1024;
  const int64_t pieces = (n + kPiece - 1) / kPiece;
  ringserve::parallel_for(0, rows * pieces, 4, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t r = w / pieces, lo = (w % pieces) * kPiece;
      fn(r, lo, std::min(kPiece, n - lo));
    }
  });
}

// gate, up: bf16 [rows, n], unit stride in n (views of one fused projection are fine);
// table: 65,536 bf16 values, table[b] = torch's gelu(tanh) of the bf16 value with bits b.
at::Tensor gelu_tanh_mul(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& table) {
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() && gate.stride(1) == 1 &&
                  up.stride(1) == 1,
              "gelu_tanh_mul: gate and up must be [rows, n] alike, unit stride in n");
  TORCH_CHECK(gate.scalar_type() == at::kBFloat16 && up.scalar_type() == at::kBFloat16,
              "gelu_tanh_mul: bfloat16 gate and up");
  TORCH_CHECK(table.scalar_type() == at::kBFloat16 && table.numel() == 65536 &&
                  table.is_contiguous(),
              "gelu_tanh_mul: table must be 65536 contiguous bfloat16 values");
  const int64_t rows = gate.size(0), n = gate.size(1);
  auto out = at::empty({rows, n}, gate.options());
  const Bf16* g = gate.data_ptr<Bf16>();
  const Bf16* u = up.data_ptr<Bf16>();
  const Bf16* t = table.data_ptr<Bf16>();
  Bf16* o = out.data_ptr<Bf16>();
  const int64_t gs = gate.stride(0), us = up.stride(0);
  for_pieces(rows, n, [&](int64_t r, int64_t lo, int64_t len) {
    gelu_tanh_mul_row(g + r * gs + lo, u + r * us + lo, len, t, o + r * n + lo);
  });
  return out;
}

// The float32 pass: gelu(x, tanh) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3),
// computed as x * sigmoid(2u) with sigmoid(a) = 1 / (1 + e^-a) for a >= 0 and
// e^a / (1 + e^a) below: exp is only taken of -|a| (exp_nonpositive), so nothing overflows,
// and the negative side has no 1 + tanh cancellation (torch's formula loses all digits
// there: gelu(-10) is -0 in torch, -7.6e-23 here). Against float64 within ~4e-7 relative
// (tests/test_act_mul.py); the gelu is rounded to float32 before its product with up, as
// torch's two ops round. Special values as torch's: gelu(inf) = inf, gelu(-inf) = NaN.
// NOTE: torch's float32 tanh GELU (Sleef's tanh) ran ~4 ns a value on a Zen 3 core (2048
// values a row: 10 us a decode row, ~5 ms of a 32-row step of gemma-3-270m); the vector
// pass below takes ~0.3-0.5 ns (2026-12-05).
constexpr float kTwoBeta = 1.5957691216057308f;  // 2 sqrt(2 / pi)
constexpr float kKappa = 0.044715f;
constexpr float kExpFloor = -87.f;  // exp_nonpositive's clamp: below it e^a is taken as 0

inline float gelu_tanh_scalar(float x) {
  const float a = kTwoBeta * x * (1.f + kKappa * x * x);
  const float z = -std::fabs(a);
  const float t = z >= kExpFloor ? std::exp(z) : 0.f;
  const float sigmoid = (a >= 0.f ? 1.f : t) / (1.f + t);
  return x * sigmoid;
}

void gelu_tanh_mul_f32_row(const float* __restrict g, const float* __restrict u, int64_t n,
                           float* __restrict o) {
  int64_t i = 0;
#if defined(__AVX2__)
  using ringserve::RINGSERVE_NS::Vec;
  const Vec::V one = Vec::set1(1.f), zero = Vec::zero(), floor = Vec::set1(kExpFloor);
  for (; i + Vec::W <= n; i += Vec::W) {
    const Vec::V x = Vec::loadf(g + i);
    const Vec::V a = Vec::mul(Vec::mul(Vec::set1(kTwoBeta), x),
                              Vec::fmadd(Vec::mul(Vec::set1(kKappa), x), x, one));
    const Vec::V z = Vec::sub(zero, Vec::max(a, Vec::sub(zero, a)));
    const Vec::V t = Vec::select_ge(z, floor, ringserve::RINGSERVE_NS::exp_nonpositive(z), zero);
    const Vec::V sigmoid = Vec::div(Vec::select_ge(a, zero, one, t), Vec::add(one, t));
    Vec::store(o + i, Vec::mul(Vec::mul(x, sigmoid), Vec::loadf(u + i)));
  }
#endif
  for (; i < n; ++i) {
    const float act = gelu_tanh_scalar(g[i]);
    o[i] = act * u[i];
  }
}

// gate, up: float32 [rows, n], unit stride in n; out [rows, n].
at::Tensor gelu_tanh_mul_f32(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() && gate.stride(1) == 1 &&
                  up.stride(1) == 1,
              "gelu_tanh_mul_f32: gate and up must be [rows, n] alike, unit stride in n");
  TORCH_CHECK(gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat,
              "gelu_tanh_mul_f32: float32 gate and up");
  const int64_t rows = gate.size(0), n = gate.size(1);
  auto out = at::empty({rows, n}, gate.options());
  const float* g = gate.data_ptr<float>();
  const float* u = up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t gs = gate.stride(0), us = up.stride(0);
  for_pieces(rows, n, [&](int64_t r, int64_t lo, int64_t len) {
    gelu_tanh_mul_f32_row(g + r * gs + lo, u + r * us + lo, len, o + r * n + lo);
  });
  return out;
}

}  // namespace

RINGSERVE_FRAGMENT(RINGSERVE_NS, m) {
  m.def("gelu_tanh_mul(Tensor gate, Tensor up, Tensor table) -> Tensor");
  m.def("gelu_tanh_mul_f32(Tensor gate, Tensor up) -> Tensor");
}

RINGSERVE_IMPL(RINGSERVE_NS, m) {
  m.impl("gelu_tanh_mul", &gelu_tanh_mul);
  m.impl("gelu_tanh_mul_f32", &gelu_tanh_mul_f32);
}
