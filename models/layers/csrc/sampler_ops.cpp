// The sampler's row ops, for CPUs: softmax / log_softmax, argmax and the inverse-CDF draw with
// top-k, top-p and min-p, each row on one thread and in one order of arithmetic for every ISA
// build, so that a seeded request draws the same tokens and logprobs on any CPU
// (engine/sampling/ calls them through models/layers/cpu_kernels.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "vec8.h"

namespace {

using namespace pagedserve_vec;

// Whether a lane is -inf, read from its bits: -ffast-math lets the compiler assume no infinities in
// float comparisons, and a sampler's logits hold -inf for every token a row may not take.
inline i32x8 is_minus_inf(f32x8 x) {
  i32x8 bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits == static_cast<int32_t>(0xFF800000u);
}

// One row of V logits -> softmax (probabilities; exactly 0 where the logit is -inf) or log_softmax
// (-inf there), in one order for every ISA build: the max, then e^(x - max) by exp8 summed in four
// 8-lane chains (each add held in its order, vec8.h: -ffast-math reassociates a plain
// chain), their lanes by sum_lanes4's tree. torch's softmax sums 8 or 16 lanes as the CPU allows and
// calls its own exp: a seeded request's logprobs differed between an AVX2 and an AVX-512 CPU.
template <bool kLog>
void softmax_row(const float* x, float* out, int64_t n) {
  const f32x8 minus_inf = splat(-std::numeric_limits<float>::infinity());
  // The row as whole vectors: a last partial one is copied into `padded`, -inf past n.
  const int64_t whole = n / 8 * 8, vectors = (n + 7) / 8;
  alignas(32) float padded[8], padded_out[8];
  store8(padded, minus_inf);
  std::copy(x + whole, x + n, padded);
  const auto in = [&](int64_t v) { return v * 8 < whole ? load8(x + v * 8) : load8(padded); };
  f32x8 m8 = minus_inf;
  for (int64_t v = 0; v < vectors; ++v) m8 = in(v) > m8 ? in(v) : m8;
  float m = m8[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, m8[i]);  // a max is exact in any order
  const f32x8 mv = splat(m), zero = splat(0.f);
  // Vector v's terms go to sum v % 4; each add held in its place.
  f32x8 s0 = zero, s1 = zero, s2 = zero, s3 = zero;
  float* const dst = kLog ? nullptr : out;
  int64_t v = 0;
  for (; v + 4 <= whole / 8; v += 4) {
    const f32x8 x0 = load8(x + 8 * v), x1 = load8(x + 8 * v + 8), x2 = load8(x + 8 * v + 16), x3 = load8(x + 8 * v + 24);
    const f32x8 e0 = is_minus_inf(x0) ? zero : exp8(x0 - mv), e1 = is_minus_inf(x1) ? zero : exp8(x1 - mv);
    const f32x8 e2 = is_minus_inf(x2) ? zero : exp8(x2 - mv), e3 = is_minus_inf(x3) ? zero : exp8(x3 - mv);
    s0 = s0 + e0, s1 = s1 + e1, s2 = s2 + e2, s3 = s3 + e3;
    hold(s0), hold(s1), hold(s2), hold(s3);
    if constexpr (!kLog) {
      store8(dst + 8 * v, e0), store8(dst + 8 * v + 8, e1), store8(dst + 8 * v + 16, e2), store8(dst + 8 * v + 24, e3);
    }
  }
  for (; v < vectors; ++v) {  // the last 0-3 vectors, the partial one padded
    const f32x8 xv = in(v), e = is_minus_inf(xv) ? zero : exp8(xv - mv);
    f32x8& sum = v % 4 == 0 ? s0 : v % 4 == 1 ? s1 : v % 4 == 2 ? s2 : s3;
    sum = sum + e;
    hold(sum);
    if constexpr (!kLog) {
      if (8 * v < whole) store8(dst + 8 * v, e);
      else store8(padded_out, e), std::copy(padded_out, padded_out + (n - whole), dst + whole);
    }
  }
  const f32x4 s4 = sum_lanes4(s0, s1, s2, s3);
  const f32x4 t = __builtin_shufflevector(s4, s4, 0, 1, 0, 1) + __builtin_shufflevector(s4, s4, 2, 3, 2, 3);
  const float sum = t[0] + t[1];  // >= 1 (the max's own term) unless every logit is -inf
  if constexpr (kLog) {  // (x - max) - log(sum), -inf where x is
    const f32x8 log_sum = splat(std::log(sum));
    for (int64_t v = 0; v < vectors; ++v) {
      const f32x8 xv = in(v);
      f32x8 d = xv - mv;
      hold(d);
      const f32x8 y = is_minus_inf(xv) ? minus_inf : d - log_sum;
      if (8 * v < whole) store8(out + 8 * v, y);
      else store8(padded_out, y), std::copy(padded_out, padded_out + (n - whole), out + whole);
    }
  } else if (sum > 0.f) {
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < n; ++j) out[j] *= inv;  // element by element: the same in any build
  }
}

// logits (N, V) float32 -> softmax or log_softmax of each row, each row on one thread.
at::Tensor softmax_rows(const at::Tensor& logits, bool log) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "softmax_rows: logits (N, V) float32");
  auto in = logits.contiguous();
  auto out = at::empty_like(in);
  const int64_t n = in.size(1);
  const float* xp = in.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, in.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (log) softmax_row<true>(xp + r * n, op + r * n, n);
      else softmax_row<false>(xp + r * n, op + r * n, n);
    }
  });
  return out;
}

// logits (N, V) float32 -> (N,) int64: each row's first maximum, as torch.argmax (a NaN counts as
// the largest: the first NaN), each row on one thread. Blocks of 256, each block's max on four 8-lane
// chains (a max is exact in any order) and whether it holds a NaN; the row's first block holding its
// max (or a NaN) is then searched for the first index. One pass where greedy sampling took three
// torch ops (block amax, argmax, the block's argmax), each reading a row the forward pass has left
// cold. NaN is found from its bits (-ffast-math assumes there is none).
constexpr int64_t kArgmaxBlock = 256;

inline bool is_nan_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

// Block [b0, b1)'s max; `nan` set where it holds a NaN.
float block_max(const float* x, int64_t b0, int64_t b1, bool& nan) {
  const f32x8 minus_inf = splat(-std::numeric_limits<float>::infinity());
  const i32x8 magnitude = {0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff};
  const i32x8 inf_bits = {0x7f800000, 0x7f800000, 0x7f800000, 0x7f800000, 0x7f800000, 0x7f800000, 0x7f800000, 0x7f800000};
  const int64_t whole = b0 + (b1 - b0) / 32 * 32;
  f32x8 m0 = minus_inf, m1 = minus_inf, m2 = minus_inf, m3 = minus_inf;
  i32x8 nans = {};
  for (int64_t j = b0; j < whole; j += 32) {
    __builtin_prefetch(x + j + 1024), __builtin_prefetch(x + j + 1040);  // 4 KB ahead: a row from memory
    const f32x8 v0 = load8(x + j), v1 = load8(x + j + 8), v2 = load8(x + j + 16), v3 = load8(x + j + 24);
    m0 = v0 > m0 ? v0 : m0, m1 = v1 > m1 ? v1 : m1, m2 = v2 > m2 ? v2 : m2, m3 = v3 > m3 ? v3 : m3;
    i32x8 b[4];
    std::memcpy(b, x + j, sizeof b);
    nans |= ((b[0] & magnitude) > inf_bits) | ((b[1] & magnitude) > inf_bits) | ((b[2] & magnitude) > inf_bits) |
            ((b[3] & magnitude) > inf_bits);
  }
  m0 = m1 > m0 ? m1 : m0, m2 = m3 > m2 ? m3 : m2, m0 = m2 > m0 ? m2 : m0;
  float m = m0[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, m0[i]);
  for (int i = 0; i < 8; ++i) nan = nan || nans[i] != 0;
  for (int64_t j = whole; j < b1; ++j) {
    nan = nan || is_nan_bits(x[j]);
    m = std::max(m, x[j]);
  }
  return m;
}

int64_t argmax_row(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t best = 0;  // the first block holding m (every logit -inf: block 0, index 0, as torch)
  for (int64_t b0 = 0; b0 < n; b0 += kArgmaxBlock) {
    const int64_t b1 = std::min(n, b0 + kArgmaxBlock);
    bool nan = false;
    const float bm = block_max(x, b0, b1, nan);
    if (nan) {  // the row's first NaN is in its first block with one
      for (int64_t j = b0; j < b1; ++j)
        if (is_nan_bits(x[j])) return j;
    }
    if (bm > m) m = bm, best = b0;  // strictly: a later block's equal max is not the first
  }
  for (int64_t j = best; j < std::min(n, best + kArgmaxBlock); ++j)
    if (x[j] == m) return j;
  return best;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "argmax_rows: logits (N, V) float32, V > 0");
  auto in = logits.contiguous();
  auto out = at::empty({in.size(0)}, in.options().dtype(at::kLong));
  const int64_t n = in.size(1);
  const float* xp = in.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // Rows on threads only where there are many: waking the team costs more than a row.
  at::parallel_for(0, in.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * n, n);
  });
  return out;
}

// One row's inverse-CDF draw from softmax(x / t) cut by top-k, top-p and min-p: the first token whose
// running sum of weights e^(x/t - max) passes u times their total; -1 where no token has weight
// (every logit -inf). What the sampler did in torch ops (divide, topk, softmax, cumsums, masks,
// two searchsorteds; docs/benchmarks.md has both times), in 2-3 passes:
// the weights summed in blocks of kDrawBlock (each block on one 8-lane chain, its lanes by one
// tree), the blocks' sums added in order to find the block, then that block's weights one by one.
// A token of weight 0 (a -inf logit, or cut) is never drawn: the running sum cannot pass u * total
// on it unless it had before. The same token on every ISA build.
constexpr int64_t kDrawBlock = 256;

// The lowest z that top-k (k < n) and top-p (p < 1) keep, as the sampler defines them: the k best
// tokens (ties with the k-th stay), then the smallest best-first prefix of those whose probability
// reaches p times theirs (the best always stays; ties with the last kept stay): the highest value
// c such that the tokens at or above c hold that much. -inf: no cut. w: every token's weight
// (exp8's, those the draw uses). Without sorting the vocabulary: one pass puts every token in a
// bucket by its distance below the max (kBuckets of kBucketWidth, then one for all the rest) with
// the buckets' counts and masses; only the bucket where the count reaches k, and the one where the
// mass reaches its share, are sorted. Masses are sums of weights in fixed point (2^-40): integers,
// exact in any order, so the same on every ISA build.
constexpr int kBuckets = 4096;
constexpr float kBucketsPerUnit = 64.f;  // buckets 1/64 of a unit of z wide: the first 64 units below the max

inline int64_t fixed(float w) { return static_cast<int64_t>(static_cast<double>(w) * 0x1p40); }

float cut_threshold(const float* z, const float* w, int64_t n, float m, int64_t k, float p, int16_t* ids) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  std::vector<int64_t> counts(kBuckets + 1, 0), masses(kBuckets + 1, 0);
  int64_t total = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (z[j] == minus_inf) {
      ids[j] = -1;
      continue;
    }
    const float below = (m - z[j]) * kBucketsPerUnit;
    const int id = below < static_cast<float>(kBuckets) ? static_cast<int>(below) : kBuckets;
    ids[j] = static_cast<int16_t>(id);
    ++counts[id];
    masses[id] += fixed(w[j]);
    total += fixed(w[j]);
  }
  const auto sorted_bucket = [&](int b) {  // (value, token) of bucket b, best first
    std::vector<std::pair<float, int64_t>> in;
    in.reserve(counts[b]);
    for (int64_t j = 0; j < n; ++j)
      if (ids[j] == b) in.emplace_back(z[j], j);
    std::sort(in.begin(), in.end(), [](const auto& x, const auto& y) { return x.first > y.first || (x.first == y.first && x.second < y.second); });
    return in;
  };
  // top-k: the k-th best value, and the mass at or above it
  float kth = minus_inf;
  int64_t kept = total;
  int last_bucket = kBuckets;  // the lowest bucket top-p may cut in
  {
    int64_t above = 0;
    int b = 0;
    for (; b <= kBuckets && above + counts[b] < k; ++b) above += counts[b];
    if (b <= kBuckets) {  // else fewer than k tokens in all: no cut by top-k
      const auto in = sorted_bucket(b);
      kth = in[k - above - 1].first;
      kept = 0;
      for (int c = 0; c < b; ++c) kept += masses[c];
      for (const auto& [v, j] : in)
        if (v >= kth) kept += fixed(w[j]);
      last_bucket = b;
    }
  }
  if (p >= 1.f) return kth;
  // top-p: the highest value whose tokens at or above it hold p of the kept mass
  const double want = static_cast<double>(p) * static_cast<double>(kept);
  int64_t before = 0;
  int b = 0;
  for (; b < last_bucket && static_cast<double>(before + masses[b]) < want; ++b) before += masses[b];
  const auto in = sorted_bucket(b);
  float found = in.empty() ? kth : in.back().first;
  for (size_t t = 0; t < in.size(); ++t) {
    before += fixed(w[in[t].second]);
    if (static_cast<double>(before) >= want || (t + 1 < in.size() && in[t + 1].first < kth)) {
      found = in[t].first;
      break;
    }
  }
  return std::max(found, kth);
}

// z: scratch of n rounded up to 8 floats (x / t), weights: the same, block_sums: n / kDrawBlock rounded
// up, ids: n (cut_threshold's buckets).
int64_t draw_row(const float* x, int64_t n, float t, float u, int64_t k, float p, float min_p, float* z,
                 float* weights, float* block_sums, int16_t* ids) {
  const f32x8 minus_inf = splat(-std::numeric_limits<float>::infinity()), zero = splat(0.f), tv = splat(t);
  const int64_t whole = n / 8 * 8, padded_n = (n + 7) / 8 * 8;
  alignas(32) float padded[8];
  store8(padded, minus_inf);
  std::copy(x + whole, x + n, padded);
  f32x8 m8 = minus_inf;
  for (int64_t j = 0; j < padded_n; j += 8) {  // z = x / t (-inf stays -inf; past n, -inf), and its max
    const f32x8 v = j < whole ? load8(x + j) : load8(padded);
    f32x8 q = v / tv;
    hold(q);
    q = is_minus_inf(v) ? minus_inf : q;
    store8(z + j, q);
    m8 = q > m8 ? q : m8;
  }
  float m = m8[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, m8[i]);
  if (m == -std::numeric_limits<float>::infinity()) return -1;
  const f32x8 mv = splat(m);
  float cut = -std::numeric_limits<float>::infinity();
  if (k < n || p < 1.f) {
    for (int64_t j = 0; j < padded_n; j += 8) {  // every token's weight, for top-p's shares
      const f32x8 q = load8(z + j);
      store8(weights + j, is_minus_inf(q) ? zero : exp8(q - mv));
    }
    cut = cut_threshold(z, weights, n, m, k, p, ids);
  }
  // min-p after top-k and top-p: a token less likely than min_p times the best, whose weight is 1
  // (exp8(0) exactly), has a weight below min_p.
  const f32x8 cutv = splat(cut), min_pv = splat(min_p);
  const int64_t blocks = (n + kDrawBlock - 1) / kDrawBlock;
  double sum_all = 0.0;  // float64 from here: a 49152-token row's running sum in float32 moved draws
  for (int64_t b = 0; b < blocks; ++b) {
    f32x8 sum = zero;
    for (int64_t j = b * kDrawBlock; j < std::min(padded_n, (b + 1) * kDrawBlock); j += 8) {
      const f32x8 q = load8(z + j);
      f32x8 e = (is_minus_inf(q) | (q < cutv)) ? zero : exp8(q - mv);
      e = e < min_pv ? zero : e;
      store8(weights + j, e);
      sum = sum + e;
      hold(sum);
    }
    block_sums[b] = sum_lanes4(sum, zero, zero, zero)[0];
    sum_all += block_sums[b];
    hold(sum_all);
  }
  if (!(sum_all > 0.0)) return -1;
  double target = static_cast<double>(u) * sum_all;
  hold(target);
  double before = 0.0;
  int64_t b = 0;
  for (; b + 1 < blocks; ++b) {  // the block where the running sum passes the target (else the last)
    double after = before + block_sums[b];
    hold(after);
    if (after > target) break;
    before = after;
  }
  int64_t last = -1;  // the block's last token with weight: where rounding leaves the target unreached
  for (int64_t j = b * kDrawBlock; j < std::min(n, (b + 1) * kDrawBlock); ++j) {
    if (weights[j] > 0.f) last = j;
    double after = before + weights[j];
    hold(after);
    if (after > target && weights[j] > 0.f) return j;
    before = after;
  }
  if (last >= 0) return last;
  for (int64_t j = b * kDrawBlock - 1; j >= 0; --j)  // the target passed with no weight left in its block
    if (weights[j] > 0.f) return j;
  return -1;
}

// logits (N, V) float32; temperature (N,) float32 > 0; u (N,) float32 in [0, 1); top_k (N,) int64
// (V: none), top_p (N,) float32 (1: none), min_p (N,) float32 (0: none) -> (N,) int64: each row's
// draw (draw_row), -1 where it has no token of positive weight. Rows on their own threads.
at::Tensor draw_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& u,
                     const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
                     const std::optional<at::Tensor>& min_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "draw_rows: logits (N, V) float32");
  const int64_t rows = logits.size(0), n = logits.size(1);
  const auto vector_of = [&](const at::Tensor& t, at::ScalarType type) {
    return t.dim() == 1 && t.size(0) == rows && t.scalar_type() == type;
  };
  TORCH_CHECK(vector_of(temperature, at::kFloat) && vector_of(u, at::kFloat), "draw_rows: temperature and u (N,) float32");
  TORCH_CHECK((!top_k || vector_of(*top_k, at::kLong)) && (!top_p || vector_of(*top_p, at::kFloat)) &&
                  (!min_p || vector_of(*min_p, at::kFloat)),
              "draw_rows: top_k (N,) int64, top_p and min_p (N,) float32");
  auto in = logits.contiguous();
  auto tc = temperature.contiguous(), uc = u.contiguous();
  auto kc = top_k ? top_k->contiguous() : at::full({rows}, n, logits.options().dtype(at::kLong));
  auto pc = top_p ? top_p->contiguous() : at::ones({rows}, logits.options());
  auto mc = min_p ? min_p->contiguous() : at::zeros({rows}, logits.options());
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* xp = in.data_ptr<float>();
  const float *tp = tc.data_ptr<float>(), *up = uc.data_ptr<float>(), *pp = pc.data_ptr<float>(), *mp = mc.data_ptr<float>();
  const int64_t* kp = kc.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> z((n + 7) / 8 * 8), weights((n + 7) / 8 * 8), block_sums((n + kDrawBlock - 1) / kDrawBlock);
    std::vector<int16_t> ids(n);
    for (int64_t r = begin; r < end; ++r)
      op[r] = draw_row(xp + r * n, n, tp[r], up[r], std::clamp<int64_t>(kp[r], 1, n), pp[r], mp[r], z.data(),
                       weights.data(), block_sums.data(), ids.data());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("draw_rows(Tensor logits, Tensor temperature, Tensor u, Tensor? top_k=None, Tensor? top_p=None, "
        "Tensor? min_p=None) -> Tensor");
  m.def("softmax_rows(Tensor logits, bool log) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("softmax_rows", &softmax_rows);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("draw_rows", &draw_rows);
}
