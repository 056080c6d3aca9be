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
// The code: quant_common.h holds what every tile family shares (the activations' rounding, `Isa`'s 8 lanes,
// `Operands`, the formats' `Bits` codes); a tile family is a header, each running the same arithmetic lane for
// lane: quant_tile.h (`tile`, every build), quant_tile_avx2.h (AVX2's assembly, 4 bits), quant_tile_wide.h
// (AVX-512 VNNI, two panels a vector), quant_tile_amx.h (AMX's int8 tiles, on the int16 activations' two
// bytes). This file is the planner (`int_qlinear`: which tiles over which rows, panels and threads) and the op. A new format is its `Bits` code and group bytes, its block decoding in each
// family that takes it (the planner sends the others to `tile`), and its tests.
//
// Determinism: every output element runs the same instruction sequence, group by group in
// order, whatever tile it falls in, however many rows the step has and whichever thread
// computes it: the integer dot is exact, and no float sum is ever split. A row's result
// depends on that row alone.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

#include "quant_common.h"
#include "quant_tile.h"
#include "quant_tile_avx2.h"
#include "quant_tile_wide.h"
#include "quant_tile_amx.h"

namespace {

// Tiles (rows x panels) that fit the register file: 2 * RP widened chunks, RM * RP integer
// sums, RM * RP float sums and two broadcast pairs. Steps of one or two rows (decodes) take
// more panels, having no rows to share a chunk with.
constexpr int kTileRows = 4;
constexpr int kTilePanels = Isa::kRegisters >= 32 ? 4 : 2;
// With pairs pre-broadcast (all of K), 4 bits take 3 panels where group_4x3 does not; 8 bits, two widened
// chunks a panel, keep 2.
constexpr int kPrebroadcastPanels4 = 3;
constexpr int kDecodePanels = Isa::kRegisters >= 32 ? 6 : 3;
constexpr int64_t kSpanBytes = 1 << 20;  // a span's activations (int_qlinear, below): about a core's L2

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

// The block loop around the micro-kernel. Tasks are blocks of panels x blocks of rows (a row
// block kept small enough to stay in L2, a panel block's weights in L2), claimed in order, so
// the threads walk the row blocks under one panel block together and its weights come from
// memory once a span: the row blocks of about kSpanBytes of activations, whose blocks stay in L2
// while each panel block's weights pass (a 2048-row step's 8 MB at K = 2048 came from L3 or memory
// again for each panel block: docs/benchmarks.md).
//
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
  // AMX's tiles (quant_tile_amx.h) where qlinear split the rows' bytes for them: row blocks of whole 16s.
  const bool amx = wide && op.xlo != nullptr;
  const int64_t tile_rows = amx ? kAmxRows : !wide ? kTileRows : few_wide ? kFewWideRows : kWideRows;
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
  // 6 bits from 7 rows take 8 x 1 wide tiles in one pass (wide_group6): each chunk and high plane read and
  // shifted once, where 8 x 2 tiles took two passes (their 32 sums would not fit) and read them twice.
  constexpr bool kOnePass6 = Bits == 6;
  int64_t tile_panels = op.M <= 2 ? kDecodePanels : !wide ? kTilePanels : 2 * (few_wide ? kFewWideVectors : kOnePass6 ? 1 : kWideVectors);
  if (op.M > 2 && Isa::kPrebroadcast && four_bit(Bits) && !each_use) tile_panels = kPrebroadcastPanels4;
  if (amx) tile_panels = kAmxPanels;  // amx_panels' tiles
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
      // RM x RZ wide tiles over rows [m_begin, m_end) x panels [p_begin, p_end)
      const auto tiles = [&](auto rows, auto vectors, int64_t m_begin, int64_t m_end, int64_t p_begin, int64_t p_end) {
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
      const auto wide_tiles = [&](int64_t m_begin, int64_t m_end, int64_t p_begin, int64_t p_end) {
        if (few_wide) {
          tiles(std::integral_constant<int, kFewWideRows>{}, std::integral_constant<int, kFewWideVectors>{}, m_begin, m_end, p_begin, p_end);
        } else if constexpr (kOnePass6) {
          tiles(std::integral_constant<int, kWideRows>{}, std::integral_constant<int, 1>{}, m_begin, m_end, p_begin, p_end);
        } else {
          tiles(std::integral_constant<int, kWideRows>{}, std::integral_constant<int, kWideVectors>{}, m_begin, m_end, p_begin, p_end);
        }
      };
#if defined(PAGEDSERVE_HAS_AMX_TILES)
      if constexpr (amx_format(Bits)) if (amx) {  // whole 16 rows x pairs of panels; the rest on the wide tiles
        const int64_t row_tiles = (m_end - m_begin) / kAmxRows, m_split = m_begin + row_tiles * kAmxRows;
        const int64_t p_split = p_begin + (p_end - p_begin) / kAmxPanels * kAmxPanels;
        if (row_tiles > 0 && p_split > p_begin) amx_panels<Bits>(op, m_begin, row_tiles, p_begin, p_split);
        wide_tiles(m_begin, m_split, p_split, p_end);
        wide_tiles(m_split, m_end, p_begin, p_end);
        return;
      }
#endif
      wide_tiles(m_begin, m_end, p_begin, p_end);
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
  // The row blocks of a span (above): its activations as int16, and AMX's bytes.
  const int64_t span_blocks = std::max<int64_t>(1, kSpanBytes / (block_rows * op.K * (amx ? 4 : 2)));
  const auto run_task = [&](int64_t task) {
    const int64_t span = task / (panel_blocks * span_blocks), first = span * span_blocks;
    const int64_t in_span = std::min(span_blocks, row_blocks - first), rest = task - span * panel_blocks * span_blocks;
    const int64_t pb = rest / in_span;
    const int64_t p_begin = pb * whole_tiles / panel_blocks * tile_panels;
    const int64_t p_end = std::min(panels, (pb + 1) * whole_tiles / panel_blocks * tile_panels);
    const int64_t m_begin = (first + rest % in_span) * block_rows, m_end = std::min(op.M, m_begin + block_rows);
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
  // AMX's tiles take the activations as bytes (quant_tile_amx.h), for the formats and steps they take, where the build
  // and the OS have them.
  at::Tensor xbytes_t;
#if defined(PAGEDSERVE_HAS_AMX_TILES)
  if (amx_format(bits) && M >= amx_min_rows(bits) && wide_tiles_enabled() && amx_tiles_enabled()) {
    xbytes_t = at::empty({2, M, K}, x.options().dtype(at::kByte));
    amx_split_bytes(xq, M * K, xbytes_t.data_ptr<uint8_t>(), reinterpret_cast<int8_t*>(xbytes_t.data_ptr<uint8_t>() + M * K));
  }
#endif
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
    if (xbytes_t.defined()) {
      op.xlo = xbytes_t.data_ptr<uint8_t>();
      op.xhi = reinterpret_cast<const int8_t*>(op.xlo + M * K);
    }
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
