// Decode attention straight out of the paged KV cache, for CPUs.
//
// One query token per sequence. The eager path gathers every sequence's cached keys and
// values into a padded copy and runs two batched matmuls over it: at 64 sequences that
// copy and the re-reading of it took ~40% of a decode step. Here each (sequence, KV head)
// is one task that reads its keys and values where they lie, once, for all the query
// heads of its group, in float32:
//
//   kv_cache   (num_blocks, block_size, 2, Hk, D) allocated, laid out plane-major as
//              (2, Hk, num_blocks, block_size, D): plane (k|v, head), see attention.py
//   token t of sequence i   block_table[i][t / block_size], offset t % block_size
//
// Built at run time by models/layers/cpu_kernels.py; the eager path is the reference.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

// Widen one element to float; the bf16 case as a shift, which compilers vectorize, and fp16
// through F16C where the build has it.
inline float widen(float x) { return x; }
inline float widen(c10::Half x) { return static_cast<float>(x); }
inline float widen(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// One cache row as floats: the row itself for a float cache; else widened into `buf` (for fp16
// eight at a time with F16C, which the compiler does not do from c10::Half on its own).
template <typename cache_t>
inline const float* row_as_float(const cache_t* row, int64_t D, float* buf) {
  if constexpr (std::is_same_v<cache_t, float>) {
    return row;
  } else {
    int64_t d = 0;
#if defined(__F16C__)
    if constexpr (std::is_same_v<cache_t, c10::Half>) {
      for (; d + 8 <= D; d += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d));
        _mm256_storeu_ps(buf + d, _mm256_cvtph_ps(h));
      }
    }
#endif
    for (; d < D; ++d) buf[d] = widen(row[d]);
    return buf;
  }
}

// Calls fn(t, row) for the tokens t = 0 .. len-1 of one sequence, `row` pointing at token t's
// entry in `plane`: block by block along the block table, with no division per token.
template <typename scalar_t, typename Fn>
inline void for_each_token(const scalar_t* plane, const int64_t* table, int64_t len, int64_t block_size,
                           int64_t D, Fn&& fn) {
  for (int64_t b = 0, t = 0; t < len; ++b) {
    const scalar_t* block = plane + table[b] * block_size * D;
    const int64_t stop = std::min(block_size, len - t);
    for (int64_t o = 0; o < stop; ++o, ++t) fn(t, block + o * D);
  }
}

// kD > 0: the head dim as a compile-time constant (fully unrolled inner loops); 0: runtime `D`.
// scalar_t: q's and the output's dtype; cache_t: the cache's (the same, or 16-bit under float32 q).
template <typename scalar_t, typename cache_t, int64_t kD>
void decode(const scalar_t* q, const cache_t* cache, const int64_t* tables, const int64_t* lens, scalar_t* out,
            int64_t n, int64_t H, int64_t Hk, int64_t head_dim, int64_t num_blocks, int64_t block_size,
            int64_t table_stride, float scale) {
  const int64_t D = kD > 0 ? kD : head_dim;
  const int64_t G = H / Hk;  // query heads per KV head
  const int64_t plane = num_blocks * block_size * D;
  int64_t total_len = 0;
  for (int64_t i = 0; i < n; ++i) total_len += lens[i];
  // A few thousand cached rows take microseconds: waking the thread team would cost more.
  const int64_t grain = total_len * Hk < 8192 ? n * Hk : 1;
  at::parallel_for(0, n * Hk, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores, row_buf(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / Hk, h = task % Hk, len = lens[i];
      const int64_t* table = tables + i * table_stride;
      const cache_t* kplane = cache + h * plane;
      const cache_t* vplane = cache + (Hk + h) * plane;
      const scalar_t* qi = q + (i * H + h * G) * D;
      for (int64_t j = 0; j < G * D; ++j) qf[j] = widen(qi[j]) * scale;
      scores.resize(G * len);
      // scores[g][t] = q_g . k_t, block by block: each key row is read once for all G heads.
      for_each_token(kplane, table, len, block_size, D, [&](int64_t t, const cache_t* k_row) {
        const float* k = row_as_float(k_row, D, row_buf.data());
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * k[d];
          scores[g * len + t] = s;
        }
      });
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * len;
        const float m = *std::max_element(sg, sg + len);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) sum += (sg[t] = std::exp(sg[t] - m));
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_token(vplane, table, len, block_size, D, [&](int64_t t, const cache_t* v_row) {
        const float* v = row_as_float(v_row, D, row_buf.data());
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * v[d];
        }
      });
      scalar_t* oi = out + (i * H + h * G) * D;
      for (int64_t j = 0; j < G * D; ++j) oi[j] = static_cast<scalar_t>(acc[j]);
    }
  });
}

template <typename scalar_t, typename cache_t>
void dispatch_head_dim(const at::Tensor& q, const at::Tensor& kv_cache, const int64_t* table_ptr, const int64_t* len_ptr,
                       at::Tensor& out, int64_t table_stride, double scale) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = kv_cache.size(0), block_size = kv_cache.size(1), Hk = kv_cache.size(3);
  auto run = [&](auto kernel) {
    kernel(q.data_ptr<scalar_t>(), kv_cache.data_ptr<cache_t>(), table_ptr, len_ptr, out.data_ptr<scalar_t>(), n, H,
           Hk, D, num_blocks, block_size, table_stride, static_cast<float>(scale));
  };
  if (D == 64) {
    run(decode<scalar_t, cache_t, 64>);
  } else if (D == 128) {
    run(decode<scalar_t, cache_t, 128>);
  } else {
    run(decode<scalar_t, cache_t, 0>);
  }
}

// q (n, H, D); kv_cache (num_blocks, block_size, 2, Hk, D) in q's dtype, or float16/bfloat16 under
// float32 q; block_table (n, >= blocks used) int64; seq_lens (n,) int64, each >= 1.
// Returns (n, H, D) in q's dtype.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                  const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(2) == 2, "bad q / kv_cache shapes");
  const bool mixed = q.scalar_type() == at::kFloat &&
                     (kv_cache.scalar_type() == at::kHalf || kv_cache.scalar_type() == at::kBFloat16);
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() || mixed,
              "kv_cache must have q's dtype, or be float16/bfloat16 under float32 q");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == q.size(0) && seq_lens.numel() == q.size(0),
              "one block table row and one length per query");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = kv_cache.size(0), block_size = kv_cache.size(1), Hk = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && H % Hk == 0, "head dims / GQA group do not match the cache");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  auto qc = q.contiguous();
  auto tables = block_table.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {  // a bad index would read outside the cache: check them all
    TORCH_CHECK(len_ptr[i] >= 1 && len_ptr[i] <= tables.size(1) * block_size, "sequence length out of range");
    for (int64_t b = 0; b < (len_ptr[i] + block_size - 1) / block_size; ++b) {
      const int64_t block = table_ptr[i * tables.size(1) + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id out of range");
    }
  }
  auto out = at::empty_like(qc);
  if (mixed && kv_cache.scalar_type() == at::kHalf) {
    dispatch_head_dim<float, c10::Half>(qc, kv_cache, table_ptr, len_ptr, out, tables.size(1), scale);
  } else if (mixed) {
    dispatch_head_dim<float, c10::BFloat16>(qc, kv_cache, table_ptr, len_ptr, out, tables.size(1), scale);
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
      dispatch_head_dim<scalar_t, scalar_t>(qc, kv_cache, table_ptr, len_ptr, out, tables.size(1), scale);
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pagedserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
