// Paged attention for CPUs: one computation for every query row of a step (a decode, a fresh
// prompt, a chunk after cached tokens), reading keys and values where they lie in the paged cache.
//
// A row's output must not depend on what else is in its step, on the thread count, or on whether
// its prefix came from the prefix cache. The eager paths attend decodes with two matmuls over
// gathered blocks, fresh prompts with SDPA over the step's own k/v (not the rounded 16-bit cache)
// and chunks with masked SDPA: one token came out three ways. Here a query at position p attends
// keys 0..p read from the cache (written before attention), and every sum of its result runs in
// an order fixed by p alone:
//
//   score    s_t = (scale q) . k_t        one 8-lane FMA chain along the head dim, the lanes summed
//                                         by one tree (sum_lanes4), then the dim % 8 tail in order;
//                                         soft-capped (Gemma 2): cap * tanh(s_t / cap)
//   softmax  online over key blocks [0, 128), [128, 256), ... of absolute positions: each block's
//            max, exps (exp8) and sum (8 lanes, one tree); running max, sum and output rescaled
//   output   acc = fma(p_t, v_t, acc) in key order, element by element; divided by the sum at the end
//
// A sliding window of W keys (Mistral, Gemma, as transformers' masking_utils defines it: key
// position > p - W) narrows a row to keys p - W + 1..p: key blocks and cache blocks wholly before
// every window of a task are never read, and within a key block the keys before a row's window
// weigh exactly 0 (their exps are zeroed, so fma(0, v, acc) leaves acc as it was): a row's sums
// still run in an order fixed by p and W alone.
//
// A task is (sequence, KV head, up to kMaxVecs query vectors: queries x the query heads of that KV
// head); it reads each key block once for all its vectors, a few vectors at a time, and one thread
// computes it whole. Tasks are split across threads by their cost. Neither the tiling, the
// grouping nor the split enters a row's sums: they are written on explicit vector types with FMA
// intrinsics (no loop for the compiler to vectorize and peel by address, no chain for -ffast-math
// to reassociate), so each is the same sequence of roundings whichever vectors share its task.
//
// Two cache layouts (models/layers/attention.py, mla.py); token t of sequence i lives in block
// block_table[i][t / block_size] at offset t % block_size:
//   GQA  (num_blocks, block_size, 2, Hk, D), laid out block-major (num_blocks, 2, Hk, block_size, D):
//        a block's keys and values for every KV head are one run of memory
//   MLA  (num_blocks, block_size, E): one latent per token for all heads (Hk = 1); keys are the
//        whole entry, values its first `value_dim` numbers (the absorbed form)
// An int8 cache (attention.py's quantize_rows) has rows of D int8 numbers and their float16 scale
// (D + 2 bytes, the last dim of its shape). Its rows are read as they lie, the integers widened
// exactly as a 16-bit cache's are, and the scales applied on the fly: a key's to its score
// (s_t = k_scale_t * (scale q . k_t)), a value's to its weight once the softmax has summed the
// weights (acc = fma(p_t * v_scale_t, v_t, acc)). Each is one more rounding in an order fixed by
// the row, so an int8 row is as independent of its step as any.
//
// Built at run time by models/layers/cpu_kernels.py; the eager paths are the reference.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec8.h"

namespace pagedserve_vec {
// 8 numbers of an int8 cache row as floats (exact); the row's scale is applied apart (see above).
inline float widen(int8_t x) { return static_cast<float>(x); }
inline f32x8 load8(const int8_t* p) {
#if defined(__AVX2__)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  return f32x8{widen(p[0]), widen(p[1]), widen(p[2]), widen(p[3]), widen(p[4]), widen(p[5]), widen(p[6]), widen(p[7])};
#endif
}
}  // namespace pagedserve_vec

namespace {

using namespace pagedserve_vec;

constexpr int64_t kKeys = 128;  // keys per softmax block: a constant, never the tile's or cache's
constexpr int64_t kMaxVecs = 32;  // query vectors per task
constexpr int64_t kFewRows = 8;   // up to this many rows left in a block: their scores key by key
constexpr int64_t kAhead = 24;    // keys whose rows are asked for ahead of their scores (see run)
// Rows that share the loads (and widening) of keys and values: three where the build has 32 vector
// registers (a row's 64 value numbers are 8 of them: three rows' outputs, the value and the weights
// fit), which is the query heads of a KV head of SmolLM2-135M and -360M (9 / 3, 15 / 5); two else.
#if defined(__AVX512F__)
constexpr int kShareRows = 3;
#else
constexpr int kShareRows = 2;
#endif
// A decode's few rows (up to kFewRows) go in the fewest groups of at most kFewShare, as even as can
// be: Qwen2.5's 7 and 6 query heads a KV head as 4 + 3 and 3 + 3, not 3 + 3 + 1, whose lone row
// widened every key and value once more for one row's FMAs (4 rows' outputs, a value and the
// weight are 21 of AVX-512's 32 registers).
#if defined(__AVX512F__)
constexpr int kFewShare = 4;
#else
constexpr int kFewShare = 2;
#endif


// Dot products of kRows (1 to 4) query rows with 4 key rows, D numbers each: s[x][i] = q[x] . k[i].
// Each is the same computation whatever kRows and order: one 8-lane FMA chain along D, the lanes
// summed by sum_lanes4, then the D % 8 tail in order. The rows share the loads of the keys.
// kKeyMajor: key after key, each read front to back (consecutive keys of a cache block are
// consecutive in memory: a decode's keys stream in the order the hardware prefetcher follows);
// else all 4 keys at each step along D (a prompt's keys are in cache: fewer loads per FMA).
template <int kRows, int64_t kD, bool kKeyMajor, typename kv_t>
inline void dots(const float* const* q, const kv_t* const* k, int64_t head_dim, float* const* s) {
  const int64_t D = kD > 0 ? kD : head_dim, D8 = D / 8 * 8;
  f32x8 a[kRows][4];
  if constexpr (kKeyMajor) {
    // A key's chains start from zeros in registers: the whole array zeroed at once went to memory
    // (a `rep stos` at every call) and its chains through loads and stores.
    for (int i = 0; i < 4; ++i) {
      f32x8 r[kRows];
      for (int x = 0; x < kRows; ++x) r[x] = f32x8{};
      for (int64_t d = 0; d < D8; d += 8) {
        const f32x8 kv = load8(k[i] + d);
        for (int x = 0; x < kRows; ++x) r[x] = fma8(load8(q[x] + d), kv, r[x]);
      }
      for (int x = 0; x < kRows; ++x) a[x][i] = r[x];
    }
  } else {
    for (int x = 0; x < kRows; ++x) a[x][0] = a[x][1] = a[x][2] = a[x][3] = f32x8{};
    for (int64_t d = 0; d < D8; d += 8) {
      const f32x8 k0 = load8(k[0] + d), k1 = load8(k[1] + d), k2 = load8(k[2] + d), k3 = load8(k[3] + d);
      for (int x = 0; x < kRows; ++x) {
        const f32x8 qv = load8(q[x] + d);
        a[x][0] = fma8(qv, k0, a[x][0]), a[x][1] = fma8(qv, k1, a[x][1]);
        a[x][2] = fma8(qv, k2, a[x][2]), a[x][3] = fma8(qv, k3, a[x][3]);
      }
    }
  }
  for (int x = 0; x < kRows; ++x) {
    f32x4 sum = sum_lanes4(a[x][0], a[x][1], a[x][2], a[x][3]);
    for (int64_t e = D8; e < D; ++e) {
      for (int i = 0; i < 4; ++i) sum[i] = __builtin_fmaf(q[x][e], widen(k[i][e]), sum[i]);
    }
    std::memcpy(s[x], &sum, sizeof(sum));
  }
}

#if defined(__AVX512F__)
// 16 numbers of a cache row as floats (exact, as load8).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// accumulate's arithmetic on 16 lanes: 64 numbers of each of kRows rows (4 vectors a row) from d on,
// while they last. Every number is its own chain of FMAs in key order, so the width of the vectors
// that carry them changes no bit; it halves the instructions (and on a core with 512-bit FMA units the
// cycles).
template <int kRows, typename kv_t>
inline void accumulate16(float* const* acc, const float* const* p, const kv_t* const* v, int64_t from, int64_t to,
                         int64_t& d, int64_t Dv) {
  constexpr int kVecs = 4;
  for (; d + 16 * kVecs <= Dv; d += 16 * kVecs) {
    __m512 r[kRows][kVecs];
    for (int x = 0; x < kRows; ++x) {
      for (int j = 0; j < kVecs; ++j) r[x][j] = _mm512_loadu_ps(acc[x] + d + 16 * j);
    }
    for (int64_t t = from; t < to; ++t) {
      const kv_t* vt = v[t] + d;
      __m512 vv[kVecs];
      for (int j = 0; j < kVecs; ++j) vv[j] = load16(vt + 16 * j);
      for (int x = 0; x < kRows; ++x) {
        const __m512 w = _mm512_set1_ps(p[x][t]);
        for (int j = 0; j < kVecs; ++j) r[x][j] = _mm512_fmadd_ps(w, vv[j], r[x][j]);
      }
    }
    for (int x = 0; x < kRows; ++x) {
      for (int j = 0; j < kVecs; ++j) _mm512_storeu_ps(acc[x] + d + 16 * j, r[x][j]);
    }
  }
}
#endif

// acc[x][d] += p[x][t] v[t][d] for t = from..to-1 in order, one FMA each, for kRows rows at once
// (sharing the loads of v): 64 / kRows numbers of each row at a time in registers (on AVX-512, 64
// of each row at a time, 16 an instruction, first).
template <int kRows, int64_t kD, typename kv_t>
inline void accumulate(float* const* acc, const float* const* p, const kv_t* const* v, int64_t from, int64_t to,
                       int64_t value_dim) {
  constexpr int kVecs = 8 / kRows;
  const int64_t Dv = kD > 0 ? kD : value_dim;
  int64_t d = 0;
#if defined(__AVX512F__)
  if (from < to) accumulate16<kRows>(acc, p, v, from, to, d, Dv);
#endif
  for (; d + 8 * kVecs <= Dv; d += 8 * kVecs) {
    f32x8 r[kRows][kVecs];
    for (int x = 0; x < kRows; ++x) {
      for (int j = 0; j < kVecs; ++j) r[x][j] = load8(acc[x] + d + 8 * j);
    }
    for (int64_t t = from; t < to; ++t) {
      const kv_t* vt = v[t] + d;
      for (int x = 0; x < kRows; ++x) {
        const f32x8 w = splat(p[x][t]);
        for (int j = 0; j < kVecs; ++j) r[x][j] = fma8(w, load8(vt + 8 * j), r[x][j]);
      }
    }
    for (int x = 0; x < kRows; ++x) {
      for (int j = 0; j < kVecs; ++j) store8(acc[x] + d + 8 * j, r[x][j]);
    }
  }
  for (; d + 8 <= Dv; d += 8) {
    for (int x = 0; x < kRows; ++x) {
      f32x8 r = load8(acc[x] + d);
      for (int64_t t = from; t < to; ++t) r = fma8(splat(p[x][t]), load8(v[t] + d), r);
      store8(acc[x] + d, r);
    }
  }
  for (; d < Dv; ++d) {
    for (int x = 0; x < kRows; ++x) {
      float r = acc[x][d];
      for (int64_t t = from; t < to; ++t) r = __builtin_fmaf(p[x][t], widen(v[t][d]), r);
      acc[x][d] = r;
    }
  }
}

// accumulate for kRows rows whose keys end at n[0] <= n[1] <= ...: each row's keys in order, the
// group split at the rows' ends (rows past their end drop out).
template <int kRows, int64_t kD, typename kv_t>
inline void accumulate_split(float* const* acc, const float* const* p, const kv_t* const* v, int64_t from,
                             const int64_t* n, int64_t value_dim) {
  accumulate<kRows, kD>(acc, p, v, from, n[0], value_dim);
  if constexpr (kRows > 1) accumulate_split<kRows - 1, kD>(acc + 1, p + 1, v, n[0], n + 1, value_dim);
}

// A cache row's lines, asked for now, read later. A decode's rows stream (keys kAhead ahead of their scores,
// values as their keys' scores are computed) into L1 (into L2 was no faster). The many rows of a prompt ask
// for a whole block of keys at once, into L2 (into L1 those held the fill buffers the reads need).
template <int kLocality = 3, typename cache_t>
inline void prefetch_row(const cache_t* row, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t at = 0; at < n * static_cast<int64_t>(sizeof(cache_t)); at += 64) __builtin_prefetch(bytes + at, 0, kLocality);
}

// One cache row as floats: the row itself for a float cache, else widened into `buf`.
template <typename cache_t>
inline const float* row_as_float(const cache_t* row, int64_t n, float* buf) {
  if constexpr (std::is_same_v<cache_t, float>) {
    return row;
  } else {
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) store8(buf + d, load8(row + d));
    for (; d < n; ++d) buf[d] = widen(row[d]);
    return buf;
  }
}

// An int8 cache row's scale: the float16 after its `n` numbers, widened (exactly).
inline float row_scale(const int8_t* row, int64_t n) {
  uint16_t bits;
  std::memcpy(&bits, row + n, sizeof(bits));
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Numbers of a cache row past its values that are read with it: an int8 row's scale.
template <typename cache_t>
constexpr int64_t kRowExtra = std::is_same_v<cache_t, int8_t> ? 2 : 0;

// Where key / value rows lie: the key row of KV head h, token o of block b is
// base + h * head_stride + b * block_stride + o * slot_stride; its value row v_offset further on.
struct Layout {
  int64_t head_stride, block_stride, slot_stride, v_offset, block_size, Dk, Dv;
  bool values_in_keys;  // MLA: a value row is the first Dv numbers of its key row
  int64_t offset(int64_t block, int64_t o) const { return block * block_stride + o * slot_stride; }
};

struct Task {
  int64_t seq, head, first, count, cost;  // `count` query vectors from `first` (= query * G + head in group)
};

template <typename scalar_t, typename cache_t, int64_t kD>
struct Attention {
  const scalar_t* q;
  int64_t q_stride0, q_stride1;  // token, head
  const cache_t* cache;
  const int64_t *tables, *seq_lens, *query_start;
  int64_t table_stride, H, G;
  Layout lay;
  float scale;
  int64_t window;  // keys a row attends, itself included (0: all before it)
  float softcap;   // scores become softcap * tanh(score / softcap) (0: as they are)
  scalar_t* out;

  // Rows of a task's keys from u on, then of the next task's from its key 0 (or none): what a decode
  // asks for ahead of its scores, walked along the block tables. (Found by its key's position, each
  // row cost a 64-bit division; perf put the address arithmetic of these prefetches among a decode's
  // hottest instructions.)
  struct Walk {
    const cache_t* base = nullptr;
    const int64_t* table = nullptr;
    int64_t b = 0, o = 0, left = 0;
    const cache_t* next_base = nullptr;
    const int64_t* next_table = nullptr;
    int64_t next_left = 0, next_lo = 0;  // the next task's keys: next_left from key next_lo
    // The row at the walk's position (null past the next task's keys); the walk moves one key on.
    const cache_t* step(const Layout& lay) {
      if (left == 0) {
        if (next_left == 0) return nullptr;
        base = next_base, table = next_table, left = next_left, next_left = 0;
        b = next_lo / lay.block_size, o = next_lo % lay.block_size;
      }
      const cache_t* row = base + lay.offset(table[b], o);
      if (++o == lay.block_size) o = 0, ++b;
      --left;
      return row;
    }
  };
  Walk walk_from(const Task& task, int64_t u, const Task* next) const {
    Walk w;
    const int64_t lo = first_key(task), keys = keys_of(task) - lo;
    w.base = cache + task.head * lay.head_stride, w.table = tables + task.seq * table_stride;
    if (next != nullptr) {
      w.next_base = cache + next->head * lay.head_stride, w.next_table = tables + next->seq * table_stride;
      w.next_lo = first_key(*next), w.next_left = keys_of(*next) - w.next_lo;
    }
    if (u >= keys) {  // past this task's keys: from the next task's key u - keys
      u -= keys, w.left = 0;
      if (u >= w.next_left) return Walk{};
      w.base = w.next_base, w.table = w.next_table, w.left = w.next_left - u, w.next_left = 0;
      u += w.next_lo;
    } else {
      w.left = keys - u;
      u += lo;
    }
    w.b = u / lay.block_size, w.o = u % lay.block_size;
    return w;
  }

  // How many keys a task reads: those of its last query.
  int64_t keys_of(const Task& task) const {
    const int64_t q_len = query_start[task.seq + 1] - query_start[task.seq];
    return seq_lens[task.seq] - q_len + (task.first + task.count - 1) / G + 1;
  }

  // The first key a row of `len` keys attends: the start of its window (0 without one).
  int64_t window_start(int64_t len) const { return window > 0 ? std::max<int64_t>(len - window, 0) : 0; }

  // The first key a task reads: its first query's window start.
  int64_t first_key(const Task& task) const {
    const int64_t q_len = query_start[task.seq + 1] - query_start[task.seq];
    return window_start(seq_lens[task.seq] - q_len + task.first / G + 1);
  }

  // `next`: the task this thread runs after this one (or null); `asked`: whether the previous
  // one asked for this task's first keys already.
  void run(const Task& task, std::vector<float>& buf, const Task* next, bool asked) const {
    const int64_t Dk = kD > 0 ? kD : lay.Dk, Dv = kD > 0 ? kD : lay.Dv, R = task.count;
    const int64_t i = task.seq, h = task.head, q_len = query_start[i + 1] - query_start[i];
    float* qf = buf.data();                // (R, Dk) scaled queries
    float* acc = qf + kMaxVecs * Dk;       // (R, Dv)
    float* kbuf = acc + kMaxVecs * Dv;     // (kKeys, Dk) widened keys (16-bit caches)
    float* vbuf = kbuf + kKeys * Dk;       // (kKeys, Dv) widened values
    float* zero = vbuf + kKeys * Dv;       // (Dk,) the key of padding columns
    std::fill(zero, zero + Dk, 0.f);
    const cache_t* zero16 = reinterpret_cast<const cache_t*>(zero);  // zero bits: 0 in every format
    float* s = zero + Dk;                  // (R, kKeys) the rows' scores, then their exps
    float m[kMaxVecs], l[kMaxVecs];
    int64_t len[kMaxVecs], lo[kMaxVecs];
    for (int64_t r = 0; r < R; ++r) {
      const int64_t vec = task.first + r, j = vec / G, head = h * G + vec % G;
      const scalar_t* qr = q + (query_start[i] + j) * q_stride0 + head * q_stride1;
      for (int64_t d = 0; d < Dk; ++d) qf[r * Dk + d] = widen(qr[d]) * scale;
      len[r] = seq_lens[i] - q_len + j + 1;  // keys 0..position
      lo[r] = window_start(len[r]);          // keys lo..position, lo growing with r as len does
    }
    std::fill(acc, acc + R * Dv, 0.f);
    const int64_t* table = tables + i * table_stride;
    const cache_t* kbase = cache + h * lay.head_stride;
    const cache_t* vbase = kbase + lay.v_offset;
    const float* krow[kKeys + 3];
    const float* vrow[kKeys];
    // Rows before r0 have seen all their keys, rows from r1 on none yet: both grow with r.
    int64_t r0 = 0, r1 = 0;
    Walk ahead = walk_from(task, kAhead, next);
    const int64_t b_first = lo[0] / kKeys * kKeys;
    for (int64_t b0 = b_first; b0 < len[R - 1]; b0 += kKeys) {
      while (len[r0] <= b0) ++r0;
      if (lo[r0] >= b0 + kKeys) b0 = lo[r0] / kKeys * kKeys;  // no row's window reaches the blocks between
      const int64_t nk = std::min(kKeys, len[R - 1] - b0);
      while (r1 < R && lo[r1] < b0 + nk) ++r1;
      // Keys before t0 lie outside every active row's window: never read. Scores go 4 keys at a
      // time from ts, keys ts..t0-1 as zero rows.
      const int64_t t0 = std::max<int64_t>(lo[r0] - b0, 0), ts = t0 / 4 * 4;
      // Walk the block table from key b0 + t0: one division per block of keys, not per key.
      int64_t slots[kKeys];  // where key t's rows lie, from the head's base
      for (int64_t t = t0, b = (b0 + t0) / lay.block_size, o = (b0 + t0) % lay.block_size; t < nk; ++t) {
        slots[t] = lay.offset(table[b], o);
        if (++o == lay.block_size) o = 0, ++b;
      }
      int64_t n[kMaxVecs], first[kMaxVecs];  // each row's keys in this block: first..n-1
      for (int64_t r = r0; r < r1; ++r) n[r] = std::min(nk, len[r] - b0), first[r] = std::max<int64_t>(lo[r] - b0, 0);
      const bool few = r1 - r0 <= kFewRows;
      const int64_t groups = (r1 - r0 + kFewShare - 1) / kFewShare;
      const int64_t share = few ? (r1 - r0 + groups - 1) / groups : kShareRows;  // rows a group
      const bool widen = !few && !std::is_same_v<cache_t, float>;  // keys widened into kbuf first
      // A decode's rows come from memory (the layers' weights went through the cache since), and
      // read one by one their misses queue behind each other: rows are asked for ahead of use.
      // Keys stream kAhead keys ahead of the scores, on into the thread's next task; a value row
      // is asked for as its key's score is computed and read after the block's scores. (Asking
      // for a block's 128 key and value rows at once, then reading them, stalled on the requests
      // themselves, with no arithmetic to overlap.)
      // Keys widened into a buffer are all read now: those are asked for here.
      if (widen) {
        for (int64_t t = t0; t < nk; ++t) prefetch_row<2>(kbase + slots[t], Dk + kRowExtra<cache_t>);
      } else if (b0 == b_first && !asked) {
        for (int64_t t = t0; t < std::min(nk, t0 + kAhead); ++t) prefetch_row(kbase + slots[t], Dk + kRowExtra<cache_t>);
      }
      // Scores, 4 keys at a time for every row that needs them (the keys stay in L1), two rows at
      // a time sharing the loads of the keys; a row left over goes alone.
      auto scores = [&](const auto* const* rows) {
        for (int64_t t = ts; t < nk; t += 4) {
          for (int64_t u = std::max(t, t0); u < std::min(t + 4, nk) && !lay.values_in_keys; ++u) {
            prefetch_row(vbase + slots[u], Dv + kRowExtra<cache_t>);
          }
          for (int64_t u = b0 + t + kAhead; u < b0 + t + kAhead + 4; ++u) {
            const cache_t* row = ahead.step(lay);  // key u of this task, or of the next past its end
            if (row != nullptr && !(widen && u < b0 + nk)) prefetch_row(row, Dk + kRowExtra<cache_t>);  // a widened block's: above
          }
          for (int64_t r = r0; r < r1;) {
            const int64_t together = std::min<int64_t>(share, r1 - r);
            const int64_t last = r + together - 1;
            if (n[last] <= t) {
              r += together;
              continue;
            }
            const float* qs[4];
            float* out[4];
            for (int64_t x = 0; x < 4; ++x) {
              qs[x] = qf + std::min(r + x, last) * Dk, out[x] = s + std::min(r + x, last) * kKeys + t;
            }
            if (together == 4) {
              dots<4, kD, true>(qs, rows + t, Dk, out);  // few rows only (kFewShare)
            } else if (together == 3) {
              if (few) dots<3, kD, true>(qs, rows + t, Dk, out);
              else dots<3, kD, false>(qs, rows + t, Dk, out);
            } else if (together == 2) {
              if (few) dots<2, kD, true>(qs, rows + t, Dk, out);
              else dots<2, kD, false>(qs, rows + t, Dk, out);
            } else {
              dots<1, kD, true>(qs, rows + t, Dk, out);
            }
            r += together;
          }
        }
        if constexpr (std::is_same_v<cache_t, int8_t>) {  // the keys' scales, on the scores
          // Each key's scale read once for all the rows of its KV head, then one multiply a score
          // in a loop the compiler vectorizes: read per row and score, they were among a GQA
          // decode's hottest instructions (perf).
          float ks[kKeys];
          for (int64_t t = t0; t < nk; ++t) ks[t] = row_scale(kbase + slots[t], Dk);
          for (int64_t r = r0; r < r1; ++r) {
            for (int64_t t = first[r]; t < n[r]; ++t) s[r * kKeys + t] *= ks[t];
          }
        }
        for (int64_t r = r0; r < r1; ++r) {
          softmax_block(s + r * kKeys, ts, first[r], n[r], lo[r] >= b0, softcap, m[r], l[r], acc + r * Dv, Dv);
        }
      };
      auto values = [&](const auto* const* rows) {
        if constexpr (std::is_same_v<cache_t, int8_t>) {  // the values' scales, on the summed weights
          float vs[kKeys];
          for (int64_t t = ts; t < t0; ++t) vs[t] = 0.f;  // before every window: weight 0 already
          for (int64_t t = t0; t < nk; ++t) vs[t] = row_scale(lay.values_in_keys ? kbase + slots[t] : vbase + slots[t], Dk);
          for (int64_t r = r0; r < r1; ++r) {
            for (int64_t t = ts; t < n[r]; ++t) s[r * kKeys + t] *= vs[t];
          }
        }
        if (r1 - r0 == 1) {  // one row (a decode without GQA): its output in registers across the keys
          float* acc_r = acc + r0 * Dv;
          const float* p = s + r0 * kKeys;
          accumulate<1, kD>(&acc_r, &p, rows, ts, n[r0], Dv);
          return;
        }
        // Two rows at a time hold a part of their outputs in registers across the block's keys,
        // sharing the loads of the values. (A decode's few rows went key by key, each term of
        // each row through memory, so that a value row was read once: the stores and the loads
        // that waited on them took a third of a GQA decode's time, and the rows are in L1 or L2
        // by then, asked for above.)
        for (int64_t r = r0; r < r1;) {
          const int64_t together = std::min<int64_t>(share, r1 - r);
          float* accs[4];
          const float* ps[4];
          for (int64_t x = 0; x < 4; ++x) {
            accs[x] = acc + std::min(r + x, r1 - 1) * Dv, ps[x] = s + std::min(r + x, r1 - 1) * kKeys;
          }
          // Keys before a row's window weigh 0 in it: every row of a group runs from ts.
          if (together == 4) {
            accumulate_split<4, kD>(accs, ps, rows, ts, n + r, Dv);
          } else if (together == 3) {
            accumulate_split<3, kD>(accs, ps, rows, ts, n + r, Dv);
          } else if (together == 2) {
            accumulate_split<2, kD>(accs, ps, rows, ts, n + r, Dv);
          } else {
            accumulate_split<1, kD>(accs, ps, rows, ts, n + r, Dv);
          }
          r += together;
        }
      };
      // A 16-bit cache: a decode's few rows widen each number as they load it (F16C, or a shift
      // for bfloat16: exact, so the same sums); many rows share one widening into a buffer (keys
      // now, values once the scores are done: 32 KB each, one buffer hot at a time). Writing a
      // decode's rows into the buffers and reading them back was a large share of its time.
      if constexpr (!std::is_same_v<cache_t, float>) {
        if (few) {
          const cache_t* krow16[kKeys + 3];
          const cache_t* vrow16[kKeys];
          for (int64_t t = ts; t < t0; ++t) krow16[t] = vrow16[t] = zero16;
          for (int64_t t = t0; t < nk; ++t) krow16[t] = kbase + slots[t];
          for (int64_t t = nk; t < nk + 3; ++t) krow16[t] = zero16;
          scores(krow16);
          for (int64_t t = t0; t < nk; ++t) vrow16[t] = lay.values_in_keys ? krow16[t] : vbase + slots[t];
          values(vrow16);
          continue;
        }
      }
      for (int64_t t = ts; t < t0; ++t) krow[t] = vrow[t] = zero;  // before every row's window: weight 0
      for (int64_t t = t0; t < nk; ++t) krow[t] = row_as_float(kbase + slots[t], Dk, kbuf + t * Dk);
      for (int64_t t = nk; t < nk + 3; ++t) krow[t] = zero;  // the columns past the block's end
      scores(krow);
      for (int64_t t = t0; t < nk; ++t) {
        vrow[t] = lay.values_in_keys ? krow[t] : row_as_float(vbase + slots[t], Dv, vbuf + t * Dv);
      }
      values(vrow);
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t vec = task.first + r, j = vec / G, head = h * G + vec % G;
      scalar_t* o = out + ((query_start[i] + j) * H + head) * Dv;
      const float inv = 1.f / l[r];
      for (int64_t d = 0; d < Dv; ++d) o[d] = static_cast<scalar_t>(acc[r * Dv + d] * inv);
    }
  }

  // One row's scores s[first..n) of a key block -> their exps relative to the row's new running max
  // m, in place, and 0 from ts to first (keys before its window that its task reads); the running
  // sum l and the output acc so far rescaled to that max. `fresh`: the row's first block.
  static void softmax_block(float* s, int64_t ts, int64_t first, int64_t n, bool fresh, float softcap, float& m,
                            float& l, float* acc, int64_t Dv) {
    if (softcap > 0.f) {
      for (int64_t t = first; t < n; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
    }
    // The lanes of the sums start at a multiple of 8 from the block's start, so that where they
    // fall depends on the row's window alone, not on the rows it shares a task with.
    const int64_t from = first / 8 * 8;
    std::fill(s + std::min(ts, from), s + from, 0.f);
    f32x8 most = splat(s[first]);  // a max is exact in any order
    int64_t t8 = first;
    for (; t8 + 8 <= n; t8 += 8) {
      const f32x8 x = load8(s + t8);
      most = x > most ? x : most;
    }
    float block_max = most[0];
    for (int i = 1; i < 8; ++i) block_max = std::max(block_max, most[i]);
    for (; t8 < n; ++t8) block_max = std::max(block_max, s[t8]);
    const float m_new = fresh ? block_max : std::max(m, block_max);
    const f32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
    f32x8 sum{};
    for (int64_t t = from; t < n; t += 8) {
      f32x8 e = exp8(load8(s + t) - splat(m_new));
      const f32x8 at = lane + splat(static_cast<float>(t));
      e = at < splat(static_cast<float>(n)) && at >= splat(static_cast<float>(first)) ? e : splat(0.f);
      store8(s + t, e);
      sum += e;
    }
    const float block_sum = sum_lanes4(sum, f32x8{}, f32x8{}, f32x8{})[0];
    if (fresh) {
      l = block_sum;
    } else {
      const float alpha = exp8(splat(m - m_new))[0];
      l = l * alpha + block_sum;
      for (int64_t d = 0; d < Dv; ++d) acc[d] *= alpha;
    }
    m = m_new;
  }

  size_t buffer_floats() const {
    const int64_t Dk = lay.Dk, Dv = lay.Dv;
    return kMaxVecs * (Dk + Dv) + kKeys * (Dk + Dv) + Dk + kMaxVecs * kKeys;
  }
};

// Tasks in sequence, KV head, query order; split into `parts` contiguous runs of about equal cost
// (a task's order changes none of its sums). Sequence-major over the block-major cache: a thread
// reads a block's 2 x Hk runs (a head's keys, a head's values) one task after the other, so the
// hardware prefetcher, running on past the end of one head's run, fetches the next head's, not a
// stranger's block. (Head-major served the earlier plane-major layout, where a KV head's rows for
// every sequence were one plane; its blocks were 2 KB runs scattered over the plane.)
//
// Few tasks of many vectors each (one request's verification step: SmolLM2-135M's 3 KV heads x 6 rows x 3
// query heads = 3 tasks of 18 vectors) would leave a thread idle for a third of the call, and tasks of more
// than kFewRows vectors widen their keys into a buffer first. Where there are fewer than 4 tasks a thread,
// each (sequence, head)'s vectors are cut into the fewest pieces of at most kFewRows vectors and at least 2 x
// kShareRows (a multiple of kShareRows) that make the task count a multiple of the threads or at least 4 a
// thread (2-row steps cut into 3 + 3 vectors were slower). A piece reads its keys again (from L2 or L3: a
// step's few sequences' keys are a few hundred KB); these steps are bound by arithmetic, not reads. A decode
// of G <= kShareRows vectors is never cut.
inline int64_t piece_of(int64_t vecs, int64_t pieces) {  // `vecs` in `pieces`: each a multiple of kShareRows
  return ((vecs + pieces - 1) / pieces + kShareRows - 1) / kShareRows * kShareRows;
}

template <typename Kernel>
void run_tasks(const Kernel& kernel, int64_t n, int64_t Hk) {
  const int64_t threads = at::get_num_threads();
  int64_t units = 0, min_vecs = kMaxVecs;  // (sequence, head, kMaxVecs run) units, and the fewest vectors of any
  for (int64_t i = 0; i < n; ++i) {
    const int64_t vecs = (kernel.query_start[i + 1] - kernel.query_start[i]) * kernel.G;
    units += Hk * ((vecs + kMaxVecs - 1) / kMaxVecs);
    if (vecs > 0) min_vecs = std::min(min_vecs, std::min(vecs, kMaxVecs));
  }
  int64_t pieces = 1;
  if (threads > 1 && units < 4 * threads) {
    for (int64_t p = 1; p == 1 || piece_of(min_vecs, p) >= 2 * kShareRows; ++p) {
      if (piece_of(min_vecs, p) <= kFewRows && (units * p % threads == 0 || units * p >= 4 * threads)) {
        pieces = p;
        break;
      }
    }
  }
  std::vector<Task> tasks;
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t h = 0; h < Hk; ++h) {
      const int64_t q_len = kernel.query_start[i + 1] - kernel.query_start[i], vecs = q_len * kernel.G;
      for (int64_t first = 0; first < vecs; first += kMaxVecs) {
        const int64_t run = std::min(kMaxVecs, vecs - first);
        // `pieces` of about equal size, each a multiple of kShareRows where it can be
        const int64_t step = piece_of(run, pieces);
        for (int64_t at = 0; at < run; at += step) {
          Task task{i, h, first + at, std::min(step, run - at), 0};
          task.cost = task.count * (kernel.keys_of(task) - kernel.first_key(task));
          tasks.push_back(task);
          total += task.cost;
        }
      }
    }
  }
  // A few hundred (vector, key) pairs take microseconds: waking the thread team would cost more.
  // One decode's keys come from memory, not cache, so from a thousand on two threads are faster.
  const int64_t parts = total < 1024 ? 1 : std::min<int64_t>(threads, tasks.size());
  std::vector<size_t> bounds(parts + 1, tasks.size());
  bounds[0] = 0;
  int64_t done = 0, part = 1;
  for (size_t t = 0; t < tasks.size() && part < parts; ++t) {
    done += tasks[t].cost;
    if (done * parts >= part * total) bounds[part++] = t + 1;
  }
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    // One scratch buffer per thread for the life of the process (~100 KB): not allocated and
    // zeroed at every call, which cost a lone decode more than its arithmetic.
    thread_local std::vector<float> buf;
    if (buf.size() < kernel.buffer_floats()) buf.resize(kernel.buffer_floats());
    for (int64_t p = begin; p < end; ++p) {
      for (size_t t = bounds[p]; t < bounds[p + 1]; ++t) {
        kernel.run(tasks[t], buf, t + 1 < bounds[p + 1] ? &tasks[t + 1] : nullptr, t > bounds[p]);
      }
    }
  });
}

template <typename scalar_t, typename cache_t>
void dispatch(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& tables, const at::Tensor& seq_lens,
              const at::Tensor& query_start, at::Tensor& out, const Layout& lay, int64_t Hk, double scale,
              int64_t window, double softcap) {
  auto run = [&](auto kernel) {
    kernel.q = q.data_ptr<scalar_t>();
    kernel.q_stride0 = q.stride(0), kernel.q_stride1 = q.stride(1);
    kernel.cache = kv_cache.data_ptr<cache_t>();
    kernel.tables = tables.data_ptr<int64_t>(), kernel.table_stride = tables.size(1);
    kernel.seq_lens = seq_lens.data_ptr<int64_t>(), kernel.query_start = query_start.data_ptr<int64_t>();
    kernel.H = q.size(1), kernel.G = q.size(1) / Hk;
    kernel.lay = lay, kernel.scale = static_cast<float>(scale);
    kernel.window = window, kernel.softcap = static_cast<float>(softcap);
    kernel.out = out.data_ptr<scalar_t>();
    run_tasks(kernel, seq_lens.numel(), Hk);
  };
  const bool same_dims = lay.Dk == lay.Dv && !lay.values_in_keys;
  if (same_dims && lay.Dk == 64) {
    run(Attention<scalar_t, cache_t, 64>{});
  } else if (same_dims && lay.Dk == 128) {
    run(Attention<scalar_t, cache_t, 128>{});
  } else {
    run(Attention<scalar_t, cache_t, 0>{});
  }
}

// q (T, H, Dk), unit stride along Dk; kv_cache GQA (num_blocks, block_size, 2, Hk, D) or MLA
// (num_blocks, block_size, E) with value_dim <= E, in q's dtype or 16-bit under float32 q;
// block_table (n, >= blocks used) int64; seq_lens (n,) int64; query_start (n + 1,) int64: the
// queries of sequence i are rows query_start[i]..query_start[i+1]-1 of q, the last of its tokens.
// window > 0: a query at position p attends keys p - window + 1..p only; softcap > 0: scores
// are soft-capped before the softmax. Returns (T, H, Dv) in q's dtype.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                           const at::Tensor& seq_lens, const at::Tensor& query_start, double scale,
                           int64_t value_dim, int64_t window, double softcap) {
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be (T, H, D) with unit stride along D");
  TORCH_CHECK(kv_cache.is_contiguous() && (kv_cache.dim() == 5 || kv_cache.dim() == 3), "bad kv_cache");
  const bool mixed = q.scalar_type() == at::kFloat &&
                     (kv_cache.scalar_type() == at::kHalf || kv_cache.scalar_type() == at::kBFloat16);
  const bool int8 = kv_cache.scalar_type() == at::kChar;
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() || mixed || int8,
              "kv_cache must have q's dtype, be float16/bfloat16 under float32 q, or int8");
  const int64_t extra = int8 ? 2 : 0;  // an int8 row's float16 scale, after its numbers
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
              query_start.scalar_type() == at::kLong, "int64 tables");
  const int64_t n = seq_lens.numel(), T = q.size(0), H = q.size(1);
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == n && query_start.numel() == n + 1,
              "one block table row and one length per sequence, query_start of n + 1");
  const int64_t num_blocks = kv_cache.size(0), block_size = kv_cache.size(1);
  Layout lay{};
  int64_t Hk = 1;
  lay.block_size = block_size;
  if (kv_cache.dim() == 5) {  // GQA, block-major (num_blocks, 2, Hk, block_size, D)
    TORCH_CHECK(kv_cache.size(2) == 2, "GQA kv_cache must be (num_blocks, block_size, 2, Hk, D)");
    Hk = kv_cache.size(3);
    const int64_t W = kv_cache.size(4), D = W - extra, run = block_size * W;
    TORCH_CHECK(D >= 1, "bad kv_cache head dim");
    TORCH_CHECK(value_dim == D || value_dim == 0, "value_dim of a GQA cache is its head dim");
    lay = Layout{run, 2 * Hk * run, W, Hk * run, block_size, D, D, false};
  } else {  // MLA latents, token-major
    const int64_t W = kv_cache.size(2), E = W - extra;
    TORCH_CHECK(value_dim >= 1 && value_dim <= E, "value_dim must be in [1, entry size]");
    lay = Layout{0, block_size * W, W, 0, block_size, E, value_dim, true};
  }
  TORCH_CHECK(q.size(2) == lay.Dk && H % Hk == 0, "q's head dim / head count do not match the cache");
  auto tables = block_table.contiguous(), lens = seq_lens.contiguous(), starts = query_start.contiguous();
  const int64_t *table_ptr = tables.data_ptr<int64_t>(), *len_ptr = lens.data_ptr<int64_t>();
  const int64_t* start_ptr = starts.data_ptr<int64_t>();
  TORCH_CHECK(start_ptr[0] == 0 && start_ptr[n] == T, "query_start must run from 0 to the number of rows of q");
  for (int64_t i = 0; i < n; ++i) {  // a bad index would read outside the cache: check them all
    const int64_t q_len = start_ptr[i + 1] - start_ptr[i];
    TORCH_CHECK(q_len >= 0 && len_ptr[i] >= q_len && len_ptr[i] <= tables.size(1) * block_size,
                "sequence length out of range");
    for (int64_t b = 0; b < (len_ptr[i] + block_size - 1) / block_size; ++b) {
      const int64_t block = table_ptr[i * tables.size(1) + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id out of range");
    }
  }
  auto out = at::empty({T, H, lay.Dv}, q.options());
  if (T == 0) return out;
  if (int8 && q.scalar_type() == at::kFloat) {
    dispatch<float, int8_t>(q, kv_cache, tables, lens, starts, out, lay, Hk, scale, window, softcap);
  } else if (int8 && q.scalar_type() == at::kBFloat16) {
    dispatch<c10::BFloat16, int8_t>(q, kv_cache, tables, lens, starts, out, lay, Hk, scale, window, softcap);
  } else if (int8 && q.scalar_type() == at::kHalf) {
    dispatch<c10::Half, int8_t>(q, kv_cache, tables, lens, starts, out, lay, Hk, scale, window, softcap);
  } else if (int8) {
    TORCH_CHECK(false, "paged_attention takes float32, bfloat16 or float16 queries");
  } else if (mixed && kv_cache.scalar_type() == at::kHalf) {
    dispatch<float, c10::Half>(q, kv_cache, tables, lens, starts, out, lay, Hk, scale, window, softcap);
  } else if (mixed) {
    dispatch<float, c10::BFloat16>(q, kv_cache, tables, lens, starts, out, lay, Hk, scale, window, softcap);
  } else if (q.scalar_type() == at::kFloat) {
    dispatch<float, float>(q, kv_cache, tables, lens, starts, out, lay, Hk, scale, window, softcap);
  } else if (q.scalar_type() == at::kBFloat16) {
    dispatch<c10::BFloat16, c10::BFloat16>(q, kv_cache, tables, lens, starts, out, lay, Hk, scale, window, softcap);
  } else if (q.scalar_type() == at::kHalf) {
    dispatch<c10::Half, c10::Half>(q, kv_cache, tables, lens, starts, out, lay, Hk, scale, window, softcap);
  } else {
    TORCH_CHECK(false, "paged_attention takes float32, bfloat16 or float16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pagedserve, m) {
  m.def("paged_attention(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, Tensor query_start, "
        "float scale, int value_dim, int window=0, float softcap=0.) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("paged_attention", &paged_attention); }
