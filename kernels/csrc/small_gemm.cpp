// y = x w^T + b for a few rows of bf16 activations: the decode step's GEMV, at memory speed.
//
// A decode step with a handful of sequences reads every weight once and does little
// arithmetic with it. oneDNN's GEMM reaches about half the machine's read bandwidth on
// gemma-3-270m's 640-wide layers at batch 1 (per-call set-up, blocking made for bigger M);
// here each weight row is streamed once, 32 bf16 at a time, and dotted with every x row by
// AVX512-BF16's dpbf16 (exact products, float32 sums), one row per iteration, rows split
// over threads.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "ops.h"
#include "thread_pool.h"

#include <optional>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 8;  // x rows served here; more go to oneDNN (linear_small_max)

#if defined(__AVX512BF16__)
template <int M>
void rows_dot(const uint16_t* x, const uint16_t* w, const c10::BFloat16* bias, int64_t n0,
              int64_t n1, int64_t k, int64_t n, c10::BFloat16* out) {
  const int64_t full = k / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((1ULL << (k - full)) - 1);
  for (int64_t r = n0; r < n1; ++r) {
    const uint16_t* wr = w + r * k;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < full; i += 32) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + i);
      for (int m = 0; m < M; ++m)
        acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512(x + m * k + i), wv);
    }
    if (full < k) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, wr + full);
      for (int m = 0; m < M; ++m)
        acc[m] = _mm512_dpbf16_ps(
            acc[m], (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * k + full), wv);
    }
    const float b = bias != nullptr ? static_cast<float>(bias[r]) : 0.f;
    for (int m = 0; m < M; ++m)
      out[m * n + r] = static_cast<c10::BFloat16>(_mm512_reduce_add_ps(acc[m]) + b);
  }
}

template <int M>
void run_rows(const at::Tensor& x, const at::Tensor& w, const c10::BFloat16* bias,
              at::Tensor& out) {
  const int64_t k = x.size(1), n = w.size(0);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  auto* op = out.data_ptr<c10::BFloat16>();
  // NOTE: 16 rows a task at least: ~20 KiB of weights for k = 640, enough to amortise.
  ringserve::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    rows_dot<M>(xp, wp, bias, begin, end, k, n, op);
  });
}
#endif

// x: [m, k] bf16 contiguous, m <= kMaxRows; w: [n, k] bf16 contiguous; bias: [n] bf16 or
// None. Where this build has no AVX512-BF16 it is at::linear.
at::Tensor linear_small(const at::Tensor& x, const at::Tensor& w,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "linear_small: x [m, k] and w [n, k]");
  TORCH_CHECK(x.size(0) <= kMaxRows, "linear_small: at most ", kMaxRows, " rows");
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
      x.is_contiguous() && w.is_contiguous() &&
      (!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous()))) {
    auto out = at::empty({x.size(0), w.size(0)}, x.options());
    const c10::BFloat16* b = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
    switch (x.size(0)) {
      case 0: return out;
      case 1: run_rows<1>(x, w, b, out); return out;
      case 2: run_rows<2>(x, w, b, out); return out;
      case 3: run_rows<3>(x, w, b, out); return out;
      case 4: run_rows<4>(x, w, b, out); return out;
      case 5: run_rows<5>(x, w, b, out); return out;
      case 6: run_rows<6>(x, w, b, out); return out;
      case 7: run_rows<7>(x, w, b, out); return out;
      default: run_rows<8>(x, w, b, out); return out;
    }
  }
#endif
  return at::linear(x, w, bias);
}

// The most rows `linear_small` serves with its own loop (0 where it falls back to ATen).
int64_t linear_small_max() {
#if defined(__AVX512BF16__)
  return kMaxRows;
#else
  return 0;
#endif
}

}  // namespace

RINGSERVE_FRAGMENT(RINGSERVE_NS, m) {
  m.def("linear_small(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("linear_small_max() -> int", &linear_small_max);
}

RINGSERVE_IMPL(RINGSERVE_NS, m) { m.impl("linear_small", &linear_small); }
