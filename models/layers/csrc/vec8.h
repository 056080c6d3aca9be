// Float arithmetic on explicit 8-lane vectors, shared by the kernels whose sums and transcendental
// functions must round the same way in every ISA build (avx2 ... avx512vnni): GCC's vector types
// compile to one ymm, half a zmm or two xmm, lane by lane the same IEEE operations; chains are
// FMA intrinsics (-ffast-math may reassociate `acc += a * b`, not an FMA) and lane sums go by a
// fixed tree of shuffles. Where the compiler vectorized plain loops instead (`omp simd`, libm's
// vector expf), an AVX-512 build summed 16 lanes where an AVX2 one summed 8, and called another
// expf: RMSNorm and SiLU differed in the last bit between builds and a seeded request's text
// between CPUs. (The generic build, without FMA, rounds its own way.)
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__) || defined(__FMA__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagedserve_vec {

using f32x8 = float __attribute__((vector_size(32)));
using f32x4 = float __attribute__((vector_size(16)));
using i32x8 = int32_t __attribute__((vector_size(32)));

inline f32x8 splat(float x) { return f32x8{x, x, x, x, x, x, x, x}; }
inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, const f32x8& v) { std::memcpy(p, &v, sizeof(v)); }

inline float widen(float x) { return x; }
inline float widen(double x) { return static_cast<float>(x); }  // float64 tensors: computed in float32
inline float widen(c10::Half x) { return static_cast<float>(x); }
inline float widen(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline f32x8 load8(const double* p) {
  return f32x8{widen(p[0]), widen(p[1]), widen(p[2]), widen(p[3]), widen(p[4]), widen(p[5]), widen(p[6]), widen(p[7])};
}

// 8 numbers of a 16-bit cache row as floats (exact: every 16-bit value is a float).
inline f32x8 load8(const c10::Half* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return f32x8{widen(p[0]), widen(p[1]), widen(p[2]), widen(p[3]), widen(p[4]), widen(p[5]), widen(p[6]), widen(p[7])};
#endif
}
inline f32x8 load8(const c10::BFloat16* p) {
#if defined(__AVX2__)
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#else
  return f32x8{widen(p[0]), widen(p[1]), widen(p[2]), widen(p[3]), widen(p[4]), widen(p[5]), widen(p[6]), widen(p[7])};
#endif
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
  for (int64_t i = 0; i < count; ++i) p[i] = static_cast<T>(lanes[i]);
}

// a * b + c as one instruction where the build has FMA: -ffast-math may reassociate a chain of
// `acc += a * b`, but not an FMA, so every chain below runs in the order it is written. (Without
// FMA, the generic build, the order is the compiler's: the same for every row in practice, but
// not by construction.)
inline f32x8 fma8(f32x8 a, f32x8 b, f32x8 c) {
#if defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

// The lane sums of 4 vectors, each by the same tree ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)):
// every add takes shuffles, so there is no chain for -ffast-math to reorder.
inline f32x4 sum_lanes4(f32x8 a0, f32x8 a1, f32x8 a2, f32x8 a3) {
  const f32x4 b0 = __builtin_shufflevector(a0, a0, 0, 1, 2, 3) + __builtin_shufflevector(a0, a0, 4, 5, 6, 7);
  const f32x4 b1 = __builtin_shufflevector(a1, a1, 0, 1, 2, 3) + __builtin_shufflevector(a1, a1, 4, 5, 6, 7);
  const f32x4 b2 = __builtin_shufflevector(a2, a2, 0, 1, 2, 3) + __builtin_shufflevector(a2, a2, 4, 5, 6, 7);
  const f32x4 b3 = __builtin_shufflevector(a3, a3, 0, 1, 2, 3) + __builtin_shufflevector(a3, a3, 4, 5, 6, 7);
  const f32x4 c01 = __builtin_shufflevector(b0, b1, 0, 4, 2, 6) + __builtin_shufflevector(b0, b1, 1, 5, 3, 7);
  const f32x4 c23 = __builtin_shufflevector(b2, b3, 0, 4, 2, 6) + __builtin_shufflevector(b2, b3, 1, 5, 3, 7);
  return __builtin_shufflevector(c01, c23, 0, 1, 4, 5) + __builtin_shufflevector(c01, c23, 2, 3, 6, 7);
}

// e^x lane by lane (Cephes' expf: 2^n e^r, |r| <= ln2 / 2, ~1e-7 relative), the same code for every
// lane: no libm call whose vector and scalar versions round differently. x is clamped to [-87, 88].
inline f32x8 exp8(f32x8 x) {
  x = x < splat(-87.f) ? splat(-87.f) : x;
  x = x > splat(88.f) ? splat(88.f) : x;
  const f32x8 z = x * splat(1.44269504088896341f);
  const i32x8 n = __builtin_convertvector(z + (z < splat(0.f) ? splat(-0.5f) : splat(0.5f)), i32x8);
  const f32x8 nf = __builtin_convertvector(n, f32x8);
  const f32x8 r = fma8(nf, splat(2.12194440e-4f), fma8(nf, splat(-0.693359375f), x));  // x - n ln2, in two parts
  f32x8 p = splat(1.9875691500e-4f);
  p = fma8(p, r, splat(1.3981999507e-3f));
  p = fma8(p, r, splat(8.3334519073e-3f));
  p = fma8(p, r, splat(4.1665795894e-2f));
  p = fma8(p, r, splat(1.6666665459e-1f));
  p = fma8(p, r, splat(5.0000001201e-1f));
  p = fma8(p, r * r, r) + splat(1.f);
  const i32x8 bits = (n + 127) << 23;
  f32x8 two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}
// Holds a value where the code put it: an empty asm that "changes" it, so that -ffast-math can
// neither reassociate a chain through it nor fuse its operation with the next.
inline void hold(f32x8& v) {
#if defined(__AVX2__)  // every build with 256-bit registers is an AVX2 build
  __asm__("" : "+x"(v));
#else
  __asm__("" : "+m"(v));  // the generic build has no 256-bit registers
#endif
}
inline void hold(float& v) { __asm__("" : "+x"(v)); }
inline void hold(double& v) { __asm__("" : "+x"(v)); }

// x * sigmoid(x) = x / (1 + e^-x), lane by lane (exp8 clamps -x to [-87, 88]: the kernels are built
// with -ffast-math, which assumes no infinities).
inline f32x8 silu8(f32x8 x) { return x / (splat(1.f) + exp8(-x)); }

// The sum of x[j]^2 over a row of n numbers in one order for every build: four 8-lane FMA chains
// over 32 numbers a step (then one over 8), their lanes by sum_lanes4's tree, then the tail in order.
template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  f32x8 a0 = splat(0.f), a1 = a0, a2 = a0, a3 = a0;
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const f32x8 v0 = load8(x + j), v1 = load8(x + j + 8), v2 = load8(x + j + 16), v3 = load8(x + j + 24);
    a0 = fma8(v0, v0, a0);
    a1 = fma8(v1, v1, a1);
    a2 = fma8(v2, v2, a2);
    a3 = fma8(v3, v3, a3);
  }
  for (; j + 8 <= n; j += 8) {
    const f32x8 v = load8(x + j);
    a0 = fma8(v, v, a0);
  }
  const f32x4 s = sum_lanes4(a0, a1, a2, a3);
  const f32x4 t = __builtin_shufflevector(s, s, 0, 1, 0, 1) + __builtin_shufflevector(s, s, 2, 3, 2, 3);
  float sum = t[0] + t[1];
  for (; j < n; ++j) {
    const float v = widen(x[j]);
    sum = std::fma(v, v, sum);
  }
  return sum;
}

}  // namespace pagedserve_vec
