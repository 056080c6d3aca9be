// LoRA's products for rows of a step, y += scale * B (A x), as vLLM's punica ops split them:
// one shrink (h = A_cat x, every adapted projection of a merged layer in one product) and one
// expand per block of B that is not zero (models/layers/lora.py's B_cat, held transposed):
//
//   bt (R, N), row-major        block (o, n, c, r): out[t, o .. o+n) += scale * h[t, c .. c+r) bt[c .. c+r, o .. o+n)
//
//        o_q          o_k   o_v
//   c_q [ B_q^T     | 0   | 0    ]      q/k/v with q and v adapted: two blocks; the zeros of k's
//   c_v [ 0         | 0   | B_v^T]      columns and of the other rank's rows are never read
//
// The shrink is rows_matmul's (each output one chain of its own row); the expand gives each output
// one FMA chain over k from c, 8 outputs a vector, then out + chain * scale in one FMA. Work is split
// over chunks of outputs, never over a sum: a row's result does not depend on the step's other
// rows, its size or the thread count.
//
// llama_decoder_layer_lora: csrc/decoder_layer.cpp's layer with each projection's adapters added
// after its product, each on its own rows: the same kernels in the same order as the modules take
// with LoRA rows (gate_up's product, then its adapters, then silu * up), so the bits are the modules'.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "vec8.h"

namespace {

using namespace pagedserve_vec;
using Opt = std::optional<at::Tensor>;

constexpr int64_t kTile = 64;  // outputs a task: 8 vectors of 8
constexpr int kChunk = 4;      // vectors of outputs a pass over the tile's weights takes
#if defined(__AVX512F__)
constexpr int kRows = 4;  // rows a pass: 16 accumulators of 32 registers
#else
constexpr int kRows = 2;  // AVX2's 16 registers: 8 accumulators, 4 weight vectors and a broadcast
#endif

// Rows h[0 .. RT) (each at its c) times the weights' r rows (N apart) at w, 8 lanes x `lanes`
// vectors (the last one `last` lanes; kChunk and 8: the whole chunk): out row t at o += scale *
// chain, each output's chain an FMA over k from 0 whatever RT. Each weight vector is loaded once for
// the RT rows: B_cat^T's rows lie N apart (a multiple of 4 KB), so a tile's lines share a few cache
// sets and the tile did not stay in L1 from one row to the next. `prefetch`: the same chunk of the
// next tile.
template <int RT, typename W>
void expand_chunk(const float* const* h, const W* w, int64_t N, int64_t r, int lanes, int last, float* const* out,
                  int64_t o, f32x8 s, bool prefetch) {
  f32x8 acc[RT][kChunk];
  for (int t = 0; t < RT; ++t)
    for (int v = 0; v < kChunk; ++v) acc[t][v] = splat(0.f);
  const bool whole = lanes == kChunk && last == 8;
  for (int64_t k = 0; k < r; ++k) {
    const W* wk = w + k * N;
    if (prefetch) {
      __builtin_prefetch(wk + kTile);
      __builtin_prefetch(wk + kTile + 64 / sizeof(W));
    }
    f32x8 wv[kChunk];
    for (int v = 0; v < kChunk; ++v)
      wv[v] = whole || v < lanes - 1 ? load8(wk + 8 * v) : v == lanes - 1 ? load_part(wk + 8 * v, last) : splat(0.f);
    for (int t = 0; t < RT; ++t) {
      const f32x8 hv = splat(h[t][k]);
      for (int v = 0; v < kChunk; ++v) acc[t][v] = fma8(hv, wv[v], acc[t][v]);
    }
  }
  for (int t = 0; t < RT; ++t) {
    float* ot = out[t] + o;
    for (int v = 0; v < lanes; ++v) {
      const int n = v == lanes - 1 ? last : 8;
      if (n == 8) store8(ot + 8 * v, fma8(acc[t][v], s, load8(ot + 8 * v)));
      else store_part(ot + 8 * v, fma8(acc[t][v], s, load_part(ot + 8 * v, n)), n);
    }
  }
}

// Outputs o0 .. o0 + cols (cols <= kTile) of one block for every row: out row t (its pointer) plus
// scale * h[t, c ..] bt[c .., o0 ..], in chunks of 32 outputs and kRows rows.
template <typename W>
void expand_tile(const float* h, int64_t R, const W* bt, int64_t N, int64_t c, int64_t r, int64_t o0, int64_t cols,
                 float* const* out_rows, int64_t T, float scale) {
  const f32x8 s = splat(scale);
  for (int64_t j = 0; j < cols; j += 8 * kChunk) {
    const int64_t n = std::min<int64_t>(8 * kChunk, cols - j);
    const int lanes = static_cast<int>((n + 7) / 8), last = static_cast<int>(n - 8 * (lanes - 1));
    const W* w = bt + c * N + o0 + j;
    for (int64_t t0 = 0; t0 < T; t0 += kRows) {
      const float* hr[kRows];
      const int rows = static_cast<int>(std::min<int64_t>(kRows, T - t0));
      for (int t = 0; t < rows; ++t) hr[t] = h + (t0 + t) * R + c;
      float* const* out = out_rows + t0;
      const bool prefetch = t0 == 0;
      switch (rows) {
        case 1: expand_chunk<1>(hr, w, N, r, lanes, last, out, o0 + j, s, prefetch); break;
        case 2: expand_chunk<2>(hr, w, N, r, lanes, last, out, o0 + j, s, prefetch); break;
#if defined(__AVX512F__)
        case 3: expand_chunk<3>(hr, w, N, r, lanes, last, out, o0 + j, s, prefetch); break;
        case 4: expand_chunk<4>(hr, w, N, r, lanes, last, out, o0 + j, s, prefetch); break;
#endif
      }
    }
  }
}

// One adapter's share of a step: its rows (int64; None: all of x's), A_cat (R, K), B_cat^T (R, N)
// and the blocks of it that are not zero, [o, n, c, r] each.
struct Group {
  Opt rows;
  at::Tensor a, bt;
  at::IntArrayRef blocks;
  double scale;
};

// out (rows of a step, N) float32 += scale * B (A x) over each group's rows of x. The shrinks run
// group by group; the expands of every group are the tasks of one parallel loop (a step of 16
// rows over 4 adapters: one fork and join a layer, not four).
void lora_add_groups(at::Tensor& out, const at::Tensor& x, const std::vector<Group>& groups) {
  using Shrink = at::Tensor(const at::Tensor&, const at::Tensor&, bool);
  static auto rows_matmul =
      c10::Dispatcher::singleton().findSchemaOrThrow("pagedserve::rows_matmul", "").typed<Shrink>();
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && out.size(0) == x.size(0), "lora_add: x (T, K) and out (T, N)");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.stride(1) == 1, "lora_add: out float32, rows contiguous");
  const int64_t N = out.size(1);
  struct Prepared {
    at::Tensor h;                  // (T, R) float32
    std::vector<float*> out_rows;  // out's row of each of h's
    int64_t R = 0;
  };
  std::vector<Prepared> prepared(groups.size());
  std::vector<int64_t> tasks;  // (group, block, first output) per task
  float* base = out.data_ptr<float>();
  std::optional<at::ScalarType> wtype;
  for (size_t g = 0; g < groups.size(); ++g) {
    const Group& group = groups[g];
    const at::Tensor &a = group.a, &bt = group.bt;
    TORCH_CHECK(a.dim() == 2 && bt.dim() == 2 && a.size(0) == bt.size(0) && a.size(1) == x.size(1),
                "lora_add: a (R, K) and bt (R, N) against x ", x.sizes());
    TORCH_CHECK(bt.size(1) == N && bt.is_contiguous(), "lora_add: bt (R, N) contiguous, N of out");
    TORCH_CHECK(group.blocks.size() % 4 == 0, "lora_add: blocks are [o, n, c, r] each");
    TORCH_CHECK(!wtype || *wtype == bt.scalar_type(), "lora_add: every adapter's bt of one dtype");
    wtype = bt.scalar_type();
    const int64_t R = a.size(0);
    const at::IntArrayRef blocks = group.blocks;
    for (size_t i = 0; i < blocks.size(); i += 4)
      TORCH_CHECK(blocks[i] >= 0 && blocks[i + 1] >= 0 && blocks[i] + blocks[i + 1] <= N && blocks[i + 2] >= 0 &&
                      blocks[i + 3] >= 0 && blocks[i + 2] + blocks[i + 3] <= R,
                  "lora_add: block ", i / 4, " outside bt ", bt.sizes());
    at::Tensor index;
    if (group.rows.has_value()) {
      index = group.rows->to(at::kLong).contiguous();
      TORCH_CHECK(index.dim() == 1, "lora_add: rows (num_rows,)");
    }
    const int64_t T = group.rows.has_value() ? index.size(0) : x.size(0);
    if (T == 0 || blocks.empty()) continue;
    Prepared& p = prepared[g];
    p.R = R;
    p.h = rows_matmul.call(group.rows.has_value() ? x.index_select(0, index) : x, a, false);
    p.out_rows.resize(T);
    const int64_t* picked = group.rows.has_value() ? index.data_ptr<int64_t>() : nullptr;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t row = picked ? picked[t] : t;
      TORCH_CHECK(row >= 0 && row < out.size(0), "lora_add: row ", row, " outside out");
      p.out_rows[t] = base + row * out.stride(0);
    }
    for (size_t i = 0; i < blocks.size(); i += 4)
      for (int64_t o0 = 0; o0 < blocks[i + 1]; o0 += kTile)
        tasks.insert(tasks.end(), {static_cast<int64_t>(g), static_cast<int64_t>(i), o0});
  }
  if (tasks.empty()) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, *wtype, "lora_add", [&] {
    at::parallel_for(0, static_cast<int64_t>(tasks.size() / 3), 4, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t g = tasks[3 * task], o0 = tasks[3 * task + 2];
        const Prepared& p = prepared[g];
        const int64_t* b = groups[g].blocks.data() + tasks[3 * task + 1];
        const int64_t cols = std::min(kTile, b[1] - o0);
        expand_tile(p.h.data_ptr<float>(), p.R, groups[g].bt.data_ptr<scalar_t>(), N, b[2], b[3], b[0] + o0, cols,
                    p.out_rows.data(), static_cast<int64_t>(p.out_rows.size()), static_cast<float>(groups[g].scale));
      }
    });
  });
}

// out (rows of a step, N) float32 += scale * B (A x) over x's rows; `rows` (int64) picks rows of x
// and out, None: all of them. a (R, K), bt (R, N), blocks [o, n, c, r] each.
void lora_add(at::Tensor& out, const at::Tensor& x, const Opt& rows, const at::Tensor& a, const at::Tensor& bt,
              at::IntArrayRef blocks, double scale) {
  lora_add_groups(out, x, {Group{rows, a, bt, blocks, scale}});
}

void lora_add_op(at::Tensor& out, const at::Tensor& x, const Opt& rows, const at::Tensor& a, const at::Tensor& bt,
                 at::IntArrayRef blocks, double scale) {
  lora_add(out, x, rows, a, bt, blocks, scale);
}

// Projection i's product, or (silu_mul) gate_up's product and silu * up in one op: decoder_layer.cpp's.
at::Tensor quant_linear(const at::Tensor& x, const c10::List<Opt>& weights, at::IntArrayRef info, int64_t i,
                        bool silu_mul = false) {
  using Signature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Opt&, const Opt&, int64_t,
                               int64_t, int64_t, double);
  static auto plain = c10::Dispatcher::singleton().findSchemaOrThrow("pagedserve::quant_linear", "").typed<Signature>();
  static auto fused =
      c10::Dispatcher::singleton().findSchemaOrThrow("pagedserve::quant_linear_silu_mul", "").typed<Signature>();
  const Opt qweight = weights.get(4 * i), scales = weights.get(4 * i + 1);
  TORCH_CHECK(qweight.has_value() && scales.has_value(), "decoder_layer_lora: projection ", i, " has no weights");
  return (silu_mul ? fused : plain).call(x, *qweight, *scales, weights.get(4 * i + 2), weights.get(4 * i + 3), info[4 * i],
                    info[4 * i + 1], info[4 * i + 2], static_cast<double>(info[4 * i + 3]));
}

// For each group (an adapter and its rows): lora holds a and bt of qkv, o, gate_up, down in turn
// (both None: no adapter on it); lora_blocks, per group and projection, its number of blocks, then
// [o, n, c, r] each; scales: one per group and projection; rows: one per group, as lora_add's.
at::Tensor llama_decoder_layer_lora(
    const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
    const c10::List<Opt>& weights, at::IntArrayRef info, at::IntArrayRef heads, const at::Tensor& cos,
    const at::Tensor& signed_sin, at::Tensor& kv_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start, double scale,
    int64_t window, const c10::List<Opt>& lora, at::IntArrayRef lora_blocks, at::ArrayRef<double> scales,
    const c10::List<Opt>& rows) {
  static auto rms_norm = c10::Dispatcher::singleton().findSchemaOrThrow("pagedserve::rms_norm", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  static auto rope = c10::Dispatcher::singleton().findSchemaOrThrow("pagedserve::rope_neox", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  static auto write_kv = c10::Dispatcher::singleton().findSchemaOrThrow("pagedserve::write_kv_blocks", "")
                             .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  static auto attention =
      c10::Dispatcher::singleton().findSchemaOrThrow("pagedserve::paged_attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, double, int64_t, int64_t, double)>();
  static auto silu_and_mul = c10::Dispatcher::singleton().findSchemaOrThrow("pagedserve::silu_and_mul", "")
                                 .typed<at::Tensor(const at::Tensor&)>();
  const size_t G = rows.size();
  TORCH_CHECK(weights.size() == 16 && info.size() == 16 && heads.size() == 3, "decoder_layer_lora: 4 projections");
  TORCH_CHECK(G > 0 && lora.size() == 8 * G && scales.size() == 4 * G,
              "decoder_layer_lora: a and bt of 4 projections per group of rows");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "decoder_layer_lora: x (T, hidden) float32");
  // groups[i]: projection i's adapters, those that touch it
  std::vector<std::vector<Group>> groups(4);
  for (size_t g = 0, pos = 0; g < G; ++g)
    for (size_t i = 0; i < 4; ++i) {
      TORCH_CHECK(pos < lora_blocks.size(), "decoder_layer_lora: lora_blocks too short");
      const size_t count = 4 * static_cast<size_t>(lora_blocks[pos]);
      TORCH_CHECK(pos + 1 + count <= lora_blocks.size(), "decoder_layer_lora: lora_blocks too short");
      const Opt a = lora.get(8 * g + 2 * i), bt = lora.get(8 * g + 2 * i + 1);
      if (a.has_value() && bt.has_value())
        groups[i].push_back(Group{rows.get(g), *a, *bt, lora_blocks.slice(pos + 1, count), scales[4 * g + i]});
      pos += 1 + count;
    }
  const auto adapted = [&](int64_t i) { return !groups[i].empty(); };
  const auto product = [&](const at::Tensor& in, int64_t i) {
    at::Tensor out = quant_linear(in, weights, info, i);
    if (adapted(i)) lora_add_groups(out, in, groups[i]);
    return out;
  };
  const int64_t T = x.size(0), H = heads[0], Hk = heads[1], D = heads[2];
  const at::Tensor qkv = product(rms_norm.call(x, input_norm, eps), 0).view({T, H + 2 * Hk, D});
  const at::Tensor qk = rope.call(qkv.slice(1, 0, H + Hk), cos, signed_sin);  // q and k heads are adjacent
  write_kv.call(kv_cache, qk.slice(1, H, H + Hk), qkv.slice(1, H + Hk, H + 2 * Hk), slot_mapping);
  const at::Tensor out =
      attention.call(qk.slice(1, 0, H), kv_cache, block_table, seq_lens, query_start, scale, 0, window, 0.);
  const at::Tensor h = x + product(out.reshape({T, H * D}), 1);
  const at::Tensor post = rms_norm.call(h, post_norm, eps);
  // gate_up without an adapter: as decoder_layer.cpp (the fused op gives silu_and_mul's numbers)
  const at::Tensor act = !adapted(2) && info[4 * 2 + 2] % 16 == 0 ? quant_linear(post, weights, info, 2, true)
                                                                  : silu_and_mul.call(product(post, 2));
  return h + product(act, 3);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("lora_add(Tensor(a!) out, Tensor x, Tensor? rows, Tensor a, Tensor bt, int[] blocks, float scale) -> ()");
  m.def("llama_decoder_layer_lora(Tensor x, Tensor input_norm, Tensor post_norm, float eps, Tensor?[] weights, "
        "int[] info, int[] heads, Tensor cos, Tensor signed_sin, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "Tensor block_table, Tensor seq_lens, Tensor query_start, float scale, int window, Tensor?[] lora, "
        "int[] lora_blocks, float[] scales, Tensor?[] rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("lora_add", &lora_add_op);
  m.impl("llama_decoder_layer_lora", &llama_decoder_layer_lora);
}
