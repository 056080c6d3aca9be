// Element-wise layers fused into one pass each, for CPUs. In eager PyTorch an RMSNorm is
// ~8 ops over the activations (upcast, square, mean, rsqrt, scale, downcast, weight) and
// SwiGLU's silu(gate) * up is 2 more, each a pass over memory with its own dispatch: in a
// prefill step of 2048 tokens they took ~20% of the time. Rounding follows the PyTorch
// code they replace (transformers' Llama): normalize in float32, round to the input dtype,
// then multiply by the weight in that dtype; silu rounded before the product.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec8.h"

namespace {

using namespace pagedserve_vec;

template <typename scalar_t>
inline scalar_t round_to(float x) {
  return static_cast<scalar_t>(x);
}

// The `count` (1..8) numbers at p as floats, 0 past them.
template <typename T>
inline f32x8 load_part(const T* p, int64_t count) {
  if (count == 8) return load8(p);
  alignas(32) float v[8] = {};
  for (int64_t i = 0; i < count; ++i) v[i] = widen(p[i]);
  return load8(v);
}

// v's first `count` lanes stored at p, each rounded to T.
template <typename T>
inline void store_part(T* p, f32x8 v, int64_t count) {
  if constexpr (std::is_same_v<T, float>) {
    if (count == 8) return store8(p, v);
  }
  alignas(32) float lanes[8];
  store8(lanes, v);
  for (int64_t i = 0; i < count; ++i) p[i] = round_to<T>(lanes[i]);
}

// Each lane rounded to T and back (as the PyTorch layers round between their ops).
template <typename T>
inline f32x8 rounded(f32x8 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    alignas(32) float lanes[8];
    store8(lanes, v);
    for (float& lane : lanes) lane = static_cast<float>(round_to<T>(lane));
    return load8(lanes);
  }
}

// One row of n: weight * round(x * rsqrt(mean(x^2) + eps)). (A function of its own, its arguments
// locals: in the rows' lambda, every store (a memcpy) could alias what the lambda reads through its
// captures, which were reloaded at each vector: 2048 rows of 960 took 2.7x as long.)
template <typename scalar_t>
void rms_norm_row(const scalar_t* x, const scalar_t* w, scalar_t* out, int64_t n, float eps) {
  const float sum = sum_squares(x, n);  // one order in every ISA build (vec8.h)
  // One IEEE operation at a time, each result held (vec8.h): under -ffast-math the compilers for
  // the AVX2 and AVX-512 builds chose differently here (sum * (1 / n) + eps as one FMA in one, a
  // division and an add in the other; 1 / sqrt as an approximate reciprocal square root and a
  // Newton step, whose start is `rsqrtss`'s 12 bits or `vrsqrt14ss`'s 14).
  float count = static_cast<float>(n);
  hold(count);
  float mean = sum / count;
  hold(mean);
  float root = std::sqrt(mean + eps);
  hold(root);
  const f32x8 inv = splat(1.f / root);
  // x * inv held apart from the weight's product: a vectorized loop let -ffast-math turn
  // w * (x * inv) into another order in its last, partial vector, which falls on other columns
  // for 16 lanes than for 8 (the AVX-512 and AVX2 builds differed there).
  for (int64_t j = 0; j < n; j += 8) {
    const int64_t part = std::min<int64_t>(8, n - j);
    f32x8 normed = load_part(x + j, part) * inv;
    hold(normed);
    store_part(out + j, load_part(w + j, part) * rounded<scalar_t>(normed), part);
  }
}

template <typename scalar_t>
void rms_norm_rows(const scalar_t* xp, const scalar_t* wp, scalar_t* op, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * n, wp, op + r * n, n, eps);
  });
}

// One row of gate_up's halves -> round(silu(gate)) * up (a function of its own, as rms_norm_row).
template <typename scalar_t>
void silu_and_mul_row(const scalar_t* gate, const scalar_t* up, scalar_t* out, int64_t inter) {
  for (int64_t j = 0; j < inter; j += 8) {  // silu8 on 8 at a time (vec8.h)
    const int64_t part = std::min<int64_t>(8, inter - j);
    store_part(out + j, rounded<scalar_t>(silu8(load_part(gate + j, part))) * load_part(up + j, part), part);
  }
}

// gate_up (T, 2I) = [gate | up] -> (T, I).
template <typename scalar_t>
void silu_and_mul_rows(const scalar_t* ip, scalar_t* op, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_and_mul_row(ip + r * 2 * inter, ip + r * 2 * inter + inter, op + r * inter, inter);
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "rms_norm: x (T, N), weight (N,)");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight must have one dtype");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto out = at::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), xc.size(0),
                            xc.size(1), static_cast<float>(eps));
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_and_mul: gate_up (T, 2I)");
  auto in = gate_up.contiguous();
  const int64_t rows = in.size(0), inter = in.size(1) / 2;
  auto out = at::empty({rows, inter}, in.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(in.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, inter);
  });
  return out;
}

// Whether a lane is -inf, read from its bits: -ffast-math lets the compiler assume no infinities in
// float comparisons, and a sampler's logits hold -inf for every token a row may not take.
inline i32x8 is_minus_inf(f32x8 x) {
  i32x8 bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits == static_cast<int32_t>(0xFF800000u);
}

// One row of V logits -> softmax (probabilities; exactly 0 where the logit is -inf) or log_softmax
// (-inf there), in one order for every ISA build: the max, then e^(x - max) by exp8 summed in four
// 8-lane chains (each add held in its order, vec8.h: -ffast-math reassociates a plain
// chain), their lanes by sum_lanes4's tree. torch's softmax sums 8 or 16 lanes as the CPU allows and
// calls its own exp: a seeded request's logprobs differed between an AVX2 and an AVX-512 CPU.
template <bool kLog>
void softmax_row(const float* x, float* out, int64_t n) {
  const f32x8 minus_inf = splat(-std::numeric_limits<float>::infinity());
  // The row as whole vectors: a last partial one is copied into `padded`, -inf past n.
  const int64_t whole = n / 8 * 8, vectors = (n + 7) / 8;
  alignas(32) float padded[8], padded_out[8];
  store8(padded, minus_inf);
  std::copy(x + whole, x + n, padded);
  const auto in = [&](int64_t v) { return v * 8 < whole ? load8(x + v * 8) : load8(padded); };
  f32x8 m8 = minus_inf;
  for (int64_t v = 0; v < vectors; ++v) m8 = in(v) > m8 ? in(v) : m8;
  float m = m8[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, m8[i]);  // a max is exact in any order
  const f32x8 mv = splat(m), zero = splat(0.f);
  // Vector v's terms go to sum v % 4; each add held in its place.
  f32x8 s0 = zero, s1 = zero, s2 = zero, s3 = zero;
  float* const dst = kLog ? nullptr : out;
  int64_t v = 0;
  for (; v + 4 <= whole / 8; v += 4) {
    const f32x8 x0 = load8(x + 8 * v), x1 = load8(x + 8 * v + 8), x2 = load8(x + 8 * v + 16), x3 = load8(x + 8 * v + 24);
    const f32x8 e0 = is_minus_inf(x0) ? zero : exp8(x0 - mv), e1 = is_minus_inf(x1) ? zero : exp8(x1 - mv);
    const f32x8 e2 = is_minus_inf(x2) ? zero : exp8(x2 - mv), e3 = is_minus_inf(x3) ? zero : exp8(x3 - mv);
    s0 = s0 + e0, s1 = s1 + e1, s2 = s2 + e2, s3 = s3 + e3;
    hold(s0), hold(s1), hold(s2), hold(s3);
    if constexpr (!kLog) {
      store8(dst + 8 * v, e0), store8(dst + 8 * v + 8, e1), store8(dst + 8 * v + 16, e2), store8(dst + 8 * v + 24, e3);
    }
  }
  for (; v < vectors; ++v) {  // the last 0-3 vectors, the partial one padded
    const f32x8 xv = in(v), e = is_minus_inf(xv) ? zero : exp8(xv - mv);
    f32x8& sum = v % 4 == 0 ? s0 : v % 4 == 1 ? s1 : v % 4 == 2 ? s2 : s3;
    sum = sum + e;
    hold(sum);
    if constexpr (!kLog) {
      if (8 * v < whole) store8(dst + 8 * v, e);
      else store8(padded_out, e), std::copy(padded_out, padded_out + (n - whole), dst + whole);
    }
  }
  const f32x4 s4 = sum_lanes4(s0, s1, s2, s3);
  const f32x4 t = __builtin_shufflevector(s4, s4, 0, 1, 0, 1) + __builtin_shufflevector(s4, s4, 2, 3, 2, 3);
  const float sum = t[0] + t[1];  // >= 1 (the max's own term) unless every logit is -inf
  if constexpr (kLog) {  // (x - max) - log(sum), -inf where x is
    const f32x8 log_sum = splat(std::log(sum));
    for (int64_t v = 0; v < vectors; ++v) {
      const f32x8 xv = in(v);
      f32x8 d = xv - mv;
      hold(d);
      const f32x8 y = is_minus_inf(xv) ? minus_inf : d - log_sum;
      if (8 * v < whole) store8(out + 8 * v, y);
      else store8(padded_out, y), std::copy(padded_out, padded_out + (n - whole), out + whole);
    }
  } else if (sum > 0.f) {
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < n; ++j) out[j] *= inv;  // element by element: the same in any build
  }
}

// logits (N, V) float32 -> softmax or log_softmax of each row, each row on one thread.
at::Tensor softmax_rows(const at::Tensor& logits, bool log) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "softmax_rows: logits (N, V) float32");
  auto in = logits.contiguous();
  auto out = at::empty_like(in);
  const int64_t n = in.size(1);
  const float* xp = in.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, in.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (log) softmax_row<true>(xp + r * n, op + r * n, n);
      else softmax_row<false>(xp + r * n, op + r * n, n);
    }
  });
  return out;
}

// One row's inverse-CDF draw from softmax(x / t): the first token whose running sum of weights
// e^(x/t - max) passes u times their total, -1 where no token has weight (every logit -inf). What
// the sampler did in 5 passes of torch ops (divide, softmax, cumsum, two searchsorteds), in 2
// passes: the weights summed in blocks of kDrawBlock (each block on one 8-lane chain, its lanes by
// one tree), the blocks' sums added in order to find the block, then that block's weights one by
// one. A token of weight 0 (a -inf logit: grammar, top-k, top-p, min-p, min_tokens) is never drawn:
// the running sum cannot pass u * total on it unless it had before.
constexpr int64_t kDrawBlock = 256;

int64_t draw_row(const float* x, int64_t n, float t, float u, float* weights, float* block_sums) {
  const f32x8 minus_inf = splat(-std::numeric_limits<float>::infinity()), zero = splat(0.f), tv = splat(t);
  const int64_t whole = n / 8 * 8;
  alignas(32) float padded[8];
  store8(padded, minus_inf);
  std::copy(x + whole, x + n, padded);
  const auto scaled = [&](int64_t j) {  // x / t of the 8 from j (a -inf logit stays -inf)
    const f32x8 v = j < whole ? load8(x + j) : load8(padded);
    f32x8 z = v / tv;
    hold(z);
    return is_minus_inf(v) ? minus_inf : z;
  };
  f32x8 m8 = minus_inf;
  for (int64_t j = 0; j < n; j += 8) {
    const f32x8 z = scaled(j);
    m8 = z > m8 ? z : m8;
  }
  float m = m8[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, m8[i]);
  const f32x8 mv = splat(m);
  const int64_t blocks = (n + kDrawBlock - 1) / kDrawBlock;
  float total = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    f32x8 sum = zero;
    for (int64_t j = b * kDrawBlock; j < std::min(n, (b + 1) * kDrawBlock); j += 8) {
      const f32x8 z = scaled(j);
      const f32x8 e = is_minus_inf(z) ? zero : exp8(z - mv);
      store8(weights + j, e);  // weights holds whole vectors: n rounded up to 8
      sum = sum + e;
      hold(sum);
    }
    const f32x4 s4 = sum_lanes4(sum, zero, zero, zero);
    block_sums[b] = s4[0];
    total += s4[0];
    hold(total);
  }
  if (!(total > 0.f) || !std::isfinite(total)) return -1;
  float target = u * total;
  hold(target);
  float before = 0.f;
  int64_t b = 0;
  for (; b + 1 < blocks; ++b) {  // the block where the running sum passes the target (else the last)
    float after = before + block_sums[b];
    hold(after);
    if (after > target) break;
    before = after;
  }
  int64_t last = -1;  // the block's last token with weight: where rounding leaves the target unreached
  for (int64_t j = b * kDrawBlock; j < std::min(n, (b + 1) * kDrawBlock); ++j) {
    if (weights[j] > 0.f) last = j;
    float after = before + weights[j];
    hold(after);
    if (after > target && weights[j] > 0.f) return j;
    before = after;
  }
  if (last >= 0) return last;
  for (int64_t j = b * kDrawBlock - 1; j >= 0; --j)  // the target passed with no weight left in its block
    if (weights[j] > 0.f) return j;
  return -1;
}

// logits (N, V) float32, temperature (N,) float32 > 0, u (N,) float32 in [0, 1) -> (N,) int64: each
// row's draw (draw_row), -1 where it has no token of positive weight. Rows on their own threads.
at::Tensor draw_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& u) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "draw_rows: logits (N, V) float32");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(temperature.dim() == 1 && temperature.size(0) == rows && temperature.scalar_type() == at::kFloat &&
              u.dim() == 1 && u.size(0) == rows && u.scalar_type() == at::kFloat,
              "draw_rows: temperature and u (N,) float32");
  auto in = logits.contiguous();
  auto tc = temperature.contiguous(), uc = u.contiguous();
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* xp = in.data_ptr<float>();
  const float* tp = tc.data_ptr<float>();
  const float* up = uc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights((n + 7) / 8 * 8), block_sums((n + kDrawBlock - 1) / kDrawBlock);
    for (int64_t r = begin; r < end; ++r) op[r] = draw_row(xp + r * n, n, tp[r], up[r], weights.data(), block_sums.data());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("draw_rows(Tensor logits, Tensor temperature, Tensor u) -> Tensor");
  m.def("softmax_rows(Tensor logits, bool log) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("softmax_rows", &softmax_rows);
  m.impl("draw_rows", &draw_rows);
}
