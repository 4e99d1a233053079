// Greedy decoding's pick: the index of each row's first maximum, over a vocabulary-wide
// row of logits (262,144 for gemma-3), in one compiled pass.
//
// torch's max(dim=-1) took 4.9-6.8 ms for 32 such bf16 rows on a 2-core AVX512-BF16 VM
// (benchmarks/step_profile.py --batch 32): ~3 GB/s of a 42 GB/s memory. Here the rows are
// cut into chunks spread over the kernels' threads; each chunk keeps, per SIMD lane, the
// largest value and the index where it first appeared (a strictly greater value replaces
// it), so the smallest index among the lanes holding the chunk's maximum is its first
// maximum, and the earliest chunk holding the row's maximum wins. A row holding a NaN is
// answered by torch's own max (which propagates NaN: the first NaN's index), here, so the
// caller needs no check of its own after the call: a decode step runs its small ops with
// caches the weights have just swept, ~50 us each (docs/cpu.md).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "ops.h"
#include "thread_pool.h"

#include "bf16.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kChunk = 16384;  // elements a work item scans

struct Best {
  float value = -std::numeric_limits<float>::infinity();
  int64_t index = -1;  // -1: nothing seen yet
  bool nan = false;
};

template <typename T>
inline void scan_scalar(const T* x, int64_t begin, int64_t end, Best& best) {
  for (int64_t i = begin; i < end; ++i) {
    const float v = ringserve::to_f(x[i]);
    if (std::isnan(v)) best.nan = true;
    else if (v > best.value || best.index < 0) best = {v, i, best.nan};
  }
}

template <typename T>
Best scan(const T* x, int64_t begin, int64_t end) {
  Best best;
  int64_t i = begin;
#if defined(__AVX512F__)
  if (end - begin >= 16) {
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512i vidx = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(begin)),
                                    _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                      12, 13, 14, 15));
    __m512i cur = vidx;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = 0;
    for (; i + 16 <= end; i += 16) {
      const __m512 v = ringserve::load16(x + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
      vmax = _mm512_mask_mov_ps(vmax, gt, v);
      vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
      cur = _mm512_add_epi32(cur, step);
    }
    const float top = _mm512_reduce_max_ps(vmax);
    const __mmask16 at = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(top), _CMP_EQ_OQ);
    // NOTE: indices fit int32: callers check the row length
    const int32_t first = _mm512_mask_reduce_min_epi32(at, vidx);
    best = {top, static_cast<int64_t>(first), nan != 0};
  }
#endif
  scan_scalar(x, i, end, best);
  return best;
}

// out[r] = -1 for a row holding a NaN.
template <typename T>
void first_max_rows(const T* x, int64_t rows, int64_t cols, int64_t stride, int64_t* out) {
  const int64_t chunks = (cols + kChunk - 1) / kChunk;
  std::vector<Best> part(static_cast<size_t>(rows * chunks));
  ringserve::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t r = w / chunks, c = w % chunks;
      part[w] = scan(x + r * stride, c * kChunk, std::min(cols, (c + 1) * kChunk));
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    Best best;
    for (int64_t c = 0; c < chunks; ++c) {
      const Best& p = part[r * chunks + c];
      best.nan = best.nan || p.nan;
      if (p.index >= 0 && (p.value > best.value || best.index < 0)) {
        best.value = p.value;
        best.index = p.index;
      }
    }
    out[r] = best.nan ? -1 : best.index;
  }
}

// logits: [rows, vocab] with unit stride in vocab, float32 or bfloat16.
at::Tensor first_max(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "first_max: logits must be [rows, vocab] with unit stride, vocab > 0");
  TORCH_CHECK(logits.size(1) < std::numeric_limits<int32_t>::max() - 16,
              "first_max: rows longer than int32 indices");
  auto out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  const auto t = logits.scalar_type();
  if (t == at::kFloat) {
    first_max_rows(logits.data_ptr<float>(), logits.size(0), logits.size(1),
                   logits.stride(0), out.data_ptr<int64_t>());
  } else if (t == at::kBFloat16) {
    first_max_rows(logits.data_ptr<c10::BFloat16>(), logits.size(0), logits.size(1),
                   logits.stride(0), out.data_ptr<int64_t>());
  } else {
    TORCH_CHECK(false, "first_max: float32 or bfloat16 logits");
  }
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < logits.size(0); ++r)
    if (o[r] < 0) o[r] = std::get<1>(logits[r].max(0)).item<int64_t>();
  return out;
}

}  // namespace

RINGSERVE_FRAGMENT(RINGSERVE_NS, m) { m.def("first_max(Tensor logits) -> Tensor"); }

RINGSERVE_IMPL(RINGSERVE_NS, m) { m.impl("first_max", &first_max); }
