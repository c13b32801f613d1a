// The warp-specialized forward kernel for Hopper (sm90a): FlashAttention-3's
// structure on this project's tiles.
//
// A CTA owns kBlockM = 64 * kConsumers query rows of one (batch, head) and is
// kConsumers + 1 warpgroups:
//
//   producer  (warpgroup 0, one thread): TMA loads of Q once, then of K and V
//             block by block into a ring of kStages stages, each guarded by a
//             full / empty mbarrier pair (tma.cuh). It gives its registers
//             away (setmaxnreg) to the consumers. (A paged KV cache: the
//             whole warpgroup issues the page-sized TMA loads,
//             fwd_sm90_producer.cuh.)
//   scheduler (warpgroup 0, warp 1, one thread): the CTA's tiles, static or
//             dynamic, handed to the producer and the consumers through a
//             mailbox in shared memory (tile_scheduler.cuh).
//   consumers (warpgroups 1..kConsumers): 64 query rows each, O and the
//             softmax statistics in registers. Per key block j:
//               issue S_{j+1} = Q K_{j+1}^T and O += P_j V_j   (wgmma, async)
//               wait S_{j+1}; release K_{j+1}; softmax of S_{j+1} (under P_j V_j)
//               wait P_j V_j; release V_j; O *= correction_{j+1}
//             Two named barriers per consumer order the GEMM issue between
//             warpgroups round robin ("ping-pong"): while one warpgroup runs
//             its exponentials, the tensor cores run the other's GEMMs.
//   epilogue  each consumer normalizes its O rows, writes them into its own
//             rows of an O tile in shared memory and one thread stores them
//             with a TMA store; rows past seqlen_q and columns past head_dim
//             are clipped by the TMA unit.
//
// The kernel is persistent (tile_scheduler.cuh): a CTA runs tile after tile,
// and the K/V ring and the ping-pong turns carry on from one tile to the next.
// Q is released as soon as a tile's last S GEMM has read it, so the producer
// loads the next tile's Q and first K/V blocks under the current tile's last
// P V and epilogue. Where shared memory has no room for a separate O tile
// (head dim 256), O is staged in the Q tile and Q is released after the store.
//
// Key blocks are visited last first, so the blocks that need element masking
// (causal diagonal, the ragged end of the keys) come first. The per-element
// mask, the skipped blocks and the CTA order are those of the other kernels
// (../mask.cuh); masks, bias or dropout slot in at softmax_step, where S is in
// registers with known (row, key) coordinates. The attn_mask instance also
// skips the key blocks the mask hides outright (../mask_skip.cuh: producer and
// consumers walk the same visible steps; ring use n is the CTA's n-th visible
// block).
//
// Varlen batches (kVarlen, a separate instance so that the dense one keeps its
// registers; see SeqInfo in ../../flash_params.h) run the same pipeline:
//   - The tensor maps describe the packed (total, heads, head_dim) tensors as
//     one batch entry of total rows, so a sequence's tile is the box at row
//     q_start + m0 (k_start + n0) of batch 0. A box that runs past the end of
//     its sequence reads the next sequence's rows (zeros past the last one):
//     keys past seqlen_k are cut by the mask of the last key block, which
//     BlockMask(p, seq) flags (tile_needs_mask: n0 + kBlockN > seqlen_k) and
//     fills with -inf whatever S holds there, so P is exactly 0 on them; query
//     rows past seqlen_q are computed and never stored. A non-finite V row of
//     the next sequence still makes 0 * inf = NaN in P V: the epilogue's
//     non-finite check then recomputes the row exactly over the keys it sees
//     (nonfinite_fixup.cuh, with the sequence's SeqInfo), as it does for a
//     masked non-finite V of a dense batch.
//   - The scheduler hands out ceil(max_seqlen_q / kBlockM) query-block ranks
//     per (batch, head); a rank past the sequence's query blocks has rows = 0
//     and every role skips it (tile_scheduler.cuh). Nothing else differs
//     between the roles: the same tiles, the same key blocks, so the ring and
//     ping-pong phases stay matched.
//   - The O store: the TMA store box of a consumer (64 rows) that runs past
//     its sequence would write the next sequence's rows, so a consumer whose
//     rows end inside its 64 stores them from the staged tile itself (16-byte
//     stores, guarded by the row count); full boxes keep the TMA store. lse
//     goes to (heads_q, total_q) through SeqInfo::rowvec_offset.
//   - V past the sequence's keys is not zeroed in shared memory: both
//     consumers read the V stage, so zeroing it needs a hand-off between
//     them (their writing the same zeros each was tried and dropped: a race
//     on the stage, session 6). Non-finite values there go through the exact
//     recompute above (slow only when such values are present).
//
// Dense batches with seqused_k (per-entry key lengths; the KV-cache prefill of
// flash_attn_with_kvcache) run the kVarlen instance over the dense tensor
// maps: SeqInfo gives entry b seqused_k[b] keys, its bottom-right diagonal and
// start rows 0, so the tiles are the dense ones (batch coordinate b, the
// O box clipped by the map at seqlen_q as in a dense batch: TMA stores only),
// the keys past seqused_k[b] (the cache's unused slots, which may hold
// anything) are cut by the mask of the last key block (a non-finite V there:
// the recompute, as above), and lse keeps the dense (batch, heads_q, seqlen_q)
// layout.
#pragma once
//
// The roles, each in its own header (this file composes them: the barrier
// set-up, the role split, the consumers' tile and key-block loops):
//   fwd_sm90_common.cuh    the tensor maps, the shared-memory carve-up, a
//                          tile's TMA coordinates, the ring's stage / parity
//   fwd_sm90_producer.cuh  the producer (TMA loads of Q, K, V; mbarriers)
//   fwd_sm90_mainloop.cuh  the S / P V GEMM issue and the ping-pong turns
//                          (FwdSm90Mainloop), and FwdSm90ScoreStep, the score
//                          processing of one key block (mask, softmax step):
//                          the hook for compile-time score modifications
//   tile_scheduler.cuh     the persistent tile order and the scheduler role
// Each step of this split was checked SASS-identical (tools/sass_compare.sh).

#include "../../flash_params.h"
#include "../mask.cuh"
#include "../mask_skip.cuh"
#include "../nonfinite_fixup.cuh"
#include "../softmax.cuh"
#include "../tile.cuh"
#include "fwd_sm90_common.cuh"
#include "fwd_sm90_epilogue.cuh"
#include "fwd_sm90_mainloop.cuh"
#include "fwd_sm90_producer.cuh"
#include "tile_scheduler.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace flashattn {

// kMod: the instance for calls with flash-attn's softcap / ALiBi
// (ScoreModSet::kFlashAttn) or torch SDPA's attn_mask (kAttnBias; a 16-bit
// float mask read through shared memory, kAttnBiasStaged), apart so
// that neither pays the other's registers (FwdSm90ScoreStep; the epilogue's
// lse is then in the modified scores' units and the non-finite recompute
// applies the score mod too).
// kMaskSteps: the steps the element mask may cut (../mask.cuh). kFirst (dense
// calls for which BlockMask::masks_first_step_only holds: every call without
// a diagonal, and causal square tiles whose diagonal starts on a block
// boundary): the mask only in a tile's first step, which runs before the
// loop; the loop's steps hold no mask code (the plain dense instance's
// default where the rule admits the call, flash_launch.cuh). kAny:
// tile_needs_mask at every step (windows, odd diagonals, score mods, varlen).
template <typename Kt, bool kVarlen, ScoreModSet kMod = ScoreModSet::kNone, MaskSteps kMaskSteps = MaskSteps::kAny>
__global__ void __launch_bounds__(Kt::kNThreads, 1)
    flash_fwd_sm90_ws_kernel(const __grid_constant__ AttnFwdParams p, const __grid_constant__ FwdTmaMaps maps,
                             const FwdSchedule sched) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kScoreMod = kMod != ScoreModSet::kNone;
  constexpr bool kModifies = modifies_scores(kMod);             // S into scaled log2 units before the softmax
  constexpr bool kDropoutOnly = kMod == ScoreModSet::kDropout;  // keep bits drawn under the S GEMM
  constexpr bool kSkipHidden = holds_attn_bias(kMod);           // key blocks the attn_mask hides (../mask_skip.cuh)
  using T = typename Kt::Element;
  using TileQ = typename Kt::TileQ;
  using TileKV = typename Kt::TileKV;
  using Tile = FwdTile<Kt::kBlockM, kVarlen>;
  constexpr int kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim;
  constexpr int kStages = Kt::kStages, kConsumers = Kt::kConsumers;
  constexpr int kNT = kBlockN / 8;       // n-tiles of a row of S
  constexpr int kDT = kHeadDim / 8;      // n-tiles of a row of O
  constexpr int kPingPongThreads = 256;  // one warpgroup syncs, the previous one arrives
  constexpr int kPingPongBar = 1;        // named barriers 1 .. kConsumers

  extern __shared__ char smem_raw[];
  const FwdSm90Smem<Kt> sm(smem_raw);
  uint64_t* const full_k = sm.full_k;
  uint64_t* const empty_k = sm.empty_k;
  uint64_t* const full_v = sm.full_v;
  uint64_t* const empty_v = sm.empty_v;
  uint64_t* const full_q = sm.full_q;
  uint64_t* const empty_q = sm.empty_q;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid / 32;
  const int wg = warp / 4;
  const BlockMask mask(p);
  // A tile's mask: the batch's, or its sequence's (lengths, diagonal) when varlen.
  auto mask_of = [&](const Tile& tl) {
    if constexpr (kVarlen) {
      return BlockMask(p, tl.seq);
    } else {
      return mask;
    }
  };
  // TMA coordinates of a tile's rows: (row in the sequence, batch b), or
  // (row in the packed tensor, batch 0) when varlen (seqused_k: start rows 0,
  // batch b).
  // Use n of ring slot s (n counts the K or V blocks loaded so far) waits for parity n & 1.
  auto stage = [](int it) { return it % kStages; };
  auto parity = [](int it) { return uint32_t(it / kStages) & 1; };

  // (The attn_mask instance: the whole warp, for its lookups of hidden
  // blocks; a paged call: the whole warpgroup, for its TMA issue.)
  const bool paged = kVarlen && p.kv.paged();
  const int producer_threads = paged ? 128 : (kSkipHidden ? 32 : 1);
  if (tid == 0) {
    // The tile mailbox's readers: every consumer thread and the producer's
    // (a paged call's but its leader, which finds the tiles itself).
    sm.tiles.init(kConsumers * 128 + producer_threads - (paged ? 1 : 0));
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full_k[s], 1);
      mbar_init(&full_v[s], 1);
      mbar_init(&empty_k[s], kConsumers * 128);
      mbar_init(&empty_v[s], kConsumers * 128);
    }
    mbar_init(full_q, 1);
    mbar_init(empty_q, kConsumers);  // one thread of each consumer
    mbar_fence_init();
  }
  __syncthreads();  // the last CTA-wide barrier: from here on the roles run apart

  if (wg == 0) {
    // ---- producer -------------------------------------------------------
    warpgroup_reg_dealloc<Kt::kProducerRegs>();
    if (tid < producer_threads)
      fwd_sm90_producer<Kt, kVarlen, kSkipHidden>(p, maps, sched, mask, sm, paged ? tid : lane);
    else if (!paged && tid == 32)
      fwd_tile_scheduler<kVarlen>(sched, sm.tiles);
    return;
  }

  // ---- consumers ----------------------------------------------------------
  warpgroup_reg_alloc<Kt::kConsumerRegs>();
  const int cwg = wg - 1;                             // consumer index
  const int ctid = tid - 128;                         // thread index among the consumers
  const int warp_row0 = cwg * 64 + (warp % 4) * 16;   // this warp's 16 rows of the block
  const bool elected = (warp % 4 == 0) && lane == 0;  // issues this consumer's stores and releases

  using Mainloop = FwdSm90Mainloop<Kt, kVarlen>;
  const uint64_t desc_q = Mainloop::q_descriptor(sm, cwg);
  float acc_o[1][kDT][4];
  const Mainloop mainloop{sm, cwg, desc_q, acc_o};
  // With a score mod the scores reach the softmax scaled, in log2 units.
  const bool positive_scale = kModifies || p.softmax_scale > 0.f;
  // (kAttnBiasStaged) the mask goes through this consumer's tile of shared memory.
  using ScoreStep = FwdSm90ScoreStep<Kt, kMod>;
  const FwdBiasStage<Kt> bias_stage{sm.bias_tiles + cwg * FwdBiasStage<Kt>::kBytes, fwd_consumer_bar<Kt>(cwg),
                                    ctid & 127};

  if (Kt::kPingPong && cwg == kConsumers - 1) named_barrier_arrive(kPingPongBar, kPingPongThreads);
  int it0 = 0, q_iter = 0;
  FwdTiles tiles(sm.tiles);
  for (;;) {
    const int tile = tiles.next();
    if (tile >= sched.num_tiles) break;
    const Tile tl(p, sched, tile);
    if (kVarlen && tl.rows <= 0) continue;  // past its sequence's query blocks (the producer skips it too)
    const int m0 = tl.m0;
    const BlockMask tmask = mask_of(tl);
    int n_min, n_max;
    tmask.key_block_range<kBlockN>(m0, tl.rows, n_min, n_max);
    const int blocks = n_max - n_min;  // step j visits key block n_max - 1 - j
    // The steps the producer loads (all of them without an attn_mask): the
    // first one looked up here (whether the tile has one at all), the rest
    // as the producer publishes them with each K stage (scores_done).
    int step = blocks > 0 ? visible_key_steps<Kt::kBlockM, kBlockN, kSkipHidden>(p.score_mod.bias, tl.b, tl.h, m0,
                                                                                 tl.rows, n_max, tmask.seqlen_k, blocks)
                                .next_warp(0)
                          : blocks;
    if (step >= blocks) {
      store_unseeing_query_block<T>(p, tl.seq, tl.b, tl.h, m0, tl.rows, ctid, kConsumers * 128);
      continue;
    }

    OnlineSoftmax<1> softmax;
    const ScoreStep softmax_step{p,    tmask,          softmax, m0,   n_max,      warp_row0,
                                 lane, positive_scale, tl.b,    tl.h, &bias_stage};
    if constexpr (ScoreStep::kStagedBias) softmax_step.request_bias(step);
    // (kDropoutOnly) The tile's generator, and the keep bits of the block whose S is in flight.
    const DropoutPlane plane = kDropoutOnly ? DropoutPlane(p.dropout, tl.b, p.heads_q, tl.h) : DropoutPlane{};
    KeepBitsRows<kNT> keep;
    // After S of ring use i (step j) has completed: K is free, and the tile's
    // last S frees Q for the next tile. Returns the visible step after j
    // (>= blocks: none) and sets `code` to j's summary code, both read from
    // the stage before it is released.
    int code = kMaskMixed;
    auto scores_done = [&](int i, int j) {
      int after = j + 1;
      if constexpr (kSkipHidden) {
        const int packed = sm.next_step[stage(it0 + i)];
        after = FwdSm90Smem<Kt>::next_of(packed);
        code = FwdSm90Smem<Kt>::code_of(packed);
      }
      mbar_arrive(&empty_k[stage(it0 + i)]);
      if (Kt::kSeparateO && after >= blocks && elected) mbar_arrive(empty_q);
      return after;
    };

    clear(acc_o);
    float acc_s[1][kNT][4];
    float correction[1][2];
    mbar_wait(full_q, q_iter & 1);

    // The first visible block and its softmax (O is zero: no rescale).
    mbar_wait(&full_k[stage(it0)], parity(it0));
    mainloop.turn_begin();
    wgmma_fence();
    mainloop.issue_scores(acc_s, it0);
    mainloop.turn_end();
    if constexpr (kDropoutOnly) keep = softmax_step.draw_keep_bits(plane, step);
    wgmma_wait<0>();
    pin_registers(acc_s[0]);
    int next = scores_done(0, step);
    softmax_step(acc_s, step, correction, code, next < blocks ? next : -1, &keep);

    int i = 0;  // ring use it0 + i: the current block
    for (; next < blocks; ++i) {
      // P_i packed into A fragments frees acc_s for S_{i+1}.
      uint32_t a_p[kBlockN / 16][4];
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) acc_to_a<T>(a_p[kk], acc_s[0], kk);
      mbar_wait(&full_k[stage(it0 + i + 1)], parity(it0 + i + 1));
      mbar_wait(&full_v[stage(it0 + i)], parity(it0 + i));
      mainloop.turn_begin();
      wgmma_fence();
      mainloop.issue_scores(acc_s, it0 + i + 1);
      mainloop.issue_pv(a_p, it0 + i);
      mainloop.turn_end();
      if constexpr (kDropoutOnly) keep = softmax_step.draw_keep_bits(plane, next);  // (no hidden blocks: next is known)
      wgmma_wait<1>();
      pin_registers(acc_s[0]);
      const int step_s = next;
      next = scores_done(i + 1, step_s);
      softmax_step.template step<kMaskSteps == MaskSteps::kAny>(acc_s, step_s, correction, code,
                                                                next < blocks ? next : -1, &keep);
      wgmma_wait<0>();
      pin_registers(acc_o[0]);
      mbar_arrive(&empty_v[stage(it0 + i)]);
      OnlineSoftmax<1>::rescale(acc_o, correction);
    }
    {  // The last block: P V only.
      uint32_t a_p[kBlockN / 16][4];
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) acc_to_a<T>(a_p[kk], acc_s[0], kk);
      mbar_wait(&full_v[stage(it0 + i)], parity(it0 + i));
      mainloop.turn_begin();
      wgmma_fence();
      mainloop.issue_pv(a_p, it0 + i);
      mainloop.turn_end();
      wgmma_wait<0>();
      pin_registers(acc_o[0]);
      mbar_arrive(&empty_v[stage(it0 + i)]);
    }

    // ---- epilogue -----------------------------------------------------------
    // Varlen: the tile is decoded again here (integer operations and two
    // cached loads of cu_seqlens) instead of kept live through the key-block
    // loop, where its fields made the d256 instance spill in every step
    // (ptxas -v: 40 bytes; none in the loop this way). Dense: the same tile.
    const Tile et = kVarlen ? Tile(p, sched, tile) : tl;
    float row_lse[1][2];
    softmax.finalize(acc_o, kModifies ? 1.f : p.softmax_scale_log2, positive_scale, row_lse,
                     kScoreMod && p.dropout.enabled() ? static_cast<float>(p.dropout.scale) : 1.f);
    const bool bad = nonfinite::any_bad(acc_o);
    fwd_sm90_epilogue<Kt, kVarlen, kScoreMod>(p, maps, sm, et, m0, acc_o, row_lse, bad, cwg, warp_row0, lane, tid,
                                              elected);
    it0 += i + 1;
    ++q_iter;
  }
  if (cwg == 0) mainloop.turn_begin();  // the last consumer's final arrive
  if (elected) tma_store_wait_all();
#endif
}

}  // namespace flashattn
