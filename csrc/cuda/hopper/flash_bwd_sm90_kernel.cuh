// The backward dK/dV(/dQ) kernel for Hopper (sm90a): the same algorithm as
// flash_bwd_dkdv_kernel (see ../flash_bwd_kernel.cuh), with every product on
// wgmma instead of mma.sync. wgmma reads its shared-memory operands once per
// warpgroup instead of once per warp through ldmatrix, which is what bounds the
// mma.sync backward; it also runs asynchronously, so the softmax work of one
// product overlaps the next.
//
// A CTA owns kBlockN = 64 keys per warpgroup (one or two warpgroups) and
// sweeps the query blocks (kBlockM rows) of every query head of its GQA group.
// Each warpgroup of 4 warps owns 64 keys:
//
//   S^T  = K_w Q^T            wgmma SS, both K-major             (64 x kBlockM)
//   dP^T = V_w dO^T           wgmma SS, both K-major             (64 x kBlockM)
//   P^T  = exp2(S^T * scale_log2 - lse), dS^T = P^T * (dP^T - D)  (registers)
//   dV_w += P^T dO            wgmma RS, P^T from registers, dO N-major
//   dK_w += dS^T Q            wgmma RS, dS^T from registers, Q N-major
//   dQ   += dS K              wgmma SS, dS^T from shared memory (M-major), K N-major
//
// dQ needs dS for all of the CTA's keys: dS^T goes to shared memory. The
// kBlockM x kHeadDim dQ tile is cut into 64 x 64 blocks dealt to the
// warpgroups, each contracting all keys; with one block and two warpgroups
// (kBlockM 64, head dim 64) the warpgroups split the keys instead and the two
// partial sums meet in the fp32 atomics.
//
// One warpgroup per CTA (kNWarpgroups = 1) halves the keys a CTA owns and lets
// two CTAs share an SM, so that the prologue and epilogue of one overlap the
// other's main loop. It is a tuning candidate only: on the H200 it measured
// slower than two warpgroups at every size tried (benchmarks/NOTES.md).
#pragma once

#include "../bwd_common.cuh"
#include "../nonfinite_fixup.cuh"
#include "bwd_sm90_common.cuh"
#include "wgmma.cuh"

namespace flashattn {

template <typename Kt, bool kVarlen>
__global__ void __launch_bounds__(Kt::kNThreads, Kt::kMinBlocksPerSm) flash_bwd_sm90_kernel(const AttnBwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = typename Kt::Element;
  using TileQ = typename Kt::TileQ;
  using TileKV = typename Kt::TileKV;
  using TileDS = typename Kt::TileDS;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim;
  constexpr int kNThreads = Kt::kNThreads, kStages = Kt::kQStages;
  constexpr int kQSteps = kBlockM / 16;  // k-steps of dV and dK (over queries)
  constexpr int kQT = kBlockM / 8;       // n-tiles of an S^T row
  constexpr int kDT = kHeadDim / 8;      // n-tiles of a dK / dV row

  extern __shared__ char smem_raw[];
  char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  T* sK = reinterpret_cast<T*>(smem);
  T* sV = sK + TileKV::kElems;
  T* sQ = sV + TileKV::kElems;                                   // [kStages] Q blocks
  T* sdO = sQ + kStages * TileQ::kElems;                         // [kStages] dO blocks
  T* sdS = sdO + kStages * TileQ::kElems;                        // dS^T of the current tile
  float* sLse = reinterpret_cast<float*>(sdS + TileDS::kElems);  // [kStages][kBlockM]
  float* sDsum = sLse + kStages * kBlockM;                       // [kStages][kBlockM]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid / 32;
  const int wg = warp / 4, warp_in_wg = warp % 4;
  const int g = lane >> 2, t = lane & 3;
  const int num_n_blocks = ceil_div(p.seqlen_k, kBlockN);
  const int n_block = static_cast<int>(blockIdx.x % num_n_blocks);
  const int h_kv = static_cast<int>((blockIdx.x / num_n_blocks) % p.heads_kv);
  const int b = static_cast<int>(blockIdx.x / num_n_blocks / p.heads_kv);
  const int ratio = p.heads_ratio();
  const int n0 = n_block * kBlockN;
  const SeqInfo seq(p, b, kVarlen);
  if (kVarlen && n0 >= seq.seqlen_k) return;  // this key block starts past the end of its sequence
  const int keys = min(kBlockN, seq.seqlen_k - n0);

  const T* gK = static_cast<const T*>(p.k_ptr) + seq.k_offset(p.k_batch_stride, p.k_row_stride, b) +
                h_kv * p.k_head_stride + n0 * p.k_row_stride;
  const T* gV = static_cast<const T*>(p.v_ptr) + seq.k_offset(p.v_batch_stride, p.v_row_stride, b) +
                h_kv * p.v_head_stride + n0 * p.v_row_stride;
  T* gdK = static_cast<T*>(p.dk_ptr) + seq.k_offset(p.dk_batch_stride, p.dk_row_stride, b) + h_kv * p.dk_head_stride +
           n0 * p.dk_row_stride;
  T* gdV = static_cast<T*>(p.dv_ptr) + seq.k_offset(p.dv_batch_stride, p.dv_row_stride, b) + h_kv * p.dv_head_stride +
           n0 * p.dv_row_stride;

  const BlockMask mask(p, seq);
  // The key blocks of a head start their sweeps at different query blocks (spreads the dQ atomics).
  const QuerySweep<kBlockM> sweep(mask, n0, keys, h_kv, ratio, n_block);
  const int iters = sweep.iters;
  const int wg_key0 = wg * Kt::kWgKeys;             // this warpgroup's first key in the block
  const int warp_key0 = wg_key0 + warp_in_wg * 16;  // this warp's rows of S^T, dK, dV

  auto query_block = [&](int it, int& hq, int& m0) { sweep.step(it, hq, m0); };
  auto load_q_block = [&](int it, int stage) {
    int hq, m0;
    query_block(it, hq, m0);
    const int rows = min(kBlockM, seq.seqlen_q - m0);
    const T* gQ = static_cast<const T*>(p.q_ptr) + seq.q_offset(p.q_batch_stride, p.q_row_stride, b) +
                  hq * p.q_head_stride + m0 * p.q_row_stride;
    const T* gdO = static_cast<const T*>(p.do_ptr) + seq.q_offset(p.do_batch_stride, p.do_row_stride, b) +
                   hq * p.do_head_stride + m0 * p.do_row_stride;
    const int64_t vec = seq.rowvec_offset(p, b, hq) + m0;
    copy_tile_async<TileQ, kNThreads>(sQ + stage * TileQ::kElems, gQ, p.q_row_stride, rows, p.head_dim, tid);
    copy_tile_async<TileQ, kNThreads>(sdO + stage * TileQ::kElems, gdO, p.do_row_stride, rows, p.head_dim, tid);
    copy_rowvec_async<kBlockM, kNThreads>(sLse + stage * kBlockM, static_cast<const float*>(p.lse_ptr) + vec, rows,
                                          tid);
    copy_rowvec_async<kBlockM, kNThreads>(sDsum + stage * kBlockM, static_cast<const float*>(p.dsum_ptr) + vec, rows,
                                          tid);
  };

  // Descriptors: K-major operands step 32 bytes per 16 columns inside a panel
  // and a panel per 64; N/M-major operands step 16 rows (2048 bytes) per k-step.
  constexpr uint32_t kSbo = 1024;
  const uint64_t desc_k = smem_desc(smem_u32(sK) + wg_key0 * 128, 16, kSbo);  // A of S^T (K-major)
  const uint64_t desc_v = smem_desc(smem_u32(sV) + wg_key0 * 128, 16, kSbo);  // A of dP^T
  // dQ: block i of warpgroup wg contracts keys [dq_key0, ..) into rows
  // [dq_row0(i), +64) x columns [dq_col0(i), +64).
  constexpr int kDqKSteps = (Kt::kDqSplitKeys ? Kt::kWgKeys : kBlockN) / 16;
  constexpr int kDqPerWg = Kt::kDqBlocksPerWg;
  const int dq_key0 = Kt::kDqSplitKeys ? wg_key0 : 0;
  auto dq_block = [&](int i) { return Kt::kDqSplitKeys ? 0 : wg * kDqPerWg + i; };
  auto dq_row0 = [&](int i) { return dq_block(i) / Kt::kDqColBlocks * 64; };
  auto dq_col0 = [&](int i) { return dq_block(i) % Kt::kDqColBlocks * 64; };
  uint64_t desc_ds[kDqPerWg], desc_k_n[kDqPerWg];
#pragma unroll
  for (int i = 0; i < kDqPerWg; ++i) {
    desc_ds[i] = smem_desc(smem_u32(sdS) + (dq_row0(i) / 64) * Kt::kPanelDS + dq_key0 * 128, Kt::kPanelDS,
                           kSbo);  // A (M-major)
    desc_k_n[i] = smem_desc(smem_u32(sK) + (dq_col0(i) / 64) * Kt::kPanelKV + dq_key0 * 128, Kt::kPanelKV,
                            kSbo);  // B (N-major)
  }

  float acc_dk[1][kDT][4], acc_dv[1][kDT][4];
  clear(acc_dk);
  clear(acc_dv);

  if (iters > 0) {
    copy_tile_async<TileKV, kNThreads>(sK, gK, p.k_row_stride, keys, p.head_dim, tid);
    copy_tile_async<TileKV, kNThreads>(sV, gV, p.v_row_stride, keys, p.head_dim, tid);
    load_q_block(0, 0);
    cp_async_commit();
  }

  for (int it = 0; it < iters; ++it) {
    const int stage = it % kStages;
    int hq, m0;
    query_block(it, hq, m0);
    const uint32_t q_addr = smem_u32(sQ + stage * TileQ::kElems), do_addr = smem_u32(sdO + stage * TileQ::kElems);
    const uint64_t desc_q = smem_desc(q_addr, 16, kSbo), desc_do = smem_desc(do_addr, 16, kSbo);  // K-major B
    const uint64_t desc_q_n = smem_desc(q_addr, Kt::kPanelQ, kSbo);                               // N-major B
    const uint64_t desc_do_n = smem_desc(do_addr, Kt::kPanelQ, kSbo);
    const float* sLses = sLse + stage * kBlockM;
    const float* sDsums = sDsum + stage * kBlockM;

    cp_async_wait<0>();
    fence_proxy_async_smem();  // the cp.async data is read by wgmma
    __syncthreads();           // this stage has landed; every warp is done with the previous tile
    if (it + 1 < iters) {
      load_q_block(it + 1, (it + 1) % kStages);
      cp_async_commit();
    }

    float acc_s[1][kQT][4], acc_dp[1][kQT][4];
    issue_scores_and_dp_t<Kt>(acc_s[0], acc_dp[0], desc_k, desc_v, desc_q, desc_do);
    wgmma_wait<1>();
    pin_registers(acc_s[0]);
    probs_t(acc_s[0], p.softmax_scale_log2, t,
            [&](int q) { return (m0 + q < seq.seqlen_q) ? lse_to_log2(sLses[q]) : INFINITY; });
    if (mask.tile_needs_mask<kBlockM, kBlockN>(m0, n0)) apply_mask_cols(acc_s, mask, n0 + warp_key0, m0, lane, 0.f);

    wgmma_wait<0>();
    pin_registers(acc_dp[0]);
    ds_t(acc_dp[0], acc_s[0], sDsums, t);
    // A masked dS is 0 even where dP - D is not finite (0 * NaN): non-finite
    // inputs reach only the rows that see them (README, "Errors, non-finite inputs and transforms").
    if (mask.tile_needs_mask<kBlockM, kBlockN>(m0, n0)) apply_mask_cols(acc_dp, mask, n0 + warp_key0, m0, lane, 0.f);

    // dV += P^T dO and dK += dS^T Q, with P^T and dS^T as register A operands.
    uint32_t a_p[kQSteps][4], a_ds[kQSteps][4];
#pragma unroll
    for (int kk = 0; kk < kQSteps; ++kk) {
      acc_to_a<T>(a_p[kk], acc_s[0], kk);
      acc_to_a<T>(a_ds[kk], acc_dp[0], kk);
    }
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kQSteps; ++kk)
      Wgmma<kHeadDim, T>::template rs<1>(acc_dv[0], a_p[kk], desc_add(desc_do_n, kk * 2048), 1);
#pragma unroll
    for (int kk = 0; kk < kQSteps; ++kk)
      Wgmma<kHeadDim, T>::template rs<1>(acc_dk[0], a_ds[kk], desc_add(desc_q_n, kk * 2048), 1);
    wgmma_commit();

    // dQ = dS K: dS^T through shared memory (the other warpgroup's keys too).
    store_acc<TileDS>(sdS, acc_dp, warp_key0, 0, lane);
    fence_proxy_async_smem();
    __syncthreads();
    float acc_dq[kDqPerWg][8][4];
    wgmma_fence();
#pragma unroll
    for (int i = 0; i < kDqPerWg; ++i)
#pragma unroll
      for (int ks = 0; ks < kDqKSteps; ++ks)
        Wgmma<64, T>::template ss<1, 1>(acc_dq[i], desc_add(desc_ds[i], ks * 2048), desc_add(desc_k_n[i], ks * 2048),
                                        ks > 0);
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < kDqPerWg; ++i) pin_registers(acc_dq[i]);
    pin_registers(acc_dv[0]);
    pin_registers(acc_dk[0]);

#pragma unroll
    for (int i = 0; i < kDqPerWg; ++i) {
      float* gdq = static_cast<float*>(p.dq_accum_ptr) + dq_accum_offset(p, seq, b, hq) +
                   (m0 + dq_row0(i) + warp_in_wg * 16) * p.dq_accum_row_stride + dq_col0(i);
#pragma unroll
      for (int di = 0; di < 8; ++di)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          atomic_add2(gdq + (g + 8 * h) * p.dq_accum_row_stride + di * 8 + 2 * t, acc_dq[i][di][2 * h],
                      acc_dq[i][di][2 * h + 1]);
    }
  }

  // Epilogue: stage dK (scaled) and dV through sK / sV, then 16-byte stores.
  const bool bad = nonfinite::any_bad(acc_dk) || nonfinite::any_bad(acc_dv);
  __syncthreads();
  store_acc<TileKV>(sK, acc_dk, warp_key0, 0, lane, p.softmax_scale);
  store_acc<TileKV>(sV, acc_dv, warp_key0, 0, lane);
  // The non-finite rule (../nonfinite_fixup.cuh): this warp's 16 keys, exactly, if one holds a NaN / inf.
  if (__any_sync(0xffffffffu, bad))
    nonfinite::fix_key_rows<TileKV, (kHeadDim + 31) / 32>(nonfinite::fixup_args(p, seq, b), h_kv, n0, warp_key0,
                                                          warp_key0 + 16, 1, keys, sK, sV, 0, kHeadDim, lane);
  __syncthreads();
  store_tile<TileKV, kNThreads>(gdK, p.dk_row_stride, sK, keys, p.head_dim, tid);
  store_tile<TileKV, kNThreads>(gdV, p.dv_row_stride, sV, keys, p.head_dim, tid);
#endif
}

}  // namespace flashattn
