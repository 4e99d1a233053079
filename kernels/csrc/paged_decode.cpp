// Decode attention over the ring, read in place: the CPU path's one compiled kernel.
//
// One new token per sequence attends to its cached window, read block by block through
// the ring table (position p lives at cache[table[s, (p / b) % R], p % b], docs/design.md §2),
// and to its own fresh K/V. Every cached K and V row of the window is read from memory
// once (asked for ahead of its use), widened to float32 in registers; nothing is copied out
// of the cache. Two passes per (sequence, kv head): scores for the group's query heads,
// then the softmax-weighted sum of V. Work is split over (sequence, kv head) pairs
// (thread_pool.h); where there are fewer pairs than threads (one row, one kv head), each
// pair's window is split into parts whose partial sums are merged (`attend_part`).

#include <ATen/Parallel.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "ops.h"
#include "thread_pool.h"

#include "attention_rows.h"
#include "bf16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <limits>
#include <vector>

namespace {

using ringserve::to_f;
using namespace ringserve::RINGSERVE_NS;

// The columns a decode row at context `ctx` attends to: the cached positions its window
// keeps, then its own fresh row.
inline int64_t window_len(const Args& a, int64_t ctx) {
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, ctx - a.window + 1) : 0;
  return ctx - lo + 1;
}

// The rows sequence `s`, kv head `h` attends to: its cached window, found in the ring, then
// its fresh K/V row (the last column). T is the activations' type, C the cache's (bf16
// under float32 activations with kv_cache_dtype=bfloat16); the fresh row is rounded to C
// first, as the cache will hold it, so a token attends to itself as later tokens will see
// it. Returns the column count.
template <typename T, typename C>
int64_t window_rows(const Args& a, int64_t s, int64_t h, const T* key, const T* value,
                    const C* key_cache, const C* value_cache, const int32_t* tables,
                    int64_t token, int64_t ctx, std::vector<C>& fresh,
                    std::vector<const C*>& krows, std::vector<const C*>& vrows) {
  const int64_t d = a.d;
  const int64_t len = window_len(a, ctx);
  const int64_t lo = ctx + 1 - len;  // the first cached position read
  fresh.resize(static_cast<size_t>(2 * d));
  const T* fk = key + (token * a.kv_heads + h) * d;
  const T* fv = value + (token * a.kv_heads + h) * d;
  for (int64_t i = 0; i < d; ++i) {
    fresh[i] = ringserve::from_f<C>(to_f(fk[i]));
    fresh[d + i] = ringserve::from_f<C>(to_f(fv[i]));
  }
  // Column c is position lo + c, its rows found block by block (one table look-up a block).
  krows.resize(static_cast<size_t>(len));
  vrows.resize(static_cast<size_t>(len));
  ring_rows(a, tables + s * a.table_width, h, lo, ctx, key_cache, value_cache, krows.data(),
            vrows.data());
  krows[len - 1] = fresh.data();
  vrows[len - 1] = fresh.data() + d;
  return len;
}

// NOTE: a part of at least this many window columns: below it, splitting one row's window
// over threads saves less than merging the parts costs.
constexpr int64_t kMinPart = 64;

// How many parts each (sequence, kv head) item's window is split into: 1 unless there are
// fewer items than threads (one decode row with few kv heads: one thread would do all the
// work while the others wait) and every window has kMinPart columns a part.
int64_t parts_of(const Args& a, int64_t items, const int64_t* ctx, int64_t n) {
  const int64_t threads = at::get_num_threads();
  if (items == 0 || items >= threads) return 1;
  int64_t shortest = std::numeric_limits<int64_t>::max();
  for (int64_t i = 0; i < n; ++i) shortest = std::min(shortest, window_len(a, ctx[i]));
  return std::clamp<int64_t>(std::min(threads / items, shortest / kMinPart), 1, kMaxParts);
}

template <typename T, typename C>
void run(const Args& a, const at::Tensor& query, const at::Tensor& key,
         const at::Tensor& value, const at::Tensor& key_cache, const at::Tensor& value_cache,
         const at::Tensor& tables, const at::Tensor& seq_ids, const at::Tensor& tokens,
         const at::Tensor& ctxs, at::Tensor& out) {
  const int64_t n = seq_ids.size(0);
  const int64_t* seq = seq_ids.data_ptr<int64_t>();
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* ctx = ctxs.data_ptr<int64_t>();
  const T* q = query.data_ptr<T>();
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  const C* kc = key_cache.data_ptr<C>();
  const C* vc = value_cache.data_ptr<C>();
  const int32_t* tb = tables.data_ptr<int32_t>();
  T* o = out.data_ptr<T>();
  const int64_t items = n * a.kv_heads, g = a.group, d = a.d;
  const auto first = [&](int64_t i, int64_t h) { return (tok[i] * a.kv_heads * g + h * g) * d; };
  const int64_t parts = parts_of(a, items, ctx, n);
  if (parts == 1) {
    // Each item's rows are found one item ahead, and asked for while the item before is
    // multiplied (`Ahead`): a thread's chunk is consecutive items.
    ringserve::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      Scratch<C> both[2];
      const auto rows_of = [&](int64_t w, Scratch<C>& t) {
        const int64_t i = w / a.kv_heads, h = w % a.kv_heads;
        return window_rows<T, C>(a, seq[i], h, k, v, kc, vc, tb, tok[i], ctx[i], t.fresh,
                                 t.krows, t.vrows);
      };
      int64_t len = rows_of(begin, both[0]);
      for (int64_t w = begin; w < end; ++w) {
        const int64_t i = w / a.kv_heads, h = w % a.kv_heads;
        Scratch<C>& t = both[(w - begin) % 2];
        Ahead<C> next;
        if (w + 1 < end) {
          Scratch<C>& u = both[(w + 1 - begin) % 2];
          next.len = rows_of(w + 1, u);
          next.k = u.krows.data();
          next.v = u.vrows.data();
          next.d = d;
        }
        attend_row(a, h, q + first(i, h), t.krows.data(), t.vrows.data(), len, o + first(i, h),
                   t.scores, t.qbuf, t.acc, w + 1 < end ? &next : nullptr, w > begin);
        len = next.len;
      }
    });
    return;
  }
  // One row's window over several threads: each part's unnormalised sums, then one merge
  // an item (the softmax's rescaling of partial sums).
  std::vector<float> tops(static_cast<size_t>(items * parts * g));
  std::vector<float> sums(tops.size()), accs(tops.size() * static_cast<size_t>(d));
  ringserve::parallel_for(0, items * parts, 1, [&](int64_t begin, int64_t end) {
    Scratch<C> t;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t w = u / parts, part = u % parts;
      const int64_t i = w / a.kv_heads, h = w % a.kv_heads;
      const int64_t len = window_rows<T, C>(a, seq[i], h, k, v, kc, vc, tb, tok[i], ctx[i],
                                            t.fresh, t.krows, t.vrows);
      const int64_t c0 = len * part / parts, c1 = len * (part + 1) / parts;
      attend_part(a, q + first(i, h), t.krows.data() + c0, t.vrows.data() + c0, c1 - c0,
                  &tops[u * g], &sums[u * g], &accs[u * g * d], t.scores, t.qbuf);
    }
  });
  for (int64_t w = 0; w < items; ++w) {
    const int64_t i = w / a.kv_heads, h = w % a.kv_heads;
    merge_parts(a, h, parts, &tops[w * parts * g], &sums[w * parts * g],
                &accs[w * parts * g * d], o + first(i, h));
  }
}

// Writes out[tokens[i]] for each decode row i; other rows of `out` are left untouched.
void paged_decode(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_ids,
                  const at::Tensor& tokens, const at::Tensor& context_lens, at::Tensor out,
                  double scale, int64_t window, int64_t ring, double softcap,
                  const std::optional<at::Tensor>& sinks) {
  const Args a = attention_args("paged_decode", query, key, value, key_cache, value_cache,
                                block_tables, out, scale, window, ring, softcap, sinks);
  TORCH_CHECK(seq_ids.scalar_type() == at::kLong && tokens.scalar_type() == at::kLong &&
                  context_lens.scalar_type() == at::kLong,
              "paged_decode: seq_ids, tokens, context_lens must be int64");
  dispatch_dtypes("paged_decode", query, key_cache, [&](auto t, auto c) {
    run<decltype(t), decltype(c)>(a, query, key, value, key_cache, value_cache, block_tables,
                                  seq_ids, tokens, context_lens, out);
  });
}

}  // namespace

RINGSERVE_LIBRARY(RINGSERVE_NS, m) {
  m.def(
      "paged_decode(Tensor query, Tensor key, Tensor value, Tensor key_cache, "
      "Tensor value_cache, Tensor block_tables, Tensor seq_ids, Tensor tokens, "
      "Tensor context_lens, Tensor(a!) out, float scale, int window, int ring, "
      "float softcap, Tensor? sinks=None) -> ()");
}

RINGSERVE_IMPL(RINGSERVE_NS, m) { m.impl("paged_decode", &paged_decode); }
