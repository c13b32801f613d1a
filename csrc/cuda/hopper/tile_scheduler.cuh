// The persistent tile scheduler of the Hopper forward: which (query block,
// head, batch) tiles a CTA processes, and in which order.
//
// The grid has one CTA per SM; in round r the CTAs take tiles
// [r * G, (r + 1) * G) of one global order (G = gridDim.x), CTA c the tile
// r * G + c (or, with FwdSchedule::boustrophedon, G - 1 - c of odd rounds: the
// CTA that took the heaviest tile of a round takes the lightest of the next;
// measured slower at d64/d128 causal, faster at d256 causal 4k). The producer
// loads the next tile's Q and K/V while the consumers still finish the
// current one (no CTA start-up between tiles).
//
// The order: (batch, head) pairs are cut into groups whose K and V fit in L2
// together; inside a group, tiles go by query block, heaviest first (the last
// query blocks under a causal mask see the most keys), then by head. So the
// CTAs running at one time share a few heads' K/V in L2, and every round of
// the static assignment hands out tiles of about equal weight (longest
// processing time first).
//
// Varlen batches (AttnFwdParams::is_varlen()): the host does not know the
// sequences' lengths (cu_seqlens stays on the device; no synchronisation), so
// every (batch, head) pair gets ceil(max_seqlen_q / kBlockM) query-block
// ranks, as a dense batch of max_seqlen_q. Rank r is the r-th query block
// counted from the end of the pair's own sequence (its heaviest block first,
// as above), and the ranks a sequence does not have (r >= its query blocks)
// are tiles with no rows: FwdTile gives them rows = 0 from cu_seqlens alone,
// so the producer and the consumers, which decode each tile themselves, skip
// the same tiles without telling each other.
#pragma once

#include "../../flash_params.h"
#include "../ptx.cuh"

namespace flashattn {

struct FwdSchedule {
  int num_m_blocks = 0;        // query blocks of a head (varlen: ranks, for max_seqlen_q)
  int num_tiles = 0;           // num_m_blocks * batch * heads_q
  int group_bh = 1;            // (batch, head) pairs per L2 group
  bool boustrophedon = false;  // alternate direction every round (FLASHATTN_FWD_BOUSTROPHEDON=1, for timing)

  // L2 bytes the K/V of one group may take: about half of an H100/H200's.
  static constexpr int64_t kL2GroupBytes = int64_t(24) << 20;

  static FwdSchedule make(const AttnFwdParams& p, int block_m) {
    FwdSchedule s;
    s.num_m_blocks = ceil_div(p.seqlen_q, block_m);
    const int64_t num_bh = int64_t(p.batch) * p.heads_q;
    s.num_tiles = static_cast<int>(num_bh * s.num_m_blocks);  // the binding layer checks it fits
    // K and V bytes per query head (a GQA group shares them: count them once per group);
    // varlen: for max_seqlen_k keys, a bound (groups no larger than their K/V allows).
    const int64_t kv_bytes = int64_t(p.seqlen_k) * p.head_dim * 2 * 2 / p.heads_ratio();
    const int64_t group = kL2GroupBytes / (kv_bytes > 0 ? kv_bytes : 1);
    s.group_bh = static_cast<int>(group < 1 ? 1 : (group > num_bh ? num_bh : group));
    return s;
  }
};

// The tile CTA `cta` of `ctas` takes in round `round` (>= num_tiles: none).
__device__ __forceinline__ int fwd_tile_of_round(const FwdSchedule& s, int round, int cta, int ctas) {
  return round * ctas + ((s.boustrophedon && (round & 1)) ? ctas - 1 - cta : cta);
}

// The (batch, head) pair (bh = batch * heads_q + head) and the query-block
// rank (0: the heaviest block) of a tile.
struct FwdTileIndex {
  int bh, m_rank;

  __device__ __forceinline__ FwdTileIndex(const AttnFwdParams& p, const FwdSchedule& s, int tile) {
    const int group_tiles = s.group_bh * s.num_m_blocks;
    const int group = tile / group_tiles;
    const int in_group = tile - group * group_tiles;
    // The last group may hold fewer (batch, head) pairs.
    const int bh0 = group * s.group_bh;
    const int bh_total = p.batch * p.heads_q;
    const int group_size = min(s.group_bh, bh_total - bh0);
    m_rank = in_group / group_size;
    bh = bh0 + (in_group - m_rank * group_size);
  }
};

// A tile's coordinates. kVarlen (== p.is_varlen(), a separate kernel instance:
// see SeqInfo) locates the sequence through cu_seqlens; its rows are then
// <= 0 for a rank past the sequence's query blocks (a tile to skip).
template <int kBlockM, bool kVarlen = false>
struct FwdTile {
  int h, b, h_kv;  // query head, batch, key/value head
  int m0, rows;    // first query row (in the sequence), valid rows
  SeqInfo seq;     // the sequence's rows, lengths and diagonal (a dense batch: the params' constants)

  __device__ __forceinline__ FwdTile(const AttnFwdParams& p, const FwdSchedule& s, int tile)
      : FwdTile(p, s, FwdTileIndex(p, s, tile)) {}

 private:
  __device__ __forceinline__ FwdTile(const AttnFwdParams& p, const FwdSchedule& s, FwdTileIndex ix)
      : h(ix.bh % p.heads_q), b(ix.bh / p.heads_q), h_kv(h / p.heads_ratio()), seq(p, b, kVarlen) {
    if constexpr (kVarlen) {
      const int m_blocks = ceil_div(seq.seqlen_q, kBlockM);  // this sequence's query blocks
      m0 = (m_blocks - 1 - ix.m_rank) * kBlockM;
      rows = ix.m_rank < m_blocks ? min(kBlockM, seq.seqlen_q - m0) : 0;
    } else {
      m0 = (s.num_m_blocks - 1 - ix.m_rank) * kBlockM;
      rows = min(kBlockM, p.seqlen_q - m0);
    }
  }
};

}  // namespace flashattn
