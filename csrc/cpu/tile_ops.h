// Element-wise operations on the tiles of the CPU kernels: loads and stores
// that convert between the input dtype and the accumulation type (float, or
// double for double inputs) and optionally transpose, the online-softmax step
// of the forward and the probability / score-gradient step of the backward.
//
// A tile is a row-major block of `rows` x `cols` elements with a leading
// dimension `ld` (row stride, in elements) and a unit column stride. Tiles in
// the accumulation type live in per-thread scratch buffers; tiles in the
// input dtype are views of q, k, v, o, dout, dq, dk, dv.
//
// Instantiated (tile_ops.cpp) for (scalar_t, acc_t) in
//   (float, float), (c10::BFloat16, float), (c10::Half, float), (double, double).
#pragma once

#include <cstdint>
#include <type_traits>

namespace flashattn {
namespace cpu {

// dst[r][c] = src[r][c]                          dst: rows x cols
template <typename scalar_t, typename acc_t>
void load_tile(const scalar_t* src, int64_t src_ld, int rows, int cols, acc_t* dst, int64_t dst_ld);

// dst[c][r] = src[r][c]                          dst: cols x rows
template <typename scalar_t, typename acc_t>
void load_tile_transposed(const scalar_t* src, int64_t src_ld, int rows, int cols, acc_t* dst, int64_t dst_ld);

// dst[r][c] = scale * src[r][c]                  src, dst: rows x cols
template <typename acc_t, typename scalar_t>
void store_tile(const acc_t* src, int64_t src_ld, int rows, int cols, acc_t scale, scalar_t* dst, int64_t dst_ld);

// dst[r][c] = row_scale[r] * src[r][c]           src, dst: rows x cols
template <typename acc_t, typename scalar_t>
void store_tile_row_scaled(const acc_t* src, int64_t src_ld, int rows, int cols, const acc_t* row_scale,
                           scalar_t* dst, int64_t dst_ld);

// dst[r][c] = scale * src[c][r]                  src: cols x rows, dst: rows x cols
template <typename acc_t, typename scalar_t>
void store_tile_transposed(const acc_t* src, int64_t src_ld, int rows, int cols, acc_t scale, scalar_t* dst,
                           int64_t dst_ld);

// out[r] = sum_c a[r][c] * b[r][c], in acc_t    a, b: rows x cols
template <typename scalar_t, typename acc_t>
void row_dot(const scalar_t* a, int64_t a_ld, const scalar_t* b, int64_t b_ld, int rows, int cols, acc_t* out);

// One step of the online softmax: a block of query rows meets one key tile.
//   scores   rows x cols, in: the raw products q.k; out: P = exp(scale * s - m_new),
//            0 outside each row's visible keys
//   key_lo, key_hi  per row, the visible keys [lo, hi) in tile coordinates;
//            nullptr when the whole tile is visible
//   row_max  rows, running max m of the scaled scores (-inf before any key)
//   row_sum  rows, running sum l of exp(scale * s - m)
//   o_acc    rows x head_dim, unnormalized output, rescaled by exp(m_old - m_new)
// A row that sees no key of this tile, nor of the tiles before, keeps m = -inf,
// l = 0 and gets a zero P row (no exp(-inf - (-inf)) anywhere).
template <typename acc_t>
void online_softmax_step(acc_t* scores, int64_t ld, int rows, int cols, acc_t scale, const int* key_lo,
                         const int* key_hi, acc_t* row_max, acc_t* row_sum, acc_t* o_acc, int64_t o_ld,
                         int head_dim);

// The backward's element-wise step on a key-major block (row j = key, column
// i = query):
//   s_t   keys x queries, in: raw products k.q; out: P^T = exp(scale * s - lse[i])
//   dp_t  keys x queries, in: dP^T = v.do;      out: dS^T = P^T * (dP^T - dsum[i])
//   neg_lse  per query, -lse; -inf for a row that saw no key, so that its P is 0
//   dsum     per query, rowsum(dO * O)
//   query_lo, query_hi  per key, the queries [lo, hi) that see it, in tile
//            coordinates; nullptr when the whole block is visible
// Masked entries get P = dS = 0.
template <typename acc_t>
void probs_and_dscores_t(acc_t* s_t, acc_t* dp_t, int64_t ld, int keys, int queries, acc_t scale,
                         const acc_t* neg_lse, const acc_t* dsum, const int* query_lo, const int* query_hi);

// A tile of a strided input as a GEMM operand in acc_t: the input itself when
// it already is one (same type, rows at least `cols` apart, as the GEMM
// needs), else a converted copy written to `buffer`.
template <typename acc_t>
struct Operand {
  const acc_t* ptr;
  int64_t ld;
};

template <typename scalar_t, typename acc_t>
inline Operand<acc_t> as_operand(const scalar_t* src, int64_t src_ld, int rows, int cols, acc_t* buffer,
                                 int64_t buffer_ld) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    if (src_ld >= cols) return {src, src_ld};
  }
  load_tile(src, src_ld, rows, cols, buffer, buffer_ld);
  return {buffer, buffer_ld};
}

}  // namespace cpu
}  // namespace flashattn
