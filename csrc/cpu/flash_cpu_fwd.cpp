// Forward pass of the CPU kernels (FlashAttention-2 style).
//
// One work item is one tile of kBlockQ query rows of one (batch, q-head). It
// keeps the query tile and streams the key/value tiles it can see past it:
//
//   S = Q K^T                      (rows x cols)   GEMM
//   m_new = max(m, rowmax(scale S))
//   P = exp(scale S - m_new),  l = l exp(m - m_new) + rowsum(P)
//   O = O exp(m - m_new) + P V     (rows x d)      GEMM
//
// and at the end writes O / l and lse = m + log(l). Nothing larger than a
// tile is ever stored: the per-thread scratch holds one tile of each operand.
//
// Key tiles lie on a fixed grid of kBlockK keys (so the GEMM shapes repeat
// and their JIT-compiled kernels are reused); the loop visits only the tiles
// the mask leaves visible to some row of the query tile, and applies the
// element mask only on tiles that are not fully visible.
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "attn_mask.h"
#include "flash_cpu.h"
#include "tile_gemm.h"
#include "tile_ops.h"
#include "work_queue.h"

namespace flashattn {
namespace cpu {
namespace {

// Tile sizes (rows of queries x keys), chosen by benchmarks/bench_cpu.py on an
// AVX-512 core: larger query tiles amortize the transposition of each key tile
// over more rows, larger key tiles make longer GEMMs; beyond these the tiles
// fall out of L1/L2 and causal masking wastes more of the diagonal tiles.
constexpr int kBlockQ = 64;
constexpr int kBlockK = 128;

template <typename acc_t>
struct FwdScratch {
  explicit FwdScratch(int head_dim)
      : q(kBlockQ * head_dim),
        k_t(head_dim * kBlockK),
        v(kBlockK * head_dim),
        scores(kBlockQ * kBlockK),
        o_acc(kBlockQ * head_dim),
        row_max(kBlockQ),
        row_sum(kBlockQ),
        row_scale(kBlockQ),
        key_lo(kBlockQ),
        key_hi(kBlockQ) {}

  ScratchArray<acc_t> q;          // kBlockQ x d        query tile, when q cannot be a GEMM operand in place
  ScratchArray<acc_t> k_t;        // d x kBlockK        key tile, transposed
  ScratchArray<acc_t> v;          // kBlockK x d        value tile, when v cannot be used in place
  ScratchArray<acc_t> scores;     // kBlockQ x kBlockK  S, then P
  ScratchArray<acc_t> o_acc;      // kBlockQ x d        unnormalized output
  ScratchArray<acc_t> row_max;    // kBlockQ            m, in units of scaled scores
  ScratchArray<acc_t> row_sum;    // kBlockQ            l
  ScratchArray<acc_t> row_scale;  // kBlockQ            1 / l at the end
  ScratchArray<int> key_lo;       // kBlockQ            visible keys of each row, in tile coordinates
  ScratchArray<int> key_hi;       // kBlockQ
};

template <typename scalar_t, typename acc_t>
void fwd_query_tile(const AttnFwdParams& p, const AttnMask& mask, int64_t b, int64_t h, int64_t q_tile,
                    FwdScratch<acc_t>& scratch) {
  const int d = p.head_dim;
  const int64_t q0 = q_tile * kBlockQ;
  const int rows = static_cast<int>(std::min<int64_t>(kBlockQ, p.seqlen_q - q0));
  const int64_t h_kv = h / p.heads_ratio();  // GQA: q-heads share k/v heads in groups, read in place

  const scalar_t* q = static_cast<const scalar_t*>(p.q_ptr) + b * p.q_batch_stride + q0 * p.q_row_stride + h * p.q_head_stride;
  const scalar_t* k = static_cast<const scalar_t*>(p.k_ptr) + b * p.k_batch_stride + h_kv * p.k_head_stride;
  const scalar_t* v = static_cast<const scalar_t*>(p.v_ptr) + b * p.v_batch_stride + h_kv * p.v_head_stride;
  scalar_t* o = static_cast<scalar_t*>(p.o_ptr) + b * p.o_batch_stride + q0 * p.o_row_stride + h * p.o_head_stride;
  acc_t* lse = static_cast<acc_t*>(p.lse_ptr) + (b * p.heads_q + h) * p.seqlen_q + q0;

  acc_t* row_max = scratch.row_max.get();
  acc_t* row_sum = scratch.row_sum.get();
  acc_t* o_acc = scratch.o_acc.get();
  acc_t* scores = scratch.scores.get();
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  for (int r = 0; r < rows; ++r) row_max[r] = kNegInf, row_sum[r] = 0;
  std::fill(o_acc, o_acc + rows * d, acc_t(0));

  const int64_t key_begin = mask.tile_key_begin(q0);
  const int64_t key_end = mask.tile_key_end(q0 + rows);
  if (key_begin < key_end) {
    const Operand<acc_t> q_op = as_operand(q, p.q_row_stride, rows, d, scratch.q.get(), d);  // rows x d
    const acc_t scale = static_cast<acc_t>(p.softmax_scale);
    for (int64_t k0 = key_begin / kBlockK * kBlockK; k0 < key_end; k0 += kBlockK) {
      const int cols = static_cast<int>(std::min<int64_t>(kBlockK, p.seqlen_k - k0));

      // S = Q K^T                                                          rows x cols
      load_tile_transposed(k + k0 * p.k_row_stride, p.k_row_stride, cols, d, scratch.k_t.get(), kBlockK);
      gemm_nn(rows, cols, d, q_op.ptr, q_op.ld, scratch.k_t.get(), kBlockK, scores, kBlockK, /*accumulate=*/false);

      // Element mask, only where some entry of the block is hidden.
      const int* key_lo = nullptr;
      const int* key_hi = nullptr;
      if (!mask.block_fully_visible(q0, q0 + rows, k0, k0 + cols)) {
        for (int r = 0; r < rows; ++r) {
          scratch.key_lo.get()[r] = static_cast<int>(std::clamp<int64_t>(mask.key_begin(q0 + r) - k0, 0, cols));
          scratch.key_hi.get()[r] = static_cast<int>(std::clamp<int64_t>(mask.key_end(q0 + r) - k0, 0, cols));
        }
        key_lo = scratch.key_lo.get();
        key_hi = scratch.key_hi.get();
      }
      // S -> P, update m and l, rescale O.
      online_softmax_step(scores, kBlockK, rows, cols, scale, key_lo, key_hi, row_max, row_sum, o_acc, d, d);

      // O += P V                                                           rows x d
      const Operand<acc_t> v_op = as_operand(v + k0 * p.v_row_stride, p.v_row_stride, cols, d, scratch.v.get(), d);
      gemm_nn(rows, d, cols, scores, kBlockK, v_op.ptr, v_op.ld, o_acc, d, /*accumulate=*/true);
    }
  }

  // O / l and lse = m + log(l); a row that saw no key has l = 0: zeros and -inf.
  acc_t* inv_sum = scratch.row_scale.get();
  for (int r = 0; r < rows; ++r) {
    const bool empty = row_sum[r] == acc_t(0);
    inv_sum[r] = empty ? acc_t(0) : acc_t(1) / row_sum[r];
    lse[r] = empty ? kNegInf : row_max[r] + std::log(row_sum[r]);
  }
  store_tile_row_scaled(o_acc, d, rows, d, inv_sum, o, p.o_row_stride);
}

template <typename scalar_t>
void fwd(const AttnFwdParams& p) {
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  const AttnMask mask(p.mask, p.seqlen_q, p.seqlen_k);
  const int64_t q_tiles = ceil_div(p.seqlen_q, kBlockQ);
  const int64_t num_items = static_cast<int64_t>(p.batch) * p.heads_q * q_tiles;
  for_each_item_in_parallel(
      num_items, [&] { return FwdScratch<acc_t>(p.head_dim); },
      [&](int64_t item, FwdScratch<acc_t>& scratch) {
        // Last query tile first: under a causal mask it is the most expensive,
        // and the dynamic schedule balances best when big items go first.
        const int64_t q_tile = q_tiles - 1 - item % q_tiles;
        const int64_t bh = item / q_tiles;
        fwd_query_tile<scalar_t, acc_t>(p, mask, bh / p.heads_q, bh % p.heads_q, q_tile, scratch);
      });
}

}  // namespace
}  // namespace cpu

void run_fwd_cpu(const AttnFwdParams& params) {
  switch (params.dtype) {
    case ScalarKind::kFloat32: return cpu::fwd<float>(params);
    case ScalarKind::kFloat64: return cpu::fwd<double>(params);
    case ScalarKind::kBFloat16: return cpu::fwd<c10::BFloat16>(params);
    case ScalarKind::kFloat16: return cpu::fwd<c10::Half>(params);
  }
  TORCH_CHECK(false, "flashattn_ext: unknown dtype in the CPU forward");
}

}  // namespace flashattn
