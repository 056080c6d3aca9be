// One Llama-style decoder layer as one op, for steps on CPU whose projections all run on
// quant_linear (models/causal_lm.py's DecoderLayer decides):
//
//   h = rms_norm(x);  qkv = h W_qkv^T;  q, k = rope(q, k);  cache <- k, v
//   x = x + attention(q, cache) W_o^T                (within the layer's sliding window, if any)
//   x = x + down(silu(gate) * up)(rms_norm(x))     (gate_up's product and silu * up one op)
//
// It calls the very kernels the module-by-module path calls, in the same order on the same
// tensors, so its result is bit-identical to that path (tests/models/test_decoder_layer_op.py):
// what it saves is Python and dispatch around ~14 small ops a layer, which at one row per step
// cost as much as a third of a 360M model's products.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

namespace {

using Opt = std::optional<at::Tensor>;

// Projection i of x: quant_linear, or (silu_mul) quant_linear_silu_mul, gate_up's product and
// silu_and_mul in one op.
at::Tensor quant_linear(const at::Tensor& x, const c10::List<Opt>& weights, at::IntArrayRef info, int64_t i,
                        bool silu_mul = false) {
  using Signature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Opt&, const Opt&, int64_t,
                               int64_t, int64_t, double);
  static auto plain = c10::Dispatcher::singleton().findSchemaOrThrow("pagedserve::quant_linear", "").typed<Signature>();
  static auto fused =
      c10::Dispatcher::singleton().findSchemaOrThrow("pagedserve::quant_linear_silu_mul", "").typed<Signature>();
  const auto& op = silu_mul ? fused : plain;
  const Opt qweight = weights.get(4 * i), scales = weights.get(4 * i + 1);
  TORCH_CHECK(qweight.has_value() && scales.has_value(), "decoder_layer: projection ", i, " has no weights");
  return op.call(x, *qweight, *scales, weights.get(4 * i + 2), weights.get(4 * i + 3), info[4 * i], info[4 * i + 1],
                 info[4 * i + 2], static_cast<double>(info[4 * i + 3]));
}

// weights: for qkv, o, gate_up, down in turn: qweight, scales, mins or None, bias or None;
// info: for each, bits, group_size, out_features, min_per_scale; heads: H, Hk, head_dim.
at::Tensor llama_decoder_layer(
    const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
    const c10::List<Opt>& weights, at::IntArrayRef info, at::IntArrayRef heads, const at::Tensor& cos,
    const at::Tensor& signed_sin, at::Tensor& kv_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start, double scale,
    int64_t window, const Opt& key_offset, const Opt& key_scale, const Opt& query_scale) {
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
  TORCH_CHECK(weights.size() == 16 && info.size() == 16 && heads.size() == 3, "decoder_layer: 4 projections");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "decoder_layer: x (T, hidden) float32");
  const int64_t T = x.size(0), H = heads[0], Hk = heads[1], D = heads[2];
  const at::Tensor qkv = quant_linear(rms_norm.call(x, input_norm, eps), weights, info, 0).view({T, H + 2 * Hk, D});
  const at::Tensor qk = rope.call(qkv.slice(1, 0, H + Hk), cos, signed_sin);  // q and k heads are adjacent
  // An int8 cache's keys: (k - key_offset) * key_scale, read by q * query_scale, in LlamaAttention's order
  at::Tensor q = qk.slice(1, 0, H), k = qk.slice(1, H, H + Hk);
  if (key_offset.has_value()) k = k - *key_offset;
  if (key_scale.has_value() && query_scale.has_value()) {
    k = k * *key_scale;
    q = q * *query_scale;
  }
  write_kv.call(kv_cache, k, qkv.slice(1, H + Hk, H + 2 * Hk), slot_mapping);
  const at::Tensor out = attention.call(q, kv_cache, block_table, seq_lens, query_start, scale, 0, window, 0.);
  const at::Tensor h = x + quant_linear(out.reshape({T, H * D}), weights, info, 1);
  const at::Tensor post = rms_norm.call(h, post_norm, eps);
  // [gate | up] of whole panels: the product and silu * up in one op, as models/layers/mlp.py runs it
  const at::Tensor act = info[4 * 2 + 2] % 16 == 0 ? quant_linear(post, weights, info, 2, true)
                                                   : silu_and_mul.call(quant_linear(post, weights, info, 2));
  return h + quant_linear(act, weights, info, 3);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("llama_decoder_layer(Tensor x, Tensor input_norm, Tensor post_norm, float eps, Tensor?[] weights, "
        "int[] info, int[] heads, Tensor cos, Tensor signed_sin, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "Tensor block_table, Tensor seq_lens, Tensor query_start, float scale, int window=0, "
        "Tensor? key_offset=None, Tensor? key_scale=None, Tensor? query_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("llama_decoder_layer", &llama_decoder_layer);
}
