// AMX's tile family (Sapphire Rapids and later; the `avx512amx` build): steps of 16 rows or more (8 and 5
// bits: 32) on the int8 tile multiplier, for the formats of one integer sum a group (not Q2_K's or Q6_K's).
// Elsewhere only stand-ins.
//
// AMX multiplies bytes, and the activations are int16: each xq is split exactly as 256 xhi + xlo (xhi its
// signed high byte, xlo its unsigned low byte, Operands::xlo / xhi), and a group's integer dot is
// 256 (xhi . q) + (xlo . q), both by `tdpbssd` / `tdpbusd` on the weights' int8 values (every format's fit a
// signed byte: 4 and 5 bits unsigned, 8 bits, the table's). The sum is the same integer as
// `vpdpwssd`'s, and the float step is `tile`'s, in its order (wide_float_step): a row's bits do not depend
// on the tile it falls in. A tile is 16 rows x 4 panels: four C tiles of 16 x 16 int32 (two panels' 8
// columns each, the wide tiles' lane order), the low and the high bytes' sums of each pair. A task decodes
// each group of its panels once into the tiles' int8 layout and runs it against all of its 16-row tiles.
// Rows past whole 16s and panels past whole 4s take the wide tiles. PAGEDSERVE_AMX_TILES=0 turns them off
// (to compare; the same bits).
#pragma once

#include "quant_tile_wide.h"

#if defined(PAGEDSERVE_HAS_WIDE_TILES) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VBMI__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#if defined(PAGEDSERVE_HAS_WIDE_TILES) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VBMI__)
#define PAGEDSERVE_HAS_AMX_TILES 1
constexpr int kAmxRows = 16;
constexpr int kAmxPanels = 4;  // a tile's panels: two pairs

// Linux gives a process the tiles' register state only when it asks (ARCH_REQ_XCOMP_PERM for XTILEDATA),
// and refuses where the kernel or the hypervisor has not enabled it: exactly where a tile instruction
// would trap, though the CPU lists amx_tile.
inline bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

inline bool amx_tiles_enabled() {
  const char* v = std::getenv("PAGEDSERVE_AMX_TILES");
  return (v == nullptr || std::strcmp(v, "0") != 0) && amx_granted();
}

// Q2_K's and Q6_K's two sums a group (sub-blocks of 16) would take four C tiles for 16 columns, twice the stores
// of the sums: Q6_K's ran no faster than the wide tiles. A `Bits` code, or quant_linear's bits.
constexpr bool amx_format(int bits) { return (bits & 0xFF) != 2 && (bits & 0xFF) != 6; }
// From how many rows a format's steps take the tiles: 4 bits' groups are a byte permutation and a mask each,
// paid back from one 16-row tile; 8 and 5 bits (two permutations, or the high bits' unpacking) from two.
constexpr int amx_min_rows(int bits) { return (bits & 0xFF) == 4 ? kAmxRows : 2 * kAmxRows; }

// The tile registers' shapes (palette 1): C tiles 0-3 (16 rows of 16 int32), A tiles 4-5 (16 rows of a group's
// 32 bytes), B tiles 6-7 (a group's 32 values of 16 columns, 4 a row).
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void amx_configure() {
  AmxConfig config;
  for (int t = 0; t < 4; ++t) config.rows[t] = kAmxRows, config.colsb[t] = 64;
  for (int t = 4; t < 6; ++t) config.rows[t] = kAmxRows, config.colsb[t] = kBlock;
  for (int t = 6; t < 8; ++t) config.rows[t] = kBlock / 4, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

// vpermb's order from a group's chunks c, c + 1 of two panels (32 bytes each, the first panel's then the
// second's; column i's values 2c + t at byte 2i + t of chunk c) to a B-tile row: values 2c .. 2c + 3 of the 16
// columns, 4 bytes a column, the first panel's 8 then the second's (the wide tiles' lane order).
struct AmxRowOrder {
  alignas(64) uint8_t index[64] = {};
  constexpr AmxRowOrder() {
    for (int o = 0; o < 64; ++o) {
      const int column = o / 4, value = o % 4;
      index[o] = static_cast<uint8_t>(column / 8 * 32 + value / 2 * 16 + 2 * (column % 8) + value % 2);
    }
  }
};
constexpr AmxRowOrder kAmxRowOrder{};

// A group of two panels (a, b: their group bytes) as B-tile rows of int8: row j values 4j .. 4j + 3 of the 16
// columns. 8 bits and 4 bits take one byte permutation for each two chunks (4 bits: both nibbles' rows, the
// low nibbles values 0..15, the high ones 16..31); 5 bits unpack their high bits as the wide tiles do, then
// interleave.
template <int Bits>
__attribute__((always_inline)) inline void amx_weights(const uint8_t* a, const uint8_t* b, int8_t (*rows)[64]) {
  const __m512i order = _mm512_load_si512(kAmxRowOrder.index);
  const auto chunk_pair = [&](int c) {  // chunks c, c + 1 of both panels, in row order
    const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c * 16));
    const __m256i second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + c * 16));
    return _mm512_permutexvar_epi8(order, _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1));
  };
  if constexpr (Bits == 8) {
    for (int j = 0; j < 8; ++j) _mm512_store_si512(rows[j], chunk_pair(2 * j));
  } else if constexpr (four_bit(Bits)) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m512i both = chunk_pair(2 * j);
      __m512i lo = _mm512_and_si512(both, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(both, 4), nibble);
      if constexpr (table_values(Bits)) {
        const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
        lo = _mm512_shuffle_epi8(table, lo);
        hi = _mm512_shuffle_epi8(table, hi);
      }
      _mm512_store_si512(rows[j], lo);
      _mm512_store_si512(rows[4 + j], hi);
    }
  } else {
    static_assert(five_bit(Bits));
    // values 2c, 2c + 1 (lo) and 16 + 2c, 17 + 2c (hi) of the 8 chunks as the wide tiles' bytes before widening
    const __m256i nibble = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    __m256i lo[8], hi[8];
    for (int h = 0; h < 2; ++h) {
      __m256i high = two_chunks(a + 128 + h * 16, b + 128 + h * 16);
      for (int j = 0; j < 4; ++j) {
        const int c = 4 * h + j;
        const __m256i both = two_chunks(a + c * 16, b + c * 16);
        lo[c] = _mm256_or_si256(_mm256_and_si256(both, nibble), _mm256_and_si256(_mm256_slli_epi16(high, 4), bit4));
        hi[c] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(both, 4), nibble), _mm256_and_si256(high, bit4));
        high = _mm256_srli_epi16(high, 1);
      }
    }
    // The 16-bit interleave of chunks c, c + 1 gives each 128-bit half 4 columns; the lane shuffle orders them.
    const auto row = [](__m256i u, __m256i v) {
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(u, v)), _mm256_unpackhi_epi16(u, v), 1);
      return _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
    };
    for (int j = 0; j < 4; ++j) {
      _mm512_store_si512(rows[j], row(lo[2 * j], lo[2 * j + 1]));
      _mm512_store_si512(rows[4 + j], row(hi[2 * j], hi[2 * j + 1]));
    }
  }
}

// Rows m0 .. m0 + 16 * row_tiles, panels p0 .. p0 + 4, over all of K, on the tiles amx_configure() set up.
template <int Bits, MinKind Min, typename S>
__attribute__((noinline)) void amx_tiles(const Operands<S>& op, int64_t m0, int64_t row_tiles, int64_t p0) {
  constexpr int kGroupBytes = kPanelGroupBytes<Bits>, RZ = 2, RP = 2 * RZ;
  constexpr int kMaxRows = 64;  // the planner's largest row block
  const int64_t rows = row_tiles * kAmxRows;
  alignas(64) float acc[kMaxRows][RZ][2 * kLanes];
  alignas(64) int8_t weights[RZ][kBlock / 4][64];
  alignas(64) int32_t sums[2 * RZ][kAmxRows][2 * kLanes];
  for (int64_t r = 0; r < rows; ++r)
    for (int z = 0; z < RZ; ++z) _mm512_store_ps(acc[r][z], _mm512_setzero_ps());
  const int64_t pb = op.panel_bytes, fs = op.scales_per_row * kLanes, K = op.K, nb = op.nb;
  const uint8_t* w = op.w + p0 * pb;
  const S* scales = op.scales + p0 * fs;
  const S* mins = Min == kStoredMins ? op.mins + p0 * fs : nullptr;
  const uint8_t* const xlo = op.xlo + m0 * K;
  const int8_t* const xhi = op.xhi + m0 * K;
  int64_t sg = 0, left = op.groups_per_scale;
  for (int64_t g = 0; g < nb; ++g) {
    const uint8_t* chunks = w + g * kGroupBytes;
    if (g + kPrefetchGroups < nb)
      for (int p = 0; p < RP; ++p)
        for (int line = 0; line < kGroupBytes; line += 64) Isa::prefetch(chunks + p * pb + kPrefetchGroups * kGroupBytes + line);
    for (int z = 0; z < RZ; ++z) amx_weights<Bits>(chunks + 2 * z * pb, chunks + (2 * z + 1) * pb, weights[z]);
    __m512 ws[RZ], mn[RZ];
    wide_factors<Bits, Min, RZ>(op, chunks, scales + sg * kLanes, Min == kStoredMins ? mins + sg * kLanes : nullptr, ws, mn);
    _tile_loadd(6, weights[0][0], 64);
    _tile_loadd(7, weights[1][0], 64);
    for (int64_t t = 0; t < row_tiles; ++t) {
      const int64_t at = t * kAmxRows * K + g * kBlock;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      _tile_loadd(4, xlo + at, K);
      _tile_loadd(5, xhi + at, K);
      _tile_dpbusd(0, 4, 6);
      _tile_dpbssd(1, 5, 6);
      _tile_dpbusd(2, 4, 7);
      _tile_dpbssd(3, 5, 7);
      _tile_stored(0, sums[0], 64);
      _tile_stored(1, sums[1], 64);
      _tile_stored(2, sums[2], 64);
      _tile_stored(3, sums[3], 64);
      for (int r = 0; r < kAmxRows; ++r) {
        const int64_t row = t * kAmxRows + r, at_row = (m0 + row) * nb + g;
        const __m512 xs = _mm512_set1_ps(op.xscale[at_row]);
        const __m512 xm = Min == kStoredMins || Min == kScaledMins ? _mm512_set1_ps(op.xsum[at_row]) : xs;
        for (int z = 0; z < RZ; ++z) {  // 256 (xhi . q) + (xlo . q), from the rows' folded min where it has one
          __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums[2 * z + 1][r]), 8), _mm512_load_si512(sums[2 * z][r]));
          if constexpr (Min == kFoldedMin) dot = _mm512_add_epi32(dot, _mm512_set1_epi32(op.xmin[at_row]));
          wide_float_step<Min>(acc[row][z], dot, xs, ws[z], xm, mn[z]);
        }
      }
    }
    if (--left == 0) {
      ++sg;
      left = op.groups_per_scale;
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int z = 0; z < RZ; ++z) wide_store(op, m0 + r, p0 + 2 * z, acc[r][z]);
}

// Rows m0 .. m0 + 16 * row_tiles (at most 64), panels p_begin .. p_end (a multiple of 4 of them).
template <int Bits, typename S>
void amx_panels(const Operands<S>& op, int64_t m0, int64_t row_tiles, int64_t p_begin, int64_t p_end) {
  amx_configure();
  with_min_kind<Bits>(op, [&](auto min) {
    for (int64_t p0 = p_begin; p0 < p_end; p0 += kAmxPanels) amx_tiles<Bits, decltype(min)::value>(op, m0, row_tiles, p0);
  });
  _tile_release();
}

// xq split into its low (unsigned) and high (signed) bytes, n values.
inline void amx_split_bytes(const int16_t* xq, int64_t n, uint8_t* lo, int8_t* hi) {
  at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      lo[i] = static_cast<uint8_t>(xq[i] & 0xFF);
      hi[i] = static_cast<int8_t>(xq[i] >> 8);
    }
  });
}
#else
constexpr int kAmxRows = 16;
constexpr int kAmxPanels = 4;  // a tile's panels: two pairs
inline bool amx_tiles_enabled() { return false; }
constexpr bool amx_format(int) { return false; }
#endif

}  // namespace
