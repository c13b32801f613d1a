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
// A paged KV cache (kVarlen, p.kv.paged()) also runs the whole warp, each
// lane loading one box of a tile (PagedBox); with pages under 64 keys
// (FwdTmaMaps::kv_gather) the whole warpgroup runs it and gathers the tiles
// with cp.async (PagedGather).
#pragma once

#include "../mask_skip.cuh"
#include "fwd_sm90_common.cuh"

namespace flashattn {

// One K or V tile of a paged cache (KvCacheView; the kVarlen instance, where
// the whole producer warp runs for a paged call) is kBlockN / box boxes of
// `box` rows, each inside one page (box divides the page size and kBlockN),
// at (row in its page, block): lane i loads box i, so that the page table's
// entries are read at once. PagedBox is lane i's box, read before the
// producer waits for the ring stage (the entry's latency under the wait, not
// after it); tma_load then issues it. The boxes complete on the stage's
// barrier whose transaction count the leader set (a count may run below zero
// until then). A box past
// the table's last column (a tile running past the sequence's last page)
// reads block -1, outside the map: TMA fills it with zeros and still counts
// its bytes, as it does for a block index a caller got wrong.
struct PagedBox {
  int row = 0, block = -1;
  bool active = false;  // a lane past the tile's boxes loads nothing

  __device__ __forceinline__ PagedBox(const KvCacheView& kv, const int32_t* table_row, int pos0, int box, int lane,
                                      int block_n) {
    if (lane >= block_n / box) return;
    const int pos = pos0 + lane * box, slot = pos / kv.page_size;
    active = true;
    block = slot < kv.max_blocks ? table_row[slot] : -1;
    row = pos - slot * kv.page_size;
  }

  template <typename Kt, typename T>
  __device__ __forceinline__ void tma_load(T* dst, const CUtensorMap* map, uint64_t* bar, int h_kv, int box,
                                           int lane) const {
    if (!active) return;
#pragma unroll
    for (int pn = 0; pn < Kt::kPanels; ++pn)
      tma_load_4d(dst + pn * Kt::TileKV::kRows * 64 + lane * box * 64, map, bar, pn * 64, h_kv, row, block);
  }
};

// A paged K or V tile gathered by the producer warpgroup's 128 threads with
// cp.async instead (FwdTmaMaps::kv_gather: pages whose boxes would be under
// 64 rows, where the TMA unit's cost per box showed: 1.20x the contiguous
// prefill's time at 32-key pages, 1.39x at 16, H200, session 15). Thread t
// copies the 16-byte chunk t % 8 of rows t / 8 + 16 i of every panel to the
// place TMA's 128-byte swizzle would have written (SmemTile::offset: fixed
// per thread, so each copy's shared address is a constant step); a warp's four
// rows never cross a page (pages are multiples of 16 keys). Lane l of every
// warp reads the page-table entry of the tile's l-th page before the stage
// wait and the rows take theirs by shuffle, so a tile costs one table read a
// thread. Rows past the sequence's keys, past the table or in a block outside
// the cache, and columns past head_dim are zero-filled (TMA's out-of-map rule;
// a sequence's unused cache rows never reach the consumers). Each thread's
// copies arrive on the stage's full barrier when they land
// (cp.async.mbarrier.arrive.noinc: the barrier counts 128 arrivals a phase;
// no producer wait), and the consumers fence the async proxy after their
// wait, before wgmma reads the tile.
struct PagedGather {
  static constexpr int kThreads = 128;
  static constexpr int kRowStep = kThreads / 8;  // rows a pass: 8 chunks of 16 bytes a panel row
  const char* page = nullptr;                    // this lane's page (the tile's lane-th) at kv head h_kv; null: none
  int in_page0 = 0;                              // the tile's first key's row in its page

  // (Bytes, not elements: one address form for K and V, whose strides differ.)
  __device__ __forceinline__ PagedGather(const AttnFwdParams& p, bool is_k, const int32_t* table_row, int pos0,
                                         int h_kv, int lane) {
    const KvCacheView& kv = p.kv;
    const int slot0 = pos0 / kv.page_size, slot = slot0 + lane;
    in_page0 = pos0 - slot0 * kv.page_size;
    const int block = slot < kv.max_blocks ? table_row[slot] : -1;
    if (block < 0 || block >= kv.cache_rows) return;
    const int64_t elems = uint64_t(uint32_t(block)) * uint64_t(is_k ? p.k_batch_stride : p.v_batch_stride) +
                          int64_t(h_kv) * (is_k ? p.k_head_stride : p.v_head_stride);
    page = static_cast<const char*>(is_k ? p.k_ptr : p.v_ptr) + 2 * elems;
  }

  // (t, the thread's index in the producer warpgroup, is read here, not
  // passed: ptxas would otherwise hoist what it derives from t out of the
  // tile loop and spill it at the producer's 24 registers.)
  template <typename Kt, typename T>
  __device__ __forceinline__ void copy(const AttnFwdParams& p, bool is_k, T* dst, int rows) const {
    using TileKV = typename Kt::TileKV;
    uint32_t t;
    asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));  // (the producer is warpgroup 0: t < 128)
    constexpr int kPasses = Kt::kBlockN / kRowStep;
    static_assert(Kt::kBlockN % kRowStep == 0 && Kt::kBlockN / 16 + 1 <= 32, "gather layout");
    static_assert(sizeof(T) == 2, "16-bit elements");
    const int r0 = t / 8, col = (t % 8) * 8;  // (t < 128)
    const uint64_t row_bytes = 2 * uint64_t(is_k ? p.k_row_stride : p.v_row_stride);
    // (The address of the zero-filled copies: row 0 of the tensor; nothing is read.)
    const char* any = static_cast<const char*>(is_k ? p.k_ptr : p.v_ptr);
    const uint32_t dst0 = smem_u32(dst + TileKV::offset(r0, col));
    int row = in_page0 + r0, slot = 0;  // (row in its page, page of the tile)
    if (row >= p.kv.page_size) row -= p.kv.page_size, slot = 1;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const auto* base = reinterpret_cast<const char*>(__shfl_sync(0xffffffffu, reinterpret_cast<uint64_t>(page), slot));
      const bool ok = base != nullptr && r0 + i * kRowStep < rows;
      const char* src = ok ? base + uint64_t(uint32_t(row)) * row_bytes + 2 * col : any;
#pragma unroll
      for (int pn = 0; pn < Kt::kPanels; ++pn)
        cp_async_16(dst0 + 2 * (pn * TileKV::kRows * 64 + i * kRowStep * 64), src + pn * 128,
                    ok && pn * 64 + col < p.head_dim);
      row += kRowStep;
      if (row >= p.kv.page_size) row -= p.kv.page_size, ++slot;
    }
  }
};

// Arrives on `bar` when this thread's cp.async copies so far have landed,
// without adding to the phase's count (the barrier was initialized for it).
__device__ __forceinline__ void cp_async_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

// ptid: the thread's index in the producer warpgroup (0..127; only warp 0
// runs here unless the tiles are gathered).
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
  const int lane = ptid & 31;
  const bool leader = ptid == 0;  // (the only thread here unless kSkipHidden or paged)
  const bool gather = kVarlen && maps.kv_gather;
  if (leader) {
    prefetch_tensor_map(&maps.q);
    prefetch_tensor_map(&maps.k);
    prefetch_tensor_map(&maps.v);
  }
  int it0 = 0, q_iter = 0;
  for (int round = 0; round < sched.rounds; ++round) {
    const int tile = fwd_tile_of_round(sched, round, blockIdx.x, gridDim.x);
    if (tile >= sched.num_tiles) continue;
    const Tile tl(p, sched, tile);
    if (kVarlen && tl.rows <= 0) continue;  // past its sequence's query blocks: the consumers skip it too
    int n_min, n_max;
    C::mask_of(p, mask, tl).template key_block_range<kBlockN>(tl.m0, tl.rows, n_min, n_max);
    if (n_max <= n_min) continue;
    const int blocks = n_max - n_min;  // step j visits key block n_max - 1 - j
    auto visible = visible_key_steps<Kt::kBlockM, kBlockN, kSkipHidden>(
        p.score_mod.bias, tl.b, tl.h, tl.m0, tl.rows, n_max, C::mask_of(p, mask, tl).seqlen_k, blocks);
    int step = visible.next_warp(0);
    if (step >= blocks) continue;  // the mask hides every key of the tile: the consumers store zeros
    int step_code = visible.code_of(step);
    int next = visible.next_warp(step + 1);
    int next_code = visible.code_of(next);
    // Ring use it0 + i holds the i-th visible block, that of step j; a K
    // stage also carries, for the consumers, the step after j (`after`) and
    // j's summary code (kMaskIdentity: the mask leaves the whole block alone,
    // so the consumers need not look it up), as FwdSm90Smem::pack_next.
    auto load = [&](bool is_k, const CUtensorMap* map, T* ring, uint64_t* full, uint64_t* empty, int i, int j,
                    int after, int code) {
      const int s = C::stage(it0 + i), n0 = (n_max - 1 - j) * kBlockN;
      if (kVarlen && p.kv.paged()) {  // (never kSkipHidden: attn_mask has no varlen form)
        const int32_t* table_row = p.kv.block_table + tl.b * p.kv.table_batch_stride;
        const int pos0 = tl.seq.k_start + n0;
        if (gather) {
          const PagedGather pages(p, is_k, table_row, pos0, tl.h_kv, lane);
          mbar_wait(&empty[s], C::parity(it0 + i) ^ 1);
          pages.copy<Kt>(p, is_k, ring + s * TileKV::kElems, tl.seq.seqlen_k - n0);
          cp_async_arrive_noinc(&full[s]);
          return;
        }
        const PagedBox page(p.kv, table_row, pos0, maps.kv_box_rows, lane, kBlockN);
        mbar_wait(&empty[s], C::parity(it0 + i) ^ 1);
        if (leader) mbar_arrive_expect_tx(&full[s], Kt::kBytesKV);
        page.tma_load<Kt>(ring + s * TileKV::kElems, map, &full[s], tl.h_kv, maps.kv_box_rows, lane);
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
    load(true, &maps.k, sm.sK, sm.full_k, sm.empty_k, 0, step, next, step_code);
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
        load(true, &maps.k, sm.sK, sm.full_k, sm.empty_k, i + 1, next, after, next_code);
        load(false, &maps.v, sm.sV, sm.full_v, sm.empty_v, i, step, -1, 0);
        step = next;
        next = after;
        next_code = after_code;
      } else {
        load(false, &maps.v, sm.sV, sm.full_v, sm.empty_v, i, step, -1, 0);
        break;
      }
    }
    it0 += i + 1;
    ++q_iter;
  }
  if (gather) cp_async_wait<0>();  // (a thread's copies land before it exits)
}

}  // namespace flashattn
