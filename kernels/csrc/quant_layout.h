// The weight-only quantized layout's checks (kernels/quant.py defines the layout), shared
// by the kernels that read it.

#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <type_traits>
#include <utility>

namespace ringserve {

inline void check_layout(const at::Tensor& qweight, const at::Tensor& scales,
                  const std::optional<at::Tensor>& mins, int64_t bits, int64_t group,
                  int64_t k) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant: bits must be 4 or 8");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "quant: qweight [n, k'] contiguous");
  TORCH_CHECK(qweight.scalar_type() == (bits == 8 ? at::kChar : at::kByte),
              "quant: qweight must be int8 (bits 8) or uint8 (bits 4)");
  TORCH_CHECK(k % (bits == 8 ? 32 : 64) == 0 && group % 16 == 0 && k % group == 0 &&
                  (bits == 8 || group % 32 == 0),
              "quant: k a multiple of 32 (64 for 4 bits), group a multiple of 16 (32 for 4 "
              "bits) dividing k");
  TORCH_CHECK(qweight.size(1) == (bits == 8 ? k : k / 2), "quant: qweight width does not match k");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.size(0) == qweight.size(0) && scales.size(1) == k / group,
              "quant: scales must be float16 [n, k / group]");
  TORCH_CHECK(bits == 8 || (mins.has_value() && mins->scalar_type() == at::kHalf &&
                            mins->is_contiguous() && mins->sizes() == scales.sizes()),
              "quant: 4-bit weights need float16 mins shaped like scales");
}

// f(std::integral_constant<int, r>{}) for the compile-time r == rows (1 <= rows <= R): the
// kernels are unrolled per row count.
template <int R, typename F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (R == 1) {
    f(std::integral_constant<int, 1>{});
  } else if (rows >= R) {
    f(std::integral_constant<int, R>{});
  } else {
    with_rows<R - 1>(rows, std::forward<F>(f));
  }
}

}  // namespace ringserve
