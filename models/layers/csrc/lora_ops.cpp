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
// llama_decoder_layer_lora: csrc/decoder_layer.cpp's layer with each projection's adapter added
// after its product, the same kernels in the same order as the modules take with LoRA rows
// (gate_up's product, then its adapter, then silu * up), so the bits are the modules'.
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

// Outputs o0 .. o0 + cols (cols <= kTile) of one block for every row: out row t (its pointer) plus
// scale * h[t, c ..] bt[c .., o0 ..]. The tile's weights (r x 64) stay in L1 over the rows.
template <typename W>
void expand_tile(const float* h, int64_t R, const W* bt, int64_t N, int64_t c, int64_t r, int64_t o0, int64_t cols,
                 float* const* out_rows, int64_t T, float scale) {
  const f32x8 s = splat(scale);
  const int nv = static_cast<int>((cols + 7) / 8);
  for (int64_t t = 0; t < T; ++t) {
    const float* ht = h + t * R + c;
    f32x8 acc[kTile / 8];
    for (int v = 0; v < kTile / 8; ++v) acc[v] = splat(0.f);
    if (cols == kTile) {
      for (int64_t k = 0; k < r; ++k) {
        const f32x8 hv = splat(ht[k]);
        const W* w = bt + (c + k) * N + o0;
        for (int v = 0; v < kTile / 8; ++v) acc[v] = fma8(hv, load8(w + 8 * v), acc[v]);
      }
      float* o = out_rows[t] + o0;
      for (int v = 0; v < kTile / 8; ++v) store8(o + 8 * v, fma8(acc[v], s, load8(o + 8 * v)));
    } else {  // the block's last outputs: the same chains on fewer lanes
      for (int64_t k = 0; k < r; ++k) {
        const f32x8 hv = splat(ht[k]);
        const W* w = bt + (c + k) * N + o0;
        for (int v = 0; v < nv; ++v) acc[v] = fma8(hv, load_part(w + 8 * v, std::min<int64_t>(8, cols - 8 * v)), acc[v]);
      }
      float* o = out_rows[t] + o0;
      for (int v = 0; v < nv; ++v) {
        const int64_t lanes = std::min<int64_t>(8, cols - 8 * v);
        store_part(o + 8 * v, fma8(acc[v], s, load_part(o + 8 * v, lanes)), lanes);
      }
    }
  }
}

// out (rows of a step, N) float32 += scale * B (A x) over x's rows; `rows` (int64) picks rows of x
// and out, None: all of them. a (R, K), bt (R, N), blocks [o, n, c, r] each.
void lora_add(at::Tensor& out, const at::Tensor& x, const Opt& rows, const at::Tensor& a, const at::Tensor& bt,
              at::IntArrayRef blocks, double scale) {
  using Shrink = at::Tensor(const at::Tensor&, const at::Tensor&, bool);
  static auto rows_matmul =
      c10::Dispatcher::singleton().findSchemaOrThrow("pagedserve::rows_matmul", "").typed<Shrink>();
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && out.size(0) == x.size(0), "lora_add: x (T, K) and out (T, N)");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.stride(1) == 1, "lora_add: out float32, rows contiguous");
  TORCH_CHECK(a.dim() == 2 && bt.dim() == 2 && a.size(0) == bt.size(0) && a.size(1) == x.size(1),
              "lora_add: a (R, K) and bt (R, N) against x ", x.sizes());
  TORCH_CHECK(bt.size(1) == out.size(1) && bt.is_contiguous(), "lora_add: bt (R, N) contiguous, N of out");
  TORCH_CHECK(blocks.size() % 4 == 0, "lora_add: blocks are [o, n, c, r] each");
  const int64_t R = a.size(0), N = bt.size(1);
  for (size_t i = 0; i < blocks.size(); i += 4)
    TORCH_CHECK(blocks[i] >= 0 && blocks[i + 1] >= 0 && blocks[i] + blocks[i + 1] <= N && blocks[i + 2] >= 0 &&
                    blocks[i + 3] >= 0 && blocks[i + 2] + blocks[i + 3] <= R,
                "lora_add: block ", i / 4, " outside bt ", bt.sizes());
  at::Tensor index;
  if (rows.has_value()) {
    index = rows->to(at::kLong).contiguous();
    TORCH_CHECK(index.dim() == 1, "lora_add: rows (num_rows,)");
  }
  const int64_t T = rows.has_value() ? index.size(0) : x.size(0);
  if (T == 0 || blocks.empty()) return;
  const at::Tensor h = rows_matmul.call(rows.has_value() ? x.index_select(0, index) : x, a, false);  // (T, R) f32
  std::vector<float*> out_rows(T);
  float* base = out.data_ptr<float>();
  const int64_t* picked = rows.has_value() ? index.data_ptr<int64_t>() : nullptr;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t row = picked ? picked[t] : t;
    TORCH_CHECK(row >= 0 && row < out.size(0), "lora_add: row ", row, " outside out");
    out_rows[t] = base + row * out.stride(0);
  }
  std::vector<int64_t> tasks;  // (block, first output) per task
  for (size_t i = 0; i < blocks.size(); i += 4)
    for (int64_t o0 = 0; o0 < blocks[i + 1]; o0 += kTile) tasks.insert(tasks.end(), {static_cast<int64_t>(i), o0});
  const float* hp = h.data_ptr<float>();
  const float s = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, bt.scalar_type(), "lora_add", [&] {
    const scalar_t* w = bt.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(tasks.size() / 2), 4, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t* b = blocks.data() + tasks[2 * task];
        const int64_t o0 = tasks[2 * task + 1], cols = std::min(kTile, b[1] - o0);
        expand_tile(hp, R, w, N, b[2], b[3], b[0] + o0, cols, out_rows.data(), T, s);
      }
    });
  });
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

// lora: for qkv, o, gate_up, down in turn: a, bt (both None: no adapter on it); lora_blocks: for
// each, its number of blocks, then [o, n, c, r] each; scales: one each; rows: as lora_add's.
at::Tensor llama_decoder_layer_lora(
    const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
    const c10::List<Opt>& weights, at::IntArrayRef info, at::IntArrayRef heads, const at::Tensor& cos,
    const at::Tensor& signed_sin, at::Tensor& kv_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start, double scale,
    int64_t window, const c10::List<Opt>& lora, at::IntArrayRef lora_blocks, at::ArrayRef<double> scales,
    const Opt& rows) {
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
  TORCH_CHECK(weights.size() == 16 && info.size() == 16 && heads.size() == 3, "decoder_layer_lora: 4 projections");
  TORCH_CHECK(lora.size() == 8 && scales.size() == 4, "decoder_layer_lora: a and bt of 4 projections");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "decoder_layer_lora: x (T, hidden) float32");
  std::vector<size_t> first_block(4);  // where projection i's blocks start in lora_blocks
  for (size_t i = 0, pos = 0; i < 4; ++i) {
    TORCH_CHECK(pos < lora_blocks.size(), "decoder_layer_lora: lora_blocks too short");
    first_block[i] = pos + 1;
    pos += 1 + 4 * static_cast<size_t>(lora_blocks[pos]);
    TORCH_CHECK(pos <= lora_blocks.size(), "decoder_layer_lora: lora_blocks too short");
  }
  const auto adapted = [&](int64_t i) { return lora.get(2 * i).has_value() && lora.get(2 * i + 1).has_value(); };
  const auto product = [&](const at::Tensor& in, int64_t i) {
    at::Tensor out = quant_linear(in, weights, info, i);
    if (adapted(i)) {
      const Opt a = lora.get(2 * i), bt = lora.get(2 * i + 1);
      const size_t first = first_block[i];
      lora_add(out, in, rows, *a, *bt, lora_blocks.slice(first, 4 * lora_blocks[first - 1]), scales[i]);
    }
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
        "int[] lora_blocks, float[] scales, Tensor? rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("lora_add", &lora_add_op);
  m.impl("llama_decoder_layer_lora", &llama_decoder_layer_lora);
}
