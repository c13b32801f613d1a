#include "tile_ops.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu_knobs.h"
#include "fast_exp.h"
#include "simd_clones.h"
#include "tile_gemm.h"

namespace flashattn {
namespace cpu {
namespace {

template <typename T>
FLASHATTN_INLINE void fill(T* x, int n, T value) {
  for (int i = 0; i < n; ++i) x[i] = value;
}

#if FLASHATTN_VECTOR_EXT
// Vector types cross no call boundary outside this file (every helper is
// inlined), so GCC's note that their calling convention differs between
// targets (-Wpsabi) does not apply.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
// ---------------------------------------------------------------------------
// 8 x 8 float blocks in GCC vector extensions: the same source compiles to
// AVX-512 / AVX2 shuffles in those clones and to SSE pairs in the baseline.

typedef float Vec8f __attribute__((vector_size(32)));
typedef uint32_t Vec8u32 __attribute__((vector_size(32)));
typedef uint16_t Vec8u16 __attribute__((vector_size(16)));

FLASHATTN_INLINE Vec8f load8(const float* p) {
  Vec8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

FLASHATTN_INLINE Vec8f load8(const c10::BFloat16* p) {
  // A bfloat16 is the upper half of a float32.
  Vec8u16 bits;
  std::memcpy(&bits, p, sizeof(bits));
  const Vec8u32 wide = __builtin_convertvector(bits, Vec8u32) << 16;
  Vec8f v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

FLASHATTN_INLINE Vec8f load8(const c10::Half* p) {
  float tmp[8];
  for (int i = 0; i < 8; ++i) tmp[i] = static_cast<float>(p[i]);
  return load8(tmp);
}

FLASHATTN_INLINE void store8(float* p, Vec8f v) { std::memcpy(p, &v, sizeof(v)); }

// The bits of v rounded to the 16-bit type: for bfloat16 round to nearest
// even, NaN to the canonical quiet NaN (c10's rule); float16 by c10's
// conversion.
FLASHATTN_INLINE Vec8u16 round8(Vec8f v, c10::BFloat16*) {
  Vec8u32 bits;
  std::memcpy(&bits, &v, sizeof(bits));
  Vec8u32 rounded = (bits + (((bits >> 16) & 1u) + 0x7FFFu)) >> 16;
  rounded = (v != v) ? Vec8u32{} + 0x7FC0u : rounded;
  return __builtin_convertvector(rounded, Vec8u16);
}

FLASHATTN_INLINE Vec8u16 round8(Vec8f v, c10::Half*) {
  c10::Half h[8];
  for (int i = 0; i < 8; ++i) h[i] = static_cast<c10::Half>(v[i]);
  Vec8u16 bits;
  std::memcpy(&bits, h, sizeof(bits));
  return bits;
}

template <typename lowp_t>
FLASHATTN_INLINE void store8(lowp_t* p, Vec8f v) {
  const Vec8u16 narrow = round8(v, static_cast<lowp_t*>(nullptr));
  std::memcpy(p, &narrow, sizeof(narrow));
}

// Eight 16-bit values as they are (their bits).
template <typename lowp_t>
FLASHATTN_INLINE Vec8u16 bits8(const lowp_t* p) {
  Vec8u16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Two 8-lane rows of 16-bit values interleaved: a0 b0 a1 b1 ... a7 b7.
typedef uint16_t Vec16u16 __attribute__((vector_size(32)));
FLASHATTN_INLINE Vec16u16 interleave8(Vec8u16 a, Vec8u16 b) {
  return __builtin_shufflevector(a, b, 0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
}

// The same 16 lanes wide, for bfloat16 (round8's rule).
typedef uint32_t Vec16u32 __attribute__((vector_size(64)));
typedef float Vec16f __attribute__((vector_size(64)));
typedef uint16_t Vec32u16 __attribute__((vector_size(64)));
FLASHATTN_INLINE Vec16u16 round16_bf16(const float* p) {
  Vec16f v;
  std::memcpy(&v, p, sizeof(v));
  Vec16u32 bits;
  std::memcpy(&bits, &v, sizeof(bits));
  Vec16u32 rounded = (bits + (((bits >> 16) & 1u) + 0x7FFFu)) >> 16;
  rounded = (v != v) ? Vec16u32{} + 0x7FC0u : rounded;
  return __builtin_convertvector(rounded, Vec16u16);
}
FLASHATTN_INLINE Vec32u16 interleave16(Vec16u16 a, Vec16u16 b) {
  return __builtin_shufflevector(a, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26, 11,
                                 27, 12, 28, 13, 29, 14, 30, 15, 31);
}

// In place: row i of r becomes column i (pure lane moves: any 32-bit lanes).
template <typename V8>
FLASHATTN_INLINE void transpose8x8(V8 r[8]) {
  V8 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {  // interleave row pairs within 128-bit lanes
    t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int i = 0; i < 8; i += 4) {  // interleave pairs of pairs
    u[i] = __builtin_shufflevector(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
    u[i + 1] = __builtin_shufflevector(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    u[i + 2] = __builtin_shufflevector(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
    u[i + 3] = __builtin_shufflevector(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int i = 0; i < 4; ++i) {  // join the 128-bit halves of rows 0-3 and 4-7
    r[i] = __builtin_shufflevector(u[i], u[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    r[i + 4] = __builtin_shufflevector(u[i], u[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
}

#endif  // FLASHATTN_VECTOR_EXT

// ---------------------------------------------------------------------------
// Row reductions (row_dot and the few-queries path: the tiled softmax steps
// reduce vertically) keep W independent partial results, so that the inner loop vectorizes without
// reassociating one sum (which the compiler may not do without -ffast-math),
// then fold them pairwise.

template <typename acc_t>
constexpr int kLanes = 64 / sizeof(acc_t);

template <int W, typename acc_t, typename Op>
FLASHATTN_INLINE acc_t fold_lanes(acc_t* lane, Op op) {
  for (int half = W / 2; half >= 1; half /= 2)
    for (int l = 0; l < half; ++l) lane[l] = op(lane[l], lane[l + half]);
  return lane[0];
}

template <int W, typename acc_t>
FLASHATTN_INLINE acc_t fold_sum(acc_t* lane) {
  return fold_lanes<W>(lane, [](acc_t a, acc_t b) { return a + b; });
}

// sum_i x[i] * y[i]
template <typename acc_t>
FLASHATTN_INLINE acc_t dot(const acc_t* __restrict x, const acc_t* __restrict y, int n) {
  constexpr int W = kLanes<acc_t>;
  acc_t lane[W] = {};
  int i = 0;
  for (; i + W <= n; i += W)
    for (int l = 0; l < W; ++l) lane[l] += x[i + l] * y[i + l];
  for (int l = 0; i < n; ++i, ++l) lane[l] += x[i] * y[i];
  return fold_sum<W>(lane);
}

// dot(q + r * d, k_row, d) for the rows of [0, rows) (the float version
// below runs four rows at a time, the same bits).
template <typename acc_t>
FLASHATTN_INLINE void dot_rows(const acc_t* __restrict q, int rows, int d, const acc_t* __restrict k_row,
                               acc_t* __restrict out, int64_t out_ld) {
  for (int r = 0; r < rows; ++r) out[r * out_ld] = dot(q + r * d, k_row, d);
}

#if FLASHATTN_VECTOR_EXT
// The float dot in vector types: the 16 lanes above as one 16-float vector
// (one AVX-512 register, two AVX2 ones), the same products, sums and fold
// order; written out because GCC kept the generic loop's lanes in memory on
// AVX2 once inlined into the few-queries loop (callgrind: ~800 instructions a
// 128-long dot, 70% of a decoding call).
FLASHATTN_INLINE Vec16f load16(const float* p) {
  Vec16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

FLASHATTN_INLINE void store16(float* p, Vec16f v) { std::memcpy(p, &v, sizeof(v)); }

// fold_sum<16>'s halving steps (lane l += lane l + half) in registers.
FLASHATTN_INLINE float fold16(Vec16f v16) {
  Vec8f v = __builtin_shufflevector(v16, v16, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v16, v16, 8, 9, 10, 11, 12, 13, 14, 15);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 2, 3, 2, 3, 2, 3, 2, 3);
  v += __builtin_shufflevector(v, v, 1, 1, 1, 1, 1, 1, 1, 1);
  return v[0];
}

FLASHATTN_INLINE float dot(const float* __restrict x, const float* __restrict y, int n) {
  constexpr int W = kLanes<float>;
  static_assert(W == 16, "one 16-float vector");
  Vec16f acc = {};
  int i = 0;
  for (; i + W <= n; i += W) acc += load16(x + i) * load16(y + i);
  if (i < n) {  // a head dim that is not a multiple of 16: the tail into the lanes, then fold_sum
    float lane[W];
    store16(lane, acc);
    for (int l = 0; i < n; ++i, ++l) lane[l] += x[i] * y[i];
    return fold_sum<W>(lane);
  }
  return fold16(acc);
}

// 16-bit values widened to float as they are loaded (a bfloat16 is the upper
// half of a float32; float16 by c10's conversion).
FLASHATTN_INLINE Vec16f load16(const c10::BFloat16* p) {
  Vec16u16 bits;
  std::memcpy(&bits, p, sizeof(bits));
  const Vec16u32 wide = __builtin_convertvector(bits, Vec16u32) << 16;
  Vec16f v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

FLASHATTN_INLINE Vec16f load16(const c10::Half* p) {
  float tmp[16];
  for (int i = 0; i < 16; ++i) tmp[i] = static_cast<float>(p[i]);
  return load16(tmp);
}

// Four query rows (q0, q0 + d, ...) against one key row, d a multiple of 16:
// four FMA chains side by side, out[t * out_ld] the row t's dot, summed and
// folded as dot() does. 16-bit keys are widened as they are loaded.
template <typename key_t>
FLASHATTN_INLINE void dot_four_rows(const float* __restrict q0, int d, const key_t* __restrict k_row,
                                    float* __restrict out, int64_t out_ld) {
  Vec16f a0 = {}, a1 = {}, a2 = {}, a3 = {};
  for (int i = 0; i < d; i += 16) {
    const Vec16f kv = load16(k_row + i);
    a0 += load16(q0 + i) * kv;
    a1 += load16(q0 + d + i) * kv;
    a2 += load16(q0 + 2 * d + i) * kv;
    a3 += load16(q0 + 3 * d + i) * kv;
  }
  out[0] = fold16(a0);
  out[out_ld] = fold16(a1);
  out[2 * out_ld] = fold16(a2);
  out[3 * out_ld] = fold16(a3);
}

// dot(q + r * d, k_row, d) for the rows r of [0, rows), into out[r * out_ld]:
// four rows a pass over k_row, so that four FMA chains run side by side
// instead of one dependent chain a row (perf: the dot's one chain was ~30% of
// a decoding step, latency-bound). Each row's products, sums and fold are
// dot()'s, in the same order: the same bits whatever rows a call groups.
FLASHATTN_INLINE void dot_rows(const float* __restrict q, int rows, int d, const float* __restrict k_row,
                               float* __restrict out, int64_t out_ld) {
  int r = 0;
  if (d % 16 == 0)
    for (; r + 4 <= rows; r += 4) dot_four_rows(q + r * d, d, k_row, out + r * out_ld, out_ld);
  for (; r < rows; ++r) out[r * out_ld] = dot(q + r * d, k_row, d);
}

// dot_rows against a 16-bit key row, widened on load (head dims that are a
// multiple of 16): the products, sums and fold of dot_rows on the converted
// row, so the same bits, without the round trip through a buffer.
template <typename key_t>
FLASHATTN_INLINE void dot_rows_widened(const float* __restrict q, int rows, int d, const key_t* __restrict k_row,
                                       float* __restrict out, int64_t out_ld) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) dot_four_rows(q + r * d, d, k_row, out + r * out_ld, out_ld);
  for (; r < rows; ++r) {
    const float* q0 = q + r * d;
    Vec16f acc = {};
    for (int i = 0; i < d; i += 16) acc += load16(q0 + i) * load16(k_row + i);
    out[r * out_ld] = fold16(acc);
  }
}

// exp_approx (fast_exp.h) on 16 lanes, the same operations.
FLASHATTN_INLINE Vec16f exp_approx16(Vec16f x) { return exp_approx_lanes<Vec16f, Vec16u32>(x); }
#endif

// max_i x[i] (-inf when n = 0)
template <typename acc_t>
FLASHATTN_INLINE acc_t max_of(const acc_t* __restrict x, int n) {
  constexpr int W = kLanes<acc_t>;
  acc_t lane[W];
  for (int l = 0; l < W; ++l) lane[l] = -std::numeric_limits<acc_t>::infinity();
  int i = 0;
  for (; i + W <= n; i += W)
    for (int l = 0; l < W; ++l) lane[l] = std::max(lane[l], x[i + l]);
  for (int l = 0; i < n; ++i, ++l) lane[l] = std::max(lane[l], x[i]);
  return fold_lanes<W>(lane, [](acc_t a, acc_t b) { return std::max(a, b); });
}

#if FLASHATTN_VECTOR_EXT
// max_of and exp_shifted_sum below for float in vector types, the same
// lanes and fold order: GCC left the generic loops scalar inside the
// few-queries loop (perf: vmaxss / scalar exp, ~15% of a decoding step).
FLASHATTN_INLINE float max_of(const float* __restrict x, int n) {
  constexpr int W = kLanes<float>;
  Vec16f acc = Vec16f{} - std::numeric_limits<float>::infinity();
  int i = 0;
  for (; i + W <= n; i += W) {
    const Vec16f v = load16(x + i);
    acc = acc < v ? v : acc;  // std::max(lane, x): a NaN x leaves the lane
  }
  float lane[W];
  store16(lane, acc);
  for (int l = 0; i < n; ++i, ++l) lane[l] = std::max(lane[l], x[i]);
  return fold_lanes<W>(lane, [](float a, float b) { return std::max(a, b); });
}

FLASHATTN_INLINE float exp_shifted_sum(float* __restrict x, int n, float shift) {
  constexpr int W = kLanes<float>;
  Vec16f acc = {};
  int i = 0;
  for (; i + W <= n; i += W) {
    const Vec16f e = exp_approx16(load16(x + i) - shift);
    store16(x + i, e);
    acc += e;
  }
  float lane[W];
  store16(lane, acc);
  for (int l = 0; i < n; ++i, ++l) {
    x[i] = exp_approx(x[i] - shift);
    lane[l] += x[i];
  }
  return fold_sum<W>(lane);
}
#endif

// x[i] = exp(x[i] - shift); returns the sum of the new x.
template <typename acc_t>
FLASHATTN_INLINE acc_t exp_shifted_sum(acc_t* __restrict x, int n, acc_t shift) {
  constexpr int W = kLanes<acc_t>;
  acc_t lane[W] = {};
  int i = 0;
  for (; i + W <= n; i += W) {
    for (int l = 0; l < W; ++l) {
      x[i + l] = exp_approx(x[i + l] - shift);
      lane[l] += x[i + l];
    }
  }
  for (int l = 0; i < n; ++i, ++l) {
    x[i] = exp_approx(x[i] - shift);
    lane[l] += x[i];
  }
  return fold_sum<W>(lane);
}

// Asks for the cache lines of a row ahead of its use. Rows of k and v are
// often far apart (the heads of a (batch, seqlen, heads, dim) tensor sit
// between them), which the hardware prefetchers follow poorly.
template <typename scalar_t>
FLASHATTN_INLINE void prefetch_row(const scalar_t* row, int n) {
#if defined(__GNUC__)
  for (int i = 0; i < n; i += 64 / sizeof(scalar_t)) __builtin_prefetch(row + i);
#endif
}

// The row of a strided input as acc_t: in place when it already is, else
// converted into `buffer`.
template <typename scalar_t, typename acc_t>
FLASHATTN_INLINE const acc_t* row_as_acc(const scalar_t* row, int n, acc_t* buffer) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return row;
  } else {
    for (int i = 0; i < n; ++i) buffer[i] = static_cast<acc_t>(row[i]);
    return buffer;
  }
}

// The few-queries path's scores, keys read in place (attend_few_queries):
// scores[r * cols + j] = dot(q + r * d, key j) for the rows r < rows and keys
// j < cols, key j at k_rows[j] (a paged cache) or k + j * k_ld. Float keys
// and 16-bit ones (bfloat16 / float16, widened to float on load: the same
// products and sums as a converted row, so the same bits).
constexpr int kFewScoresAhead = 16;  // keys prefetched ahead

// Row j of a few-queries block's keys (or values): rows[j] (a paged cache)
// or base + j * ld.
template <typename scalar_t>
FLASHATTN_INLINE const scalar_t* few_key_row(const scalar_t* base, int64_t ld, const scalar_t* const* rows, int j) {
  return rows ? rows[j] : base + j * ld;
}

// dot_rows on each key row; a 16-bit row is widened as it is loaded
// (dot_rows_widened) or, at head dims that are not a multiple of 16, first
// converted into `buffer` (d floats).
template <typename key_t>
FLASHATTN_INLINE void few_query_scores_vec16(const float* q, int rows, int d, const key_t* k, int64_t k_ld,
                                             const key_t* const* k_rows, int cols, float* scores, float* buffer) {
  for (int j = 0; j < cols; ++j) {
    if (j + kFewScoresAhead < cols) prefetch_row(few_key_row(k, k_ld, k_rows, j + kFewScoresAhead), d);
    const key_t* k_row = few_key_row(k, k_ld, k_rows, j);
#if FLASHATTN_VECTOR_EXT
    if constexpr (!std::is_same_v<key_t, float>) {
      if (d % 16 == 0) {
        dot_rows_widened(q, rows, d, k_row, scores + j, cols);
        continue;
      }
    }
#endif
    dot_rows(q, rows, d, row_as_acc(k_row, d, buffer), scores + j, cols);
  }
}

#if FLASHATTN_HAVE_SIMD_CLONES && FLASHATTN_VECTOR_EXT
// The AVX2 version: dot_rows's 16 lanes as two 8-lane halves. GCC keeps a
// 64-byte vector that the target has no register for in memory across the
// loop (the AVX2 clone of dot_rows moved its four accumulators between the
// stack and general registers every step: callgrind, ~200 instructions a
// 128-long dot, 58% of a decoding step's); two 32-byte halves stay in ymm
// registers. The same lanes, products, sums and fold (fold16's first step
// adds the halves): the same bits as dot_rows. A 16-bit key is widened as
// it is loaded (load8): converting rows into a buffer and taking the generic
// dot made bfloat16 decoding 2.6x slower than float32 on the AVX2 machine.
FLASHATTN_INLINE float fold_halves(Vec8f lo, Vec8f hi) {
  Vec8f v = lo + hi;
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 2, 3, 2, 3, 2, 3, 2, 3);
  v += __builtin_shufflevector(v, v, 1, 1, 1, 1, 1, 1, 1, 1);
  return v[0];
}

template <typename key_t>
FLASHATTN_INLINE void few_query_scores_halves(const float* q, int rows, int d, const key_t* k, int64_t k_ld,
                                              const key_t* const* k_rows, int cols, float* scores, float* buffer) {
  if (d % 16 != 0) {
    few_query_scores_vec16(q, rows, d, k, k_ld, k_rows, cols, scores, buffer);
    return;
  }
  for (int j = 0; j < cols; ++j) {
    if (j + kFewScoresAhead < cols) prefetch_row(few_key_row(k, k_ld, k_rows, j + kFewScoresAhead), d);
    const key_t* __restrict k_row = few_key_row(k, k_ld, k_rows, j);
    float* out = scores + j;
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
      const float* q0 = q + r * d;
      Vec8f l0 = {}, h0 = {}, l1 = {}, h1 = {}, l2 = {}, h2 = {}, l3 = {}, h3 = {};
      for (int i = 0; i < d; i += 16) {
        const Vec8f kl = load8(k_row + i), kh = load8(k_row + i + 8);
        l0 += load8(q0 + i) * kl;
        h0 += load8(q0 + i + 8) * kh;
        l1 += load8(q0 + d + i) * kl;
        h1 += load8(q0 + d + i + 8) * kh;
        l2 += load8(q0 + 2 * d + i) * kl;
        h2 += load8(q0 + 2 * d + i + 8) * kh;
        l3 += load8(q0 + 3 * d + i) * kl;
        h3 += load8(q0 + 3 * d + i + 8) * kh;
      }
      out[r * cols] = fold_halves(l0, h0);
      out[(r + 1) * cols] = fold_halves(l1, h1);
      out[(r + 2) * cols] = fold_halves(l2, h2);
      out[(r + 3) * cols] = fold_halves(l3, h3);
    }
    for (; r < rows; ++r) {
      const float* q0 = q + r * d;
      Vec8f lo = {}, hi = {};
      for (int i = 0; i < d; i += 16) {
        lo += load8(q0 + i) * load8(k_row + i);
        hi += load8(q0 + i + 8) * load8(k_row + i + 8);
      }
      out[r * cols] = fold_halves(lo, hi);
    }
  }
}

// The AVX-512 version: four keys against four query rows a pass, sixteen
// accumulators (zmm registers: 16 + 4 keys + 1 query of 32), so that each
// query vector loaded serves four keys (dot_rows reloads the queries for
// every key: five loads for four FMAs, the load ports the limit). Each
// accumulator is dot_rows's for its (row, key), summed in the same order:
// the same bits. Keys and rows past the last whole group of four take one
// key at a time (dot_rows, as few_query_scores_vec16 does); head dims that
// are not a multiple of 16, and fewer than four rows, few_query_scores_vec16.
template <typename key_t>
FLASHATTN_INLINE void few_query_scores_blocked(const float* q, int rows, int d, const key_t* k, int64_t k_ld,
                                               const key_t* const* k_rows, int cols, float* scores, float* buffer) {
  if (d % 16 != 0 || rows < 4) {
    few_query_scores_vec16(q, rows, d, k, k_ld, k_rows, cols, scores, buffer);
    return;
  }
  const int rows4 = rows / 4 * 4, cols4 = cols / 4 * 4;
  // Key j against the rows from r0 on, as few_query_scores_vec16 takes it.
  auto one_key = [&](int j, int r0) {
    const key_t* k_row = few_key_row(k, k_ld, k_rows, j);
    if constexpr (std::is_same_v<key_t, float>) {
      dot_rows(q + r0 * d, rows - r0, d, k_row, scores + r0 * cols + j, cols);
    } else {
      dot_rows_widened(q + r0 * d, rows - r0, d, k_row, scores + r0 * cols + j, cols);
    }
  };
  for (int j = 0; j < cols4; j += 4) {
    for (int t = 0; t < 4 && j + kFewScoresAhead + t < cols; ++t)
      prefetch_row(few_key_row(k, k_ld, k_rows, j + kFewScoresAhead + t), d);
    const key_t* __restrict k0 = few_key_row(k, k_ld, k_rows, j);
    const key_t* __restrict k1 = few_key_row(k, k_ld, k_rows, j + 1);
    const key_t* __restrict k2 = few_key_row(k, k_ld, k_rows, j + 2);
    const key_t* __restrict k3 = few_key_row(k, k_ld, k_rows, j + 3);
    for (int r = 0; r < rows4; r += 4) {
      Vec16f acc[4][4] = {};
      for (int i = 0; i < d; i += 16) {
        const Vec16f kv0 = load16(k0 + i), kv1 = load16(k1 + i), kv2 = load16(k2 + i), kv3 = load16(k3 + i);
        for (int rr = 0; rr < 4; ++rr) {
          const Vec16f qv = load16(q + (r + rr) * d + i);
          acc[rr][0] += qv * kv0;
          acc[rr][1] += qv * kv1;
          acc[rr][2] += qv * kv2;
          acc[rr][3] += qv * kv3;
        }
      }
      for (int rr = 0; rr < 4; ++rr)
        for (int t = 0; t < 4; ++t) scores[(r + rr) * cols + j + t] = fold16(acc[rr][t]);
    }
    for (int t = 0; t < 4 && rows4 < rows; ++t) one_key(j + t, rows4);  // the last rows
  }
  for (int j = cols4; j < cols; ++j) one_key(j, 0);  // the last keys
}

// One set of target versions a key type (GCC's function multiversioning
// takes no templates): AVX2 the halves, AVX-512 dot_rows as it is (one zmm
// register a 16-lane vector; four keys against four rows a pass, the one-key
// pass under TestKnob::kFewQueriesOneKey: the blocked pass loads an operand
// for every four FMAs where the one-key pass loads one for each), the
// baseline dot_rows as it is.
#define FLASHATTN_FEW_QUERY_SCORES(key_t)                                                                             \
  __attribute__((target("arch=x86-64-v3"))) void few_query_scores(const float* q, int rows, int d, const key_t* k,    \
                                                                  int64_t k_ld, const key_t* const* k_rows, int cols, \
                                                                  float* scores, float* buffer) {                     \
    few_query_scores_halves(q, rows, d, k, k_ld, k_rows, cols, scores, buffer);                                       \
  }                                                                                                                   \
  __attribute__((target("arch=x86-64-v4"))) void few_query_scores(const float* q, int rows, int d, const key_t* k,    \
                                                                  int64_t k_ld, const key_t* const* k_rows, int cols, \
                                                                  float* scores, float* buffer) {                     \
    if (test_knob_value(TestKnob::kFewQueriesOneKey) == 1) {                                                          \
      few_query_scores_vec16(q, rows, d, k, k_ld, k_rows, cols, scores, buffer);                                      \
    } else {                                                                                                          \
      few_query_scores_blocked(q, rows, d, k, k_ld, k_rows, cols, scores, buffer);                                    \
    }                                                                                                                 \
  }                                                                                                                   \
  __attribute__((target("default"))) void few_query_scores(const float* q, int rows, int d, const key_t* k,           \
                                                           int64_t k_ld, const key_t* const* k_rows, int cols,        \
                                                           float* scores, float* buffer) {                            \
    few_query_scores_vec16(q, rows, d, k, k_ld, k_rows, cols, scores, buffer);                                        \
  }
FLASHATTN_FEW_QUERY_SCORES(float)
FLASHATTN_FEW_QUERY_SCORES(c10::BFloat16)
FLASHATTN_FEW_QUERY_SCORES(c10::Half)
#undef FLASHATTN_FEW_QUERY_SCORES
#else
template <typename key_t>
void few_query_scores(const float* q, int rows, int d, const key_t* k, int64_t k_ld, const key_t* const* k_rows,
                      int cols, float* scores, float* buffer) {
  few_query_scores_vec16(q, rows, d, k, k_ld, k_rows, cols, scores, buffer);
}
#endif

}  // namespace

template <typename scalar_t, typename acc_t>
FLASHATTN_SIMD_CLONES void load_tile(const scalar_t* src, int64_t src_ld, int rows, int cols, acc_t* dst,
                                     int64_t dst_ld) {
  for (int r = 0; r < rows; ++r) {
    const scalar_t* s = src + r * src_ld;
    acc_t* d = dst + r * dst_ld;
    for (int c = 0; c < cols; ++c) d[c] = static_cast<acc_t>(s[c]);
  }
}

template <typename scalar_t, typename acc_t>
FLASHATTN_SIMD_CLONES void load_tile_transposed(const scalar_t* src, int64_t src_ld, int rows, int cols, acc_t scale,
                                                acc_t* dst, int64_t dst_ld) {
  int rows8 = 0, cols8 = 0;  // the part done in 8 x 8 blocks
#if FLASHATTN_VECTOR_EXT
  if constexpr (std::is_same_v<acc_t, float>) {
    rows8 = rows / 8 * 8, cols8 = cols / 8 * 8;
    for (int r0 = 0; r0 < rows8; r0 += 8) {
      for (int c0 = 0; c0 < cols8; c0 += 8) {
        Vec8f block[8];
        for (int i = 0; i < 8; ++i) block[i] = load8(src + (r0 + i) * src_ld + c0);
        transpose8x8(block);
        for (int i = 0; i < 8; ++i) store8(dst + (c0 + i) * dst_ld + r0, block[i] * scale);
      }
    }
  }
#endif
  // The ragged right edge of the blocked rows, then the remaining rows.
  for (int c = cols8; c < cols; ++c)
    for (int r = 0; r < rows8; ++r) dst[c * dst_ld + r] = scale * static_cast<acc_t>(src[r * src_ld + c]);
  for (int c = 0; c < cols; ++c)
    for (int r = rows8; r < rows; ++r) dst[c * dst_ld + r] = scale * static_cast<acc_t>(src[r * src_ld + c]);
}

// load_tile_transposed's 8 x 8 blocks, added into dst after scaling it.
template <typename scalar_t, typename acc_t>
FLASHATTN_SIMD_CLONES void add_tile_transposed(const scalar_t* src, int64_t src_ld, int rows, int cols, acc_t scale,
                                               acc_t* dst, int64_t dst_ld) {
  int rows8 = 0, cols8 = 0;  // the part done in 8 x 8 blocks
#if FLASHATTN_VECTOR_EXT
  if constexpr (std::is_same_v<acc_t, float>) {
    rows8 = rows / 8 * 8, cols8 = cols / 8 * 8;
    for (int r0 = 0; r0 < rows8; r0 += 8) {
      for (int c0 = 0; c0 < cols8; c0 += 8) {
        Vec8f block[8];
        for (int i = 0; i < 8; ++i) block[i] = load8(src + (r0 + i) * src_ld + c0);
        transpose8x8(block);
        for (int i = 0; i < 8; ++i) {
          float* d = dst + (c0 + i) * dst_ld + r0;
          store8(d, load8(d) * scale + block[i]);
        }
      }
    }
  }
#endif
  // The ragged right edge of the blocked rows, then the remaining rows.
  for (int c = cols8; c < cols; ++c)
    for (int r = 0; r < rows8; ++r)
      dst[c * dst_ld + r] = scale * dst[c * dst_ld + r] + static_cast<acc_t>(src[r * src_ld + c]);
  for (int c = 0; c < cols; ++c)
    for (int r = rows8; r < rows; ++r)
      dst[c * dst_ld + r] = scale * dst[c * dst_ld + r] + static_cast<acc_t>(src[r * src_ld + c]);
}

template <typename acc_t, typename scalar_t>
FLASHATTN_SIMD_CLONES void store_tile(const acc_t* src, int64_t src_ld, int rows, int cols, acc_t scale, scalar_t* dst,
                                      int64_t dst_ld) {
  for (int r = 0; r < rows; ++r) {
    const acc_t* s = src + r * src_ld;
    scalar_t* d = dst + r * dst_ld;
    for (int c = 0; c < cols; ++c) d[c] = static_cast<scalar_t>(scale * s[c]);
  }
}

template <typename acc_t, typename scalar_t>
FLASHATTN_SIMD_CLONES void store_tile_transposed(const acc_t* src, int64_t src_ld, int rows, int cols, acc_t scale,
                                                 const acc_t* row_scale, scalar_t* dst, int64_t dst_ld) {
  auto factor = [&](int r) { return row_scale ? scale * row_scale[r] : scale; };
  int rows8 = 0, cols8 = 0;  // the part done in 8 x 8 blocks
#if FLASHATTN_VECTOR_EXT
  if constexpr (std::is_same_v<acc_t, float>) {
    rows8 = rows / 8 * 8, cols8 = cols / 8 * 8;
    for (int r0 = 0; r0 < rows8; r0 += 8) {
      for (int c0 = 0; c0 < cols8; c0 += 8) {
        Vec8f block[8];
        for (int i = 0; i < 8; ++i) block[i] = load8(src + (c0 + i) * src_ld + r0);
        transpose8x8(block);
        for (int i = 0; i < 8; ++i) store8(dst + (r0 + i) * dst_ld + c0, block[i] * factor(r0 + i));
      }
    }
  }
#endif
  for (int r = 0; r < rows8; ++r)
    for (int c = cols8; c < cols; ++c) dst[r * dst_ld + c] = static_cast<scalar_t>(factor(r) * src[c * src_ld + r]);
  for (int r = rows8; r < rows; ++r)
    for (int c = 0; c < cols; ++c) dst[r * dst_ld + c] = static_cast<scalar_t>(factor(r) * src[c * src_ld + r]);
}

template <typename scalar_t, typename acc_t>
FLASHATTN_SIMD_CLONES void row_dot(const scalar_t* a, int64_t a_ld, const scalar_t* b, int64_t b_ld, int rows, int cols,
                                   acc_t* out) {
  constexpr int W = kLanes<acc_t>;
  for (int r = 0; r < rows; ++r) {
    const scalar_t* x = a + r * a_ld;
    const scalar_t* y = b + r * b_ld;
    acc_t lane[W] = {};
    int c = 0;
    for (; c + W <= cols; c += W)
      for (int l = 0; l < W; ++l) lane[l] += static_cast<acc_t>(x[c + l]) * static_cast<acc_t>(y[c + l]);
    for (int l = 0; c < cols; ++c, ++l) lane[l] += static_cast<acc_t>(x[c]) * static_cast<acc_t>(y[c]);
    out[r] = fold_sum<W>(lane);
  }
}

namespace {

// online_softmax_step's body; kScaled: the scores are raw products, times
// `scale` where they are read.
template <bool kScaled, typename acc_t>
FLASHATTN_INLINE void online_softmax_impl(acc_t* s_t, int64_t ld, int keys, int queries, const int* query_lo,
                                          const int* query_hi, acc_t* row_max, acc_t* row_sum, acc_t* o_t, int64_t o_ld,
                                          int head_dim, acc_t* work, acc_t scale) {
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  acc_t* __restrict alpha = work;            // queries: tile max, then exp(m_old - m_new)
  acc_t* __restrict shift = work + queries;  // queries: exponent shift, m_new or 0
  acc_t* __restrict tile_sum = work + 2 * queries;

  // Masked scores become -inf: they cannot raise the max and exp gives 0.
  if (query_lo) {
    for (int j = 0; j < keys; ++j) {
      acc_t* s = s_t + j * ld;
      const int lo = std::min(query_lo[j], queries), hi = std::max(query_hi[j], lo);
      fill(s, lo, kNegInf);
      fill(s + hi, queries - hi, kNegInf);
    }
  }

  fill(alpha, queries, kNegInf);
  for (int j = 0; j < keys; ++j) {
    const acc_t* __restrict s = s_t + j * ld;
    for (int i = 0; i < queries; ++i) alpha[i] = std::max(alpha[i], kScaled ? s[i] * scale : s[i]);
  }
  for (int i = 0; i < queries; ++i) {
    const acc_t m_old = row_max[i];
    const acc_t m_new = std::max(m_old, alpha[i]);
    // A query with no visible key so far keeps m = -inf but shifts by 0,
    // so its P column is exp(-inf) = 0 and its alpha exp(-inf) = 0.
    shift[i] = m_new == kNegInf ? acc_t(0) : m_new;
    alpha[i] = exp_approx(m_old - shift[i]);
    row_max[i] = m_new;
    tile_sum[i] = 0;
  }
  for (int j = 0; j < keys; ++j) {
    acc_t* __restrict s = s_t + j * ld;
    for (int i = 0; i < queries; ++i) {
      const acc_t p = exp_approx((kScaled ? s[i] * scale : s[i]) - shift[i]);
      s[i] = p;
      tile_sum[i] += p;
    }
  }
  for (int i = 0; i < queries; ++i) row_sum[i] = row_sum[i] * alpha[i] + tile_sum[i];
  // O^T *= alpha, unless every alpha is 1 (no query's max moved: most tiles
  // once the first have been seen); x * 1 = x, so skipping changes no bit.
  bool all_one = true;
  for (int i = 0; i < queries; ++i) all_one &= alpha[i] == acc_t(1);
  if (all_one) return;
  for (int d = 0; d < head_dim; ++d) {
    acc_t* __restrict o = o_t + d * o_ld;
    for (int i = 0; i < queries; ++i) o[i] *= alpha[i];
  }
}

}  // namespace

template <typename acc_t>
FLASHATTN_SIMD_CLONES void online_softmax_step(acc_t* s_t, int64_t ld, int keys, int queries, const int* query_lo,
                                               const int* query_hi, acc_t* row_max, acc_t* row_sum, acc_t* o_t,
                                               int64_t o_ld, int head_dim, acc_t* work, acc_t scale) {
  if (scale == acc_t(1)) {
    online_softmax_impl<false>(s_t, ld, keys, queries, query_lo, query_hi, row_max, row_sum, o_t, o_ld, head_dim, work,
                               scale);
  } else {
    online_softmax_impl<true>(s_t, ld, keys, queries, query_lo, query_hi, row_max, row_sum, o_t, o_ld, head_dim, work,
                              scale);
  }
}

// tanh(x) in float, in plain arithmetic that a loop vectorizes: for |x| >=
// 0.3, 1 - 2 / (exp(2|x|) + 1) with x's sign (tanh >= 0.29 there, so the
// subtraction loses under 2 bits; exp's clamp at 88.3 gives 1 for large |x|,
// inf included); below, the odd Taylor series to x^13 (the next term is under
// 1e-9 of tanh there). A NaN goes through the first branch and stays NaN.
FLASHATTN_INLINE float tanh_approx(float x) {
  const float a = std::fabs(x);
  const float far = std::copysign(1.f - 2.f / (exp_approx(2.f * a) + 1.f), x);
  const float x2 = x * x;
  float p = 21844.f / 6081075.f;
  p = p * x2 - 1382.f / 155925.f;
  p = p * x2 + 62.f / 2835.f;
  p = p * x2 - 17.f / 315.f;
  p = p * x2 + 2.f / 15.f;
  p = p * x2 - 1.f / 3.f;
  const float near = x + x * x2 * p;
  return a < 0.3f ? near : far;
}
FLASHATTN_INLINE double tanh_approx(double x) { return std::tanh(x); }

template <typename acc_t>
FLASHATTN_SIMD_CLONES void softcap_tile(acc_t* s_t, int64_t ld, int keys, int queries, acc_t scale, acc_t softcap,
                                        acc_t* dtanh) {
  const acc_t in = scale / softcap;
  for (int r = 0; r < keys; ++r) {
    acc_t* s = s_t + r * ld;
    acc_t* g = dtanh ? dtanh + r * ld : nullptr;
    for (int c = 0; c < queries; ++c) {
      const acc_t t = tanh_approx(in * s[c]);
      s[c] = softcap * t;
      if (g) g[c] = acc_t(1) - t * t;
    }
  }
}

template <typename acc_t>
FLASHATTN_SIMD_CLONES void alibi_tile(acc_t* s_t, int64_t ld, int keys, int queries, acc_t scale, acc_t slope,
                                      int64_t dist0) {
  for (int r = 0; r < keys; ++r) {
    acc_t* s = s_t + r * ld;
    const int64_t d0 = dist0 - r;  // the distance at c = 0
    for (int c = 0; c < queries; ++c) {
      const int64_t dist = d0 + c;
      s[c] = scale * s[c] - slope * static_cast<acc_t>(dist < 0 ? -dist : dist);
    }
  }
}

template <typename acc_t>
FLASHATTN_SIMD_CLONES void probs_and_dscores_t(acc_t* s_t, acc_t* dp_t, int64_t ld, int keys, int queries, acc_t scale,
                                               const acc_t* neg_lse, const acc_t* dsum, const int* query_lo,
                                               const int* query_hi) {
  for (int j = 0; j < keys; ++j) {
    acc_t* __restrict p = s_t + j * ld;
    acc_t* __restrict ds = dp_t + j * ld;
    const int lo = query_lo ? std::min(query_lo[j], queries) : 0;
    const int hi = query_hi ? std::max(query_hi[j], lo) : queries;
    fill(p, lo, acc_t(0));
    fill(ds, lo, acc_t(0));
    fill(p + hi, queries - hi, acc_t(0));
    fill(ds + hi, queries - hi, acc_t(0));
    for (int i = lo; i < hi; ++i) {
      // neg_lse = -inf (row without keys) gives exp(-inf) = 0, not a NaN.
      const acc_t prob = exp_approx(scale * p[i] + neg_lse[i]);
      p[i] = prob;
      ds[i] = prob * (ds[i] - dsum[i]);
    }
  }
}

namespace {

// O += P V for a few-queries block, kFewKvRows value rows at a time, over
// the rows that see them (a masked P is 0, but 0 * NaN is not: see
// tile_ops.h). A row that sees all of them adds them in one pass over its O
// row (each element loaded and stored once, not once a key), in the same
// order as one key at a time. P is `scores` (rows x cols).
template <typename scalar_t, typename acc_t>
FLASHATTN_INLINE void few_queries_pv_rows(const acc_t* scores, int rows, int d, const scalar_t* v, int64_t v_ld,
                                          const scalar_t* const* v_rows, int cols, const int* key_lo, const int* key_hi,
                                          acc_t* o, acc_t* kv_row) {
  constexpr int kAhead = kFewScoresAhead;  // rows
  constexpr int kPvKeys = kFewKvRows;      // value rows per pass over O
  auto v_row_of = [&](int j) { return few_key_row(v, v_ld, v_rows, j); };
  for (int j0 = 0; j0 < cols; j0 += kPvKeys) {
    const int keys = std::min(kPvKeys, cols - j0);
    const acc_t* v_acc[kPvKeys];
    for (int t = 0; t < keys; ++t) {
      const int j = j0 + t;
      if (j + kAhead < cols) prefetch_row(v_row_of(j + kAhead), d);
      v_acc[t] = row_as_acc(v_row_of(j), d, kv_row + t * d);
    }
    for (int r = 0; r < rows; ++r) {
      const int lo = key_lo ? key_lo[r] : 0;
      const int hi = key_lo ? key_hi[r] : cols;
      const acc_t* p = scores + r * cols + j0;
      acc_t* __restrict o_row = o + r * d;
      if (keys == kPvKeys && lo <= j0 && j0 + kPvKeys <= hi) {
        const acc_t* __restrict v0 = v_acc[0];
        const acc_t* __restrict v1 = v_acc[1];
        const acc_t* __restrict v2 = v_acc[2];
        const acc_t* __restrict v3 = v_acc[3];
        static_assert(kPvKeys == 4, "the pass below adds four value rows");
        for (int c = 0; c < d; ++c) {
          acc_t x = o_row[c];
          x += p[0] * v0[c];
          x += p[1] * v1[c];
          x += p[2] * v2[c];
          x += p[3] * v3[c];
          o_row[c] = x;
        }
        continue;
      }
      for (int t = 0; t < keys; ++t) {
        if (j0 + t < lo || j0 + t >= hi) continue;
        const acc_t* __restrict v_row = v_acc[t];
        for (int c = 0; c < d; ++c) o_row[c] += p[t] * v_row[c];
      }
    }
  }
}

#if FLASHATTN_HAVE_SIMD_CLONES && FLASHATTN_VECTOR_EXT
// The AVX-512 version for blocks every row sees whole: four value rows
// against four query rows a pass, their sixteen P values broadcast once
// (zmm registers: 16 + 4 values + 1 of O), so that each value vector loaded
// serves four rows (few_queries_pv_rows reloads the values for every row:
// five loads for four FMAs). Each O element gets the same FMAs in the same
// order as in few_queries_pv_rows: the same bits. 16-bit values are widened
// as they are loaded.
template <typename val_t>
FLASHATTN_INLINE void few_queries_pv_blocked(const float* scores, int rows, int d, const val_t* v, int64_t v_ld,
                                             const val_t* const* v_rows, int cols, float* o, float* kv_row) {
  if (d % 16 != 0 || rows < 4) {
    few_queries_pv_rows(scores, rows, d, v, v_ld, v_rows, cols, nullptr, nullptr, o, kv_row);
    return;
  }
  constexpr int kAhead = kFewScoresAhead;
  const int rows4 = rows / 4 * 4, cols4 = cols / 4 * 4;
  for (int j = 0; j < cols4; j += 4) {
    for (int t = 0; t < 4 && j + kAhead + t < cols; ++t) prefetch_row(few_key_row(v, v_ld, v_rows, j + kAhead + t), d);
    const val_t* __restrict v0 = few_key_row(v, v_ld, v_rows, j);
    const val_t* __restrict v1 = few_key_row(v, v_ld, v_rows, j + 1);
    const val_t* __restrict v2 = few_key_row(v, v_ld, v_rows, j + 2);
    const val_t* __restrict v3 = few_key_row(v, v_ld, v_rows, j + 3);
    for (int r = 0; r < rows4; r += 4) {
      Vec16f p[4][4];
      for (int rr = 0; rr < 4; ++rr)
        for (int t = 0; t < 4; ++t) p[rr][t] = Vec16f{} + scores[(r + rr) * cols + j + t];
      for (int c = 0; c < d; c += 16) {
        const Vec16f w0 = load16(v0 + c), w1 = load16(v1 + c), w2 = load16(v2 + c), w3 = load16(v3 + c);
        for (int rr = 0; rr < 4; ++rr) {
          float* o_row = o + (r + rr) * d + c;
          Vec16f x = load16(o_row);
          x += p[rr][0] * w0;
          x += p[rr][1] * w1;
          x += p[rr][2] * w2;
          x += p[rr][3] * w3;
          store16(o_row, x);
        }
      }
    }
    for (int r = rows4; r < rows; ++r) {  // the last rows, one at a time
      const float* p = scores + r * cols + j;
      for (int c = 0; c < d; c += 16) {
        float* o_row = o + r * d + c;
        Vec16f x = load16(o_row);
        x += (Vec16f{} + p[0]) * load16(v0 + c);
        x += (Vec16f{} + p[1]) * load16(v1 + c);
        x += (Vec16f{} + p[2]) * load16(v2 + c);
        x += (Vec16f{} + p[3]) * load16(v3 + c);
        store16(o_row, x);
      }
    }
  }
  if (cols4 < cols) {  // the last keys, as few_queries_pv_rows takes them (one at a time)
    for (int r = 0; r < rows; ++r)
      for (int t = cols4; t < cols; ++t) {
        const float pt = scores[r * cols + t];
        const val_t* v_row = few_key_row(v, v_ld, v_rows, t);
        for (int c = 0; c < d; c += 16)
          store16(o + r * d + c, load16(o + r * d + c) + (Vec16f{} + pt) * load16(v_row + c));
      }
  }
}

// One set of target versions a value type, as few_query_scores:
// few_queries_pv_rows, on AVX-512 the blocked pass (few_queries_pv_rows under
// TestKnob::kFewQueriesOneKey).
#define FLASHATTN_FEW_QUERIES_PV(val_t)                                                                                \
  __attribute__((target("arch=x86-64-v4"))) void few_queries_pv(const float* scores, int rows, int d, const val_t* v,  \
                                                                int64_t v_ld, const val_t* const* v_rows, int cols,    \
                                                                float* o, float* kv_row) {                             \
    if (test_knob_value(TestKnob::kFewQueriesOneKey) == 1) {                                                           \
      few_queries_pv_rows(scores, rows, d, v, v_ld, v_rows, cols, nullptr, nullptr, o, kv_row);                        \
    } else {                                                                                                           \
      few_queries_pv_blocked(scores, rows, d, v, v_ld, v_rows, cols, o, kv_row);                                       \
    }                                                                                                                  \
  }                                                                                                                    \
  __attribute__((target("arch=x86-64-v3"))) void few_queries_pv(const float* scores, int rows, int d, const val_t* v,  \
                                                                int64_t v_ld, const val_t* const* v_rows, int cols,    \
                                                                float* o, float* kv_row) {                             \
    few_queries_pv_rows(scores, rows, d, v, v_ld, v_rows, cols, nullptr, nullptr, o, kv_row);                          \
  }                                                                                                                    \
  __attribute__((target("default"))) void few_queries_pv(const float* scores, int rows, int d, const val_t* v,         \
                                                         int64_t v_ld, const val_t* const* v_rows, int cols, float* o, \
                                                         float* kv_row) {                                              \
    few_queries_pv_rows(scores, rows, d, v, v_ld, v_rows, cols, nullptr, nullptr, o, kv_row);                          \
  }
FLASHATTN_FEW_QUERIES_PV(float)
FLASHATTN_FEW_QUERIES_PV(c10::BFloat16)
FLASHATTN_FEW_QUERIES_PV(c10::Half)
#undef FLASHATTN_FEW_QUERIES_PV
#else
template <typename val_t>
void few_queries_pv(const float* scores, int rows, int d, const val_t* v, int64_t v_ld, const val_t* const* v_rows,
                    int cols, float* o, float* kv_row) {
  few_queries_pv_rows(scores, rows, d, v, v_ld, v_rows, cols, nullptr, nullptr, o, kv_row);
}
#endif

}  // namespace

namespace {

// mask(j) added to a row of scaled scores (a bool mask: -inf where false).
template <typename mask_t, typename acc_t>
FLASHATTN_INLINE void add_mask_row(const void* row, int64_t col_stride, int cols, acc_t* s) {
  const mask_t* m = static_cast<const mask_t*>(row);
  for (int j = 0; j < cols; ++j) {
    if constexpr (std::is_same_v<mask_t, bool>) {
      if (!m[j * col_stride]) s[j] = -std::numeric_limits<acc_t>::infinity();
    } else {
      s[j] += static_cast<acc_t>(m[j * col_stride]);
    }
  }
}

// FewQueriesMods on the scores (rows x cols), in TileScoreMod::apply's order:
// softcap, then ALiBi; an attn_mask comes alone.
template <typename acc_t>
FLASHATTN_INLINE void few_queries_score_mods(const FewQueriesMods<acc_t>& m, int rows, int cols, acc_t* scores) {
  for (int r = 0; r < rows; ++r) {
    acc_t* s = scores + r * cols;
    if (m.softcap > 0) {
      const acc_t in = acc_t(1) / m.softcap;
      for (int j = 0; j < cols; ++j) s[j] = m.softcap * tanh_approx(in * s[j]);
    }
    if (m.slope) {
      const acc_t slope = m.slope[r];
      const int64_t d0 = m.dist0[r];
      for (int j = 0; j < cols; ++j) {
        const int64_t dist = d0 - j;
        s[j] -= slope * static_cast<acc_t>(dist < 0 ? -dist : dist);
      }
    }
    if (m.bias_rows) {
      const void* row = m.bias_rows[r];
      switch (m.bias_kind) {
        case BiasKind::kBool: add_mask_row<bool>(row, m.bias_col_stride, cols, s); break;
        case BiasKind::kFloat16: add_mask_row<c10::Half>(row, m.bias_col_stride, cols, s); break;
        case BiasKind::kBFloat16: add_mask_row<c10::BFloat16>(row, m.bias_col_stride, cols, s); break;
        case BiasKind::kFloat32: add_mask_row<float>(row, m.bias_col_stride, cols, s); break;
        default: add_mask_row<double>(row, m.bias_col_stride, cols, s); break;
      }
    }
  }
}

}  // namespace

template <typename scalar_t, typename acc_t>
FLASHATTN_SIMD_CLONES void attend_few_queries(const acc_t* q, int rows, int head_dim, const scalar_t* k, int64_t k_ld,
                                              const scalar_t* v, int64_t v_ld, const scalar_t* const* k_rows,
                                              const scalar_t* const* v_rows, int cols, const int* key_lo,
                                              const int* key_hi, acc_t* row_max, acc_t* row_sum, acc_t* o,
                                              acc_t* scores, acc_t* kv_row, const FewQueriesMods<acc_t>* mods) {
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  const int d = head_dim;
  auto k_row_of = [&](int j) { return few_key_row(k, k_ld, k_rows, j); };
  // S = Q K^T, one key row at a time (shared by every query row).    rows x cols
  constexpr int kAhead = kFewScoresAhead;  // rows
  if constexpr (std::is_same_v<acc_t, float>) {
    few_query_scores(q, rows, d, k, k_ld, k_rows, cols, scores, kv_row);  // (the keys in place)
  } else {
    for (int j = 0; j < cols; ++j) {
      if (j + kAhead < cols) prefetch_row(k_row_of(j + kAhead), d);
      const acc_t* k_row = row_as_acc(k_row_of(j), d, kv_row);
      dot_rows(q, rows, d, k_row, scores + j, cols);
    }
  }
  if (mods) few_queries_score_mods(*mods, rows, cols, scores);
  // Online softmax per query row, as in online_softmax_step.
  for (int r = 0; r < rows; ++r) {
    acc_t* s = scores + r * cols;
    const int lo = key_lo ? key_lo[r] : 0;
    const int hi = key_hi ? std::max(key_hi[r], lo) : cols;
    fill(s, lo, acc_t(0));
    fill(s + hi, cols - hi, acc_t(0));
    const acc_t m_old = row_max[r];
    const acc_t m_new = std::max(m_old, max_of(s + lo, hi - lo));
    // As in online_softmax_step: a row with no finite score so far keeps
    // m = -inf and shifts by 0, so that its P is exp(-inf) = 0 for masked or
    // -inf scores and NaN for NaN scores (max_of skips NaNs: a NaN in q or k
    // must still poison the rows that see it, not make them look key-less).
    const acc_t shift = m_new == kNegInf ? acc_t(0) : m_new;
    const acc_t tile_sum = exp_shifted_sum(s + lo, hi - lo, shift);
    const acc_t alpha = exp_approx(m_old - shift);  // 0 for the first keys a row sees
    row_sum[r] = row_sum[r] * alpha + tile_sum;
    row_max[r] = m_new;
    acc_t* o_row = o + r * d;
    if (alpha != acc_t(1))
      for (int c = 0; c < d; ++c) o_row[c] *= alpha;
  }
  // O += P V (rows x d): one pass over O a group of kFewKvRows keys.
  if constexpr (std::is_same_v<acc_t, float>) {
    if (key_lo == nullptr) {  // every row sees every key: the machine's best pass (few_queries_pv)
      few_queries_pv(scores, rows, d, v, v_ld, v_rows, cols, o, kv_row);
      return;
    }
  }
  few_queries_pv_rows(scores, rows, d, v, v_ld, v_rows, cols, key_lo, key_hi, o, kv_row);
}

// ---------------------------------------------------------------------------
// Operands of the low-precision products (tile_gemm.h's pairs panels).

namespace {

template <typename lowp_t, typename src_t>
FLASHATTN_INLINE lowp_t to_lowp(src_t x) {
  if constexpr (std::is_same_v<src_t, lowp_t>) {
    return x;
  } else {
    return static_cast<lowp_t>(x);
  }
}

}  // namespace

template <typename lowp_t, typename src_t>
FLASHATTN_SIMD_CLONES void pack_pairs(const src_t* src, int64_t src_ld, int k, int n, lowp_t* dst) {
  const int w = lowp_panel_width(n);
  for (int j0 = 0; j0 < n; j0 += w) {  // one panel: k / 2 rows of w pairs
    lowp_t* panel = dst + static_cast<int64_t>(j0) * k;
    for (int p = 0; p < k; p += 2) {
      const src_t* row0 = src + p * src_ld + j0;
      const src_t* row1 = row0 + src_ld;
      lowp_t* out = panel + p * w;
#if FLASHATTN_VECTOR_EXT
      if constexpr (std::is_same_v<src_t, float> && std::is_same_v<lowp_t, c10::BFloat16>) {
        // 16 columns at a time (w is a multiple of 16): one AVX-512 register a row.
        for (int j = 0; j < w; j += 16) {
          const Vec32u16 both = interleave16(round16_bf16(row0 + j), round16_bf16(row1 + j));
          std::memcpy(out + 2 * j, &both, sizeof(both));
        }
        continue;
      }
      // Rows p, p + 1 interleaved, 8 columns at a time (w is a multiple of 8).
      for (int j = 0; j < w; j += 8) {
        Vec8u16 a, b;
        if constexpr (std::is_same_v<src_t, float>) {
          a = round8(load8(row0 + j), static_cast<lowp_t*>(nullptr));
          b = round8(load8(row1 + j), static_cast<lowp_t*>(nullptr));
        } else {
          a = bits8(row0 + j), b = bits8(row1 + j);
        }
        const Vec16u16 both = interleave8(a, b);
        std::memcpy(out + 2 * j, &both, sizeof(both));
      }
#else
      for (int j = 0; j < w; ++j) {
        out[2 * j] = to_lowp<lowp_t>(row0[j]);
        out[2 * j + 1] = to_lowp<lowp_t>(row1[j]);
      }
#endif
    }
  }
}

template <typename lowp_t>
FLASHATTN_SIMD_CLONES void pack_pairs_transposed(const lowp_t* src, int64_t src_ld, int k, int n, lowp_t* dst) {
  const int w = lowp_panel_width(n);
  for (int j0 = 0; j0 < n; j0 += w) {
    lowp_t* panel = dst + static_cast<int64_t>(j0) * k;
    int p_done = 0;  // k in blocks of 16 (8 pairs) x 8 columns: a transpose of 32-bit pairs
#if FLASHATTN_VECTOR_EXT
    p_done = k / 16 * 16;
    for (int j = 0; j < w; j += 8) {
      for (int p0 = 0; p0 < p_done; p0 += 16) {
        Vec8u32 block[8];  // block[i]: the pairs p0.. of column j0 + j + i
        for (int i = 0; i < 8; ++i) std::memcpy(&block[i], src + (j0 + j + i) * src_ld + p0, sizeof(Vec8u32));
        transpose8x8(block);  // block[m]: pair p0 / 2 + m of the 8 columns
        for (int m = 0; m < 8; ++m) std::memcpy(panel + (p0 + 2 * m) * w + 2 * j, &block[m], sizeof(Vec8u32));
      }
    }
#endif
    for (int j = 0; j < w; ++j)
      for (int p = p_done; p < k; ++p) panel[(p / 2) * 2 * w + 2 * j + p % 2] = src[(j0 + j) * src_ld + p];
  }
}

template <typename lowp_t>
FLASHATTN_SIMD_CLONES void transpose_lowp(const lowp_t* src, int64_t src_ld, int rows, int cols, lowp_t* dst,
                                          int64_t dst_ld) {
  int rows8 = 0, cols8 = 0;  // the part done in 8 x 8 blocks (the 16-bit values widened to 32-bit lanes)
#if FLASHATTN_VECTOR_EXT
  rows8 = rows / 8 * 8, cols8 = cols / 8 * 8;
  for (int r0 = 0; r0 < rows8; r0 += 8) {
    for (int c0 = 0; c0 < cols8; c0 += 8) {
      Vec8u32 block[8];
      for (int i = 0; i < 8; ++i) block[i] = __builtin_convertvector(bits8(src + (r0 + i) * src_ld + c0), Vec8u32);
      transpose8x8(block);
      for (int i = 0; i < 8; ++i) {
        const Vec8u16 narrow = __builtin_convertvector(block[i], Vec8u16);
        std::memcpy(dst + (c0 + i) * dst_ld + r0, &narrow, sizeof(narrow));
      }
    }
  }
#endif
  for (int c = cols8; c < cols; ++c)
    for (int r = 0; r < rows8; ++r) dst[c * dst_ld + r] = src[r * src_ld + c];
  for (int c = 0; c < cols; ++c)
    for (int r = rows8; r < rows; ++r) dst[c * dst_ld + r] = src[r * src_ld + c];
}

template <typename lowp_t>
FLASHATTN_SIMD_CLONES void zero_pairs_rows(lowp_t* b, int k, int n, const int* rows, int num_rows) {
  const int w = lowp_panel_width(n);
  for (int r = 0; r < num_rows; ++r) {
    const int p = rows[r];
    for (int j0 = 0; j0 < n; j0 += w) {
      lowp_t* row = b + static_cast<int64_t>(j0) * k + (p / 2) * 2 * w + p % 2;
      for (int j = 0; j < w; ++j) row[2 * j] = lowp_t(0.f);
    }
  }
}

template <typename lowp_t>
FLASHATTN_SIMD_CLONES void zero_columns(lowp_t* t, int64_t ld, int rows, const int* columns, int num_columns) {
  for (int r = 0; r < rows; ++r)
    for (int n = 0; n < num_columns; ++n) t[r * ld + columns[n]] = lowp_t(0.f);
}

template <typename acc_t>
FLASHATTN_SIMD_CLONES int take_nonfinite_columns(acc_t* t, int64_t ld, int rows, int cols, acc_t* work, int* index) {
  // x * 0 is (+-)0 for a finite x and NaN otherwise.
  fill(work, cols, acc_t(0));
  for (int r = 0; r < rows; ++r) {
    const acc_t* __restrict row = t + r * ld;
    for (int j = 0; j < cols; ++j) work[j] += row[j] * acc_t(0);
  }
  int n = 0;
  for (int j = 0; j < cols; ++j)
    if (work[j] != acc_t(0)) index[n++] = j;
  for (int i = 0; i < n; ++i)
    for (int r = 0; r < rows; ++r) t[r * ld + index[i]] = acc_t(0);
  return n;
}

template <typename scalar_t, typename acc_t>
FLASHATTN_SIMD_CLONES int nonfinite_rows(const scalar_t* t, int64_t ld, int rows, int cols, int* index) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>) {
    // A 16-bit value is a NaN or an infinity where its exponent bits are all
    // ones: one integer compare a value, which vectorizes (the conversion to
    // acc_t below did not: perf, a causal bfloat16 forward, 11% of the time
    // in this scan of the masked tiles' value rows).
    constexpr uint16_t kExp = std::is_same_v<scalar_t, c10::BFloat16> ? 0x7F80 : 0x7C00;
    int n = 0;
    for (int r = 0; r < rows; ++r) {
      const scalar_t* x = t + r * ld;
      uint16_t top = 0;  // the largest exponent field of the row
      for (int c = 0; c < cols; ++c) top = std::max<uint16_t>(top, x[c].x & kExp);
      if (top == kExp) index[n++] = r;
    }
    return n;
  }
  constexpr int W = kLanes<acc_t>;
  int n = 0;
  for (int r = 0; r < rows; ++r) {
    const scalar_t* x = t + r * ld;
    acc_t lane[W] = {};
    int c = 0;
    for (; c + W <= cols; c += W)
      for (int l = 0; l < W; ++l) lane[l] += static_cast<acc_t>(x[c + l]) * acc_t(0);
    for (int l = 0; c < cols; ++c, ++l) lane[l] += static_cast<acc_t>(x[c]) * acc_t(0);
    if (fold_sum<W>(lane) != acc_t(0)) index[n++] = r;
  }
  return n;
}

// Instantiations.
#define FLASHATTN_INSTANTIATE_IO(scalar_t, acc_t)                                                                      \
  template void load_tile<scalar_t, acc_t>(const scalar_t*, int64_t, int, int, acc_t*, int64_t);                       \
  template void load_tile_transposed<scalar_t, acc_t>(const scalar_t*, int64_t, int, int, acc_t, acc_t*, int64_t);     \
  template void add_tile_transposed<scalar_t, acc_t>(const scalar_t*, int64_t, int, int, acc_t, acc_t*, int64_t);      \
  template void store_tile<acc_t, scalar_t>(const acc_t*, int64_t, int, int, acc_t, scalar_t*, int64_t);               \
  template void store_tile_transposed<acc_t, scalar_t>(const acc_t*, int64_t, int, int, acc_t, const acc_t*,           \
                                                       scalar_t*, int64_t);                                            \
  template void row_dot<scalar_t, acc_t>(const scalar_t*, int64_t, const scalar_t*, int64_t, int, int, acc_t*);        \
  template void attend_few_queries<scalar_t, acc_t>(const acc_t*, int, int, const scalar_t*, int64_t, const scalar_t*, \
                                                    int64_t, const scalar_t* const*, const scalar_t* const*, int,      \
                                                    const int*, const int*, acc_t*, acc_t*, acc_t*, acc_t*, acc_t*,    \
                                                    const FewQueriesMods<acc_t>*);                                     \
  template int nonfinite_rows<scalar_t, acc_t>(const scalar_t*, int64_t, int, int, int*);

FLASHATTN_INSTANTIATE_IO(float, float)
FLASHATTN_INSTANTIATE_IO(c10::BFloat16, float)
FLASHATTN_INSTANTIATE_IO(c10::Half, float)
FLASHATTN_INSTANTIATE_IO(double, double)
#undef FLASHATTN_INSTANTIATE_IO

#define FLASHATTN_INSTANTIATE_MATH(acc_t)                                                                             \
  template void online_softmax_step<acc_t>(acc_t*, int64_t, int, int, const int*, const int*, acc_t*, acc_t*, acc_t*, \
                                           int64_t, int, acc_t*, acc_t);                                              \
  template void probs_and_dscores_t<acc_t>(acc_t*, acc_t*, int64_t, int, int, acc_t, const acc_t*, const acc_t*,      \
                                           const int*, const int*);                                                   \
  template int take_nonfinite_columns<acc_t>(acc_t*, int64_t, int, int, acc_t*, int*);                                \
  template void softcap_tile<acc_t>(acc_t*, int64_t, int, int, acc_t, acc_t, acc_t*);                                 \
  template void alibi_tile<acc_t>(acc_t*, int64_t, int, int, acc_t, acc_t, int64_t);

FLASHATTN_INSTANTIATE_MATH(float)
FLASHATTN_INSTANTIATE_MATH(double)
#undef FLASHATTN_INSTANTIATE_MATH

#define FLASHATTN_INSTANTIATE_LOWP(lowp_t)                                                  \
  template void pack_pairs<lowp_t, float>(const float*, int64_t, int, int, lowp_t*);        \
  template void pack_pairs<lowp_t, lowp_t>(const lowp_t*, int64_t, int, int, lowp_t*);      \
  template void pack_pairs_transposed<lowp_t>(const lowp_t*, int64_t, int, int, lowp_t*);   \
  template void transpose_lowp<lowp_t>(const lowp_t*, int64_t, int, int, lowp_t*, int64_t); \
  template void zero_columns<lowp_t>(lowp_t*, int64_t, int, const int*, int);               \
  template void zero_pairs_rows<lowp_t>(lowp_t*, int, int, const int*, int);

FLASHATTN_INSTANTIATE_LOWP(c10::BFloat16)
FLASHATTN_INSTANTIATE_LOWP(c10::Half)
#undef FLASHATTN_INSTANTIATE_LOWP

}  // namespace cpu
}  // namespace flashattn
