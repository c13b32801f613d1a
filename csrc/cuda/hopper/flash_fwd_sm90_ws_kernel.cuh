// The warp-specialized forward kernel for Hopper (sm90a): FlashAttention-3's
// structure on this project's tiles.
//
// A CTA owns kBlockM = 64 * kConsumers query rows of one (batch, head) and is
// kConsumers + 1 warpgroups:
//
//   producer  (warpgroup 0, one thread): TMA loads of Q once, then of K and V
//             block by block into a ring of kStages stages, each guarded by a
//             full / empty mbarrier pair (tma.cuh). It gives its registers
//             away (setmaxnreg) to the consumers.
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
// registers with known (row, key) coordinates.
#pragma once

#include "../../flash_params.h"
#include "../mask.cuh"
#include "../nonfinite_fixup.cuh"
#include "../softmax.cuh"
#include "../tile.cuh"
#include "tile_scheduler.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace flashattn {

// The tensor maps of one forward call (built on the host, tma_host.h): q, k,
// v are read and o written as 4-D (head_dim, heads, seqlen, batch) tensors
// through boxes of 64 columns (one 128-byte swizzled panel) x rows.
struct FwdTmaMaps {
  CUtensorMap q, k, v, o;
};

template <typename Kt>
__global__ void __launch_bounds__(Kt::kNThreads, 1)
    flash_fwd_sm90_ws_kernel(const __grid_constant__ AttnFwdParams p, const __grid_constant__ FwdTmaMaps maps,
                             const FwdSchedule sched) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = typename Kt::Element;
  using TileQ = typename Kt::TileQ;
  using TileKV = typename Kt::TileKV;
  using Tile = FwdTile<Kt::kBlockM>;
  constexpr int kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim;
  constexpr int kStages = Kt::kStages, kConsumers = Kt::kConsumers;
  constexpr int kNT = kBlockN / 8;             // n-tiles of a row of S
  constexpr int kDT = kHeadDim / 8;            // n-tiles of a row of O
  constexpr int kPanelQ = TileQ::kRows * 128;  // bytes of one 64-column panel
  constexpr int kPanelKV = TileKV::kRows * 128;
  constexpr uint32_t kSbo = 1024;
  constexpr int kPingPongThreads = 256;  // one warpgroup syncs, the previous one arrives
  constexpr int kPingPongBar = 1;        // named barriers 1 .. kConsumers
  constexpr int kEpilogueBar = 1 + kConsumers;

  extern __shared__ char smem_raw[];
  char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  T* sQ = reinterpret_cast<T*>(smem);
  T* sO = Kt::kSeparateO ? sQ + TileQ::kElems : sQ;
  T* sK = sQ + (Kt::kSeparateO ? 2 : 1) * TileQ::kElems;  // [kStages]
  T* sV = sK + kStages * TileKV::kElems;                  // [kStages]
  uint64_t* full_k = reinterpret_cast<uint64_t*>(sV + kStages * TileKV::kElems);
  uint64_t* empty_k = full_k + kStages;
  uint64_t* full_v = empty_k + kStages;
  uint64_t* empty_v = full_v + kStages;
  uint64_t* full_q = empty_v + kStages;
  uint64_t* empty_q = full_q + 1;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid / 32;
  const int wg = warp / 4;
  const BlockMask mask(p);
  // Use n of ring slot s (n counts the K or V blocks loaded so far) waits for parity n & 1.
  auto stage = [](int it) { return it % kStages; };
  auto parity = [](int it) { return uint32_t(it / kStages) & 1; };

  if (tid == 0) {
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
    if (warp == 0 && lane == 0) {
      prefetch_tensor_map(&maps.q);
      prefetch_tensor_map(&maps.k);
      prefetch_tensor_map(&maps.v);
      int it0 = 0, q_iter = 0;
      for (int round = 0; round < sched.rounds; ++round) {
        const int tile = fwd_tile_of_round(sched, round, blockIdx.x, gridDim.x);
        if (tile >= sched.num_tiles) continue;
        const Tile tl(p, sched, tile);
        int n_min, n_max;
        mask.key_block_range<kBlockN>(tl.m0, tl.rows, n_min, n_max);
        if (n_max <= n_min) continue;
        const int blocks = n_max - n_min;
        auto load = [&](const CUtensorMap* map, T* ring, uint64_t* full, uint64_t* empty, int j) {
          const int s = stage(it0 + j), row0 = (n_max - 1 - j) * kBlockN;
          mbar_wait(&empty[s], parity(it0 + j) ^ 1);
          mbar_arrive_expect_tx(&full[s], Kt::kBytesKV);
#pragma unroll
          for (int pn = 0; pn < Kt::kPanels; ++pn)
            tma_load_4d(ring + s * TileKV::kElems + pn * TileKV::kRows * 64, map, &full[s], pn * 64, tl.h_kv, row0,
                        tl.b);
        };
        load(&maps.k, sK, full_k, empty_k, 0);
        mbar_wait(empty_q, (q_iter & 1) ^ 1);  // the previous tile's last S GEMM (or O store) is done with sQ
        mbar_arrive_expect_tx(full_q, Kt::kBytesQ);
#pragma unroll
        for (int pn = 0; pn < Kt::kPanels; ++pn)
          tma_load_4d(sQ + pn * TileQ::kRows * 64, &maps.q, full_q, pn * 64, tl.h, tl.m0, tl.b);
        // K one block ahead of V: S_{j+1} is issued together with P_j V_j.
        for (int j = 0; j < blocks; ++j) {
          if (j + 1 < blocks) load(&maps.k, sK, full_k, empty_k, j + 1);
          load(&maps.v, sV, full_v, empty_v, j);
        }
        it0 += blocks;
        ++q_iter;
      }
    }
    return;
  }

  // ---- consumers ----------------------------------------------------------
  warpgroup_reg_alloc<Kt::kConsumerRegs>();
  const int cwg = wg - 1;                            // consumer index
  const int ctid = tid - 128;                        // thread index among the consumers
  const int warp_row0 = cwg * 64 + (warp % 4) * 16;  // this warp's 16 rows of the block
  const int g = lane >> 2, t = lane & 3;
  const bool elected = (warp % 4 == 0) && lane == 0;  // issues this consumer's stores and releases

  // Ping-pong: consumer c issues its GEMMs after syncing on barrier c, then
  // lets consumer c + 1 go. The last consumer opens the first turn, and
  // consumer 0 takes the one turn left open at the end.
  auto turn_begin = [&]() { named_barrier_sync(kPingPongBar + cwg, kPingPongThreads); };
  auto turn_end = [&]() { named_barrier_arrive(kPingPongBar + (cwg + 1) % kConsumers, kPingPongThreads); };

  // Q: A of S, K-major, this consumer's 64 rows. K: B of S, K-major.
  // V: B of P V, N-major (keys are the contraction, 16 rows = 2048 bytes a step).
  const uint64_t desc_q = smem_desc(smem_u32(sQ) + cwg * 64 * 128, 16, kSbo);

  auto issue_scores = [&](float(&acc_s)[1][kNT][4], int it) {
    const uint64_t dk = smem_desc(smem_u32(sK + stage(it) * TileKV::kElems), 16, kSbo);
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks)
      Wgmma<kBlockN, T>::template ss<0, 0>(acc_s[0], desc_add(desc_q, kmajor_step(ks, kPanelQ)),
                                           desc_add(dk, kmajor_step(ks, kPanelKV)), ks > 0);
    wgmma_commit();
  };
  float acc_o[1][kDT][4];
  auto issue_pv = [&](const uint32_t(&a_p)[kBlockN / 16][4], int it) {
    const uint64_t dv = smem_desc(smem_u32(sV + stage(it) * TileKV::kElems), kPanelKV, kSbo);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      Wgmma<kHeadDim, T>::template rs<1>(acc_o[0], a_p[kk], desc_add(dv, kk * 2048), 1);
    wgmma_commit();
  };
  const bool positive_scale = p.softmax_scale > 0.f;

  if (cwg == kConsumers - 1) named_barrier_arrive(kPingPongBar, kPingPongThreads);
  int it0 = 0, q_iter = 0;
  for (int round = 0; round < sched.rounds; ++round) {
    const int tile = fwd_tile_of_round(sched, round, blockIdx.x, gridDim.x);
    if (tile >= sched.num_tiles) continue;
    const Tile tl(p, sched, tile);
    const int m0 = tl.m0;
    int n_min, n_max;
    mask.key_block_range<kBlockN>(m0, tl.rows, n_min, n_max);
    if (n_max <= n_min) {
      store_unseeing_query_block<T>(p, tl.b, tl.h, m0, tl.rows, ctid, kConsumers * 128);
      continue;
    }
    const int blocks = n_max - n_min;  // step j visits key block n_max - 1 - j

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
    // After S_j has completed: the last S of the tile frees Q for the next tile.
    auto scores_done = [&](int j) {
      mbar_arrive(&empty_k[stage(it0 + j)]);
      if (Kt::kSeparateO && j == blocks - 1 && elected) mbar_arrive(empty_q);
    };

    clear(acc_o);
    float acc_s[1][kNT][4];
    float correction[1][2];
    mbar_wait(full_q, q_iter & 1);

    // S_0 and its softmax (O is zero: no rescale).
    mbar_wait(&full_k[stage(it0)], parity(it0));
    turn_begin();
    wgmma_fence();
    issue_scores(acc_s, it0);
    turn_end();
    wgmma_wait<0>();
    pin_registers(acc_s[0]);
    scores_done(0);
    softmax_step(acc_s, 0, correction);

    for (int j = 0; j + 1 < blocks; ++j) {
      // P_j packed into A fragments frees acc_s for S_{j+1}.
      uint32_t a_p[kBlockN / 16][4];
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) acc_to_a<T>(a_p[kk], acc_s[0], kk);
      mbar_wait(&full_k[stage(it0 + j + 1)], parity(it0 + j + 1));
      mbar_wait(&full_v[stage(it0 + j)], parity(it0 + j));
      turn_begin();
      wgmma_fence();
      issue_scores(acc_s, it0 + j + 1);
      issue_pv(a_p, it0 + j);
      turn_end();
      wgmma_wait<1>();
      pin_registers(acc_s[0]);
      scores_done(j + 1);
      softmax_step(acc_s, j + 1, correction);
      wgmma_wait<0>();
      pin_registers(acc_o[0]);
      mbar_arrive(&empty_v[stage(it0 + j)]);
      OnlineSoftmax<1>::rescale(acc_o, correction);
    }
    {  // The last block: P V only.
      uint32_t a_p[kBlockN / 16][4];
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) acc_to_a<T>(a_p[kk], acc_s[0], kk);
      mbar_wait(&full_v[stage(it0 + blocks - 1)], parity(it0 + blocks - 1));
      turn_begin();
      wgmma_fence();
      issue_pv(a_p, it0 + blocks - 1);
      turn_end();
      wgmma_wait<0>();
      pin_registers(acc_o[0]);
      mbar_arrive(&empty_v[stage(it0 + blocks - 1)]);
    }

    // ---- epilogue -----------------------------------------------------------
    float row_lse[1][2];
    softmax.finalize(acc_o, p.softmax_scale_log2, positive_scale, row_lse);
    const bool bad = nonfinite::any_bad(acc_o);
    if (Kt::kSeparateO) {
      // This consumer's previous O store must have finished reading its rows of sO.
      if (elected) tma_store_wait_read();
      named_barrier_sync(kEpilogueBar + cwg, 128);
    }
    // (Staged in sQ: this consumer's rows are free, its last S GEMM has
    // completed and no other warpgroup reads them.)
    store_acc<TileQ>(sO, acc_o, warp_row0, 0, lane);
    if (t == 0) {
      float* gLse = static_cast<float*>(p.lse_ptr) + (int64_t(tl.b) * p.heads_q + tl.h) * p.seqlen_q + m0;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = warp_row0 + g + 8 * hh;
        if (r < tl.rows) gLse[r] = row_lse[0][hh];
      }
    }
    // The non-finite rule (../nonfinite_fixup.cuh): this warp's 16 rows of the
    // staged O, exactly, if one holds a NaN / inf (before the TMA store reads them).
    if (__any_sync(0xffffffffu, bad))
      nonfinite::fix_fwd_rows<TileQ, (kHeadDim + 31) / 32>(nonfinite::fixup_args(p, SeqInfo(p, tl.b, false), tl.b),
                                                           tl.h, m0, warp_row0, 16, tl.rows, sO, lane);
    fence_proxy_async_smem();  // the TMA store (async proxy) reads what st.shared wrote
    named_barrier_sync(kEpilogueBar + cwg, 128);
    if (elected) {
#pragma unroll
      for (int pn = 0; pn < Kt::kPanels; ++pn)
        tma_store_4d(&maps.o, sO + pn * TileQ::kRows * 64 + cwg * 64 * 64, pn * 64, tl.h, m0 + cwg * 64, tl.b);
      tma_store_commit();
      if (!Kt::kSeparateO) {
        tma_store_wait_read();
        mbar_arrive(empty_q);
      }
    }
    it0 += blocks;
    ++q_iter;
  }
  if (cwg == 0) turn_begin();  // the last consumer's final arrive
  if (elected) tma_store_wait_all();
#endif
}

}  // namespace flashattn
