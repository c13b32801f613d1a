// What the roles of the warp-specialized Hopper forward
// (flash_fwd_sm90_ws_kernel.cuh) share: the tensor maps, the shared-memory
// carve-up, the TMA coordinates of a tile and the K/V ring's stage / parity.
#pragma once

#include "../../flash_params.h"
#include "../mask.cuh"
#include "tile_scheduler.cuh"
#include "tma.cuh"

namespace flashattn {

// The tensor maps of one forward call (built on the host, tma_host.h): q, k,
// v are read and o written as 4-D (head_dim, heads, seqlen, batch) tensors
// through boxes of 64 columns (one 128-byte swizzled panel) x rows; a varlen
// batch as (head_dim, heads, total rows, 1); a paged k / v (KvCacheView) as
// (head_dim, heads_kv, page_size, num_blocks) in boxes of kv_box_rows rows,
// which divides both the page size and kBlockN (0: not paged).
struct FwdTmaMaps {
  CUtensorMap q, k, v, o;
  int kv_box_rows = 0;
};

// The CTA's shared memory: the Q tile, the O tile (or O staged in Q), the
// K and V rings of kStages stages and their full / empty mbarriers, Q's pair,
// the tile mailbox (tile_scheduler.cuh), the ring's next-step words, and (the
// attn_mask instance) the consumers' mask tiles.
template <typename Kt>
struct FwdSm90Smem {
  using T = typename Kt::Element;
  using TileQ = typename Kt::TileQ;
  using TileKV = typename Kt::TileKV;
  T *sQ, *sO, *sK, *sV;
  uint64_t *full_k, *empty_k, *full_v, *empty_v, *full_q, *empty_q;
  FwdTileMailbox tiles;
  // [kStages] (the attn_mask instance) the key-block step after the one whose
  // K the stage holds, and that block's summary code: the producer's word on
  // which blocks it loads next (../mask_skip.cuh), published by the stage's
  // full barrier.
  int* next_step;
  // (the attn_mask instance, Kt::kBiasStageFits) the consumers' mask tiles,
  // consumer c's at bias_tiles + c * FwdBiasStage<Kt>::kBytes (fwd_sm90_bias_stage.cuh).
  uint32_t bias_tiles;
  static __device__ __forceinline__ int pack_next(int after, int code) { return after << 2 | code; }
  static __device__ __forceinline__ int next_of(int packed) { return packed >> 2; }
  static __device__ __forceinline__ int code_of(int packed) { return packed & 3; }

  __device__ __forceinline__ explicit FwdSm90Smem(char* smem_raw) {
    char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    sQ = reinterpret_cast<T*>(smem);
    sO = Kt::kSeparateO ? sQ + TileQ::kElems : sQ;
    sK = sQ + (Kt::kSeparateO ? 2 : 1) * TileQ::kElems;  // [kStages]
    sV = sK + Kt::kStages * TileKV::kElems;              // [kStages]
    full_k = reinterpret_cast<uint64_t*>(sV + Kt::kStages * TileKV::kElems);
    empty_k = full_k + Kt::kStages;
    full_v = empty_k + Kt::kStages;
    empty_v = full_v + Kt::kStages;
    full_q = empty_v + Kt::kStages;
    empty_q = full_q + 1;
    tiles.base = smem_u32(empty_q + 1);
    next_step = reinterpret_cast<int*>(reinterpret_cast<char*>(empty_q + 1) + FwdTileMailbox::kBytes);
    bias_tiles = (smem_u32(next_step + Kt::kStages) + 127) & ~127u;
  }
};

// The forward's named barriers: 0 the CTA's, 1 .. kConsumers the ping-pong
// turns (fwd_sm90_mainloop.cuh), then one a consumer for its own 128 threads
// (the epilogue's staging, the mask tiles of fwd_sm90_bias_stage.cuh).
template <typename Kt>
__device__ __forceinline__ constexpr int fwd_consumer_bar(int cwg) {
  return 1 + Kt::kConsumers + cwg;
}

// Where a tile's rows are, for the mask and the TMA units.
template <typename Kt, bool kVarlen>
struct FwdSm90Coords {
  using Tile = FwdTile<Kt::kBlockM, kVarlen>;
  // A tile's mask: the batch's, or its sequence's (lengths, diagonal) when varlen.
  static __device__ __forceinline__ BlockMask mask_of(const AttnFwdParams& p, const BlockMask& mask, const Tile& tl) {
    if constexpr (kVarlen) {
      return BlockMask(p, tl.seq);
    } else {
      return mask;
    }
  }
  // TMA coordinates of a tile's rows: (row in the sequence, batch b), or
  // (row in the packed tensor, batch 0) when varlen (seqused_k: start rows 0,
  // batch b).
  static __device__ __forceinline__ int q_row_of(const Tile& tl) { return kVarlen ? tl.seq.q_start + tl.m0 : tl.m0; }
  static __device__ __forceinline__ int k_row_of(const Tile& tl, int n0) { return kVarlen ? tl.seq.k_start + n0 : n0; }
  static __device__ __forceinline__ int batch_of(const AttnFwdParams& p, const Tile& tl) {
    return kVarlen && p.is_varlen() ? 0 : tl.b;
  }
  // The keys' batch coordinate: the sequence's (0 when packed; a KV cache's row, SeqInfo::k_batch).
  static __device__ __forceinline__ int k_batch_of(const Tile& tl) { return kVarlen ? tl.seq.k_batch : tl.b; }
  // Use n of ring slot s (n counts the K or V blocks loaded so far) waits for parity n & 1.
  static __device__ __forceinline__ int stage(int it) { return it % Kt::kStages; }
  static __device__ __forceinline__ uint32_t parity(int it) { return uint32_t(it / Kt::kStages) & 1; }
};

}  // namespace flashattn
