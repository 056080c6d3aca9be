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

#include <cmath>

namespace {

template <typename scalar_t>
inline scalar_t round_to(float x) {
  return static_cast<scalar_t>(x);
}

// x (T, N), weight (N,): weight * round(x * rsqrt(mean(x^2) + eps)).
template <typename scalar_t>
void rms_norm_rows(const scalar_t* xp, const scalar_t* wp, scalar_t* op, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = xp + r * n;
      scalar_t* orow = op + r * n;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        const float v = static_cast<float>(xr[j]);
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const float normed = static_cast<float>(round_to<scalar_t>(static_cast<float>(xr[j]) * inv));
        orow[j] = round_to<scalar_t>(static_cast<float>(wp[j]) * normed);
      }
    }
  });
}

// gate_up (T, 2I) = [gate | up] -> (T, I): round(silu(gate)) * up.
template <typename scalar_t>
void silu_and_mul_rows(const scalar_t* ip, scalar_t* op, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = ip + r * 2 * inter;
      const scalar_t* u = g + inter;
      scalar_t* o = op + r * inter;
#pragma omp simd
      for (int64_t j = 0; j < inter; ++j) {
        const float x = static_cast<float>(g[j]);
        // exp clamped: the kernels are built with -ffast-math, which assumes no infinities.
        const float act = static_cast<float>(round_to<scalar_t>(x / (1.f + std::exp(std::fmin(-x, 88.f)))));
        o[j] = round_to<scalar_t>(act * static_cast<float>(u[j]));
      }
    }
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
}
