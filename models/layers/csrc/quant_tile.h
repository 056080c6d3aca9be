// The tile family every build has: `tile`, RM rows x RP panels on `Isa`'s 8 lanes (plain C++, AVX2,
// AVX-512), for every format. Each other family runs exactly its arithmetic, lane for lane.
#pragma once

#include "quant_common.h"

namespace {

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
    for (int r = 0; r < RM; ++r) {  // the row's factors first, then one store a sum (as wide_tile)
      const typename Isa::F xs = Isa::broadcast(op.xscale[(m0 + r) * op.nb + g]);
      const typename Isa::F xm = has_min ? Isa::broadcast(op.xsum[(m0 + r) * op.nb + g]) : xs;
      for (int p = 0; p < RP; ++p) {
        typename Isa::F a = Isa::fma(Isa::mul(Isa::to_float(dots[r][p]), xs), ws[p], Isa::load(acc[r][p]));
        if (has_min) a = Isa::fma(xm, mn[p], a);
        Isa::store(acc[r][p], a);
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

}  // namespace
