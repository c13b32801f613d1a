// Backward pass of the CPU kernels: recomputation from lse, no N x N buffer.
//
//   dsum_i = rowsum(dO_i * O_i)                               (pass 0)
//   per (key tile, query tile) block, recomputed from q, k, v and lse:
//     P  = exp(scale S - lse)        dP = dO V^T        dS = P * (dP - dsum)
//     dV += P^T dO     dK += scale dS^T Q     dQ += scale dS K
//
// Parallel scheme. dK/dV of a key tile sum over every query, dQ of a query
// tile over every key; accumulating both in one pass means that two threads
// add into the same rows (atomics or locks, and a result that depends on the
// order threads arrive in). Instead:
//   pass 1, one item per (batch, kv-head, key tile): loops over the q-heads
//           of its GQA group and the query tiles that see the key tile, and
//           owns the dK, dV rows of that tile;
//   pass 2, one item per (batch, q-head, query tile): loops over the key
//           tiles, recomputes P and dS and owns the dQ rows of that tile.
// Every output element is written by exactly one item, with a fixed order of
// summation, so the gradients are race-free and bitwise deterministic whatever
// the thread count or schedule. The price is recomputing S, dP and P in pass 2:
// 7 tile GEMMs per block instead of 5, no atomics, no locks.
//
// Both passes lay the block out key-major (row = key, column = query): S^T =
// K Q^T and dP^T = V dO^T, so that P^T and dS^T come out in the layout the
// GEMMs dV += P^T dO, dK += dS^T Q and dQ^T += K^T dS^T take without a
// transposition of a block-sized tile (the only GEMM form is A . B, see
// tile_gemm.h). What gets transposed while loading are d-wide tiles of
// q, dO (pass 1, per block) and k (pass 2, per block).
//
// bfloat16 / float16 where the products run on brgemm (tile_gemm.h: the
// matrix units): the full 64 x 64 blocks run all seven products on the 16-bit
// inputs with float32 accumulation, k and v in place as A operands, q and dO
// packed into pairs panels, P^T and dS^T rounded to the input dtype for the
// products that take them (FlashAttention's rounding); ragged blocks take the
// float32 path on the same accumulators.
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "attn_mask.h"
#include "cpu_knobs.h"
#include "dropout.h"
#include "flash_cpu.h"
#include "scalar_dispatch.h"
#include "score_mod.h"
#include "tile_gemm.h"
#include "tile_ops.h"
#include "work_queue.h"

namespace flashattn {
namespace cpu {
namespace {

// Block sizes (keys x queries). Timed like the forward's, key x query blocks
// of 64..128 were within a few % of each other (32 was ~8% slower); 64 x 64
// gives the most items to spread over threads in both passes.
constexpr int kBlockK = 64;
constexpr int kBlockQ = 64;

// Full blocks go to the JIT-compiled GEMM, ragged ones do not (tile_gemm.h).
bool is_full_tile(int rows, int cols) { return rows == kBlockQ && cols == kBlockK; }

// Row statistics of the forward that the backward needs, per (batch, q-head,
// query): neg_lse = -lse (-inf for rows without keys, so that their P is 0)
// and dsum = rowsum(dO * O). Contiguous, in the layout of lse: (batch,
// heads_q, seqlen_q), or (heads_q, total_q) in a varlen batch.
template <typename acc_t>
struct RowStats {
  const acc_t* neg_lse;
  const acc_t* dsum;
};

// lowp: also the 16-bit tiles of the low-precision products (tile_gemm.h).
template <typename scalar_t, typename acc_t>
struct BwdScratch {
  BwdScratch(int d, bool lowp_)
      : lowp(lowp_),
        q_t(d * kBlockQ),
        do_t(d * kBlockQ),
        q(kBlockQ * d),
        dout(kBlockQ * d),
        k(kBlockK * d),
        k_t(d * kBlockK),
        v(kBlockK * d),
        s_t(kBlockK * kBlockQ),
        dp_t(kBlockK * kBlockQ),
        dtanh_t(kBlockK * kBlockQ),
        dk_acc(kBlockK * d),
        dv_acc(kBlockK * d),
        dq_t_acc(d * kBlockQ),
        probe(kBlockK),
        keep(kBlockK * kBlockQ),
        query_lo(kBlockK),
        query_hi(kBlockK),
        bad(std::max(kBlockK, kBlockQ)),
        bad2(kBlockQ),
        q_t_pairs(lowp_ ? d * kBlockQ : 0),
        do_t_pairs(lowp_ ? d * kBlockQ : 0),
        q_pairs(lowp_ ? kBlockQ * d : 0),
        do_pairs(lowp_ ? kBlockQ * d : 0),
        p_lowp(lowp_ ? kBlockK * kBlockQ : 0),
        ds_lowp(lowp_ ? kBlockK * kBlockQ : 0),
        ds_pairs(lowp_ ? kBlockK * kBlockQ : 0),
        k_lowp(lowp_ ? kBlockK * d : 0),
        v_lowp(lowp_ ? kBlockK * d : 0),
        k_t_lowp(lowp_ ? d * kBlockK : 0),
        k_t_masked(d * kBlockK),
        k_t_lowp_masked(lowp_ ? d * kBlockK : 0) {}

  const bool lowp;

  ScratchArray<acc_t> q_t;       // d x kBlockQ        query tile, transposed
  ScratchArray<acc_t> do_t;      // d x kBlockQ        output-gradient tile, transposed
  ScratchArray<acc_t> q;         // kBlockQ x d        query tile, when q cannot be used in place
  ScratchArray<acc_t> dout;      // kBlockQ x d        dO tile, when dout cannot be used in place
  ScratchArray<acc_t> k;         // kBlockK x d        key tile, when k cannot be used in place
  ScratchArray<acc_t> k_t;       // d x kBlockK        key tile, transposed
  ScratchArray<acc_t> v;         // kBlockK x d        value tile, when v cannot be used in place
  ScratchArray<acc_t> s_t;       // kBlockK x kBlockQ  S^T, then P^T
  ScratchArray<acc_t> dp_t;      // kBlockK x kBlockQ  dP^T, then dS^T
  ScratchArray<acc_t> dtanh_t;   // kBlockK x kBlockQ  softcap: 1 - tanh^2 of the block's scores
  ScratchArray<acc_t> dk_acc;    // kBlockK x d        pass 1
  ScratchArray<acc_t> dv_acc;    // kBlockK x d        pass 1
  ScratchArray<acc_t> dq_t_acc;  // d x kBlockQ        pass 2
  ScratchArray<acc_t> probe;     // kBlockK            non-finite search
  ScratchArray<uint8_t> keep;    // kBlockK x kBlockQ  dropout's keep mask of the block
  ScratchArray<int> query_lo;    // kBlockK            visible queries of each key, in tile coordinates
  ScratchArray<int> query_hi;    // kBlockK
  ScratchArray<int> bad;         // rows / keys of an operand tile that are not finite (masked blocks)
  ScratchArray<int> bad2;
  // Low-precision products (full blocks):
  ScratchArray<scalar_t> q_t_pairs;   // d x kBlockQ        Q^T in pairs panels (S^T = K Q^T)
  ScratchArray<scalar_t> do_t_pairs;  // d x kBlockQ        dO^T in pairs panels (dP^T = V dO^T)
  ScratchArray<scalar_t> q_pairs;     // kBlockQ x d        Q in pairs panels (dK += dS^T Q)
  ScratchArray<scalar_t> do_pairs;    // kBlockQ x d        dO in pairs panels (dV += P^T dO)
  ScratchArray<scalar_t> p_lowp;      // kBlockK x kBlockQ  P^T rounded
  ScratchArray<scalar_t> ds_lowp;     // kBlockK x kBlockQ  dS^T rounded
  ScratchArray<scalar_t> ds_pairs;    // kBlockK x kBlockQ  dS^T rounded, in pairs panels (dQ^T += K^T dS^T)
  ScratchArray<scalar_t> k_lowp;      // kBlockK x d        key tile, when k cannot be a GEMM operand in place
  ScratchArray<scalar_t> v_lowp;      // kBlockK x d        value tile, likewise
  ScratchArray<scalar_t> k_t_lowp;    // d x kBlockK        key tile, transposed
  // One pass (dq below): K^T of a masked block, whose non-finite columns the
  // non-finite rule zeroes (k_t / k_t_lowp then hold the key tile's K^T for
  // all its unmasked blocks).
  ScratchArray<acc_t> k_t_masked;          // d x kBlockK
  ScratchArray<scalar_t> k_t_lowp_masked;  // d x kBlockK
  ScratchArray<acc_t> dq_acc;              // one pass: DqTiles' memory
  int64_t dq_acc_size = 0;
};

// One pass: the dQ^T accumulators of a (sequence, kv head)'s query heads,
// d x kBlockQ per (head of the group, query tile), laid out like pass 2's.
template <typename acc_t>
struct DqTiles {
  acc_t* data;
  int64_t q_tiles;
  int d;
  acc_t* tile(int head_in_group, int64_t q_tile) const {
    return data + (head_in_group * q_tiles + q_tile) * d * kBlockQ;
  }
};

template <typename scalar_t>
constexpr bool kIsLowp = std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>;

// A rows x d tile of a 16-bit input as the A operand of a low-precision
// product: in place when its stride may be (tile_ops.h), else copied.
template <typename scalar_t>
std::pair<const scalar_t*, int64_t> lowp_operand(const scalar_t* src, int64_t ld, int rows, int d, scalar_t* buffer) {
  if (ld >= d && ld_admitted_in_place(ld)) return {src, ld};
  for (int r = 0; r < rows; ++r) std::copy(src + r * ld, src + r * ld + d, buffer + r * d);
  return {buffer, d};
}

// Whether the float32 products read q, dO, k and v tiles from contiguous
// copies, on this machine. Measured (b4 h16 n1024 d128 float32, forward +
// backward, rows h * d = 2048 floats apart in place, the same bits either
// way; benchmarks/cpu_perf_log.md): on a 2-core AVX2 EPYC the copies took
// 0.85-0.87 of the in-place time (the q and dO tiles, B operands of
// dV += P^T dO and dK += dS^T Q, most of it; d64 rows 512 floats apart
// 0.98-0.99), on an AVX-512 Xeon 1.01-1.03 at 1, 4 and 16 threads. So in
// place where the CPU has AVX-512, copies elsewhere.
bool copies_tiles_here() {
#if defined(__x86_64__) || defined(_M_X64)
  static const bool copies = !__builtin_cpu_supports("avx512f");
#else
  static const bool copies = true;
#endif
  return copies;
}

bool copies_tiles() {
  const int knob = test_knob_value(TestKnob::kBwdTilesInPlace);
  return knob == 0 ? copies_tiles_here() : knob == 2;
}

// The rows x d tile of q, dO, k or v at src as a float32 GEMM operand: a
// contiguous copy where copies_tiles() and the rows are not contiguous already
// (ld != d), else in place where as_operand admits the stride.
template <typename scalar_t, typename acc_t>
Operand<acc_t> bwd_tile_operand(const scalar_t* src, int64_t ld, int rows, int d, acc_t* buffer) {
  if (ld != d && copies_tiles()) {
    load_tile(src, ld, rows, d, buffer, int64_t(d));
    return {buffer, int64_t(d)};
  }
  return as_operand(src, ld, rows, d, buffer, int64_t(d));
}

// Masked blocks and non-finite operands (tile_ops.h): rows of an input tile
// that hold a NaN or an infinity leave the GEMM (zeroed in a copy) and their
// products are added over the visible entries only.

// The rows x d tile at src as a GEMM operand with the rows `bad` zeroed (a
// converted copy in buffer).
template <typename scalar_t, typename acc_t>
Operand<acc_t> operand_without_rows(const scalar_t* src, int64_t src_ld, int rows, int d, const int* bad, int num_bad,
                                    acc_t* buffer) {
  load_tile(src, src_ld, rows, d, buffer, d);
  for (int n = 0; n < num_bad; ++n) std::fill(buffer + bad[n] * d, buffer + (bad[n] + 1) * d, acc_t(0));
  return {buffer, d};
}

// acc[j][:] += w_t[j][i] * x[i][:] for the query rows i in `bad` and the keys j
// that see them (acc: cols x d, ld d; w_t: cols x rows, ld kBlockQ).
template <typename scalar_t, typename acc_t>
void add_query_rows_over_visible_keys(const int* bad, int num_bad, const scalar_t* x, int64_t x_ld, int d,
                                      const acc_t* w_t, int cols, const int* query_lo, const int* query_hi,
                                      acc_t* acc) {
  for (int n = 0; n < num_bad; ++n) {
    const int i = bad[n];
    for (int j = 0; j < cols; ++j) {
      if (i < query_lo[j] || i >= query_hi[j]) continue;
      const acc_t w = w_t[j * kBlockQ + i];
      for (int c = 0; c < d; ++c) acc[j * d + c] += w * static_cast<acc_t>(x[i * x_ld + c]);
    }
  }
}

// Pointers of one (sequence, head) slice of every tensor.
template <typename scalar_t, typename acc_t>
struct HeadView {
  const scalar_t* q;
  const scalar_t* dout;
  const scalar_t* k;
  const scalar_t* v;
  RowStats<acc_t> stats;
  TileScoreMod<acc_t> mod;  // softcap / ALiBi of (b, h)
  uint64_t dropout_plane;   // the (b, h) plane of the dropout's counters (philox.h)
};

template <typename scalar_t, typename acc_t>
HeadView<scalar_t, acc_t> head_view(const AttnBwdParams& p, const SeqInfo& seq, const RowStats<acc_t>& stats, int b,
                                    int h) {
  const int64_t h_kv = h / p.heads_ratio();
  const int64_t row0 = seq.rowvec_offset(p, b, h);
  return {
      static_cast<const scalar_t*>(p.q_ptr) + seq.q_offset(p.q_batch_stride, p.q_row_stride, b) + h * p.q_head_stride,
      static_cast<const scalar_t*>(p.do_ptr) + seq.q_offset(p.do_batch_stride, p.do_row_stride, b) +
          h * p.do_head_stride,
      static_cast<const scalar_t*>(p.k_ptr) + seq.k_offset(p.k_batch_stride, p.k_row_stride, b) +
          h_kv * p.k_head_stride,
      static_cast<const scalar_t*>(p.v_ptr) + seq.k_offset(p.v_batch_stride, p.v_row_stride, b) +
          h_kv * p.v_head_stride,
      {stats.neg_lse + row0, stats.dsum + row0},
      TileScoreMod<acc_t>(p.score_mod, b, h, seq.seqlen_q, seq.seqlen_k),
      dropout_plane(p.dropout.offset, b, p.heads_q, h)};
}

// The part both passes share: for keys [k0, k0 + cols) and queries
// [q0, q0 + rows) of one head, with the key tile as operands k_op, v_op
// (cols x d) and the query tile transposed in scratch.q_t, scratch.do_t
// (d x rows), leaves P^T in scratch.s_t and dS^T in scratch.dp_t (cols x rows).
// Returns whether the block is masked (then scratch.query_lo / query_hi hold
// the visible queries of each key).
template <typename scalar_t, typename acc_t>
bool probs_and_dscores_block(const AttnBwdParams& p, const AttnMask& mask, const HeadView<scalar_t, acc_t>& head,
                             int64_t k0, int cols, int64_t q0, int rows, BwdScratch<scalar_t, acc_t>& scratch);

template <typename scalar_t, typename acc_t>
bool recompute_block(const AttnBwdParams& p, const AttnMask& mask, const HeadView<scalar_t, acc_t>& head, int64_t k0,
                     int cols, int64_t q0, int rows, Operand<acc_t> k_op, Operand<acc_t> v_op,
                     BwdScratch<scalar_t, acc_t>& scratch) {
  const int d = p.head_dim;
  const bool full_tile = is_full_tile(rows, cols);
  acc_t* s_t = scratch.s_t.get();
  acc_t* dp_t = scratch.dp_t.get();
  gemm_nn(cols, rows, d, k_op.ptr, k_op.ld, scratch.q_t.get(), kBlockQ, s_t, kBlockQ, false, full_tile);  // S^T = K Q^T
  gemm_nn(cols, rows, d, v_op.ptr, v_op.ld, scratch.do_t.get(), kBlockQ, dp_t, kBlockQ, false, full_tile);  // dP^T
  return probs_and_dscores_block(p, mask, head, k0, cols, q0, rows, scratch);
}

// recompute_block on the low-precision products (a full block): k, v as A
// operands (cols x d), Q^T and dO^T in scratch.q_t_pairs / do_t_pairs.
template <typename scalar_t, typename acc_t>
bool recompute_block_lowp(const AttnBwdParams& p, const AttnMask& mask, const HeadView<scalar_t, acc_t>& head,
                          int64_t k0, int cols, int64_t q0, int rows, std::pair<const scalar_t*, int64_t> k_a,
                          std::pair<const scalar_t*, int64_t> v_a, BwdScratch<scalar_t, acc_t>& scratch) {
  if constexpr (kIsLowp<scalar_t>) {
    const int d = p.head_dim;
    gemm_nn_lowp(cols, rows, d, k_a.first, k_a.second, scratch.q_t_pairs.get(), scratch.s_t.get(), kBlockQ, false);
    gemm_nn_lowp(cols, rows, d, v_a.first, v_a.second, scratch.do_t_pairs.get(), scratch.dp_t.get(), kBlockQ, false);
  }
  return probs_and_dscores_block(p, mask, head, k0, cols, q0, rows, scratch);
}

// S^T, dP^T (in scratch.s_t, dp_t) -> P^T, dS^T.
template <typename scalar_t, typename acc_t>
bool probs_and_dscores_block(const AttnBwdParams& p, const AttnMask& mask, const HeadView<scalar_t, acc_t>& head,
                             int64_t k0, int cols, int64_t q0, int rows, BwdScratch<scalar_t, acc_t>& scratch) {
  acc_t* s_t = scratch.s_t.get();
  acc_t* dp_t = scratch.dp_t.get();
  const bool masked = mask.block_query_ranges(q0, rows, k0, cols, scratch.query_lo.get(), scratch.query_hi.get());
  const int* query_lo = masked ? scratch.query_lo.get() : nullptr;
  const int* query_hi = masked ? scratch.query_hi.get() : nullptr;
  acc_t scale = static_cast<acc_t>(p.softmax_scale);
  // softcap / ALiBi: P recomputed from the modified scores as the forward
  // formed them; dS then goes through tanh (ALiBi's bias has derivative 1).
  const bool has_mod = head.mod.any();
  acc_t* dtanh = has_mod && head.mod.softcap > 0 ? scratch.dtanh_t.get() : nullptr;
  if (has_mod) head.mod.apply(s_t, kBlockQ, cols, rows, scale, k0, q0, dtanh), scale = acc_t(1);
  // Dropout, Z = keep / (1 - p) (the forward's mask, regenerated): the output
  // is (P o Z) V, so the gradient reaching P is Z o dP with dP = dO V^T, and
  // dS = P o (Z o dP - D), where D = rowsum(P o Z o dP) = rowsum(dO o O) is
  // the dsum the kernels already have; dV = (P o Z)^T dO.
  const bool dropout = p.dropout.enabled();
  const acc_t kept_scale = static_cast<acc_t>(p.dropout.scale);
  if (dropout) {
    dropout_keep_tile(p.dropout, head.dropout_plane, k0, cols, q0, rows, scratch.keep.get(), kBlockQ);
    apply_keep_tile(scratch.keep.get(), kBlockQ, cols, rows, kept_scale, dp_t, kBlockQ);
  }
  probs_and_dscores_t(s_t, dp_t, kBlockQ, cols, rows, scale, head.stats.neg_lse + q0, head.stats.dsum + q0, query_lo,
                      query_hi);
  if (dropout) apply_keep_tile(scratch.keep.get(), kBlockQ, cols, rows, kept_scale, s_t, kBlockQ);
  if (dtanh) {
    for (int r = 0; r < cols; ++r)
      for (int c = 0; c < rows; ++c) dp_t[r * kBlockQ + c] *= dtanh[r * kBlockQ + c];
  }
  return masked;
}

// Loads the transposed query and output-gradient tiles (d x rows) a block needs.
template <typename scalar_t, typename acc_t>
void load_query_tile_transposed(const AttnBwdParams& p, const HeadView<scalar_t, acc_t>& head, int64_t q0, int rows,
                                BwdScratch<scalar_t, acc_t>& scratch) {
  load_tile_transposed(head.q + q0 * p.q_row_stride, p.q_row_stride, rows, p.head_dim, acc_t(1), scratch.q_t.get(),
                       kBlockQ);
  load_tile_transposed(head.dout + q0 * p.do_row_stride, p.do_row_stride, rows, p.head_dim, acc_t(1),
                       scratch.do_t.get(), kBlockQ);
}

// The same for the low-precision products: Q^T and dO^T in pairs panels.
template <typename scalar_t, typename acc_t>
void pack_query_tile_pairs(const AttnBwdParams& p, const HeadView<scalar_t, acc_t>& head, int64_t q0,
                           BwdScratch<scalar_t, acc_t>& scratch) {
  if constexpr (kIsLowp<scalar_t>) {
    pack_pairs_transposed(head.q + q0 * p.q_row_stride, p.q_row_stride, p.head_dim, kBlockQ, scratch.q_t_pairs.get());
    pack_pairs_transposed(head.dout + q0 * p.do_row_stride, p.do_row_stride, p.head_dim, kBlockQ,
                          scratch.do_t_pairs.get());
  }
}

// dV += P^T dO and dK += dS^T Q of a full block on the low-precision
// products (P^T and dS^T rounded to the input dtype, as FlashAttention does);
// the query rows `bad_do` of dO and `bad_q` of Q leave the products (tile_ops.h).
template <typename scalar_t, typename acc_t>
void dkdv_block_lowp(const AttnBwdParams& p, const scalar_t* dout_tile, const scalar_t* q_tile, const int* bad_do,
                     int num_bad_do, const int* bad_q, int num_bad_q, BwdScratch<scalar_t, acc_t>& scratch) {
  if constexpr (kIsLowp<scalar_t>) {
    const int d = p.head_dim;
    store_tile(scratch.s_t.get(), kBlockQ, kBlockK, kBlockQ, acc_t(1), scratch.p_lowp.get(), kBlockQ);
    store_tile(scratch.dp_t.get(), kBlockQ, kBlockK, kBlockQ, acc_t(1), scratch.ds_lowp.get(), kBlockQ);
    pack_pairs(dout_tile, p.do_row_stride, kBlockQ, d, scratch.do_pairs.get());
    pack_pairs(q_tile, p.q_row_stride, kBlockQ, d, scratch.q_pairs.get());
    zero_pairs_rows(scratch.do_pairs.get(), kBlockQ, d, bad_do, num_bad_do);
    zero_pairs_rows(scratch.q_pairs.get(), kBlockQ, d, bad_q, num_bad_q);
    gemm_nn_lowp(kBlockK, d, kBlockQ, scratch.p_lowp.get(), kBlockQ, scratch.do_pairs.get(), scratch.dv_acc.get(), d,
                 true);
    gemm_nn_lowp(kBlockK, d, kBlockQ, scratch.ds_lowp.get(), kBlockQ, scratch.q_pairs.get(), scratch.dk_acc.get(), d,
                 true);
  }
}

// dQ^T += K^T dS^T for the keys `bad` of a masked block (their k rows are not
// finite and left the product), over the queries that see each.
template <typename scalar_t, typename acc_t>
void add_keys_to_dq(const AttnBwdParams& p, const HeadView<scalar_t, acc_t>& head, int64_t k0, int rows, const int* bad,
                    int num_bad, const BwdScratch<scalar_t, acc_t>& scratch, acc_t* dq_t_acc) {
  for (int n = 0; n < num_bad; ++n) {
    const int j = bad[n];
    const int lo = std::min(scratch.query_lo.get()[j], rows), hi = std::max(scratch.query_hi.get()[j], lo);
    const scalar_t* k_row = head.k + (k0 + j) * p.k_row_stride;
    const acc_t* ds_t = scratch.dp_t.get() + j * kBlockQ;
    for (int c = 0; c < p.head_dim; ++c) {
      const acc_t kc = static_cast<acc_t>(k_row[c]);
      for (int i = lo; i < hi; ++i) dq_t_acc[c * kBlockQ + i] += kc * ds_t[i];
    }
  }
}

// Pass 1: dK, dV of one key tile of one (sequence, kv-head); the caller
// skips tiles past the sequence's end.
//
// With dq (the one-pass backward, bwd_kv_head below) it also adds each
// block's dQ^T += K^T dS^T to dq's tile, exactly as pass 2 computes it (the
// same products of the same operands, key tiles in ascending order): the
// results are bitwise the same either way.
template <typename scalar_t, typename acc_t>
void dkdv_key_tile(const AttnBwdParams& p, const SeqInfo& seq, const AttnMask& mask, const RowStats<acc_t>& stats,
                   int b, int h_kv, int64_t k_tile, BwdScratch<scalar_t, acc_t>& scratch,
                   const DqTiles<acc_t>* dq = nullptr) {
  const int d = p.head_dim;
  const int64_t k0 = k_tile * kBlockK;
  const int cols = static_cast<int>(std::min<int64_t>(kBlockK, seq.seqlen_k - k0));
  acc_t* dk_acc = scratch.dk_acc.get();
  acc_t* dv_acc = scratch.dv_acc.get();
  std::fill(dk_acc, dk_acc + cols * d, acc_t(0));
  std::fill(dv_acc, dv_acc + cols * d, acc_t(0));

  const int64_t query_begin = mask.tile_query_begin(k0);
  const int64_t query_end = mask.tile_query_end(k0 + cols);
  if (query_begin < query_end) {
    const int ratio = p.heads_ratio();
    // The key tile serves every q-head of the GQA group.
    const HeadView<scalar_t, acc_t> group = head_view<scalar_t, acc_t>(p, seq, stats, b, h_kv * ratio);
    // The float32 path's operands, made on first use (a key tile of the
    // low-precision path may still meet ragged query tiles).
    Operand<acc_t> k_op{nullptr, 0}, v_op{nullptr, 0};
    auto float_operands = [&] {
      if (k_op.ptr) return;
      k_op = bwd_tile_operand(group.k + k0 * p.k_row_stride, p.k_row_stride, cols, d, scratch.k.get());
      v_op = bwd_tile_operand(group.v + k0 * p.v_row_stride, p.v_row_stride, cols, d, scratch.v.get());
    };
    const bool lowp_tile = scratch.lowp && cols == kBlockK;
    std::pair<const scalar_t*, int64_t> k_a{nullptr, 0}, v_a{nullptr, 0};
    if (lowp_tile) {
      k_a = lowp_operand(group.k + k0 * p.k_row_stride, p.k_row_stride, cols, d, scratch.k_lowp.get());
      v_a = lowp_operand(group.v + k0 * p.v_row_stride, p.v_row_stride, cols, d, scratch.v_lowp.get());
    }
    // One pass: K^T of the tile for dQ, made on first use.
    const scalar_t* k_tile = group.k + k0 * p.k_row_stride;
    bool have_k_t = false, have_k_t_lowp = false;
    for (int h = h_kv * ratio; h < (h_kv + 1) * ratio; ++h) {
      const HeadView<scalar_t, acc_t> head = head_view<scalar_t, acc_t>(p, seq, stats, b, h);
      for (int64_t q0 = query_begin / kBlockQ * kBlockQ; q0 < query_end; q0 += kBlockQ) {
        const int rows = static_cast<int>(std::min<int64_t>(kBlockQ, seq.seqlen_q - q0));
        if (head.mod.hides(cols, rows, k0, q0)) continue;  // an attn_mask hides the block outright: dS, P are 0
        head.mod.prefetch(cols, kBlockQ, k0, q0 + kBlockQ, seq.seqlen_q);  // the next query tile's mask rows
        const scalar_t* dout_tile = head.dout + q0 * p.do_row_stride;
        const scalar_t* q_tile = head.q + q0 * p.q_row_stride;
        acc_t* dq_t_acc = dq ? dq->tile(h - h_kv * ratio, q0 / kBlockQ) : nullptr;
        if (lowp_tile && rows == kBlockQ) {
          pack_query_tile_pairs(p, head, q0, scratch);
          const bool masked = recompute_block_lowp(p, mask, head, k0, cols, q0, rows, k_a, v_a, scratch);
          const int bad_do =
              masked ? nonfinite_rows<scalar_t, acc_t>(dout_tile, p.do_row_stride, rows, d, scratch.bad.get()) : 0;
          const int bad_q =
              masked ? nonfinite_rows<scalar_t, acc_t>(q_tile, p.q_row_stride, rows, d, scratch.bad2.get()) : 0;
          dkdv_block_lowp(p, dout_tile, q_tile, scratch.bad.get(), bad_do, scratch.bad2.get(), bad_q, scratch);
          if (bad_do > 0)
            add_query_rows_over_visible_keys(scratch.bad.get(), bad_do, dout_tile, p.do_row_stride, d,
                                             scratch.s_t.get(), cols, scratch.query_lo.get(), scratch.query_hi.get(),
                                             dv_acc);
          if (bad_q > 0)
            add_query_rows_over_visible_keys(scratch.bad2.get(), bad_q, q_tile, p.q_row_stride, d, scratch.dp_t.get(),
                                             cols, scratch.query_lo.get(), scratch.query_hi.get(), dk_acc);
          if constexpr (kIsLowp<scalar_t>) {
            if (dq_t_acc) {  // dQ^T += K^T dS^T, as in pass 2
              scalar_t* k_t = scratch.k_t_lowp.get();
              int bad = 0;
              if (masked) {
                k_t = scratch.k_t_lowp_masked.get();
                transpose_lowp(k_tile, p.k_row_stride, cols, d, k_t, kBlockK);
                bad = nonfinite_rows<scalar_t, acc_t>(k_tile, p.k_row_stride, cols, d, scratch.bad.get());
                if (bad > 0) zero_columns(k_t, kBlockK, d, scratch.bad.get(), bad);
              } else if (!have_k_t_lowp) {
                transpose_lowp(k_tile, p.k_row_stride, cols, d, k_t, kBlockK);
                have_k_t_lowp = true;
              }
              pack_pairs(scratch.dp_t.get(), kBlockQ, cols, rows, scratch.ds_pairs.get());
              gemm_nn_lowp(d, rows, cols, k_t, kBlockK, scratch.ds_pairs.get(), dq_t_acc, kBlockQ, true);
              add_keys_to_dq(p, head, k0, rows, scratch.bad.get(), bad, scratch, dq_t_acc);
            }
          }
          continue;
        }
        float_operands();
        load_query_tile_transposed(p, head, q0, rows, scratch);
        const bool masked = recompute_block(p, mask, head, k0, cols, q0, rows, k_op, v_op, scratch);
        // dV += P^T dO,  dK += dS^T Q                                       cols x d
        const int bad_do =
            masked ? nonfinite_rows<scalar_t, acc_t>(dout_tile, p.do_row_stride, rows, d, scratch.bad.get()) : 0;
        const int bad_q =
            masked ? nonfinite_rows<scalar_t, acc_t>(q_tile, p.q_row_stride, rows, d, scratch.bad2.get()) : 0;
        const Operand<acc_t> do_op = bad_do > 0
                                         ? operand_without_rows(dout_tile, p.do_row_stride, rows, d, scratch.bad.get(),
                                                                bad_do, scratch.dout.get())
                                         : bwd_tile_operand(dout_tile, p.do_row_stride, rows, d, scratch.dout.get());
        const Operand<acc_t> q_op = bad_q > 0 ? operand_without_rows(q_tile, p.q_row_stride, rows, d,
                                                                     scratch.bad2.get(), bad_q, scratch.q.get())
                                              : bwd_tile_operand(q_tile, p.q_row_stride, rows, d, scratch.q.get());
        const bool full_tile = is_full_tile(rows, cols);
        gemm_nn(cols, d, rows, scratch.s_t.get(), kBlockQ, do_op.ptr, do_op.ld, dv_acc, d, true, full_tile);
        gemm_nn(cols, d, rows, scratch.dp_t.get(), kBlockQ, q_op.ptr, q_op.ld, dk_acc, d, true, full_tile);
        if (bad_do > 0)
          add_query_rows_over_visible_keys(scratch.bad.get(), bad_do, dout_tile, p.do_row_stride, d, scratch.s_t.get(),
                                           cols, scratch.query_lo.get(), scratch.query_hi.get(), dv_acc);
        if (bad_q > 0)
          add_query_rows_over_visible_keys(scratch.bad2.get(), bad_q, q_tile, p.q_row_stride, d, scratch.dp_t.get(),
                                           cols, scratch.query_lo.get(), scratch.query_hi.get(), dk_acc);
        if (dq_t_acc) {  // dQ^T += K^T dS^T, as in pass 2
          acc_t* k_t = scratch.k_t.get();
          int bad = 0;
          if (masked) {
            k_t = scratch.k_t_masked.get();
            load_tile_transposed(k_tile, p.k_row_stride, cols, d, acc_t(1), k_t, kBlockK);
            bad = take_nonfinite_columns(k_t, kBlockK, d, cols, scratch.probe.get(), scratch.bad.get());
          } else if (!have_k_t) {
            load_tile_transposed(k_tile, p.k_row_stride, cols, d, acc_t(1), k_t, kBlockK);
            have_k_t = true;
          }
          gemm_nn(d, rows, cols, k_t, kBlockK, scratch.dp_t.get(), kBlockQ, dq_t_acc, kBlockQ, true, full_tile);
          add_keys_to_dq(p, head, k0, rows, scratch.bad.get(), bad, scratch, dq_t_acc);
        }
      }
    }
  }

  scalar_t* dk = static_cast<scalar_t*>(p.dk_ptr) + seq.k_offset(p.dk_batch_stride, p.dk_row_stride, b) +
                 k0 * p.dk_row_stride + h_kv * p.dk_head_stride;
  scalar_t* dv = static_cast<scalar_t*>(p.dv_ptr) + seq.k_offset(p.dv_batch_stride, p.dv_row_stride, b) +
                 k0 * p.dv_row_stride + h_kv * p.dv_head_stride;
  store_tile(dk_acc, d, cols, d, static_cast<acc_t>(p.softmax_scale), dk, p.dk_row_stride);
  store_tile(dv_acc, d, cols, d, acc_t(1), dv, p.dv_row_stride);
}

// Pass 2: dQ of one query tile of one (sequence, q-head); the caller skips
// tiles past the sequence's end.
template <typename scalar_t, typename acc_t>
void dq_query_tile(const AttnBwdParams& p, const SeqInfo& seq, const AttnMask& mask, const RowStats<acc_t>& stats,
                   int b, int h, int64_t q_tile, BwdScratch<scalar_t, acc_t>& scratch) {
  const int d = p.head_dim;
  const int64_t q0 = q_tile * kBlockQ;
  const int rows = static_cast<int>(std::min<int64_t>(kBlockQ, seq.seqlen_q - q0));
  const HeadView<scalar_t, acc_t> head = head_view<scalar_t, acc_t>(p, seq, stats, b, h);
  acc_t* dq_t_acc = scratch.dq_t_acc.get();
  for (int i = 0; i < d; ++i) std::fill(dq_t_acc + i * kBlockQ, dq_t_acc + i * kBlockQ + rows, acc_t(0));

  const int64_t key_begin = mask.tile_key_begin(q0);
  const int64_t key_end = mask.tile_key_end(q0 + rows);
  if (key_begin < key_end) {
    const bool lowp_rows = scratch.lowp && rows == kBlockQ;
    bool have_float_tiles = false;  // the float32 path's Q^T, dO^T, loaded on first use
    if (lowp_rows) pack_query_tile_pairs(p, head, q0, scratch);
    for (int64_t k0 = key_begin / kBlockK * kBlockK; k0 < key_end; k0 += kBlockK) {
      const int cols = static_cast<int>(std::min<int64_t>(kBlockK, seq.seqlen_k - k0));
      if (head.mod.hides(cols, rows, k0, q0)) continue;  // an attn_mask hides the block outright
      if constexpr (kIsLowp<scalar_t>) {
        if (lowp_rows && cols == kBlockK) {
          const scalar_t* k_tile = head.k + k0 * p.k_row_stride;
          const auto k_a = lowp_operand(k_tile, p.k_row_stride, cols, d, scratch.k_lowp.get());
          const auto v_a = lowp_operand(head.v + k0 * p.v_row_stride, p.v_row_stride, cols, d, scratch.v_lowp.get());
          const bool masked = recompute_block_lowp(p, mask, head, k0, cols, q0, rows, k_a, v_a, scratch);
          // dQ^T += K^T dS^T                                               d x rows
          transpose_lowp(k_tile, p.k_row_stride, cols, d, scratch.k_t_lowp.get(), kBlockK);
          const int bad =
              masked ? nonfinite_rows<scalar_t, acc_t>(k_tile, p.k_row_stride, cols, d, scratch.bad.get()) : 0;
          if (bad > 0) zero_columns(scratch.k_t_lowp.get(), kBlockK, d, scratch.bad.get(), bad);
          pack_pairs(scratch.dp_t.get(), kBlockQ, cols, rows, scratch.ds_pairs.get());
          gemm_nn_lowp(d, rows, cols, scratch.k_t_lowp.get(), kBlockK, scratch.ds_pairs.get(), dq_t_acc, kBlockQ, true);
          add_keys_to_dq(p, head, k0, rows, scratch.bad.get(), bad, scratch, dq_t_acc);
          continue;
        }
      }
      if (!have_float_tiles) {
        load_query_tile_transposed(p, head, q0, rows, scratch);
        have_float_tiles = true;
      }
      const Operand<acc_t> k_op =
          bwd_tile_operand(head.k + k0 * p.k_row_stride, p.k_row_stride, cols, d, scratch.k.get());
      const Operand<acc_t> v_op =
          bwd_tile_operand(head.v + k0 * p.v_row_stride, p.v_row_stride, cols, d, scratch.v.get());
      const bool masked = recompute_block(p, mask, head, k0, cols, q0, rows, k_op, v_op, scratch);
      // dQ^T += K^T dS^T                                                   d x rows
      load_tile_transposed(head.k + k0 * p.k_row_stride, p.k_row_stride, cols, d, acc_t(1), scratch.k_t.get(), kBlockK);
      const int bad =
          masked ? take_nonfinite_columns(scratch.k_t.get(), kBlockK, d, cols, scratch.probe.get(), scratch.bad.get())
                 : 0;
      gemm_nn(d, rows, cols, scratch.k_t.get(), kBlockK, scratch.dp_t.get(), kBlockQ, dq_t_acc, kBlockQ, true,
              is_full_tile(rows, cols));
      add_keys_to_dq(p, head, k0, rows, scratch.bad.get(), bad, scratch, dq_t_acc);
    }
  }

  scalar_t* dq = static_cast<scalar_t*>(p.dq_ptr) + seq.q_offset(p.dq_batch_stride, p.dq_row_stride, b) +
                 q0 * p.dq_row_stride + h * p.dq_head_stride;
  const acc_t* no_row_scale = nullptr;
  store_tile_transposed(dq_t_acc, kBlockQ, rows, d, static_cast<acc_t>(p.softmax_scale), no_row_scale, dq,
                        p.dq_row_stride);
}

// The one-pass backward of one (sequence, kv head): every key tile as pass 1
// does, adding each block's dQ^T to `dq` on the way (dkdv_key_tile), then
// dQ of the group's query heads from it. Bitwise the same as passes 1 and 2,
// with 5 products a block instead of 7 (no recomputation for dQ) and K^T
// made once a key tile; it has batch x kv-heads items only, so it runs when
// they keep every thread busy (bwd below).
template <typename scalar_t, typename acc_t>
void bwd_kv_head(const AttnBwdParams& p, const SeqInfo& seq, const AttnMask& mask, const RowStats<acc_t>& stats, int b,
                 int h_kv, BwdScratch<scalar_t, acc_t>& scratch) {
  const int d = p.head_dim, ratio = p.heads_ratio();
  const int64_t q_tiles = ceil_div(seq.seqlen_q, kBlockQ);
  const int64_t size = ratio * q_tiles * d * kBlockQ;
  if (scratch.dq_acc_size < size) scratch.dq_acc = ScratchArray<acc_t>(size), scratch.dq_acc_size = size;
  const DqTiles<acc_t> dq{scratch.dq_acc.get(), q_tiles, d};
  std::fill(dq.data, dq.data + size, acc_t(0));
  for (int64_t k_tile = 0; k_tile * kBlockK < seq.seqlen_k; ++k_tile)
    dkdv_key_tile<scalar_t, acc_t>(p, seq, mask, stats, b, h_kv, k_tile, scratch, &dq);
  const acc_t* no_row_scale = nullptr;
  for (int g = 0; g < ratio; ++g) {
    const int h = h_kv * ratio + g;
    for (int64_t t = 0; t < q_tiles; ++t) {
      const int64_t q0 = t * kBlockQ;
      const int rows = static_cast<int>(std::min<int64_t>(kBlockQ, seq.seqlen_q - q0));
      scalar_t* dq_out = static_cast<scalar_t*>(p.dq_ptr) + seq.q_offset(p.dq_batch_stride, p.dq_row_stride, b) +
                         q0 * p.dq_row_stride + h * p.dq_head_stride;
      store_tile_transposed(dq.tile(g, t), kBlockQ, rows, d, static_cast<acc_t>(p.softmax_scale), no_row_scale, dq_out,
                            p.dq_row_stride);
    }
  }
}

// Pass 3, only for a float attn_mask that requires grad (AttnBias::grad):
// the mask's gradient, dS summed over the dimensions the mask broadcasts.
// One item per (batch, head, query tile) of the gradient (a dimension the
// mask broadcasts counts once, a query dimension it broadcasts is one tile);
// the item recomputes dS^T for every (batch, head, query tile) of the call
// that maps onto it, in a fixed order, and stores its part of the gradient
// once: no two items touch an element, and the sums do not depend on the
// thread count. It costs the two recomputing products of a block again
// (S^T, dP^T), where passes 1 and 2 cannot write the gradient: under a
// broadcast their items share its elements.
template <typename scalar_t, typename acc_t>
void dmask_tile(const AttnBwdParams& p, const RowStats<acc_t>& stats, int grad_b, int grad_h, int64_t grad_q_tile,
                BwdScratch<scalar_t, acc_t>& scratch, std::vector<acc_t>& acc) {
  const AttnBias& bias = p.score_mod.bias;
  const int d = p.head_dim;
  const bool all_b = bias.grad_batch_stride == 0, all_h = bias.grad_head_stride == 0;
  const bool all_rows = bias.grad_row_stride == 0, all_cols = bias.grad_col_stride == 0;
  const int64_t q_tiles = ceil_div(p.seqlen_q, kBlockQ);
  const int64_t grad_q0 = all_rows ? 0 : grad_q_tile * kBlockQ;
  const int grad_rows = all_rows ? 1 : static_cast<int>(std::min<int64_t>(kBlockQ, p.seqlen_q - grad_q0));
  const int64_t grad_cols = all_cols ? 1 : p.seqlen_k;
  acc.assign(static_cast<size_t>(grad_rows * grad_cols), acc_t(0));
  for (int b = all_b ? 0 : grad_b; b < (all_b ? p.batch : grad_b + 1); ++b) {
    const SeqInfo seq(p, b);
    const AttnMask mask(p.mask, seq);
    for (int h = all_h ? 0 : grad_h; h < (all_h ? p.heads_q : grad_h + 1); ++h) {
      const HeadView<scalar_t, acc_t> head = head_view<scalar_t, acc_t>(p, seq, stats, b, h);
      for (int64_t t = all_rows ? 0 : grad_q_tile; t < (all_rows ? q_tiles : grad_q_tile + 1); ++t) {
        const int64_t q0 = t * kBlockQ;
        const int rows = static_cast<int>(std::min<int64_t>(kBlockQ, seq.seqlen_q - q0));
        const int64_t key_begin = mask.tile_key_begin(q0), key_end = mask.tile_key_end(q0 + rows);
        if (key_begin >= key_end) continue;
        load_query_tile_transposed(p, head, q0, rows, scratch);
        for (int64_t k0 = key_begin / kBlockK * kBlockK; k0 < key_end; k0 += kBlockK) {
          const int cols = static_cast<int>(std::min<int64_t>(kBlockK, seq.seqlen_k - k0));
          const Operand<acc_t> k_op =
              bwd_tile_operand(head.k + k0 * p.k_row_stride, p.k_row_stride, cols, d, scratch.k.get());
          const Operand<acc_t> v_op =
              bwd_tile_operand(head.v + k0 * p.v_row_stride, p.v_row_stride, cols, d, scratch.v.get());
          recompute_block(p, mask, head, k0, cols, q0, rows, k_op, v_op, scratch);
          const acc_t* ds_t = scratch.dp_t.get();  // dS^T, cols x rows
          if (all_rows) {                          // one gradient row: the keys' sums, contiguous
            for (int j = 0; j < cols; ++j) {
              acc_t* dst = acc.data() + (all_cols ? 0 : k0 + j);
              for (int i = 0; i < rows; ++i) *dst += ds_t[j * kBlockQ + i];
            }
          } else {  // row by row: the gradient rows are grad_cols apart, dS^T's columns in L1
            for (int i = 0; i < rows; ++i) {
              acc_t* dst = acc.data() + i * grad_cols;
              for (int j = 0; j < cols; ++j) dst[all_cols ? 0 : k0 + j] += ds_t[j * kBlockQ + i];
            }
          }
        }
      }
    }
  }
  acc_t* grad = static_cast<acc_t*>(bias.grad) + bias.grad_offset(grad_b, grad_h) + grad_q0 * bias.grad_row_stride;
  for (int i = 0; i < grad_rows; ++i)
    for (int64_t j = 0; j < grad_cols; ++j)
      grad[i * bias.grad_row_stride + j * bias.grad_col_stride] = acc[i * grad_cols + j];
}

template <typename scalar_t, typename acc_t>
void dmask(const AttnBwdParams& p, const RowStats<acc_t>& stats) {
  const AttnBias& bias = p.score_mod.bias;
  const int64_t batches = bias.grad_batch_stride == 0 ? 1 : p.batch;
  const int64_t heads = bias.grad_head_stride == 0 ? 1 : p.heads_q;
  const int64_t tiles = bias.grad_row_stride == 0 ? 1 : ceil_div(p.seqlen_q, kBlockQ);
  for_each_item_in_parallel(
      batches * heads * tiles,
      [&] { return std::make_pair(BwdScratch<scalar_t, acc_t>(p.head_dim, false), std::vector<acc_t>()); },
      [&](int64_t item, std::pair<BwdScratch<scalar_t, acc_t>, std::vector<acc_t>>& scratch) {
        const int64_t bh = item / tiles;
        dmask_tile<scalar_t, acc_t>(p, stats, static_cast<int>(bh / heads), static_cast<int>(bh % heads), item % tiles,
                                    scratch.first, scratch.second);
      });
}

// Items run over (batch, head, tile of seqlen_q or seqlen_k): in a varlen
// batch these are the longest sequences' lengths, and the items past a
// shorter sequence's end do nothing.
template <typename scalar_t>
void bwd(const AttnBwdParams& p) {
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  const int64_t num_rows =
      static_cast<int64_t>(p.heads_q) * (p.is_varlen() ? p.total_q : static_cast<int64_t>(p.batch) * p.seqlen_q);

  // Pass 0: neg_lse and dsum for every query row, in the layout of lse.
  // O(batch * heads * seqlen) numbers, the only buffer beyond per-thread tiles.
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  std::vector<acc_t> neg_lse(num_rows), dsum(num_rows);
  const acc_t* lse = static_cast<const acc_t*>(p.lse_ptr);
  const int64_t q_tiles = ceil_div(p.seqlen_q, kBlockQ);
  for_each_item_in_parallel(
      static_cast<int64_t>(p.batch) * p.heads_q * q_tiles, /*make_scratch=*/[] { return 0; },
      [&](int64_t item, int& /*no scratch*/) {
        const int64_t bh = item / q_tiles;
        const int b = static_cast<int>(bh / p.heads_q), h = static_cast<int>(bh % p.heads_q);
        const int64_t q0 = item % q_tiles * kBlockQ;
        const SeqInfo seq(p, b);
        if (q0 >= seq.seqlen_q) return;
        const int rows = static_cast<int>(std::min<int64_t>(kBlockQ, seq.seqlen_q - q0));
        const int64_t row0 = seq.rowvec_offset(p, b, h) + q0;
        const scalar_t* dout = static_cast<const scalar_t*>(p.do_ptr) +
                               seq.q_offset(p.do_batch_stride, p.do_row_stride, b) + q0 * p.do_row_stride +
                               h * p.do_head_stride;
        const scalar_t* out = static_cast<const scalar_t*>(p.o_ptr) +
                              seq.q_offset(p.o_batch_stride, p.o_row_stride, b) + q0 * p.o_row_stride +
                              h * p.o_head_stride;
        row_dot(dout, p.do_row_stride, out, p.o_row_stride, rows, p.head_dim, dsum.data() + row0);
        // A row without keys has lse = -inf; its exponent offset must be -inf
        // too (not +inf), so that P = exp(-inf) = 0 even where no mask says so.
        for (int r = 0; r < rows; ++r) neg_lse[row0 + r] = lse[row0 + r] == kNegInf ? kNegInf : -lse[row0 + r];
      });
  const RowStats<acc_t> stats{neg_lse.data(), dsum.data()};

  // Low-precision products (tile_gemm.h) for full blocks; each worker frees
  // the matrix units' state at its end.
  const bool lowp = p.head_dim % 32 == 0 && lowp_gemm_enabled(p.dtype);
  auto release = [lowp](BwdScratch<scalar_t, acc_t>&) {
    if (lowp) lowp_gemm_release();
  };

  // One pass when the (batch, kv head) items keep every thread busy and
  // their dQ accumulators stay small; the test knob kBwdPasses = 1 / 2
  // (cpu_knobs.h) forces either (the results are bitwise the same).
  const int passes = test_knob_value(TestKnob::kBwdPasses);
  const int64_t groups = static_cast<int64_t>(p.batch) * p.heads_kv;
  const int64_t dq_bytes = static_cast<int64_t>(p.heads_ratio()) * ceil_div(p.seqlen_q, kBlockQ) * kBlockQ *
                           p.head_dim * static_cast<int64_t>(sizeof(acc_t));
  bool one_pass = groups >= at::get_num_threads() && dq_bytes <= (int64_t(16) << 20);
  if (passes == 1) one_pass = true;
  if (passes == 2) one_pass = false;
  if (one_pass) {
    for_each_item_in_parallel(
        groups, [&] { return BwdScratch<scalar_t, acc_t>(p.head_dim, lowp); },
        [&](int64_t item, BwdScratch<scalar_t, acc_t>& scratch) {
          const int b = static_cast<int>(item / p.heads_kv);
          const SeqInfo seq(p, b);
          if (seq.seqlen_q == 0 && seq.seqlen_k == 0) return;
          bwd_kv_head<scalar_t, acc_t>(p, seq, AttnMask(p.mask, seq), stats, b, static_cast<int>(item % p.heads_kv),
                                       scratch);
        },
        release);
    if (p.score_mod.bias.grad) dmask<scalar_t, acc_t>(p, stats);
    return;
  }

  // Pass 1: dK, dV, first key tile first (under a causal mask it is seen by
  // the most queries; heavy items first balance the dynamic schedule).
  const int64_t k_tiles = ceil_div(p.seqlen_k, kBlockK);
  for_each_item_in_parallel(
      static_cast<int64_t>(p.batch) * p.heads_kv * k_tiles,
      [&] { return BwdScratch<scalar_t, acc_t>(p.head_dim, lowp); },
      [&](int64_t item, BwdScratch<scalar_t, acc_t>& scratch) {
        const int64_t bh = item / k_tiles, k_tile = item % k_tiles;
        const int b = static_cast<int>(bh / p.heads_kv);
        const SeqInfo seq(p, b);
        if (k_tile * kBlockK >= seq.seqlen_k) return;
        dkdv_key_tile<scalar_t, acc_t>(p, seq, AttnMask(p.mask, seq), stats, b, static_cast<int>(bh % p.heads_kv),
                                       k_tile, scratch);
      },
      release);

  // Pass 2: dQ, last query tile first (under a causal mask it sees the most keys).
  for_each_item_in_parallel(
      static_cast<int64_t>(p.batch) * p.heads_q * q_tiles,
      [&] { return BwdScratch<scalar_t, acc_t>(p.head_dim, lowp); },
      [&](int64_t item, BwdScratch<scalar_t, acc_t>& scratch) {
        const int64_t bh = item / q_tiles, q_tile = q_tiles - 1 - item % q_tiles;
        const int b = static_cast<int>(bh / p.heads_q);
        const SeqInfo seq(p, b);
        if (q_tile * kBlockQ >= seq.seqlen_q) return;
        dq_query_tile<scalar_t, acc_t>(p, seq, AttnMask(p.mask, seq), stats, b, static_cast<int>(bh % p.heads_q),
                                       q_tile, scratch);
      },
      release);

  if (p.score_mod.bias.grad) dmask<scalar_t, acc_t>(p, stats);
}

}  // namespace
}  // namespace cpu

bool bwd_cpu_copies_tiles() { return cpu::copies_tiles(); }

void run_bwd_cpu(const AttnBwdParams& params) {
  cpu::with_scalar_type(params.dtype, "backward", [&](auto elem) { cpu::bwd<decltype(elem)>(params); });
}

}  // namespace flashattn
