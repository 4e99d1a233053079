// RMSNorm and (norm +) rotary embedding as one pass each, for the CPU bf16 path.
//
// Eagerly, an RMSNorm is ~10 small ATen ops (widen, square, mean, add, rsqrt, two
// multiplies, narrow) and a rotary embedding ~9; at decode batch sizes each op costs more
// in dispatch than in arithmetic, and a gemma-3 layer runs six norms and two rotaries.
// Here each is one loop over the rows, in float32, rounded once at the end. For the
// decode path without modules (engine/models/fast_decode.py) two more save Python-side ops
// between the big multiplies: add_rms_norm (residual + norm) and qkv_rope (split, q and k
// through norm_rope, v copied), each with the roundings of the ops it replaces.

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"
#include "thread_pool.h"

#include "bf16.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using ringserve::from_f;
using ringserve::to_f;

// With `res` (the residual stream, [rows, d] contiguous): res + norm(x), each rounded to T
// as the two ops `res + rms_norm(x)` round (the norm's value first, then the sum).
template <typename T>
void rms_rows(const T* x, int64_t rows, int64_t d, int64_t stride, const float* scale,
              float eps, const T* res, T* out) {
  ringserve::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * stride;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < d; ++i) ss += to_f(xr[i]) * to_f(xr[i]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
      T* o = out + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) o[i] = from_f<T>(to_f(xr[i]) * inv * scale[i]);
      // NOTE: a second pass over the stored norm, so that for float32 the compiler cannot
      // contract the scale multiply and the add into one FMA (one rounding, not the two
      // ops' two).
      if (res != nullptr) {
        const T* rr = res + r * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) o[i] = from_f<T>(to_f(rr[i]) + to_f(o[i]));
      }
    }
  });
}

// x: [rows, d] with unit stride in d; scale: float32 [d] (the norm's effective weight);
// res (add_rms_norm): [rows, d] contiguous, x's dtype.
at::Tensor norm_rows(const char* op, const at::Tensor& x, const at::Tensor& scale, double eps,
                     const at::Tensor* res) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [rows, d], unit stride");
  TORCH_CHECK(res == nullptr || (res->sizes() == x.sizes() &&
                                 res->scalar_type() == x.scalar_type() && res->is_contiguous()),
              op, ": res must be contiguous, with x's shape and dtype");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.numel() == x.size(1),
              op, ": scale must be float32 [d]");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.size(1), x.stride(0),
                       scale.data_ptr<float>(), static_cast<float>(eps),
                       res == nullptr ? nullptr : res->data_ptr<scalar_t>(),
                       out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& scale, double eps) {
  return norm_rows("rms_norm", x, scale, eps, nullptr);
}

// res + rms_norm(x, scale, eps) in one pass, with the two ops' roundings: a sandwich
// layer's residual add after its post-attention and post-feedforward norms.
at::Tensor add_rms_norm(const at::Tensor& res, const at::Tensor& x, const at::Tensor& scale,
                        double eps) {
  return norm_rows("add_rms_norm", x, scale, eps, &res);
}

template <typename T>
void norm_rope_rows(const T* xp, int64_t st, int64_t sh, int64_t tokens, int64_t heads,
                    int64_t d, int64_t rot, const float* sc, const T* cp, const T* sp,
                    float eps, T* op) {
  const int64_t half = rot / 2;
  ringserve::parallel_for(0, tokens * heads, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(static_cast<size_t>(d));
    float* hp = h.data();
    for (int64_t w = begin; w < end; ++w) {
      const int64_t t = w / heads, hd = w % heads;
      const T* xr = xp + t * st + hd * sh;
      float inv = 1.f;
      if (sc != nullptr) {
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < d; ++i) ss += to_f(xr[i]) * to_f(xr[i]);
        inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) hp[i] = to_f(xr[i]) * inv * sc[i];
      } else {
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) hp[i] = to_f(xr[i]);
      }
      const T* c = cp + t * rot;
      const T* s = sp + t * rot;
      T* o = op + w * d;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i)
        o[i] = from_f<T>(hp[i] * to_f(c[i]) - hp[i + half] * to_f(s[i]));
#pragma omp simd
      for (int64_t i = 0; i < half; ++i)
        o[i + half] = from_f<T>(hp[i + half] * to_f(c[i + half]) + hp[i] * to_f(s[i + half]));
      for (int64_t i = rot; i < d; ++i) o[i] = from_f<T>(hp[i]);
    }
  });
}

// x: [tokens, heads, d] (d unit stride, any token/head strides); cos, sin: [tokens, rot]
// contiguous, rot <= d, even. Optional RMSNorm of each head row first (scale float32 [d]),
// then the half-split rotary embedding of the first rot features. Returns a contiguous copy.
at::Tensor norm_rope(const at::Tensor& x, const std::optional<at::Tensor>& scale,
                     const at::Tensor& cos, const at::Tensor& sin, double eps) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "norm_rope: x must be [tokens, heads, d]");
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2);
  const int64_t rot = cos.size(-1);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * rot &&
                  sin.numel() == tokens * rot && rot <= d && rot % 2 == 0,
              "norm_rope: cos and sin must be contiguous [tokens, rot], rot <= d, even");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "norm_rope: cos and sin must have x's dtype");
  const float* sc = nullptr;
  if (scale.has_value()) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous() &&
                    scale->numel() == d,
                "norm_rope: scale must be float32 [d]");
    sc = scale->data_ptr<float>();
  }
  auto out = at::empty({tokens, heads, d}, x.options());
  const float feps = static_cast<float>(eps);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "norm_rope", [&] {
    norm_rope_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.stride(1), tokens, heads,
                             d, rot, sc, cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                             feps, out.data_ptr<scalar_t>());
  });
  return out;
}

// A fused q/k/v projection's output [tokens, (heads + 2 kv_heads) d] as attention takes it:
// q and k through norm_rope (each with its optional norm), v a contiguous copy. The same
// calls as splitting in Python, without a dozen Python-side ops a layer.
std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_rope(
    const at::Tensor& qkv, const std::optional<at::Tensor>& q_scale,
    const std::optional<at::Tensor>& k_scale, const at::Tensor& cos, const at::Tensor& sin,
    double q_eps, double k_eps, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && heads > 0 && kv_heads > 0 &&
                  qkv.size(1) % (heads + 2 * kv_heads) == 0,
              "qkv_rope: qkv must be [tokens, (heads + 2 kv_heads) d], unit stride");
  const int64_t n = qkv.size(0), d = qkv.size(1) / (heads + 2 * kv_heads);
  const at::Tensor q = qkv.narrow(1, 0, heads * d).view({n, heads, d});
  const at::Tensor k = qkv.narrow(1, heads * d, kv_heads * d).view({n, kv_heads, d});
  const at::Tensor v = qkv.narrow(1, (heads + kv_heads) * d, kv_heads * d).view({n, kv_heads, d});
  return {norm_rope(q, q_scale, cos, sin, q_eps), norm_rope(k, k_scale, cos, sin, k_eps),
          v.contiguous()};
}

}  // namespace

RINGSERVE_FRAGMENT(RINGSERVE_NS, m) {
  m.def("rms_norm(Tensor x, Tensor scale, float eps) -> Tensor");
  m.def("norm_rope(Tensor x, Tensor? scale, Tensor cos, Tensor sin, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor res, Tensor x, Tensor scale, float eps) -> Tensor");
  m.def("qkv_rope(Tensor qkv, Tensor? q_scale, Tensor? k_scale, Tensor cos, Tensor sin, "
        "float q_eps, float k_eps, int heads, int kv_heads) -> (Tensor, Tensor, Tensor)");
}

RINGSERVE_IMPL(RINGSERVE_NS, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("norm_rope", &norm_rope);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("qkv_rope", &qkv_rope);
}
