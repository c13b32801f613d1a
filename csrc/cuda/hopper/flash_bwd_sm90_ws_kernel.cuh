// The warp-specialized backward kernel for Hopper (sm90a): the products of
// flash_bwd_sm90_kernel (one key block a CTA, query blocks swept, every
// product on wgmma), fed by TMA and with dQ added by the TMA unit instead of
// by fp32 atomics from the consumers' registers.
//
// A CTA owns kBlockN = 128 keys of one (batch, kv head) and is three
// warpgroups:
//
//   producer warp   (warpgroup 0, warp 0): TMA loads of K and V once, then of
//                   the Q and dO blocks of each step into a ring of kStages
//                   stages (full / empty mbarriers, tma.cuh); its lanes also
//                   copy the step's lse (in log2 units) and D = rowsum(dO * O)
//                   into the stage, so the consumers read no global memory.
//   dQ writer warp  (warpgroup 0, warp 1): adds each step's dQ tile, which the
//                   consumers leave in shared memory, into the fp32 dQ
//                   accumulator with one bulk reduce-add (cp.reduce.async.bulk
//                   .add.f32) of the whole tile, kept in the accumulators'
//                   fragment order (DqFragLayout). The adds are done by the TMA
//                   unit in L2, off the consumers' path; the old kernel issued
//                   64 x head_dim atomics a step from the consumers, which
//                   bound it. (One bulk add per row measured no faster than
//                   the atomics at d64: 64 small operations a step.)
//   consumers       (warpgroups 1, 2): 64 keys each. Per step (query block m):
//                     S^T  = K_w Q^T, dP^T = V_w dO^T       (wgmma SS, async)
//                     P^T  = exp2(S^T scale_log2 - lse)      (under dP^T)
//                     dV_w += P^T dO                         (wgmma RS, async)
//                     dS^T = P^T (dP^T - D)                  (under dV)
//                     dK_w += dS^T Q                         (wgmma RS, async)
//                   (kBlockM = 128 queries a step, head dim 64: dV is issued
//                   after dS, with dK, for registers: Kt::kDvAfterDs)
//                     dS^T -> shared memory (both warpgroups), named barrier
//                     dQ_i  = dS K for this warpgroup's 64 x 64 block(s) of dQ
//                     dQ -> shared memory (fp32) for the writer warp
//                   With a single 64 x 64 dQ block (64-query steps at head dim
//                   64, FLASHATTN_BWD_D64_SHORT_STEPS=1) the consumers compute
//                   it in turns, step by step, each into its own dQ tile.
//                   (Writing a step's dQ under the next step's first products
//                   keeps a wgmma group in flight across the loop's back edge:
//                   ptxas then serializes every wgmma.)
//
// dS^T is double-buffered: writing buffer it % 2 at step it only needs both
// warpgroups to be past their dQ product of step it - 2 (waited for before the
// dS barrier of step it - 1). The writer warp frees a dQ tile as soon as the
// TMA unit has read it; where shared memory holds two (head dim 128,
// Kt::kDqDoubleBuffer) step it writes tile it % 2, so the consumers need not
// wait for the writer of step it - 1, which in the deterministic mode may
// still wait for its turn (ncu, session 7: 21% of the deterministic d128
// kernel's issue samples waited there with one tile). Head dim 64 (128-query
// steps) has room for one.
//
// Deterministic mode (p.deterministic): the key blocks of a head add their dQ
// tiles to a query block in a fixed order (descending key blocks, or without
// a mask the order of rotated sweeps: dq_wait_for_turn), each waiting for a
// per-(batch, head, 64-query block) counter; see the grid order and the
// writer warp below.
//
// Named barriers: kDsBar (the two consumers, dS complete), kDqFull (the
// consumers computing dQ arrive, the writer syncs) and kDqEmpty (the writer
// arrives, the consumers sync), kEpilogueBar (the consumers, before dK/dV
// reuse sK/sV).
//
// The masks (causal, window, the ragged key end) are those of the other
// kernels (../mask.cuh), applied to S^T and dS^T in registers; bias, dropout
// or softcap would slot in at the same place.
//
// Varlen batches (kVarlen, a separate instance so that the dense one keeps its
// registers and SASS; SeqInfo in ../../flash_params.h), as in the forward
// (flash_fwd_sm90_ws_kernel.cuh):
//   - The grid is sized by max_seqlen_k: ceil(max_seqlen_k / kBlockN) key
//     blocks per (sequence, kv head). A CTA whose key block starts past its
//     sequence's seqlen_k returns before the mbarrier set-up and the CTA-wide
//     barrier (the whole CTA decides it from the same values: nothing waits
//     for it, and it has no key to write). A sequence without queries
//     (iters = 0) still writes zero dK / dV for its keys, as a dense one does.
//   - The tensor maps describe the packed (total, heads, head_dim) tensors as
//     one batch entry of total rows: a sequence's K / V box is at row
//     k_start + n0, its Q / dO boxes at q_start + m0. A box that runs past the
//     end of its sequence reads the next sequence's rows (TMA zero-fills only
//     past the end of the packed tensor), which may hold inf / NaN. The masks
//     and lse = +inf would make P and dS zero there, but a zero operand does
//     not keep a non-finite one out of a wgmma product (0 * inf = NaN): a
//     NaN row of dO past the sequence would reach dV through P^T dO, a
//     non-finite Q row dK through dS^T Q, a non-finite K row past seqlen_k dQ
//     through dS K. So the consumers zero those rows in shared memory after
//     the TMA lands and before any product reads them: rows [keys, kBlockN)
//     of sK once (the last key block of a sequence), rows [seqlen_q - m0,
//     kBlockM) of the Q and dO stage at the last, partial query block of a
//     sequence (once a query head of the sweep); zeroing and a consumer
//     barrier (kZeroBar) cost nothing in the other steps. (V past seqlen_k
//     only reaches dP^T rows that the mask replaces by 0: not zeroed.) The
//     shared-memory tiles are then exactly those of a dense call on the
//     sequence alone, whose boxes TMA zero-fills past seqlen: dK and dV come
//     out bitwise equal to that call's (same sweep order), and the
//     non-finite recompute (../nonfinite_fixup.cuh, with the sequence's
//     SeqInfo) only sees what the sequence's own values produce.
//   - lse / D come from (heads_q, total_q) through SeqInfo::rowvec_offset; the
//     sweep and the masks use the sequence's BlockMask (seqlen_q, seqlen_k,
//     the per-sequence diagonal).
//   - dQ: the accumulator is (heads_q, total_q + batch * kBwdBlockM, cols),
//     sequence b from row q_start + b * kBwdBlockM (dq_accum_offset). A step's
//     tile is kBlockM rows x cols floats from row m0 of the sequence, in
//     DqFragLayout order: the last tile of sequence b ends before row
//     q_start + b * kBwdBlockM + seqlen_q + kBlockM - 1 < the start of b + 1
//     (kBlockM <= kBwdBlockM, cols = kHeadDim): the bulk adds of two
//     sequences never meet, and the rows past seqlen_q are padding that only
//     the zeroing and the adds touch. convert_dq_frag_kernel<Kt, true> reads
//     each sequence's rows back.
//   - dK / dV: store_tile's guarded 16-byte stores (rows < keys) at
//     k_start + n0, as for dense batches.
//   - Deterministic mode: the counters are (batch, heads_q, ceil(max_seqlen_q
//     / 64)), indexed as for a dense batch of max_seqlen_q; the add order is
//     the plain descending one (the launcher sets no rotation: the rotated
//     order's deadlock argument counts every key block of a head resident and
//     the same sweep length for all, which sequences of their own lengths do
//     not give).
#pragma once

#include "../../flash_params.h"
#include "../bwd_common.cuh"
#include "../mask_skip.cuh"
#include "../nonfinite_fixup.cuh"
#include "../score_mod.cuh"
#include "bwd_sm90_common.cuh"
#include "bwd_sm90_dq_writer.cuh"
#include "bwd_sm90_epilogue.cuh"
#include "bwd_sm90_producer.cuh"
#include "bwd_sm90_scheduler.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace flashattn {

// kMod: the score modifications the instance holds (ScoreModSet,
// ../score_mod.cuh; kFlashAttn for softcap / ALiBi, kAttnBias for torch SDPA's
// attn_mask, compiled apart as in the forward: together they spilled).
// S^T is modified before P^T is recomputed from it and dS^T takes softcap's
// derivative (recovered from P^T at the dS^T step, ../score_mod.cuh).
// The attn_mask instance skips the query blocks the mask hides outright from
// the block's keys (../mask_skip.cuh): the producer, the dQ writer and the
// consumers walk the same visible steps, and the ring, the dS^T and dQ tiles
// and their barriers count visible steps (r), not steps (it). In the
// deterministic mode the writer still takes and passes the turn of a hidden
// step, with no add.
template <typename Kt, bool kVarlen, ScoreModSet kMod = ScoreModSet::kNone>
__global__ void __launch_bounds__(Kt::kNThreads, 1)
    flash_bwd_sm90_ws_kernel(const __grid_constant__ AttnBwdParams p, const __grid_constant__ BwdTmaMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kScoreMod = kMod != ScoreModSet::kNone;
  constexpr bool kModifies = modifies_scores(kMod);  // S^T into scaled log2 units before the softmax
  constexpr bool kSkipHidden = holds_attn_bias(kMod);
  using T = typename Kt::Element;
  using TileQ = typename Kt::TileQ;
  using TileKV = typename Kt::TileKV;
  using TileDS = typename Kt::TileDS;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim;
  constexpr int kStages = Kt::kStages;
  constexpr int kConsumerThreads = 256;
  constexpr int kQSteps = kBlockM / 16;  // k-steps of dV and dK (over queries)
  constexpr int kQT = kBlockM / 8;       // n-tiles of an S^T row
  constexpr int kDT = kHeadDim / 8;      // n-tiles of a dK / dV row
  constexpr int kDqTileFloats = kBlockM * kHeadDim;
  constexpr int kDsBar = 1, kDqFull = 2, kDqEmpty = 3, kEpilogueBar = 4;
  constexpr int kZeroBar = 5;                 // varlen: the consumers, rows past the sequence zeroed in sK / sQ / sdO
  constexpr int kDqFull1 = 6, kDqEmpty1 = 7;  // the second dQ tile's pair (Kt::kDqDoubleBuffer)
  // With a single 64 x 64 dQ block (kBlockM = 64, head dim 64) the consumers
  // take turns: consumer it % 2 computes and hands over the dQ of step it.
  constexpr bool kDqAlternate = Kt::kDqAlternate;
  constexpr int kDqBarThreads = (kDqAlternate ? 128 : kConsumerThreads) + 32;
  // The dQ tile of step it, and its full / empty barriers: with two tiles in
  // turns (kDqAlternate) one pair serves both (the writer frees each tile
  // before the other consumer writes its own); double-buffered, each tile has
  // its pair, and tile it % 2 is free again once step it - 2's add has read it.
  constexpr bool kDqDoubleBuffer = Kt::kDqDoubleBuffer;
  constexpr int kDqReuse = kDqDoubleBuffer ? 2 : 1;  // a tile is written again kDqReuse steps later
  auto dq_full_bar = [](int it) { return kDqDoubleBuffer && (it & 1) ? kDqFull1 : kDqFull; };
  auto dq_empty_bar = [](int it) { return kDqDoubleBuffer && (it & 1) ? kDqEmpty1 : kDqEmpty; };

  extern __shared__ char smem_raw[];
  char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  T* sK = reinterpret_cast<T*>(smem);
  T* sV = sK + TileKV::kElems;
  T* sQ = sV + TileKV::kElems;                                      // [kStages]
  T* sdO = sQ + kStages * TileQ::kElems;                            // [kStages]
  T* sdS = sdO + kStages * TileQ::kElems;                           // [2] dS^T, [key][query]
  float* sdQ = reinterpret_cast<float*>(sdS + 2 * TileDS::kElems);  // [kDqTiles][kDqTileFloats], DqFragLayout
  float* sLse = sdQ + Kt::kDqTiles * kDqTileFloats;                 // [kStages][kBlockM], log2 units
  float* sDsum = sLse + kStages * kBlockM;                          // [kStages][kBlockM]
  uint64_t* full_kv = reinterpret_cast<uint64_t*>(sDsum + kStages * kBlockM);
  uint64_t* full_q = full_kv + 1;        // [kStages]
  uint64_t* empty_q = full_q + kStages;  // [kStages]
  // (then the attn_mask instance's bitmap of visible steps, StepBitmap)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid / 32;
  const int wg = warp / 4;
  const bool deterministic = p.deterministic;
  const BwdGridBlock grid_block = bwd_grid_block<kBlockN>(p);
  const int n_block = grid_block.n_block, b = grid_block.b, h_kv = grid_block.h_kv;
  const int ratio = p.heads_ratio();
  const int n0 = n_block * kBlockN;
  // Varlen: b is the sequence; every role returns here alike when the key
  // block starts past its seqlen_k (before any barrier; no key to write).
  const SeqInfo seq(p, b, kVarlen);
  if (kVarlen && n0 >= seq.seqlen_k) return;
  const int keys = min(kBlockN, seq.seqlen_k - n0);

  const BlockMask mask = kVarlen ? BlockMask(p, seq) : BlockMask(p);
  // TMA coordinates of a sequence's rows: (row in the sequence, batch b), or
  // (row in the packed tensor, batch 0) when varlen.
  const int k_row0 = kVarlen ? seq.k_start + n0 : n0;
  const int tma_b = kVarlen ? 0 : b;
  // The key blocks of a head start their sweeps at different query blocks
  // (spreads the dQ adds). Deterministic: by p.dq_sweep_stride (see
  // dq_wait_for_turn).
  const QuerySweep<kBlockM> sweep(mask, n0, keys, h_kv, ratio, deterministic ? n_block * p.dq_sweep_stride : n_block);
  const int iters = sweep.iters;
  auto query_block = [&](int it, int& hq, int& m0) { sweep.step(it, hq, m0); };
  // Step it's tile (its query block x this block's keys): its attn_mask summary code.
  // (By value: a lambda holding references to the kernel's locals puts them
  // on the stack.)
  auto step_hidden = [sweep, bias = &p.score_mod.bias, b, n0, last_key = n0 + keys - 1,
                      seqlen_q = mask.seqlen_q](int it) {
    int hq, m0;
    sweep.step(it, hq, m0);
    return summary_code<kBlockM, kBlockN>(*bias, b, hq, m0, min(m0 + kBlockM, seqlen_q) - 1, n0, last_key);
  };
  auto stage = [](int it) { return it % kStages; };
  auto parity = [](int it) { return uint32_t(it / kStages) & 1; };

  if (tid == 0) {
    mbar_init(full_kv, 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full_q[s], 1 + 32);  // the TMA bytes (with lane 0's arrive) + each lane's lse / D rows
      mbar_init(&empty_q[s], kConsumerThreads);
    }
    mbar_fence_init();
  }
  const auto visible = StepBitmap<kSkipHidden>::template fill<Kt::kNThreads>(
      reinterpret_cast<uint32_t*>(empty_q + kStages), iters, step_hidden, p.score_mod.bias.summary != nullptr, tid);
  __syncthreads();  // the last CTA-wide barrier: from here on the roles run apart

  if (wg == 0) {
    // ---- producer warpgroup ---------------------------------------------
    warpgroup_reg_dealloc<Kt::kProducerRegs>();
    if (warp == 0 && iters > 0) {
      // Loads.
      if (lane == 0) {
        prefetch_tensor_map(&maps.q);
        prefetch_tensor_map(&maps.dout);
        mbar_arrive_expect_tx(full_kv, 2 * Kt::kBytesKV);
#pragma unroll
        for (int pn = 0; pn < Kt::kPanels; ++pn) {
          tma_load_4d(sK + pn * TileKV::kRows * 64, &maps.k, full_kv, pn * 64, h_kv, k_row0, tma_b);
          tma_load_4d(sV + pn * TileKV::kRows * 64, &maps.v, full_kv, pn * 64, h_kv, k_row0, tma_b);
        }
      }
      StepRowVecs<kBlockM> next;  // the lse and D of step it + 1
      auto load_rowvecs = [&](int it) {
        int hq, m0;
        query_block(it, hq, m0);
        if constexpr (kVarlen) {
          next.load(p, seq, b, hq, m0, lane);
        } else {
          next.load(p, b, hq, m0, lane);
        }
      };
      int it = visible.next(0);
      if (it < iters) load_rowvecs(it);
      for (int r = 0; it < iters; ++r) {  // r: the visible steps so far
        const int s = stage(r);
        int hq, m0;
        query_block(it, hq, m0);
        mbar_wait(&empty_q[s], parity(r) ^ 1);
        if (lane == 0) {
          mbar_arrive_expect_tx(&full_q[s], 2 * Kt::kBytesQ);
#pragma unroll
          for (int pn = 0; pn < Kt::kPanels; ++pn) {
            tma_load_4d(sQ + s * TileQ::kElems + pn * TileQ::kRows * 64, &maps.q, &full_q[s], pn * 64, hq,
                        kVarlen ? seq.q_start + m0 : m0, tma_b);
            tma_load_4d(sdO + s * TileQ::kElems + pn * TileQ::kRows * 64, &maps.dout, &full_q[s], pn * 64, hq,
                        kVarlen ? seq.q_start + m0 : m0, tma_b);
          }
        }
        next.store(sLse + s * kBlockM, sDsum + s * kBlockM, lane);
        mbar_arrive(&full_q[s]);  // every lane: releases its own writes to the consumers
        const int next_it = visible.next(it + 1);
        if (next_it < iters) load_rowvecs(next_it);
        it = next_it;
      }
    } else if (warp == 1 && iters > 0) {
      // dQ writer: the consumers' dQ tile of step it into dq_accum, one row a bulk add.
      const int first = visible.next(0);
      if (first < iters) named_barrier_arrive(kDqEmpty, kDqBarThreads);  // the tile starts free
      if (kDqDoubleBuffer && first < iters && visible.next(first + 1) < iters)
        named_barrier_arrive(kDqEmpty1, kDqBarThreads);  // and the second
      // Deterministic: every step (a hidden one still takes and passes its turn).
      int r = 0;  // the visible steps so far
      for (int it = deterministic ? 0 : first; it < iters; it = deterministic ? it + 1 : visible.next(it + 1)) {
        const bool shown = visible.next(it) == it;
        int hq, m0;
        query_block(it, hq, m0);
        // Deterministic: the writer's two global round trips a step (waiting
        // for its turn, and for its add to land before passing the turn on)
        // stay off the path of the tile: the turn is awaited before the tile
        // is full, and passed on after the tile has gone back to the consumers.
        int* sem = nullptr;
        if (deterministic && lane == 0)
          sem = dq_wait_for_turn<kBlockN, kBlockM, kVarlen>(p, mask, b, hq, m0, n_block, sweep.order_index(it));
        if (shown) {
          named_barrier_sync(dq_full_bar(r), kDqBarThreads);
          float* gdq =
              static_cast<float*>(p.dq_accum_ptr) +
              (kVarlen ? dq_accum_offset(p, seq, b, hq) : b * p.dq_accum_batch_stride + hq * p.dq_accum_head_stride) +
              int64_t(m0) * p.dq_accum_row_stride;
          // One bulk add of the whole tile: the accumulator keeps each (b, h, query
          // block) in the tile's fragment order (DqFragLayout), and its rows are
          // padded to kBwdBlockM (varlen: kBwdBlockM padding rows after each
          // sequence), so the tile is one contiguous range of its own.
          if (lane == 0) {
            bulk_reduce_add_f32(gdq, sdQ + (r % Kt::kDqTiles) * kDqTileFloats, kDqTileFloats * 4);
            tma_store_commit();
            tma_store_wait_read();
          }
          __syncwarp();
          // The tile is written again kDqReuse visible steps later, if there are that many.
          int later = visible.next(it + 1);
          if (kDqReuse == 2 && later < iters) later = visible.next(later + 1);
          if (later < iters) named_barrier_arrive(dq_empty_bar(r), kDqBarThreads);
          ++r;
        }
        if (deterministic && lane == 0) dq_pass_turn(sem);
      }
      tma_store_wait_all();
    }
    return;
  }

  // ---- consumers ----------------------------------------------------------
  warpgroup_reg_alloc<Kt::kConsumerRegs>();
  const int cwg = wg - 1;  // consumer index: keys [cwg * 64, +64) of the block
  const int ctid = tid - 128;
  const int warp_in_wg = warp % 4;
  const int g = lane >> 2, t = lane & 3;
  const int wg_key0 = cwg * 64;
  const int warp_key0 = wg_key0 + warp_in_wg * 16;  // this warp's rows of S^T, dK, dV

  // Descriptors: K-major operands step 32 bytes per 16 columns inside a panel
  // and a panel per 64; N/M-major operands step 16 rows (2048 bytes) per k-step.
  constexpr uint32_t kSbo = 1024;
  const uint64_t desc_k = smem_desc(smem_u32(sK) + wg_key0 * 128, 16, kSbo);  // A of S^T (K-major)
  const uint64_t desc_v = smem_desc(smem_u32(sV) + wg_key0 * 128, 16, kSbo);  // A of dP^T
  // dQ: block i of this warpgroup is rows [dq_row0(i), +64) x columns [dq_col0(i), +64), over all keys.
  constexpr int kDqPerWg = Kt::kDqBlocksPerWg;
  auto dq_block = [&](int i) { return kDqAlternate ? 0 : cwg * kDqPerWg + i; };
  auto dq_row0 = [&](int i) { return dq_block(i) / Kt::kDqColBlocks * 64; };
  auto dq_col0 = [&](int i) { return dq_block(i) % Kt::kDqColBlocks * 64; };

  float acc_dk[1][kDT][4], acc_dv[1][kDT][4];
  clear(acc_dk);
  clear(acc_dv);
  // dQ of step it is written to shared memory under the S^T / dP^T products
  // of step it + 1 (so the tensor cores do not wait for the copy).
  float acc_dq[kDqPerWg][8][4];
  const int wg_tid = ctid % 128;
  auto write_dq = [&](int it) {
    // The dQ tile of visible step it (in turns: each consumer its own, which keeps the
    // writes of consecutive steps apart), once the writer has read it last.
    float* sdQ_own = sdQ + (kDqAlternate ? cwg : (kDqDoubleBuffer ? (it & 1) : 0)) * kDqTileFloats;
    named_barrier_sync(dq_empty_bar(it), kDqBarThreads);
#pragma unroll
    for (int i = 0; i < kDqPerWg; ++i)
#pragma unroll
      for (int di = 0; di < 8; ++di)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          *reinterpret_cast<float2*>(sdQ_own + DqFragLayout::offset(dq_block(i), di, h, wg_tid)) =
              make_float2(acc_dq[i][di][2 * h], acc_dq[i][di][2 * h + 1]);
        }
    fence_proxy_async_smem();  // the bulk reduce (async proxy) reads what st.shared wrote
    named_barrier_arrive(dq_full_bar(it), kDqBarThreads);
  };
  if (iters > 0) mbar_wait(full_kv, 0);
  if (kVarlen && iters > 0 && keys < kBlockN) zero_key_tail<TileKV, kConsumerThreads>(sK, keys, ctid, kZeroBar);

  int r = 0;  // the visible steps so far: the ring's use, the dS^T buffer, the dQ tile and turn
  for (int it = visible.next(0); it < iters; it = visible.next(it + 1), ++r) {
    const int s = stage(r);
    int hq, m0;
    query_block(it, hq, m0);
    const uint32_t q_addr = smem_u32(sQ + s * TileQ::kElems), do_addr = smem_u32(sdO + s * TileQ::kElems);
    const uint64_t desc_q = smem_desc(q_addr, 16, kSbo), desc_do = smem_desc(do_addr, 16, kSbo);  // K-major B
    const uint64_t desc_q_n = smem_desc(q_addr, Kt::kPanelQ, kSbo);                               // N-major B
    const uint64_t desc_do_n = smem_desc(do_addr, Kt::kPanelQ, kSbo);
    const float* sLses = sLse + s * kBlockM;
    const float* sDsums = sDsum + s * kBlockM;
    T* sdS_it = sdS + (r & 1) * TileDS::kElems;
    mbar_wait(&full_q[s], parity(r));
    if constexpr (kVarlen) {
      // The sequence's last, partial query block: its rows past seqlen_q are
      // the next sequence's Q / dO (see the top of the file). Both consumers
      // take this branch at the same steps (it depends on m0 only).
      const int q_rows = mask.seqlen_q - m0;
      if (q_rows < kBlockM) {
        zero_tile_rows<TileQ, kConsumerThreads>(sQ + s * TileQ::kElems, q_rows, ctid);
        zero_tile_rows<TileQ, kConsumerThreads>(sdO + s * TileQ::kElems, q_rows, ctid);
        fence_proxy_async_smem();
        named_barrier_sync(kZeroBar, kConsumerThreads);
      }
    }

    float acc_s[1][kQT][4], acc_dp[1][kQT][4];
    issue_scores_and_dp_t<Kt>(acc_s[0], acc_dp[0], desc_k, desc_v, desc_q, desc_do);
    // Dropout (the dropout-only instance; in the other score-mod instances a
    // runtime branch): the step's keep bits, drawn while the S^T / dP^T products run. dV takes Z * P (its
    // 1 / (1 - p) at the end), dS = P (Z dP / (1 - p) - D).
    KeepBitsCols<1, kQT> keep;
    const bool dropout = kMod == ScoreModSet::kDropout || (kScoreMod && p.dropout.enabled());
    if constexpr (kScoreMod) {
      if (dropout) keep = KeepBitsCols<1, kQT>(DropoutPlane(p.dropout, b, p.heads_q, hq), n0 + warp_key0, m0, lane);
    }
    wgmma_wait<1>();
    pin_registers(acc_s[0]);
    [[maybe_unused]] const ScoreModTile mod(p.score_mod, static_cast<float>(p.softmax_scale), b, hq, mask.seqlen_q,
                                            mask.seqlen_k);
    if constexpr (kModifies) apply_score_mod_cols<kMod>(acc_s, mod, n0 + warp_key0, m0, lane);
    probs_t(acc_s[0], kModifies ? 1.f : p.softmax_scale_log2, t, [&](int q) { return sLses[q]; });
    const bool needs_mask = mask.tile_needs_mask<kBlockM, kBlockN>(m0, n0);
    if (needs_mask) apply_mask_cols(acc_s, mask, n0 + warp_key0, m0, lane, 0.f);

    // dV += P^T dO (P^T as the register A operand) runs under the dS
    // arithmetic; with 128-query steps (Kt::kDvAfterDs) it is issued after it,
    // with dK: P^T's packed copy (read by the running dV product) beside both
    // fp32 tiles and dV, dK did not fit in the registers (ptxas serialized
    // every wgmma, C7512).
    uint32_t a_p[kQSteps][4], a_ds[kQSteps][4];
    auto issue_dv = [&]() {
      if (dropout) {
#pragma unroll
        for (int kk = 0; kk < kQSteps; ++kk) acc_to_a_kept<T>(a_p[kk], acc_s[0], kk, keep);
      } else {
#pragma unroll
        for (int kk = 0; kk < kQSteps; ++kk) acc_to_a<T>(a_p[kk], acc_s[0], kk);
      }
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kQSteps; ++kk)
        Wgmma<kHeadDim, T>::template rs<1>(acc_dv[0], a_p[kk], desc_add(desc_do_n, kk * 2048), 1);
      wgmma_commit();
    };
    if constexpr (!Kt::kDvAfterDs) {
      issue_dv();
      wgmma_wait<1>();  // dP^T (dV may still run)
    } else {
      wgmma_wait<0>();  // dP^T
    }
    pin_registers(acc_dp[0]);
    if (dropout) keep.apply(acc_dp, static_cast<float>(p.dropout.scale));
    ds_t(acc_dp[0], acc_s[0], sDsums, t);
    if constexpr (holds_flash_attn_mods(kMod))
      apply_softcap_grad<true>(acc_dp, acc_s, mod, n0 + warp_key0, m0, lane,
                               [&](int, int, int qi, int e) { return sLses[qi * 8 + 2 * t + e]; });
    // A masked dS is 0 even where dP - D is not finite (0 * NaN).
    if (needs_mask) apply_mask_cols(acc_dp, mask, n0 + warp_key0, m0, lane, 0.f);
    if constexpr (holds_bias_grad(kMod)) add_bias_grad_tile<true>(acc_dp, mod, n0 + warp_key0, m0, lane);
    if constexpr (Kt::kDvAfterDs) issue_dv();

      // dK += dS^T Q, dS^T as the register A operand.
#pragma unroll
    for (int kk = 0; kk < kQSteps; ++kk) acc_to_a<T>(a_ds[kk], acc_dp[0], kk);
    auto issue_dk = [&]() {
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kQSteps; ++kk)
        Wgmma<kHeadDim, T>::template rs<1>(acc_dk[0], a_ds[kk], desc_add(desc_q_n, kk * 2048), 1);
      wgmma_commit();
    };
    if constexpr (!Kt::kDqFirst) issue_dk();

    // dQ = dS K needs every key's dS: dS^T of both warpgroups through shared
    // memory, written from the packed fragments (fewer live registers than
    // acc_dp). a_ds[kk] = rows g / g + 8 of n-tiles 2kk, 2kk + 1.
    store_a_frags<TileDS>(sdS_it, a_ds, warp_key0, g, t);
    fence_proxy_async_smem();  // wgmma (async proxy) reads what st.shared wrote
    const bool dq_owner = !kDqAlternate || (r & 1) == cwg;
    if (!dq_owner) {
      named_barrier_arrive(kDsBar, kConsumerThreads);
      wgmma_wait<0>();  // dV, dK done: the Q / dO stage is free
      pin_registers(acc_dv[0]);
      pin_registers(acc_dk[0]);
      mbar_arrive(&empty_q[s]);
      continue;
    }
    named_barrier_sync(kDsBar, kConsumerThreads);
    wgmma_fence();
#pragma unroll
    for (int i = 0; i < kDqPerWg; ++i) {
      const uint64_t desc_ds =
          smem_desc(smem_u32(sdS_it) + (dq_row0(i) / 64) * Kt::kPanelDS, Kt::kPanelDS, kSbo);  // A, M-major
      const uint64_t desc_kn =
          smem_desc(smem_u32(sK) + (dq_col0(i) / 64) * Kt::kPanelKV, Kt::kPanelKV, kSbo);  // B, N-major
      // The first k-step overwrites acc_dq without reading it: the last
      // step's dQ (written out) is dead, and no register holds it across
      // the step (at 128-query steps that made ptxas serialize every wgmma
      // for lack of registers, C7512).
      Wgmma<64, T>::template ss_overwrite<1, 1>(acc_dq[i], desc_ds, desc_kn);
#pragma unroll
      for (int ks = 1; ks < kBlockN / 16; ++ks)
        Wgmma<64, T>::template ss<1, 1>(acc_dq[i], desc_add(desc_ds, ks * 2048), desc_add(desc_kn, ks * 2048), 1);
    }
    wgmma_commit();
    if constexpr (Kt::kDqFirst) {
      issue_dk();
      wgmma_wait<1>();  // dV, dQ done (dK may run)
#pragma unroll
      for (int i = 0; i < kDqPerWg; ++i) pin_registers(acc_dq[i]);
      write_dq(r);
      wgmma_wait<0>();  // dK done: the Q / dO stage is free (and a_p, a_ds)
      pin_registers(acc_dv[0]);
      pin_registers(acc_dk[0]);
      mbar_arrive(&empty_q[s]);
      continue;
    }
    wgmma_wait<1>();  // dV, dK done: the Q / dO stage is free (and a_p, a_ds)
    pin_registers(acc_dv[0]);
    pin_registers(acc_dk[0]);
    mbar_arrive(&empty_q[s]);
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < kDqPerWg; ++i) pin_registers(acc_dq[i]);
    write_dq(r);
  }

  // Epilogue: dK (scaled) and dV through sK / sV once both warpgroups are done reading them.
  // Varlen: the sequence is decoded again here (two cached loads of
  // cu_seqlens) rather than its start rows kept live through the loop.
  const SeqInfo eseq(p, b, kVarlen);
  const bool bad = nonfinite::any_bad(acc_dk) || nonfinite::any_bad(acc_dv);
  named_barrier_sync(kEpilogueBar, kConsumerThreads);
  store_acc<TileKV>(sK, acc_dk, warp_key0, 0, lane, p.softmax_scale);
  store_acc<TileKV>(sV, acc_dv, warp_key0, 0, lane,
                    kScoreMod && p.dropout.enabled() ? static_cast<float>(p.dropout.scale) : 1.f);
  // The non-finite rule (../nonfinite_fixup.cuh): this warp's 16 keys, exactly, if one holds a NaN / inf.
  if (__any_sync(0xffffffffu, bad))
    nonfinite::fix_key_rows<TileKV, (kHeadDim + 31) / 32>(nonfinite::fixup_args(p, eseq, b), h_kv, n0, warp_key0,
                                                          warp_key0 + 16, 1, keys, sK, sV, 0, kHeadDim, lane,
                                                          nonfinite::score_policy<kScoreMod>(p, b));
  named_barrier_sync(kEpilogueBar, kConsumerThreads);
  store_dk_dv<TileKV, kConsumerThreads>(p, eseq, b, h_kv, n0, keys, sK, sV, ctid);
#endif
}

}  // namespace flashattn
