// Weight-only quantized linear layers: y = x W^T (+ bias) with W stored in 4, 5, 6 or 8 bits.
//
// Weights come in groups of 32 along K (a GGUF Q2_K/Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q5_K/Q6_K/Q8_0/IQ4_NL/IQ4_XS block, or
// what models/layers/quantization.py makes from a dense checkpoint), each with a float scale
// and, for asymmetric 4 and 5 bits, a float min:
//
//     w[n, k] = scale[n, k / G] * q[n, k] + min[n, k / G]      q in [0, 15] (4 bits), [0, 31] (5 bits)
//     w[n, k] = scale[n, k / G] * q[n, k]                      q in [-127, 127] (8 bits)
//     w[n, k] = scale[n, k / G] * sc[n, k / 16] * (q[n, k] - 32)   q in [0, 63] (6 bits, Q6_K: the
//               scale its fp16 d per 256, sc an int8 sub-scale per 16 stored in the group's bytes)
//
// with G a multiple of 32, or with Q4_K's and Q5_K's factors as stored (4 and 5 bits with sub-scales, below):
//
//     w[n, k] = scale[n, k / G] * sc[n, k / 32] * q[n, k] + min[n, k / G] * mn[n, k / 32]
//               (scale its fp16 d, min its fp16 -dmin, G = 256; sc, mn uint8 in the group's bytes)
//
// or Q2_K's, per 16 (2 bits with sub-scales, q in [0, 3], sc and mn 4 bits: below):
//
//     w[n, k] = scale[n, k / G] * sc[n, k / 16] * q[n, k] + min[n, k / G] * mn[n, k / 16]
//
// Activations are rounded to int16 per 32 values with one float scale, so a group's inner
// product is an integer dot product:
//
//     sum_k w x~ = scale * xscale * sum_k q xq  +  min * xscale * sum_k xq
//
// AVX2 computes it 16 products an instruction (madd: s16 x s16 -> s32 pairs, the weights
// widened from 4/8 bits), AVX-VNNI / AVX512-VNNI with the accumulation fused (dpwssd).
// llama.cpp rounds x to int8 instead (maddubs, 32 products an instruction); we tried that,
// and SmolLM2's residual stream has outliers (|x| ~ 70 among values ~ 1) that int8 blocks
// flatten: its greedy answer to "What is the capital of France?" stopped being Paris. int16
// steps are 256 times finer (relative error ~1.5e-5 of a block's max). The min term uses the
// quantized x~ too, so the result is exactly the dequantized weight times x~.
//
// Weights in panels. quantization.py's `to_panels` reorders a layer's weights once, after
// loading, so that a vector's 8 lanes are 8 output columns (a panel) rather than 8 partial
// sums of one column: the per-group float work (convert, scale, accumulate) then serves 8
// outputs an instruction, no output needs a horizontal sum, and a panel's weights, scales
// and mins are each one contiguous stream. Within a panel, group g is one block of 16-byte
// chunks; lane i of chunk c holds column i's pair of values (k, k + 1):
//
//     8 bits, chunk p = 0..15:  int8 q[i, 2p], q[i, 2p + 1] for i = 0..7      (k = 2p)
//     4 bits, chunk c = 0..7:   bytes q[i, 2c + t] | q[i, 16 + 2c + t] << 4    (t = 0, 1)
//
// so one chunk widened to 16 int16 (`pmovzxbw`, then `and 0x0F` / `>> 4` for 4 bits) is the
// 8 columns' pair, which `madd` multiplies by the row's pair x[k], x[k + 1] broadcast to
// every lane. A 4-bit chunk is the GGUF group's byte pair (2c, 2c + 1) of each column: the
// reorder moves 2-byte units, nothing else (`to_panels`, `panel_rows`).
//
// 5 bits (Q5_0, Q5_1, Q5_K: q = nibble | bit << 4) are the 4-bit group's 8 chunks (the nibbles),
// then its 32 high bits a column in two 16-byte chunks h = 0, 1, lane for lane like the 4-bit
// chunks: byte 2i + t of chunk h holds, for the 4-bit chunks c = 4h + j (j = 0..3), the high bit
// of q[i, 2c + t] at bit j and that of q[i, 16 + 2c + t] at bit 4 + j. A group is 160 contiguous
// bytes (5 bits a weight). Widened once for 4 chunks, a high chunk gives each 4-bit chunk's
// values their bit 4 by a shift, an `and 0x10` and an `or`, one shift on to the next chunk; then
// the same madds as 4 bits, on values 0..31. `tile` runs them on every build (plain C++, AVX2,
// AVX-512), and AVX-512 VNNI builds on the wide tiles as well (below); AVX2's assembly is 4 bits only.
//
// 6 bits (Q6_K: q = nibble | two bits << 4, w = d sc (q - 32)) are the 4-bit group's 8 chunks, then
// its 64 high bits a column in four 16-byte chunks h = 0..3, then its int8 sub-scales (16 bytes:
// sc of values 0..15 for columns 0..7, then of values 16..31). Byte 2i + t of high chunk h holds,
// for the 4-bit chunks c = 2h + j (j = 0, 1), bits 4 and 5 of q[i, 2c + t] at bits 2j, 2j + 1 and
// those of q[i, 16 + 2c + t] at bits 4 + 2j, 4 + 2j + 1. A group is 208 contiguous bytes, and with
// d (fp16, per 256) 6.5625 bits a weight, Q6_K's own size. A 4-bit chunk's low nibbles are values
// 0..15 of the group and its high nibbles values 16..31: the two sub-blocks of 16, each with its sc,
// so each gets an integer sum of its own and the float step takes two:
//
//     acc = fma(float(sum over values 0..15) * xscale, d * sc0, acc)
//     acc = fma(float(sum over values 16..31) * xscale, d * sc1, acc)
//
// |a sum| <= 16 * 32 * 32767 = 16,776,704 < 2^24: exact in int32 and in float32. d * sc is exact
// too (11 by 8 significant bits). One sum for the 32 values with sc inside it would not fit:
// 32 * 32 * 128 * 32767 > 2^31. The wide tiles (AVX-512 VNNI) run the same two sums and float steps;
// with more than two rows, one sub-block after the other (wide_group6).
//
// 4 bits with sub-scales (Q4_K: w = d sc q - dmin mn) are the 4-bit group's 8 chunks, then the 8 columns'
// uint8 sc (8 bytes), then their mn (8 bytes): 144 bytes a group, with d and -dmin (fp16, per 256) 4.625
// bits a weight, where multiplied-out float32 factors made 6. The integer sums are 4 bits', and the float
// step makes the factors first, scale = d * float(sc) and min = (-dmin) * float(mn), both exact (11 by 6
// significant bits): the float32 numbers the multiplied-out form stores, so the same arithmetic and bits.
// 5 bits with sub-scales (Q5_K) are the same: the 5-bit group's 160 bytes, then the sc and mn (176 bytes a
// group, with d and -dmin 5.625 bits a weight where the float32 factors made 7), 5 bits' integer sums and the
// same float step.
//
// 2 bits with sub-scales (Q2_K: w = d sc q - dmin mn per 16 values) are 4 chunks of 16 bytes, lane for lane
// like the 4-bit ones: byte 2i + t of chunk c holds column i's values 2c + t, 8 + 2c + t, 16 + 2c + t and
// 24 + 2c + t at bits 0, 2, 4 and 6 (so a chunk widened once gives 4 pairs of values by shifts and masks),
// then the 8 columns' scale bytes of values 0..15 and those of values 16..31 (sc | mn << 4, the file's own):
// 80 bytes a group, with d and -dmin (fp16, per 256) 2.625 bits a weight, Q2_K's size. As 6 bits, two
// integer sums a group (values 0..15 and 16..31), each scaled by d * sc (exact: 11 by 4 significant bits);
// the min term takes each 16 activations' integer sum s (`Operands::xsum16`, |s| <= 16 * 32767):
//
//     acc = fma(float(mn0 * s0 + mn1 * s1) * xscale, -dmin, acc)      (the sum exact: < 2^24)
//
// a few ulps from the dequantized weight times x~ (the float32 w = d sc q - dmin mn rounds once per weight),
// each row's bits its own still. `tile` runs it on every build, and AVX-512 VNNI's wide tiles (wide_group2);
// AVX2's assembly is 4 bits only.
//
// 4 bits through a table (IQ4_NL, IQ4_XS: w = scale * kIQ4Values[q], a fixed non-linear int8 codebook) are
// the 4-bit group's 8 chunks as they are; widening maps each nibble through the 16-entry table (a byte
// shuffle, then the sign extension) to int8 values, and the rest is 8 bits' arithmetic: symmetric, no min,
// |a group's sum| <= 32 * 127 * 32767 < 2^31. IQ4_NL's scale is its fp16 d per 32 (128 bytes a group, 4.5
// bits a weight, the file's own); IQ4_XS's is its fp16 d per 256 times the group's signed sub-scale ls - 32,
// an int8 behind the chunks (8 bytes: the 8 columns'; 136 bytes a group, with d 4.3125 bits a weight for the
// file's 4.25), made d * float(ls - 32) in the float step, exact (11 by 5 significant bits).
//
// Determinism: every output element runs the same instruction sequence, group by group in
// order, whatever tile it falls in, however many rows the step has and whichever thread
// computes it: the integer dot is exact, and no float sum is ever split. A row's result
// depends on that row alone.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "vec8.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;  // values per quantization block of weights and activations
constexpr int kLanes = 8;       // output columns per panel
constexpr int kPrefetchGroups = 24;  // how far ahead a tile's stream is prefetched
constexpr int kBalancedPanels = 24;  // a one-row-block step's panels per task, about
// IQ4_NL's and IQ4_XS's codebook (ggml's kvalues_iq4nl): 4-bit index -> int8 value.
alignas(16) constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// f(0) .. f(n - 1) on the thread team, each task claimed by whichever thread is free next, in order: a thread
// held up (the event loop shares its core) or given the larger share no longer keeps the other idle for the
// rest of the split (it halved the engine thread's waits in the barrier). A task's result never depends on
// which thread runs it, so the split changes no bit.
template <typename F>
void parallel_tasks(int64_t n, const F& f) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t task; (task = next.fetch_add(1, std::memory_order_relaxed)) < n;) f(task);
  });
}

// f(0) .. f(n - 1) on the thread team, thread t owning the tasks [t n / T, (t + 1) n / T) and taking
// them front to back, one at a time; a thread out of its own takes the last task left of the range
// with the most left. For the steps of one row block (decodes), whose tasks are runs of panels:
// a thread's tasks follow each other in memory, so the prefetch of one's last tile runs into the
// next one's first (claimed in one shared order, the two threads' tasks interleave and each began
// at a cold stream), and a thread held up still has its share taken.
template <typename F>
void parallel_ranges(int64_t n, const F& f) {
  const int64_t T = std::min<int64_t>(n, at::get_num_threads());
  if (T <= 1) {
    for (int64_t task = 0; task < n; ++task) f(task);
    return;
  }
  struct alignas(64) Range { std::atomic<uint64_t> span; };  // front << 32 | end
  std::vector<Range> ranges(T);
  for (int64_t t = 0; t < T; ++t) ranges[t].span.store(static_cast<uint64_t>(t * n / T) << 32 | static_cast<uint64_t>((t + 1) * n / T));
  // The front task (or, from another thread, the last) of range r, or -1 where none is left.
  const auto take = [&](int64_t r, bool front) -> int64_t {
    uint64_t span = ranges[r].span.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t first = span >> 32, end = span & 0xFFFFFFFFu;
      if (first >= end) return -1;
      const uint64_t taken = front ? (first + 1) << 32 | end : first << 32 | (end - 1);
      if (ranges[r].span.compare_exchange_weak(span, taken, std::memory_order_relaxed)) return static_cast<int64_t>(front ? first : end - 1);
    }
  };
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t own = begin; own < end; ++own) {
      for (int64_t task; (task = take(own, true)) >= 0;) f(task);
    }
    for (;;) {  // the others' last tasks, from the range with the most left
      int64_t most = -1, left = 0;
      for (int64_t r = 0; r < T; ++r) {
        const uint64_t span = ranges[r].span.load(std::memory_order_relaxed);
        const int64_t n_left = static_cast<int64_t>(span & 0xFFFFFFFFu) - static_cast<int64_t>(span >> 32);
        if (n_left > left) most = r, left = n_left;
      }
      if (most < 0) return;
      const int64_t task = take(most, false);
      if (task >= 0) f(task);
    }
  });
}

// x (M, K) float -> xq (M, K) int16, xscale (M, K/32), xsum (M, K/32) = xscale * sum of xq, and where
// `xmin` is given, xmin (M, K/32) = min_per_scale * sum of xq (an integer min, folded into the dot).
void quantize_activations(const float* x, int64_t M, int64_t K, int16_t* xq, float* xscale, float* xsum,
                          int32_t* xmin = nullptr, int32_t min_per_scale = 0) {
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
      if (xmin != nullptr) xmin[i] = min_per_scale * sum;
    }
  });
}

// ---- 8 lanes, per ISA ---------------------------------------------------------------------
//
// `Isa` is the one piece that differs between the builds (cpu_kernels.py builds a library per
// ISA level): 8 float lanes (F), 8 int32 lanes (I), a chunk of 16 int16 (W), and the
// integer dot step. Every build computes, per lane, per group:
//
//   acc  =  fma(float(sum of the group's 32 products) * xscale, scale, acc)
//   acc  =  fma(xsum, min, acc)                                   (asymmetric 4 bits)
//
// except where min = scale * m for a small integer m (Q4_0's m = -8): w = scale * (q + m), so the
// min joins the integer sum, m * (sum of the group's xq) added before the one conversion (fewer
// float operations a group, and one rounding fewer).
//
// then adds the bias; only the register file differs (the tiles below).
#if defined(__AVX2__)
struct Isa {
  using F = __m256;
  using I = __m256i;
  using W = __m256i;
#if defined(__AVX512F__)
  static constexpr int kRegisters = 32;
#else
  static constexpr int kRegisters = 16;
#endif
  static I izero() { return _mm256_setzero_si256(); }
  static I iadd(I a, int32_t b) { return _mm256_add_epi32(a, _mm256_set1_epi32(b)); }
  static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static F zero() { return _mm256_setzero_ps(); }
  static W widen_u8(const uint8_t* p) {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static W widen_s8(const uint8_t* p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // A 4-bit chunk's low and high nibbles through kIQ4Values (a byte shuffle each), widened with the sign.
  static void widen_table(const uint8_t* p, W& lo, W& hi) {
    const __m128i both = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Values)), nibble = _mm_set1_epi8(0x0F);
    lo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(both, nibble)));
    hi = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(both, 4), nibble)));
  }
  static W low_nibbles(W w) { return _mm256_and_si256(w, _mm256_set1_epi16(0x0F)); }
  static W high_nibbles(W w) { return _mm256_srli_epi16(w, 4); }
  static W bit4(W w) { return _mm256_and_si256(w, _mm256_set1_epi16(0x10)); }
  static W shl4(W w) { return _mm256_slli_epi16(w, 4); }
  static W shr1(W w) { return _mm256_srli_epi16(w, 1); }
  static W shr2(W w) { return _mm256_srli_epi16(w, 2); }
  static W low2(W w) { return _mm256_and_si256(w, _mm256_set1_epi16(0x03)); }
  static W bits45(W w) { return _mm256_and_si256(w, _mm256_set1_epi16(0x30)); }
  static W sub32(W w) { return _mm256_sub_epi16(w, _mm256_set1_epi16(32)); }
  static W bor(W a, W b) { return _mm256_or_si256(a, b); }
  static W pair(const int16_t* x) {  // x[0], x[1] in every lane
    int32_t v;
    std::memcpy(&v, x, sizeof v);
    return _mm256_set1_epi32(v);
  }
  static W load_pair(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  // x's pairs 0 .. n - 1 (n a multiple of 16: K's groups) each in all 8 lanes of dst (32-byte aligned):
  // 8 pairs a load, each to its lanes by a permute (a broadcast from memory per pair costs a load
  // and a vector pipe, and the loop ran twice the instructions).
  static void broadcast_pairs(int32_t* dst, const int16_t* x, int64_t n) {
    for (int64_t j = 0; j < n; j += 8) {
      const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 2 * j));
      __m256i* to = reinterpret_cast<__m256i*>(dst + j * kLanes);
      for (int i = 0; i < 8; ++i) _mm256_store_si256(to + i, _mm256_permutevar8x32_epi32(pairs, _mm256_set1_epi32(i)));
    }
  }
  // |127 * 32767 * 2| per madd lane, 16 pairs a group: far inside int32.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
  static constexpr bool kFusedDot = true;
#else
  static constexpr bool kFusedDot = false;
#endif
  static I dot(I acc, W w, W x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, w, x);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
  }
  // An opaque step on the running sum: keeps the compiler from reassociating a group's 16 madds + adds into a
  // tree, which spilled every partial product to the stack. With madd + add (AVX2, AVX-512 without VNNI)
  // every tile needs it, even a lone row's. A fused dot (VNNI) has nothing to reassociate: AVX512-VNNI runs
  // without it (a lone row's reads overlap better; 4 x 4 tiles stop spilling); AVX-VNNI, 16 registers and not
  // measured here, keeps it on tiles of more than one row, as before.
  // "v": any of AVX-512's 32 vector registers ("x" allows only the first 16, and made gcc
  // spill 9 of a 4 x 4 tile's 16 sums to the stack and shuffle the rest every chunk).
#if defined(__AVX512VL__)
  static void order(I& v) { __asm__("" : "+v"(v)); }
#else
  static void order(I& v) { __asm__("" : "+x"(v)); }
#endif
  // Pairs broadcast once a step into memory (`Operands::xb`) rather than at every use: a `vpbroadcastd` from
  // memory takes a vector pipe as well as a load, where madd's own memory operand is a load alone; and with
  // no register held by a pair, a tile of 4 rows x 3 panels fits the 16 registers.
  static constexpr bool kPrebroadcast = !kFusedDot && kRegisters < 32;
  static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static F broadcast(float s) { return _mm256_set1_ps(s); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F load_s8(const uint8_t* p) {  // 8 int8 as floats
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static F load_u8(const uint8_t* p) {  // 8 uint8 as floats
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static F load_u4(const uint8_t* p, int shift) {  // 8 uint8's nibbles (shift 0: low, 4: high) as floats
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(b, _mm256_set1_epi32(shift)), _mm256_set1_epi32(0x0F)));
  }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F fma(F a, F b, F acc) { return _mm256_fmadd_ps(a, b, acc); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
};
#else
struct Isa {  // plain C++: the same lane arithmetic, one lane at a time
  template <typename T, int L> struct V { T v[L]; };
  using F = V<float, kLanes>;
  using I = V<int32_t, kLanes>;
  using W = V<int16_t, 2 * kLanes>;
  static constexpr int kRegisters = 16;
  static I izero() { return I{}; }
  static I iadd(I a, int32_t b) { for (auto& e : a.v) e += b; return a; }
  static I iadd(I a, I b) { for (int i = 0; i < kLanes; ++i) a.v[i] += b.v[i]; return a; }
  static F zero() { return F{}; }
  static W widen_u8(const uint8_t* p) { W w; for (int j = 0; j < 2 * kLanes; ++j) w.v[j] = p[j]; return w; }
  static W widen_s8(const uint8_t* p) {
    W w; for (int j = 0; j < 2 * kLanes; ++j) w.v[j] = static_cast<int8_t>(p[j]); return w;
  }
  static void widen_table(const uint8_t* p, W& lo, W& hi) {
    for (int j = 0; j < 2 * kLanes; ++j) lo.v[j] = kIQ4Values[p[j] & 0x0F], hi.v[j] = kIQ4Values[p[j] >> 4];
  }
  static W low_nibbles(W w) { for (auto& e : w.v) e &= 0x0F; return w; }
  static W high_nibbles(W w) { for (auto& e : w.v) e = static_cast<int16_t>(e >> 4); return w; }
  static W bit4(W w) { for (auto& e : w.v) e &= 0x10; return w; }
  static W shl4(W w) { for (auto& e : w.v) e = static_cast<int16_t>(e << 4); return w; }
  static W shr1(W w) { for (auto& e : w.v) e = static_cast<int16_t>(e >> 1); return w; }
  static W shr2(W w) { for (auto& e : w.v) e = static_cast<int16_t>(e >> 2); return w; }
  static W low2(W w) { for (auto& e : w.v) e &= 0x03; return w; }
  static W bits45(W w) { for (auto& e : w.v) e &= 0x30; return w; }
  static W sub32(W w) { for (auto& e : w.v) e = static_cast<int16_t>(e - 32); return w; }
  static W bor(W a, W b) { for (int j = 0; j < 2 * kLanes; ++j) a.v[j] |= b.v[j]; return a; }
  static W pair(const int16_t* x) { W w; for (int j = 0; j < 2 * kLanes; ++j) w.v[j] = x[j % 2]; return w; }
  static W load_pair(const int32_t* p) { W w; std::memcpy(w.v, p, sizeof w.v); return w; }
  static void broadcast_pairs(int32_t* dst, const int16_t* x, int64_t n) {
    for (int64_t j = 0; j < n; ++j)
      for (int i = 0; i < kLanes; ++i) std::memcpy(dst + j * kLanes + i, x + 2 * j, sizeof(int32_t));
  }
  static I dot(I acc, W w, W x) {
    for (int i = 0; i < kLanes; ++i) acc.v[i] += w.v[2 * i] * x.v[2 * i] + w.v[2 * i + 1] * x.v[2 * i + 1];
    return acc;
  }
  static constexpr bool kFusedDot = true;
  static constexpr bool kPrebroadcast = false;
  static void order(I&) {}
  static F to_float(I v) { F f; for (int i = 0; i < kLanes; ++i) f.v[i] = static_cast<float>(v.v[i]); return f; }
  static F broadcast(float s) { F f; for (auto& e : f.v) e = s; return f; }
  template <typename S>
  static F load(const S* p) { F f; for (int i = 0; i < kLanes; ++i) f.v[i] = static_cast<float>(p[i]); return f; }
  static F load_s8(const uint8_t* p) {
    F f; for (int i = 0; i < kLanes; ++i) f.v[i] = static_cast<float>(static_cast<int8_t>(p[i])); return f;
  }
  static F load_u8(const uint8_t* p) { F f; for (int i = 0; i < kLanes; ++i) f.v[i] = static_cast<float>(p[i]); return f; }
  static F load_u4(const uint8_t* p, int shift) {
    F f; for (int i = 0; i < kLanes; ++i) f.v[i] = static_cast<float>((p[i] >> shift) & 0x0F); return f;
  }
  static F mul(F a, F b) { for (int i = 0; i < kLanes; ++i) a.v[i] *= b.v[i]; return a; }
  static F add(F a, F b) { for (int i = 0; i < kLanes; ++i) a.v[i] += b.v[i]; return a; }
  static F fma(F a, F b, F acc) { for (int i = 0; i < kLanes; ++i) acc.v[i] = std::fma(a.v[i], b.v[i], acc.v[i]); return acc; }
  static void store(float* p, F v) { std::memcpy(p, v.v, sizeof v.v); }
  static void prefetch(const void*) {}
};
#endif

#if defined(__AVX2__) && !defined(__AVX512F__) && !defined(__AVXVNNI__)
#define PAGEDSERVE_GROUP_ASM 1  // group_4x3, sliced_tiles_4x3: AVX2's 16 registers, no fused dot
#endif

#if defined(PAGEDSERVE_GROUP_ASM)
// A 4 x 3 tile's group of 4 bits in assembly (AVX2; the pairs pre-broadcast, `Isa::kPrebroadcast`), its float
// step included: 12 integer sums (ymm0-11), the 0x0F mask (ymm12) and 3 scratch registers are the 16. Given
// the same arithmetic as intrinsics, gcc widened every panel's nibbles up front and kept 5 of the sums on the
// stack. (The float step was C after the integer assembly, the sums stored and loaded back; in here it costs
// no less that could be measured, but it keeps the sums in registers whatever the compiler does.) Row r's
// pairs at x[r] (+ 256 bytes: the high nibbles' pairs), panel p's chunks at w[p]: a base register and a
// constant an operand, no index (indexed memory operands ran a chunk at half the speed). The rows' group
// factors at `rf` (int32 xmin[4], float xscale[4], float xsum[4]), panel p's scales at f + p * fs bytes (mins
// at mn + p * fs), the float sums at acc[r][p]. The arithmetic of `tile`'s C loop, operation for operation:
// the integer sums start at the rows' xmin (integer addition: where the sum starts does not change it), then
// acc = fma(float(sum) * xscale, scale, acc) and, with mins, acc = fma(xsum, min, acc).
#define PS_ROW(off, x, d) "vpmaddwd " off "(%[" x "]), %%ymm14, %%ymm15\n\tvpaddd %%ymm15, %%ymm" d ", %%ymm" d "\n\t"
#define PS_HALF(off, a, b, c, d) PS_ROW(off, "x0", a) PS_ROW(off, "x1", b) PS_ROW(off, "x2", c) PS_ROW(off, "x3", d)
#define PS_PANEL(wo, xo, w, a, b, c, d)                                                    \
  "vpmovzxbw " wo "(%[" w "]), %%ymm13\n\tvpand %%ymm12, %%ymm13, %%ymm14\n\t" PS_HALF(xo, a, b, c, d) \
  "vpsrlw $4, %%ymm13, %%ymm14\n\t" PS_HALF(xo "+256", a, b, c, d)
#define PS_CHUNK(wo, xo) \
  PS_PANEL(wo, xo, "w0", "0", "1", "2", "3") PS_PANEL(wo, xo, "w1", "4", "5", "6", "7") PS_PANEL(wo, xo, "w2", "8", "9", "10", "11")
#define PS_START(off, a, b, c) "vpbroadcastd " off "(%[rf]), %%ymm" a "\n\tvmovdqa %%ymm" a ", %%ymm" b "\n\tvmovdqa %%ymm" a ", %%ymm" c "\n\t"
#define PS_SCALE1(s) "vcvtdq2ps %%ymm" s ", %%ymm" s "\n\tvmulps %%ymm15, %%ymm" s ", %%ymm" s "\n\t"
#define PS_SCALE(off, a, b, c) "vbroadcastss " off "(%[rf]), %%ymm15\n\t" PS_SCALE1(a) PS_SCALE1(b) PS_SCALE1(c)
#define PS_FACTORS(LOAD, p) LOAD("(%[" p "])", "12") LOAD("(%[" p "],%[fs],1)", "13") LOAD("(%[" p "],%[fs],2)", "14")
#define PS_F32(at, n) "vmovups " at ", %%ymm" n "\n\t"
#define PS_F16(at, n) "vcvtph2ps " at ", %%ymm" n "\n\t"
#define PS_FMA(off, a, b, c) "vfmadd213ps " off "(%[acc]), %%ymm12, %%ymm" a "\n\tvfmadd213ps " off "+32(%[acc]), %%ymm13, %%ymm" b \
  "\n\tvfmadd213ps " off "+64(%[acc]), %%ymm14, %%ymm" c "\n\t"
#define PS_MIN(off, a, b, c) "vbroadcastss " off "(%[rf]), %%ymm15\n\tvfmadd231ps %%ymm12, %%ymm15, %%ymm" a \
  "\n\tvfmadd231ps %%ymm13, %%ymm15, %%ymm" b "\n\tvfmadd231ps %%ymm14, %%ymm15, %%ymm" c "\n\t"
#define PS_STORE(off, a, b, c) "vmovaps %%ymm" a ", " off "(%[acc])\n\tvmovaps %%ymm" b ", " off "+32(%[acc])\n\tvmovaps %%ymm" c ", " off "+64(%[acc])\n\t"
#define PS_BODY(LOAD)                                                                                       \
  PS_START("0", "0", "4", "8") PS_START("4", "1", "5", "9") PS_START("8", "2", "6", "10") PS_START("12", "3", "7", "11") \
  "vpcmpeqw %%ymm12, %%ymm12, %%ymm12\n\tvpsrlw $12, %%ymm12, %%ymm12\n\t"                                  \
  PS_CHUNK("0", "0") PS_CHUNK("16", "32") PS_CHUNK("32", "64") PS_CHUNK("48", "96")                        \
  PS_CHUNK("64", "128") PS_CHUNK("80", "160") PS_CHUNK("96", "192") PS_CHUNK("112", "224")                 \
  PS_SCALE("16", "0", "4", "8") PS_SCALE("20", "1", "5", "9") PS_SCALE("24", "2", "6", "10") PS_SCALE("28", "3", "7", "11") \
  PS_FACTORS(LOAD, "f") PS_FMA("0", "0", "4", "8") PS_FMA("96", "1", "5", "9") PS_FMA("192", "2", "6", "10") PS_FMA("288", "3", "7", "11")
#define PS_MINS(LOAD) \
  PS_FACTORS(LOAD, "mn") PS_MIN("32", "0", "4", "8") PS_MIN("36", "1", "5", "9") PS_MIN("40", "2", "6", "10") PS_MIN("44", "3", "7", "11")
#define PS_END PS_STORE("0", "0", "4", "8") PS_STORE("96", "1", "5", "9") PS_STORE("192", "2", "6", "10") PS_STORE("288", "3", "7", "11")
#define PS_IN(x, stride)                                                                                      \
  [acc] "r"(acc), [w0] "r"(w), [w1] "r"(w + panel_bytes), [w2] "r"(w + 2 * panel_bytes), [x0] "r"(x), \
  [x1] "r"(x + stride), [x2] "r"(x + 2 * stride), [x3] "r"(x + 3 * stride), [rf] "r"(rf), [f] "r"(f), [fs] "r"(fs)
#define PS_CLOBBERS \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory"
template <typename S>
inline void group_4x3(float* acc, const uint8_t* w, int64_t panel_bytes, const int32_t* x, int64_t stride, const float* rf,
                      const S* f, const S* mn, int64_t fs) {
  fs *= sizeof(S);
  if constexpr (std::is_same_v<S, float>) {
    if (mn == nullptr) __asm__ volatile(PS_BODY(PS_F32) PS_END : : PS_IN(x, stride) : PS_CLOBBERS);
    else __asm__ volatile(PS_BODY(PS_F32) PS_MINS(PS_F32) PS_END : : PS_IN(x, stride), [mn] "r"(mn) : PS_CLOBBERS);
  } else {
    if (mn == nullptr) __asm__ volatile(PS_BODY(PS_F16) PS_END : : PS_IN(x, stride) : PS_CLOBBERS);
    else __asm__ volatile(PS_BODY(PS_F16) PS_MINS(PS_F16) PS_END : : PS_IN(x, stride), [mn] "r"(mn) : PS_CLOBBERS);
  }
}
#undef PS_CLOBBERS
#undef PS_IN
#undef PS_END
#undef PS_MINS
#undef PS_BODY
#undef PS_STORE
#undef PS_MIN
#undef PS_FMA
#undef PS_F16
#undef PS_F32
#undef PS_FACTORS
#undef PS_SCALE
#undef PS_SCALE1
#undef PS_START
#undef PS_CHUNK
#undef PS_PANEL
#undef PS_HALF
#undef PS_ROW
#endif

// What one product reads: the int16 activations, the panelled weights, their factors.
template <typename S>
struct Operands {
  const int16_t* xq;     // (M, K)
  const float* xscale;   // (M, K/32)
  const float* xsum;     // (M, K/32): xscale * sum of the block's xq
  const int32_t* xmin;   // (M, K/32): min_per_scale * sum of the block's xq where that is folded, or nullptr
  const int32_t* xb;     // the tile's rows as (rows, K/2, 8): each pair of xq in all 8 lanes (Isa::kPrebroadcast)
  const uint8_t* w;      // (P, nb, chunk bytes): see the top of the file
  const S* scales;       // (P, K/G, 8)
  const S* mins;         // like scales, or nullptr
  float min_per_scale;   // without mins: min = scale * this (Q4_0's -8), or 0
  const float* bias;     // (N,) or nullptr
  float* out;            // (M, N), or a task's part of it (below)
  int64_t M, N, K, nb, panel_bytes, groups_per_scale, scales_per_row;
  // Row m, panel p goes to out + (m - out_row0) * out_stride + (p - out_panel0) * 8: the whole
  // output (0, N, 0), or a task's scratch (quant_linear_silu_mul's gate and up halves).
  int64_t out_row0 = 0, out_stride = 0, out_panel0 = 0;
  const int32_t* xsum16 = nullptr;  // (M, K/16): the integer sum of each 16 xq (k2K's mins per 16), or nullptr
  float* at(int64_t m, int64_t n0) const { return out + (m - out_row0) * out_stride + n0 - out_panel0 * kLanes; }
};

// Row m, panel p of the output: its float sums plus the bias.
// Always inlined: with the 5-bit tiles in the file gcc stopped inlining it into the 4/8-bit ones.
template <typename S>
__attribute__((always_inline)) inline void store_output(const Operands<S>& op, int64_t m, int64_t p, const float* sums) {
  const int64_t n0 = p * kLanes;
  float* dst = op.at(m, n0);
  typename Isa::F y = Isa::load(sums);
  if (n0 + kLanes <= op.N) {
    if (op.bias != nullptr) y = Isa::add(y, Isa::load(op.bias + n0));
    Isa::store(dst, y);
  } else {  // the last panel of an N that is not a multiple of 8: its lanes past N are padding
    float lanes[kLanes], bias[kLanes] = {};
    if (op.bias != nullptr) std::copy(op.bias + n0, op.bias + op.N, bias);
    Isa::store(lanes, Isa::add(y, Isa::load(bias)));
    std::copy(lanes, lanes + (op.N - n0), dst);
  }
}

// The micro-kernel: output rows m0 .. m0+RM, panels p0 .. p0+RP (8 columns each), over all
// of K. Each weight chunk is widened once for the RM rows, each row's pair broadcast once
// for the RP panels; the integer sums live in registers for a group, the float sums too.
// A panel group's bytes: 4 bits 128, 5 bits 160 (the 4-bit 128, then 32 of high bits), 6 bits 208 (the
// 4-bit 128, 64 of high bits, 16 of sub-scales), 8 bits 256; with sc and mn behind, 4 bits 144, 5 bits 176.
// The `Bits` of a format: 4, 5, 6, 8, or 2, 4 and 5 bits with sub-scales (k4K, k5K: Q4_K's and Q5_K's sc and
// mn behind each group; k2K: Q2_K's two scale bytes, sc | mn << 4 of each 16 values), or 4 bits through the
// table (kIQ4NL; kIQ4XS with its ls - 32 behind each group).
constexpr int kSubScaled = 0x100;
constexpr int kTable = 0x200;  // 4 bits through kIQ4Values (the op's `bits` argument says so too)
constexpr int k2K = 2 | kSubScaled;
constexpr int k4K = 4 | kSubScaled;
constexpr int k5K = 5 | kSubScaled;
constexpr int kIQ4NL = 4 | kTable;               // IQ4_NL: the table's values, fp16 d per 32
constexpr int kIQ4XS = 4 | kTable | kSubScaled;  // IQ4_XS: and an int8 ls - 32 per 32 behind the chunks
constexpr bool four_bit(int bits) { return (bits & 0xFF) == 4; }  // 4 bits' integer loop, with or without
constexpr bool five_bit(int bits) { return (bits & 0xFF) == 5; }  // 5 bits' integer loop, with or without
constexpr bool k_factors_in(int bits) { return (bits & kSubScaled) != 0; }  // sub-scales in the group's bytes
constexpr bool table_values(int bits) { return (bits & kTable) != 0; }  // nibbles mapped through kIQ4Values
constexpr int panel_group_bytes(int bits) {
  return table_values(bits) ? kBlock / 2 * kLanes + (k_factors_in(bits) ? kLanes : 0)
         : k_factors_in(bits) ? panel_group_bytes(bits & 0xFF) + 2 * kLanes
         : bits == 2        ? kBlock / 4 * kLanes
         : bits == 4        ? kBlock / 2 * kLanes
         : bits == 5        ? kBlock / 2 * kLanes + kBlock / 8 * kLanes
         : bits == 6        ? kBlock / 2 * kLanes + kBlock / 4 * kLanes + 2 * kLanes
                            : kBlock * kLanes;
}
template <int Bits>
constexpr int kPanelGroupBytes = panel_group_bytes(Bits);
constexpr int kSubScaleOffset = kBlock / 2 * kLanes + kBlock / 4 * kLanes;  // 6 bits: the sub-scales' bytes
template <int Bits>
constexpr int kKScaleOffset = kPanelGroupBytes<Bits & 0xFF>;  // k4K, k5K: the 8 columns' sc, then (+ 8) their mn;
                                                               // kIQ4XS: their ls - 32

template <int Bits, int RM, int RP, bool FromXb, typename S>
__attribute__((noinline)) void tile(const Operands<S>& op, int64_t m0, int64_t p0) {
  constexpr int kGroupBytes = kPanelGroupBytes<Bits>;
  // The float sums, touched once a group, live in memory: in registers they crowded out the
  // integer sums, which every chunk updates (gcc spilled those instead: a 4 x 4 tile ran at
  // half the dot rate). The asm below keeps them there; the arithmetic is the same either way.
  alignas(64) float acc[RM][RP][kLanes];
  for (int r = 0; r < RM; ++r)
    for (int p = 0; p < RP; ++p) Isa::store(acc[r][p], Isa::zero());
  const uint8_t* w = op.w + p0 * op.panel_bytes;
  const S* scales = op.scales + p0 * op.scales_per_row * kLanes;
  const S* mins = op.mins != nullptr ? op.mins + p0 * op.scales_per_row * kLanes : nullptr;
  int64_t sg = 0, left = op.groups_per_scale;  // the group's scale index, and groups left in it
  // The group kPrefetchGroups ahead (below), followed like sg / left rather than divided out at
  // every group: its `idiv` and address arithmetic were a large share of a lone row's tile.
  int64_t ahead_g = kPrefetchGroups % op.nb, ahead_panels = kPrefetchGroups / op.nb * RP;
  int64_t ahead_sg = ahead_g / op.groups_per_scale, ahead_left = op.groups_per_scale - ahead_g % op.groups_per_scale;
  // Row r's pair j (its xq[2j], xq[2j + 1]) in every lane: broadcast here, or (tiles of more than
  // two rows where the build pre-broadcasts: int_qlinear gives them op.xb) loaded as broadcast.
  constexpr bool kFromXb = FromXb && Isa::kPrebroadcast && RM > 2;
  const int32_t* xb = op.xb;
  const auto pair = [&](int r, const int16_t* x, int64_t j) {
    if constexpr (kFromXb) return Isa::load_pair(xb + (r * op.K / 2 + j) * kLanes);
    else return Isa::pair(x);
  };
  // A lone row's integer sums in two chains a panel, as wide_tile's kSplit, where the dot is fused
  // (AVX2's madd + add in two chains, each held by Isa::order, measured no faster).
  // 6 bits always hold two sums, a sub-block's each (dots: values 0..15, dots6: 16..31).
  constexpr bool kSplit = RM == 1 && Isa::kFusedDot && Bits != 6 && Bits != k2K;
  constexpr int kSums6 = Bits == 6 || Bits == k2K ? 1 : 0;
  for (int64_t g = 0; g < op.nb; ++g) {
    typename Isa::I dots[RM][RP], dots2[RP], dots6[kSums6 ? RM : 1][kSums6 ? RP : 1];
    for (int r = 0; r < RM; ++r)
      for (int p = 0; p < RP; ++p) dots[r][p] = Isa::izero();
    if constexpr (kSums6)
      for (int r = 0; r < RM; ++r)
        for (int p = 0; p < RP; ++p) dots6[r][p] = Isa::izero();
    for (int p = 0; p < RP; ++p) dots2[p] = Isa::izero();
    const uint8_t* chunks = w + g * kGroupBytes;
    // Every cache line of the group kPrefetchGroups ahead in the order the tiles read them: this
    // tile's panels, then (past their last group) the next tile's, which follow in memory. Into
    // L2: a decode's whole step is a stream from memory, and L1 prefetches held the fill buffers
    // the loads need (prefetching each panel's own stream into L1 was slower than not prefetching:
    // it overran short panels into data already read).
    // The group's scales (and mins) too, which are streams of their own.
    {
      const uint8_t* at = w + ahead_panels * op.panel_bytes + ahead_g * kGroupBytes;
      const int64_t factors_at = (ahead_panels * op.scales_per_row + ahead_sg) * kLanes;
      for (int p = 0; p < RP; ++p)
        for (int line = 0; line < kGroupBytes; line += 64) Isa::prefetch(at + p * op.panel_bytes + line);
      for (int p = 0; p < RP; ++p) {
        Isa::prefetch(scales + factors_at + p * op.scales_per_row * kLanes);
        if (mins != nullptr) Isa::prefetch(mins + factors_at + p * op.scales_per_row * kLanes);
      }
      if (++ahead_g == op.nb) {
        ahead_g = 0, ahead_panels += RP, ahead_sg = 0, ahead_left = op.groups_per_scale;
      } else if (--ahead_left == 0) {
        ++ahead_sg, ahead_left = op.groups_per_scale;
      }
    }
    if constexpr (four_bit(Bits)) {
      for (int c = 0; c < 8; ++c) {
        typename Isa::W lo[RP], hi[RP];
        for (int p = 0; p < RP; ++p) {
          if constexpr (table_values(Bits)) {
            Isa::widen_table(chunks + p * op.panel_bytes + c * 16, lo[p], hi[p]);
          } else {
            const typename Isa::W both = Isa::widen_u8(chunks + p * op.panel_bytes + c * 16);
            lo[p] = Isa::low_nibbles(both);
            hi[p] = Isa::high_nibbles(both);
          }
        }
        for (int r = 0; r < RM; ++r) {
          const int16_t* x = op.xq + (m0 + r) * op.K + g * kBlock + 2 * c;
          const typename Isa::W xa = pair(r, x, g * kBlock / 2 + c), xb = pair(r, x + 16, g * kBlock / 2 + c + 8);
          for (int p = 0; p < RP; ++p) {
            if constexpr (kSplit) {
              dots[r][p] = Isa::dot(dots[r][p], lo[p], xa);
              dots2[p] = Isa::dot(dots2[p], hi[p], xb);
            } else {
              dots[r][p] = Isa::dot(Isa::dot(dots[r][p], lo[p], xa), hi[p], xb);
            }
            if constexpr (!Isa::kFusedDot || (RM > 1 && Isa::kRegisters < 32)) Isa::order(dots[r][p]);
          }
        }
      }
    } else if constexpr (five_bit(Bits)) {
      // The 4-bit loop with q = nibble | bit << 4 (values 0..31), the same madds. Half h's high chunk
      // (chunks 4h .. 4h + 3) widened once; chunk c's two bits at 0 and 4 after j = c - 4h shifts.
      for (int h = 0; h < 2; ++h) {
        typename Isa::W high[RP];
        for (int p = 0; p < RP; ++p) high[p] = Isa::widen_u8(chunks + p * op.panel_bytes + 128 + h * 16);
        for (int j = 0; j < 4; ++j) {
          const int c = 4 * h + j;
          typename Isa::W lo[RP], hi[RP];
          for (int p = 0; p < RP; ++p) {
            const typename Isa::W both = Isa::widen_u8(chunks + p * op.panel_bytes + c * 16);
            lo[p] = Isa::bor(Isa::low_nibbles(both), Isa::bit4(Isa::shl4(high[p])));
            hi[p] = Isa::bor(Isa::high_nibbles(both), Isa::bit4(high[p]));
            high[p] = Isa::shr1(high[p]);
          }
          for (int r = 0; r < RM; ++r) {
            const int16_t* x = op.xq + (m0 + r) * op.K + g * kBlock + 2 * c;
            const typename Isa::W xa = pair(r, x, g * kBlock / 2 + c), xb = pair(r, x + 16, g * kBlock / 2 + c + 8);
            for (int p = 0; p < RP; ++p) {
              if constexpr (kSplit) {
                dots[r][p] = Isa::dot(dots[r][p], lo[p], xa);
                dots2[p] = Isa::dot(dots2[p], hi[p], xb);
              } else {
                dots[r][p] = Isa::dot(Isa::dot(dots[r][p], lo[p], xa), hi[p], xb);
              }
              if constexpr (!Isa::kFusedDot || (RM > 1 && Isa::kRegisters < 32)) Isa::order(dots[r][p]);
            }
          }
        }
      }
    } else if constexpr (Bits == k2K) {
      // Chunk c's byte 2i + t holds column i's values 2c + t, 8 + 2c + t, 16 + 2c + t, 24 + 2c + t at bits 0, 2,
      // 4, 6: the first two sub-block 0's (into dots), the last two sub-block 1's (into dots6).
      for (int c = 0; c < 4; ++c) {
        typename Isa::W q[4][RP];
        for (int p = 0; p < RP; ++p) {
          const typename Isa::W both = Isa::widen_u8(chunks + p * op.panel_bytes + c * 16);
          q[0][p] = Isa::low2(both);
          q[1][p] = Isa::low2(Isa::shr2(both));
          q[2][p] = Isa::low2(Isa::high_nibbles(both));
          q[3][p] = Isa::shr2(Isa::high_nibbles(both));
        }
        for (int r = 0; r < RM; ++r) {
          const int16_t* x = op.xq + (m0 + r) * op.K + g * kBlock + 2 * c;
          const int64_t j = g * kBlock / 2 + c;
          const typename Isa::W x0 = pair(r, x, j), x1 = pair(r, x + 8, j + 4), x2 = pair(r, x + 16, j + 8),
                                x3 = pair(r, x + 24, j + 12);
          for (int p = 0; p < RP; ++p) {
            dots[r][p] = Isa::dot(Isa::dot(dots[r][p], q[0][p], x0), q[1][p], x1);
            dots6[r][p] = Isa::dot(Isa::dot(dots6[r][p], q[2][p], x2), q[3][p], x3);
            if constexpr (!Isa::kFusedDot || (RM > 1 && Isa::kRegisters < 32)) {
              Isa::order(dots[r][p]);
              Isa::order(dots6[r][p]);
            }
          }
        }
      }
    } else if constexpr (Bits == 6) {
      // The 4-bit loop with q = nibble | two bits << 4, less 32 (values -32..31). High chunk h (chunks 2h,
      // 2h + 1) widened once; chunk c's bits at 0-1 and 4-5 after j = c - 2h shifts by 2.
      for (int h = 0; h < 4; ++h) {
        typename Isa::W high[RP];
        for (int p = 0; p < RP; ++p) high[p] = Isa::widen_u8(chunks + p * op.panel_bytes + 128 + h * 16);
        for (int j = 0; j < 2; ++j) {
          const int c = 2 * h + j;
          typename Isa::W lo[RP], hi[RP];
          for (int p = 0; p < RP; ++p) {
            const typename Isa::W both = Isa::widen_u8(chunks + p * op.panel_bytes + c * 16);
            lo[p] = Isa::sub32(Isa::bor(Isa::low_nibbles(both), Isa::bits45(Isa::shl4(high[p]))));
            hi[p] = Isa::sub32(Isa::bor(Isa::high_nibbles(both), Isa::bits45(high[p])));
            high[p] = Isa::shr2(high[p]);
          }
          for (int r = 0; r < RM; ++r) {
            const int16_t* x = op.xq + (m0 + r) * op.K + g * kBlock + 2 * c;
            const typename Isa::W xa = pair(r, x, g * kBlock / 2 + c), xb = pair(r, x + 16, g * kBlock / 2 + c + 8);
            for (int p = 0; p < RP; ++p) {
              if constexpr (kSums6) {
                dots[r][p] = Isa::dot(dots[r][p], lo[p], xa);
                dots6[r][p] = Isa::dot(dots6[r][p], hi[p], xb);
                if constexpr (!Isa::kFusedDot || (RM > 1 && Isa::kRegisters < 32)) {
                  Isa::order(dots[r][p]);
                  Isa::order(dots6[r][p]);
                }
              }
            }
          }
        }
      }
    } else {
      for (int c = 0; c < 16; c += 2) {  // two chunks a step, as a 4-bit chunk's two halves
        typename Isa::W q0[RP], q1[RP];
        for (int p = 0; p < RP; ++p) {
          q0[p] = Isa::widen_s8(chunks + p * op.panel_bytes + c * 16);
          q1[p] = Isa::widen_s8(chunks + p * op.panel_bytes + c * 16 + 16);
        }
        for (int r = 0; r < RM; ++r) {
          const int16_t* x = op.xq + (m0 + r) * op.K + g * kBlock + 2 * c;
          const typename Isa::W xa = pair(r, x, g * kBlock / 2 + c), xb = pair(r, x + 2, g * kBlock / 2 + c + 1);
          for (int p = 0; p < RP; ++p) {
            if constexpr (kSplit) {
              dots[r][p] = Isa::dot(dots[r][p], q0[p], xa);
              dots2[p] = Isa::dot(dots2[p], q1[p], xb);
            } else {
              dots[r][p] = Isa::dot(Isa::dot(dots[r][p], q0[p], xa), q1[p], xb);
            }
            if constexpr (!Isa::kFusedDot || (RM > 1 && Isa::kRegisters < 32)) Isa::order(dots[r][p]);
          }
        }
      }
    }
    // The group's factors, once for the RM rows: scales, and mins as stored or made from the
    // scales (scale * a power of two is exact: the same numbers as stored mins), except where an
    // integral min_per_scale (Q4_0's -8) went into the integer sums instead (op.xmin).
    if constexpr (kSplit)
      for (int p = 0; p < RP; ++p) dots[0][p] = Isa::iadd(dots[0][p], dots2[p]);
    typename Isa::F ws[RP], mn[RP];
    if (op.xmin != nullptr)
      for (int r = 0; r < RM; ++r)
        for (int p = 0; p < RP; ++p) dots[r][p] = Isa::iadd(dots[r][p], op.xmin[(m0 + r) * op.nb + g]);
    if constexpr (Bits == k2K) {  // two sub-blocks, each d * sc (exact), then -dmin times the mins' integer sum
      typename Isa::F s0[RP], s1[RP], dm[RP], mn0[RP], mn1[RP];
      for (int p = 0; p < RP; ++p) {
        const int64_t at = p * op.scales_per_row * kLanes + sg * kLanes;
        const typename Isa::F d = Isa::load(scales + at);
        const uint8_t* k_factors = chunks + p * op.panel_bytes + kKScaleOffset<Bits>;
        s0[p] = Isa::mul(d, Isa::load_u4(k_factors, 0));
        s1[p] = Isa::mul(d, Isa::load_u4(k_factors + kLanes, 0));
        mn0[p] = Isa::load_u4(k_factors, 4);
        mn1[p] = Isa::load_u4(k_factors + kLanes, 4);
        dm[p] = Isa::load(mins + at);
      }
      for (int r = 0; r < RM; ++r) {
        const int64_t at = (m0 + r) * op.nb + g;
        const typename Isa::F xs = Isa::broadcast(op.xscale[at]);
        const typename Isa::F x0 = Isa::broadcast(static_cast<float>(op.xsum16[2 * at]));
        const typename Isa::F x1 = Isa::broadcast(static_cast<float>(op.xsum16[2 * at + 1]));
        for (int p = 0; p < RP; ++p) {
          // mn0 x0 + mn1 x1 is exact: |each| <= 15 * 16 * 32767 < 2^23
          const typename Isa::F m = Isa::fma(mn1[p], x1, Isa::mul(mn0[p], x0));
          typename Isa::F a = Isa::fma(Isa::mul(Isa::to_float(dots[r][p]), xs), s0[p], Isa::load(acc[r][p]));
          a = Isa::fma(Isa::mul(Isa::to_float(dots6[r][p]), xs), s1[p], a);
          Isa::store(acc[r][p], Isa::fma(Isa::mul(m, xs), dm[p], a));
        }
      }
      if constexpr (Isa::kRegisters >= 32) __asm__("" : "+m"(acc));
      if (--left == 0) {
        ++sg;
        left = op.groups_per_scale;
      }
      continue;
    }
    if constexpr (kSums6) {  // two sub-blocks a group, each its d * sc (exact), in order
      typename Isa::F s0[RP], s1[RP];
      for (int p = 0; p < RP; ++p) {
        const typename Isa::F d = Isa::load(scales + p * op.scales_per_row * kLanes + sg * kLanes);
        s0[p] = Isa::mul(d, Isa::load_s8(chunks + p * op.panel_bytes + kSubScaleOffset));
        s1[p] = Isa::mul(d, Isa::load_s8(chunks + p * op.panel_bytes + kSubScaleOffset + kLanes));
      }
      for (int r = 0; r < RM; ++r) {
        const typename Isa::F xs = Isa::broadcast(op.xscale[(m0 + r) * op.nb + g]);
        for (int p = 0; p < RP; ++p) {
          typename Isa::F a = Isa::fma(Isa::mul(Isa::to_float(dots[r][p]), xs), s0[p], Isa::load(acc[r][p]));
          Isa::store(acc[r][p], Isa::fma(Isa::mul(Isa::to_float(dots6[r][p]), xs), s1[p], a));
        }
      }
      if constexpr (Isa::kRegisters >= 32) __asm__("" : "+m"(acc));
      if (--left == 0) {
        ++sg;
        left = op.groups_per_scale;
      }
      continue;
    }
    const bool has_min = mins != nullptr || (op.min_per_scale != 0.f && op.xmin == nullptr);
    for (int p = 0; p < RP; ++p) {
      const int64_t at = p * op.scales_per_row * kLanes + sg * kLanes;
      ws[p] = Isa::load(scales + at);
      if (mins != nullptr) mn[p] = Isa::load(mins + at);
      else if (has_min) mn[p] = Isa::mul(ws[p], Isa::broadcast(op.min_per_scale));
      if constexpr (Bits == kIQ4XS) {  // d * (ls - 32), exact
        ws[p] = Isa::mul(ws[p], Isa::load_s8(chunks + p * op.panel_bytes + kKScaleOffset<Bits>));
      } else if constexpr (k_factors_in(Bits)) {  // d * sc and -dmin * mn, exact: the multiplied-out form's numbers
        const uint8_t* k_factors = chunks + p * op.panel_bytes + kKScaleOffset<Bits>;
        ws[p] = Isa::mul(ws[p], Isa::load_u8(k_factors));
        mn[p] = Isa::mul(mn[p], Isa::load_u8(k_factors + kLanes));
      }
    }
    for (int r = 0; r < RM; ++r) {
      const typename Isa::F xs = Isa::broadcast(op.xscale[(m0 + r) * op.nb + g]);
      for (int p = 0; p < RP; ++p)
        Isa::store(acc[r][p], Isa::fma(Isa::mul(Isa::to_float(dots[r][p]), xs), ws[p], Isa::load(acc[r][p])));
      if (has_min) {
        const typename Isa::F xm = Isa::broadcast(op.xsum[(m0 + r) * op.nb + g]);
        for (int p = 0; p < RP; ++p) Isa::store(acc[r][p], Isa::fma(xm, mn[p], Isa::load(acc[r][p])));
      }
    }
    if constexpr (Isa::kRegisters >= 32) __asm__("" : "+m"(acc));
    if (--left == 0) {
      ++sg;
      left = op.groups_per_scale;
    }
  }
  for (int r = 0; r < RM; ++r)
    for (int p = 0; p < RP; ++p) store_output(op, m0 + r, p0 + p, acc[r][p]);
}

// tile<Bits, rm, rp> for run-time rm <= RM, rp <= RP (the edges of the output).
template <int Bits, int RM, int RP, bool FromXb = false, typename S>
void tile_upto(const Operands<S>& op, int64_t m0, int64_t p0, int rm, int rp) {
  if constexpr (RM > 1) {
    if (rm < RM) return tile_upto<Bits, RM - 1, RP, FromXb>(op, m0, p0, rm, rp);
  }
  if constexpr (RP > 1) {
    if (rp < RP) return tile_upto<Bits, RM, RP - 1, FromXb>(op, m0, p0, rm, rp);
  }
  tile<Bits, RM, RP, FromXb>(op, m0, p0);
}

#if defined(PAGEDSERVE_GROUP_ASM)
// AVX2's 4 x 3 tiles of 4 bits (group_4x3) over a task's rows (4 at a time) and panels, K a slice of 8 groups
// at a time: for each slice, each 4 rows' pairs of the slice are broadcast (16 KB, in L1) and every tile
// takes the slice's groups, then the next 4 rows, then the next slice. Pairs broadcast for all of K (8 times
// the bytes of the rows: 128 KB at K = 2048) were read from L2 by each tile, where a chunk runs much slower
// than from L1; and K = 8192 did not fit at all. Rows inside slices: a task's slice of weights (48 panels: 48
// KB) is read from memory once and by the other rows from L2, where rows outside slices read all of the
// task's weights (384 KB at K = 2048, 1.5 MB at K = 8192) once per 4 rows, from L3 or memory, and two threads
// slowed each other there. The float sums of the task's tiles wait in `acc` between slices; each output still
// takes its groups in order, so the bits are `tile`'s.
constexpr int64_t kSliceGroups = 8;
constexpr int64_t kSlicedMinRows = 8;  // fewer rows take 4 x 2 tiles (int_qlinear)
constexpr int64_t kSlicePairs = kSliceGroups * kBlock / 2;
constexpr int kSlicedTileFloats = 4 * 3 * kLanes;
//
// The first rows of each slice also prefetch the tiles' next slice, and in the last slice the first
// slice of the panels from `next_p` on (what this thread most likely takes next: the next task's
// panels, or the up half's after the gate's): without it every task began on weights still in
// memory, which at a few rows (decodes) the other rows do not hide. (Prefetching a task's whole first
// slice at its start as well gained nothing.)
//
// 4 bits with sub-scales (k4K) make each group's factors d * sc, -dmin * mn for the tile's 3 panels first
// (`tile`'s float step, exact), and group_4x3 reads them as float32 factors: the same bits as stored ones.
template <int Bits, typename S>
void sliced_tiles_4x3(const Operands<S>& op, int64_t m_begin, int64_t row_tiles, int64_t p_begin, int64_t tiles, float* acc,
                      int32_t* xb, float* xf, int64_t next_p) {
  constexpr int kGroupBytes = kPanelGroupBytes<Bits>;
  std::fill(acc, acc + row_tiles * tiles * kSlicedTileFloats, 0.f);
  const int64_t pb = op.panel_bytes, fs = op.scales_per_row * kLanes;
  const int64_t total_panels = (op.N + kLanes - 1) / kLanes;
  // Group g of panel q (its chunks and factors) into L2; `factors_at` = g / groups_per_scale * kLanes.
  const auto prefetch_group = [&](int64_t q, int64_t g, int64_t factors_at) {
    for (int line = 0; line < kGroupBytes; line += 64) Isa::prefetch(op.w + q * pb + g * kGroupBytes + line);
    Isa::prefetch(op.scales + q * fs + factors_at);
    if (op.mins != nullptr) Isa::prefetch(op.mins + q * fs + factors_at);
  };
  int64_t factor_first[kSliceGroups];  // the first slice's factor offsets, for the next panels' prefetch
  for (int64_t j = 0; j < std::min(op.nb, kSliceGroups); ++j) factor_first[j] = j / op.groups_per_scale * kLanes;
  for (int64_t g0 = 0; g0 < op.nb; g0 += kSliceGroups) {
    const int64_t g1 = std::min(op.nb, g0 + kSliceGroups);
    // The slice's groups' factor offsets (and those a slice ahead), divided out once a slice rather
    // than at every group of every tile: an `idiv` each, ~1% of a 2048-row product's samples.
    int64_t factor_at[kSliceGroups], factor_ahead[kSliceGroups];
    for (int64_t g = g0; g < g1; ++g) {
      factor_at[g - g0] = g / op.groups_per_scale * kLanes;
      factor_ahead[g - g0] = (g + kSliceGroups) / op.groups_per_scale * kLanes;
    }
    for (int64_t rt = 0; rt < row_tiles; ++rt) {
      const int64_t m0 = m_begin + 4 * rt;
      for (int r = 0; r < 4; ++r) {  // the slice's pairs in all 8 lanes, and its factors as group_4x3 reads them
        const int16_t* x = op.xq + (m0 + r) * op.K + g0 * kBlock;
        Isa::broadcast_pairs(xb + r * kSlicePairs * kLanes, x, (g1 - g0) * kBlock / 2);
        for (int64_t g = g0; g < g1; ++g) {
          const int64_t at = (m0 + r) * op.nb + g;
          const int32_t xmin = op.xmin != nullptr ? op.xmin[at] : 0;
          std::memcpy(xf + (g - g0) * 12 + r, &xmin, sizeof xmin);
          xf[(g - g0) * 12 + 4 + r] = op.xscale[at];
          xf[(g - g0) * 12 + 8 + r] = op.xsum[at];
        }
      }
      // The next row tile's slice (or the next slice's first row tile), pairs and factors, into L2
      // while this one's tiles run: at 2048 rows a task's rows (64 x K int16) come from L3 or memory,
      // and the broadcast above waited on them (~9% of the product's samples, ~5% with this).
      {
        const bool last = rt + 1 == row_tiles;
        const int64_t nm = last ? m_begin : m0 + 4, ng = last ? g1 : g0;
        const int64_t ng1 = std::min(op.nb, ng + kSliceGroups);
        for (int r = 0; r < 4 && ng < op.nb; ++r) {
          const char* x = reinterpret_cast<const char*>(op.xq + (nm + r) * op.K + ng * kBlock);
          for (int64_t line = 0; line < (ng1 - ng) * kBlock * 2; line += 64) Isa::prefetch(x + line);
          const int64_t at = (nm + r) * op.nb + ng;
          if (op.xmin != nullptr) Isa::prefetch(op.xmin + at);
          Isa::prefetch(op.xscale + at);
          Isa::prefetch(op.xsum + at);
        }
      }
      float* const row_acc = acc + rt * tiles * kSlicedTileFloats;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t p0 = p_begin + 3 * t;
        const uint8_t* w = op.w + p0 * pb;
        const S* scales = op.scales + p0 * fs;
        const S* mins = op.mins != nullptr ? op.mins + p0 * fs : nullptr;
        for (int64_t g = g0; g < g1; ++g) {
          // this tile's next slice, into L2 (by the first rows: the others find this slice there)
          if (const int64_t ahead = g + kSliceGroups; rt == 0 && ahead < op.nb) {
            for (int p = 0; p < 3; ++p) prefetch_group(p0 + p, ahead, factor_ahead[g - g0]);
          } else if (rt == 0 && g1 == op.nb) {  // the last slice: the next panels' first slice
            const int64_t q0 = next_p + 3 * t;
            const int64_t j_end = g + 1 < g1 ? g - g0 + 1 : std::min(op.nb, kSliceGroups);
            for (int64_t j = g - g0; j < j_end; ++j)
              for (int64_t q = q0; q < std::min(q0 + 3, total_panels); ++q) prefetch_group(q, j, factor_first[j]);
          }
          const int64_t at = factor_at[g - g0];
          if constexpr (Bits == k4K) {
            alignas(32) float factors[2][3][kLanes];  // the 3 panels' scales, then their mins
            for (int p = 0; p < 3; ++p) {
              const uint8_t* k_factors = w + p * pb + g * kGroupBytes + kKScaleOffset<Bits>;
              Isa::store(factors[0][p], Isa::mul(Isa::load(scales + p * fs + at), Isa::load_u8(k_factors)));
              Isa::store(factors[1][p], Isa::mul(Isa::load(mins + p * fs + at), Isa::load_u8(k_factors + kLanes)));
            }
            group_4x3(row_acc + t * kSlicedTileFloats, w + g * kGroupBytes, pb, xb + (g - g0) * kBlock / 2 * kLanes,
                      kSlicePairs * kLanes, xf + (g - g0) * 12, &factors[0][0][0], &factors[1][0][0], int64_t{kLanes});
          } else {
            group_4x3(row_acc + t * kSlicedTileFloats, w + g * kGroupBytes, pb, xb + (g - g0) * kBlock / 2 * kLanes,
                      kSlicePairs * kLanes, xf + (g - g0) * 12, scales + at, mins != nullptr ? mins + at : nullptr, fs);
          }
        }
      }
    }
  }
  for (int64_t rt = 0; rt < row_tiles; ++rt)
    for (int64_t t = 0; t < tiles; ++t)
      for (int r = 0; r < 4; ++r)
        for (int p = 0; p < 3; ++p)
          store_output(op, m_begin + 4 * rt + r, p_begin + 3 * t + p,
                       acc + (rt * tiles + t) * kSlicedTileFloats + (r * 3 + p) * kLanes);
}
#endif

// ---- Wide tiles (AVX-512 VNNI): two panels a vector --------------------------------------
//
// On a core with two 512-bit pipes (Intel Xeons) a 512-bit `vpdpwssd` does twice the products of
// a 256-bit one in the same slot; on one that splits 512-bit operations in two (Zen 4) it costs two
// and the count of everything else halves. Tiles of two rows or more (prompts, mixed steps,
// verification, decodes) therefore run 16 lanes: the chunks of panels p and p + 1 side by side, so lanes
// 0-7 are panel p's 8 columns and 8-15 panel p + 1's, the pair broadcast to all 16, for every format
// (4, 5, 6 and 8 bits; 5 and 6 bits unpack their bit planes in bytes, then widen). Each lane
// runs exactly the arithmetic of `tile` above (the integer dot is exact, then the same convert,
// multiply and fused multiply-adds, group by group in order), so a row's bits do not depend on
// which of the two it fell in (a task's last odd panel takes `tile`). PAGEDSERVE_WIDE_TILES=0 turns them off (to
// compare; results are the same bits; docs/benchmarks.md has the figures).
// tests/models/test_wide_tiles.py builds them with emulated vectors where the CPU lacks AVX-512.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) || defined(PAGEDSERVE_WIDE_EMULATED)
#define PAGEDSERVE_HAS_WIDE_TILES 1
constexpr bool kWide = true;
// Two tile shapes of the 32 registers: steps of more than 6 rows take 8 rows x 2 vectors (16 sums, 4
// widened chunks, 2 pairs: 32 products for 2 widenings, where 6 x 3 does 36 for 3), fewer rows 6 x 3
// (more panels to share each row's pairs, where rows are few). The widenings compete with `vpdpwssd`
// for the vector pipes, so 8 x 2 pays from 16 rows on and 5 rows were slower on it; 12 x 2, 10 x 2,
// 9 x 2, 7 x 3 and 4 x 4 were no better than 8 x 2.
constexpr int kWideRows = 8;
constexpr int kWideVectors = 2;
constexpr int kFewWideRows = 6;
constexpr int kFewWideVectors = 3;

// Read once a product (a lookup, against microseconds of arithmetic), so that a test can hold the
// tiles' bits to the 8-lane ones in one process.
inline bool wide_tiles_enabled() {
  const char* v = std::getenv("PAGEDSERVE_WIDE_TILES");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

// As Isa::order: without it gcc copied the sums between registers and spilled 10 of 18 every chunk.
#if defined(__AVX512F__)
inline void wide_order(__m512i& v) { __asm__("" : "+v"(v)); }
#else
inline void wide_order(__m512i&) {}  // PAGEDSERVE_WIDE_EMULATED: the same tiles on emulated vectors, to test them
#endif

// sum += a . xa + b . xb (pairs of int16, exact): in one chain, or (kSplit) b's into sum2, a chain of its own.
template <bool kSplit>
inline void dot_pair(__m512i& sum, __m512i& sum2, __m512i a, __m512i xa, __m512i b, __m512i xb) {
  if constexpr (kSplit) {
    sum = _mm512_dpwssd_epi32(sum, a, xa);
    sum2 = _mm512_dpwssd_epi32(sum2, b, xb);
    wide_order(sum2);
  } else {
    sum = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(sum, a, xa), b, xb);
  }
  wide_order(sum);
}

inline __m256i two_chunks(const uint8_t* a, const uint8_t* b) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
}
inline __m512 two_factors(const float* a, const float* b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a))),
                                             _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}
inline __m512 two_factors(const c10::Half* a, const c10::Half* b) {
  return _mm512_cvtph_ps(two_chunks(reinterpret_cast<const uint8_t*>(a), reinterpret_cast<const uint8_t*>(b)));
}
// Two panels' 8 int8 sub-scales (6 bits) as floats, as Isa::load_s8 makes each panel's.
inline __m512 two_subscales(const uint8_t* a, const uint8_t* b) {
  const __m128i both = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                                          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(both));
}
// Two panels' 8 uint8 K factors (k4K's or k5K's sc or mn) as floats.
inline __m512 two_k_factors(const uint8_t* a, const uint8_t* b) {
  const __m128i both = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                                          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(both));
}
inline __m512i pair16(const int16_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof v);
  return _mm512_set1_epi32(v);
}

// How a tile's groups take the weights' mins (Operands): none (symmetric 8 bits), folded into the
// integer sums (op.xmin: Q4_0's integral min_per_scale), stored (op.mins), or scale * min_per_scale.
// A template argument of the wide tiles, so that their per-group step has no branch on it.
enum MinKind { kNoMin, kFoldedMin, kStoredMins, kScaledMins };

template <typename S>
MinKind min_kind(const Operands<S>& op) {
  if (op.mins != nullptr) return kStoredMins;
  if (op.xmin != nullptr) return kFoldedMin;
  return op.min_per_scale != 0.f ? kScaledMins : kNoMin;
}

// A 6-bit group of RM rows x 2 * RZ panels into the float sums: `tile`'s 6-bit loop and float step, lane for
// lane. Two rows or fewer (decodes) take both sub-blocks in one pass, two integer sums an output, as `tile`;
// more rows take the group's first sub-block (values 0..15: the chunks' low nibbles) and its float step,
// then the second's: one sum an output, so that 6 x 3 and 8 x 2 tiles fit the 32 registers (36 and 32 sums
// in one pass), each chunk widened twice. The float steps are `tile`'s, in its order.
template <int RM, int RZ, typename S>
__attribute__((always_inline)) inline void wide_group6(const Operands<S>& op, float (&acc)[RM][RZ][2 * kLanes], const uint8_t* chunks,
                                                       const S* scales, const int16_t* x, const float* xscale) {
  const int64_t pb = op.panel_bytes, fs = op.scales_per_row * kLanes, nb = op.nb;
  constexpr bool kOnePass = RM <= 2;
  __m512 s0[RZ], s1[RZ];
  for (int z = 0; z < RZ; ++z) {
    const __m512 d = two_factors(scales + 2 * z * fs, scales + (2 * z + 1) * fs);
    s0[z] = _mm512_mul_ps(d, two_subscales(chunks + 2 * z * pb + kSubScaleOffset, chunks + (2 * z + 1) * pb + kSubScaleOffset));
    s1[z] = _mm512_mul_ps(d, two_subscales(chunks + 2 * z * pb + kSubScaleOffset + kLanes,
                                           chunks + (2 * z + 1) * pb + kSubScaleOffset + kLanes));
  }
  // Pass 0: both sub-blocks (into dots and dots6); 1: the first alone; 2: the second alone.
  const auto pass = [&](auto which) {
    constexpr int kWhich = decltype(which)::value;
    constexpr bool kLow = kWhich != 2, kHigh = kWhich != 1;
    __m512i dots[RM][RZ], dots6[kWhich == 0 ? RM : 1][RZ];
    for (int r = 0; r < RM; ++r)
      for (int z = 0; z < RZ; ++z) dots[r][z] = _mm512_setzero_si512();
    if constexpr (kWhich == 0)
      for (int r = 0; r < RM; ++r)
        for (int z = 0; z < RZ; ++z) dots6[r][z] = _mm512_setzero_si512();
    for (int h = 0; h < 4; ++h) {
      __m256i high[RZ];
      for (int z = 0; z < RZ; ++z) high[z] = two_chunks(chunks + 2 * z * pb + 128 + h * 16, chunks + (2 * z + 1) * pb + 128 + h * 16);
      for (int j = 0; j < 2; ++j) {
        const int c = 2 * h + j;
        __m512i lo[RZ], hi[RZ];
        for (int z = 0; z < RZ; ++z) {
          // In bytes, 32 a 256-bit operation (a 512-bit one costs two on Zen 4), then widened with the sign:
          // the same int16 as `tile`'s. A 16-bit shift carries bits across bytes only where the masks drop them.
          const __m256i both = two_chunks(chunks + 2 * z * pb + c * 16, chunks + (2 * z + 1) * pb + c * 16);
          const __m256i nibble = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30), bias = _mm256_set1_epi8(32);
          if constexpr (kLow)
            lo[z] = _mm512_cvtepi8_epi16(_mm256_sub_epi8(
                _mm256_or_si256(_mm256_and_si256(both, nibble), _mm256_and_si256(_mm256_slli_epi16(high[z], 4), bits45)), bias));
          if constexpr (kHigh)
            hi[z] = _mm512_cvtepi8_epi16(_mm256_sub_epi8(
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(both, 4), nibble), _mm256_and_si256(high[z], bits45)), bias));
          high[z] = _mm256_srli_epi16(high[z], 2);
        }
        for (int r = 0; r < RM; ++r) {
          for (int z = 0; z < RZ; ++z) {
            if constexpr (kLow) dots[r][z] = _mm512_dpwssd_epi32(dots[r][z], lo[z], pair16(x + r * op.K + 2 * c));
            if constexpr (kWhich == 0) dots6[r][z] = _mm512_dpwssd_epi32(dots6[r][z], hi[z], pair16(x + r * op.K + 16 + 2 * c));
            if constexpr (kWhich == 2) dots[r][z] = _mm512_dpwssd_epi32(dots[r][z], hi[z], pair16(x + r * op.K + 16 + 2 * c));
            wide_order(dots[r][z]);
            if constexpr (kWhich == 0) wide_order(dots6[r][z]);
          }
        }
      }
    }
    for (int r = 0; r < RM; ++r) {
      const __m512 xs = _mm512_set1_ps(xscale[r * nb]);
      for (int z = 0; z < RZ; ++z) {
        __m512 a = _mm512_load_ps(acc[r][z]);
        a = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dots[r][z]), xs), kWhich == 2 ? s1[z] : s0[z], a);
        if constexpr (kWhich == 0) a = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dots6[r][z]), xs), s1[z], a);
        _mm512_store_ps(acc[r][z], a);
      }
    }
    __asm__("" : "+m"(acc));
  };
  if constexpr (kOnePass) {
    pass(std::integral_constant<int, 0>{});
  } else {
    pass(std::integral_constant<int, 1>{});
    pass(std::integral_constant<int, 2>{});
  }
}

// A 2-bit group (k2K) of RM rows x 2 * RZ panels into the float sums: `tile`'s k2K loop and float step, lane
// for lane, in passes as wide_group6 (both sub-blocks at once for two rows or fewer; else sub-block 0's sum
// and float step, then sub-block 1's and the min term). Values are unpacked in bytes, then widened.
template <int RM, int RZ, typename S>
__attribute__((always_inline)) inline void wide_group2(const Operands<S>& op, float (&acc)[RM][RZ][2 * kLanes], const uint8_t* chunks,
                                                       const S* scales, const S* mins, const int16_t* x, int64_t at) {
  const int64_t pb = op.panel_bytes, fs = op.scales_per_row * kLanes, nb = op.nb;
  constexpr bool kOnePass = RM <= 2;
  constexpr int kScales = kPanelGroupBytes<2>;
  __m512 s0[RZ], s1[RZ], mn0[RZ], mn1[RZ], dm[RZ];
  for (int z = 0; z < RZ; ++z) {
    const __m512 d = two_factors(scales + 2 * z * fs, scales + (2 * z + 1) * fs);
    dm[z] = two_factors(mins + 2 * z * fs, mins + (2 * z + 1) * fs);
    for (int half = 0; half < 2; ++half) {  // sub-block `half`'s sc | mn << 4 of the two panels' 8 columns
      const uint8_t* a = chunks + 2 * z * pb + kScales + half * kLanes;
      const __m128i both = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(a + pb)));
      const __m128i nibble = _mm_set1_epi8(0x0F);
      const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(both, nibble)));
      const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(both, 4), nibble)));
      (half == 0 ? s0 : s1)[z] = _mm512_mul_ps(d, sc);
      (half == 0 ? mn0 : mn1)[z] = mn;
    }
  }
  // Pass 0: both sub-blocks (sums[0] and sums[1]); 1: the first alone; 2: the second alone, then the mins.
  const auto pass = [&](auto which) {
    constexpr int kWhich = decltype(which)::value;
    constexpr bool kLow = kWhich != 2, kHigh = kWhich != 1;
    __m512i sums[kWhich == 0 ? 2 : 1][RM][RZ];
    for (auto& part : sums)
      for (auto& row : part)
        for (auto& sum : row) sum = _mm512_setzero_si512();
    auto& dots = sums[0];
    auto& dots1 = sums[kWhich == 0 ? 1 : 0];
    for (int c = 0; c < 4; ++c) {
      __m512i q[4][RZ];
      for (int z = 0; z < RZ; ++z) {
        const __m256i both = two_chunks(chunks + 2 * z * pb + c * 16, chunks + (2 * z + 1) * pb + c * 16);
        const __m256i two = _mm256_set1_epi8(0x03);
        if constexpr (kLow) {
          q[0][z] = _mm512_cvtepu8_epi16(_mm256_and_si256(both, two));
          q[1][z] = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(both, 2), two));
        }
        if constexpr (kHigh) {
          q[2][z] = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(both, 4), two));
          q[3][z] = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(both, 6), two));
        }
      }
      for (int r = 0; r < RM; ++r) {
        const int16_t* xr = x + r * op.K + 2 * c;
        for (int z = 0; z < RZ; ++z) {
          if constexpr (kLow)
            dots[r][z] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(dots[r][z], q[0][z], pair16(xr)), q[1][z], pair16(xr + 8));
          if constexpr (kWhich == 0)
            dots1[r][z] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(dots1[r][z], q[2][z], pair16(xr + 16)), q[3][z], pair16(xr + 24));
          if constexpr (kWhich == 2)
            dots[r][z] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(dots[r][z], q[2][z], pair16(xr + 16)), q[3][z], pair16(xr + 24));
          wide_order(dots[r][z]);
          if constexpr (kWhich == 0) wide_order(dots1[r][z]);
        }
      }
    }
    for (int r = 0; r < RM; ++r) {
      const int64_t row = at + r * nb;
      const __m512 xs = _mm512_set1_ps(op.xscale[row]);
      const __m512 x0 = _mm512_set1_ps(static_cast<float>(op.xsum16[2 * row]));
      const __m512 x1 = _mm512_set1_ps(static_cast<float>(op.xsum16[2 * row + 1]));
      for (int z = 0; z < RZ; ++z) {
        __m512 a = _mm512_load_ps(acc[r][z]);
        a = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dots[r][z]), xs), kWhich == 2 ? s1[z] : s0[z], a);
        if constexpr (kWhich == 0) a = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dots1[r][z]), xs), s1[z], a);
        if constexpr (kHigh) {
          const __m512 m = _mm512_fmadd_ps(mn1[z], x1, _mm512_mul_ps(mn0[z], x0));
          a = _mm512_fmadd_ps(_mm512_mul_ps(m, xs), dm[z], a);
        }
        _mm512_store_ps(acc[r][z], a);
      }
    }
    __asm__("" : "+m"(acc));
  };
  if constexpr (kOnePass) pass(std::integral_constant<int, 0>{});
  else pass(std::integral_constant<int, 1>{}), pass(std::integral_constant<int, 2>{});
}

// Rows m0 .. m0+RM, panels p0 .. p0+2*RZ: `tile`'s loop with a vector for each two panels. The high-bit
// planes (5 and 6 bits) are unpacked 32 bytes at a time in 256-bit operations (a 512-bit one costs two
// on Zen 4), then widened: the same int16 as `tile`'s.
template <int Bits, int RM, int RZ, MinKind Min, typename S>
__attribute__((noinline)) void wide_tile(const Operands<S>& op, int64_t m0, int64_t p0) {

  constexpr int kGroupBytes = kPanelGroupBytes<Bits>;
  constexpr int RP = 2 * RZ;
  constexpr bool kFloatMin = Min == kStoredMins || Min == kScaledMins;
  alignas(64) float acc[RM][RZ][2 * kLanes];
  for (int r = 0; r < RM; ++r)
    for (int z = 0; z < RZ; ++z) _mm512_store_ps(acc[r][z], _mm512_setzero_ps());
  const int64_t pb = op.panel_bytes, fs = op.scales_per_row * kLanes;  // next panel's weights, factors
  const uint8_t* w = op.w + p0 * pb;
  const S* scales = op.scales + p0 * fs;
  const S* mins = Min == kStoredMins ? op.mins + p0 * fs : nullptr;
  const int64_t nb = op.nb, groups_per_scale = op.groups_per_scale;
  const int16_t* const x0 = op.xq + m0 * op.K;
  const float* const xscale = op.xscale + m0 * nb;
  const float* const xsum = op.xsum + m0 * nb;
  const int32_t* const xmin = Min == kFoldedMin ? op.xmin + m0 * nb : nullptr;
  int64_t sg = 0, left = groups_per_scale;
  // The group kPrefetchGroups ahead, followed as in `tile` (no division a group).
  int64_t ahead_g = kPrefetchGroups % nb, ahead_panels = kPrefetchGroups / nb * RP;
  int64_t ahead_sg = ahead_g / groups_per_scale, ahead_left = groups_per_scale - ahead_g % groups_per_scale;
  // A lone row's integer sums in two chains a vector (the low and the high nibbles, or the even and
  // odd chunks), added at the group's end: with one, each vector's 16 dependent `vpdpwssd` a group
  // waited on each other's latency (an integer sum is exact in any order: the same bits).
  constexpr bool kSplit = RM == 1;
  for (int64_t g = 0; g < nb; ++g) {
    __m512i dots[RM][RZ], dots2[RZ];
    // Folded mins: the integer sums start at the rows' xmin (where a sum starts does not change it).
    for (int r = 0; r < RM; ++r) {
      const __m512i start = Min == kFoldedMin ? _mm512_set1_epi32(xmin[r * nb + g]) : _mm512_setzero_si512();
      for (int z = 0; z < RZ; ++z) dots[r][z] = start;
    }
    for (int z = 0; z < RZ; ++z) dots2[z] = _mm512_setzero_si512();
    const uint8_t* chunks = w + g * kGroupBytes;
    {  // as in `tile`: the group kPrefetchGroups ahead, this tile's panels then the next tile's
      const uint8_t* at = w + ahead_panels * pb + ahead_g * kGroupBytes;
      const int64_t factors_at = ahead_panels * fs + ahead_sg * kLanes;
      for (int p = 0; p < RP; ++p)
        for (int line = 0; line < kGroupBytes; line += 64) Isa::prefetch(at + p * pb + line);
      for (int p = 0; p < RP; ++p) {
        Isa::prefetch(scales + factors_at + p * fs);
        if constexpr (Min == kStoredMins) Isa::prefetch(mins + factors_at + p * fs);
      }
      if (++ahead_g == nb) {
        ahead_g = 0, ahead_panels += RP, ahead_sg = 0, ahead_left = groups_per_scale;
      } else if (--ahead_left == 0) {
        ++ahead_sg, ahead_left = groups_per_scale;
      }
    }
    const int16_t* x = x0 + g * kBlock;
    if constexpr (Bits == k2K) {
      wide_group2<RM, RZ>(op, acc, chunks, scales + sg * kLanes, mins + sg * kLanes, x, m0 * nb + g);
      if (--left == 0) {
        ++sg;
        left = groups_per_scale;
      }
      continue;
    }
    if constexpr (Bits == 6) {
      wide_group6<RM, RZ>(op, acc, chunks, scales + sg * kLanes, x, xscale + g);
      if (--left == 0) {
        ++sg;
        left = groups_per_scale;
      }
      continue;
    }
    if constexpr (four_bit(Bits)) {
      for (int c = 0; c < 8; ++c) {
        __m512i lo[RZ], hi[RZ];
        for (int z = 0; z < RZ; ++z) {
          if constexpr (table_values(Bits)) {  // in bytes through the table (both 128-bit halves), then widened
            const __m256i both = two_chunks(chunks + 2 * z * pb + c * 16, chunks + (2 * z + 1) * pb + c * 16);
            const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
            const __m256i nibble = _mm256_set1_epi8(0x0F);
            lo[z] = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(table, _mm256_and_si256(both, nibble)));
            hi[z] = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(both, 4), nibble)));
          } else {
            const __m512i both = _mm512_cvtepu8_epi16(two_chunks(chunks + 2 * z * pb + c * 16, chunks + (2 * z + 1) * pb + c * 16));
            lo[z] = _mm512_and_si512(both, _mm512_set1_epi16(0x0F));
            hi[z] = _mm512_srli_epi16(both, 4);
          }
        }
        for (int r = 0; r < RM; ++r) {
          const __m512i xa = pair16(x + r * op.K + 2 * c), xb = pair16(x + r * op.K + 16 + 2 * c);
          for (int z = 0; z < RZ; ++z) dot_pair<kSplit>(dots[r][z], dots2[z], lo[z], xa, hi[z], xb);
        }
      }
    } else if constexpr (five_bit(Bits)) {  // `tile`'s 5-bit loop, two panels a vector
      for (int h = 0; h < 2; ++h) {
        __m256i high[RZ];
        for (int z = 0; z < RZ; ++z) high[z] = two_chunks(chunks + 2 * z * pb + 128 + h * 16, chunks + (2 * z + 1) * pb + 128 + h * 16);
        for (int j = 0; j < 4; ++j) {
          const int c = 4 * h + j;
          __m512i lo[RZ], hi[RZ];
          for (int z = 0; z < RZ; ++z) {  // in bytes, then widened, as 6 bits (wide_group6)
            const __m256i both = two_chunks(chunks + 2 * z * pb + c * 16, chunks + (2 * z + 1) * pb + c * 16);
            const __m256i nibble = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
            lo[z] = _mm512_cvtepu8_epi16(_mm256_or_si256(_mm256_and_si256(both, nibble), _mm256_and_si256(_mm256_slli_epi16(high[z], 4), bit4)));
            hi[z] = _mm512_cvtepu8_epi16(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(both, 4), nibble), _mm256_and_si256(high[z], bit4)));
            high[z] = _mm256_srli_epi16(high[z], 1);
          }
          for (int r = 0; r < RM; ++r) {
            const __m512i xa = pair16(x + r * op.K + 2 * c), xb = pair16(x + r * op.K + 16 + 2 * c);
            for (int z = 0; z < RZ; ++z) dot_pair<kSplit>(dots[r][z], dots2[z], lo[z], xa, hi[z], xb);
          }
        }
      }
    } else {
      for (int c = 0; c < 16; c += 2) {
        __m512i q0[RZ], q1[RZ];
        for (int z = 0; z < RZ; ++z) {
          q0[z] = _mm512_cvtepi8_epi16(two_chunks(chunks + 2 * z * pb + c * 16, chunks + (2 * z + 1) * pb + c * 16));
          q1[z] = _mm512_cvtepi8_epi16(two_chunks(chunks + 2 * z * pb + c * 16 + 16, chunks + (2 * z + 1) * pb + c * 16 + 16));
        }
        for (int r = 0; r < RM; ++r) {
          const __m512i xa = pair16(x + r * op.K + 2 * c), xb = pair16(x + r * op.K + 2 * c + 2);
          for (int z = 0; z < RZ; ++z) dot_pair<kSplit>(dots[r][z], dots2[z], q0[z], xa, q1[z], xb);
        }
      }
    }
    if constexpr (kSplit)
      for (int z = 0; z < RZ; ++z) dots[0][z] = _mm512_add_epi32(dots[0][z], dots2[z]);
    __m512 ws[RZ], mn[RZ];
    for (int z = 0; z < RZ; ++z) {
      const int64_t at = 2 * z * fs + sg * kLanes;
      ws[z] = two_factors(scales + at, scales + at + fs);
      if constexpr (Min == kStoredMins) mn[z] = two_factors(mins + at, mins + at + fs);
      if constexpr (Min == kScaledMins) mn[z] = _mm512_mul_ps(ws[z], _mm512_set1_ps(op.min_per_scale));
      if constexpr (Bits == kIQ4XS) {  // as `tile`: d * (ls - 32), exact
        const uint8_t* k_factors = chunks + 2 * z * pb + kKScaleOffset<Bits>;
        ws[z] = _mm512_mul_ps(ws[z], two_subscales(k_factors, k_factors + pb));
      }
      if constexpr (k_factors_in(Bits) && Min == kStoredMins) {  // as `tile`: d * sc, -dmin * mn, exact
        const uint8_t* k_factors = chunks + 2 * z * pb + kKScaleOffset<Bits>;
        ws[z] = _mm512_mul_ps(ws[z], two_k_factors(k_factors, k_factors + pb));
        mn[z] = _mm512_mul_ps(mn[z], two_k_factors(k_factors + kLanes, k_factors + pb + kLanes));
      }
    }
    for (int r = 0; r < RM; ++r) {
      const __m512 xs = _mm512_set1_ps(xscale[r * nb + g]);
      for (int z = 0; z < RZ; ++z)
        _mm512_store_ps(acc[r][z], _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dots[r][z]), xs), ws[z],
                                                   _mm512_load_ps(acc[r][z])));
      if constexpr (kFloatMin) {
        const __m512 xm = _mm512_set1_ps(xsum[r * nb + g]);
        for (int z = 0; z < RZ; ++z) _mm512_store_ps(acc[r][z], _mm512_fmadd_ps(xm, mn[z], _mm512_load_ps(acc[r][z])));
      }
    }
    __asm__("" : "+m"(acc));
    if (--left == 0) {
      ++sg;
      left = groups_per_scale;
    }
  }
  for (int r = 0; r < RM; ++r) {
    for (int z = 0; z < RZ; ++z) {
      const int64_t n0 = (p0 + 2 * z) * kLanes;
      float* dst = op.at(m0 + r, n0);
      __m512 y = _mm512_load_ps(acc[r][z]);
      if (n0 + 2 * kLanes <= op.N) {
        if (op.bias != nullptr) y = _mm512_add_ps(y, _mm512_loadu_ps(op.bias + n0));
        _mm512_storeu_ps(dst, y);
      } else {  // panel p0 + 2z + 1 is the last, N not a multiple of 8: lanes past N are padding
        alignas(64) float lanes[2 * kLanes], bias[2 * kLanes] = {};
        if (op.bias != nullptr) std::copy(op.bias + n0, op.bias + op.N, bias);
        _mm512_store_ps(lanes, _mm512_add_ps(y, _mm512_load_ps(bias)));
        std::copy(lanes, lanes + (op.N - n0), dst);
      }
    }
  }
}

template <int Bits, int RM, int RZ, MinKind Min, typename S>
void wide_tile_upto(const Operands<S>& op, int64_t m0, int64_t p0, int rm, int rz) {
  if constexpr (RM > 1) {
    if (rm < RM) return wide_tile_upto<Bits, RM - 1, RZ, Min>(op, m0, p0, rm, rz);
  }
  if constexpr (RZ > 1) {
    if (rz < RZ) return wide_tile_upto<Bits, RM, RZ - 1, Min>(op, m0, p0, rm, rz);
  }
  wide_tile<Bits, RM, RZ, Min>(op, m0, p0);
}

template <int Bits, int RM, int RZ, typename S>
void wide_tile_upto(const Operands<S>& op, int64_t m0, int64_t p0, int rm, int rz) {
  if constexpr (Bits == 8 || Bits == 6 || table_values(Bits)) {  // qlinear takes no mins with these
    wide_tile_upto<Bits, RM, RZ, kNoMin>(op, m0, p0, rm, rz);
  } else if constexpr (k_factors_in(Bits)) {  // always its -dmin (qlinear checks)
    wide_tile_upto<Bits, RM, RZ, kStoredMins>(op, m0, p0, rm, rz);
  } else {
    switch (min_kind(op)) {
      case kNoMin: return wide_tile_upto<Bits, RM, RZ, kNoMin>(op, m0, p0, rm, rz);
      case kFoldedMin: return wide_tile_upto<Bits, RM, RZ, kFoldedMin>(op, m0, p0, rm, rz);
      case kStoredMins: return wide_tile_upto<Bits, RM, RZ, kStoredMins>(op, m0, p0, rm, rz);
      case kScaledMins: return wide_tile_upto<Bits, RM, RZ, kScaledMins>(op, m0, p0, rm, rz);
    }
  }
}
#else
constexpr bool kWide = false;
constexpr int kWideRows = 4;
constexpr int kWideVectors = 1;
constexpr int kFewWideRows = 4;
constexpr int kFewWideVectors = 1;
inline bool wide_tiles_enabled() { return false; }
#endif

// Tiles (rows x panels) that fit the register file: 2 * RP widened chunks, RM * RP integer
// sums, RM * RP float sums and two broadcast pairs. Steps of one or two rows (decodes) take
// more panels, having no rows to share a chunk with.
constexpr int kTileRows = 4;
constexpr int kTilePanels = Isa::kRegisters >= 32 ? 4 : 2;
// With pairs pre-broadcast (all of K), 4 bits take 3 panels where group_4x3 does not; 8 bits, two widened
// chunks a panel, keep 2.
constexpr int kPrebroadcastPanels4 = 3;
constexpr int kDecodePanels = Isa::kRegisters >= 32 ? 6 : 3;

// The block loop around the micro-kernel. Tasks are blocks of panels x blocks of rows (a row
// block kept small enough to stay in L2, a panel block's weights in L2), claimed in order, so
// the threads walk the row blocks under one panel block together and its weights come from
// memory once.
// silu(gate) * up over a row's n columns, in float32: elementwise.cpp's silu_and_mul, the same
// silu8 (vec8.h), then the product.
inline void silu_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  using namespace pagedserve_vec;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) store8(out + j, silu8(load8(gate + j)) * load8(up + j));
  if (j < n) {
    alignas(32) float act[8] = {};
    std::copy(gate + j, gate + n, act);
    store8(act, silu8(load8(act)));
    for (int64_t i = 0; j + i < n; ++i) out[j + i] = act[i] * up[j + i];
  }
}

// With `silu_out`: N = 2I is [gate | up] (I a multiple of 8) and the result is silu(gate) * up,
// (M, I) at silu_out: each task takes its gate panels and the up panels I / 8 further, into a
// scratch of its own (in L2), and writes only the product. The (M, 2I) output that silu_and_mul
// read back (128 MB at 1.7B for a 2048-token step, paged in fresh at every layer) is never made.
template <int Bits, typename S>
void int_qlinear(const Operands<S>& op, float* silu_out = nullptr) {
  // the panels the tasks divide: all of them, or the gate's (each task also takes the same up panels)
  const int64_t panels = (op.N + kLanes - 1) / kLanes / (silu_out != nullptr ? 2 : 1);
  // Every format takes the wide tiles where the build has them (AVX2's assembly is 4 bits only).
  constexpr bool kWideBits = true;
  // 6 bits hold two integer sums an output and a plane of high bits a panel: with 32 registers, half the
  // panels a tile (a 1 x 6 tile's 12 sums, 6 high planes and 12 widened chunks spilled), still dividing
  // the tasks' whole tiles below. k2K's two sums and four widened values a chunk likewise.
  constexpr bool kHalfTiles = (Bits == 6 || Bits == k2K) && Isa::kRegisters >= 32;
  constexpr int kDecodeTile = kHalfTiles ? kDecodePanels / 2 : kDecodePanels;
  constexpr int kRowsTile = kHalfTiles ? kTilePanels / 2 : kTilePanels;
  const bool wide_enabled = kWideBits && wide_tiles_enabled();  // once, on the calling thread (tasks run on others)
  const bool wide = kWide && op.M > 2 && wide_enabled;
  const bool few_wide = op.M <= kFewWideRows;  // the wide tiles' shape: 6 x 3 or 8 x 2 (above)
  const int64_t tile_rows = !wide ? kTileRows : few_wide ? kFewWideRows : kWideRows;
  int64_t block_rows = std::clamp<int64_t>((256 << 10) / (op.K * 2) / tile_rows * tile_rows, tile_rows, 64);
  int64_t block_panels = std::clamp<int64_t>((256 << 10) / op.panel_bytes / 12 * 12, 12, 48);
  bool each_use = false;  // pairs broadcast at each use, not once a task (AVX2's few rows of 4 bits, below)
#if defined(PAGEDSERVE_GROUP_ASM)
  // AVX2's sliced 4-bit tiles (sliced_tiles_4x3; 4 bits with mins stored, folded or none: a min made
  // from the scales that is not an integer takes `tile`) keep a K slice of the task's rows, pairs and
  // weights in cache at a time, not all of K: the largest tasks whatever K. Each slice's pairs are
  // broadcast once a task (K = 8192 had tasks of 12 panels, the broadcast ~10% of the product) and
  // the weights read from memory once a row block (K = 8192 had blocks of 16 rows).
  //
  // Below kSlicedMinRows rows (a speculative verification's 1 + k rows, a few decodes) the 4 x 2 tiles that
  // broadcast the pairs at each use, panels outer, are the faster, with the same bits (docs/benchmarks.md);
  // from 8 rows the sliced ones win, and the pre-broadcast tiles were slower than either below 8. At 3 rows
  // the sliced path had no whole 4-row tile and took these already.
  const bool group_asm = four_bit(Bits) && !table_values(Bits) && (op.mins != nullptr || op.xmin != nullptr || op.min_per_scale == 0.f);
  const bool sliced = group_asm && op.M >= kSlicedMinRows;
  each_use = group_asm && op.M > 2 && !sliced;
  if (sliced) {
    block_rows = 64;
    block_panels = 48;
  }
#endif
  int64_t row_blocks = (op.M + block_rows - 1) / block_rows;
  // Row blocks of about equal size (a multiple of the tile's rows): 143 rows (a prompt's chunk
  // and 15 decodes) are 48 + 48 + 47, not 64 + 64 + 15. Rounding up to the tile can leave the
  // last blocks empty (6-row tiles, 721 rows: 12 blocks of 61 rounded to 66, the twelfth from row 726),
  // so the count follows the size: no task without rows.
  block_rows = ((op.M + row_blocks - 1) / row_blocks + tile_rows - 1) / tile_rows * tile_rows;
  row_blocks = (op.M + block_rows - 1) / block_rows;
  const int64_t threads = at::get_num_threads();
  // Enough panel blocks for every thread to get several (one decode: all the parallelism).
  while (block_panels > 12 && row_blocks * ((panels + block_panels - 1) / block_panels) < 4 * threads)
    block_panels /= 2;
  // The panels of the path's whole tiles (below): a task's panels start at a multiple of it, so
  // that only the last task of a row block ends in a narrower tile (which broadcasts at each use).
  // (AVX2's 4 bits: group_4x3 or the pre-broadcast tiles, 3 panels either way; below kSlicedMinRows, 2.)
  int64_t tile_panels = op.M <= 2 ? kDecodePanels : !wide ? kTilePanels : 2 * (few_wide ? kFewWideVectors : kWideVectors);
  if (op.M > 2 && Isa::kPrebroadcast && four_bit(Bits) && !each_use) tile_panels = kPrebroadcastPanels4;
  int64_t panel_blocks = (panels + block_panels - 1) / block_panels;
  if (row_blocks == 1) {  // one row block (decodes): as many blocks for each thread, of about equal size
    // Tiles of more than 2 rows broadcast each K slice's pairs once a task (sliced_tiles_4x3,
    // 4 rows at a time): twice the panels a task halves that.
    const int64_t balanced = op.M <= 2 ? kBalancedPanels : 2 * kBalancedPanels;
    panel_blocks = threads * ((panels + threads * balanced - 1) / (threads * balanced));
  }
  // Task t's panels: whole tiles [t * tiles / n, (t + 1) * tiles / n) of the row block's `tiles`.
  const int64_t whole_tiles = (panels + tile_panels - 1) / tile_panels;
  // A task count that the threads divide: 3 row blocks x 5 panel blocks gave one thread 8 tasks
  // and the other 7.
  while (row_blocks * panel_blocks % threads != 0) ++panel_blocks;
  panel_blocks = std::min(panel_blocks, whole_tiles);
  // Output rows [m_begin, m_end) x panels [p_begin, p_end) into op.out.
  // `next_p`: the first panel of what the thread most likely computes next (prefetched ahead).
  const auto compute = [&](const Operands<S>& op, int64_t m_begin, int64_t m_end, int64_t p_begin, int64_t p_end,
                           int64_t next_p) {
    if (op.M <= 2) {
#if defined(PAGEDSERVE_HAS_WIDE_TILES)
      // One or two rows on the 512-bit tiles (a vector for each two panels; kDecodePanels = 2 *
      // kFewWideVectors, so tasks start on whole tiles either way). One row gained only once its sums ran in
      // two chains a panel (wide_tile's kSplit); docs/benchmarks.md has the figures.
      if constexpr (kWideBits) if (wide_enabled) {
        const auto wide_rows = [&](auto rows) {
          constexpr int RM = decltype(rows)::value, RP = 2 * kFewWideVectors;
          for (int64_t p0 = p_begin; p0 < p_end; p0 += RP) {
            const int np = static_cast<int>(std::min<int64_t>(RP, p_end - p0));
            if (np >= 2) wide_tile_upto<Bits, RM, kFewWideVectors>(op, m_begin, p0, RM, np / 2);
            if (np % 2) tile_upto<Bits, RM, 1>(op, m_begin, p0 + np - 1, RM, 1);
          }
        };
        if (op.M == 2) wide_rows(std::integral_constant<int, 2>{});
        else wide_rows(std::integral_constant<int, 1>{});
        return;
      }
#endif
      for (int64_t p0 = p_begin; p0 < p_end; p0 += kDecodeTile)
        tile_upto<Bits, 2, kDecodeTile>(op, m_begin, p0, static_cast<int>(m_end - m_begin),
                                        static_cast<int>(std::min<int64_t>(kDecodeTile, p_end - p0)));
      return;
    }
#if defined(PAGEDSERVE_HAS_WIDE_TILES)
    if constexpr (kWideBits) if (wide) {  // two panels a vector; a last odd panel on the 8-lane tile
      const auto tiles = [&](auto rows, auto vectors) {  // RM x RZ wide tiles over the task
        constexpr int RM = decltype(rows)::value, RZ = decltype(vectors)::value, RP = 2 * RZ;
        for (int64_t p0 = p_begin; p0 < p_end; p0 += RP) {
          const int np = static_cast<int>(std::min<int64_t>(RP, p_end - p0));
          for (int64_t m0 = m_begin; m0 < m_end; m0 += RM) {
            const int rm = static_cast<int>(std::min<int64_t>(RM, m_end - m0));
            if (np >= 2) wide_tile_upto<Bits, RM, RZ>(op, m0, p0, rm, np / 2);
            if (np % 2)
              for (int64_t m1 = m0; m1 < m0 + rm; m1 += kTileRows)
                tile_upto<Bits, kTileRows, 1>(op, m1, p0 + np - 1, static_cast<int>(std::min<int64_t>(kTileRows, m0 + rm - m1)), 1);
          }
        }
      };
      if (few_wide) {
        tiles(std::integral_constant<int, kFewWideRows>{}, std::integral_constant<int, kFewWideVectors>{});
      } else {
        tiles(std::integral_constant<int, kWideRows>{}, std::integral_constant<int, kWideVectors>{});
      }
      return;
    }
#endif
#if defined(PAGEDSERVE_GROUP_ASM)
    // whole 4 x 3 tiles in assembly, K in slices; the edges broadcast at each use
    if (sliced) {
      const int64_t tiles = (p_end - p_begin) / 3;
      const int64_t row_tiles = (m_end - m_begin) / kTileRows;
      thread_local std::vector<float> storage;  // the slice's pairs, its factors, the tiles' float sums
      storage.resize(4 * kSlicePairs * kLanes + kSliceGroups * 12 + row_tiles * tiles * kSlicedTileFloats + 16);
      int32_t* const xb = reinterpret_cast<int32_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
      float* const xf = reinterpret_cast<float*>(xb + 4 * kSlicePairs * kLanes);
      float* const acc = xf + kSliceGroups * 12;  // 64-byte aligned: the pairs and factors are multiples of 64 bytes
      if (row_tiles > 0 && tiles > 0) sliced_tiles_4x3<Bits>(op, m_begin, row_tiles, p_begin, tiles, acc, xb, xf, next_p);
      for (int64_t m0 = m_begin; m0 < m_end; m0 += kTileRows) {  // the edges: panels past whole tiles, rows past 4s
        const int rm = static_cast<int>(std::min<int64_t>(kTileRows, m_end - m0));
        int64_t p0 = rm == kTileRows ? p_begin + 3 * tiles : p_begin;
        for (; p0 < p_end; p0 += kTilePanels)
          tile_upto<Bits, kTileRows, kTilePanels>(op, m0, p0, rm, static_cast<int>(std::min<int64_t>(kTilePanels, p_end - p0)));
      }
      return;
    }
#endif
    // 8 bits (and 4 bits that group_4x3 does not take), rows outer: each 4 rows broadcast once for
    // the task's panels, where 4 rows' pairs (K x 64 bytes) leave room in a 512 KB L2 for the
    // task's weights (up to 256 KB); K = 8192 (1.7B's down projection, 512 KB of pairs) keeps the
    // 4 x 2 tiles that broadcast at each use. The bound is reasoned from the cache sizes: runs
    // with and without it on that shape could not tell them apart.
    if (Isa::kPrebroadcast && op.K * 64 <= (192 << 10) && !each_use) {
      // 64-byte aligned: a madd operand that crosses a cache line costs more.
      thread_local std::vector<int32_t> broadcast_storage;
      const int64_t pairs = op.K / 2;
      if (broadcast_storage.size() < static_cast<size_t>(kTileRows * pairs * kLanes + 16))
        broadcast_storage.resize(kTileRows * pairs * kLanes + 16);
      int32_t* const broadcast = reinterpret_cast<int32_t*>((reinterpret_cast<uintptr_t>(broadcast_storage.data()) + 63) & ~uintptr_t{63});
      for (int64_t m0 = m_begin; m0 < m_end; m0 += kTileRows) {
        const int rm = static_cast<int>(std::min<int64_t>(kTileRows, m_end - m0));
        for (int r = 0; r < rm; ++r) Isa::broadcast_pairs(broadcast + r * pairs * kLanes, op.xq + (m0 + r) * op.K, pairs);
        Operands<S> rows = op;
        rows.xb = broadcast;
        constexpr int RP = four_bit(Bits) ? kPrebroadcastPanels4 : kTilePanels;
        for (int64_t p0 = p_begin; p0 < p_end; p0 += RP)
          tile_upto<Bits, kTileRows, RP, true>(rows, m0, p0, rm, static_cast<int>(std::min<int64_t>(RP, p_end - p0)));
      }
    } else {
      for (int64_t p0 = p_begin; p0 < p_end; p0 += kRowsTile) {
        const int rp = static_cast<int>(std::min<int64_t>(kRowsTile, p_end - p0));
        for (int64_t m0 = m_begin; m0 < m_end; m0 += kTileRows)
          tile_upto<Bits, kTileRows, kRowsTile>(op, m0, p0, static_cast<int>(std::min<int64_t>(kTileRows, m_end - m0)),
                                                rp);
      }
    }
  };
  const auto run_task = [&](int64_t task) {
    const int64_t pb = task / row_blocks;
    const int64_t p_begin = pb * whole_tiles / panel_blocks * tile_panels;
    const int64_t p_end = std::min(panels, (pb + 1) * whole_tiles / panel_blocks * tile_panels);
    const int64_t m_begin = task % row_blocks * block_rows, m_end = std::min(op.M, m_begin + block_rows);
    if (silu_out == nullptr) return compute(op, m_begin, m_end, p_begin, p_end, p_end);
    const int64_t width = (p_end - p_begin) * kLanes;  // the task's columns of gate, and of up
    thread_local std::vector<float> storage;
    storage.resize((m_end - m_begin) * 2 * width + 16);
    float* const gate = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
    Operands<S> part = op;
    part.out = gate, part.out_row0 = m_begin, part.out_stride = 2 * width, part.out_panel0 = p_begin;
    compute(part, m_begin, m_end, p_begin, p_end, p_begin + panels);
    part.out = gate + width, part.out_panel0 = p_begin + panels;
    compute(part, m_begin, m_end, p_begin + panels, p_end + panels, p_end);
    for (int64_t m = m_begin; m < m_end; ++m) {
      const float* row = gate + (m - m_begin) * 2 * width;
      silu_mul_row(row, row + width, silu_out + m * panels * kLanes + p_begin * kLanes, width);
    }
  };
  if (row_blocks == 1) {
    parallel_ranges(panel_blocks, run_task);
  } else {
    parallel_tasks(panel_blocks * row_blocks, run_task);
  }
}

// x (M, K) float32 or bfloat16; qweight (P, K/32, 128) uint8 (4 bits; 144 with sub-scales; bits 4 | 0x200:
// indices into kIQ4Values, 136 with IQ4_XS's ls - 32, no mins), (P, K/32, 160)
// uint8 (5 bits; 176 with sub-scales), (P, K/32, 208) uint8 (6 bits) or (P, K/32, 256) int8 (8 bits),
// P = ceil(N / 8) panels; scales, mins (P, K/group_size, 8) float32 or float16 (6 bits: scales are Q6_K's d,
// group_size 256; mins only for 4 and 5 bits; or none, and min = scale * min_per_scale, a power of two such
// as Q4_0's -8 or Q5_0's -16, which reads fewer bytes a weight); bias (N,) -> (M, N) in x's dtype.
// With silu_mul: x float32, N = 2I a multiple of 16 ([gate | up]) -> silu(gate) * up (M, I) in float32.
at::Tensor qlinear(
    const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
    const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias, int64_t bits,
    int64_t group_size, int64_t N, double min_per_scale, bool silu_mul) {
  // bits 4 | kTable: 4-bit indices into kIQ4Values (IQ4_NL, IQ4_XS), symmetric.
  const bool table = bits == kIQ4NL;
  if (table) bits = 4;
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 5 || bits == 6 || bits == 8,
              "quant_linear: bits must be 2, 4, 5, 6, 8 or 4 | 0x200");
  TORCH_CHECK(!silu_mul || (x.scalar_type() == at::kFloat && N % (2 * kLanes) == 0),
              "quant_linear_silu_mul: x float32, out_features a multiple of 16 ([gate | up])");
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 3 && scales.dim() == 3, "quant_linear: x 2-D, panelled weights 3-D");
  const int64_t M = x.size(0), K = x.size(1), P = qweight.size(0);
  TORCH_CHECK(K % kBlock == 0 && group_size % kBlock == 0 && K % group_size == 0,
              "quant_linear: K and group_size must be multiples of 32, K of group_size");
  TORCH_CHECK(N > 0 && (N + kLanes - 1) / kLanes == P, "quant_linear: ", P, " panels do not hold ", N, " columns");
  // 4 and 5 bits come in two layouts each, told apart by their groups' bytes: 128 or 160, or 144 or 176 with
  // Q4_K's or Q5_K's sub-scales; 2 bits only with Q2_K's (80). Through the table: 128, or 136 with IQ4_XS's
  // ls - 32.
  const bool sub_scaled = bits == 2 ||
                          (bits == 4 && qweight.size(2) == (table ? kPanelGroupBytes<kIQ4XS> : kPanelGroupBytes<k4K>)) ||
                          (bits == 5 && qweight.size(2) == kPanelGroupBytes<k5K>);
  const int64_t group_bytes = bits == 2     ? kPanelGroupBytes<k2K>
                              : table       ? (sub_scaled ? kPanelGroupBytes<kIQ4XS> : kPanelGroupBytes<kIQ4NL>)
                              : sub_scaled  ? (bits == 4 ? kPanelGroupBytes<k4K> : kPanelGroupBytes<k5K>)
                              : bits == 4 ? kPanelGroupBytes<4>
                              : bits == 5 ? kPanelGroupBytes<5>
                              : bits == 6 ? kPanelGroupBytes<6>
                                          : kPanelGroupBytes<8>;
  TORCH_CHECK(qweight.size(1) == K / kBlock && qweight.size(2) == group_bytes && qweight.is_contiguous() &&
              qweight.element_size() == 1, "quant_linear: qweight must be (panels, K/32, ", group_bytes,
              ") bytes, K of x");
  TORCH_CHECK(scales.size(0) == P && scales.size(1) == K / group_size && scales.size(2) == kLanes &&
              scales.is_contiguous() && (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf),
              "quant_linear: scales must be float32 or float16 (panels, K/group_size, 8)");
  int exponent = 0;
  TORCH_CHECK(min_per_scale == 0 || ((bits == 4 || bits == 5) && !mins.has_value() && std::fabs(std::frexp(min_per_scale, &exponent)) == 0.5),
              "quant_linear: min_per_scale must be 0, or a power of two for 4 or 5 bits without mins");
  TORCH_CHECK(!table || (!mins.has_value() && min_per_scale == 0), "quant_linear: 4 bits through the table take no mins");
  TORCH_CHECK(table || !sub_scaled || (mins.has_value() && min_per_scale == 0),
              "quant_linear: 2, 4 or 5 bits with sub-scales take their mins (-dmin) and no min_per_scale");
  if (mins.has_value()) {
    TORCH_CHECK((bits == 2 || bits == 4 || bits == 5) && mins->sizes() == scales.sizes() && mins->scalar_type() == scales.scalar_type() &&
                mins->is_contiguous(), "quant_linear: mins must be like scales (4 or 5 bits only)");
  }
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "quant_linear: bias must have N elements");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, silu_mul ? N / 2 : N}, x.options().dtype(at::kFloat));
  // A small step's rounded activations go in this thread's scratch, kept across calls: three tensors a call
  // were a third of what a decode's product costs besides its reads. Large steps (prefill) allocate, so the
  // scratch stays at ~2 MB.
  const int64_t nb = K / kBlock;
  const bool small = M * K <= (int64_t{1} << 20);
  thread_local std::vector<int16_t> xq_scratch;
  thread_local std::vector<float> factor_scratch;
  at::Tensor xq_t, factor_t;
  int16_t* xq;
  float* xscale;
  if (small) {
    if (xq_scratch.size() < static_cast<size_t>(M * K)) xq_scratch.resize(M * K);
    if (factor_scratch.size() < static_cast<size_t>(2 * M * nb)) factor_scratch.resize(2 * M * nb);
    xq = xq_scratch.data(), xscale = factor_scratch.data();
  } else {
    xq_t = at::empty({M, K}, x.options().dtype(at::kShort));
    factor_t = at::empty({2, M, nb}, x.options().dtype(at::kFloat));
    xq = xq_t.data_ptr<int16_t>(), xscale = factor_t.data_ptr<float>();
  }
  float* const xsum = xscale + M * nb;
  // An integral min_per_scale (Q4_0's -8): folded into the integer sums, m * (sum of a block's xq).
  // |sum of 32 (q + m) xq| <= 32 * 32767 * max(31 + m, -m): far inside int32.
  const bool fold = min_per_scale != 0 && std::fabs(min_per_scale) <= 64 && min_per_scale == std::trunc(min_per_scale);
  thread_local std::vector<int32_t> xmin_scratch;
  at::Tensor xmin_t;
  int32_t* xmin = nullptr;
  if (fold && small) {
    if (xmin_scratch.size() < static_cast<size_t>(M * nb)) xmin_scratch.resize(M * nb);
    xmin = xmin_scratch.data();
  } else if (fold) {
    xmin_t = at::empty({M, nb}, x.options().dtype(at::kInt));
    xmin = xmin_t.data_ptr<int32_t>();
  }
  quantize_activations(xf.data_ptr<float>(), M, K, xq, xscale, xsum, xmin, static_cast<int32_t>(min_per_scale));
  // Q2_K's mins are per 16 values: each 16 xq's integer sum, for the min term of each sub-block.
  at::Tensor xsum16_t;
  if (bits == 2) {
    xsum16_t = at::empty({M, K / 16}, x.options().dtype(at::kInt));
    int32_t* const xsum16 = xsum16_t.data_ptr<int32_t>();
    at::parallel_for(0, M * K / 16, 1024, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        int32_t sum = 0;
        for (int j = 0; j < 16; ++j) sum += xq[i * 16 + j];
        xsum16[i] = sum;
      }
    });
  }
  const auto run = [&](auto* sc, auto* mn) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(sc)>>;
    Operands<S> op{xq, xscale, xsum, xmin, nullptr,
                   reinterpret_cast<const uint8_t*>(qweight.data_ptr()), sc, mn,
                   static_cast<float>(min_per_scale),
                   bias.has_value() ? bias_f.data_ptr<float>() : nullptr, out.data_ptr<float>(),
                   M, N, K, nb, qweight.size(1) * qweight.size(2), group_size / kBlock,
                   K / group_size};
    op.out_stride = N;
    if (bits == 2) op.xsum16 = xsum16_t.data_ptr<int32_t>();
    float* const silu_out = silu_mul ? out.data_ptr<float>() : nullptr;
    if (bits == 2) int_qlinear<k2K>(op, silu_out);
    else if (table && sub_scaled) int_qlinear<kIQ4XS>(op, silu_out);
    else if (table) int_qlinear<kIQ4NL>(op, silu_out);
    else if (sub_scaled && bits == 4) int_qlinear<k4K>(op, silu_out);
    else if (sub_scaled) int_qlinear<k5K>(op, silu_out);
    else if (bits == 4) int_qlinear<4>(op, silu_out);
    else if (bits == 5) int_qlinear<5>(op, silu_out);
    else if (bits == 6) int_qlinear<6>(op, silu_out);
    else int_qlinear<8>(op, silu_out);
  };
  if (scales.scalar_type() == at::kHalf) {
    run(scales.data_ptr<c10::Half>(), mins.has_value() ? mins->data_ptr<c10::Half>() : nullptr);
  } else {
    run(scales.data_ptr<float>(), mins.has_value() ? mins->data_ptr<float>() : nullptr);
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

at::Tensor quant_linear(
    const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
    const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias, int64_t bits,
    int64_t group_size, int64_t N, double min_per_scale) {
  return qlinear(x, qweight, scales, mins, bias, bits, group_size, N, min_per_scale, false);
}

// quant_linear then silu_and_mul, in one pass: the same numbers (each output element is the
// kernel's gate and up sums, then silu_and_mul's expression), without the (M, N) float32 output
// between them.
at::Tensor quant_linear_silu_mul(
    const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
    const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias, int64_t bits,
    int64_t group_size, int64_t N, double min_per_scale) {
  return qlinear(x, qweight, scales, mins, bias, bits, group_size, N, min_per_scale, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? bias, int bits, "
        "int group_size, int out_features, float min_per_scale=0) -> Tensor");
  m.def("quant_linear_silu_mul(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? bias, int bits, "
        "int group_size, int out_features, float min_per_scale=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_linear_silu_mul", &quant_linear_silu_mul);
}
