// Element-wise layers fused into one pass each, for CPUs. In eager PyTorch an RMSNorm is ~8 ops over the
// activations (upcast, square, mean, rsqrt, scale, downcast, weight) and SwiGLU's silu(gate) * up is 2 more,
// each a pass over memory with its own dispatch: a large share of a long prefill step. Rounding follows the
// PyTorch code they replace (transformers' Llama): normalize in float32, round to the input dtype, then
// multiply by the weight in that dtype; silu rounded before the product.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "vec8.h"

namespace {

using namespace pagedserve_vec;

template <typename scalar_t>
inline scalar_t round_to(float x) {
  return static_cast<scalar_t>(x);
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
// captures, which were reloaded at each vector.)
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

// x (any shape) -> 1 / (1 + e^-x) element by element, 8 at a time on exp8 (vec8.h), a last partial 8
// on the same lanes: an element's bits do not depend on where it falls. (torch's sigmoid runs
// whole vectors with Sleef's exp and a range's last few elements with libm's, and where a range
// ends moves with the tensor's size: a router's scores changed with the step's row count.)
at::Tensor sigmoid(const at::Tensor& x) {
  auto in = x.contiguous();
  auto out = at::empty_like(in);
  const int64_t n = in.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in.scalar_type(), "sigmoid", [&] {
    const scalar_t* ip = in.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, (n + 7) / 8, 2048, [&](int64_t begin, int64_t end) {
      for (int64_t v = begin; v < end; ++v) {
        const int64_t part = std::min<int64_t>(8, n - 8 * v);
        store_part(op + 8 * v, splat(1.f) / (splat(1.f) + exp8(-load_part(ip + 8 * v, part))), part);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("sigmoid(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("sigmoid", &sigmoid);
}
