// AVX-512 (F/BW/VL/DQ, BF16, VNNI) in software, for testing the kernels' AVX-512 code on a
// CPU that has only AVX2 (kernels/cpu_build.py's emulated builds; docs/cpu.md).
//
// Read by every source of an emulated build right after the torch headers (cpu_build's
// precompiled torch_headers.h includes it), compiled for x86-64-v3. The real <immintrin.h>
// is read first, without the AVX-512 macros (so GCC's AVX-512 headers keep their target
// pragmas), then SIMDe's portable AVX-512 with its native aliases, which makes
// `_mm512_add_ps` and `__m512` name SIMDe's functions and types; then the intrinsics SIMDe
// 0.7.4 (Debian's libsimde-dev) lacks, gets wrong, or rounds otherwise than the hardware
// are defined below, each after the instruction's description in Intel's manual (the
// element order, the rounding, the masked lanes); then emulate_avx512_macros.h (a second
// -include) defines the AVX-512 macros, so the sources take their `#if __AVX512F__`
// branches. Not emulated: the speed, and the inline assembly (greedy_head.cpp has an
// intrinsic in its place here).
//
// Never served: the emulated library is only built for a variant above the CPU's class,
// which only the tests ask for.

#pragma once

#include <immintrin.h>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace ringserve_emu {

template <typename T, typename V>
inline void to_lanes(T* out, const V& v) {
  static_assert(sizeof(V) % sizeof(T) == 0);
  std::memcpy(out, &v, sizeof(V));
}
template <typename V, typename T>
inline V from_lanes(const T* in) {
  V v;
  std::memcpy(&v, in, sizeof(V));
  return v;
}

inline float bits_to_f(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}
inline uint32_t f_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

// VCVTNE(2)PS2BF16: round to nearest even, input denormals read as zero, NaN kept quiet.
inline uint16_t to_bf16(float f) {
  const uint32_t b = f_to_bits(f);
  if ((b & 0x7F800000u) == 0x7F800000u && (b & 0x007FFFFFu) != 0)
    return static_cast<uint16_t>((b >> 16) | 0x40u);
  if ((b & 0x7F800000u) == 0) return static_cast<uint16_t>((b >> 16) & 0x8000u);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// Denormals read and written as zero, as VDPBF16PS does.
inline float daz(float f) {
  const uint32_t b = f_to_bits(f);
  return (b & 0x7F800000u) == 0 ? bits_to_f(b & 0x80000000u) : f;
}

inline simde__m512 dpbf16_ps(simde__m512 src, simde__m512bh a, simde__m512bh b) {
  float acc[16];
  uint16_t x[32], y[32];
  to_lanes(acc, src);
  to_lanes(x, a);
  to_lanes(y, b);
  for (int i = 0; i < 16; ++i) {
    // The odd pair first, then the even one, each a float32 FMA (one rounding).
    float d = daz(acc[i]);
    for (const int j : {2 * i + 1, 2 * i})
      d = daz(std::fma(daz(bits_to_f(uint32_t{x[j]} << 16)), daz(bits_to_f(uint32_t{y[j]} << 16)),
                       d));
    acc[i] = d;
  }
  return from_lanes<simde__m512>(acc);
}

// dst's low half from b, its high half from a.
inline simde__m512bh cvtne2ps_pbh(simde__m512 a, simde__m512 b) {
  float fa[16], fb[16];
  uint16_t out[32];
  to_lanes(fa, a);
  to_lanes(fb, b);
  for (int i = 0; i < 16; ++i) {
    out[i] = to_bf16(fb[i]);
    out[16 + i] = to_bf16(fa[i]);
  }
  return from_lanes<simde__m512bh>(out);
}

inline simde__m256bh cvtneps_pbh(simde__m512 a) {
  float fa[16];
  uint16_t out[16];
  to_lanes(fa, a);
  for (int i = 0; i < 16; ++i) out[i] = to_bf16(fa[i]);
  return from_lanes<simde__m256bh>(out);
}

// Widening moves: N lanes of From read from the low bytes of `a`, each converted to To.
template <typename To, typename From, int N, typename Out, typename In>
inline Out widen(In a) {
  From in[sizeof(In) / sizeof(From)];
  To out[N];
  to_lanes(in, a);
  for (int i = 0; i < N; ++i) out[i] = static_cast<To>(in[i]);
  return from_lanes<Out>(out);
}

inline simde__m512 cvtepi32_ps(simde__m512i a) {
  int32_t in[16];
  float out[16];
  to_lanes(in, a);
  for (int i = 0; i < 16; ++i) out[i] = static_cast<float>(in[i]);  // rounds to nearest
  return from_lanes<simde__m512>(out);
}

// VPMOVDW: truncation to the low 16 bits of each lane.
inline simde__m256i cvtepi32_epi16(simde__m512i a) {
  int32_t in[16];
  int16_t out[16];
  to_lanes(in, a);
  for (int i = 0; i < 16; ++i) out[i] = static_cast<int16_t>(static_cast<uint32_t>(in[i]));
  return from_lanes<simde__m256i>(out);
}

inline simde__m512 cvtph_ps(simde__m256i a) {
  const __m128i lo = simde_mm256_castsi256_si128(a);
  const __m128i hi = simde_mm256_extracti128_si256(a, 1);
  float out[16];
  // F16C is native here: half -> float is exact.
  _mm256_storeu_ps(out, _mm256_cvtph_ps(reinterpret_cast<const ::__m128i&>(lo)));
  _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(reinterpret_cast<const ::__m128i&>(hi)));
  return from_lanes<simde__m512>(out);
}

template <typename Mask, int N, typename T, typename V>
inline V maskz_loadu(Mask k, const void* p) {
  T out[N];
  const T* in = static_cast<const T*>(p);
  for (int i = 0; i < N; ++i) out[i] = ((k >> i) & 1) ? in[i] : T{};  // masked lanes unread
  return from_lanes<V>(out);
}

template <typename Mask, int N, typename T, typename V>
inline void mask_storeu(void* p, Mask k, V a) {
  T in[N];
  to_lanes(in, a);
  T* out = static_cast<T*>(p);
  for (int i = 0; i < N; ++i)
    if ((k >> i) & 1) out[i] = in[i];
}

// The reductions in the order GCC's <avx512fintrin.h> computes them (halves, then quarters,
// then pairs), so sums agree with the native build's.
template <typename Op>
inline float reduce_ps(simde__m512 a, Op op) {
  float v[16];
  to_lanes(v, a);
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = op(v[i + 8], v[i]);
  float q[4];
  for (int i = 0; i < 4; ++i) q[i] = op(t[i + 4], t[i]);
  return op(op(q[0], q[2]), op(q[1], q[3]));
}

inline int32_t mask_reduce_min_epi32(simde__mmask16 k, simde__m512i a) {
  int32_t v[16];
  to_lanes(v, a);
  int32_t m = INT32_MAX;  // masked lanes count as the largest int32
  for (int i = 0; i < 16; ++i)
    if (((k >> i) & 1) && v[i] < m) m = v[i];
  return m;
}

}  // namespace ringserve_emu

#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps ringserve_emu::dpbf16_ps
#undef _mm512_cvtne2ps_pbh
#define _mm512_cvtne2ps_pbh ringserve_emu::cvtne2ps_pbh
#undef _mm512_cvtneps_pbh
#define _mm512_cvtneps_pbh ringserve_emu::cvtneps_pbh
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps ringserve_emu::cvtepi32_ps
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16 ringserve_emu::cvtepi32_epi16
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps ringserve_emu::cvtph_ps
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32 \
  ringserve_emu::widen<int32_t, int8_t, 16, simde__m512i, simde__m128i>
#undef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32 \
  ringserve_emu::widen<int32_t, uint8_t, 16, simde__m512i, simde__m128i>
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32 \
  ringserve_emu::widen<int32_t, uint16_t, 16, simde__m512i, simde__m256i>
#undef _mm512_cvtepu8_epi16
#define _mm512_cvtepu8_epi16 \
  ringserve_emu::widen<int16_t, uint8_t, 32, simde__m512i, simde__m256i>
#undef _mm512_cvtepi8_epi16
#define _mm512_cvtepi8_epi16 \
  ringserve_emu::widen<int16_t, int8_t, 32, simde__m512i, simde__m256i>
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps ringserve_emu::maskz_loadu<simde__mmask16, 16, float, simde__m512>
#undef _mm512_maskz_loadu_epi16
#define _mm512_maskz_loadu_epi16 \
  ringserve_emu::maskz_loadu<simde__mmask32, 32, int16_t, simde__m512i>
#undef _mm256_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16 \
  ringserve_emu::maskz_loadu<simde__mmask16, 16, int16_t, simde__m256i>
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps ringserve_emu::mask_storeu<simde__mmask16, 16, float, simde__m512>
#undef _mm256_mask_storeu_epi16
#define _mm256_mask_storeu_epi16 \
  ringserve_emu::mask_storeu<simde__mmask16, 16, int16_t, simde__m256i>
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps(a) \
  ringserve_emu::reduce_ps((a), [](float x, float y) { return x + y; })
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps(a) \
  ringserve_emu::reduce_ps((a), [](float x, float y) { return x > y ? x : y; })
#undef _mm512_mask_cmp_ps_mask
#define _mm512_mask_cmp_ps_mask(k, a, b, imm) \
  static_cast<simde__mmask16>((k) & simde_mm512_cmp_ps_mask((a), (b), (imm)))
// SIMDe 0.7.4's alias gives this one the masked form's four arguments.
#undef _mm512_madd_epi16
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16((a), (b))
#undef _mm512_mask_reduce_min_epi32
#define _mm512_mask_reduce_min_epi32 ringserve_emu::mask_reduce_min_epi32
