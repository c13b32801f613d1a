// The forward kernel for Hopper (sm90a): the algorithm of flash_fwd_kernel
// (../flash_fwd_kernel.cuh) with S = Q K^T and O += P V on wgmma.
//
// A CTA owns kBlockM = 128 query rows; each of its two warpgroups owns 64 and
// keeps its O rows and softmax statistics in registers. Key/value blocks of
// kBlockN rows stream through two shared-memory stages, last block first (the
// blocks that need masking come first).
//
// Software pipeline (per warpgroup), one CTA barrier per key block j:
//
//   barrier: K_{j+1} and V_j have landed; every warpgroup is done with K_j
//            (its S ran in step j-1) and with V_{j-1} (its P V ran in step j-1)
//   start loads K_{j+2} -> K stage of j, V_{j+1} -> V stage of j-1
//   issue S_{j+1} = Q K_{j+1}^T, then O += P_j V_j    (both asynchronous)
//   wait for S_{j+1}; softmax of S_{j+1}              (overlaps P_j V_j)
//   wait for P_j V_j; O *= correction_{j+1}
//
// so the exponentials of one block run while the tensor cores do the previous
// block's P V, and K runs one block ahead of V in the stage ring.
#pragma once

#include "../../flash_params.h"
#include "../mask.cuh"
#include "../nonfinite_fixup.cuh"
#include "../softmax.cuh"
#include "../tile.cuh"
#include "wgmma.cuh"

namespace flashattn {

template <typename Kt, bool kVarlen>
__global__ void __launch_bounds__(Kt::kNThreads, Kt::kMinBlocksPerSm) flash_fwd_sm90_kernel(const AttnFwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = typename Kt::Element;
  using TileQ = typename Kt::TileQ;
  using TileKV = typename Kt::TileKV;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim;
  constexpr int kNT = kBlockN / 8;   // n-tiles of a row of S
  constexpr int kDT = kHeadDim / 8;  // n-tiles of a row of O
  constexpr int kNThreads = Kt::kNThreads;
  constexpr uint32_t kSbo = 1024;

  extern __shared__ char smem_raw[];
  char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + TileQ::kElems;       // [2] K stages
  T* sV = sK + 2 * TileKV::kElems;  // [2] V stages

  const int tid = threadIdx.x, lane = tid & 31, warp = tid / 32;
  const int wg = warp / 4;
  const int g = lane >> 2, t = lane & 3;
  const QueryBlockOfCta<kBlockM> blk(p, kVarlen);
  const int h = blk.h, b = blk.b, h_kv = blk.h_kv, m0 = blk.m0, rows = blk.rows;
  if (kVarlen && rows <= 0) return;  // this block starts past the end of its sequence
  const SeqInfo& seq = blk.seq;
  const int seqlen_k = seq.seqlen_k;
  const int warp_row0 = warp * 16;  // this warp's 16 rows (warpgroup wg: rows 64 wg ..)

  const T* gQ = static_cast<const T*>(p.q_ptr) + seq.q_offset(p.q_batch_stride, p.q_row_stride, b) +
                h * p.q_head_stride + m0 * p.q_row_stride;
  const T* gK =
      static_cast<const T*>(p.k_ptr) + seq.k_offset(p.k_batch_stride, p.k_row_stride, b) + h_kv * p.k_head_stride;
  const T* gV =
      static_cast<const T*>(p.v_ptr) + seq.k_offset(p.v_batch_stride, p.v_row_stride, b) + h_kv * p.v_head_stride;
  T* gO = static_cast<T*>(p.o_ptr) + seq.q_offset(p.o_batch_stride, p.o_row_stride, b) + h * p.o_head_stride +
          m0 * p.o_row_stride;
  float* gLse = static_cast<float*>(p.lse_ptr) + seq.rowvec_offset(p, b, h) + m0;

  const BlockMask mask(p, seq);
  int n_min, n_max;
  mask.key_block_range<kBlockN>(m0, rows, n_min, n_max);
  if (n_max <= n_min) {
    store_unseeing_query_block<T>(p, seq, b, h, m0, rows, tid, kNThreads);
    return;
  }
  const int blocks = n_max - n_min;  // step j visits key block n_max - 1 - j
  auto load_k = [&](int j) {
    const int n_block = n_max - 1 - j;
    copy_tile_async<TileKV, kNThreads>(sK + (j & 1) * TileKV::kElems, gK + int64_t(n_block) * kBlockN * p.k_row_stride,
                                       p.k_row_stride, seqlen_k - n_block * kBlockN, p.head_dim, tid);
  };
  auto load_v = [&](int j) {
    const int n_block = n_max - 1 - j;
    copy_tile_async<TileKV, kNThreads>(sV + (j & 1) * TileKV::kElems, gV + int64_t(n_block) * kBlockN * p.v_row_stride,
                                       p.v_row_stride, seqlen_k - n_block * kBlockN, p.head_dim, tid);
  };

  // Q: A of S, K-major, this warpgroup's 64 rows. K: B of S, K-major.
  // V: B of P V, N-major (keys are the contraction, 16 rows = 2048 bytes a step).
  const uint64_t desc_q = smem_desc(smem_u32(sQ) + wg * 64 * 128, 16, kSbo);
  auto desc_k = [&](int j) { return smem_desc(smem_u32(sK + (j & 1) * TileKV::kElems), 16, kSbo); };
  auto desc_v = [&](int j) { return smem_desc(smem_u32(sV + (j & 1) * TileKV::kElems), Kt::kPanelKV, kSbo); };

  // S_j = Q K_j^T, issued and committed (not waited for).
  auto issue_scores = [&](float(&acc_s)[1][kNT][4], int j) {
    const uint64_t dk = desc_k(j);
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks)
      Wgmma<kBlockN, T>::template ss<0, 0>(acc_s[0], desc_add(desc_q, kmajor_step(ks, Kt::kPanelQ)),
                                           desc_add(dk, kmajor_step(ks, Kt::kPanelKV)), ks > 0);
    wgmma_commit();
  };
  // Mask S_j where needed, then P_j = online softmax (O's correction returned).
  const bool positive_scale = p.softmax_scale > 0.f;
  OnlineSoftmax<1> softmax;
  auto softmax_step = [&](float(&acc_s)[1][kNT][4], int j, float(&correction)[1][2]) {
    const int n0 = (n_max - 1 - j) * kBlockN;
    if (mask.tile_needs_mask<kBlockM, kBlockN>(m0, n0)) apply_mask_rows(acc_s, mask, m0 + warp_row0, n0, lane);
    if (positive_scale) {
      softmax.template softmax_rows<true>(acc_s, p.softmax_scale_log2, correction);
    } else {
      softmax.template softmax_rows<false>(acc_s, p.softmax_scale_log2, correction);
    }
  };

  // Prologue: Q and K_0; then V_0 and K_1. S_0 and its softmax.
  copy_tile_async<TileQ, kNThreads>(sQ, gQ, p.q_row_stride, rows, p.head_dim, tid);
  load_k(0);
  cp_async_commit();
  load_v(0);
  if (blocks > 1) load_k(1);
  cp_async_commit();

  float acc_o[1][kDT][4];
  clear(acc_o);
  float acc_s[1][kNT][4];
  float correction[1][2];
  cp_async_wait<1>();
  fence_proxy_async_smem();
  __syncthreads();
  wgmma_fence();
  issue_scores(acc_s, 0);
  wgmma_wait<0>();
  pin_registers(acc_s[0]);
  softmax_step(acc_s, 0, correction);  // O is zero: no rescale

  // O += P_j V_j, issued and committed (not waited for). P_j is packed into
  // A fragments first, which frees acc_s for S_{j+1}.
  auto issue_pv = [&](const uint32_t(&a_p)[kBlockN / 16][4], int j) {
    const uint64_t dv = desc_v(j);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      Wgmma<kHeadDim, T>::template rs<1>(acc_o[0], a_p[kk], desc_add(dv, kk * 2048), 1);
    wgmma_commit();
  };
  auto wait_for_loads = [&](int j) {
    cp_async_wait<0>();
    fence_proxy_async_smem();
    __syncthreads();  // K_{j+1}, V_j landed; every warpgroup is done with K_j and V_{j-1}
    if (j + 2 < blocks) load_k(j + 2);
    if (j + 1 < blocks) load_v(j + 1);
    cp_async_commit();
  };

  for (int j = 0; j + 1 < blocks; ++j) {
    wait_for_loads(j);
    // S_{j+1} and P_j V_j in flight together; the softmax of S_{j+1} runs under P_j V_j.
    uint32_t a_p[kBlockN / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) acc_to_a<T>(a_p[kk], acc_s[0], kk);
    wgmma_fence();
    issue_scores(acc_s, j + 1);
    issue_pv(a_p, j);
    wgmma_wait<1>();
    pin_registers(acc_s[0]);
    softmax_step(acc_s, j + 1, correction);
    wgmma_wait<0>();
    pin_registers(acc_o[0]);
    OnlineSoftmax<1>::rescale(acc_o, correction);
  }
  {  // The last block: P V only.
    wait_for_loads(blocks - 1);
    uint32_t a_p[kBlockN / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) acc_to_a<T>(a_p[kk], acc_s[0], kk);
    wgmma_fence();
    issue_pv(a_p, blocks - 1);
    wgmma_wait<0>();
    pin_registers(acc_o[0]);
  }

  // Epilogue: normalize, stage O through this warp's rows of sQ (only this
  // warp read them), 16-byte stores, lse.
  float row_lse[1][2];
  cp_async_wait<0>();
  softmax.finalize(acc_o, p.softmax_scale_log2, positive_scale, row_lse);
  const bool bad = nonfinite::any_bad(acc_o);
  store_acc<TileQ>(sQ, acc_o, warp_row0, 0, lane);
  if (t == 0) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = warp_row0 + g + 8 * hh;
      if (r < rows) gLse[r] = row_lse[0][hh];
    }
  }
  // The non-finite rule (../nonfinite_fixup.cuh): this warp's 16 rows, exactly, if one holds a NaN / inf.
  if (__any_sync(0xffffffffu, bad))
    nonfinite::fix_fwd_rows<TileQ, (kHeadDim + 31) / 32>(nonfinite::fixup_args(p, seq, b), h, m0, warp_row0, 16, rows,
                                                         sQ, lane);
  __syncthreads();
  store_tile<TileQ, kNThreads>(gO, p.o_row_stride, sQ, rows, p.head_dim, tid);
#endif
}

}  // namespace flashattn
