// The forward pass: one CTA per (query block, head, batch). The query block
// stays on chip while key/value blocks stream past it (seed section 2.8):
//
//   for each key block j (last to first):
//     S   = Q K_j^T                      (tensor cores, fp32 accumulators)
//     m'  = max(m, rowmax(S)); c = exp(m - m')
//     P   = exp(S - m'); l = l * c + rowsum(P); O = O * c + P V_j
//   O /= l; lse = m + log(l)
//
// Warps split the query rows (kBlockM / kNWarps each), so the softmax row
// statistics never leave a warp's quad of lanes. Key blocks are visited last
// to first: the blocks that need masking (the diagonal of a causal mask, the
// ragged end of the keys) come first and the rest run without mask code.
//
// kScoreMod: the instance for calls with flash-attn's softcap / ALiBi
// (score_mod.cuh): each S tile is modified (in log2 units) before the mask.
// It also runs dropout (p.dropout.enabled(), a runtime branch: the plain
// instance holds no dropout code): the row sums (and lse) are those of the
// undropped P; the dropped entries of P are zeroed before P V (dropout.cuh,
// philox.h's mask) and O takes the 1 / (1 - p) once, at the end.
#pragma once

#include "../flash_params.h"
#include "dropout.cuh"
#include "kernel_traits.h"
#include "mask.cuh"
#include "mask_skip.cuh"
#include "nonfinite_fixup.cuh"
#include "score_mod.cuh"
#include "softmax.cuh"
#include "tile.cuh"

namespace flashattn {

template <typename Kt, bool kVarlen, bool kScoreMod = false>
__global__ void __launch_bounds__(Kt::kNThreads, Kt::kMinBlocksPerSm) flash_fwd_kernel(const AttnFwdParams p) {
  using T = typename Kt::Element;
  using TileQ = typename Kt::TileQ;
  using TileKV = typename Kt::TileKV;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim;
  constexpr int kMT = Kt::kMTilesPerWarp;  // 16-row m-tiles per warp
  constexpr int kNT = kBlockN / 8;         // 8-column n-tiles of S
  constexpr int kDT = kHeadDim / 8;        // 8-column n-tiles of O
  constexpr int kNThreads = Kt::kNThreads;

  extern __shared__ __align__(128) char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + TileQ::kElems;                  // [kStages] K blocks
  T* sV = sK + Kt::kStages * Kt::kStageElems;  // [kStages] V blocks

  const int tid = threadIdx.x, lane = tid & 31, warp = tid / 32;
  const QueryBlockOfCta<kBlockM> blk(p, kVarlen);
  const int h = blk.h, b = blk.b, h_kv = blk.h_kv, m0 = blk.m0, rows = blk.rows;
  if (kVarlen && rows <= 0) return;  // this block starts past the end of its sequence
  const SeqInfo& seq = blk.seq;
  const int seqlen_k = seq.seqlen_k;

  const T* gQ = static_cast<const T*>(p.q_ptr) + seq.q_offset(p.q_batch_stride, p.q_row_stride, b) +
                h * p.q_head_stride + m0 * p.q_row_stride;
  // Row 0 of the sequence's keys of kv head h_kv (paged: of the cache's kv head h_kv; key_offset locates the rows).
  const bool paged_kv = kVarlen && p.kv.paged();
  const T* gK = static_cast<const T*>(p.k_ptr) + (paged_kv ? 0 : seq.k_offset(p.k_batch_stride, p.k_row_stride, b)) +
                h_kv * p.k_head_stride;
  const T* gV = static_cast<const T*>(p.v_ptr) + (paged_kv ? 0 : seq.k_offset(p.v_batch_stride, p.v_row_stride, b)) +
                h_kv * p.v_head_stride;
  T* gO = static_cast<T*>(p.o_ptr) + seq.q_offset(p.o_batch_stride, p.o_row_stride, b) + h * p.o_head_stride +
          m0 * p.o_row_stride;
  float* gLse = static_cast<float*>(p.lse_ptr) + seq.rowvec_offset(p, b, h) + m0;

  const BlockMask mask(p, seq);
  int n_min, n_max;
  mask.key_block_range<kBlockN>(m0, rows, n_min, n_max);

  const int warp_row0 = warp * Kt::kRowsPerWarp;  // first row of this warp inside the block
  const int g = lane >> 2, t = lane & 3;

  // Step j visits key block n_max - 1 - j. The score-mod instance skips the
  // blocks an attn_mask hides outright (../mask_skip.cuh; every warp looks
  // them up alike); with none left the block sees no key.
  const int blocks = n_max - n_min;
  auto visible =
      visible_key_steps<kBlockM, kBlockN, kScoreMod>(p.score_mod.bias, b, h, m0, rows, n_max, seqlen_k, blocks);
  const int s0 = blocks > 0 ? visible.next_warp(0) : blocks;
  if (s0 >= blocks) {
    store_unseeing_query_block<T>(p, seq, b, h, m0, rows, tid, kNThreads);
    return;
  }
  auto block_of = [&](int step) { return n_max - 1 - step; };

  const LdsmA<TileQ> ldsm_q(sQ, warp_row0, 0, lane);
  const LdsmB<TileKV> ldsm_k(sK, 0, 0, lane);
  const LdsmA<TileKV> ldsm_v(sV, 0, 0, lane);
  // With a score mod the scores reach the softmax scaled, in log2 units.
  const bool positive_scale = kScoreMod || p.softmax_scale > 0.f;

  // A paged cache is read row by row through its page table.
  auto load_k = [&](int n_block, int stage) {
    const int n0 = n_block * kBlockN;
    if (paged_kv) {
      copy_tile_rows_async<TileKV, kNThreads>(
          sK + stage * Kt::kStageElems,
          [&](int r) { return gK + seq.key_offset(p, b, p.k_batch_stride, p.k_row_stride, n0 + r); }, gK, seqlen_k - n0,
          p.head_dim, tid);
      return;
    }
    copy_tile_async<TileKV, kNThreads>(sK + stage * Kt::kStageElems, gK + int64_t(n0) * p.k_row_stride, p.k_row_stride,
                                       seqlen_k - n0, p.head_dim, tid);
  };
  auto load_v = [&](int n_block, int stage) {
    const int n0 = n_block * kBlockN;
    if (paged_kv) {
      copy_tile_rows_async<TileKV, kNThreads>(
          sV + stage * Kt::kStageElems,
          [&](int r) { return gV + seq.key_offset(p, b, p.v_batch_stride, p.v_row_stride, n0 + r); }, gV, seqlen_k - n0,
          p.head_dim, tid);
      return;
    }
    copy_tile_async<TileKV, kNThreads>(sV + stage * Kt::kStageElems, gV + int64_t(n0) * p.v_row_stride, p.v_row_stride,
                                       seqlen_k - n0, p.head_dim, tid);
  };

  // Prologue: Q and the first (last) key block in flight; with two stages,
  // the second key/value block too.
  copy_tile_async<TileQ, kNThreads>(sQ, gQ, p.q_row_stride, rows, p.head_dim, tid);
  load_k(block_of(s0), 0);
  if constexpr (Kt::kStages == 2) load_v(block_of(s0), 0);
  cp_async_commit();
  const int s1 = Kt::kStages == 2 ? visible.next_warp(s0 + 1) : blocks;  // the second visible step
  if constexpr (Kt::kStages == 2) {
    if (s1 < blocks) load_k(block_of(s1), 1), load_v(block_of(s1), 1);
    cp_async_commit();
  }

  // Small head dims keep the warp's Q fragments in registers for the whole sweep.
  uint32_t qfrag[Kt::kQInRegs ? kMT : 1][Kt::kQInRegs ? kHeadDim / 16 : 1][4];
  if constexpr (Kt::kQInRegs) {
    cp_async_wait<Kt::kStages - 1>();
    __syncthreads();
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) ldmatrix_x4(qfrag[mi][ks], ldsm_q(mi * 16, ks * 16));
  }

  float acc_o[kMT][kDT][4];
  clear(acc_o);
  OnlineSoftmax<kMT> softmax;

  // S = Q K^T for the key block in `stage`, masked where needed.
  auto scores = [&](float(&acc_s)[kMT][kNT][4], int n0, int stage) {
    clear(acc_s);
    if constexpr (Kt::kQInRegs) {
      gemm_rs_nk<kMT, kNT, kHeadDim, T>(acc_s, qfrag, ldsm_k, stage * Kt::kStageBytes);
    } else {
      gemm_ss_nk<kMT, kNT, kHeadDim, T>(acc_s, ldsm_q, ldsm_k, stage * Kt::kStageBytes);
    }
    if constexpr (kScoreMod) {
      const ScoreModTile mod(p.score_mod, static_cast<float>(p.softmax_scale), b, h, seq.seqlen_q, seqlen_k);
      apply_score_mod_rows(acc_s, mod, m0 + warp_row0, n0, lane);
    }
    if (mask.tile_needs_mask<kBlockM, kBlockN>(m0, n0)) apply_mask_rows(acc_s, mask, m0 + warp_row0, n0, lane);
  };
  // P = online softmax of S (rescaling O), then O += P V (with dropout, the
  // kept entries of P: the row sums above saw them all).
  auto accumulate = [&](float(&acc_s)[kMT][kNT][4], int n0, int stage) {
    if (positive_scale) {
      softmax.template update<true>(acc_s, acc_o, kScoreMod ? 1.f : p.softmax_scale_log2);
    } else {
      softmax.template update<false>(acc_s, acc_o, kScoreMod ? 1.f : p.softmax_scale_log2);
    }
    if constexpr (kScoreMod) {
      if (p.dropout.enabled())
        apply_dropout_rows(acc_s, DropoutPlane(p.dropout, b, p.heads_q, h), m0 + warp_row0, n0, lane, 1.f);
    }
    gemm_rc_kn<kMT, kDT, kBlockN, T>(acc_o, acc_s, ldsm_v, stage * Kt::kStageBytes);
  };

  if constexpr (Kt::kStages == 1) {
    // K and V have one buffer each: V_j loads under S = Q K_j^T, K_{j-1}
    // under the softmax and P V_j.
    for (int step = s0; step < blocks;) {
      const int n_block = block_of(step);
      const int n0 = n_block * kBlockN;
      float acc_s[kMT][kNT][4];
      cp_async_wait<0>();
      __syncthreads();  // K_j has landed; every warp is done with V_{j+1}
      load_v(n_block, 0);
      cp_async_commit();
      scores(acc_s, n0, 0);
      cp_async_wait<0>();
      __syncthreads();  // V_j has landed; every warp is done with K_j
      const int next = visible.next_warp(step + 1);
      if (next < blocks) {
        load_k(block_of(next), 0);
        cp_async_commit();
      }
      accumulate(acc_s, n0, 0);
      step = next;
    }
  } else {
    // Two K/V stages: block j - 2 loads during all of block j - 1's work.
    for (int it = 0, step = s0, ahead = s1; step < blocks; ++it) {
      const int stage = it & 1;
      const int n0 = block_of(step) * kBlockN;
      float acc_s[kMT][kNT][4];
      cp_async_wait<1>();
      __syncthreads();  // this stage has landed
      scores(acc_s, n0, stage);
      accumulate(acc_s, n0, stage);
      __syncthreads();  // every warp is done with this stage
      const int far = ahead < blocks ? visible.next_warp(ahead + 1) : blocks;
      if (far < blocks) load_k(block_of(far), stage), load_v(block_of(far), stage);
      cp_async_commit();  // possibly empty: keeps the group count uniform
      step = ahead;
      ahead = far;
    }
  }

  // Epilogue: normalize, stage O through this warp's rows of sQ so the global
  // store is 16 bytes per lane, and write lse.
  float row_lse[kMT][2];
  cp_async_wait<0>();  // only empty groups can remain
  softmax.finalize(acc_o, kScoreMod ? 1.f : p.softmax_scale_log2, positive_scale, row_lse);
  if constexpr (kScoreMod) {
    if (p.dropout.enabled()) {  // O / l times 1 / (1 - p) (0 when p = 1: every entry dropped), as the CPU's
      const float scale = static_cast<float>(p.dropout.scale);
#pragma unroll
      for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
        for (int di = 0; di < kDT; ++di)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_o[mi][di][e] *= scale;
    }
  }
  const bool bad = nonfinite::any_bad(acc_o);
  store_acc<TileQ>(sQ, acc_o, warp_row0, 0, lane);
  if (t == 0) {
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = warp_row0 + mi * 16 + g + 8 * hh;
        if (r < rows) gLse[r] = row_lse[mi][hh];
      }
  }
  // The non-finite rule (nonfinite_fixup.cuh): this warp's rows, exactly, if one holds a NaN / inf.
  if (__any_sync(0xffffffffu, bad))
    nonfinite::fix_fwd_rows<TileQ, (kHeadDim + 31) / 32>(nonfinite::fixup_args(p, seq, b), h, m0, warp_row0,
                                                         Kt::kRowsPerWarp, rows, sQ, lane,
                                                         nonfinite::score_policy<kScoreMod>(p, b));
  __syncthreads();
  store_tile<TileQ, kNThreads>(gO, p.o_row_stride, sQ, rows, p.head_dim, tid);
}

}  // namespace flashattn
