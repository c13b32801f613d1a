// The producer role of the warp-specialized Hopper forward
// (flash_fwd_sm90_ws_kernel.cuh): warpgroup 0, one thread, the TMA loads of
// Q once a tile and of K and V block by block into the rings. Called by
// that thread, after the warpgroup has given its registers away.
#pragma once

#include "fwd_sm90_common.cuh"

namespace flashattn {

template <typename Kt, bool kVarlen>
__device__ __forceinline__ void fwd_sm90_producer(const AttnFwdParams& p, const FwdTmaMaps& maps,
                                                  const FwdSchedule& sched, const BlockMask& mask,
                                                  const FwdSm90Smem<Kt>& sm) {
  using T = typename Kt::Element;
  using TileQ = typename Kt::TileQ;
  using TileKV = typename Kt::TileKV;
  using C = FwdSm90Coords<Kt, kVarlen>;
  using Tile = typename C::Tile;
  constexpr int kBlockN = Kt::kBlockN;
  prefetch_tensor_map(&maps.q);
  prefetch_tensor_map(&maps.k);
  prefetch_tensor_map(&maps.v);
  int it0 = 0, q_iter = 0;
  for (int round = 0; round < sched.rounds; ++round) {
    const int tile = fwd_tile_of_round(sched, round, blockIdx.x, gridDim.x);
    if (tile >= sched.num_tiles) continue;
    const Tile tl(p, sched, tile);
    if (kVarlen && tl.rows <= 0) continue;  // past its sequence's query blocks: the consumers skip it too
    int n_min, n_max;
    C::mask_of(p, mask, tl).template key_block_range<kBlockN>(tl.m0, tl.rows, n_min, n_max);
    if (n_max <= n_min) continue;
    const int blocks = n_max - n_min;
    auto load = [&](const CUtensorMap* map, T* ring, uint64_t* full, uint64_t* empty, int j) {
      const int s = C::stage(it0 + j), row0 = C::k_row_of(tl, (n_max - 1 - j) * kBlockN);
      mbar_wait(&empty[s], C::parity(it0 + j) ^ 1);
      mbar_arrive_expect_tx(&full[s], Kt::kBytesKV);
#pragma unroll
      for (int pn = 0; pn < Kt::kPanels; ++pn)
        tma_load_4d(ring + s * TileKV::kElems + pn * TileKV::kRows * 64, map, &full[s], pn * 64, tl.h_kv, row0,
                    C::batch_of(p, tl));
    };
    load(&maps.k, sm.sK, sm.full_k, sm.empty_k, 0);
    mbar_wait(sm.empty_q, (q_iter & 1) ^ 1);  // the previous tile's last S GEMM (or O store) is done with sQ
    mbar_arrive_expect_tx(sm.full_q, Kt::kBytesQ);
#pragma unroll
    for (int pn = 0; pn < Kt::kPanels; ++pn)
      tma_load_4d(sm.sQ + pn * TileQ::kRows * 64, &maps.q, sm.full_q, pn * 64, tl.h, C::q_row_of(tl),
                  C::batch_of(p, tl));
    // K one block ahead of V: S_{j+1} is issued together with P_j V_j.
    for (int j = 0; j < blocks; ++j) {
      if (j + 1 < blocks) load(&maps.k, sm.sK, sm.full_k, sm.empty_k, j + 1);
      load(&maps.v, sm.sV, sm.full_v, sm.empty_v, j);
    }
    it0 += blocks;
    ++q_iter;
  }
}

}  // namespace flashattn
