// OCP MXFP4 as checkpoints store it: E2M1 codes, two a byte, and one E8M0 exponent per
// block of 32 values. Shared by the float32 kernel (compact_gemm.cpp) and the int16
// dot-product one (int16_act_gemm.cpp).
//
// A code's value is looked up as twice its E2M1 value, an integer in -12..12 (so a byte
// table and a byte shuffle decode 16 codes at once), and the block's scale is halved to
// match (`e8m0_half`): value = kE2M1x2[code] * e8m0_half(e), exactly.

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__SSSE3__)
#include <immintrin.h>
#endif

namespace ringserve {

alignas(16) constexpr int8_t kE2M1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12,
                                            0, -1, -2, -3, -4, -6, -8, -12};

// Half of an E8M0 exponent's 2^(e - 127), exactly (a float32 for every e; 255 is NaN).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e == 255 ? 0x7FC00000u : e >= 2 ? static_cast<uint32_t>(e - 1) << 23
                                                        : 0x00200000u << e;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Value `at` (0..31) of the block whose 16 bytes are at p, as its code: with `split`
// (GGUF's order) value i is byte i's low nibble and 16 + i its high one; else
// (transformers' order) values 2i and 2i + 1 are byte i's low and high nibble.
inline int fp4_code(const uint8_t* p, bool split, int at) {
  return (split ? p[at & 15] >> (4 * (at >> 4)) : p[at / 2] >> (4 * (at & 1))) & 0xF;
}

#if defined(__SSSE3__)
// The 32 values of the block at p as int8 (twice their E2M1 value), in order: values 0-15
// in v0, 16-31 in v1.
inline void fp4_block_int8(const uint8_t* p, bool split, __m128i& v0, __m128i& v1) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1x2));
  v0 = _mm_shuffle_epi8(table, split ? lo : _mm_unpacklo_epi8(lo, hi));
  v1 = _mm_shuffle_epi8(table, split ? hi : _mm_unpackhi_epi8(lo, hi));
}
#endif

#if defined(__AVX2__)
// Two blocks' 64 values from their 32 bytes at p as int16, in order (block b's values 0-15
// and 16-31, then block b + 1's): both decoded by one 256-bit shuffle, each lane a block.
inline void fp4_pair_int16(const uint8_t* p, bool split, __m256i (&v)[4]) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(bytes, mask);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
  const __m256i table = _mm256_broadcastsi128_si256(
      _mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1x2)));
  const __m256i first = _mm256_shuffle_epi8(table, split ? lo : _mm256_unpacklo_epi8(lo, hi));
  const __m256i second = _mm256_shuffle_epi8(table, split ? hi : _mm256_unpackhi_epi8(lo, hi));
  v[0] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(first));
  v[1] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(second));
  v[2] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(first, 1));
  v[3] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(second, 1));
}
#endif

}  // namespace ringserve
