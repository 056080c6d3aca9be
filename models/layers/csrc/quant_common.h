// quant_linear's shared pieces: the block and panel constants, the thread-team splits, the rounding of the
// activations to int16, `Isa` (8 lanes, the one piece that differs between the ISA builds), what a product
// reads (`Operands`) and the formats' `Bits` codes with their group sizes. The formats themselves are
// described at the top of quant_linear.cpp; each tile family has a header of its own (quant_tile*.h).
// These headers are quant_linear.cpp's alone, in an unnamed namespace as when they were one file: internal
// linkage, so gcc inlines and clones the tiles as it would in one source.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
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
inline void quantize_activations(const float* x, int64_t M, int64_t K, int16_t* xq, float* xscale, float* xsum,
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
// then adds the bias; only the register file differs (the tile families, quant_tile*.h).
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

// What one product reads: the int16 activations, the panelled weights, their factors.
template <typename S>
struct Operands {
  const int16_t* xq;     // (M, K)
  const float* xscale;   // (M, K/32)
  const float* xsum;     // (M, K/32): xscale * sum of the block's xq
  const int32_t* xmin;   // (M, K/32): min_per_scale * sum of the block's xq where that is folded, or nullptr
  const int32_t* xb;     // the tile's rows as (rows, K/2, 8): each pair of xq in all 8 lanes (Isa::kPrebroadcast)
  const uint8_t* w;      // (P, nb, chunk bytes): see the top of quant_linear.cpp
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
  // (M, K) each: xq's low bytes (unsigned) and high bytes (signed), xq = 256 xhi + xlo, for AMX's int8 tiles; or nullptr
  const uint8_t* xlo = nullptr;
  const int8_t* xhi = nullptr;
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

}  // namespace
