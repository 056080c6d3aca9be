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

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A 4-bit group's 16 bytes widened to 16 int16 lanes, byte j in lane j: its low nibble is
// value j, its high nibble value j + 16 (GGUF's order), so `and 0x0F` gives values 0..15 and
// `>> 4` values 16..31, in the order of the activations, with no shuffle across lanes.
inline __m256i widen_nibble_pairs(const uint8_t* row, int64_t g) {
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * (kBlock / 2))));
}
#endif

// ---- One group's integer dot product, per ISA ---------------------------------------------
//
// `Isa` is the one piece that differs between the builds (cpu_kernels.py builds a library per
// ISA level): how a weight group is widened to int16 (W), how 32 products are summed into
// int32 lanes and converted (dot), and the float lanes they accumulate in (F). Everything
// above it, the tiling, is one template.
//
//   acc (F)  +=  (float(int32 lanes of sum_j w[j] * x[j]) * activation scale) * weight scale
//   result   =   hsum(acc) + sum_g min[g] * xsum[g] + bias          (per output element)
//
// Every output element runs exactly this sequence, group by group in order, whatever tile
// it falls in, however many rows the step has and whichever thread computes it: the
// integer dot is exact, and no float sum is ever split. That is what makes a row's result
// independent of its neighbours and of the thread count.
#if defined(__AVX512F__) && defined(__AVX512BW__)
struct Isa {
  using F = __m512;
  using W = __m512i;  // 32 int16
  static constexpr int kTileRows = 4, kTileCols = 4, kWideCols = 4;  // 32 registers
  static F zero() { return _mm512_setzero_ps(); }
  template <int Bits>
  static W load(const uint8_t* row, int64_t g) {
    if constexpr (Bits == 4) {
      const __m256i h = widen_nibble_pairs(row, g);  // low nibbles | high nibbles, 16 int16 each
      return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(h, _mm256_set1_epi16(0x0F))),
                                _mm256_srli_epi16(h, 4), 1);
    }
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * kBlock)));
  }
  // |127 * 32767 * 2| per madd lane: far inside int32.
  using X = __m512i;
  static X load_x(const int16_t* x) { return _mm512_loadu_si512(x); }
  static F dot(const W& w, const X& x) { return _mm512_cvtepi32_ps(_mm512_madd_epi16(w, x)); }
  static F broadcast(float s) { return _mm512_set1_ps(s); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F acc) { return _mm512_fmadd_ps(a, b, acc); }
  static float sum(F v) {
    return hsum(_mm256_add_ps(_mm512_castps512_ps256(v),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
  }
};
#elif defined(__AVX2__)
struct Isa {
  using F = __m256;
  struct W { __m256i lo, hi; };  // 16 + 16 int16
  static constexpr int kTileRows = 3, kTileCols = 2, kWideCols = 2;  // 16 registers
  static F zero() { return _mm256_setzero_ps(); }
  template <int Bits>
  static W load(const uint8_t* row, int64_t g) {
    if constexpr (Bits == 4) {
      const __m256i h = widen_nibble_pairs(row, g);
      return {_mm256_and_si256(h, _mm256_set1_epi16(0x0F)), _mm256_srli_epi16(h, 4)};
    }
    const __m128i* q = reinterpret_cast<const __m128i*>(row + g * kBlock);
    return {_mm256_cvtepi8_epi16(_mm_loadu_si128(q)), _mm256_cvtepi8_epi16(_mm_loadu_si128(q + 1))};
  }
  using X = W;
  static X load_x(const int16_t* x) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16))};
  }
  static F dot(const W& w, const X& x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    const __m256i acc = _mm256_dpwssd_epi32(_mm256_madd_epi16(w.lo, x.lo), w.hi, x.hi);
#elif defined(__AVXVNNI__)
    const __m256i acc = _mm256_dpwssd_avx_epi32(_mm256_madd_epi16(w.lo, x.lo), w.hi, x.hi);
#else
    const __m256i acc = _mm256_add_epi32(_mm256_madd_epi16(w.lo, x.lo), _mm256_madd_epi16(w.hi, x.hi));
#endif
    return _mm256_cvtepi32_ps(acc);
  }
  static F broadcast(float s) { return _mm256_set1_ps(s); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F acc) { return _mm256_fmadd_ps(a, b, acc); }
  static float sum(F v) { return hsum(v); }
};
#else
struct Isa {
  using F = float;
  struct W { int16_t v[kBlock]; };
  static constexpr int kTileRows = 2, kTileCols = 2, kWideCols = 2;
  static F zero() { return 0.f; }
  template <int Bits>
  static W load(const uint8_t* row, int64_t g) {
    W w;
    for (int j = 0; j < kBlock; ++j) {
      if constexpr (Bits == 4) {
        const uint8_t byte = row[g * (kBlock / 2) + j % (kBlock / 2)];
        w.v[j] = j < kBlock / 2 ? (byte & 0x0F) : (byte >> 4);
      } else {
        w.v[j] = reinterpret_cast<const int8_t*>(row)[g * kBlock + j];
      }
    }
    return w;
  }
  using X = const int16_t*;
  static X load_x(const int16_t* x) { return x; }
  static F dot(const W& w, X x) {
    int32_t acc = 0;
    for (int j = 0; j < kBlock; ++j) acc += static_cast<int32_t>(w.v[j]) * x[j];
    return static_cast<float>(acc);
  }  static F broadcast(float s) { return s; }
  static F mul(F a, F b) { return a * b; }
  static F fma(F a, F b, F acc) { return std::fma(a, b, acc); }
  static float sum(F v) { return v; }
};
#endif

// What one product reads: the int16 activations, the weights, their factors.
template <typename S>
struct Operands {
  const int16_t* xq;     // (M, K)
  const float* xscale;   // (M, K/32)
  const float* xsum;     // (M, K/32): xscale * sum of the block's xq
  const uint8_t* w;      // (N, row_bytes)
  const S* scales;       // (N, K/group_size)
  const S* mins;         // like scales, or nullptr
  const float* bias;     // (N,) or nullptr
  float* out;            // (M, N)
  int64_t M, N, K, nb, row_bytes, groups_per_scale, scales_per_row;
};

// sum_g min[g / groups_per_scale] * xsum[g] (the asymmetric 4-bit term), in one fixed order:
// lane l of 8 takes groups l, l + 8, ...; then the lanes, then the last nb % 8 groups.
template <typename S>
float min_term(const S* mins, const float* xsum, int64_t nb, int64_t groups_per_scale) {
  int64_t g = 0;
  float acc = 0.f;
#if defined(__AVX2__)
  if (groups_per_scale == 1) {
    __m256 lanes = _mm256_setzero_ps();
    for (; g + 8 <= nb; g += 8) {
      __m256 m;
      if constexpr (std::is_same_v<S, float>) {
        m = _mm256_loadu_ps(mins + g);
      } else {
        m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + g)));
      }
      lanes = _mm256_fmadd_ps(m, _mm256_loadu_ps(xsum + g), lanes);
    }
    acc = hsum(lanes);
  }
#endif
  for (; g < nb; ++g) acc = std::fma(to_float(mins[g / groups_per_scale]), xsum[g], acc);
  return acc;
}

// Not inlined: the same instructions finish every element, whatever tile computed its sum.
template <typename S>
__attribute__((noinline)) float finish(float dot_sum, const Operands<S>& op, int64_t m, int64_t n) {
  float y = dot_sum;
  if (op.mins != nullptr) y += min_term(op.mins + n * op.scales_per_row, op.xsum + m * op.nb, op.nb,
                                        op.groups_per_scale);
  if (op.bias != nullptr) y += op.bias[n];
  return y;
}

// The micro-kernel: output rows m0 .. m0+RM, columns n0 .. n0+RN, over all of K. Each weight
// group is widened once for the RM rows, each activation block read once per column.
template <int Bits, int RM, int RN, typename S>
void tile(const Operands<S>& op, int64_t m0, int64_t n0) {
  typename Isa::F acc[RM][RN];
  for (int r = 0; r < RM; ++r)
    for (int c = 0; c < RN; ++c) acc[r][c] = Isa::zero();
  const uint8_t* rows[RN];
  for (int c = 0; c < RN; ++c) rows[c] = op.w + (n0 + c) * op.row_bytes;
  for (int64_t sg = 0, g = 0; sg < op.scales_per_row; ++sg) {  // a scale's groups (G / 32 blocks of 32)
    typename Isa::F ws[RN];
    for (int c = 0; c < RN; ++c) ws[c] = Isa::broadcast(to_float(op.scales[(n0 + c) * op.scales_per_row + sg]));
    for (const int64_t g_end = g + op.groups_per_scale; g < g_end; ++g) {
      typename Isa::W w[RN];
      for (int c = 0; c < RN; ++c) w[c] = Isa::template load<Bits>(rows[c], g);
      for (int r = 0; r < RM; ++r) {
        const typename Isa::X x = Isa::load_x(op.xq + (m0 + r) * op.K + g * kBlock);
        const typename Isa::F xs = Isa::broadcast(op.xscale[(m0 + r) * op.nb + g]);
        for (int c = 0; c < RN; ++c) acc[r][c] = Isa::fma(Isa::mul(Isa::dot(w[c], x), xs), ws[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < RM; ++r)
    for (int c = 0; c < RN; ++c) op.out[(m0 + r) * op.N + n0 + c] = finish(Isa::sum(acc[r][c]), op, m0 + r, n0 + c);
}

// tile<Bits, rm, rn> for run-time rm <= RM, rn <= RN (the edges of the output).
template <int Bits, int RM, int RN, typename S>
void tile_upto(const Operands<S>& op, int64_t m0, int64_t n0, int rm, int rn) {
  if constexpr (RM > 1) {
    if (rm < RM) return tile_upto<Bits, RM - 1, RN>(op, m0, n0, rm, rn);
  }
  if constexpr (RN > 1) {
    if (rn < RN) return tile_upto<Bits, RM, RN - 1>(op, m0, n0, rm, rn);
  }
  tile<Bits, RM, RN>(op, m0, n0);
}

// The block loop around the micro-kernel. Tasks are blocks of output columns x blocks of rows
// (a row block kept small enough to stay in L2, a column block's weights in L1/L2); a thread
// takes consecutive tasks, so it walks the row blocks under one column block, and reads
// that block's weights from memory once. Tiles: RM x RN, or 2 x kWideCols for steps of one or
// two rows (decodes), where there are no rows to reuse a weight group across.
//
//          n0 ->  [RN cols][RN cols] ...  (column block)
//   m0  [RM rows]  tile     tile
//    |  [RM rows]  tile     tile
//    v   ...                                 (row block)
template <int Bits, typename S>
void int_qlinear(const Operands<S>& op) {
  const int64_t x_row_bytes = op.K * 2;
  constexpr int64_t RM = Isa::kTileRows;
  const int64_t block_rows = std::clamp<int64_t>((256 << 10) / x_row_bytes / RM * RM, RM, 64 / RM * RM);
  const int64_t threads = at::get_num_threads();
  int64_t block_cols = std::clamp<int64_t>((64 << 10) / op.row_bytes / 8 * 8, 8, 64);
  const int64_t row_blocks = (op.M + block_rows - 1) / block_rows;
  // Enough column blocks for every thread to get several (one decode: all the parallelism).
  while (block_cols > 8 && row_blocks * ((op.N + block_cols - 1) / block_cols) < 4 * threads) block_cols /= 2;
  const int64_t col_blocks = (op.N + block_cols - 1) / block_cols;
  at::parallel_for(0, col_blocks * row_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n_begin = task / row_blocks * block_cols, n_end = std::min(op.N, n_begin + block_cols);
      const int64_t m_begin = task % row_blocks * block_rows, m_end = std::min(op.M, m_begin + block_rows);
      if (op.M <= 2) {
        for (int64_t n0 = n_begin; n0 < n_end; n0 += Isa::kWideCols)
          tile_upto<Bits, 2, Isa::kWideCols>(op, m_begin, n0, static_cast<int>(m_end - m_begin),
                                             static_cast<int>(std::min<int64_t>(Isa::kWideCols, n_end - n0)));
        continue;
      }
      for (int64_t n0 = n_begin; n0 < n_end; n0 += Isa::kTileCols) {
        const int rn = static_cast<int>(std::min<int64_t>(Isa::kTileCols, n_end - n0));
        for (int64_t m0 = m_begin; m0 < m_end; m0 += Isa::kTileRows)
          tile_upto<Bits, Isa::kTileRows, Isa::kTileCols>(
              op, m0, n0, static_cast<int>(std::min<int64_t>(Isa::kTileRows, m_end - m0)), rn);
      }
    }
  });
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
  with_scales(scales, mins, [&](auto* sc, auto* mn) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(sc)>>;
    const Operands<S> op{xq.data_ptr<int16_t>(), xscale.data_ptr<float>(), xsum.data_ptr<float>(), w, sc, mn,
                         bias_ptr, o, M, N, K, K / kBlock, bits == 4 ? K / 2 : K, group_size / kBlock,
                         K / group_size};
    if (bits == 4) int_qlinear<4>(op); else int_qlinear<8>(op);
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? bias, int bits, "
        "int group_size, bool quantize_input) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("quant_linear", &quant_linear);
}
