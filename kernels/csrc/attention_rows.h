// The per-query-row pieces of paged attention on the CPU, shared by the decode kernel
// (paged_decode.cpp: one query row per sequence) and the prefill kernel (paged_prefill.cpp:
// every new token of a chunk). A query row's G heads (one kv head's group) are scored
// against a list of K rows given as pointers (the caller finds them in the ring, block by
// block), softmaxed with an optional soft cap and sink, and weighted over the V rows.

#pragma once

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "bf16.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#ifndef RINGSERVE_NS
#define RINGSERVE_NS ringserve
#endif

namespace ringserve {
namespace RINGSERVE_NS {  // this variant's library's own copy (built with its flags)

using ringserve::to_f;

// The most parts one row's window is split into (`attend_part`, paged_decode.cpp).
constexpr int64_t kMaxParts = 16;

// Scores of `g` query heads (rows of q, each d floats) against one key row: out[j] = q_j . k.
template <typename T>
inline void dots(const float* q, const T* k, int64_t g, int64_t d, float* out, int64_t stride) {
  for (int64_t j = 0; j < g; ++j) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < d; ++i) acc += q[j * d + i] * to_f(k[i]);
    out[j * stride] = acc;
  }
}

// acc_j += p_j * v for the `g` heads (acc rows of d floats; p strided by `stride`).
template <typename T>
inline void axpys(float* acc, const float* p, int64_t stride, const T* v, int64_t g,
                  int64_t d) {
  for (int64_t j = 0; j < g; ++j) {
    const float pj = p[j * stride];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) acc[j * d + i] += pj * to_f(v[i]);
  }
}

#if defined(__AVX512F__)
// NOTE: explicit AVX-512 for bf16 rows: the compiler does not vectorise the widening
// above well (measured 4-5 GB/s of KV read); here each 16-wide chunk of a K or V row is
// widened once and used by all g heads.
using ringserve::load16;

template <typename T>
inline bool dots_avx512(const float* q, const T* k, int64_t g, int64_t d, float* out,
                        int64_t stride) {
  constexpr int64_t kMaxGroup = 8;
  if (d % 16 != 0 || g > kMaxGroup) return false;
  __m512 acc[kMaxGroup];
  for (int64_t j = 0; j < g; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) {
    const __m512 kv = load16(k + i);
    for (int64_t j = 0; j < g; ++j)
      acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * d + i), kv, acc[j]);
  }
  for (int64_t j = 0; j < g; ++j) out[j * stride] = _mm512_reduce_add_ps(acc[j]);
  return true;
}

template <typename T>
inline bool axpys_avx512(float* acc, const float* p, int64_t stride, const T* v, int64_t g,
                         int64_t d) {
  if (d % 16 != 0) return false;
  for (int64_t i = 0; i < d; i += 16) {
    const __m512 vv = load16(v + i);
    for (int64_t j = 0; j < g; ++j) {
      float* a = acc + j * d + i;
      _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(p[j * stride]), vv,
                                          _mm512_loadu_ps(a)));
    }
  }
  return true;
}
#endif

template <typename T>
inline void score_row(const float* q, const T* k, int64_t g, int64_t d, float* out,
                      int64_t stride) {
#if defined(__AVX512F__)
  if (dots_avx512(q, k, g, d, out, stride)) return;
#endif
  dots(q, k, g, d, out, stride);
}

template <typename T>
inline void value_row(float* acc, const float* p, int64_t stride, const T* v, int64_t g,
                      int64_t d) {
#if defined(__AVX512F__)
  if (axpys_avx512(acc, p, stride, v, g, d)) return;
#endif
  axpys(acc, p, stride, v, g, d);
}

// Asks for the lines of one cache row ahead of its use (the window is read from memory:
// a layer's cache of many sequences is far larger than the caches): hint 0 into L1, else
// into L2 (GCC's locality 3 / 2: prefetcht0 / prefetcht1 on x86; portable builds too).
template <typename C>
inline void prefetch_row(const C* row, int64_t d, int hint) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(C)); b += 64) {
    if (hint == 0) __builtin_prefetch(p + b, 0, 3);
    else __builtin_prefetch(p + b, 0, 2);
  }
}

// The K and V rows of the work item after this one (paged_decode.cpp: the next (sequence,
// kv head) of the thread's chunk), asked for into L2 a few at a time while this item is
// multiplied: without it an item's rows came from memory while its multiplies waited, and
// its multiplies ran while memory idled. Spread out, not asked for at once (that was slower:
// 0.92x). 32 decode rows of gemma-3-270m, contexts ~220, 18 layers from memory, old and new
// library alternating in one process: 8.98 -> 8.11 ms (AVX-512 build), 9.64 -> 7.85 (AVX2).
// `upto(i)` asks for rows [asked, i).
template <typename C>
struct Ahead {
  const C* const* k = nullptr;
  const C* const* v = nullptr;
  int64_t len = 0, d = 0, asked = 0;
  void upto(int64_t i) {
    for (i = std::min(i, len); asked < i; ++asked) {
      prefetch_row(k[asked], d, 1);
      prefetch_row(v[asked], d, 1);
    }
  }
};

#if defined(__AVX2__)
// The tiled path for groups of 1, 2, 4 or 8 query heads and d a multiple of W: G * P
// score sums (G heads x P positions) stay in registers while each W-wide chunk of P key
// rows is widened once, and the weighted sum of V keeps G x DC output chunks in registers
// across the whole window (DC chunks of W at a time), so nothing is stored per position.
// Rows come through a table of pointers built block by block (no division per position).
// NOTE: sized to the registers: AVX-512 has 32, AVX2 16 (acc + rows + one q/p each).
template <int G>
struct Tile {
#if defined(__AVX512F__)
  static constexpr int P = G >= 8 ? 2 : (G == 4 ? 4 : 8);  // positions a score tile
  static constexpr int DC = 16 / G;                         // value chunks a pass
#else
  static constexpr int P = G >= 8 ? 1 : (G == 4 ? 2 : 4);
  static constexpr int DC = G >= 8 ? 1 : (G == 4 ? 2 : (G == 2 ? 4 : 6));
#endif
};

// `next`: the next item's rows, an eighth of them asked for over this item's scores and the
// rest over its values (`values_tiled`: L2-bound, memory idle); `asked`: this item's own
// rows were asked for by the item before (its V still in L2 for the values pass).
template <int G, typename C>
void scores_tiled(const float* q, const C* const* rows, const C* const* vrows, int64_t len,
                  int64_t d, float* sc, Ahead<C>* next, bool asked) {
  using V = Vec::V;
  constexpr int P = Tile<G>::P;
  // NOTE: K rows 8 positions ahead into L1 (1.7-2.9x faster than without, from memory; 4
  // and 16 measured the same), and K and V rows 64 ahead into L2 (V for the second pass).
  // With both fetched only 8 ahead, one layer's windows of 32 sequences x 130 positions,
  // read from memory, ran at 10-11 GB/s; 64 ahead into L2, 1.12-1.19x faster (also 8 x
  // 400, AVX-512 and AVX2 builds alike; old and new library in one process, 2026-12-04).
  constexpr int64_t kAhead = 8;  // positions
  constexpr int64_t kFar = 64;
  for (int64_t i = 0; i < std::min(len, asked ? kAhead : kFar); ++i) {
    prefetch_row(rows[i], d, i < kAhead ? 0 : 1);
    if (!asked) prefetch_row(vrows[i], d, 1);
  }
  for (int64_t c = 0; c < len; c += P) {
    const int np = static_cast<int>(std::min<int64_t>(P, len - c));
    for (int64_t i = c + kAhead; i < std::min(len, c + kAhead + P); ++i)
      prefetch_row(rows[i], d, 0);
    if (!asked)
      for (int64_t i = c + kFar; i < std::min(len, c + kFar + P); ++i) {
        prefetch_row(rows[i], d, 1);
        prefetch_row(vrows[i], d, 1);
      }
    if (next != nullptr) next->upto(next->len * (c + P) / (8 * len));
    V acc[G][P];
    for (int j = 0; j < G; ++j)
      for (int p = 0; p < P; ++p) acc[j][p] = Vec::zero();
    for (int64_t i = 0; i < d; i += Vec::W) {
      V kv[P];
      for (int p = 0; p < P; ++p) kv[p] = p < np ? Vec::load(rows[c + p] + i) : Vec::zero();
      for (int j = 0; j < G; ++j) {
        const V qq = Vec::loadf(q + j * d + i);
        for (int p = 0; p < P; ++p) acc[j][p] = Vec::fmadd(qq, kv[p], acc[j][p]);
      }
    }
    for (int j = 0; j < G; ++j)
      for (int p = 0; p < np; ++p) sc[j * len + c + p] = Vec::sum(acc[j][p]);
  }
}

template <int G, typename C>
void values_tiled(const float* sc, const C* const* rows, int64_t len, int64_t d, float* out,
                  Ahead<C>* next) {
  using V = Vec::V;
  constexpr int DC = Tile<G>::DC;
  const int64_t passes = (d + Vec::W * DC - 1) / (Vec::W * DC);
  for (int64_t i0 = 0; i0 < d; i0 += Vec::W * DC) {
    const int64_t pass = i0 / (Vec::W * DC);
    const int nc = static_cast<int>(std::min<int64_t>(DC, (d - i0) / Vec::W));
    V acc[G][DC];
    for (int j = 0; j < G; ++j)
      for (int k = 0; k < DC; ++k) acc[j][k] = Vec::zero();
    for (int64_t c = 0; c < len; ++c) {
      if (next != nullptr && c % 8 == 0)  // the next item's rows after the first eighth
        next->upto(next->len / 8 + 7 * next->len * (pass * len + c + 8) / (8 * passes * len));
      const C* v = rows[c] + i0;
      V vv[DC];
      for (int k = 0; k < DC; ++k) vv[k] = k < nc ? Vec::load(v + Vec::W * k) : Vec::zero();
      for (int j = 0; j < G; ++j) {
        const V pj = Vec::set1(sc[j * len + c]);
        for (int k = 0; k < DC; ++k) acc[j][k] = Vec::fmadd(pj, vv[k], acc[j][k]);
      }
    }
    for (int j = 0; j < G; ++j)
      for (int k = 0; k < nc; ++k) Vec::store(out + j * d + i0 + Vec::W * k, acc[j][k]);
  }
}

template <typename C>
bool scores_fast(int64_t g, const float* q, const C* const* rows, const C* const* vrows,
                 int64_t len, int64_t d, float* sc, Ahead<C>* next, bool asked) {
  if (d % Vec::W != 0) return false;
  switch (g) {
    case 1: scores_tiled<1>(q, rows, vrows, len, d, sc, next, asked); return true;
    case 2: scores_tiled<2>(q, rows, vrows, len, d, sc, next, asked); return true;
    case 4: scores_tiled<4>(q, rows, vrows, len, d, sc, next, asked); return true;
    case 8: scores_tiled<8>(q, rows, vrows, len, d, sc, next, asked); return true;
    default: return false;
  }
}

template <typename C>
bool values_fast(int64_t g, const float* sc, const C* const* rows, int64_t len, int64_t d,
                 float* out, Ahead<C>* next) {
  if (d % Vec::W != 0) return false;
  switch (g) {
    case 1: values_tiled<1>(sc, rows, len, d, out, next); return true;
    case 2: values_tiled<2>(sc, rows, len, d, out, next); return true;
    case 4: values_tiled<4>(sc, rows, len, d, out, next); return true;
    case 8: values_tiled<8>(sc, rows, len, d, out, next); return true;
    default: return false;
  }
}
#endif

// In place: the soft cap (if any) on one row of scores; returns their largest, or `floor`
// where that is larger.
inline float capped_max(float* sc, int64_t len, float softcap, float floor) {
  float top = floor;
  for (int64_t c = 0; c < len; ++c) {
    if (softcap > 0.f) sc[c] = softcap * std::tanh(sc[c] / softcap);
    top = std::max(top, sc[c]);
  }
  return top;
}

// In place: sc[c] = exp(sc[c] - top) (top at least every sc[c]); returns `sum` plus them.
inline float exp_shifted(float* sc, int64_t len, float top, float sum) {
  int64_t c = 0;
#if defined(__AVX2__)
  Vec::V vsum = Vec::zero();
  const Vec::V vtop = Vec::set1(top);
  for (; c + Vec::W <= len; c += Vec::W) {
    const Vec::V e = exp_nonpositive(Vec::sub(Vec::loadf(sc + c), vtop));
    Vec::store(sc + c, e);
    vsum = Vec::add(vsum, e);
  }
  sum += Vec::sum(vsum);
#endif
  for (; c < len; ++c) {
    sc[c] = std::exp(sc[c] - top);
    sum += sc[c];
  }
  return sum;
}

// In place: softmax of one row of scores (after the optional soft-cap), with an attention
// sink: the logit `sink` (-inf: none) joins the denominator and takes no value row.
inline void softmax(float* sc, int64_t len, float softcap, float sink) {
  const float top = capped_max(sc, len, softcap, sink);
  const float sum = exp_shifted(sc, len, top, std::isfinite(sink) ? std::exp(sink - top) : 0.f);
  const float inv = 1.f / sum;
  for (int64_t i = 0; i < len; ++i) sc[i] *= inv;
}

// What both kernels read from their arguments.
struct Args {
  // block_stride: elements from one block of a cache to the next (a view of one layer of
  // a slab row per block holding several layers: engine/kv_cache.py)
  int64_t kv_heads, group, d, block_size, block_stride, window, ring, table_width;
  float scale, softcap;
  const float* sinks;  // [num_heads] or null
};

// The cache rows of kv head h for positions [lo, hi) of the sequence whose block table is
// `table`, into krows / vrows [0, hi - lo): position p lives at slot p % b of block
// table[(p / b) % R] (a ring of R blocks; table[p / b] without one: docs/design.md §2),
// found block by block (one table look-up a block, no division per position).
template <typename C>
inline void ring_rows(const Args& a, const int32_t* table, int64_t h, int64_t lo, int64_t hi,
                      const C* key_cache, const C* value_cache, const C** krows,
                      const C** vrows) {
  const int64_t slot = a.kv_heads * a.d;  // elements per cache slot
  for (int64_t p = lo; p < hi;) {
    const int64_t logical = p / a.block_size;
    const int64_t column = a.ring > 0 ? logical % a.ring : logical;
    const int64_t base = static_cast<int64_t>(table[column]) * a.block_stride + h * a.d;
    const int64_t end = std::min(hi, (logical + 1) * a.block_size);
    for (int64_t r = p - logical * a.block_size; p < end; ++p, ++r) {
      krows[p - lo] = key_cache + base + r * slot;
      vrows[p - lo] = value_cache + base + r * slot;
    }
  }
}

// Per thread: what one work item of the attention kernels needs besides its arguments.
template <typename C>
struct Scratch {
  std::vector<float> scores, qbuf, acc;
  std::vector<C> fresh;
  std::vector<const C*> krows, vrows;
};

// The scores of one query token's group of g heads (rows q[j * d ..], scaled by a.scale)
// against n K rows kr: scores[j * n + c]. vr: the V rows, asked for while K is read.
template <typename T, typename C>
inline void score_group(const Args& a, const T* q, const C* const* kr, const C* const* vr,
                        int64_t n, std::vector<float>& scores, std::vector<float>& qbuf,
                        Ahead<C>* next = nullptr, bool asked = false) {
  const int64_t d = a.d, g = a.group;
  scores.resize(static_cast<size_t>(g * n));
  qbuf.resize(static_cast<size_t>(g * d));
  for (int64_t i = 0; i < g * d; ++i) qbuf[i] = to_f(q[i]) * a.scale;
  bool tiled = false;
#if defined(__AVX2__)
  tiled = scores_fast(g, qbuf.data(), kr, vr, n, d, scores.data(), next, asked);
#endif
  if (!tiled)
    for (int64_t c = 0; c < n; ++c) score_row(qbuf.data(), kr[c], g, d, &scores[c], n);
}

// acc[j * d ..] (zeroed first) = the sum over c of weights[j * n + c] * V row c: each row
// read once for all of the group's heads.
template <typename C>
inline void weigh_values(const Args& a, const float* weights, const C* const* vr, int64_t n,
                         float* acc, Ahead<C>* next = nullptr) {
  const int64_t d = a.d, g = a.group;
  std::fill(acc, acc + g * d, 0.f);
  bool tiled = false;
#if defined(__AVX2__)
  tiled = values_fast(g, weights, vr, n, d, acc, next);
#endif
  if (!tiled)
    for (int64_t c = 0; c < n; ++c) value_row(acc, &weights[c], n, vr[c], g, d);
}

// Attention of one query token's group of g heads (rows q[j * d ..], scaled by a.scale)
// over n K/V rows kr / vr: scores, softmax with the soft cap and head h's sinks, the
// weighted sum of V, written to out[j * d ..]. scores, qbuf and acc: the caller's scratch;
// next, asked: as `scores_tiled`'s.
template <typename T, typename C>
inline void attend_row(const Args& a, int64_t h, const T* q, const C* const* kr,
                       const C* const* vr, int64_t n, T* out, std::vector<float>& scores,
                       std::vector<float>& qbuf, std::vector<float>& acc,
                       Ahead<C>* next = nullptr, bool asked = false) {
  const int64_t d = a.d, g = a.group;
  score_group(a, q, kr, vr, n, scores, qbuf, next, asked);
  for (int64_t j = 0; j < g; ++j)
    softmax(&scores[j * n], n, a.softcap,
            a.sinks != nullptr ? a.sinks[h * g + j] : -std::numeric_limits<float>::infinity());
  acc.resize(static_cast<size_t>(g * d));
  weigh_values(a, scores.data(), vr, n, acc.data(), next);
  if (next != nullptr) next->upto(next->len);
  for (int64_t i = 0; i < g * d; ++i) out[i] = static_cast<T>(acc[i]);
}

// One part of a row's window (docs/design.md §5, "one row on many threads"): n of its K/V
// rows attended by the group's g heads, left unnormalised: per head j, top[j] = the largest
// (soft-capped) score, sum[j] = sum of exp(score - top[j]), acc[j * d ..] = the sum of
// exp(score - top[j]) * V. `merge_parts` combines the parts.
template <typename T, typename C>
inline void attend_part(const Args& a, const T* q, const C* const* kr, const C* const* vr,
                        int64_t n, float* top, float* sum, float* acc,
                        std::vector<float>& scores, std::vector<float>& qbuf) {
  score_group(a, q, kr, vr, n, scores, qbuf);
  for (int64_t j = 0; j < a.group; ++j) {
    float* sc = &scores[j * n];
    top[j] = capped_max(sc, n, a.softcap, -std::numeric_limits<float>::infinity());
    sum[j] = exp_shifted(sc, n, top[j], 0.f);
  }
  weigh_values(a, scores.data(), vr, n, acc);
}

// The softmax-weighted sum of V for head group h from `parts` parts of its window
// (`attend_part`'s tops / sums [part][g], accs [part][g][d]), each rescaled to the largest
// score of all, with head h's sinks in the denominator; written to out[j * d ..].
template <typename T>
inline void merge_parts(const Args& a, int64_t h, int64_t parts, const float* tops,
                        const float* sums, const float* accs, T* out) {
  const int64_t d = a.d, g = a.group;
  for (int64_t j = 0; j < g; ++j) {
    const float sink =
        a.sinks != nullptr ? a.sinks[h * g + j] : -std::numeric_limits<float>::infinity();
    float top = sink;
    for (int64_t p = 0; p < parts; ++p) top = std::max(top, tops[p * g + j]);
    float total = std::isfinite(sink) ? std::exp(sink - top) : 0.f;
    float w[kMaxParts];
    for (int64_t p = 0; p < parts; ++p) {
      w[p] = std::exp(tops[p * g + j] - top);
      total += w[p] * sums[p * g + j];
    }
    const float inv = 1.f / total;
    for (int64_t p = 0; p < parts; ++p) w[p] *= inv;
    for (int64_t i = 0; i < d; ++i) {
      float v = 0.f;
      for (int64_t p = 0; p < parts; ++p) v += w[p] * accs[(p * g + j) * d + i];
      out[j * d + i] = static_cast<T>(v);
    }
  }
}

// The checks both ops make of their common arguments, and their Args; `op` names the op
// in an error. Each block's rows contiguous; blocks any whole number of rows apart, equal
// for K and V; query, K/V and out of one dtype, the two caches of one dtype.
inline Args attention_args(const char* op, const at::Tensor& query, const at::Tensor& key,
                           const at::Tensor& value, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& out, double scale, int64_t window, int64_t ring,
                           double softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.is_contiguous() && key.is_contiguous() && value.is_contiguous() &&
                  block_tables.is_contiguous() && out.is_contiguous(),
              op, ": tensors must be contiguous");
  const int64_t cache_row = key_cache.size(2) * key_cache.size(3);
  for (const at::Tensor* c : {&key_cache, &value_cache})
    TORCH_CHECK(c->dim() == 4 && c->stride(3) == 1 && c->stride(2) == c->size(3) &&
                    c->stride(1) == cache_row && c->stride(0) >= c->size(1) * cache_row &&
                    c->stride(0) == key_cache.stride(0) && c->sizes() == key_cache.sizes(),
                op, ": each cache block's rows must be contiguous, K and V alike");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt, op, ": block_tables must be int32");
  const auto qt = query.scalar_type(), ct = key_cache.scalar_type();
  TORCH_CHECK(value_cache.scalar_type() == ct && key.scalar_type() == qt &&
                  value.scalar_type() == qt && out.scalar_type() == qt,
              op, ": K/V share the query's dtype, the two caches one dtype");
  Args a;
  a.kv_heads = key_cache.size(2);
  a.d = key_cache.size(3);
  a.group = query.size(1) / a.kv_heads;
  a.block_size = key_cache.size(1);
  a.block_stride = key_cache.stride(0);
  a.window = window;
  a.ring = ring;
  a.table_width = block_tables.size(1);
  a.scale = static_cast<float>(scale);
  a.softcap = static_cast<float>(softcap);
  a.sinks = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                    sinks->numel() == query.size(1),
                op, ": sinks must be float32 [num_heads], contiguous");
    a.sinks = sinks->data_ptr<float>();
  }
  return a;
}

// f(T{}, C{}) for the activations' type T and the cache's C: float32 or bf16 queries over a
// cache of their dtype, or float32 queries over a bf16 cache.
template <typename F>
void dispatch_dtypes(const char* op, const at::Tensor& query, const at::Tensor& key_cache,
                     F&& f) {
  const auto qt = query.scalar_type(), ct = key_cache.scalar_type();
  if (qt == at::kFloat && ct == at::kFloat) {
    f(float{}, float{});
  } else if (qt == at::kBFloat16 && ct == at::kBFloat16) {
    f(c10::BFloat16{}, c10::BFloat16{});
  } else if (qt == at::kFloat && ct == at::kBFloat16) {
    f(float{}, c10::BFloat16{});
  } else {
    TORCH_CHECK(false, op, ": float32 or bfloat16 queries over a cache of their dtype, or "
                "float32 queries over a bfloat16 cache");
  }
}

}  // namespace RINGSERVE_NS
}  // namespace ringserve
