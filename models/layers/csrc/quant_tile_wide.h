// AVX-512 VNNI's tile family: two panels a 512-bit vector (`wide_tile`), for every format. On other builds
// only kWide = false and its stand-ins, unless PAGEDSERVE_WIDE_EMULATED builds it on emulated vectors.
#pragma once

#include "quant_tile.h"

namespace {

// ---- Wide tiles (AVX-512 VNNI): two panels a vector --------------------------------------
//
// On a core with two 512-bit pipes (Intel Xeons) a 512-bit `vpdpwssd` does twice the products of
// a 256-bit one in the same slot; on one that splits 512-bit operations in two (Zen 4) it costs two
// and the count of everything else halves. Tiles of two rows or more (prompts, mixed steps,
// verification, decodes) therefore run 16 lanes: the chunks of panels p and p + 1 side by side, so lanes
// 0-7 are panel p's 8 columns and 8-15 panel p + 1's, the pair broadcast to all 16, for every format
// (4, 5, 6 and 8 bits; 5 and 6 bits unpack their bit planes in bytes, then widen). Each lane
// runs exactly the arithmetic of `tile` (quant_tile.h: the integer dot is exact, then the same convert,
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

// The float factors of group g's 2 * RZ panels (chunks: the group's bytes in the first panel; scales, mins: its
// scale group's in the first panel): `tile`'s scale and min, lane for lane.
template <int Bits, MinKind Min, int RZ, typename S>
__attribute__((always_inline)) inline void wide_factors(const Operands<S>& op, const uint8_t* chunks, const S* scales, const S* mins,
                                                        __m512 (&ws)[RZ], __m512 (&mn)[RZ]) {
  const int64_t pb = op.panel_bytes, fs = op.scales_per_row * kLanes;
  for (int z = 0; z < RZ; ++z) {
    ws[z] = two_factors(scales + 2 * z * fs, scales + (2 * z + 1) * fs);
    if constexpr (Min == kStoredMins) mn[z] = two_factors(mins + 2 * z * fs, mins + (2 * z + 1) * fs);
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
}

// `tile`'s float step on 16 lanes: acc += float(dot) * xscale * scale (+ xsum * min).
template <MinKind Min>
__attribute__((always_inline)) inline void wide_float_step(float* acc, __m512i dot, __m512 xs, __m512 ws, __m512 xm, __m512 mn) {
  __m512 a = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), xs), ws, _mm512_load_ps(acc));
  if constexpr (Min == kStoredMins || Min == kScaledMins) a = _mm512_fmadd_ps(xm, mn, a);
  _mm512_store_ps(acc, a);
}

// Row m's float sums of panels p, p + 1 (16 lanes), plus the bias, into the output.
template <typename S>
inline void wide_store(const Operands<S>& op, int64_t m, int64_t p, const float* sums) {
  const int64_t n0 = p * kLanes;
  float* dst = op.at(m, n0);
  __m512 y = _mm512_load_ps(sums);
  if (n0 + 2 * kLanes <= op.N) {
    if (op.bias != nullptr) y = _mm512_add_ps(y, _mm512_loadu_ps(op.bias + n0));
    _mm512_storeu_ps(dst, y);
  } else {  // panel p + 1 is the last, N not a multiple of 8: lanes past N are padding
    alignas(64) float lanes[2 * kLanes], bias[2 * kLanes] = {};
    if (op.bias != nullptr) std::copy(op.bias + n0, op.bias + op.N, bias);
    _mm512_store_ps(lanes, _mm512_add_ps(y, _mm512_load_ps(bias)));
    std::copy(lanes, lanes + (op.N - n0), dst);
  }
}

// Two panels' Q6_K factors of a group: d * sc for its values 0..15 (s0) and 16..31 (s1), as `tile`.
template <int RZ, typename S>
__attribute__((always_inline)) inline void wide_subscales6(const Operands<S>& op, const uint8_t* chunks, const S* scales,
                                                           __m512 (&s0)[RZ], __m512 (&s1)[RZ]) {
  const int64_t pb = op.panel_bytes, fs = op.scales_per_row * kLanes;
  for (int z = 0; z < RZ; ++z) {
    const __m512 d = two_factors(scales + 2 * z * fs, scales + (2 * z + 1) * fs);
    s0[z] = _mm512_mul_ps(d, two_subscales(chunks + 2 * z * pb + kSubScaleOffset, chunks + (2 * z + 1) * pb + kSubScaleOffset));
    s1[z] = _mm512_mul_ps(d, two_subscales(chunks + 2 * z * pb + kSubScaleOffset + kLanes,
                                           chunks + (2 * z + 1) * pb + kSubScaleOffset + kLanes));
  }
}

// A 6-bit group of RM rows x 2 * RZ panels into the float sums: `tile`'s 6-bit loop and float step, lane for
// lane. Two rows or fewer (decodes), and the 8 x 1 tiles that the planner gives 6 bits from 7 rows, take both
// sub-blocks in one pass, two integer sums an output, as `tile`; 6 x 3 tiles (3 to 6 rows) take the group's
// first sub-block (values 0..15: the chunks' low nibbles) and its float step, then the second's: one sum an
// output, so that they fit the 32 registers (36 sums in one pass), each chunk and high plane read twice.
// The float steps are `tile`'s, in its order.
template <int RM, int RZ, typename S>
__attribute__((always_inline)) inline void wide_group6(const Operands<S>& op, float (&acc)[RM][RZ][2 * kLanes], const uint8_t* chunks,
                                                       const S* scales, const int16_t* x, const float* xscale) {
  const int64_t pb = op.panel_bytes, nb = op.nb;
  constexpr bool kOnePass = RM <= 2 || RZ == 1;
  __m512 s0[RZ], s1[RZ];
  wide_subscales6<RZ>(op, chunks, scales, s0, s1);
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
    wide_factors<Bits, Min, RZ>(op, chunks, scales + sg * kLanes, Min == kStoredMins ? mins + sg * kLanes : nullptr, ws, mn);
    // A row's factors read before its sums are stored: a store to acc between them made gcc store each sum
    // twice (after each fused multiply-add), not knowing that xsum is not acc.
    for (int r = 0; r < RM; ++r) {
      const __m512 xs = _mm512_set1_ps(xscale[r * nb + g]);
      const __m512 xm = kFloatMin ? _mm512_set1_ps(xsum[r * nb + g]) : xs;
      for (int z = 0; z < RZ; ++z) wide_float_step<Min>(acc[r][z], dots[r][z], xs, ws[z], xm, mn[z]);
    }
    __asm__("" : "+m"(acc));
    if (--left == 0) {
      ++sg;
      left = groups_per_scale;
    }
  }
  for (int r = 0; r < RM; ++r)
    for (int z = 0; z < RZ; ++z) wide_store(op, m0 + r, p0 + 2 * z, acc[r][z]);
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

// f(std::integral_constant<MinKind, the product's kind>{}): a tile's min step as a template argument.
template <int Bits, typename S, typename F>
void with_min_kind(const Operands<S>& op, const F& f) {
  if constexpr (Bits == 8 || Bits == 6 || table_values(Bits)) {  // qlinear takes no mins with these
    f(std::integral_constant<MinKind, kNoMin>{});
  } else if constexpr (k_factors_in(Bits)) {  // always its -dmin (qlinear checks)
    f(std::integral_constant<MinKind, kStoredMins>{});
  } else {
    switch (min_kind(op)) {
      case kNoMin: return f(std::integral_constant<MinKind, kNoMin>{});
      case kFoldedMin: return f(std::integral_constant<MinKind, kFoldedMin>{});
      case kStoredMins: return f(std::integral_constant<MinKind, kStoredMins>{});
      case kScaledMins: return f(std::integral_constant<MinKind, kScaledMins>{});
    }
  }
}

template <int Bits, int RM, int RZ, typename S>
void wide_tile_upto(const Operands<S>& op, int64_t m0, int64_t p0, int rm, int rz) {
  with_min_kind<Bits>(op, [&](auto min) { wide_tile_upto<Bits, RM, RZ, decltype(min)::value>(op, m0, p0, rm, rz); });
}
#else
constexpr bool kWide = false;
constexpr int kWideRows = 4;
constexpr int kWideVectors = 1;
constexpr int kFewWideRows = 4;
constexpr int kFewWideVectors = 1;
inline bool wide_tiles_enabled() { return false; }
#endif

}  // namespace
