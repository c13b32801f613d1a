// The warp-specialized Hopper backward for head dims 192 and 256, where the dK
// and dV of 64 keys (2 x 64 x 256 fp32) do not fit the registers of one
// warpgroup: the two consumer warpgroups split the head dim instead of the
// keys, in whole 64-column panels (an N-major wgmma operand cannot start inside
// a swizzle atom): 128 + 128 columns at 256, 128 + 64 at 192. The column
// counts below are those of head dim 256.
//
// A CTA owns kBlockN = 64 keys of one (batch, kv head) and sweeps the query
// blocks (64 queries a step) of every query head of its GQA group, like
// flash_bwd_sm90_ws_kernel.cuh, whose producer and dQ writer roles it shares:
//
//   producer warp   TMA loads of K and V once; Q (a ring of kStages) and dO
//                   (one stage: it is free once both dV products have read
//                   it, mid-step) for each step; lse (log2 units) and D in
//                   the Q stage, loaded a step ahead by its lanes.
//   dQ writer warp  adds each consumer's part of the step's dQ tile to the
//                   fp32 accumulator with one bulk reduce-add (32 KiB; lane
//                   0), the parts one after the other through one shared tile.
//   consumer 0      S^T = K Q^T (wgmma SS, all 256 columns), P^T = exp2(...),
//                   P^T to shared memory twice: fp32 (for consumer 1's dS)
//                   and 16-bit (consumer 1's dV operand);
//                   dV[:, 0:128] += P^T dO[:, 0:128] (RS, P^T from registers);
//                   then, once consumer 1 has written dS^T:
//                   dK[:, 0:128] += dS^T Q[:, 0:128], dQ[:, 0:128] = dS K[:, 0:128] (SS).
//   consumer 1      dP^T = V dO^T (SS), dS^T = P^T (dP^T - D) with P^T read
//                   in its fragment order, dS^T to shared memory;
//                   dV[:, 128:256] += P^T dO[:, 128:256] (SS),
//                   dK[:, 128:256] += dS^T Q[:, 128:256] (RS, dS^T from registers),
//                   dQ[:, 128:256] = dS K[:, 128:256] (SS).
//
// Each consumer does the same tensor work a step (one 64 x 64 x 256 product
// and three 64 x 128 x 64; at head dim 192 consumer 1's three are 64 wide), keeps 128 accumulator registers of dK / dV
// and 64 of its dQ part (consumer 1 at head dim 192: 64 and 32; each role's accumulators are sized by its own columns),
// and the elementwise work is split: exponentials on consumer 0, dS on consumer 1 (both in fp32, as in the other
// kernels).
//
// Shared memory at head dim 256: K, V 64 KiB, Q 2 x 32 KiB, dO 32 KiB, P^T
// (16-bit and fp32) and dS^T 32 KiB, the dQ part tile 32 KiB: 224 KiB, and
// lse / D (1 KiB) and 15 mbarriers.
//
// Hand-offs between the roles: a full / empty pair of mbarriers a buffer
// (tma.cuh), one phase a step, besides the Q ring's and dO's. Every thread
// that wrote the buffer (or read it, for empty) arrives itself, and the other
// side waits on the phase:
//   full_p   (0 -> 1, 128) P^T written       empty_p  (1 -> 0, 128) P^T read (dS, dV done)
//   full_ds  (1 -> 0, 128) dS^T written      empty_ds (0 -> 1, 128) dS^T read (dK, dQ done)
//   full_dq[c] (consumer c -> writer, 128) its part of the dQ tile written;
//   empty_dq[c] (writer -> consumer c, 1: lane 0, once the bulk add issued
//   before it has read the tile): the shared dQ tile goes consumer 0, writer,
//   consumer 1, writer, ...
// These were named barriers used as arrive (one side) -> sync (the other):
// ordered by the PTX memory model, but compute-sanitizer's racecheck does not
// credit arrive-only ordering and reported 80 hazards (session 5). It follows
// an mbarrier's arrive -> wait when the thread that wrote is the one that
// arrives (the producer's lse / D copy is handed over that way), hence the
// per-thread counts: racecheck reports none since (session 6). The one named
// barrier left is
// kEpilogueBar (both consumers sync, before dK / dV reuse sK / sV).
//
// Deterministic mode: as in flash_bwd_sm90_ws_kernel.cuh (key blocks add in
// the order their sweeps reach a query block, behind per-(batch, head,
// 64-query block) counters; the counter is released after both parts have
// landed).
//
// Varlen batches (kVarlen): as in flash_bwd_sm90_ws_kernel.cuh (see its top
// comment: packed tensor maps, the early exit of key blocks past the
// sequence, rows past the sequence zeroed in shared memory, the dQ layout).
// Here Q and dO have separate full barriers and the consumers wait on them at
// different points of a step, so at the sequence's last, partial query block
// both consumers wait for both at the top of the step, zero their share of
// the rows past seqlen_q and meet at kZeroBar before any product. This cannot
// block: each consumer reaches the top of step it having finished step it - 1
// (its empty_do / empty_q arrives included), which is all the producer needs
// to load Q and dO of step it.
#pragma once

#include <type_traits>

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

// P^T of a warpgroup's accumulator (kQT n-tiles x 4 floats a thread) in
// shared memory in the accumulators' own order, so that the thread of the
// other consumer holding the same (key, query) elements of dP^T reads them
// back: [float4 index][thread of the warpgroup], conflict-free both ways.
struct PFragLayout {
  __device__ __forceinline__ static int offset(int i, int wg_tid) { return (i * 128 + wg_tid) * 4; }
};

// kMod: the score modifications the instance holds (ScoreModSet,
// ../score_mod.cuh, as flash_bwd_sm90_ws_kernel): consumer 0 modifies S^T
// before recomputing P^T, and hands consumer 1 P^T * (1 - t^2) (softcap's
// derivative) in fp32 for its dS^T, P^T itself in 16 bits for dV.
// The attn_mask instance skips the query blocks the mask hides outright, as
// flash_bwd_sm90_ws_kernel does: every role walks the visible steps (`step`,
// the sweep's index) and counts them (`it`, which the ring and the hand-off
// barriers' phases follow); the deterministic writer passes a hidden step's
// turn on without an add.
template <typename Kt, bool kVarlen, ScoreModSet kMod = ScoreModSet::kNone>
__global__ void __launch_bounds__(Kt::kNThreads, 1)
    flash_bwd_sm90_ws_split_kernel(const __grid_constant__ AttnBwdParams p, const __grid_constant__ BwdTmaMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kScoreMod = kMod != ScoreModSet::kNone;
  constexpr bool kModifies = modifies_scores(kMod);  // S^T into scaled log2 units before the softmax
  constexpr bool kSkipHidden = holds_attn_bias(kMod);
  using T = typename Kt::Element;
  using TileQ = typename Kt::TileQ;
  using TileKV = typename Kt::TileKV;
  using TileDS = typename Kt::TileDS;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN;
  // Consumer c owns columns [c * kCols0, c * kCols0 + kCols(c)) of dK, dV, dQ:
  // whole 64-column panels, 128 / 128 at head dim 256, 128 / 64 at 192.
  constexpr int kCols0 = Kt::kCols0, kCols1 = Kt::kCols1;
  constexpr int kStages = Kt::kStages;
  constexpr int kConsumerThreads = 256;
  constexpr int kQSteps = kBlockM / 16;  // k-steps of dV and dK (over queries)
  constexpr int kKSteps = kBlockN / 16;  // k-steps of dQ (over keys)
  constexpr int kQT = kBlockM / 8;       // n-tiles of an S^T row
  constexpr int kDqPart0Floats = kBlockM * kCols0, kDqPart1Floats = kBlockM * kCols1;
  constexpr int kWgThreads = 128;
  constexpr int kEpilogueBar = 1;  // both consumers sync on it
  constexpr int kZeroBar = 2;      // varlen: both consumers sync, rows past the sequence zeroed
  static_assert(kBlockN == 64 && kBlockM == 64, "one warpgroup's M is the CTA's 64 keys");

  extern __shared__ char smem_raw[];
  char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  T* sK = reinterpret_cast<T*>(smem);
  T* sV = sK + TileKV::kElems;
  T* sQ = sV + TileKV::kElems;                                  // [kStages]
  T* sdO = sQ + kStages * TileQ::kElems;                        // one stage
  T* sP = sdO + TileQ::kElems;                                  // P^T, [key][query]
  T* sdS = sP + TileDS::kElems;                                 // dS^T, [key][query]
  float* sPf = reinterpret_cast<float*>(sdS + TileDS::kElems);  // P^T fp32, PFragLayout
  float* sdQ = sPf + TileDS::kElems;                            // a dQ half, DqFragLayout
  float* sLse = sdQ + kDqPart0Floats;                           // [kStages][kBlockM], log2 units
  float* sDsum = sLse + kStages * kBlockM;                      // [kStages][kBlockM]
  uint64_t* full_kv = reinterpret_cast<uint64_t*>(sDsum + kStages * kBlockM);
  uint64_t* full_do = full_kv + 1;
  uint64_t* empty_do = full_do + 1;
  uint64_t* full_q = empty_do + 1;       // [kStages]
  uint64_t* empty_q = full_q + kStages;  // [kStages]
  // The hand-offs between the roles (see the top of the file), one phase a step each.
  uint64_t* full_p = empty_q + kStages;  // consumer 0 -> 1: P^T (fp32 and 16-bit) written
  uint64_t* empty_p = full_p + 1;        // consumer 1 -> 0: P^T read
  uint64_t* full_ds = empty_p + 1;       // consumer 1 -> 0: dS^T written
  uint64_t* empty_ds = full_ds + 1;      // consumer 0 -> 1: dS^T read
  uint64_t* full_dq = empty_ds + 1;      // [2] consumer c -> writer: part c of the dQ tile written
  uint64_t* empty_dq = full_dq + 2;      // [2] writer -> consumer c: the tile is free for part c
  // (then the attn_mask instance's bitmap of visible steps, StepBitmap)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid / 32;
  const int wg = warp / 4;
  const bool deterministic = p.deterministic;
  const BwdGridBlock grid_block = bwd_grid_block<kBlockN>(p);  // 64 keys a CTA here
  const int n_block = grid_block.n_block, b = grid_block.b, h_kv = grid_block.h_kv;
  const int ratio = p.heads_ratio();
  const int n0 = n_block * kBlockN;
  // Varlen: b is the sequence; every role returns here alike when the key
  // block starts past its seqlen_k (before any barrier; no key to write).
  const SeqInfo seq(p, b, kVarlen);
  if (kVarlen && n0 >= seq.seqlen_k) return;
  const int keys = min(kBlockN, seq.seqlen_k - n0);

  const BlockMask mask = kVarlen ? BlockMask(p, seq) : BlockMask(p);
  // TMA coordinates: (row in the sequence, batch b), or (row in the packed tensor, batch 0) when varlen.
  const int k_row0 = kVarlen ? seq.k_start + n0 : n0;
  const int tma_b = kVarlen ? 0 : b;
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
    mbar_init(full_do, 1);
    mbar_init(empty_do, kConsumerThreads);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full_q[s], 1 + 32);  // the TMA bytes (with lane 0's arrive) + each lane's lse / D rows
      mbar_init(&empty_q[s], kConsumerThreads);
    }
    // Every thread that wrote (or read) the buffer arrives itself: one consumer
    // warpgroup, or the writer thread that issued the bulk add once the TMA unit
    // has read the tile.
    mbar_init(full_p, kWgThreads);
    mbar_init(empty_p, kWgThreads);
    mbar_init(full_ds, kWgThreads);
    mbar_init(empty_ds, kWgThreads);
    for (int c = 0; c < 2; ++c) {
      mbar_init(&full_dq[c], kWgThreads);
      mbar_init(&empty_dq[c], 1);
    }
    mbar_fence_init();
  }
  const auto visible = StepBitmap<kSkipHidden>::template fill<Kt::kNThreads>(
      reinterpret_cast<uint32_t*>(empty_dq + 2), iters, step_hidden, p.score_mod.bias.summary != nullptr, tid);
  __syncthreads();  // the last CTA-wide barrier: from here on the roles run apart

  if (wg == 0) {
    // ---- producer warpgroup ---------------------------------------------
    warpgroup_reg_dealloc<Kt::kProducerRegs>();
    if (warp == 0 && iters > 0) {
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
      int step = visible.next(0);
      if (step < iters) load_rowvecs(step);
      for (int it = 0; step < iters; ++it) {  // it: the visible steps so far
        const int s = stage(it);
        int hq, m0;
        query_block(step, hq, m0);
        mbar_wait(&empty_q[s], parity(it) ^ 1);
        if (lane == 0) {
          mbar_arrive_expect_tx(&full_q[s], Kt::kBytesQ);
#pragma unroll
          for (int pn = 0; pn < Kt::kPanels; ++pn)
            tma_load_4d(sQ + s * TileQ::kElems + pn * TileQ::kRows * 64, &maps.q, &full_q[s], pn * 64, hq,
                        kVarlen ? seq.q_start + m0 : m0, tma_b);
        }
        next.store(sLse + s * kBlockM, sDsum + s * kBlockM, lane);
        mbar_arrive(&full_q[s]);  // every lane: releases its own writes to the consumers
        // dO has one stage: free once both consumers' dV of the previous step is done.
        mbar_wait(empty_do, (uint32_t(it) & 1) ^ 1);
        if (lane == 0) {
          mbar_arrive_expect_tx(full_do, Kt::kBytesQ);
#pragma unroll
          for (int pn = 0; pn < Kt::kPanels; ++pn)
            tma_load_4d(sdO + pn * TileQ::kRows * 64, &maps.dout, full_do, pn * 64, hq, kVarlen ? seq.q_start + m0 : m0,
                        tma_b);
        }
        const int next_step = visible.next(step + 1);
        if (next_step < iters) load_rowvecs(next_step);
        step = next_step;
      }
    } else if (warp == 1 && iters > 0) {
      // dQ writer: the two parts of each step's dQ tile, consumer 0's then
      // consumer 1's, through the one shared tile. Lane 0 issues the bulk adds
      // and, once the TMA unit has read the tile, hands it on with its own
      // arrive (empty_dq counts that one thread); the other lanes only wait.
      int it = 0;  // the visible steps so far
      // Deterministic: every step (a hidden one still takes and passes its turn).
      for (int step = deterministic ? 0 : visible.next(0); step < iters;
           step = deterministic ? step + 1 : visible.next(step + 1)) {
        int hq, m0;
        query_block(step, hq, m0);
        if (visible.next(step) != step) {  // hidden (deterministic mode only)
          if (lane == 0)
            dq_pass_turn(
                dq_wait_for_turn<kBlockN, kBlockM, kVarlen>(p, mask, b, hq, m0, n_block, sweep.order_index(step)));
          __syncwarp();
          continue;
        }
        // (Varlen: the sequence's own accumulator rows, dq_accum_offset.)
        float* gdq =
            static_cast<float*>(p.dq_accum_ptr) +
            (kVarlen ? dq_accum_offset(p, seq, b, hq) : b * p.dq_accum_batch_stride + hq * p.dq_accum_head_stride) +
            int64_t(m0) * p.dq_accum_row_stride;
        // Deterministic: the turn is awaited once the first part is full and
        // passed on (both parts landed) before the tile goes back to consumer 0.
        // (Awaiting it before the tile is full and passing it after the tile
        // is back, as flash_bwd_sm90_ws_kernel.cuh does, measured 18% slower
        // here: d256 4k 251 against 309 TFLOP/s, session 6 visits 2-3.)
        int* sem = nullptr;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          mbar_wait(&full_dq[half], uint32_t(it) & 1);
          if (lane == 0) {
            if (deterministic && half == 0)
              sem = dq_wait_for_turn<kBlockN, kBlockM, kVarlen>(p, mask, b, hq, m0, n_block, sweep.order_index(step));
            bulk_reduce_add_f32(gdq + half * kDqPart0Floats, sdQ, (half == 0 ? kDqPart0Floats : kDqPart1Floats) * 4);
            tma_store_commit();
            if (deterministic && half == 1) {
              dq_pass_turn(sem);  // both parts have landed (so the tile has been read)
            } else {
              tma_store_wait_read();
            }
            // The other consumer's part may overwrite the tile: consumer 1's of
            // this step, consumer 0's of the next (the last step's arrive on
            // empty_dq[0] has no waiter).
            mbar_arrive(&empty_dq[half ^ 1]);
          }
          __syncwarp();  // no lane falls a phase of full_dq behind
        }
        ++it;
      }
      tma_store_wait_all();
    }
    return;
  }

  // ---- consumers ----------------------------------------------------------
  warpgroup_reg_alloc<Kt::kConsumerRegs>();
  const int cwg = wg - 1;  // 0: S^T, P^T; 1: dP^T, dS^T (and their columns of dK, dV, dQ)
  const int ctid = tid - 128;
  const int wg_tid = ctid % 128;
  const int warp_in_wg = warp % 4;
  const int g = lane >> 2, t = lane & 3;
  const int warp_key0 = warp_in_wg * 16;  // this warp's rows of S^T, dP^T, dK, dV

  constexpr uint32_t kSbo = 1024;
  // K-major A of S^T / dP^T over the head dim; K-major A of dV / dK over the
  // queries (one 64-column panel: P^T and dS^T); M-major A of dQ (dS from dS^T).
  const uint64_t desc_k = smem_desc(smem_u32(sK), 16, kSbo);
  const uint64_t desc_v = smem_desc(smem_u32(sV), 16, kSbo);
  const uint64_t desc_p = smem_desc(smem_u32(sP), 16, kSbo);
  const uint64_t desc_ds = smem_desc(smem_u32(sdS), 16, kSbo);
  const uint64_t desc_ds_m = smem_desc(smem_u32(sdS), Kt::kPanelDS, kSbo);

  if (iters > 0) mbar_wait(full_kv, 0);
  if (kVarlen && iters > 0 && keys < kBlockN) zero_key_tail<TileKV, kConsumerThreads>(sK, keys, ctid, kZeroBar);

  // Dropout lives in the score-mod instances (a runtime branch): the generator of head hq's plane.
  const bool dropout = kMod == ScoreModSet::kDropout || (kScoreMod && p.dropout.enabled());
  auto dropout_of = [&](int hq) { return DropoutPlane(p.dropout, b, p.heads_q, hq); };

  // One consumer's whole path, instantiated per role (kRole = cwg) so that each
  // has accumulators of its own column count: with one set sized for consumer
  // 0 (consumer 1 using its first n-tiles) the unused upper halves stayed live
  // in consumer 1's path and ptxas serialized the wgmmas at head dim 192 (C7511).
  auto consumer = [&](auto role) -> bool {
    constexpr int kRole = decltype(role)::value;
    constexpr int kCols = kRole == 0 ? kCols0 : kCols1;  // this consumer's columns of dK, dV, dQ
    constexpr int kCol0 = kRole * kCols0;                // ... starting here (whole 64-column panels)
    constexpr int kT = kCols / 8;                        // their n-tiles
    constexpr uint32_t kPanel0 = kCol0 / 64;
    // N-major B of dQ: this consumer's columns of K, 16 keys (2048 bytes) a k-step.
    const uint64_t desc_k_n = smem_desc(smem_u32(sK) + kPanel0 * Kt::kPanelKV, Kt::kPanelKV, kSbo);
    const uint32_t do_cols = smem_u32(sdO) + kPanel0 * Kt::kPanelQ;

    float acc_dk[1][kT][4], acc_dv[1][kT][4], acc_dq[kT][4];
    clear(acc_dk);
    clear(acc_dv);

    // P^T and dS^T are single buffers, one phase of their full / empty barriers
    // a step: the consumer writing at step it waits for parity (it & 1) ^ 1 of
    // empty (the reader's release of step it - 1; a fresh barrier passes), the
    // reading one for parity it & 1 of full.
    // The dQ tile: the writer frees it for consumer 1 after reading consumer
    // 0's part of step it (phase it of empty_dq[1]) and for consumer 0 after
    // reading consumer 1's part of step it - 1 (phase it - 1 of empty_dq[0]; the
    // first wait, on parity 1 of a fresh barrier, passes: the tile starts free).
    auto hand_over_dq = [&](int it) {
      mbar_wait(&empty_dq[kRole], (uint32_t(it) & 1) ^ uint32_t(kRole == 0));
#pragma unroll
      for (int ni = 0; ni < kT; ++ni)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          *reinterpret_cast<float2*>(sdQ + DqFragLayout::offset(ni / 8, ni % 8, h, wg_tid)) =
              make_float2(acc_dq[ni][2 * h], acc_dq[ni][2 * h + 1]);
      fence_proxy_async_smem();      // the bulk reduce (async proxy) reads what st.shared wrote
      mbar_arrive(&full_dq[kRole]);  // every thread: releases its own writes to the writer
    };
    // This consumer's columns of dQ = dS K[:, cols] (SS: dS M-major from dS^T, K N-major).
    auto issue_dq = [&]() {
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks)
        Wgmma<kCols, T>::template ss<1, 1>(acc_dq, desc_add(desc_ds_m, ks * 2048), desc_add(desc_k_n, ks * 2048),
                                           ks > 0);
    };

    // step: the sweep's index; it: the visible steps so far (the phases of the ring and the hand-offs).
    for (int step = visible.next(0), it = 0; step < iters; step = visible.next(step + 1), ++it) {
      const int s = stage(it);
      int hq, m0;
      query_block(step, hq, m0);
      const uint32_t q_addr = smem_u32(sQ + s * TileQ::kElems);
      const uint64_t desc_q_n = smem_desc(q_addr + kPanel0 * Kt::kPanelQ, Kt::kPanelQ, kSbo);  // B of dK, N-major
      const uint64_t desc_do_n = smem_desc(do_cols, Kt::kPanelQ, kSbo);                        // B of dV, N-major
      const bool needs_mask = mask.tile_needs_mask<kBlockM, kBlockN>(m0, n0);
      mbar_wait(&full_q[s], parity(it));
      if constexpr (kVarlen) {
        // The sequence's last, partial query block (both consumers alike, by
        // m0): rows past seqlen_q of the Q stage and of dO are the next
        // sequence's; see the top of the file for why waiting for dO here is safe.
        const int q_rows = mask.seqlen_q - m0;
        if (q_rows < kBlockM) {
          mbar_wait(full_do, uint32_t(it) & 1);
          zero_tile_rows<TileQ, kConsumerThreads>(sQ + s * TileQ::kElems, q_rows, ctid);
          zero_tile_rows<TileQ, kConsumerThreads>(sdO, q_rows, ctid);
          fence_proxy_async_smem();
          named_barrier_sync(kZeroBar, kConsumerThreads);
        }
      }

      float acc_x[1][kQT][4];  // consumer 0: S^T then P^T; consumer 1: dP^T then dS^T
      if constexpr (kRole == 0) {
        // ---- consumer 0: S^T, P^T, dV (RS), then dK, dQ (SS) ----
        wgmma_fence();
        issue_kmajor_product<TileKV, TileQ, T>(acc_x[0], desc_k, smem_desc(q_addr, 16, kSbo));
        wgmma_commit();
        // Dropout (score-mod instances, a runtime branch): the keep bits, drawn
        // under the product; the 16-bit P^T (both consumers' dV operand) is
        // Z * P, the fp32 one (consumer 1's dS) P itself.
        KeepBitsCols<1, kQT> keep;
        if (dropout) keep = KeepBitsCols<1, kQT>(dropout_of(hq), n0 + warp_key0, m0, lane);
        wgmma_wait<0>();
        pin_registers(acc_x[0]);
        const float* sLses = sLse + s * kBlockM;
        [[maybe_unused]] const ScoreModTile mod(p.score_mod, static_cast<float>(p.softmax_scale), b, hq, mask.seqlen_q,
                                                mask.seqlen_k);
        if constexpr (kModifies) apply_score_mod_cols<kMod>(acc_x, mod, n0 + warp_key0, m0, lane);
        probs_t(acc_x[0], kModifies ? 1.f : p.softmax_scale_log2, t, [&](int q) { return sLses[q]; });
        if (needs_mask) apply_mask_cols(acc_x, mask, n0 + warp_key0, m0, lane, 0.f);
        uint32_t a_p[kQSteps][4];
        if (dropout) {
#pragma unroll
          for (int kk = 0; kk < kQSteps; ++kk) acc_to_a_kept<T>(a_p[kk], acc_x[0], kk, keep);
        } else {
#pragma unroll
          for (int kk = 0; kk < kQSteps; ++kk) acc_to_a<T>(a_p[kk], acc_x[0], kk);
        }
        if constexpr (holds_flash_attn_mods(kMod))  // P^T (1 - t^2) in place (a_p keeps P^T for dV)
          apply_softcap_grad<true>(acc_x, acc_x, mod, n0 + warp_key0, m0, lane,
                                   [&](int, int, int qi, int e) { return sLses[qi * 8 + 2 * t + e]; });

        // P^T to consumer 1: fp32 for its dS, 16-bit for its dV.
        mbar_wait(empty_p, (uint32_t(it) & 1) ^ 1);
#pragma unroll
        for (int i = 0; i < kQT; ++i)
          *reinterpret_cast<float4*>(sPf + PFragLayout::offset(i, wg_tid)) =
              make_float4(acc_x[0][i][0], acc_x[0][i][1], acc_x[0][i][2], acc_x[0][i][3]);
        store_a_frags<TileDS>(sP, a_p, warp_key0, g, t);
        fence_proxy_async_smem();  // consumer 1's wgmma (async proxy) reads sP
        mbar_arrive(full_p);       // every thread: releases its own writes to consumer 1

        mbar_wait(full_do, uint32_t(it) & 1);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kQSteps; ++kk)
          Wgmma<kCols, T>::template rs<1>(acc_dv[0], a_p[kk], desc_add(desc_do_n, kk * 2048), 1);
        wgmma_commit();

        mbar_wait(full_ds, uint32_t(it) & 1);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kQSteps; ++kk)
          Wgmma<kCols, T>::template ss<0, 1>(acc_dk[0], desc_add(desc_ds, kk * 32), desc_add(desc_q_n, kk * 2048), 1);
        issue_dq();
        wgmma_commit();
        wgmma_wait<1>();  // dV done: dO (and a_p) free
        pin_registers(acc_dv[0]);
        mbar_arrive(empty_do);
        wgmma_wait<0>();  // dK, dQ done: Q and dS^T free
        pin_registers(acc_dk[0]);
        pin_registers(acc_dq);
        mbar_arrive(&empty_q[s]);
        mbar_arrive(empty_ds);
      } else {
        // ---- consumer 1: dP^T, dS^T, then dV (SS), dK (RS), dQ (SS) ----
        mbar_wait(full_do, uint32_t(it) & 1);
        wgmma_fence();
        issue_kmajor_product<TileKV, TileQ, T>(acc_x[0], desc_v, smem_desc(smem_u32(sdO), 16, kSbo));
        wgmma_commit();
        KeepBitsCols<1, kQT> keep;  // dropout: drawn under the product, as consumer 0 draws them
        if (dropout) keep = KeepBitsCols<1, kQT>(dropout_of(hq), n0 + warp_key0, m0, lane);
        wgmma_wait<0>();
        pin_registers(acc_x[0]);
        if (dropout) keep.apply(acc_x, static_cast<float>(p.dropout.scale));

        mbar_wait(full_p, uint32_t(it) & 1);
        float p_t[kQT][4];
#pragma unroll
        for (int i = 0; i < kQT; ++i) {
          const float4 v = *reinterpret_cast<const float4*>(sPf + PFragLayout::offset(i, wg_tid));
          p_t[i][0] = v.x, p_t[i][1] = v.y, p_t[i][2] = v.z, p_t[i][3] = v.w;
        }
        ds_t(acc_x[0], p_t, sDsum + s * kBlockM, t);
        // A masked dS is 0 even where dP - D is not finite (0 * NaN).
        if (needs_mask) apply_mask_cols(acc_x, mask, n0 + warp_key0, m0, lane, 0.f);
        if constexpr (holds_bias_grad(kMod))
          add_bias_grad_tile<true>(acc_x, ScoreModTile(p.score_mod, 0.f, b, hq, mask.seqlen_q, mask.seqlen_k),
                                   n0 + warp_key0, m0, lane);
        uint32_t a_ds[kQSteps][4];
#pragma unroll
        for (int kk = 0; kk < kQSteps; ++kk) acc_to_a<T>(a_ds[kk], acc_x[0], kk);

        // dS^T to consumer 0 (its dK and dQ operand; this consumer's dQ reads it too).
        mbar_wait(empty_ds, (uint32_t(it) & 1) ^ 1);
        store_a_frags<TileDS>(sdS, a_ds, warp_key0, g, t);
        fence_proxy_async_smem();
        mbar_arrive(full_ds);  // every thread: releases its own writes to consumer 0

        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kQSteps; ++kk)
          Wgmma<kCols, T>::template ss<0, 1>(acc_dv[0], desc_add(desc_p, kk * 32), desc_add(desc_do_n, kk * 2048), 1);
#pragma unroll
        for (int kk = 0; kk < kQSteps; ++kk)
          Wgmma<kCols, T>::template rs<1>(acc_dk[0], a_ds[kk], desc_add(desc_q_n, kk * 2048), 1);
        wgmma_commit();
        wgmma_fence();
        issue_dq();
        wgmma_commit();
        wgmma_wait<1>();  // dV, dK done: P^T, dO, Q (and a_ds) free
        pin_registers(acc_dv[0]);
        pin_registers(acc_dk[0]);
        mbar_arrive(empty_do);
        mbar_arrive(&empty_q[s]);
        mbar_arrive(empty_p);  // the fp32 P^T was read long before, sP by the dV wgmma
        wgmma_wait<0>();       // dQ done
        pin_registers(acc_dq);
      }
      hand_over_dq(it);
    }

    // Epilogue: this consumer's columns of dK (scaled) and dV through sK / sV
    // once both consumers are done reading them; returns whether one is not finite.
    const bool bad = nonfinite::any_bad(acc_dk) || nonfinite::any_bad(acc_dv);
    named_barrier_sync(kEpilogueBar, kConsumerThreads);
    store_acc<TileKV>(sK, acc_dk, warp_key0, kCol0, lane, p.softmax_scale);
    store_acc<TileKV>(sV, acc_dv, warp_key0, kCol0, lane, dropout ? static_cast<float>(p.dropout.scale) : 1.f);
    return bad;
  };
  const bool bad = cwg == 0 ? consumer(std::integral_constant<int, 0>{}) : consumer(std::integral_constant<int, 1>{});
  // The non-finite rule (../nonfinite_fixup.cuh): this warp's 16 keys over this
  // consumer's columns, exactly, if one holds a NaN / inf. (One call for both
  // roles: a second call site of the out-of-line fix-up cost a spilled stack
  // address at head dim 256.)
  // Varlen: the sequence decoded again (its start rows not kept live through the loop).
  const SeqInfo eseq(p, b, kVarlen);
  const int col0 = cwg * kCols0, cols = cwg == 0 ? kCols0 : kCols1;
  if (__any_sync(0xffffffffu, bad))
    nonfinite::fix_key_rows<TileKV, (Kt::kHeadDim + 31) / 32>(nonfinite::fixup_args(p, eseq, b), h_kv, n0, warp_key0,
                                                              warp_key0 + 16, 1, keys, sK, sV, col0, col0 + cols, lane,
                                                              nonfinite::score_policy<kScoreMod>(p, b));
  named_barrier_sync(kEpilogueBar, kConsumerThreads);

  store_dk_dv<TileKV, kConsumerThreads>(p, eseq, b, h_kv, n0, keys, sK, sV, ctid);
#endif
}

}  // namespace flashattn
