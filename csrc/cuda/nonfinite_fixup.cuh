// The non-finite rule on the CUDA kernels (issue #9, finding 5; README,
// "Errors, non-finite inputs and transforms"): an output row depends only on
// the keys it can see, and a gradient row only on the (query, key) pairs it is
// made of. The kernels mask the scores and dS (-inf / 0), but on a tile the mask
// cuts through the tensor cores still form 0 * x for a masked zero probability
// and a non-finite operand row (v in P V; dO in dV, q in dK, k in dQ), and
// 0 * NaN = 0 * inf = NaN.
//
// Such a contamination can only turn a value into NaN: a finite output value is
// never wrong. So the fast path only looks for non-finite values in what each
// thread already holds in registers at the epilogue (a compare per value and one
// warp or CTA vote per tile, nothing in the main loops), and only a tile that
// holds one (its inputs hold a NaN or an infinity) takes the slow path below:
// every row with a non-finite value is recomputed exactly, in fp32, by a warp
// that loops over the row's visible (query, key) pairs (the visible set of
// mask.cuh's BlockMask, or of the decode kernel's clamped ranges), and
// overwritten before it is stored (in the shared-memory staging tile) or after
// the normal store is known complete (global memory, same warp or after a CTA
// barrier). A row that is NaN by the rule (a NaN at a key it sees) goes through
// the recompute too and stays NaN: slow, but rare. The recompute is a fixed
// loop order: the deterministic backward stays bitwise reproducible.
//
// The slow-path routines are __noinline__ and take their arguments by value
// (FixupArgs, not the kernel's parameter struct, whose address would force a
// local copy), so that they add no registers to the kernels' main loops.
#pragma once

#include <cfloat>

#include "../flash_params.h"
#include "../kvcache_params.h"
#include "dropout.cuh"
#include "mask.cuh"
#include "ptx.cuh"
#include "score_mod.cuh"

#ifndef FLASHATTN_NONFINITE_SLOW
#define FLASHATTN_NONFINITE_SLOW __noinline__
#endif

namespace flashattn {
namespace nonfinite {

// ---- detection (fast path) -------------------------------------------------

// NaN or +-inf (one compare; stays correct under --use_fast_math, which does not
// assume finite values).
__device__ __forceinline__ bool is_bad(float x) { return !(fabsf(x) <= FLT_MAX); }

template <int kMT, int kNT>
__device__ __forceinline__ bool any_bad(const float (&acc)[kMT][kNT][4]) {
  bool bad = false;
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int ni = 0; ni < kNT; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) bad |= is_bad(acc[mi][ni][e]);
  return bad;
}

// ---- helpers -----------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// A row of head_dim values, lane-split: lane holds columns lane + 32 u (zero past d).
template <int kPer, typename T>
__device__ __forceinline__ void load_row(float (&x)[kPer], const T* row, int d, int lane) {
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int c = lane + 32 * u;
    x[u] = c < d ? to_float(row[c]) : 0.f;
  }
}

template <int kPer>
__device__ __forceinline__ float dot(const float (&a)[kPer], const float (&b)[kPer]) {
  float s = 0.f;
#pragma unroll
  for (int u = 0; u < kPer; ++u) s += a[u] * b[u];
  return warp_sum(s);
}

// Element (r, c) of a swizzled shared-memory tile (tile.cuh's SmemTile).
template <typename Tile, typename T>
__device__ __forceinline__ T& tile_at(T* tile, int r, int c) {
  return tile[Tile::offset(r, c & ~7) + (c & 7)];
}

// Does row r of a tile hold a non-finite value in columns [c_lo, c_hi)? (warp-uniform)
template <typename Tile, typename T>
__device__ __forceinline__ bool tile_row_bad(T* tile, int r, int c_lo, int c_hi, int lane) {
  bool bad = false;
  for (int c = c_lo + lane; c < c_hi; c += 32) bad |= is_bad(to_float(tile_at<Tile>(tile, r, c)));
  return __any_sync(0xffffffffu, bad);
}

// ---- the exact row computations (slow path; whole warp, lane-split columns) --

// o (lane-split) and the natural-log lse of one query row over the keys
// [lo, hi), key j at k_row(j) / v_row(j): softmax with naive semantics on the
// visible set (a NaN score makes the row NaN; +inf makes it NaN as in
// torch.softmax; a NaN or infinity in a visible v reaches its column). A row
// that sees no key: 0 and -inf. Two passes (max, then sum) so that fmaxf, which
// drops NaN, is never asked about one.
// score(qk, j): the (scaled, modified) score of key j, natural-log units;
// drop(j): what key j's probability is multiplied by in o (dropout: 0 or
// 1 / (1 - p); the lse is the softmax's).
struct NoDrop {
  __device__ __forceinline__ float operator()(int) const { return 1.f; }
};
template <int kPer, typename T, typename Score, typename KRow, typename VRow, typename Drop = NoDrop>
__device__ __forceinline__ float attend_row(float (&o)[kPer], const T* q_row, int d, Score&& score, int lo, int hi,
                                            KRow&& k_row, VRow&& v_row, int lane, Drop&& drop = {}) {
  float q[kPer];
  load_row(q, q_row, d, lane);
#pragma unroll
  for (int u = 0; u < kPer; ++u) o[u] = 0.f;
  if (hi <= lo) return -INFINITY;
  float mx = -INFINITY;
  bool nan = false;
  for (int j = lo; j < hi; ++j) {
    float k[kPer];
    load_row(k, k_row(j), d, lane);
    const float s = score(dot(q, k), j);
    nan |= isnan(s);
    mx = fmaxf(mx, s);
  }
  if (nan) {
#pragma unroll
    for (int u = 0; u < kPer; ++u) o[u] = NAN;
    return NAN;
  }
  float l = 0.f;
  for (int j = lo; j < hi; ++j) {
    float k[kPer], v[kPer];
    load_row(k, k_row(j), d, lane);
    load_row(v, v_row(j), d, lane);
    const float pj = expf(score(dot(q, k), j) - mx);  // mx = +-inf: NaN, as torch.softmax
    l += pj;
    const float po = pj * drop(j);
#pragma unroll
    for (int u = 0; u < kPer; ++u) o[u] += po * v[u];
  }
#pragma unroll
  for (int u = 0; u < kPer; ++u) o[u] /= l;
  return mx + logf(l);
}

// What the slow paths of the forward and backward kernels read: the rows of
// one sequence (head 0 of its first row; 16-bit elements, the CUDA kernels'
// types), its mask and the scalars.
struct FixupArgs {
  __device__ __forceinline__ explicit FixupArgs(const BlockMask& m) : mask(m) {}
  const void *q, *k, *v, *dout;
  int64_t q_row, q_head, k_row, k_head, v_row, v_head, do_row, do_head;
  float* lse;         // (head 0, row 0 of the sequence); heads vec_head apart
  const float* dsum;  // the same layout (backward)
  int64_t vec_head;
  BlockMask mask;
  int head_dim, ratio;
  float scale;
  // A paged cache (KvCacheView, forward only): the sequence's page-table row
  // (nullptr: k and v rows k_row / v_row apart from k / v), the view, and the
  // block strides of k and v.
  const int32_t* page_row = nullptr;
  KvCacheView kv;
  int64_t k_block = 0, v_block = 0;
};

// The score of query i, key j of head h from q.k (natural-log units) and
// *dmod = d score / d (scale q.k), the slow paths' one rule, as a policy: the
// plain kernels pass PlainScore (an empty argument: their slow paths compile as
// before the score mods existed), the kScoreMod instances ModScore. drop(h, i,
// j) is dropout's factor of P(i, j) in O and dV, and of dP in dS (0 or
// 1 / (1 - p); 1 without dropout), which the score-mod instances hold too.
struct PlainScore {
  __device__ __forceinline__ float operator()(const FixupArgs& a, float qk, int, int, int, float* dmod) const {
    *dmod = 1.f;
    return a.scale * qk;
  }
  __device__ __forceinline__ float drop(int, int, int) const { return 1.f; }
};
struct ModScore {
  ScoreMod mod;
  int b;  // the batch entry (its slopes; dropout's plane)
  DropoutParams dropout;
  int heads_q;
  __device__ __forceinline__ ModScore(const AttnFwdParams& p, int b_)
      : mod(p.score_mod), b(b_), dropout(p.dropout), heads_q(p.heads_q) {}
  __device__ __forceinline__ float operator()(const FixupArgs& a, float qk, int h, int i, int j, float* dmod) const {
    const ScoreModTile m(mod, a.scale, b, h, a.mask.seqlen_q, a.mask.seqlen_k);
    return m.apply(qk, i, j, dmod) * kLn2;
  }
  __device__ __forceinline__ float drop(int h, int i, int j) const {
    if (!dropout.enabled()) return 1.f;
    return DropoutPlane(dropout, b, heads_q, h).keep(i, j) ? static_cast<float>(dropout.scale) : 0.f;
  }
};

// The score policy of a kernel instance (kScoreMod: the call's softcap / ALiBi, dropout).
template <bool kScoreMod>
__device__ __forceinline__ auto score_policy(const AttnFwdParams& p, int b) {
  if constexpr (kScoreMod) {
    return ModScore(p, b);
  } else {
    return PlainScore{};
  }
}

__device__ __forceinline__ FixupArgs fixup_args(const AttnFwdParams& p, const SeqInfo& seq, int b) {
  FixupArgs a(BlockMask(p, seq));
  a.q = static_cast<const char*>(p.q_ptr) + 2 * seq.q_offset(p.q_batch_stride, p.q_row_stride, b);
  a.k = static_cast<const char*>(p.k_ptr) + 2 * seq.k_offset(p.k_batch_stride, p.k_row_stride, b);
  a.v = static_cast<const char*>(p.v_ptr) + 2 * seq.k_offset(p.v_batch_stride, p.v_row_stride, b);
  a.dout = nullptr;
  a.q_row = p.q_row_stride, a.q_head = p.q_head_stride;
  a.k_row = p.k_row_stride, a.k_head = p.k_head_stride;
  a.v_row = p.v_row_stride, a.v_head = p.v_head_stride;
  a.do_row = 0, a.do_head = 0;
  a.lse = static_cast<float*>(p.lse_ptr) + seq.rowvec_offset(p, b, 0);
  a.dsum = nullptr;
  a.vec_head = seq.rowvec_head_stride(p);
  a.head_dim = p.head_dim, a.ratio = p.heads_ratio();
  a.scale = static_cast<float>(p.softmax_scale);
  if (seq.varlen && p.kv.paged()) {
    a.k = p.k_ptr, a.v = p.v_ptr;
    a.page_row = p.kv.block_table + b * p.kv.table_batch_stride;
    a.kv = p.kv;
    a.k_block = p.k_batch_stride, a.v_block = p.v_batch_stride;
  }
  return a;
}

__device__ __forceinline__ FixupArgs fixup_args(const AttnBwdParams& p, const SeqInfo& seq, int b) {
  FixupArgs a = fixup_args(static_cast<const AttnFwdParams&>(p), seq, b);
  a.dout = static_cast<const char*>(p.do_ptr) + 2 * seq.q_offset(p.do_batch_stride, p.do_row_stride, b);
  a.do_row = p.do_row_stride, a.do_head = p.do_head_stride;
  a.dsum = static_cast<const float*>(p.dsum_ptr) + seq.rowvec_offset(p, b, 0);
  return a;
}

template <typename T>
__device__ __forceinline__ const T* q_row(const FixupArgs& a, int h, int i) {
  return static_cast<const T*>(a.q) + int64_t(i) * a.q_row + h * a.q_head;
}
template <typename T>
__device__ __forceinline__ const T* do_row(const FixupArgs& a, int h, int i) {
  return static_cast<const T*>(a.dout) + int64_t(i) * a.do_row + h * a.do_head;
}
template <typename T>
__device__ __forceinline__ const T* k_row(const FixupArgs& a, int h_kv, int j) {
  const int64_t row = a.page_row ? a.kv.page_offset(a.page_row, j, a.k_block, a.k_row) : int64_t(j) * a.k_row;
  return static_cast<const T*>(a.k) + row + h_kv * a.k_head;
}
template <typename T>
__device__ __forceinline__ const T* v_row(const FixupArgs& a, int h_kv, int j) {
  const int64_t row = a.page_row ? a.kv.page_offset(a.page_row, j, a.v_block, a.v_row) : int64_t(j) * a.v_row;
  return static_cast<const T*>(a.v) + row + h_kv * a.v_head;
}

// P of a visible pair from the saved lse (natural log); a row that saw no key has P = 0.
__device__ __forceinline__ float prob(float s, float lse) { return lse == -INFINITY ? 0.f : expf(s - lse); }

// dK_j (scaled) and dV_j of key j of kv head h_kv: sums over the query heads of
// its GQA group and the queries that see j.
template <int kPer, typename T, typename Score>
__device__ __forceinline__ void grad_key_row(float (&dk)[kPer], float (&dv)[kPer], const FixupArgs& a, int h_kv, int j,
                                             const Score& score, int lane) {
  const int d = a.head_dim;
  float k[kPer], v[kPer];
  load_row(k, k_row<T>(a, h_kv, j), d, lane);
  load_row(v, v_row<T>(a, h_kv, j), d, lane);
#pragma unroll
  for (int u = 0; u < kPer; ++u) dk[u] = 0.f, dv[u] = 0.f;
  int i_min, i_max;
  a.mask.query_block_range<1>(j, 1, i_min, i_max);
  for (int hq = h_kv * a.ratio; hq < (h_kv + 1) * a.ratio; ++hq)
    for (int i = i_min; i < i_max; ++i) {
      if (j < a.mask.key_lo(i) || j >= a.mask.key_hi(i)) continue;
      float q[kPer], dout[kPer];
      load_row(q, q_row<T>(a, hq, i), d, lane);
      load_row(dout, do_row<T>(a, hq, i), d, lane);
      float dmod;
      const float pij = prob(score(a, dot(q, k), hq, i, j, &dmod), a.lse[hq * a.vec_head + i]);
      const float drop = score.drop(hq, i, j);
      const float ds = pij * (dot(dout, v) * drop - a.dsum[hq * a.vec_head + i]) * dmod;
      const float pv = pij * drop;
#pragma unroll
      for (int u = 0; u < kPer; ++u) dv[u] += pv * dout[u], dk[u] += ds * q[u];
    }
#pragma unroll
  for (int u = 0; u < kPer; ++u) dk[u] *= a.scale;
}

// dQ_i (scaled) of query i of head h: a sum over the keys i sees.
template <int kPer, typename T, typename Score>
__device__ __forceinline__ void grad_query_row(float (&dq)[kPer], const FixupArgs& a, int h, int i, const Score& score,
                                               int lane) {
  const int d = a.head_dim, h_kv = h / a.ratio;
  float q[kPer], dout[kPer];
  load_row(q, q_row<T>(a, h, i), d, lane);
  load_row(dout, do_row<T>(a, h, i), d, lane);
  const float lse = a.lse[h * a.vec_head + i], dsum = a.dsum[h * a.vec_head + i];
#pragma unroll
  for (int u = 0; u < kPer; ++u) dq[u] = 0.f;
  const int lo = a.mask.key_lo(i), hi = a.mask.key_hi(i);
  for (int j = lo; j < hi; ++j) {
    float k[kPer], v[kPer];
    load_row(k, k_row<T>(a, h_kv, j), d, lane);
    load_row(v, v_row<T>(a, h_kv, j), d, lane);
    float dmod;
    const float pij = prob(score(a, dot(q, k), h, i, j, &dmod), lse);
    const float ds = pij * (dot(dout, v) * score.drop(h, i, j) - dsum) * dmod;
#pragma unroll
    for (int u = 0; u < kPer; ++u) dq[u] += ds * k[u];
  }
#pragma unroll
  for (int u = 0; u < kPer; ++u) dq[u] *= a.scale;
}

// ---- the kernels' slow paths ---------------------------------------------------

// Forward: rows [r0, r0 + nrows) (< rows_valid) of a query block starting at
// query m0 of head h, staged as T in `tile`: every row holding a non-finite value
// is recomputed there, and its lse in global memory (after the kernel's own
// write of it by this warp). Whole warp; the caller has written the rows.
template <typename Tile, int kPer, typename T, typename Score = PlainScore>
__device__ FLASHATTN_NONFINITE_SLOW void fix_fwd_rows(FixupArgs a, int h, int m0, int r0, int nrows, int rows_valid,
                                                      T* tile, int lane, Score score = {}) {
  __syncwarp();
  const int d = a.head_dim, h_kv = h / a.ratio;
  for (int r = r0; r < r0 + nrows && r < rows_valid; ++r) {
    if (!tile_row_bad<Tile>(tile, r, 0, d, lane)) continue;
    const int i = m0 + r;
    float o[kPer];
    const float lse = attend_row(
        o, q_row<T>(a, h, i), d,
        [&](float qk, int j) {
          float dmod;
          return score(a, qk, h, i, j, &dmod);
        },
        a.mask.key_lo(i), a.mask.key_hi(i), [&](int j) { return k_row<T>(a, h_kv, j); },
        [&](int j) { return v_row<T>(a, h_kv, j); }, lane, [&](int j) { return score.drop(h, i, j); });
#pragma unroll
    for (int u = 0; u < kPer; ++u)
      if (lane + 32 * u < d) tile_at<Tile>(tile, r, lane + 32 * u) = from_float<T>(o[u]);
    if (lane == 0) a.lse[h * a.vec_head + i] = lse;
  }
  __syncwarp();
}

// Backward dK / dV: rows r0, r0 + step, ... (< keys_valid) of the key block
// starting at key n0 of kv head h_kv, staged as T (dK scaled) in tile_dk /
// tile_dv over the columns [c_lo, c_hi) (the CTA's head-dim slice): a row
// with a non-finite value in either is recomputed in both.
template <typename Tile, int kPer, typename T, typename Score = PlainScore>
__device__ FLASHATTN_NONFINITE_SLOW void fix_key_rows(FixupArgs a, int h_kv, int n0, int r0, int r_end, int step,
                                                      int keys_valid, T* tile_dk, T* tile_dv, int c_lo, int c_hi,
                                                      int lane, Score score = {}) {
  __syncwarp();
  c_hi = min(c_hi, a.head_dim);
  for (int r = r0; r < r_end && r < keys_valid; r += step) {
    if (!tile_row_bad<Tile>(tile_dk, r, c_lo, c_hi, lane) && !tile_row_bad<Tile>(tile_dv, r, c_lo, c_hi, lane))
      continue;
    float dk[kPer], dv[kPer];
    grad_key_row<kPer, T>(dk, dv, a, h_kv, n0 + r, score, lane);
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int c = lane + 32 * u;
      if (c >= c_lo && c < c_hi) {
        tile_at<Tile>(tile_dk, r, c) = from_float<T>(dk[u]);
        tile_at<Tile>(tile_dv, r, c) = from_float<T>(dv[u]);
      }
    }
  }
  __syncwarp();
}

// Backward dQ staged in a tile (the deterministic mma.sync dQ kernel): rows
// [r0, r0 + nrows) (< rows_valid) of the query block at m0 of head h.
template <typename Tile, int kPer, typename T, typename Score = PlainScore>
__device__ FLASHATTN_NONFINITE_SLOW void fix_dq_rows(FixupArgs a, int h, int m0, int r0, int nrows, int rows_valid,
                                                     T* tile, int lane, Score score = {}) {
  __syncwarp();
  const int d = a.head_dim;
  for (int r = r0; r < r0 + nrows && r < rows_valid; ++r) {
    if (!tile_row_bad<Tile>(tile, r, 0, d, lane)) continue;
    float dq[kPer];
    grad_query_row<kPer, T>(dq, a, h, m0 + r, score, lane);
#pragma unroll
    for (int u = 0; u < kPer; ++u)
      if (lane + 32 * u < d) tile_at<Tile>(tile, r, lane + 32 * u) = from_float<T>(dq[u]);
  }
  __syncwarp();
}

// Backward dQ written straight to global memory (the fp32 accumulator's
// conversion kernels): query i of head h, columns [c_lo, c_hi), at dq_row
// (column 0). Called by the whole warp after its own normal writes of them.
template <int kPer, typename T, typename Score = PlainScore>
__device__ FLASHATTN_NONFINITE_SLOW void fix_dq_row_global(FixupArgs a, int h, int i, T* dq_row, int c_lo, int c_hi,
                                                           int lane, Score score = {}) {
  __syncwarp();
  float dq[kPer];
  grad_query_row<kPer, T>(dq, a, h, i, score, lane);
  c_hi = min(c_hi, a.head_dim);
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int c = lane + 32 * u;
    if (c >= c_lo && c < c_hi) dq_row[c] = from_float<T>(dq[u]);
  }
  __syncwarp();
}

// ---- flash_attn_with_kvcache (flash_decode_kernel.cuh) ---------------------------

// The decode kernel's inputs, by value (see the file comment).
struct DecodeFixupArgs {
  const void *q, *k, *v;
  void* o;
  float* lse;
  const int32_t *seqlens_k, *leftpad, *batch_idx, *block_table;
  int64_t q_batch, q_row, q_head, k_batch, k_row, k_head, v_batch, v_row, v_head, o_batch, o_row, o_head, table_batch;
  int heads_q, heads_kv, seqlen_q, head_dim, capacity, cache_rows, page_size, window_left, window_right;
  float scale;
};

__device__ __forceinline__ DecodeFixupArgs decode_fixup_args(const KvcacheParams& p) {
  DecodeFixupArgs a;
  a.q = p.q_ptr, a.k = p.k_ptr, a.v = p.v_ptr, a.o = p.o_ptr, a.lse = static_cast<float*>(p.lse_ptr);
  a.seqlens_k = p.seqlens_k, a.leftpad = p.leftpad, a.batch_idx = p.batch_idx, a.block_table = p.block_table;
  a.q_batch = p.q_batch_stride, a.q_row = p.q_row_stride, a.q_head = p.q_head_stride;
  a.k_batch = p.k_batch_stride, a.k_row = p.k_row_stride, a.k_head = p.k_head_stride;
  a.v_batch = p.v_batch_stride, a.v_row = p.v_row_stride, a.v_head = p.v_head_stride;
  a.o_batch = p.o_batch_stride, a.o_row = p.o_row_stride, a.o_head = p.o_head_stride;
  a.table_batch = p.block_table_batch_stride;
  a.heads_q = p.heads_q, a.heads_kv = p.heads_kv, a.seqlen_q = p.seqlen_q, a.head_dim = p.head_dim;
  a.capacity = p.capacity, a.cache_rows = p.cache_rows, a.page_size = p.page_size;
  a.window_left = p.window_left, a.window_right = p.window_right;
  a.scale = static_cast<float>(p.softmax_scale);
  return a;
}

__device__ __forceinline__ int clamp_to(int64_t x, int lo, int hi) {
  return static_cast<int>(x < lo ? lo : (x > hi ? hi : x));
}

// Output row (b, head, query qi) of the decode kernel, written to o and lse
// (natural log) when it holds a non-finite value: the visible keys are the
// kernel's (cache_seqlens and cache_leftpad clamped as it clamps them, the
// window aligned bottom-right), read through the page table or cache_batch_idx
// as the kernel reads them. Whole warp, after the row's normal store.
// The decode kernel's score policies (as PlainScore / ModScore above): the
// score of query qi, key j of (b, head), the row holding seqlen_k keys.
struct DecodePlainScore {
  __device__ __forceinline__ float operator()(const DecodeFixupArgs& a, float qk, int, int, int, int, int) const {
    return a.scale * qk;
  }
};
struct DecodeModScore {
  ScoreMod mod;
  __device__ __forceinline__ float operator()(const DecodeFixupArgs& a, float qk, int b, int head, int qi, int j,
                                              int seqlen_k) const {
    return ScoreModTile(mod, a.scale, b, head, a.seqlen_q, seqlen_k).apply(qk, qi, j) * kLn2;
  }
};

template <int kPer, typename T, typename Score = DecodePlainScore>
__device__ FLASHATTN_NONFINITE_SLOW void fix_decode_row(DecodeFixupArgs a, int b, int head, int qi, int lane,
                                                        Score score_of = {}) {
  __syncwarp();
  const int d = a.head_dim;
  T* out = static_cast<T*>(a.o) + b * a.o_batch + int64_t(qi) * a.o_row + head * a.o_head;
  bool bad = false;
  for (int c = lane; c < d; c += 32) bad |= is_bad(to_float(out[c]));
  if (!__any_sync(0xffffffffu, bad)) return;
  const int seqlen_k = row_seqlen_k(a.seqlens_k, b, a.capacity);
  const int key_begin = a.leftpad ? clamp_to(a.leftpad[b], 0, seqlen_k) : 0;
  const int64_t diag = int64_t(seqlen_k) - a.seqlen_q;
  const int lo = a.window_left < 0 ? key_begin : clamp_to(diag + qi - a.window_left, key_begin, seqlen_k);
  const int hi = a.window_right < 0 ? seqlen_k : clamp_to(diag + qi + a.window_right + 1, key_begin, seqlen_k);
  const bool paged = a.block_table != nullptr;
  const int cache_row = paged ? 0 : (a.batch_idx ? clamp_to(a.batch_idx[b], 0, a.cache_rows - 1) : b);
  const int32_t* table = paged ? a.block_table + b * a.table_batch : nullptr;
  const int h_kv = head / (a.heads_q / a.heads_kv);
  const T* k_base = static_cast<const T*>(a.k) + h_kv * a.k_head;
  const T* v_base = static_cast<const T*>(a.v) + h_kv * a.v_head;
  auto slot = [&](int j, int64_t batch, int64_t row) {
    if (!paged) return cache_row * batch + int64_t(j) * row;
    const int64_t page = clamp_to(table[j / a.page_size], 0, a.cache_rows - 1);
    return page * batch + int64_t(j % a.page_size) * row;
  };
  // ALiBi's distance uses the row's key count (its keys [0, seqlen_k), query qi at seqlen_k - seqlen_q + qi).
  auto score = [&](float qk, int j) { return score_of(a, qk, b, head, qi, j, seqlen_k); };
  float o[kPer];
  const float lse = attend_row(
      o, static_cast<const T*>(a.q) + b * a.q_batch + int64_t(qi) * a.q_row + head * a.q_head, d, score, lo, hi,
      [&](int j) { return k_base + slot(j, a.k_batch, a.k_row); },
      [&](int j) { return v_base + slot(j, a.v_batch, a.v_row); }, lane);
#pragma unroll
  for (int u = 0; u < kPer; ++u)
    if (lane + 32 * u < d) out[lane + 32 * u] = from_float<T>(o[u]);
  if (lane == 0) a.lse[(int64_t(b) * a.heads_q + head) * a.seqlen_q + qi] = lse;
  __syncwarp();
}

}  // namespace nonfinite
}  // namespace flashattn
