// quant_linear.cpp's 16-lane tiles (built only for AVX-512 VNNI) on plain C++ vectors, so that a
// machine without AVX-512 can test their logic: the layout of two panels a vector, the factors,
// the edges. Each function below does what the intrinsic it replaces does, lane by lane (Intel's
// pseudocode), including the single rounding of the fused multiply-add. Built by
// tests/models/test_wide_tiles.py with the AVX2 flags; the real instructions are held to the same
// test where the CPU has them (tests/models/test_quantization.py, in every build's own tiles).
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

struct emu512i { union { int8_t i8[64]; uint8_t u8[64]; int16_t i16[32]; int32_t i32[16]; }; };
struct emu512 { float f[16]; };
struct emu512d { float f[16]; };  // only ever a float vector in disguise here

static inline emu512i emu_setzero_si512() { return emu512i{}; }
static inline emu512 emu_setzero_ps() { return emu512{}; }
static inline emu512 emu_load_ps(const float* p) { emu512 r; std::memcpy(r.f, p, 64); return r; }
static inline void emu_store_ps(float* p, emu512 v) { std::memcpy(p, v.f, 64); }
static inline emu512i emu_set1_epi16(int16_t v) { emu512i r; for (auto& e : r.i16) e = v; return r; }
static inline emu512i emu_set1_epi32(int32_t v) { emu512i r; for (auto& e : r.i32) e = v; return r; }
static inline emu512 emu_set1_ps(float v) { emu512 r; for (auto& e : r.f) e = v; return r; }
static inline emu512i emu_cvtepu8_epi16(__m256i a) {
  uint8_t b[32]; std::memcpy(b, &a, 32); emu512i r; for (int i = 0; i < 32; ++i) r.i16[i] = b[i]; return r;
}
static inline emu512i emu_cvtepi8_epi16(__m256i a) {
  int8_t b[32]; std::memcpy(b, &a, 32); emu512i r; for (int i = 0; i < 32; ++i) r.i16[i] = b[i]; return r;
}
static inline emu512i emu_and_si512(emu512i a, emu512i b) { for (int i = 0; i < 16; ++i) a.i32[i] &= b.i32[i]; return a; }
static inline emu512i emu_srli_epi16(emu512i a, int n) {
  for (auto& e : a.i16) e = static_cast<int16_t>(static_cast<uint16_t>(e) >> n); return a;
}
static inline emu512i emu_or_si512(emu512i a, emu512i b) { for (int i = 0; i < 16; ++i) a.i32[i] |= b.i32[i]; return a; }
static inline emu512i emu_slli_epi16(emu512i a, int n) {
  for (auto& e : a.i16) e = static_cast<int16_t>(static_cast<uint16_t>(e) << n); return a;
}
static inline emu512i emu_sub_epi16(emu512i a, emu512i b) {
  for (int i = 0; i < 32; ++i) a.i16[i] = static_cast<int16_t>(a.i16[i] - b.i16[i]); return a;
}
static inline emu512i emu_cvtepi8_epi32(__m128i a) {
  int8_t b[16]; std::memcpy(b, &a, 16); emu512i r; for (int i = 0; i < 16; ++i) r.i32[i] = b[i]; return r;
}
static inline emu512i emu_cvtepu8_epi32(__m128i a) {
  uint8_t b[16]; std::memcpy(b, &a, 16); emu512i r; for (int i = 0; i < 16; ++i) r.i32[i] = b[i]; return r;
}
static inline emu512i emu_add_epi32(emu512i a, emu512i b) { for (int i = 0; i < 16; ++i) a.i32[i] += b.i32[i]; return a; }
static inline emu512i emu_dpwssd_epi32(emu512i acc, emu512i a, emu512i b) {  // no saturation, as vpdpwssd
  for (int i = 0; i < 16; ++i)
    acc.i32[i] += int32_t{a.i16[2 * i]} * b.i16[2 * i] + int32_t{a.i16[2 * i + 1]} * b.i16[2 * i + 1];
  return acc;
}
static inline emu512d emu_castpd256_pd512(__m256d a) { emu512d r{}; std::memcpy(r.f, &a, 32); return r; }
static inline emu512d emu_insertf64x4(emu512d a, __m256d b, int imm) { std::memcpy(a.f + 8 * (imm & 1), &b, 32); return a; }
static inline emu512 emu_castpd_ps(emu512d a) { emu512 r; std::memcpy(r.f, a.f, 64); return r; }
static inline emu512 emu_cvtph_ps(__m256i a) {
  uint16_t h[16]; std::memcpy(h, &a, 32); emu512 r; for (int i = 0; i < 16; ++i) r.f[i] = _cvtsh_ss(h[i]); return r;
}
static inline emu512 emu_cvtepi32_ps(emu512i a) { emu512 r; for (int i = 0; i < 16; ++i) r.f[i] = static_cast<float>(a.i32[i]); return r; }
static inline emu512 emu_mul_ps(emu512 a, emu512 b) { for (int i = 0; i < 16; ++i) a.f[i] *= b.f[i]; return a; }
static inline emu512 emu_add_ps(emu512 a, emu512 b) { for (int i = 0; i < 16; ++i) a.f[i] += b.f[i]; return a; }
static inline emu512 emu_fmadd_ps(emu512 a, emu512 b, emu512 c) {
  for (int i = 0; i < 16; ++i) c.f[i] = std::fma(a.f[i], b.f[i], c.f[i]); return c;
}

#define __m512i emu512i
#define __m512 emu512
#define _mm512_setzero_si512 emu_setzero_si512
#define _mm512_setzero_ps emu_setzero_ps
#define _mm512_load_ps emu_load_ps
#define _mm512_loadu_ps emu_load_ps
#define _mm512_store_ps emu_store_ps
#define _mm512_storeu_ps emu_store_ps
#define _mm512_set1_epi16 emu_set1_epi16
#define _mm512_set1_epi32 emu_set1_epi32
#define _mm512_set1_ps emu_set1_ps
#define _mm512_cvtepu8_epi16 emu_cvtepu8_epi16
#define _mm512_cvtepi8_epi16 emu_cvtepi8_epi16
#define _mm512_and_si512 emu_and_si512
#define _mm512_srli_epi16 emu_srli_epi16
#define _mm512_or_si512 emu_or_si512
#define _mm512_slli_epi16 emu_slli_epi16
#define _mm512_sub_epi16 emu_sub_epi16
#define _mm512_cvtepi8_epi32 emu_cvtepi8_epi32
#define _mm512_cvtepu8_epi32 emu_cvtepu8_epi32
#define _mm512_add_epi32 emu_add_epi32
#define _mm512_dpwssd_epi32 emu_dpwssd_epi32
#define _mm512_castpd256_pd512 emu_castpd256_pd512
#define _mm512_insertf64x4 emu_insertf64x4
#define _mm512_castpd_ps emu_castpd_ps
#define _mm512_cvtph_ps emu_cvtph_ps
#define _mm512_cvtepi32_ps emu_cvtepi32_ps
#define _mm512_mul_ps emu_mul_ps
#define _mm512_add_ps emu_add_ps
#define _mm512_fmadd_ps emu_fmadd_ps

#define PAGEDSERVE_WIDE_EMULATED 1
#include "../../../models/layers/csrc/quant_linear.cpp"
