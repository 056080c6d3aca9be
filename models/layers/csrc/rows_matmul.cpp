// Float products of rows by dense weights, each output summed in one order that nothing but its own
// row decides: DeepSeek's absorbed attention (q_nope W_UK, out_latent W_UV^T, per head), the MoE
// router's logits, and every dense linear layer under --batch-invariant (RowsDenseMethod). torch's
// batched matmuls (MKL, oneDNN) pick their kernels and blocking by the step's row count, so a row's
// rounding followed its neighbours, and the same seeded request to a DeepSeek model sampled
// differently alone and among others, or with drafts.
//
//   kn:  out[t, b, n] = sum over k of x[t, b, k] * w[b, k, n]    w (B, K, N): 8 outputs a vector,
//        one FMA chain over k from 0 (no lane sum)
//   nk:  out[t, b, n] = sum over k of x[t, b, k] * w[b, n, k]    w (B, N, K): lane j's FMA chain over
//        k = j, j + 8, ... of whole vectors, the lanes by sum_lanes4's tree, then the k past the last
//        whole vector in order
//
// Work is split over (b, blocks of rows, blocks of outputs), never over a sum; a block at an edge
// runs the same chains on fewer lanes or rows (vec8.h: FMA intrinsics, so -ffast-math reorders
// nothing). The result is float32, whatever the operands' dtypes (float32, bfloat16, float16).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "vec8.h"

namespace {

using namespace pagedserve_vec;

struct Shape {
  int64_t T, B, K, N;
  int64_t xs_t, xs_b;  // x's strides (k is contiguous); out is (T, B, N) contiguous
};

// kn: rows t0 .. t0 + RT of head b, outputs n0 .. n0 + 8 CV (fewer at the edge).
template <int RT, int CV, typename X, typename W>
void kn_block(const Shape& s, const X* x, const W* w, float* out, int64_t b, int64_t t0, int64_t n0) {
  int64_t lanes[CV];
  for (int v = 0; v < CV; ++v) lanes[v] = std::clamp<int64_t>(s.N - n0 - 8 * v, 0, 8);
  const bool whole = lanes[CV - 1] == 8;
  const W* wb = w + b * s.K * s.N + n0;
  const X* xr[RT];
  for (int r = 0; r < RT; ++r) xr[r] = x + (t0 + r) * s.xs_t + b * s.xs_b;
  f32x8 acc[RT][CV];
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < CV; ++v) acc[r][v] = splat(0.f);
  const auto chains = [&](auto load_w) {
    for (int64_t k = 0; k < s.K; ++k) {
      if constexpr (RT == 1) {  // as nk_block's one row: each weight vector loaded at its FMA
        const f32x8 xv = splat(widen(xr[0][k]));
        for (int v = 0; v < CV; ++v) acc[0][v] = fma8(xv, load_w(wb + k * s.N + 8 * v, v), acc[0][v]);
      } else {
        f32x8 wv[CV];
        for (int v = 0; v < CV; ++v) wv[v] = load_w(wb + k * s.N + 8 * v, v);
        for (int r = 0; r < RT; ++r) {
          const f32x8 xv = splat(widen(xr[r][k]));
          for (int v = 0; v < CV; ++v) acc[r][v] = fma8(xv, wv[v], acc[r][v]);
        }
      }
    }
  };
  if (whole) chains([](const W* p, int) { return load8(p); });
  else chains([&](const W* p, int v) { return lanes[v] > 0 ? load_part(p, lanes[v]) : splat(0.f); });  // the last outputs: the lanes past N on zeros
  for (int r = 0; r < RT; ++r) {
    float* o = out + ((t0 + r) * s.B + b) * s.N + n0;
    for (int v = 0; v < CV; ++v)
      if (lanes[v] > 0) store_part(o + 8 * v, acc[r][v], lanes[v]);
  }
}

// nk: rows t0 .. t0 + RT of head b, outputs n0 .. n0 + 4 G (fewer at the edge).
template <int RT, int G, typename X, typename W>
void nk_block(const Shape& s, const X* x, const W* w, float* out, int64_t b, int64_t t0, int64_t n0) {
  constexpr int CC = 4 * G;
  const int cols = static_cast<int>(std::min<int64_t>(CC, s.N - n0));
  const W* wc[CC];
  for (int c = 0; c < CC; ++c) wc[c] = w + (b * s.N + n0 + std::min(c, cols - 1)) * s.K;  // an edge repeats its last
  const X* xr[RT];
  for (int r = 0; r < RT; ++r) xr[r] = x + (t0 + r) * s.xs_t + b * s.xs_b;
  f32x8 acc[RT][CC];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CC; ++c) acc[r][c] = splat(0.f);
  const int64_t whole = s.K / 8 * 8;
  for (int64_t k = 0; k < whole; k += 8) {
    if constexpr (RT == 1) {  // each weight vector used once: loaded (and widened) at its FMA, so the
      // 8 sums, x and a temporary fit AVX2's 16 registers (all 8 loaded first spilled a sum: its chain
      // went through the stack, and a bf16 row ran at half the speed)
      const f32x8 xv = load8(xr[0] + k);
      if ((k * sizeof(W)) % 64 == 0)
        for (int c = 0; c < CC; ++c) __builtin_prefetch(wc[c] + CC * s.K + k);  // the next block's rows
      for (int c = 0; c < CC; ++c) acc[0][c] = fma8(xv, load8(wc[c] + k), acc[0][c]);
    } else {
      f32x8 wv[CC];
      for (int c = 0; c < CC; ++c) wv[c] = load8(wc[c] + k);
      for (int r = 0; r < RT; ++r) {
        const f32x8 xv = load8(xr[r] + k);
        for (int c = 0; c < CC; ++c) acc[r][c] = fma8(xv, wv[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < RT; ++r) {
    float* o = out + ((t0 + r) * s.B + b) * s.N + n0;
    for (int g = 0; g < G; ++g) {
      const f32x4 sums = sum_lanes4(acc[r][4 * g], acc[r][4 * g + 1], acc[r][4 * g + 2], acc[r][4 * g + 3]);
      for (int c = 4 * g; c < std::min(cols, 4 * g + 4); ++c) {
        float sum = sums[c - 4 * g];
        for (int64_t k = whole; k < s.K; ++k) sum = std::fma(widen(xr[r][k]), widen(wc[c][k]), sum);
        o[c] = sum;
      }
    }
  }
}

// Rows of kn blocks: RT = BR for all but the last, which takes its own count.
template <int BR, int CV, typename X, typename W>
void kn_rows(const Shape& s, const X* x, const W* w, float* out, int64_t b, int64_t t0, int64_t n0, int64_t rows) {
  if constexpr (BR > 1) {
    if (rows < BR) return kn_rows<BR - 1, CV>(s, x, w, out, b, t0, n0, rows);
  }
  kn_block<BR, CV>(s, x, w, out, b, t0, n0);
}

template <int BR, int G, typename X, typename W>
void nk_rows(const Shape& s, const X* x, const W* w, float* out, int64_t b, int64_t t0, int64_t n0, int64_t rows) {
  if constexpr (BR > 1) {
    if (rows < BR) return nk_rows<BR - 1, G>(s, x, w, out, b, t0, n0, rows);
  }
  nk_block<BR, G>(s, x, w, out, b, t0, n0);
}

// Blocks of BR rows x BC outputs, each a task. The blocks' shape never changes a bit (each output's
// chain is its own), only how many independent chains hide the FMA latency: a step of one or two
// rows takes wider blocks.
template <bool kKn, int BR, int BC, typename X, typename W>
void blocks(const Shape& s, const X* x, const W* w, float* out) {
  const int64_t row_blocks = (s.T + BR - 1) / BR, col_blocks = (s.N + BC - 1) / BC;
  at::parallel_for(0, s.B * row_blocks * col_blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      // rows fastest: a block's weights (BC outputs x K) stay in L1 for the next rows
      const int64_t b = task / (row_blocks * col_blocks), cb = task / row_blocks % col_blocks, rb = task % row_blocks;
      const int64_t t0 = rb * BR, n0 = cb * BC, rows = std::min<int64_t>(BR, s.T - t0);
      if constexpr (kKn) kn_rows<BR, BC / 8>(s, x, w, out, b, t0, n0, rows);
      else nk_rows<BR, BC / 4>(s, x, w, out, b, t0, n0, rows);
    }
  });
}

template <bool kKn, typename X, typename W>
void rows_matmul_impl(const Shape& s, const X* x, const W* w, float* out) {
  if constexpr (kKn) {  // 8-12 accumulators
    if (s.T == 1) blocks<true, 1, 64>(s, x, w, out);
    else if (s.T == 2) blocks<true, 2, 32>(s, x, w, out);
    else blocks<true, 6, 16>(s, x, w, out);
  } else {
    if (s.T == 1) blocks<false, 1, 8>(s, x, w, out);
    else blocks<false, 3, 4>(s, x, w, out);
  }
}

// x (T, K) or (T, B, K), its last dimension contiguous; w (K, N) / (N, K), or (B, K, N) / (B, N, K)
// with `kn` saying which -> (T, N) or (T, B, N) float32.
at::Tensor rows_matmul(const at::Tensor& x, const at::Tensor& w, bool kn) {
  TORCH_CHECK((x.dim() == 2 && w.dim() == 2) || (x.dim() == 3 && w.dim() == 3),
              "rows_matmul: x (T, K) with w 2-D, or x (T, B, K) with w 3-D");
  const bool batched = x.dim() == 3;
  Shape s{};
  s.T = x.size(0);
  s.B = batched ? x.size(1) : 1;
  s.K = x.size(-1);
  s.N = kn ? w.size(-1) : w.size(-2);
  TORCH_CHECK((kn ? w.size(-2) : w.size(-1)) == s.K, "rows_matmul: x's K ", s.K, " against w ", w.sizes());
  TORCH_CHECK(!batched || w.size(0) == s.B, "rows_matmul: x's B ", s.B, " against w ", w.sizes());
  auto xc = x.stride(-1) == 1 ? x : x.contiguous();
  auto wc = w.contiguous();
  s.xs_t = xc.stride(0);
  s.xs_b = batched ? xc.stride(1) : 0;
  auto out = at::empty(batched ? std::vector<int64_t>{s.T, s.B, s.N} : std::vector<int64_t>{s.T, s.N},
                       x.options().dtype(at::kFloat));
  if (out.numel() == 0) return out;
  if (s.K == 0) return out.zero_();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "rows_matmul_x", [&] {
    using X = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, wc.scalar_type(), "rows_matmul_w", [&] {
      using W = scalar_t;
      if (kn) rows_matmul_impl<true>(s, xc.data_ptr<X>(), wc.data_ptr<W>(), out.data_ptr<float>());
      else rows_matmul_impl<false>(s, xc.data_ptr<X>(), wc.data_ptr<W>(), out.data_ptr<float>());
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) { m.def("rows_matmul(Tensor x, Tensor w, bool kn) -> Tensor"); }

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("rows_matmul", &rows_matmul); }
