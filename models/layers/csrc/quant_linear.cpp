// Weight-only quantized linear layers: y = x W^T (+ bias) with W stored in 4 or 8 bits.
//
// Weights come in groups of 32 along K (a GGUF Q4_0/Q4_1/Q4_K/Q8_0 block, or what
// models/layers/quantization.py makes from a dense checkpoint), each with a float scale and,
// for asymmetric 4-bit, a float min:
//
//     w[n, k] = scale[n, k / G] * q[n, k] + min[n, k / G]      q in [0, 15] (4 bits)
//     w[n, k] = scale[n, k / G] * q[n, k]                      q in [-127, 127] (8 bits)
//
// with G a multiple of 32. 4-bit rows are packed as GGUF packs a block: byte j of a 32-wide
// group holds element j in its low nibble and element j + 16 in its high nibble.
//
// Two ways to multiply:
//
//   int16 activations (the default): each row of x is quantized per 32 values to int16 with
//   one float scale, so a group's inner product is an integer dot product,
//
//       sum_k w x~ = scale * xscale * sum_k q xq  +  min * xscale * sum_k xq
//
//   which AVX2 computes 16 products per instruction (madd: s16 x s16 -> s32 pairs, the
//   weights widened from 4/8 bits), AVX-VNNI / AVX512-VNNI with the accumulation fused
//   (dpwssd). llama.cpp rounds x to int8 instead (maddubs, 32 products an instruction); we
//   tried that, and SmolLM2's residual stream has outliers (|x| ~ 70 among values ~ 1) that
//   int8 blocks flatten: its greedy answer to "What is the capital of France?" stopped being
//   Paris. int16 steps are 256 times finer (relative error ~1.5e-5 of a block's max).
//   The min term uses the quantized x~ too, so the result is exactly the dequantized weight
//   times x~: w is centred, so its error sum_k w (x - x~) stays small, where the exact sum of
//   x would add the uncentred min * sum_k (x - x~).
//
//   float activations: each weight group is dequantized to floats and multiplied with x as it
//   is, equal to the PyTorch reference up to summation order (tests, and the exact mode).
//
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;  // values per quantization block of weights and activations

// Scales and mins are float32, or float16 where that holds them exactly (GGUF's Q4_0, Q4_1 and
// Q8_0 store fp16 factors): a sixth less to read per weight at one row, where reading is the cost.
inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) {
#if defined(__F16C__)
  return _cvtsh_ss(x.x);
#else
  return static_cast<float>(x);
#endif
}

// x (M, K) float -> xq (M, K) int16, xscale (M, K/32), xsum (M, K/32) = xscale * sum of xq.
void quantize_activations(const float* x, int64_t M, int64_t K, int16_t* xq, float* xscale, float* xsum) {
  const int64_t nb = K / kBlock;
  at::parallel_for(0, M * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* src = x + i * kBlock;  // block i of the flattened (M, K): rows are K apart, K % 32 == 0
      float amax = 0.f;
      for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(src[j]));
      const float d = amax / 32767.f;
      const float inv = d > 0.f ? 1.f / d : 0.f;
      int16_t* dst = xq + i * kBlock;
      int32_t sum = 0;
      for (int j = 0; j < kBlock; ++j) {
        dst[j] = static_cast<int16_t>(std::nearbyint(src[j] * inv));
        sum += dst[j];
      }
      xscale[i] = d;
      xsum[i] = d * static_cast<float>(sum);
    }
  });
}

#if defined(__AVX2__)
inline __m256i unpack_nibbles(const uint8_t* qs) {  // 16 bytes -> 32 values in [0, 15], GGUF order
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// A weight group (32 values, unsigned 4-bit or signed 8-bit, one per byte) widened to int16.
template <int Bits>
inline void widen_group(__m256i wq, __m256i w16[2]) {
  const __m128i lo = _mm256_castsi256_si128(wq), hi = _mm256_extracti128_si256(wq, 1);
  w16[0] = Bits == 4 ? _mm256_cvtepu8_epi16(lo) : _mm256_cvtepi8_epi16(lo);
  w16[1] = Bits == 4 ? _mm256_cvtepu8_epi16(hi) : _mm256_cvtepi8_epi16(hi);
}

// The widened group times 32 int16 activations: the 32 products summed into 8 int32 lanes, as float.
inline __m256 dot_group_s16(const __m256i w16[2], const int16_t* x) {
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  const __m256i acc = _mm256_dpwssd_epi32(_mm256_madd_epi16(w16[0], x0), w16[1], x1);
#elif defined(__AVXVNNI__)
  const __m256i acc = _mm256_dpwssd_avx_epi32(_mm256_madd_epi16(w16[0], x0), w16[1], x1);
#else
  // |127 * 32768 * 2| per madd lane, two of them: far inside int32.
  const __m256i acc = _mm256_add_epi32(_mm256_madd_epi16(w16[0], x0), _mm256_madd_epi16(w16[1], x1));
#endif
  return _mm256_cvtepi32_ps(acc);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// Integer dot product of weight group g of row `w` with one activation block.
template <int Bits>
inline int32_t group_dot(const uint8_t* w, int64_t g, const int16_t* xq) {
  int32_t acc = 0;
  if constexpr (Bits == 4) {
    const uint8_t* qs = w + g * (kBlock / 2);
    for (int j = 0; j < kBlock / 2; ++j) {
      acc += static_cast<int32_t>(qs[j] & 0x0F) * xq[j];
      acc += static_cast<int32_t>(qs[j] >> 4) * xq[j + kBlock / 2];
    }
  } else {
    const int8_t* qs = reinterpret_cast<const int8_t*>(w) + g * kBlock;
    for (int j = 0; j < kBlock; ++j) acc += static_cast<int32_t>(qs[j]) * xq[j];
  }
  return acc;
}

// Rows m0 .. m0+MB of the output for output column n. Each weight group is unpacked once
// and used for all MB activation rows.
template <int Bits, int MB, typename S>
inline void rows_of_column(
    const uint8_t* w, const S* scale, const S* min, int64_t groups_per_scale, int64_t nb,
    const int16_t* xq, const float* xscale, const float* xsum, int64_t m0, int64_t K, float* acc_out) {
#if defined(__AVX2__)
  __m256 acc[MB];
  for (int r = 0; r < MB; ++r) acc[r] = _mm256_setzero_ps();
#else
  float acc[MB] = {};
#endif
  float min_acc[MB] = {};
  for (int64_t g = 0; g < nb; ++g) {
    const float s = to_float(scale[g / groups_per_scale]);
#if defined(__AVX2__)
    __m256i w16[2];
    widen_group<Bits>(Bits == 4 ? unpack_nibbles(w + g * (kBlock / 2))
                                : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * kBlock)),
                      w16);
#endif
    for (int r = 0; r < MB; ++r) {
      const int64_t row = m0 + r;
      const int16_t* xb = xq + row * K + g * kBlock;
      const float xs = xscale[row * nb + g];
#if defined(__AVX2__)
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(s * xs), dot_group_s16(w16, xb), acc[r]);
#else
      acc[r] += s * xs * static_cast<float>(group_dot<Bits>(w, g, xb));
#endif
      if constexpr (Bits == 4) {
        if (min != nullptr) min_acc[r] += to_float(min[g / groups_per_scale]) * xsum[row * nb + g];
      }
    }
  }
  for (int r = 0; r < MB; ++r) {
#if defined(__AVX2__)
    acc_out[r] = hsum(acc[r]) + min_acc[r];
#else
    acc_out[r] = acc[r] + min_acc[r];
#endif
  }
}

#if defined(__AVX2__)
// Weight group g of row w as 32 floats (4 vectors): scale * q (+ min).
template <int Bits>
inline void dequantize_group(const uint8_t* w, int64_t g, float s, float mn, __m256 out[4]) {
  const __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(mn);
  __m256i q;
  if constexpr (Bits == 4) {
    q = unpack_nibbles(w + g * (kBlock / 2));
  } else {
    q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * kBlock));
  }
  const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
  for (int h = 0; h < 2; ++h) {
    for (int part = 0; part < 2; ++part) {
      const __m128i bytes = part == 0 ? halves[h] : _mm_srli_si128(halves[h], 8);
      const __m256i ints = Bits == 4 ? _mm256_cvtepu8_epi32(bytes) : _mm256_cvtepi8_epi32(bytes);
      out[h * 2 + part] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), vs, vm);
    }
  }
}
#endif

// The float-activation path: each weight group is dequantized to floats and multiplied
// with x as it is, for layers whose inputs an int8 rounding would hurt (the logits).
template <int Bits, int MB, typename S>
inline void float_rows_of_column(
    const uint8_t* w, const S* scale, const S* min, int64_t groups_per_scale, int64_t nb,
    const float* x, int64_t m0, int64_t K, float* acc_out) {
#if defined(__AVX2__)
  __m256 acc[MB];
  for (int r = 0; r < MB; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < nb; ++g) {
    __m256 wf[4];
    dequantize_group<Bits>(w, g, to_float(scale[g / groups_per_scale]),
                           min ? to_float(min[g / groups_per_scale]) : 0.f, wf);
    for (int r = 0; r < MB; ++r) {
      const float* xb = x + (m0 + r) * K + g * kBlock;
      for (int v = 0; v < 4; ++v) acc[r] = _mm256_fmadd_ps(wf[v], _mm256_loadu_ps(xb + 8 * v), acc[r]);
    }
  }
  for (int r = 0; r < MB; ++r) acc_out[r] = hsum(acc[r]);
#else
  for (int r = 0; r < MB; ++r) {
    const float* xr = x + (m0 + r) * K;
    float acc = 0.f;
    for (int64_t g = 0; g < nb; ++g) {
      const float s = to_float(scale[g / groups_per_scale]);
      const float mn = min ? to_float(min[g / groups_per_scale]) : 0.f;
      for (int j = 0; j < kBlock; ++j) {
        int q;
        if constexpr (Bits == 4) {
          const uint8_t byte = w[g * (kBlock / 2) + j % (kBlock / 2)];
          q = j < kBlock / 2 ? (byte & 0x0F) : (byte >> 4);
        } else {
          q = reinterpret_cast<const int8_t*>(w)[g * kBlock + j];
        }
        acc += (s * static_cast<float>(q) + mn) * xr[g * kBlock + j];
      }
    }
    acc_out[r] = acc;
  }
#endif
}

// The loop both paths share: output columns split across threads, each weight row walked once
// per block of up to 4 activation rows. rows(mb, w, s, mn, m0, acc) fills acc[0, mb) with
// rows m0 .. m0+mb of column n (mb a std::integral_constant, so each block size is compiled).
template <int Bits, typename S, typename Rows>
void for_each_column(int64_t M, int64_t N, int64_t K, int64_t group_size, const uint8_t* qweight, const S* scales,
                     const S* mins, const float* bias, float* out, Rows&& rows) {
  const int64_t scales_per_row = K / group_size;
  const int64_t row_bytes = Bits == 4 ? K / 2 : K;
  constexpr int MB = 4;
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(64, N / (4 * at::get_num_threads())));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    float acc[MB];
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* w = qweight + n * row_bytes;
      const S* s = scales + n * scales_per_row;
      const S* mn = mins != nullptr ? mins + n * scales_per_row : nullptr;
      const float b = bias != nullptr ? bias[n] : 0.f;
      int64_t m0 = 0;
      for (; m0 + MB <= M; m0 += MB) {
        rows(std::integral_constant<int, MB>{}, w, s, mn, m0, acc);
        for (int r = 0; r < MB; ++r) out[(m0 + r) * N + n] = acc[r] + b;
      }
      const int64_t rest = M - m0;  // 0-3 rows left: one more pass over the weights, not one per row
      if (rest == 3) rows(std::integral_constant<int, 3>{}, w, s, mn, m0, acc);
      if (rest == 2) rows(std::integral_constant<int, 2>{}, w, s, mn, m0, acc);
      if (rest == 1) rows(std::integral_constant<int, 1>{}, w, s, mn, m0, acc);
      for (int64_t r = 0; r < rest; ++r) out[(m0 + r) * N + n] = acc[r] + b;
    }
  });
}

template <int Bits, typename S>
void float_qlinear_impl(
    const float* x, int64_t M, int64_t K, const uint8_t* qweight, const S* scales, const S* mins,
    int64_t N, int64_t group_size, const float* bias, float* out) {
  const int64_t nb = K / kBlock, groups_per_scale = group_size / kBlock;
  for_each_column<Bits>(M, N, K, group_size, qweight, scales, mins, bias, out,
                        [&](auto mb, const uint8_t* w, const S* s, const S* mn, int64_t m0, float* acc) {
                          float_rows_of_column<Bits, decltype(mb)::value, S>(w, s, mn, groups_per_scale, nb, x,
                                                                             m0, K, acc);
                        });
}

template <int Bits, typename S>
void qlinear_impl(
    const int16_t* xq, const float* xscale, const float* xsum, int64_t M, int64_t K,
    const uint8_t* qweight, const S* scales, const S* mins, int64_t N, int64_t group_size,
    const float* bias, float* out) {
  const int64_t nb = K / kBlock, groups_per_scale = group_size / kBlock;
  for_each_column<Bits>(M, N, K, group_size, qweight, scales, mins, bias, out,
                        [&](auto mb, const uint8_t* w, const S* s, const S* mn, int64_t m0, float* acc) {
                          rows_of_column<Bits, decltype(mb)::value, S>(w, s, mn, groups_per_scale, nb, xq, xscale,
                                                                       xsum, m0, K, acc);
                        });
}

void check_scales(const at::Tensor& scales, const std::optional<at::Tensor>& mins, int64_t N, int64_t K,
                  int64_t group_size, int64_t bits) {
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / group_size && scales.is_contiguous() &&
              (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf),
              "quantized weight: scales must be float32 or float16 (N, K/group_size)");
  if (mins.has_value()) {
    TORCH_CHECK(bits == 4 && mins->sizes() == scales.sizes() && mins->scalar_type() == scales.scalar_type() &&
                mins->is_contiguous(), "quantized weight: mins must be like scales (4 bits only)");
  }
}

// fn(scales pointer, mins pointer or nullptr), typed float or c10::Half as the scales are.
template <typename Fn>
void with_scales(const at::Tensor& scales, const std::optional<at::Tensor>& mins, Fn&& fn) {
  if (scales.scalar_type() == at::kHalf) {
    fn(scales.data_ptr<c10::Half>(), mins.has_value() ? mins->data_ptr<c10::Half>() : nullptr);
  } else {
    fn(scales.data_ptr<float>(), mins.has_value() ? mins->data_ptr<float>() : nullptr);
  }
}

// x (M, K) float32 or bfloat16; qweight (N, K/2) uint8 (4 bits) or (N, K) int8 (8 bits);
// scales, mins (N, K/group_size) float32 or float16 (mins only for asymmetric 4 bits); bias (N,)
// -> (M, N) in x's dtype. quantize_input: int16 activations and integer dot products (fast),
// else float FMAs on x as it is.
at::Tensor quant_linear(
    const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
    const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias, int64_t bits,
    int64_t group_size, bool quantize_input) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8");
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && scales.dim() == 2, "quant_linear: 2-D tensors expected");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(K % kBlock == 0 && group_size % kBlock == 0 && K % group_size == 0,
              "quant_linear: K and group_size must be multiples of 32, K of group_size");
  TORCH_CHECK(qweight.size(1) == (bits == 4 ? K / 2 : K), "quant_linear: qweight's columns do not match x's K");
  check_scales(scales, mins, N, K, group_size, bits);
  TORCH_CHECK(qweight.is_contiguous(), "quant_linear: contiguous weights expected");
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* bias_ptr = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  const auto* w = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  if (!quantize_input) {
    with_scales(scales, mins, [&](auto* sc, auto* mn) {
      if (bits == 4) {
        float_qlinear_impl<4>(xf.data_ptr<float>(), M, K, w, sc, mn, N, group_size, bias_ptr, o);
      } else {
        float_qlinear_impl<8>(xf.data_ptr<float>(), M, K, w, sc, mn, N, group_size, bias_ptr, o);
      }
    });
    return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
  }
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kShort));
  at::Tensor xscale = at::empty({M, K / kBlock}, x.options().dtype(at::kFloat));
  at::Tensor xsum = at::empty({M, K / kBlock}, x.options().dtype(at::kFloat));
  quantize_activations(xf.data_ptr<float>(), M, K, xq.data_ptr<int16_t>(), xscale.data_ptr<float>(),
                       xsum.data_ptr<float>());
  const int16_t* q = xq.data_ptr<int16_t>();
  with_scales(scales, mins, [&](auto* sc, auto* mn) {
    if (bits == 4) {
      qlinear_impl<4>(q, xscale.data_ptr<float>(), xsum.data_ptr<float>(), M, K, w, sc, mn, N, group_size, bias_ptr, o);
    } else {
      qlinear_impl<8>(q, xscale.data_ptr<float>(), xsum.data_ptr<float>(), M, K, w, sc, mn, N, group_size, bias_ptr, o);
    }
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// qweight, scales, mins as above -> the float32 weight (N, K): for steps of many rows, where
// one dequantization plus a dense GEMM beats the row-by-row kernel.
at::Tensor dequantize_weight(
    const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& mins, int64_t bits,
    int64_t group_size) {
  TORCH_CHECK(bits == 4 || bits == 8, "dequantize_weight: bits must be 4 or 8");
  const int64_t N = qweight.size(0), K = bits == 4 ? qweight.size(1) * 2 : qweight.size(1);
  TORCH_CHECK(K % kBlock == 0 && group_size % kBlock == 0 && K % group_size == 0 && qweight.is_contiguous(),
              "dequantize_weight: bad shapes");
  check_scales(scales, mins, N, K, group_size, bits);
  at::Tensor out = at::empty({N, K}, scales.options().dtype(at::kFloat));
  const auto* w = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  float* dst = out.data_ptr<float>();
  const int64_t nb = K / kBlock, groups_per_scale = group_size / kBlock, scales_per_row = K / group_size;
  const int64_t row_bytes = bits == 4 ? K / 2 : K;
  with_scales(scales, mins, [&](auto* sc, auto* mins_ptr) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = w + n * row_bytes;
      for (int64_t g = 0; g < nb; ++g) {
        const float s = to_float(sc[n * scales_per_row + g / groups_per_scale]);
        const float mn = mins_ptr ? to_float(mins_ptr[n * scales_per_row + g / groups_per_scale]) : 0.f;
        float* o = dst + n * K + g * kBlock;
#if defined(__AVX2__)
        __m256 v[4];
        if (bits == 4) dequantize_group<4>(wr, g, s, mn, v); else dequantize_group<8>(wr, g, s, mn, v);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(o + 8 * i, v[i]);
#else
        for (int j = 0; j < kBlock; ++j) {
          int q;
          if (bits == 4) {
            const uint8_t byte = wr[g * (kBlock / 2) + j % (kBlock / 2)];
            q = j < kBlock / 2 ? (byte & 0x0F) : (byte >> 4);
          } else {
            q = reinterpret_cast<const int8_t*>(wr)[g * kBlock + j];
          }
          o[j] = s * static_cast<float>(q) + mn;
        }
#endif
      }
    }
  });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("dequantize_weight(Tensor qweight, Tensor scales, Tensor? mins, int bits, int group_size) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? bias, int bits, "
        "int group_size, bool quantize_input) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("dequantize_weight", &dequantize_weight);
}
