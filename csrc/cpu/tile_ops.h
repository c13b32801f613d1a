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
// Score tiles are key-major in both passes (row = key, column = query), so
// that every per-query statistic (running max, running sum, lse, dsum) is a
// vector along the rows and all the arithmetic is vertical: no horizontal
// reduction inside a row, which costs more than the row itself on short rows.
//
// Instantiated (tile_ops.cpp) for (scalar_t, acc_t) in
//   (float, float), (c10::BFloat16, float), (c10::Half, float), (double, double).
#pragma once

#include <cstdint>
#include <type_traits>

#include "../flash_params.h"

namespace flashattn {
namespace cpu {

// dst[r][c] = src[r][c]                                  dst: rows x cols
template <typename scalar_t, typename acc_t>
void load_tile(const scalar_t* src, int64_t src_ld, int rows, int cols, acc_t* dst, int64_t dst_ld);

// dst[c][r] = scale * src[r][c]                          dst: cols x rows
template <typename scalar_t, typename acc_t>
void load_tile_transposed(const scalar_t* src, int64_t src_ld, int rows, int cols, acc_t scale, acc_t* dst,
                          int64_t dst_ld);

// dst[c][r] = scale * dst[c][r] + src[r][c]              src: rows x cols, dst: cols x rows
// (an attn_mask's block, rows = queries, added to a key-major score tile)
template <typename scalar_t, typename acc_t>
void add_tile_transposed(const scalar_t* src, int64_t src_ld, int rows, int cols, acc_t scale, acc_t* dst,
                         int64_t dst_ld);

// dst[r][c] = scale * src[r][c]                          src, dst: rows x cols
template <typename acc_t, typename scalar_t>
void store_tile(const acc_t* src, int64_t src_ld, int rows, int cols, acc_t scale, scalar_t* dst, int64_t dst_ld);

// dst[r][c] = scale * row_scale[r] * src[c][r]           src: cols x rows, dst: rows x cols
// (row_scale may be nullptr: all ones)
template <typename acc_t, typename scalar_t>
void store_tile_transposed(const acc_t* src, int64_t src_ld, int rows, int cols, acc_t scale, const acc_t* row_scale,
                           scalar_t* dst, int64_t dst_ld);

// out[r] = sum_c a[r][c] * b[r][c], in acc_t            a, b: rows x cols
template <typename scalar_t, typename acc_t>
void row_dot(const scalar_t* a, int64_t a_ld, const scalar_t* b, int64_t b_ld, int rows, int cols, acc_t* out);

// One step of the forward's online softmax: a key tile meets a query block.
//   s_t       keys x queries, in: scores, scaled by `scale` here (1: already
//             scaled); out: P^T = exp(scale * s - m_new), 0 where masked
//   query_lo, query_hi  per key, the queries [lo, hi) that see it, in block
//             coordinates; nullptr when every query sees every key
//   row_max   per query, running max m of the scores (-inf before any key)
//   row_sum   per query, running sum l of exp(s - m)
//   o_t       head_dim x queries, unnormalized O^T, rescaled by exp(m_old - m_new)
//   work      3 * queries elements of scratch
// A query that has seen no key yet keeps m = -inf, l = 0, O = 0 and gets a
// zero column of P: the exponent shift of such a column is 0, never -inf, so
// no exp(-inf - (-inf)) = NaN can arise.
template <typename acc_t>
void online_softmax_step(acc_t* s_t, int64_t ld, int keys, int queries, const int* query_lo, const int* query_hi,
                         acc_t* row_max, acc_t* row_sum, acc_t* o_t, int64_t o_ld, int head_dim, acc_t* work,
                         acc_t scale);

// online_softmax_step on a span of `keys` unmasked keys (an even count), as
// one fused step (softmax_span.cpp: AVX-512 with AVX512-BF16, queries a
// multiple of 16; float32 also on AVX2 with FMA, queries a multiple of 8);
// false, having done nothing, where it has none: the caller runs
// online_softmax_step (and pack_pairs). The same statistics and
// probabilities within float32 rounding: the float32 version's exp is
// exp_approx's steps, the bfloat16 version's a degree-5 polynomial, far
// below the rounding to bfloat16 that follows; the sums are theirs, the FMA
// contractions may differ.
//   online_softmax_span           P^T back into s_t
//   online_softmax_span_to_pairs  P^T rounded to lowp_t into `pairs`, the
//                                 keys x queries pairs operand (pack_pairs's
//                                 layout); s_t is left as it was
bool online_softmax_span(float* s_t, int64_t ld, int keys, int queries, float* row_max, float* row_sum, float* o_t,
                         int64_t o_ld, int head_dim, float scale);
// The fused step's instruction set on this CPU (kNone: the generic steps
// only; also while the test knob no_fused_softmax is set).
enum class FusedSoftmax { kNone, kAvx2, kAvx512Bf16 };
FusedSoftmax fused_softmax_step();
template <typename lowp_t>
bool online_softmax_span_to_pairs(const float* s_t, int64_t ld, int keys, int queries, float* row_max, float* row_sum,
                                  float* o_t, int64_t o_ld, int head_dim, float scale, lowp_t* pairs);

// flash-attn's score mods on a key-major score tile (s_t: keys x queries, ld):
//   softcap_tile  s = softcap * tanh(scale * s / softcap), and where dtanh is
//                 not null dtanh = 1 - tanh^2 (ld like s_t: the backward's
//                 factor of dS); float32's tanh is tanh_approx's (~2 ulp);
//   alibi_tile    s[r][c] = scale * s[r][c] - slope * |dist0 - r + c|
//                 (dist0: the signed distance of element (0, 0)).
template <typename acc_t>
void softcap_tile(acc_t* s_t, int64_t ld, int keys, int queries, acc_t scale, acc_t softcap, acc_t* dtanh);
template <typename acc_t>
void alibi_tile(acc_t* s_t, int64_t ld, int keys, int queries, acc_t scale, acc_t slope, int64_t dist0);

// The backward's element-wise step, key-major:
//   s_t    keys x queries, in: raw products k.q; out: P^T = exp(scale * s - lse[i])
//   dp_t   keys x queries, in: dP^T = v.do;      out: dS^T = P^T * (dP^T - dsum[i])
//   neg_lse  per query, -lse; -inf for a row that saw no key, so that its P is 0
//   dsum     per query, rowsum(dO * O)
//   query_lo, query_hi  as above
// Masked entries get P = dS = 0.
template <typename acc_t>
void probs_and_dscores_t(acc_t* s_t, acc_t* dp_t, int64_t ld, int keys, int queries, acc_t scale, const acc_t* neg_lse,
                         const acc_t* dsum, const int* query_lo, const int* query_hi);

// The forward for a handful of query rows against one key tile, row-major,
// with dot products and axpys on the k and v rows read in place: for
// decode-shaped problems, where a query block is too short for GEMMs (padded
// to vector width) and for transposing a value tile per block to pay off.
//   q         rows x head_dim (ld head_dim), scaled queries
//   k, v      cols rows of the input with strides k_ld, v_ld, or, where
//             k_rows / v_rows are given, one pointer a row there (the rows of
//             a paged cache's pages); the arithmetic is the same either way
//   key_lo, key_hi  per query, the visible keys [lo, hi) in tile coordinates;
//             nullptr when every query sees every key
//   row_max, row_sum, o  the online-softmax state (m, l, unnormalized O,
//             rows x head_dim, ld head_dim), updated as online_softmax_step does
//   scores    rows x cols scratch; kv_row kFewKvRows x head_dim scratch
//   mods      the score mods (nullptr: none), applied to the scaled scores
//             as TileScoreMod::apply does on the tiled path's
constexpr int kFewKvRows = 4;  // value rows attend_few_queries adds in one pass over O
// The score mods of one attend_few_queries call, per row r (its query and
// head): softcap (0: none), then ALiBi's -slope[r] * |dist0[r] - j| (slope
// nullptr: none; dist0[r] the row's query + diag - k0, the distance at the
// block's key 0), or torch SDPA's attn_mask: bias_rows[r] its row at the
// block's key 0, bias_col_stride elements between keys (bias_rows nullptr:
// none).
template <typename acc_t>
struct FewQueriesMods {
  acc_t softcap = 0;
  const acc_t* slope = nullptr;
  const int64_t* dist0 = nullptr;
  const void* const* bias_rows = nullptr;
  BiasKind bias_kind = BiasKind::kNone;
  int64_t bias_col_stride = 1;
};
template <typename scalar_t, typename acc_t>
void attend_few_queries(const acc_t* q, int rows, int head_dim, const scalar_t* k, int64_t k_ld, const scalar_t* v,
                        int64_t v_ld, const scalar_t* const* k_rows, const scalar_t* const* v_rows, int cols,
                        const int* key_lo, const int* key_hi, acc_t* row_max, acc_t* row_sum, acc_t* o, acc_t* scores,
                        acc_t* kv_row, const FewQueriesMods<acc_t>* mods);

// Operands of the low-precision products in tile_gemm.h's pairs panels
// (lowp_t: c10::BFloat16 or c10::Half). The B side of a k x n product (k
// even, n a multiple of lowp_panel_width(n) > 0), dst k * n elements:
//   pack_pairs             from src[p][j] (k x n, row-major; float rounded
//                          to lowp_t, lowp_t copied)
//   pack_pairs_transposed  from src[j][p] (n x k, row-major)
// The A side, row-major: transpose_lowp, dst[c][r] = src[r][c] (dst: cols x
// rows); store_tile rounds a float tile.
template <typename lowp_t, typename src_t>
void pack_pairs(const src_t* src, int64_t src_ld, int k, int n, lowp_t* dst);

template <typename lowp_t>
void pack_pairs_transposed(const lowp_t* src, int64_t src_ld, int k, int n, lowp_t* dst);

template <typename lowp_t>
void transpose_lowp(const lowp_t* src, int64_t src_ld, int rows, int cols, lowp_t* dst, int64_t dst_ld);

// Rows `rows` of a k x n pairs operand b (the B side above) set to 0.
template <typename lowp_t>
void zero_pairs_rows(lowp_t* b, int k, int n, const int* rows, int num_rows);

// t[r][c] = 0 for the columns c of `columns`, every row r < rows.
template <typename lowp_t>
void zero_columns(lowp_t* t, int64_t ld, int rows, const int* columns, int num_columns);

// Non-finite inputs on masked blocks. A masked entry has P = dS = 0 exactly,
// but a GEMM still multiplies it with the operand row of the key (or query)
// the entry hides, and 0 * NaN = NaN (0 * inf too): a NaN or infinity in a v
// row would reach query rows that cannot see that key, and which rows depended
// on how keys fall into tiles. The kernels keep the rule "an output (or
// gradient) row depends only on the keys (queries) it can see": on masked
// blocks only (the tiles the mask cuts through), the operand rows holding a
// non-finite value leave the GEMM and are added exactly over the visible
// entries. Finding none costs one pass over the operand tile.

// Columns of the rows x cols tile t holding a NaN or an infinity: zeroed in t,
// their indices written to `index`; returns their count. work: cols elements.
template <typename acc_t>
int take_nonfinite_columns(acc_t* t, int64_t ld, int rows, int cols, acc_t* work, int* index);

// Rows of the rows x cols input tile t holding a NaN or an infinity: their
// indices written to `index`; returns their count.
template <typename scalar_t, typename acc_t>
int nonfinite_rows(const scalar_t* t, int64_t ld, int rows, int cols, int* index);

// Whether an input's row stride may be the leading dimension of a GEMM
// operand in place. The JIT-compiled GEMM (tile_gemm.h) keeps one compiled
// kernel per leading dimension in a per-thread cache that is never emptied, so
// a program whose strides change from call to call (views into buffers of
// growing size) would grow it without bound: the first few distinct strides of
// the process are admitted, any other is copied into a scratch tile (same
// GEMM, same results, one copy of the tile more).
bool ld_admitted_in_place(int64_t ld);

// A tile of a strided input as a GEMM operand in acc_t: the input itself when
// it already is one (same type, rows at least `cols` apart, as the GEMM
// needs, and a stride admitted above), else a converted copy written to `buffer`.
template <typename acc_t>
struct Operand {
  const acc_t* ptr;
  int64_t ld;
};

template <typename scalar_t, typename acc_t>
inline Operand<acc_t> as_operand(const scalar_t* src, int64_t src_ld, int rows, int cols, acc_t* buffer,
                                 int64_t buffer_ld) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    if (src_ld >= cols && (src_ld == buffer_ld || ld_admitted_in_place(src_ld))) return {src, src_ld};
  }
  load_tile(src, src_ld, rows, cols, buffer, buffer_ld);
  return {buffer, buffer_ld};
}

}  // namespace cpu
}  // namespace flashattn
