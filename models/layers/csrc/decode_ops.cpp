// The small per-layer ops of a decode step, one pass each. At one token a step's arithmetic
// is a few microseconds per op, so their dispatch is the cost: RoPE in eager PyTorch is ~8
// ops (slice, mul, roll, mul, add, ...) and writing K/V into the paged cache 4 (stack,
// transpose, cast, index_copy): a good part of a decode layer's time.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

// x (T, H, D) float32, any strides with unit stride along D; cos, signed_sin (T, D) float32
// -> (T, H, D): x * cos + roll(x, D/2) * signed_sin, RotaryEmbedding.rotate's formula.
at::Tensor rope_neox(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1, "rope_neox: x (T, H, D) float32");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos.sizes() == signed_sin.sizes() && cos.size(0) == T && cos.size(-1) == D &&
              cos.scalar_type() == at::kFloat && signed_sin.scalar_type() == at::kFloat,
              "rope_neox: cos and signed_sin (T, D) float32");
  const at::Tensor c = cos.reshape({T, D}).contiguous(), s = signed_sin.reshape({T, D}).contiguous();
  at::Tensor out = at::empty({T, H, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  at::parallel_for(0, T * H, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / H, h = i % H;
      const float* xr = xp + t * st + h * sh;
      const float* cr = cp + t * D;
      const float* sr = sp + t * D;
      float* o = op + i * D;
      for (int64_t d = 0; d < half; ++d) o[d] = xr[d] * cr[d] + xr[d + half] * sr[d];
      for (int64_t d = half; d < D; ++d) o[d] = xr[d] * cr[d] + xr[d - half] * sr[d];
    }
  });
  return out;
}

// kv_cache (num_blocks, block_size, 2, Hk, D) used block-major as (num_blocks, 2, Hk, block_size, D)
// (see attention.py); k, v (T, Hk, D), any strides with unit stride along D; slot_mapping (T,)
// int64. Writes token t's keys and values at slot slot_mapping[t] (block slot / block_size, offset
// slot % block_size), cast to the cache's dtype; an int8 cache's rows of W = D + 2 bytes get each
// row quantized as attention.py's quantize_rows does (the same float32 operations: the same bytes):
// the float16 scale absmax / 127 after the numbers, each number round(x / scale) against that scale.
void write_kv_int8(at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v, const int64_t* sp, int64_t T) {
  const int64_t Hk = kv_cache.size(3), W = kv_cache.size(4), D = W - 2, block_size = kv_cache.size(1);
  const int64_t run = block_size * W;
  int8_t* cache = kv_cache.data_ptr<int8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_int8", [&] {
    const scalar_t* src[2] = {k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>()};
    const int64_t st[2] = {k.stride(0), v.stride(0)}, sh[2] = {k.stride(1), v.stride(1)};
    at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        int8_t* block = cache + sp[t] / block_size * 2 * Hk * run + sp[t] % block_size * W;
        for (int64_t p = 0; p < 2; ++p) {
          for (int64_t h = 0; h < Hk; ++h) {
            const scalar_t* from = src[p] + t * st[p] + h * sh[p];
            int8_t* to = block + (p * Hk + h) * run;
            float amax = 0.f;
            for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(static_cast<float>(from[d])));
            volatile float divisor = 127.f;  // amax / 127 as Python divides, not times a rounded 1 / 127
            const c10::Half scale(std::min(amax / divisor, 65504.f));  // to nearest even, as Tensor.half()
            const float wide = static_cast<float>(scale);
            const float inv = wide > 0.f ? 1.f / wide : 0.f;
            for (int64_t d = 0; d < D; ++d) {
              const float x = std::nearbyint(static_cast<float>(from[d]) * inv);  // to nearest even, as torch.round
              to[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, x)));
            }
            std::memcpy(to + D, &scale, sizeof(scale));
          }
        }
      }
    });
  });
}

void write_kv_blocks(at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(2) == 2 && kv_cache.is_contiguous(), "write_kv_blocks: bad cache");
  const bool int8 = kv_cache.scalar_type() == at::kChar;
  const int64_t T = k.size(0), Hk = kv_cache.size(3), D = kv_cache.size(4) - (int8 ? 2 : 0);
  const int64_t block_size = kv_cache.size(1), slots = kv_cache.size(0) * block_size, run = block_size * D;
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == Hk && k.size(2) == D && k.stride(2) == 1 &&
              v.stride(2) == 1 && k.scalar_type() == v.scalar_type(), "write_kv_blocks: k, v (T, Hk, D)");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T, "write_kv_blocks: slots");
  const at::Tensor slot = slot_mapping.contiguous();
  const int64_t* sp = slot.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < slots, "write_kv_blocks: slot out of range");
  if (int8) return write_kv_int8(kv_cache, k, v, sp, T);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_cache.scalar_type(), "write_kv_blocks", [&] {
    using cache_t = scalar_t;
    cache_t* cache = kv_cache.data_ptr<cache_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_blocks_src", [&] {
      const scalar_t* src[2] = {k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>()};
      const int64_t st[2] = {k.stride(0), v.stride(0)}, sh[2] = {k.stride(1), v.stride(1)};
      at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          cache_t* block = cache + sp[t] / block_size * 2 * Hk * run + sp[t] % block_size * D;
          for (int64_t p = 0; p < 2; ++p) {
            for (int64_t h = 0; h < Hk; ++h) {
              const scalar_t* from = src[p] + t * st[p] + h * sh[p];
              cache_t* to = block + (p * Hk + h) * run;
              int64_t d = 0;
#if defined(__F16C__)
              // float32 -> float16 eight at a time, rounded to nearest even as c10::Half's is
              // (one at a time in software, the conversion showed in a decode layer's time).
              if constexpr (std::is_same_v<scalar_t, float> && std::is_same_v<cache_t, c10::Half>) {
                for (; d + 8 <= D; d += 8) {
                  const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(reinterpret_cast<const float*>(from) + d), _MM_FROUND_TO_NEAREST_INT);
                  _mm_storeu_si128(reinterpret_cast<__m128i*>(to + d), h);
                }
              }
#endif
              for (; d < D; ++d) to[d] = static_cast<cache_t>(static_cast<float>(from[d]));
            }
          }
        }
      });
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("rope_neox(Tensor x, Tensor cos, Tensor signed_sin) -> Tensor");
  m.def("write_kv_blocks(Tensor(a!) kv_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("rope_neox", &rope_neox);
  m.impl("write_kv_blocks", &write_kv_blocks);
}
