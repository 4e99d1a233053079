// A decode step's layers in one call from Python: engine/models/fast_decode.py's flat
// sequence of ops, run as a loop here for the paths where every op is one of ours: float32
// rows over int16-activation linears (the AVX2 class's default), and bf16 rows over the
// few-row quantized linears (`quant_linear`, or `compact_linear` without AVX512-BF16) or
// an int8 weight's one-byte copy (`int8_tiles_linear`) in steps too small for the linears'
// other copies (one decode row, with the served defaults). Each linear names its own op
// (`QuantLinear.direct_call`).
//
// Why: at one decode row, a layer's 14 op calls from Python cost ~2-3 us each before any
// work (argument parsing against the schema, the Python loop around them): ~0.7 ms of a
// ~12.5 ms step of gemma-3-270m on a Zen 3, most of the time the step is not reading
// weights. Here each op is called through the dispatcher (~0.3 us) with the same tensors
// in the same order as the Python loop, so the results are its bits (tests/test_fast_decode.py
// compares the two, and the modules).
//
// `DecodeLayers` (a torch custom class) holds each layer's constants: the norms' scales,
// the four linears' weights, the attention's shape; `run` takes what changes per step (the
// rows, the rotary tables, the block tables and slots of each layer group, the caches).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "ops.h"

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#define RINGSERVE_STR2(x) #x
#define RINGSERVE_STR(x) RINGSERVE_STR2(x)

namespace {

using Opt = std::optional<at::Tensor>;

template <typename Sig>
c10::TypedOperatorHandle<Sig> our_op(const char* name) {
  const std::string full = std::string(RINGSERVE_STR(RINGSERVE_NS)) + "::" + name;
  return c10::Dispatcher::singleton().findSchemaOrThrow(full.c_str(), "").typed<Sig>();
}

// An empty tensor stands for None in the constructor's list (Tensor[] holds no None).
Opt maybe(const at::Tensor& t) { return t.numel() == 0 ? Opt() : Opt(t); }

// The op a linear calls, as engine/models/fast_decode.py's LINEAR_OPS numbers them.
enum class Op : int64_t { kInt16 = 0, kQuant = 1, kCompact = 2, kTiles8 = 3 };

struct Linear {
  Op op = Op::kInt16;
  // the weight, its scales and mins (empty: none), or the one-byte copy's three tensors
  at::Tensor weight, scales, mins_or_empty;
  Opt mins, bias;
  int64_t bits = 0, group = 0, n = 0, tile_rows = 0;
};

struct Layer {
  at::Tensor norm[4];  // input, post-attention, pre-feedforward, post-feedforward
  Opt q_norm, k_norm;
  Linear linear[4];  // qkv, o, gate_up, down
  double eps[6] = {};  // the four norms', q_norm's, k_norm's
  double scale = 0, softcap = 0;
  int64_t heads = 0, kv_heads = 0, dim = 0, group = 0, window = 0, rope = 0;
};

// Per layer in `tensors`: the 4 norm scales, q_norm and k_norm (empty: none), then for
// qkv, o, gate_up, down each its weight, scales, mins and bias (empty: none), or for the
// one-byte copy its tiles, scales, mins and the bias: 22 tensors. In `floats`: the 6 eps,
// the attention's scale and soft cap: 8. In `ints`: heads, kv_heads, head dim, the layer's
// group (its block tables' index), window (0: none), rotary table index, then each linear's
// op (enum Op), bits, group, output features and tile_rows (quant_linear, compact_linear): 26.
constexpr size_t kTensors = 22, kFloats = 8, kInts = 26;

class DecodeLayers : public torch::CustomClassHolder {
 public:
  // gelu_table: the bf16 GELU's table (cpu_act.table()), empty for float32 rows (every
  // linear int16_act_linear).
  DecodeLayers(std::vector<at::Tensor> tensors, std::vector<double> floats,
               std::vector<int64_t> ints, at::Tensor gelu_table)
      : gelu_table_(std::move(gelu_table)) {
    const size_t n = tensors.size() / kTensors;
    TORCH_CHECK(n > 0 && tensors.size() == n * kTensors && floats.size() == n * kFloats &&
                    ints.size() == n * kInts,
                "DecodeLayers: 22 tensors, 8 floats and 26 ints a layer");
    size_t int16 = 0;
    for (size_t l = 0; l < n; ++l) {
      const at::Tensor* t = tensors.data() + l * kTensors;
      const double* f = floats.data() + l * kFloats;
      const int64_t* i = ints.data() + l * kInts;
      Layer layer;
      for (int j = 0; j < 4; ++j) layer.norm[j] = t[j];
      layer.q_norm = maybe(t[4]);
      layer.k_norm = maybe(t[5]);
      for (int j = 0; j < 4; ++j) {
        Linear& lin = layer.linear[j];
        const int64_t* li = i + 6 + 5 * j;
        TORCH_CHECK(li[0] >= 0 && li[0] <= 3, "DecodeLayers: no linear op ", li[0]);
        lin.op = static_cast<Op>(li[0]);
        int16 += lin.op == Op::kInt16;
        lin.weight = t[6 + 4 * j];
        lin.scales = t[7 + 4 * j];
        lin.mins_or_empty = t[8 + 4 * j];
        lin.mins = maybe(t[8 + 4 * j]);
        lin.bias = maybe(t[9 + 4 * j]);
        lin.bits = li[1];
        lin.group = li[2];
        lin.n = li[3];
        lin.tile_rows = li[4];
      }
      for (int j = 0; j < 6; ++j) layer.eps[j] = f[j];
      layer.scale = f[6];
      layer.softcap = f[7];
      layer.heads = i[0];
      layer.kv_heads = i[1];
      layer.dim = i[2];
      layer.group = i[3];
      layer.window = i[4];
      layer.rope = i[5];
      layers_.push_back(std::move(layer));
    }
    int16_ = int16 > 0;
    TORCH_CHECK(int16 == 0 || int16 == 4 * n,
                "DecodeLayers: float32 rows (int16_act_linear) in every linear or in none");
    TORCH_CHECK(int16_ || gelu_table_.numel() == 65536,
                "DecodeLayers: bf16 rows need the GELU's table of every bf16 value");
  }

  // x: [n, hidden] float32 (every linear int16_act_linear) or bf16, one decode token a
  // row (row i is sequence i's); cos, sin: the
  // rotary tables by index; tables, slots, rings: each layer group's int32 block tables,
  // slot mapping and ring width (0: none); caches: layer l's key and value caches at 2l and
  // 2l + 1. Returns the last layer's output.
  at::Tensor run(at::Tensor x, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                 std::vector<at::Tensor> tables, std::vector<at::Tensor> slots,
                 std::vector<int64_t> rings, at::Tensor rows, at::Tensor ctxs,
                 std::vector<at::Tensor> caches) {
    TORCH_CHECK(caches.size() == 2 * layers_.size(), "DecodeLayers.run: two caches a layer");
    TORCH_CHECK(tables.size() == slots.size() && tables.size() == rings.size() &&
                    cos.size() == sin.size(),
                "DecodeLayers.run: a table, slots and ring per group; cos and sin alike");
    const int64_t n = x.size(0);
    TORCH_CHECK(x.scalar_type() == (int16_ ? at::kFloat : at::kBFloat16),
                "DecodeLayers.run: rows of the dtype its linears were chosen for");
    x = x.contiguous();
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& L = layers_[l];
      TORCH_CHECK(L.group < static_cast<int64_t>(tables.size()) &&
                      L.rope < static_cast<int64_t>(cos.size()),
                  "DecodeLayers.run: layer ", l, "'s group or rotary table is missing");
      const at::Tensor& table = tables[L.group];
      const at::Tensor h = rms_norm_.call(x, L.norm[0], L.eps[0]);
      const auto [q, k, v] = qkv_rope_.call(linear(L.linear[0], h), L.q_norm, L.k_norm,
                                            cos[L.rope], sin[L.rope], L.eps[4], L.eps[5],
                                            L.heads, L.kv_heads);
      const at::Tensor& key_cache = caches[2 * l];
      const at::Tensor& value_cache = caches[2 * l + 1];
      at::Tensor out = at::empty_like(q);
      paged_decode_.call(q, k, v, key_cache, value_cache, table, rows, rows, ctxs, out,
                         L.scale, L.window, rings[L.group], L.softcap, std::nullopt);
      write_kv_.call(k, v, key_cache, value_cache, slots[L.group]);
      x = add_rms_norm_.call(x, linear(L.linear[1], out.view({n, L.heads * L.dim})),
                             L.norm[1], L.eps[1]);
      const std::vector<at::Tensor> gate_up =
          linear(L.linear[2], rms_norm_.call(x, L.norm[2], L.eps[2])).chunk(2, -1);
      const at::Tensor act = int16_ ? gelu_.call(gate_up[0], gate_up[1])
                                    : gelu_bf16_.call(gate_up[0], gate_up[1], gelu_table_);
      x = add_rms_norm_.call(x, linear(L.linear[3], act), L.norm[3], L.eps[3]);
    }
    return x;
  }

 private:
  at::Tensor linear(const Linear& lin, const at::Tensor& x) const {
    switch (lin.op) {
      case Op::kQuant:
        return quant_linear_.call(x, lin.weight, lin.scales, lin.mins, lin.bits, lin.group,
                                  lin.bias, lin.tile_rows);
      case Op::kCompact:
        return compact_linear_.call(x, lin.weight, lin.scales, lin.mins, lin.bits, lin.group,
                                    lin.bias, lin.tile_rows);
      case Op::kTiles8:
        return tiles8_linear_.call(x, lin.weight, lin.scales, lin.mins_or_empty, lin.bits,
                                   lin.group, lin.n, lin.bias);
      case Op::kInt16:
        break;
    }
    return int16_linear_.call(x, lin.weight, lin.scales, lin.mins, lin.bits, lin.group,
                              lin.bias);
  }

  // (the two few-row linears of bf16 rows: compact_linear's scales are optional)
  using QuantLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const Opt&, int64_t, int64_t, const Opt&, int64_t);
  using CompactLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const Opt&,
                                   const Opt&, int64_t, int64_t, const Opt&, int64_t);
  using Tiles8Linear = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, int64_t, int64_t, int64_t, const Opt&);
  bool int16_ = true;
  at::Tensor gelu_table_;
  c10::TypedOperatorHandle<QuantLinear> quant_linear_ = our_op<QuantLinear>("quant_linear");
  c10::TypedOperatorHandle<CompactLinear> compact_linear_ =
      our_op<CompactLinear>("compact_linear");
  c10::TypedOperatorHandle<Tiles8Linear> tiles8_linear_ =
      our_op<Tiles8Linear>("int8_tiles_linear");
  std::vector<Layer> layers_;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm_ =
      our_op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("rms_norm");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      double)>
      add_rms_norm_ = our_op<at::Tensor(const at::Tensor&, const at::Tensor&,
                                        const at::Tensor&, double)>("add_rms_norm");
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const Opt&, const Opt&, const at::Tensor&, const at::Tensor&, double,
      double, int64_t, int64_t)>
      qkv_rope_ = our_op<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
          const at::Tensor&, const Opt&, const Opt&, const at::Tensor&, const at::Tensor&,
          double, double, int64_t, int64_t)>("qkv_rope");
  // (the signatures as the ops' functions declare them: an output by value)
  using PagedDecode = void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor,
                           double, int64_t, int64_t, double, const Opt&);
  c10::TypedOperatorHandle<PagedDecode> paged_decode_ = our_op<PagedDecode>("paged_decode");
  using WriteKv = void(const at::Tensor&, const at::Tensor&, at::Tensor, at::Tensor,
                       const at::Tensor&);
  c10::TypedOperatorHandle<WriteKv> write_kv_ = our_op<WriteKv>("write_kv");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const Opt&, int64_t, int64_t, const Opt&)>
      int16_linear_ = our_op<at::Tensor(const at::Tensor&, const at::Tensor&,
                                        const at::Tensor&, const Opt&, int64_t, int64_t,
                                        const Opt&)>("int16_act_linear");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&)> gelu_ =
      our_op<at::Tensor(const at::Tensor&, const at::Tensor&)>("gelu_tanh_mul_f32");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>
      gelu_bf16_ = our_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
          "gelu_tanh_mul");
};

}  // namespace

RINGSERVE_FRAGMENT(RINGSERVE_NS, m) {
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<std::vector<at::Tensor>, std::vector<double>, std::vector<int64_t>,
                       at::Tensor>())
      .def("run", &DecodeLayers::run);
}
