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
#include "tma.cuh"
#include "wgmma.cuh"

namespace flashattn {

// The tensor maps of one backward call (tma_host.h): q, k, v, dO as 4-D
// (head_dim, heads, seqlen, batch) tensors read in 64-column boxes.
struct BwdTmaMaps {
  CUtensorMap q, k, v, dout;
};

// The order of a dQ tile's fp32 values in shared memory and in the
// accumulator: [64 x 64 block][n-tile di][row half h][thread of the
// warpgroup][2], the order the wgmma accumulators come out in. A warp's
// stores are then 256 contiguous bytes (no bank conflicts), and the tile is
// one contiguous range for a single bulk add. convert_dq_frag_kernel maps it
// back to rows and columns.
struct DqFragLayout {
  __device__ __forceinline__ static int offset(int block, int di, int h, int wg_tid) {
    return block * 4096 + ((di * 2 + h) * 128 + wg_tid) * 2;
  }
};

// ---- pieces the two warp-specialized backward kernels share ----------------
// (this one and flash_bwd_sm90_ws_split_kernel.cuh)

// The key block a CTA owns: (batch or sequence b, kv head, key block). The
// key blocks of a head are neighbours in the grid: their Q / dO reads meet in
// L2. (Causal CTAs launched heaviest first across all heads, key block
// slowest, measured 5-11% slower: the L2 reuse is worth more than the shorter
// tail.) Deterministic: the key blocks of a head wait for each other's dQ
// adds. With plain sweeps (descending order) a CTA then only waits for ones
// launched before it (CTAs start in blockIdx order): the last key block of a
// head goes first. Rotated sweeps wait in a cycle, so the launcher rotates
// only when a head's key blocks are at most half the SMs (they are then
// resident together). The grid has ceil(seqlen_k / kBlockN) key blocks a
// (b, kv head) (varlen: max_seqlen_k's).
struct BwdGridBlock {
  int n_block, b, h_kv;
};

template <int kBlockN>
__device__ __forceinline__ BwdGridBlock bwd_grid_block(const AttnBwdParams& p) {
  const int num_n_blocks = ceil_div(p.seqlen_k, kBlockN);
  const int n_block =
      static_cast<int>(p.deterministic ? num_n_blocks - 1 - blockIdx.x % num_n_blocks : blockIdx.x % num_n_blocks);
  const int bh = static_cast<int>(blockIdx.x / num_n_blocks);
  return {n_block, bh / p.heads_kv, bh % p.heads_kv};
}

// The lse (log2 units) and D of a step's kBlockM query rows, kBlockM / 32 a
// lane of the producer warp, loaded one step ahead so that their latency is not
// on the path. Rows past seqlen_q: lse +inf makes P (and so dS, dV, dK, dQ) zero.
template <int kBlockM>
struct StepRowVecs {
  static constexpr int kRowsPerLane = kBlockM / 32;
  float lse[kRowsPerLane], dsum[kRowsPerLane];

  __device__ __forceinline__ void load(const AttnBwdParams& p, int b, int hq, int m0, int lane) {
    const int64_t vec = (int64_t(b) * p.heads_q + hq) * p.seqlen_q + m0;
#pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i) {
      const int r = lane + 32 * i;
      const bool in = m0 + r < p.seqlen_q;
      lse[i] = in ? lse_to_log2(static_cast<const float*>(p.lse_ptr)[vec + r]) : INFINITY;
      dsum[i] = in ? static_cast<const float*>(p.dsum_ptr)[vec + r] : 0.f;
    }
  }
  // Varlen: the sequence's rows of (heads_q, total_q) (SeqInfo); rows past its seqlen_q as above.
  __device__ __forceinline__ void load(const AttnBwdParams& p, const SeqInfo& seq, int b, int hq, int m0, int lane) {
    const int64_t vec = seq.rowvec_offset(p, b, hq) + m0;
#pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i) {
      const int r = lane + 32 * i;
      const bool in = m0 + r < seq.seqlen_q;
      lse[i] = in ? lse_to_log2(static_cast<const float*>(p.lse_ptr)[vec + r]) : INFINITY;
      dsum[i] = in ? static_cast<const float*>(p.dsum_ptr)[vec + r] : 0.f;
    }
  }
  // Into the stage's vectors (kBlockM floats each).
  __device__ __forceinline__ void store(float* stage_lse, float* stage_dsum, int lane) const {
#pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i) {
      stage_lse[lane + 32 * i] = lse[i];
      stage_dsum[lane + 32 * i] = dsum[i];
    }
  }
};

// Deterministic mode: the key blocks of a head add their dQ for a query block
// in a fixed order, the order in which their sweeps reach it when they run at
// the same pace. Plain sweeps (every key block starts at the first query
// block; masked calls, where key block n's first query block grows with n):
// descending key blocks. Rotated sweeps (p.dq_sweep_stride = S > 0, no mask:
// key block n starts S * n steps in): the query block of order index j is
// reached first by key block n_top = min(N - 1, j / S), then n_top - 1, ..., 0,
// N - 1, ..., n_top + 1, each S steps after the one before. Without the
// rotation every key block of a head meets the others at every query block
// from the first step on, and the fixed order builds a wavefront (key block n
// starts N - 1 - n add latencies late: 10-30% slower, NOTES question 9).
// Waits (acquire) until the key blocks before n_block in that order have added
// theirs; returns the counter to pass on.
// Varlen (kVarlen): `mask` is the sequence's, whose seqlen_q bounds the query
// block's rows; the counters are laid out for max_seqlen_q (p.seqlen_q).
template <int kBlockN, int kBlockM, bool kVarlen = false>
__device__ __forceinline__ int* dq_wait_for_turn(const AttnBwdParams& p, const BlockMask& mask, int b, int hq, int m0,
                                                 int n_block, int order_index) {
  int n_lo, n_hi;
  mask.key_block_range<kBlockN>(m0, min(kBlockM, (kVarlen ? mask.seqlen_q : p.seqlen_q) - m0), n_lo, n_hi);
  int* sem = p.dq_semaphore_ptr + (int64_t(b) * p.heads_q + hq) * ceil_div(p.seqlen_q, 64) + m0 / 64;
  int before = n_hi - 1 - n_block;
  if (p.dq_sweep_stride > 0) {  // no mask: n_lo = 0, n_hi = N
    const int n_top = min(n_hi - 1, order_index / p.dq_sweep_stride);
    before = (n_top - n_block + n_hi) % n_hi;
  }
  while (ld_acquire_gpu(sem) != before) {
  }
  fence_proxy_async();  // the adds that follow (async proxy) come after the acquire
  return sem;
}

// ... and once this key block's adds (committed bulk operations) have landed in
// global memory, passes the turn on (release).
__device__ __forceinline__ void dq_pass_turn(int* sem) {
  tma_store_wait_all();
  fence_proxy_async();
  red_release_gpu_add(sem, 1);
}

// Varlen: zeroes rows [row_lo, Tile::kRows) of a swizzled shared-memory tile
// (all of each row's 16-byte chunks, so the swizzle does not matter), with
// kNThreads threads numbered tid. The caller fences (fence_proxy_async_smem:
// wgmma reads the tile next) and syncs its threads.
template <typename Tile, int kNThreads, typename T>
__device__ __forceinline__ void zero_tile_rows(T* tile, int row_lo, int tid) {
  constexpr int kChunks = Tile::kCols / 8;
  for (int i = row_lo * kChunks + tid; i < Tile::kRows * kChunks; i += kNThreads)
    *reinterpret_cast<uint4*>(tile + Tile::offset(i / kChunks, (i % kChunks) * 8)) = make_uint4(0, 0, 0, 0);
}

// Varlen, the last key block of a sequence: rows [keys, kBlockN) of sK are the
// next sequence's keys and dQ = dS K reads every row (see the top of the
// file): the kNThreads consumer threads zero them once, before any product,
// and meet at zero_bar.
template <typename TileKV, int kNThreads, typename T>
__device__ __forceinline__ void zero_key_tail(T* sK, int keys, int tid, int zero_bar) {
  zero_tile_rows<TileKV, kNThreads>(sK, keys, tid);
  fence_proxy_async_smem();  // wgmma (async proxy) reads what st.shared wrote
  named_barrier_sync(zero_bar, kNThreads);
}

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
    // Dropout (in the score-mod instances, a runtime branch): the step's keep
    // bits, drawn while the S^T / dP^T products run. dV takes Z * P (its
    // 1 / (1 - p) at the end), dS = P (Z dP / (1 - p) - D).
    KeepBitsCols<1, kQT> keep;
    const bool dropout = kScoreMod && p.dropout.enabled();
    if constexpr (kScoreMod) {
      if (dropout) keep = KeepBitsCols<1, kQT>(DropoutPlane(p.dropout, b, p.heads_q, hq), n0 + warp_key0, m0, lane);
    }
    wgmma_wait<1>();
    pin_registers(acc_s[0]);
    [[maybe_unused]] const ScoreModTile mod(p.score_mod, static_cast<float>(p.softmax_scale), b, hq, mask.seqlen_q,
                                            mask.seqlen_k);
    if constexpr (kScoreMod) apply_score_mod_cols<kMod>(acc_s, mod, n0 + warp_key0, m0, lane);
    probs_t(acc_s[0], kScoreMod ? 1.f : p.softmax_scale_log2, t, [&](int q) { return sLses[q]; });
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
  T* gdK = static_cast<T*>(p.dk_ptr) + eseq.k_offset(p.dk_batch_stride, p.dk_row_stride, b) + h_kv * p.dk_head_stride +
           n0 * p.dk_row_stride;
  T* gdV = static_cast<T*>(p.dv_ptr) + eseq.k_offset(p.dv_batch_stride, p.dv_row_stride, b) + h_kv * p.dv_head_stride +
           n0 * p.dv_row_stride;
  store_tile<TileKV, kConsumerThreads>(gdK, p.dk_row_stride, sK, keys, p.head_dim, ctid);
  store_tile<TileKV, kConsumerThreads>(gdV, p.dv_row_stride, sV, keys, p.head_dim, ctid);
#endif
}

// The fp32 accumulator's 8 floats that hold columns [8 di, 8 di + 8) of row r of
// 64 x 64 block `block`: pairs of the accumulator threads (w, g, t = 0..3).
__device__ __forceinline__ const float4* dq_frag_chunk(const float* acc, int block, int r, int di) {
  const int w = r / 16, hh = (r / 8) % 2, g = r % 8;
  return reinterpret_cast<const float4*>(acc + DqFragLayout::offset(block, di, hh, w * 32 + g * 4));
}

__device__ __forceinline__ bool any_bad8(float4 x, float4 y) {
  using nonfinite::is_bad;
  return is_bad(x.x) || is_bad(x.y) || is_bad(x.z) || is_bad(x.w) || is_bad(y.x) || is_bad(y.y) || is_bad(y.z) ||
         is_bad(y.w);
}

// The slow path of convert_dq_frag_kernel (../nonfinite_fixup.cuh), whole
// warp, after its normal stores: the rows of this warp's chunks that hold a
// NaN / inf, recomputed exactly over the block's 64 columns.
template <typename Kt, bool kVarlen>
__device__ FLASHATTN_NONFINITE_SLOW void fix_dq_frag_rows(AttnBwdParams p, const float* acc, int block, int row_base,
                                                          int c_lo, int b, int h, int thr) {
  using T = typename Kt::Element;
  const int lane = thr % 32;
  const SeqInfo seq(p, b, kVarlen);
  for (int u = 0; u < 64 * 8 / 128; ++u) {
    const int r = (thr + 128 * u) / 8, di = (thr + 128 * u) % 8;
    bool bad = false;
    if (row_base + r < seq.seqlen_q && c_lo + di * 8 < p.head_dim) {
      const float4* src = dq_frag_chunk(acc, block, r, di);
      bad = any_bad8(src[0], src[1]);
    }
    for (int q = 0; q < 4; ++q) {  // the warp's 4 rows of this unit: lanes 8q .. 8q + 7
      const int row = row_base + ((thr - lane) + 128 * u) / 8 + q;
      if (!__any_sync(0xffffffffu, bad && lane / 8 == q) || row >= seq.seqlen_q) continue;
      T* dq = static_cast<T*>(p.dq_ptr) + seq.q_offset(p.dq_batch_stride, p.dq_row_stride, b) + h * p.dq_head_stride +
              int64_t(row) * p.dq_row_stride;
      // (One conversion kernel serves both instances: the score mod is a runtime property here.)
      if (p.score_mod.any() || p.dropout.enabled()) {
        nonfinite::fix_dq_row_global<(Kt::kHeadDim + 31) / 32, T>(nonfinite::fixup_args(p, seq, b), h, row, dq, c_lo,
                                                                  c_lo + 64, lane, nonfinite::ModScore(p, b));
      } else {
        nonfinite::fix_dq_row_global<(Kt::kHeadDim + 31) / 32, T>(nonfinite::fixup_args(p, seq, b), h, row, dq, c_lo,
                                                                  c_lo + 64, lane);
      }
    }
  }
}

// dq[b, i, h, :] = scale * the accumulator, read in DqFragLayout order: one
// CTA of 128 threads per 64 x 64 block of a (query block, head, batch). A
// thread converts 8 consecutive columns of a row at a time: in DqFragLayout
// they are 8 consecutive floats (4 threads' pairs), so it reads 32 bytes and
// writes 16, and 8 neighbouring threads write a row's 128 contiguous bytes.
// (At most 64 registers: see convert_dq_kernel.)
//
// Varlen (kVarlen): the grid covers ceil(max_seqlen_q / kBlockM) query blocks
// a (sequence, head); a CTA whose query block starts past its sequence's
// seqlen_q returns (the whole CTA: no vote is left half-taken). The tile of
// query block mb is at row mb * kBlockM of the sequence's accumulator rows
// (dq_accum_offset: q_start + b * kBwdBlockM), as the kernel added it; rows
// past seqlen_q are padding and are not read.
template <typename Kt, bool kVarlen>
__global__ void __launch_bounds__(128, 8) convert_dq_frag_kernel(const AttnBwdParams p) {
  using T = typename Kt::Element;
  const int m_blocks = ceil_div(p.seqlen_q, Kt::kBlockM);
  unsigned idx = blockIdx.x;  // (32-bit divisions: the grid is below 2^31 blocks)
  const int block = static_cast<int>(idx % Kt::kDqBlocks);
  idx /= Kt::kDqBlocks;
  const int mb = static_cast<int>(idx % unsigned(m_blocks));
  idx /= unsigned(m_blocks);
  const int h = static_cast<int>(idx % unsigned(p.heads_q));
  const int b = static_cast<int>(idx / unsigned(p.heads_q));
  const int thr = threadIdx.x;
  const SeqInfo seq(p, b, kVarlen);
  if (kVarlen && mb * Kt::kBlockM >= seq.seqlen_q) return;
  const float* acc =
      static_cast<const float*>(p.dq_accum_ptr) +
      (kVarlen ? dq_accum_offset(p, seq, b, h) : b * p.dq_accum_batch_stride + h * p.dq_accum_head_stride) +
      int64_t(mb) * Kt::kBlockM * p.dq_accum_row_stride;
  const int c_lo = (block % Kt::kDqColBlocks) * 64;
  const int row_base = mb * Kt::kBlockM + (block / Kt::kDqColBlocks) * 64;
  T* dq_base = static_cast<T*>(p.dq_ptr) + seq.q_offset(p.dq_batch_stride, p.dq_row_stride, b) + h * p.dq_head_stride;
  const float s = p.softmax_scale;
  bool bad = false;
#pragma unroll
  for (int u = 0; u < 64 * 8 / 128; ++u) {
    const int r = (thr + 128 * u) / 8, di = (thr + 128 * u) % 8;  // row of the block, 8-column chunk
    const int row = row_base + r, col = c_lo + di * 8;
    if (row >= seq.seqlen_q || col >= p.head_dim) continue;
    const float4* src = dq_frag_chunk(acc, block, r, di);
    const float4 x = src[0], y = src[1];
    uint4 out;
    out.x = pack2<T>(x.x * s, x.y * s);
    out.y = pack2<T>(x.z * s, x.w * s);
    out.z = pack2<T>(y.x * s, y.y * s);
    out.w = pack2<T>(y.z * s, y.w * s);
    *reinterpret_cast<uint4*>(dq_base + int64_t(row) * p.dq_row_stride + col) = out;
    bad |= any_bad8(x, y);
  }
  // The non-finite rule: rows with a NaN / inf, exactly (each row's chunks are this warp's).
  if (__any_sync(0xffffffffu, bad)) fix_dq_frag_rows<Kt, kVarlen>(p, acc, block, row_base, c_lo, b, h, thr);
}

}  // namespace flashattn
