// x rows rounded to int16 in blocks of 32 values, one float32 scale a block: the
// activations of the int16 dot-product kernels (int16_act_gemm.cpp, int8_tiles.cpp), which
// kernels/quant.py's `quantize_activations` states in torch.

#pragma once

#include "bf16.h"
#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace ringserve {

constexpr int64_t kActBlock = 32;  // x values per int16 scale

struct Acts {
  std::vector<int16_t> q;   // [m, k]
  std::vector<float> d;     // [m, k / 32]
  std::vector<float> gsum;  // [m, gpad]: float32 sums of x over each weight group (4-bit)
  int64_t k = 0, blocks = 0, gpad = 0;
};

// Rows of x (float32, or bf16: widened exactly as read) quantized (and, for 4-bit weights,
// summed per weight group of `group`).
template <typename T>
inline Acts quantize_acts(const T* x, int64_t m, int64_t k, int64_t group, bool sums) {
  Acts a;
  a.k = k;
  a.blocks = k / kActBlock;
  a.gpad = sums ? (k / group + 7) / 8 * 8 : 0;
  a.q.resize(static_cast<size_t>(m * k));
  a.d.resize(static_cast<size_t>(m * a.blocks));
  a.gsum.assign(static_cast<size_t>(m * a.gpad), 0.f);
  parallel_for(0, m, 16, [&](int64_t m0, int64_t m1) {
    float v[kActBlock];
    for (int64_t r = m0; r < m1; ++r) {
      const T* xr = x + r * k;
      for (int64_t b = 0; b < a.blocks; ++b) {
        for (int64_t t = 0; t < kActBlock; ++t) v[t] = to_f(xr[b * kActBlock + t]);
        float amax = 0.f;
        for (int64_t t = 0; t < kActBlock; ++t) amax = std::max(amax, std::fabs(v[t]));
        const float d = amax / 32767.f;
        const float id = d != 0.f ? 1.f / d : 0.f;
        a.d[r * a.blocks + b] = d;
        int16_t* q = a.q.data() + r * k + b * kActBlock;
        // NOTE: nearbyint rounds half to even under the default rounding mode, as
        // torch.round does in the reference.
        for (int64_t t = 0; t < kActBlock; ++t)
          q[t] = static_cast<int16_t>(std::clamp(std::nearbyint(v[t] * id), -32767.f, 32767.f));
      }
      if (sums)
        for (int64_t g = 0; g < k / group; ++g) {
          float s = 0.f;
          for (int64_t t = 0; t < group; ++t) s += to_f(xr[g * group + t]);
          a.gsum[r * a.gpad + g] = s;
        }
    }
  });
  return a;
}

}  // namespace ringserve
