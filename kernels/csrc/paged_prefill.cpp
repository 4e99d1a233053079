// Prefill attention over the ring, read in place: every new token of a chunk attends to the
// keys of its window, the cached ones read through the ring table (docs/design.md §2) and
// the chunk's own from the step's fresh K/V, never copied out of the cache.
//
// The torch path this replaces gathered each chunk's window out of the cache, widened it to
// float32, and ran the whole (chunk x window) score square through bmm, masking, softmax
// and a second bmm, sequence by sequence from Python: for 16 prompts of 128 tokens about a
// sixth of a 2048-token prefill step on gemma-3-270m (benchmarks/prefill_attention_bench.py).
// Here each query token scores only the keys it may see (a causal band, not the square),
// with the decode kernel's register tiles over its group of query heads
// (attention_rows.h). Work items are (sequence, kv head, tile of kQueryTile tokens): a
// tile's key rows are found once and stay in L2 while its tokens read them.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "ops.h"
#include "thread_pool.h"

#include "attention_rows.h"
#include "bf16.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using ringserve::to_f;
using namespace ringserve::RINGSERVE_NS;

// Query tokens a work item: its keys (kQueryTile + window - 1 rows of K and V) stay in L2.
constexpr int64_t kQueryTile = 32;

// One prefill row: the new tokens start..end of sequence seq, after ctx cached positions.
struct Row {
  int64_t seq, start, end, ctx;
};

// Query tokens [q0, q1) (counted from the row's start) of one row, one kv head.
struct Item {
  int64_t row, head, q0, q1;
};

// Items of every row and kv head, each row's tiles ordered first, last, second, second to
// last...: the pool hands each thread one contiguous run of items (at::parallel_for's
// chunks), and under full attention a tile's cost grows with its position, so pairing the
// cheap with the dear keeps the runs even.
std::vector<Item> items(const std::vector<Row>& rows, int64_t kv_heads) {
  std::vector<Item> out;
  for (int64_t r = 0; r < static_cast<int64_t>(rows.size()); ++r) {
    const int64_t n = rows[r].end - rows[r].start;
    const int64_t tiles = (n + kQueryTile - 1) / kQueryTile;
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t i = 0, lo = 0, hi = tiles - 1; i < tiles; ++i) {
        const int64_t t = i % 2 == 0 ? lo++ : hi--;
        out.push_back({r, h, t * kQueryTile, std::min(n, (t + 1) * kQueryTile)});
      }
  }
  return out;
}


// The item's query tokens. T is the activations' type, C the cache's; the chunk's own K/V
// rows are rounded to C first (as the cache will hold them, and as the decode kernel reads
// a token's own row), which is the identity where T is C.
template <typename T, typename C>
void prefill_item(const Args& a, const Row& row, const Item& it, const T* query, const T* key,
                  const T* value, const C* key_cache, const C* value_cache,
                  const int32_t* tables, T* out, Scratch<C>& s) {
  const int64_t d = a.d, g = a.group, h = it.head, ctx = row.ctx;
  const int64_t first = ctx + it.q0, last = ctx + it.q1 - 1;  // query positions
  // Keys of the tile: [klo, last]; an older cached position is outside every query's window
  // (and may be expired in the ring).
  const int64_t klo = a.window > 0 ? std::max<int64_t>(0, first - a.window + 1) : 0;
  const int64_t len = last - klo + 1;
  s.krows.resize(static_cast<size_t>(len));
  s.vrows.resize(static_cast<size_t>(len));
  // the cached positions, then the chunk's own
  ring_rows(a, tables + row.seq * a.table_width, h, klo, std::min(ctx, last + 1), key_cache,
            value_cache, s.krows.data(), s.vrows.data());
  const int64_t f0 = std::max(klo, ctx);  // the chunk's own positions [f0, last]
  if constexpr (std::is_same_v<T, C>) {
    for (int64_t p = f0; p <= last; ++p) {
      const int64_t token = row.start + p - ctx;
      s.krows[p - klo] = key + (token * a.kv_heads + h) * d;
      s.vrows[p - klo] = value + (token * a.kv_heads + h) * d;
    }
  } else {
    s.fresh.resize(static_cast<size_t>(2 * (last + 1 - f0) * d));
    for (int64_t p = f0; p <= last; ++p) {
      const int64_t token = row.start + p - ctx;
      const T* fk = key + (token * a.kv_heads + h) * d;
      const T* fv = value + (token * a.kv_heads + h) * d;
      C* dst = s.fresh.data() + 2 * (p - f0) * d;
      for (int64_t i = 0; i < d; ++i) {
        dst[i] = ringserve::from_f<C>(to_f(fk[i]));
        dst[d + i] = ringserve::from_f<C>(to_f(fv[i]));
      }
      s.krows[p - klo] = dst;
      s.vrows[p - klo] = dst + d;
    }
  }
  for (int64_t pos = first; pos <= last; ++pos) {
    const int64_t token = row.start + pos - ctx;
    // This token's keys: positions [lo, pos], columns lo - klo .. pos - klo of the tile.
    const int64_t lo = a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0;
    const int64_t n = pos - lo + 1;
    const int64_t at = (token * a.kv_heads * g + h * g) * d;  // the group's first head
    attend_row(a, h, query + at, s.krows.data() + (lo - klo), s.vrows.data() + (lo - klo), n,
               out + at, s.scores, s.qbuf, s.acc);
  }
}

template <typename T, typename C>
void run(const Args& a, const std::vector<Row>& rows, const at::Tensor& query,
         const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
         const at::Tensor& value_cache, const at::Tensor& tables, at::Tensor& out) {
  const std::vector<Item> work = items(rows, a.kv_heads);
  const T* q = query.data_ptr<T>();
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  const C* kc = key_cache.data_ptr<C>();
  const C* vc = value_cache.data_ptr<C>();
  const int32_t* tb = tables.data_ptr<int32_t>();
  T* o = out.data_ptr<T>();
  ringserve::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t b, int64_t e) {
    Scratch<C> s;
    for (int64_t w = b; w < e; ++w) {
      const Item& it = work[static_cast<size_t>(w)];
      prefill_item<T, C>(a, rows[static_cast<size_t>(it.row)], it, q, k, v, kc, vc, tb, o, s);
    }
  });
}

// Writes out[start:end] of each prefill row (rows: int64 [n, 4] of seq, start, end, ctx);
// other rows of `out` are left untouched. The same arguments as paged_decode otherwise.
void paged_prefill(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   const at::Tensor& key_cache, const at::Tensor& value_cache,
                   const at::Tensor& block_tables, const at::Tensor& prefill_rows,
                   at::Tensor out, double scale, int64_t window, int64_t ring, double softcap,
                   const std::optional<at::Tensor>& sinks) {
  const Args a = attention_args("paged_prefill", query, key, value, key_cache, value_cache,
                                block_tables, out, scale, window, ring, softcap, sinks);
  TORCH_CHECK(prefill_rows.is_contiguous() && prefill_rows.scalar_type() == at::kLong &&
                  prefill_rows.dim() == 2 && prefill_rows.size(1) == 4,
              "paged_prefill: prefill_rows must be int64 [n, 4] (seq, start, end, ctx)");
  std::vector<Row> rows(static_cast<size_t>(prefill_rows.size(0)));
  const int64_t* pr = prefill_rows.data_ptr<int64_t>();
  for (size_t i = 0; i < rows.size(); ++i) {
    rows[i] = {pr[4 * i], pr[4 * i + 1], pr[4 * i + 2], pr[4 * i + 3]};
    TORCH_CHECK(rows[i].seq >= 0 && rows[i].seq < block_tables.size(0) && rows[i].start >= 0 &&
                    rows[i].start <= rows[i].end && rows[i].end <= query.size(0) &&
                    rows[i].ctx >= 0,
                "paged_prefill: prefill row ", i, " is out of range");
  }
  dispatch_dtypes("paged_prefill", query, key_cache, [&](auto t, auto c) {
    run<decltype(t), decltype(c)>(a, rows, query, key, value, key_cache, value_cache,
                                  block_tables, out);
  });
}

}  // namespace

RINGSERVE_FRAGMENT(RINGSERVE_NS, m) {
  m.def(
      "paged_prefill(Tensor query, Tensor key, Tensor value, Tensor key_cache, "
      "Tensor value_cache, Tensor block_tables, Tensor prefill_rows, Tensor(a!) out, "
      "float scale, int window, int ring, float softcap, Tensor? sinks=None) -> ()");
}

RINGSERVE_IMPL(RINGSERVE_NS, m) { m.impl("paged_prefill", &paged_prefill); }
