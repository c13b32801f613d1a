// The producer role of the warp-specialized Hopper forward
// (flash_fwd_sm90_ws_kernel.cuh): warpgroup 0, one thread, the TMA loads of
// Q once a tile and of K and V block by block into the rings. Called by
// that thread, after the warpgroup has given its registers away.
//
// kSkipHidden (the attn_mask instance): the key blocks the mask hides
// outright are not loaded, and each K stage carries the next visible step for
// the consumers (ring use n is the n-th visible block of the CTA's tiles in
// both roles). Then the whole warp runs this (`lane` 0 issues), so that the
// lookup takes 32 blocks at a time (../mask_skip.cuh): one thread walking the
// blocks paid a load latency per hidden block, most of a document mask's.
// A paged KV cache (kVarlen, p.kv.paged()) runs the whole warpgroup, each
// thread issuing one box panel of a tile (PagedBox).
#pragma once

#include "../mask_skip.cuh"
#include "fwd_sm90_common.cuh"

namespace flashattn {

// One K or V tile of a paged cache (KvCacheView; the kVarlen instance) is
// kBlockN / box boxes of `box` rows, each inside one page (box divides the
// page size and kBlockN), at (row in its page, block), each loaded panel by
// panel: kBlockN / box * kPanels TMA loads a tile (16 at 16-key pages, d128).
// A TMA load takes uniform operands, so the loads of one warp's lanes issue
// one after the other (an ELECT loop: elect, R2UR the coordinates, UTMALDG);
// one producer warp issuing them all paid that chain once per load, so the
// whole producer warpgroup runs for a paged call and load u (box u /
// kPanels, panel u % kPanels) is issued by warp u % 4, lane u / 4: four
// chains of a quarter of the length, side by side. PagedBox is thread
// (warp, lane)'s load, its page-table entry read before the producer waits
// for the ring stage (the entry's latency under the wait, not after it);
// tma_load then issues it. The loads complete on the stage's barrier whose
// transaction count the leader set (a count may run below zero until then).
// A box past the table's last column (a tile running past the sequence's
// last page) reads block -1, outside the map: TMA fills it with zeros and
// still counts its bytes, as it does for a block index a caller got wrong.
struct PagedBox {
  int row = 0, block = -1;
  int dst = 0, col = 0;  // (elements) the load's place in the tile, its panel's first column
  bool active = false;   // a thread past the tile's loads loads nothing

  template <typename Kt>
  __device__ __forceinline__ PagedBox(const KvCacheView& kv, const int32_t* table_row, int pos0, int box, int ptid,
                                      Kt) {
    const int u = (ptid & 31) * 4 + ptid / 32;
    if (u >= Kt::kBlockN / box * Kt::kPanels) return;
    const int b = u / Kt::kPanels, panel = u % Kt::kPanels;
    const int pos = pos0 + b * box, slot = pos / kv.page_size;
    active = true;
    block = slot < kv.max_blocks ? table_row[slot] : -1;
    row = pos - slot * kv.page_size;
    dst = panel * Kt::TileKV::kRows * 64 + b * box * 64;
    col = panel * 64;
  }

  template <typename T>
  __device__ __forceinline__ void tma_load(T* tile, const CUtensorMap* map, uint64_t* bar, int h_kv) const {
    if (active) tma_load_4d(tile + dst, map, bar, col, h_kv, row, block);
  }
};

template <typename Kt, bool kVarlen, bool kSkipHidden = false>
__device__ __forceinline__ void fwd_sm90_producer(const AttnFwdParams& p, const FwdTmaMaps& maps,
                                                  const FwdSchedule& sched, const BlockMask& mask,
                                                  const FwdSm90Smem<Kt>& sm, int ptid) {
  using T = typename Kt::Element;
  using TileQ = typename Kt::TileQ;
  using TileKV = typename Kt::TileKV;
  using C = FwdSm90Coords<Kt, kVarlen>;
  using Tile = typename C::Tile;
  constexpr int kBlockN = Kt::kBlockN;
  // ptid: the thread's index in the producer warpgroup: 0 .. 127 for a paged
  // call, the lane (warp 0) otherwise.
  const bool leader = ptid == 0;  // (the only thread here unless kSkipHidden or paged)
  if (leader) {
    prefetch_tensor_map(&maps.q);
    prefetch_tensor_map(&maps.k);
    prefetch_tensor_map(&maps.v);
  }
  int it0 = 0, q_iter = 0;
  // The CTA's tiles (tile_scheduler.cuh), from the scheduler warp; a paged
  // call's leader (the whole warpgroup loads) finds them itself.
  const bool finds = kVarlen && p.kv.paged() && leader;
  FwdTiles tiles(sm.tiles);
  for (;;) {
    const int tile = finds ? tiles.publish(tiles.find<kVarlen>(sched, false)) : tiles.next();
    if (tile >= sched.num_tiles) break;
    const Tile tl(p, sched, tile);
    int n_min = 0, n_max = 0;
    if (!kVarlen || tl.rows > 0)  // (past its sequence's query blocks: the consumers skip it too)
      C::mask_of(p, mask, tl).template key_block_range<kBlockN>(tl.m0, tl.rows, n_min, n_max);
    if (n_max <= n_min) {
      if (leader) tiles.request(sched);
      continue;
    }
    const int blocks = n_max - n_min;  // step j visits key block n_max - 1 - j
    auto visible = visible_key_steps<Kt::kBlockM, kBlockN, kSkipHidden>(
        p.score_mod.bias, tl.b, tl.h, tl.m0, tl.rows, n_max, C::mask_of(p, mask, tl).seqlen_k, blocks);
    int step = visible.next_warp(0);
    if (step >= blocks) {  // the mask hides every key of the tile: the consumers store zeros
      if (leader) tiles.request(sched);
      continue;
    }
    int step_code = visible.code_of(step);
    int next = visible.next_warp(step + 1);
    int next_code = visible.code_of(next);
    // Ring use it0 + i holds the i-th visible block, that of step j; a K
    // stage also carries, for the consumers, the step after j (`after`) and
    // j's summary code (kMaskIdentity: the mask leaves the whole block alone,
    // so the consumers need not look it up), as FwdSm90Smem::pack_next.
    auto load = [&](const CUtensorMap* map, T* ring, uint64_t* full, uint64_t* empty, int i, int j, int after,
                    int code) {
      const int s = C::stage(it0 + i), n0 = (n_max - 1 - j) * kBlockN;
      if (kVarlen && p.kv.paged()) {  // (never kSkipHidden: attn_mask has no varlen form)
        const int32_t* table_row = p.kv.block_table + tl.b * p.kv.table_batch_stride;
        const int pos0 = tl.seq.k_start + n0;
        const PagedBox page(p.kv, table_row, pos0, maps.kv_box_rows, ptid, Kt{});
        mbar_wait(&empty[s], C::parity(it0 + i) ^ 1);
        if (leader) mbar_arrive_expect_tx(&full[s], Kt::kBytesKV);
        page.tma_load(ring + s * TileKV::kElems, map, &full[s], tl.h_kv);
        return;
      }
      mbar_wait(&empty[s], C::parity(it0 + i) ^ 1);
      if (!leader) return;
      if (kSkipHidden && after >= 0)
        sm.next_step[s] = FwdSm90Smem<Kt>::pack_next(after, code);  // (the arrive releases it)
      mbar_arrive_expect_tx(&full[s], Kt::kBytesKV);
#pragma unroll
      for (int pn = 0; pn < Kt::kPanels; ++pn)
        tma_load_4d(ring + s * TileKV::kElems + pn * TileKV::kRows * 64, map, &full[s], pn * 64, tl.h_kv,
                    C::k_row_of(tl, n0), C::k_batch_of(tl));
    };
    load(&maps.k, sm.sK, sm.full_k, sm.empty_k, 0, step, next, step_code);
    mbar_wait(sm.empty_q, (q_iter & 1) ^ 1);  // the previous tile's last S GEMM (or O store) is done with sQ
    if (leader) {
      mbar_arrive_expect_tx(sm.full_q, Kt::kBytesQ);
#pragma unroll
      for (int pn = 0; pn < Kt::kPanels; ++pn)
        tma_load_4d(sm.sQ + pn * TileQ::kRows * 64, &maps.q, sm.full_q, pn * 64, tl.h, C::q_row_of(tl),
                    C::batch_of(p, tl));
    }
    // K one block ahead of V: S_{i+1} is issued together with P_i V_i.
    int i = 0;
    for (;; ++i) {
      if (next < blocks) {
        const int after = visible.next_warp(next + 1);
        const int after_code = visible.code_of(after);
        load(&maps.k, sm.sK, sm.full_k, sm.empty_k, i + 1, next, after, next_code);
        load(&maps.v, sm.sV, sm.full_v, sm.empty_v, i, step, -1, 0);
        step = next;
        next = after;
        next_code = after_code;
      } else {
        if (leader) tiles.request(sched);
        load(&maps.v, sm.sV, sm.full_v, sm.empty_v, i, step, -1, 0);
        break;
      }
    }
    it0 += i + 1;
    ++q_iter;
  }
}

}  // namespace flashattn
