// The step's fresh K/V rows into the paged caches, in place: kernels.write_kv on the CPU.
//
// Slot s of a cache is row s % b of block s / b (docs/design.md §2); a slot of -1 skips its
// token. A cache may be a view of a slab with blocks further apart than b rows
// (engine/kv_cache.py): only a token row (kv heads x head dim) must be contiguous. Rows are
// converted to the cache's type as torch's `.to` converts them (bf16: round to nearest
// even), so this writes what kernels/reference.py's `write_kv_reference` writes.
//
// Why compiled: the torch path costs two index_copy_ calls, a view of the slab and the
// checks of the -1 slots, ~60 us a layer from Python; a decode step writes 8 KiB a layer.

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "ops.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

template <typename T, typename C>
void copy_row(const T* src, C* dst, int64_t n) {
  if constexpr (std::is_same_v<T, C>) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(T));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<C>(static_cast<float>(src[i]));
  }
}

template <typename T, typename C, typename S>
void write_rows(const at::Tensor& rows, at::Tensor& cache, const S* slots, int64_t tokens) {
  const int64_t b = cache.size(1), blocks = cache.size(0);
  const int64_t width = cache.size(2) * cache.size(3);
  const int64_t block_stride = cache.stride(0), row_stride = cache.stride(1);
  const int64_t src_stride = rows.stride(0);
  const T* src = rows.data_ptr<T>();
  C* dst = cache.data_ptr<C>();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t s = static_cast<int64_t>(slots[t]);
    if (s < 0) continue;
    TORCH_CHECK(s < blocks * b, "write_kv: slot ", s, " is past the cache's ", blocks * b,
                " slots");
    copy_row(src + t * src_stride, dst + (s / b) * block_stride + (s % b) * row_stride, width);
  }
}

// A token's rows as one contiguous run of kv heads x head dim (a view of a fused
// projection keeps its rows apart: only the row itself must be dense).
bool dense_rows(const at::Tensor& t) {
  return t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2);
}

bool dense_cache_rows(const at::Tensor& c) {
  return c.dim() == 4 && c.stride(3) == 1 && c.stride(2) == c.size(3) &&
         c.stride(1) == c.size(2) * c.size(3);
}

template <typename C>
void write_one(const at::Tensor& rows, at::Tensor& cache, const at::Tensor& slots) {
  const at::Tensor r = dense_rows(rows) ? rows : rows.contiguous();
  const int64_t n = slots.size(0);
  auto go = [&](auto t) {
    using T = decltype(t);
    if (slots.scalar_type() == at::kLong)
      write_rows<T, C>(r, cache, slots.data_ptr<int64_t>(), n);
    else
      write_rows<T, C>(r, cache, slots.data_ptr<int32_t>(), n);
  };
  switch (r.scalar_type()) {
    case at::kFloat: go(float{}); break;
    case at::kBFloat16: go(c10::BFloat16{}); break;
    case at::kHalf: go(c10::Half{}); break;
    default: TORCH_CHECK(false, "write_kv: key and value must be float32, bfloat16 or float16");
  }
}

void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
              at::Tensor value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(),
              "write_kv: key and value must be [tokens, kv_heads, head_dim]");
  TORCH_CHECK(dense_cache_rows(key_cache) && dense_cache_rows(value_cache) &&
                  key_cache.sizes() == value_cache.sizes() &&
                  key_cache.scalar_type() == value_cache.scalar_type(),
              "write_kv: the caches must be [blocks, block_size, kv_heads, head_dim] alike, "
              "each token row contiguous");
  TORCH_CHECK(key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2),
              "write_kv: the caches' rows must be the keys' [kv_heads, head_dim]");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) &&
                  slot_mapping.is_contiguous() &&
                  (slot_mapping.scalar_type() == at::kLong ||
                   slot_mapping.scalar_type() == at::kInt),
              "write_kv: slot_mapping must be [tokens] int32 or int64, contiguous");
  for (const at::Tensor* pair : {&key, &value}) {
    at::Tensor& cache = pair == &key ? key_cache : value_cache;
    switch (cache.scalar_type()) {
      case at::kFloat: write_one<float>(*pair, cache, slot_mapping); break;
      case at::kBFloat16: write_one<c10::BFloat16>(*pair, cache, slot_mapping); break;
      case at::kHalf: write_one<c10::Half>(*pair, cache, slot_mapping); break;
      default: TORCH_CHECK(false, "write_kv: the caches must be float32, bfloat16 or float16");
    }
  }
}

}  // namespace

RINGSERVE_FRAGMENT(RINGSERVE_NS, m) {
  m.def(
      "write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
}

RINGSERVE_IMPL(RINGSERVE_NS, m) { m.impl("write_kv", &write_kv); }
