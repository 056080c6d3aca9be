// AVX2's tile family (no AVX-512, no AVX-VNNI): 4 x 3 tiles of 4 bits in inline assembly (group_4x3) and
// the sliced loop around them (sliced_tiles_4x3). Empty on every other build.
#pragma once

#include "quant_common.h"

namespace {

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

}  // namespace
