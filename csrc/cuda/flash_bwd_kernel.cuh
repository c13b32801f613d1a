// The backward pass, recomputing each probability tile from the saved
// log-sum-exp instead of storing P (seed section 2.9):
//
//   D     = rowsum(dO * O)                          (bwd_preprocess_kernel)
//   P     = exp(scale * Q K^T - lse)
//   dV   += P^T dO
//   dP    = dO V^T
//   dS    = P * (dP - D)
//   dK   += scale * dS^T Q
//   dQ   += scale * dS K
//
// flash_bwd_dkdv_kernel owns a key block and sweeps the query blocks; with
// kComputeDq it also adds each tile's dS K into an fp32 dQ accumulator with
// atomics (fast, not bitwise reproducible: the order of the adds varies).
// The deterministic mode instead runs flash_bwd_dq_kernel, which owns a query
// block and sweeps the key blocks, recomputing S and dP a second time.
#pragma once

#include "../flash_params.h"
#include "bwd_common.cuh"
#include "dispatch.h"
#include "dropout.cuh"
#include "dropout_keep_bits.cuh"
#include "kernel_traits.h"
#include "mask.cuh"
#include "mask_skip.cuh"
#include "nonfinite_fixup.cuh"
#include "score_mod.cuh"
#include "tile.cuh"

namespace flashattn {

// kScoreMod (both kernels below): the instance for calls with softcap / ALiBi
// (score_mod.cuh): S is modified before P is recomputed from it, and dS takes
// softcap's derivative. It also runs dropout (p.dropout.enabled(), a runtime
// branch; the plain instances hold no dropout code), with Z the forward's keep
// mask regenerated (dropout.cuh, philox.h) and s = 1 / (1 - p):
//   dP = (dO V^T) o Z s,  dS = P o (dP - D),  dV += (Z o P s)^T dO
// (D = rowsum(dO o O) unchanged; P the undropped probabilities, as the
// softcap derivative needs them), as the CPU kernels compute it.

template <typename Kt, bool kComputeDq, bool kVarlen, bool kScoreMod = false>
__global__ void __launch_bounds__(Kt::kNThreads, 1) flash_bwd_dkdv_kernel(const AttnBwdParams p) {
  using T = typename Kt::Element;
  using TileQ = typename Kt::TileQ;
  using TileKV = typename Kt::TileKV;
  using TileDS = typename Kt::TileDS;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim;
  constexpr int kMT = Kt::kSKeys / 16;    // 16-key m-tiles of a warp's S^T tile
  constexpr int kQT = Kt::kSQueries / 8;  // 8-query n-tiles of a warp's S^T tile
  constexpr int kVMT = Kt::kVKeys / 16;   // 16-key m-tiles of a warp's dK / dV tile
  constexpr int kDT = Kt::kVCols / 8;     // 8-column n-tiles of a warp's dK / dV tile
  constexpr int kNThreads = Kt::kNThreads;
  constexpr int kStages = Kt::kQStages;

  extern __shared__ __align__(128) char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + TileKV::kElems;
  T* sQ = sV + TileKV::kElems;             // [kStages] Q blocks
  T* sdO = sQ + kStages * TileQ::kElems;   // [kStages] dO blocks
  T* sdS = sdO + kStages * TileQ::kElems;  // dS^T of the current tile
  T* sP = sdS + TileDS::kElems;            // P^T of the current tile (kPInSmem only)
  float* sLse = reinterpret_cast<float*>(sP + (Kt::kPInSmem ? TileDS::kElems : 0));  // [kStages][kBlockM]
  float* sDsum = sLse + kStages * kBlockM;                                           // [kStages][kBlockM]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid / 32;
  const int num_n_blocks = ceil_div(p.seqlen_k, kBlockN);
  int64_t rest = blockIdx.x;
  const int n_block = static_cast<int>(rest % num_n_blocks);
  rest /= num_n_blocks;
  const int d0 = static_cast<int>(rest % Kt::kDSplit) * Kt::kDOut;
  rest /= Kt::kDSplit;
  const int h_kv = static_cast<int>(rest % p.heads_kv);
  const int b = static_cast<int>(rest / p.heads_kv);
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
  // Every query head of the group, every query block that sees the keys. With
  // kRotate, the key blocks of one head start their sweeps at different query
  // blocks, so their fp32 dQ atomics do not all land on the same rows at once.
  const QuerySweep<kBlockM> sweep(mask, n0, keys, h_kv, ratio, Kt::kRotate && kComputeDq ? n_block : 0);
  const int iters = sweep.iters;
  const int g = lane >> 2, t = lane & 3;
  // This warp's tile of S^T (keys s_key0.., queries s_q0..) and of dK / dV
  // (keys v_key0.., columns v_col0.. of the CTA's slice).
  const int s_key0 = (warp / Kt::kSWarpsQ) * Kt::kSKeys, s_q0 = (warp % Kt::kSWarpsQ) * Kt::kSQueries;
  const int v_key0 = (warp / Kt::kVWarpsD) * Kt::kVKeys, v_col0 = d0 + (warp % Kt::kVWarpsD) * Kt::kVCols;
  const LdsmA<TileKV> ldsm_k(sK, s_key0, 0, lane), ldsm_v(sV, s_key0, 0, lane);  // A of K Q^T, V dO^T

  float acc_dk[kVMT][kDT][4], acc_dv[kVMT][kDT][4];
  clear(acc_dk);
  clear(acc_dv);

  auto query_block = [&](int it, int& hq, int& m0) { sweep.step(it, hq, m0); };
  // The score-mod instance skips the query blocks an attn_mask hides from
  // this block's keys outright (../mask_skip.cuh; every warp looks them up alike).
  auto visible = visible_steps<kScoreMod>(
      [sweep, bias = &p.score_mod.bias, b, n0, last_key = n0 + keys - 1, seqlen_q = seq.seqlen_q](int it) {
        int hq, m0;
        sweep.step(it, hq, m0);
        return summary_code<kBlockM, kBlockN>(*bias, b, hq, m0, min(m0 + kBlockM, seqlen_q) - 1, n0, last_key);
      },
      iters);
  const int first = iters > 0 ? visible.next_warp(0) : iters;

  // Loads query block `it` (head, block) into stage `stage`.
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

  if (iters > 0) {
    copy_tile_async<TileKV, kNThreads>(sK, gK, p.k_row_stride, keys, p.head_dim, tid);
    copy_tile_async<TileKV, kNThreads>(sV, gV, p.v_row_stride, keys, p.head_dim, tid);
    if (first < iters) load_q_block(first, 0);
    cp_async_commit();
  }

  // it: the sweep's step; r: the visible steps so far (the stage).
  for (int it = first, r = 0; it < iters; ++r) {
    const int next = visible.next_warp(it + 1);
    const int stage = kStages == 1 ? 0 : r % kStages;
    int hq, m0;
    query_block(it, hq, m0);
    const T* sQs = sQ + stage * TileQ::kElems;
    const T* sdOs = sdO + stage * TileQ::kElems;
    const LdsmB<TileQ> ldsm_q_b(sQs, s_q0, 0, lane), ldsm_do_b(sdOs, s_q0, 0, lane);      // B of K Q^T, V dO^T
    const LdsmA<TileQ> ldsm_q_t(sQs, 0, v_col0, lane), ldsm_do_t(sdOs, 0, v_col0, lane);  // B of dS^T Q, P^T dO
    const float* sLses = sLse + stage * kBlockM;
    const float* sDsums = sDsum + stage * kBlockM;

    cp_async_wait<0>();
    __syncthreads();  // this stage has landed; every warp is done with the previous tile
    if (kStages > 1 && next < iters) {
      load_q_block(next, (r + 1) % kStages);
      cp_async_commit();
    }

    // Dropout: the tile's keep bits (dropout_keep_bits.cuh), drawn before the
    // products, when only the dK / dV accumulators are live (the Philox
    // temporaries then do not add to the S^T / dP^T tiles' peak), applied to
    // dP^T and P^T below.
    [[maybe_unused]] const bool dropout = kScoreMod && p.dropout.enabled();
    [[maybe_unused]] const float dropout_scale = static_cast<float>(p.dropout.scale);
    [[maybe_unused]] KeepBitsCols<kMT, kQT> keep;
    if constexpr (kScoreMod) {
      // (apply_dropout_cols: key offsets multiples of 32, or 16 with one m-tile.)
      static_assert(Kt::kSKeys % 32 == 0 || Kt::kSKeys == 16, "dropout: a warp's keys must be whole key groups");
      if (dropout)
        keep = KeepBitsCols<kMT, kQT>(DropoutPlane(p.dropout, b, p.heads_q, hq), n0 + s_key0, m0 + s_q0, lane);
    }

    // P^T = exp2(scale_log2 * K Q^T - lse_log2), keys as rows.
    float acc_s[kMT][kQT][4];
    clear(acc_s);
    gemm_ss_nk<kMT, kQT, kHeadDim, T>(acc_s, ldsm_k, ldsm_q_b);
    [[maybe_unused]] const ScoreModTile mod(p.score_mod, static_cast<float>(p.softmax_scale), b, hq, seq.seqlen_q,
                                            seq.seqlen_k);
    if constexpr (kScoreMod) apply_score_mod_cols(acc_s, mod, n0 + s_key0, m0 + s_q0, lane);
    const float score_scale_log2 = kScoreMod ? 1.f : p.softmax_scale_log2;
#pragma unroll
    for (int qi = 0; qi < kQT; ++qi)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int q = s_q0 + qi * 8 + 2 * t + e;
        const float lse_log2 = (m0 + q < seq.seqlen_q) ? lse_to_log2(sLses[q]) : INFINITY;
#pragma unroll
        for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float& x = acc_s[mi][qi][2 * h + e];
            x = fast_exp2(x * score_scale_log2 - lse_log2);
          }
      }
    if (mask.tile_needs_mask<kBlockM, kBlockN>(m0, n0)) {
      apply_mask_cols(acc_s, mask, n0 + s_key0, m0 + s_q0, lane, 0.f);
    }

    // dP^T = V dO^T (with dropout: times Z s), then dS^T = P^T * (dP^T - D) in place.
    float acc_dp[kMT][kQT][4];
    clear(acc_dp);
    gemm_ss_nk<kMT, kQT, kHeadDim, T>(acc_dp, ldsm_v, ldsm_do_b);
    if constexpr (kScoreMod) {
      if (dropout) keep.apply(acc_dp, dropout_scale);
    }
#pragma unroll
    for (int qi = 0; qi < kQT; ++qi)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float dsum = sDsums[s_q0 + qi * 8 + 2 * t + e];
#pragma unroll
        for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float& x = acc_dp[mi][qi][2 * h + e];
            x = acc_s[mi][qi][2 * h + e] * (x - dsum);
          }
      }
    if constexpr (kScoreMod)
      apply_softcap_grad<true>(acc_dp, acc_s, mod, n0 + s_key0, m0 + s_q0, lane, [&](int, int, int qi, int e) {
        const int q = s_q0 + qi * 8 + 2 * t + e;
        return (m0 + q < seq.seqlen_q) ? lse_to_log2(sLses[q]) : INFINITY;
      });
    // A masked dS is 0 even where dP - D is not finite (0 * NaN): non-finite
    // inputs reach only the rows that see them (README, "Errors, non-finite inputs and transforms").
    if (mask.tile_needs_mask<kBlockM, kBlockN>(m0, n0)) {
      apply_mask_cols(acc_dp, mask, n0 + s_key0, m0 + s_q0, lane, 0.f);
    }
    // The attn_mask's gradient: one CTA of a key block's head-dim slices adds it.
    if constexpr (kScoreMod)
      if (d0 == 0) add_bias_grad_tile<true>(acc_dp, mod, n0 + s_key0, m0 + s_q0, lane);

    // dV += (Z o P s)^T dO with dropout (dS above took the undropped P).
    if constexpr (kScoreMod) {
      if (dropout) keep.apply(acc_s, dropout_scale);
    }

    // dV += P^T dO and dK += dS^T Q over this CTA's head-dim slice.
    if constexpr (!Kt::kPInSmem) {
      gemm_rc_kn<kMT, kDT, kBlockM, T>(acc_dv, acc_s, ldsm_do_t);
      gemm_rc_kn<kMT, kDT, kBlockM, T>(acc_dk, acc_dp, ldsm_q_t);
    } else {
      // The 2-D S^T tiles cover all queries of a key only together: gather
      // P^T and dS^T in shared memory, then contract over all kBlockM queries.
      store_acc<TileDS>(sP, acc_s, s_key0, s_q0, lane);
      store_acc<TileDS>(sdS, acc_dp, s_key0, s_q0, lane);
      __syncthreads();
      gemm_ss_kn<kVMT, kDT, kBlockM, T>(acc_dv, LdsmA<TileDS>(sP, v_key0, 0, lane), ldsm_do_t);
      gemm_ss_kn<kVMT, kDT, kBlockM, T>(acc_dk, LdsmA<TileDS>(sdS, v_key0, 0, lane), ldsm_q_t);
    }

    if constexpr (kComputeDq) {
      // dQ_tile = dS K: the warps split it differently from the keys, so dS^T
      // goes through shared memory; the partial products meet in fp32 atomics.
      if constexpr (!Kt::kPInSmem) {
        store_acc<TileDS>(sdS, acc_dp, s_key0, s_q0, lane);
        __syncthreads();
      }
      constexpr int kQMT = Kt::kDqRowsPerWarp / 16, kQDT = Kt::kDqColsPerWarp / 8;
      const int q_row0 = (warp % Kt::kDqWarpsM) * Kt::kDqRowsPerWarp;
      const int q_col0 = d0 + (warp / Kt::kDqWarpsM) * Kt::kDqColsPerWarp;
      float acc_dq[kQMT][kQDT][4];
      clear(acc_dq);
      gemm_tt_kn<kQMT, kQDT, kBlockN, T>(acc_dq, LdsmB<TileDS>(sdS, 0, q_row0, lane),
                                         LdsmA<TileKV>(sK, 0, q_col0, lane));
      float* gdq = static_cast<float*>(p.dq_accum_ptr) + dq_accum_offset(p, seq, b, hq) +
                   (m0 + q_row0) * p.dq_accum_row_stride + q_col0;
#pragma unroll
      for (int mi = 0; mi < kQMT; ++mi)
#pragma unroll
        for (int di = 0; di < kQDT; ++di)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            atomic_add2(gdq + (mi * 16 + g + 8 * h) * p.dq_accum_row_stride + di * 8 + 2 * t, acc_dq[mi][di][2 * h],
                        acc_dq[mi][di][2 * h + 1]);
    }

    if (kStages == 1 && next < iters) {
      __syncthreads();  // every warp is done with the single Q / dO buffer
      load_q_block(next, 0);
      cp_async_commit();
    }
    it = next;
  }

  // Epilogue: stage dK (scaled) and dV through sK / sV, then 16-byte stores.
  const bool bad = nonfinite::any_bad(acc_dk) || nonfinite::any_bad(acc_dv);
  __syncthreads();
  store_acc<TileKV>(sK, acc_dk, v_key0, v_col0, lane, p.softmax_scale);
  store_acc<TileKV>(sV, acc_dv, v_key0, v_col0, lane);
  // The non-finite rule (nonfinite_fixup.cuh): a warp's tile is not whole rows
  // here, so the vote is the CTA's; the warps then share the rows.
  if (__syncthreads_or(bad)) {
    nonfinite::fix_key_rows<TileKV, (kHeadDim + 31) / 32>(nonfinite::fixup_args(p, seq, b), h_kv, n0, warp, kBlockN,
                                                          kNThreads / 32, keys, sK, sV, d0, d0 + Kt::kDOut, lane,
                                                          nonfinite::score_policy<kScoreMod>(p, b));
    __syncthreads();
  }
  store_tile<TileKV, kNThreads, Kt::kDOut>(gdK, p.dk_row_stride, sK, keys, p.head_dim, tid, d0);
  store_tile<TileKV, kNThreads, Kt::kDOut>(gdV, p.dv_row_stride, sV, keys, p.head_dim, tid, d0);
}

template <typename Kt, bool kVarlen, bool kScoreMod = false>
__global__ void __launch_bounds__(Kt::kNThreads, 1) flash_bwd_dq_kernel(const AttnBwdParams p) {
  using T = typename Kt::Element;
  using TileQ = typename Kt::TileQ;
  using TileKV = typename Kt::TileKV;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim;
  constexpr int kMT = Kt::kMTilesPerWarp;
  constexpr int kNT = kBlockN / 8;
  constexpr int kDT = kHeadDim / 8;
  constexpr int kNThreads = Kt::kNThreads;

  extern __shared__ __align__(128) char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + TileQ::kElems;
  T* sK = sdO + TileQ::kElems;
  T* sV = sK + TileKV::kElems;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid / 32;
  const QueryBlockOfCta<kBlockM> blk(p, kVarlen);
  const int h = blk.h, b = blk.b, h_kv = blk.h_kv, m0 = blk.m0, rows = blk.rows;
  if (kVarlen && rows <= 0) return;  // this block starts past the end of its sequence
  const SeqInfo& seq = blk.seq;
  const int warp_row0 = warp * Kt::kRowsPerWarp;
  const int g = lane >> 2;

  const T* gQ = static_cast<const T*>(p.q_ptr) + seq.q_offset(p.q_batch_stride, p.q_row_stride, b) +
                h * p.q_head_stride + m0 * p.q_row_stride;
  const T* gdO = static_cast<const T*>(p.do_ptr) + seq.q_offset(p.do_batch_stride, p.do_row_stride, b) +
                 h * p.do_head_stride + m0 * p.do_row_stride;
  const T* gK =
      static_cast<const T*>(p.k_ptr) + seq.k_offset(p.k_batch_stride, p.k_row_stride, b) + h_kv * p.k_head_stride;
  const T* gV =
      static_cast<const T*>(p.v_ptr) + seq.k_offset(p.v_batch_stride, p.v_row_stride, b) + h_kv * p.v_head_stride;
  T* gdQ = static_cast<T*>(p.dq_ptr) + seq.q_offset(p.dq_batch_stride, p.dq_row_stride, b) + h * p.dq_head_stride +
           m0 * p.dq_row_stride;
  const int64_t vec = seq.rowvec_offset(p, b, h) + m0;

  // Per-row lse (log2 units) and D of this lane's rows.
  float lse_log2[kMT][2], dsum[kMT][2];
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = warp_row0 + mi * 16 + g + 8 * hh;
      lse_log2[mi][hh] = r < rows ? lse_to_log2(static_cast<const float*>(p.lse_ptr)[vec + r]) : INFINITY;
      dsum[mi][hh] = r < rows ? static_cast<const float*>(p.dsum_ptr)[vec + r] : 0.f;
    }

  const BlockMask mask(p, seq);
  int n_min, n_max;
  mask.key_block_range<kBlockN>(m0, rows, n_min, n_max);
  [[maybe_unused]] const ScoreModTile mod(p.score_mod, static_cast<float>(p.softmax_scale), b, h, seq.seqlen_q,
                                          seq.seqlen_k);
  const float score_scale_log2 = kScoreMod ? 1.f : p.softmax_scale_log2;

  float acc_dq[kMT][kDT][4];
  clear(acc_dq);
  const LdsmA<TileQ> ldsm_q(sQ, warp_row0, 0, lane), ldsm_do(sdO, warp_row0, 0, lane);
  const LdsmB<TileKV> ldsm_k(sK, 0, 0, lane), ldsm_v(sV, 0, 0, lane);
  const LdsmA<TileKV> ldsm_k_t(sK, 0, 0, lane);

  copy_tile_async<TileQ, kNThreads>(sQ, gQ, p.q_row_stride, rows, p.head_dim, tid);
  copy_tile_async<TileQ, kNThreads>(sdO, gdO, p.do_row_stride, rows, p.head_dim, tid);
  cp_async_commit();

  // The score-mod instance skips the key blocks an attn_mask hides outright
  // (../mask_skip.cuh): step j is key block n_min + j.
  auto visible = visible_steps<kScoreMod>(
      [bias = &p.score_mod.bias, b, h, m0, last_row = m0 + rows - 1, n_min, seqlen_k = seq.seqlen_k](int j) {
        const int n0 = (n_min + j) * kBlockN;
        return summary_code<kBlockM, kBlockN>(*bias, b, h, m0, last_row, n0, min(n0 + kBlockN, seqlen_k) - 1);
      },
      n_max - n_min);
  for (int step = visible.next_warp(0); step < n_max - n_min; step = visible.next_warp(step + 1)) {
    const int n_block = n_min + step;
    const int n0 = n_block * kBlockN;
    copy_tile_async<TileKV, kNThreads>(sK, gK + int64_t(n0) * p.k_row_stride, p.k_row_stride, seq.seqlen_k - n0,
                                       p.head_dim, tid);
    copy_tile_async<TileKV, kNThreads>(sV, gV + int64_t(n0) * p.v_row_stride, p.v_row_stride, seq.seqlen_k - n0,
                                       p.head_dim, tid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    float acc_s[kMT][kNT][4];
    clear(acc_s);
    gemm_ss_nk<kMT, kNT, kHeadDim, T>(acc_s, ldsm_q, ldsm_k);
    if constexpr (kScoreMod) apply_score_mod_rows(acc_s, mod, m0 + warp_row0, n0, lane);
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
      for (int ni = 0; ni < kNT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          acc_s[mi][ni][e] = fast_exp2(acc_s[mi][ni][e] * score_scale_log2 - lse_log2[mi][e / 2]);
    if (mask.tile_needs_mask<kBlockM, kBlockN>(m0, n0)) apply_mask_rows(acc_s, mask, m0 + warp_row0, n0, lane, 0.f);

    float acc_dp[kMT][kNT][4];
    clear(acc_dp);
    gemm_ss_nk<kMT, kNT, kHeadDim, T>(acc_dp, ldsm_do, ldsm_v);
    if constexpr (kScoreMod) {  // dropout: dP = (dO V^T) o Z s (the forward's mask, regenerated)
      if (p.dropout.enabled())
        apply_dropout_rows(acc_dp, DropoutPlane(p.dropout, b, p.heads_q, h), m0 + warp_row0, n0, lane,
                           static_cast<float>(p.dropout.scale));
    }
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
      for (int ni = 0; ni < kNT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dp[mi][ni][e] = acc_s[mi][ni][e] * (acc_dp[mi][ni][e] - dsum[mi][e / 2]);
    if constexpr (kScoreMod)
      apply_softcap_grad<false>(acc_dp, acc_s, mod, m0 + warp_row0, n0, lane,
                                [&](int mi, int hh, int, int) { return lse_log2[mi][hh]; });
    // A masked dS is 0 even where dP - D is not finite (0 * NaN): non-finite
    // inputs reach only the rows that see them (README, "Errors, non-finite inputs and transforms").
    if (mask.tile_needs_mask<kBlockM, kBlockN>(m0, n0)) apply_mask_rows(acc_dp, mask, m0 + warp_row0, n0, lane, 0.f);

    gemm_rc_kn<kMT, kDT, kBlockN, T>(acc_dq, acc_dp, ldsm_k_t);
    __syncthreads();  // every warp is done with K / V before the next block overwrites them
  }

  // Each warp only ever read its own rows of sQ, so it can stage dQ there
  // (once the Q load has surely landed: the loop may not have run).
  cp_async_wait<0>();
  __syncthreads();
  const bool bad = nonfinite::any_bad(acc_dq);
  store_acc<TileQ>(sQ, acc_dq, warp_row0, 0, lane, p.softmax_scale);
  // The non-finite rule (nonfinite_fixup.cuh): this warp's rows, exactly, if one holds a NaN / inf.
  if (__any_sync(0xffffffffu, bad))
    nonfinite::fix_dq_rows<TileQ, (kHeadDim + 31) / 32>(nonfinite::fixup_args(p, seq, b), h, m0, warp_row0,
                                                        Kt::kRowsPerWarp, rows, sQ, lane,
                                                        nonfinite::score_policy<kScoreMod>(p, b));
  __syncthreads();
  store_tile<TileQ, kNThreads>(gdQ, p.dq_row_stride, sQ, rows, p.head_dim, tid);
}

}  // namespace flashattn
