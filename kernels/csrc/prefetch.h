// Asking for the next block of a weight stream into L2 while the block in hand is
// multiplied, a few lines at each step of that multiply (quant_gemm.cpp's AMX tiles,
// int8_tiles.cpp's one-byte tiles, greedy_head.cpp's AMX pass; docs/cpu.md, "The next
// tile a few lines at a time"). The whole next block asked for at once stalled the core
// until the requests drained; spread over the steps, the read overlaps the multiplies.

#pragma once

#include <cstdint>

#if defined(__SSE__)
#include <xmmintrin.h>

namespace ringserve {

struct Ahead {
  const char* at = nullptr;   // the next line to ask for
  const char* end = nullptr;  // past the block's last
  int64_t per_step = 0;       // lines a step

  Ahead() = default;
  // `bytes` from `next`, spread over `steps` calls of fetch()
  Ahead(const void* next, int64_t bytes, int64_t steps)
      : at(static_cast<const char*>(next)), end(at + bytes),
        per_step((bytes / 64 + steps - 1) / steps) {}

  void fetch() {
    for (int64_t i = 0; i < per_step && at < end; ++i, at += 64) _mm_prefetch(at, _MM_HINT_T1);
  }
};

}  // namespace ringserve

#endif  // __SSE__
