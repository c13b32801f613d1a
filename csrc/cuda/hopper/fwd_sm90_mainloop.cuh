// The consumers' key-block loop of the warp-specialized Hopper forward
// (flash_fwd_sm90_ws_kernel.cuh): the S and P V GEMM issue, the ping-pong
// turns that order it between consumer warpgroups, and the score processing
// of a key block (mask, online softmax step). The kernel's key-block loop
// composes them (left there: as a function of this struct it compiled to
// different register allocation, see tools/sass_compare.sh).
#pragma once

#include "../dropout.cuh"
#include "../dropout_keep_bits.cuh"
#include "../score_mod.cuh"
#include "../softmax.cuh"
#include "../tile.cuh"
#include "fwd_sm90_bias_stage.cuh"
#include "fwd_sm90_common.cuh"
#include "wgmma.cuh"

namespace flashattn {

// The score processing of one key block, S in registers with known (row, key)
// coordinates: the element mask where the block needs it, then the online
// softmax step (which yields the correction of O). This is the hook for
// per-element score modifications (a compile-time policy such as softcap or
// ALiBi, masks, bias, dropout): they go here, between the S GEMM and the
// softmax; dropout after it, on P (the row sums, and so the lse, are the
// softmax's; O is scaled by 1 / (1 - p) at the end). kMod: the score
// modifications the instance holds
// (ScoreModSet, ../score_mod.cuh: flash-attn's softcap / ALiBi, or torch
// SDPA's attn_mask, each its own instance here), S
// modified into scaled log2 units before the mask (the softmax then runs its
// positive-scale path with scale 1; the plain instance holds no such code).
// kStagedBias (ScoreModSet::kAttnBiasStaged): the mask is read from the
// consumer's shared-memory tile (`staged`), requested one visible step ahead.
// kDropoutOnly (ScoreModSet::kDropout): S as in the plain instance, and P's
// keep bits drawn by the caller before it waits for S (`keep`).
template <typename Kt, ScoreModSet kMod = ScoreModSet::kNone>
struct FwdSm90ScoreStep {
  static constexpr bool kScoreMod = kMod != ScoreModSet::kNone;
  static constexpr bool kModifies = modifies_scores(kMod);
  static constexpr bool kStagedBias = kMod == ScoreModSet::kAttnBiasStaged;
  static constexpr bool kDropoutOnly = kMod == ScoreModSet::kDropout;
  static_assert(!kStagedBias || Kt::kBiasStageFits, "the mask tiles fit in shared memory");
  static constexpr int kNT = Kt::kBlockN / 8;  // n-tiles of a row of S
  const AttnFwdParams& p;
  const BlockMask& tmask;
  OnlineSoftmax<1>& softmax;
  const int& m0;
  const int& n_max;
  const int& warp_row0;
  const int& lane;
  const bool& positive_scale;
  int b, h;                                  // the tile's batch entry and query head (the score mod's slope)
  const FwdBiasStage<Kt>* staged = nullptr;  // (kStagedBias) the consumer's mask tile

  // Requests the mask tile of step j (key block n_max - 1 - j) for this consumer's 64 rows.
  __device__ __forceinline__ void request_bias(int j) const {
    const AttnBias& a = p.score_mod.bias;
    staged->request(a.plane(b, h), a.row_stride, m0 + (warp_row0 & ~63), tmask.seqlen_q - 1,
                    (n_max - 1 - j) * Kt::kBlockN, tmask.seqlen_k);
  }

  // Step j visits key block n_max - 1 - j. block_code: the attn_mask's
  // summary code of the whole block where the caller knows it
  // (kMaskIdentity: no lookup), else kMaskMixed. kMayMask false: a step the
  // mask cannot cut (MaskSteps::kFirst after the first step), no mask code.
  // next: the visible step after j (a staged mask requests it; < 0: none).
  // keep: (kDropoutOnly) the block's keep bits (draw_keep_bits).
  template <bool kMayMask = true>
  __device__ __forceinline__ void step(float (&acc_s)[1][kNT][4], int j, float (&correction)[1][2],
                                       int block_code = kMaskMixed, int next = -1,
                                       const KeepBitsRows<kNT>* keep = nullptr) const {
    const int n0 = (n_max - 1 - j) * Kt::kBlockN;
    if constexpr (kModifies) {
      ScoreModTile mod(p.score_mod, static_cast<float>(p.softmax_scale), b, h, tmask.seqlen_q, tmask.seqlen_k);
      mod.known_code = block_code;
      if constexpr (kStagedBias) {
        staged->wait();
        staged->apply(acc_s, mod, warp_row0 & 63, m0 + warp_row0, n0, lane);
        staged->release();
        if (next >= 0) request_bias(next);
      } else {
        apply_score_mod_rows<kMod>(acc_s, mod, m0 + warp_row0, n0, lane);
      }
    }
    if (kMayMask && tmask.template tile_needs_mask<Kt::kBlockM, Kt::kBlockN>(m0, n0))
      apply_mask_rows(acc_s, tmask, m0 + warp_row0, n0, lane);
    if (positive_scale) {
      softmax.template softmax_rows<true, Kt::kPolyExpEvery>(acc_s, kModifies ? 1.f : p.softmax_scale_log2, correction);
    } else {
      softmax.template softmax_rows<false, Kt::kPolyExpEvery>(acc_s, kModifies ? 1.f : p.softmax_scale_log2,
                                                              correction);
    }
    // Dropout: the dropout-only instance's bits were drawn under the S GEMM;
    // the other score-mod instances draw them here (a runtime branch: the
    // plain instance holds none of it).
    if constexpr (kDropoutOnly) {
      keep->apply(acc_s, 1.f);
    } else if constexpr (kScoreMod) {
      if (p.dropout.enabled())
        apply_dropout_rows(acc_s, DropoutPlane(p.dropout, b, p.heads_q, h), m0 + warp_row0, n0, lane, 1.f);
    }
  }
  // (kDropoutOnly) The keep bits of step j's key block for this warp's rows.
  __device__ __forceinline__ KeepBitsRows<kNT> draw_keep_bits(const DropoutPlane& plane, int j) const {
    return KeepBitsRows<kNT>(plane, m0 + warp_row0, (n_max - 1 - j) * Kt::kBlockN, lane);
  }
  __device__ __forceinline__ void operator()(float (&acc_s)[1][kNT][4], int j, float (&correction)[1][2],
                                             int block_code = kMaskMixed, int next = -1,
                                             const KeepBitsRows<kNT>* keep = nullptr) const {
    step<true>(acc_s, j, correction, block_code, next, keep);
  }
};

template <typename Kt, bool kVarlen>
struct FwdSm90Mainloop {
  using T = typename Kt::Element;
  using TileQ = typename Kt::TileQ;
  using TileKV = typename Kt::TileKV;
  using C = FwdSm90Coords<Kt, kVarlen>;
  static constexpr int kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim, kConsumers = Kt::kConsumers;
  static constexpr int kNT = kBlockN / 8;             // n-tiles of a row of S
  static constexpr int kDT = kHeadDim / 8;            // n-tiles of a row of O
  static constexpr int kPanelQ = TileQ::kRows * 128;  // bytes of one 64-column panel
  static constexpr int kPanelKV = TileKV::kRows * 128;
  static constexpr uint32_t kSbo = 1024;
  static constexpr int kPingPongThreads = 256;  // one warpgroup syncs, the previous one arrives
  static constexpr int kPingPongBar = 1;        // named barriers 1 .. kConsumers

  const FwdSm90Smem<Kt>& sm;
  const int& cwg;
  const uint64_t& desc_q;
  float (&acc_o)[1][kDT][4];

  // Ping-pong: consumer c issues its GEMMs after syncing on barrier c, then
  // lets consumer c + 1 go. The last consumer opens the first turn, and
  // consumer 0 takes the one turn left open at the end.
  // (Without ping-pong, Kt::kPingPong false: no turns.)
  __device__ __forceinline__ void turn_begin() const {
    if constexpr (Kt::kPingPong) named_barrier_sync(kPingPongBar + cwg, kPingPongThreads);
  }
  __device__ __forceinline__ void turn_end() const {
    if constexpr (Kt::kPingPong) named_barrier_arrive(kPingPongBar + (cwg + 1) % kConsumers, kPingPongThreads);
  }

  // Q: A of S, K-major, this consumer's 64 rows. K: B of S, K-major.
  // V: B of P V, N-major (keys are the contraction, 16 rows = 2048 bytes a step).
  static __device__ __forceinline__ uint64_t q_descriptor(const FwdSm90Smem<Kt>& sm, int cwg) {
    return smem_desc(smem_u32(sm.sQ) + cwg * 64 * 128, 16, kSbo);
  }
  __device__ __forceinline__ void issue_scores(float (&acc_s)[1][kNT][4], int it) const {
    const uint64_t dk = smem_desc(smem_u32(sm.sK + C::stage(it) * TileKV::kElems), 16, kSbo);
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks)
      Wgmma<kBlockN, T>::template ss<0, 0>(acc_s[0], desc_add(desc_q, kmajor_step(ks, kPanelQ)),
                                           desc_add(dk, kmajor_step(ks, kPanelKV)), ks > 0);
    wgmma_commit();
  }
  __device__ __forceinline__ void issue_pv(const uint32_t (&a_p)[kBlockN / 16][4], int it) const {
    const uint64_t dv = smem_desc(smem_u32(sm.sV + C::stage(it) * TileKV::kElems), kPanelKV, kSbo);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      Wgmma<kHeadDim, T>::template rs<1>(acc_o[0], a_p[kk], desc_add(dv, kk * 2048), 1);
    wgmma_commit();
  }
};

}  // namespace flashattn
