// The persistent tile scheduler of the Hopper forward: which (query block,
// head, batch) tiles a CTA processes, and in which order.
//
// The grid has one CTA per SM (G = gridDim.x CTAs), and the assignment is
// static: CTA c takes every G-th entry of one global order, round by round.
// The producer loads the next tile's Q and K/V while the consumers still
// finish the current one (no CTA start-up between tiles).
//
// The global order: (batch, head) pairs are cut into groups whose K and V fit
// in L2 together; inside a group, tiles go by query block, heaviest first
// (under a causal mask the last query blocks see the most keys), then by head.
// So the CTAs running at one time share a few heads' K/V in L2.
//
// Tile weights: without a mask every tile has the same number of key blocks
// and plain striding balances the CTAs. Under a causal mask (or a window) the
// weight of query block m grows with m, and a round of G tiles can span the
// whole range of weights (one head's query blocks at 16k tokens), so CTA c
// keeps about the same position in every round: a simulation of the d256
// causal 16k grid point gives the busiest CTA 1.8x the mean (measured: 0.69 of
// cuDNN there, and the alternating-direction order did not help). Masked calls
// therefore hand out *pairs*: query block m with M - 1 - m of the same head,
// whose key-block counts add up to the same total for every pair, so that
// plain striding over pairs balances (simulated: 0.97 of ideal at every grid
// point, against 0.55-0.86 for single tiles at d128/d256). A CTA runs the
// heavy tile of its pair, then the light one.
//
// Pairs only where single tiles are unbalanced: a round of G single tiles
// spans G / group_bh query-block ranks of the M, and the spread of weights in
// a round grows with that fraction; with short sequences (small M) the last
// round of pairs leaves CTAs idle for a whole pair. Measured (session 6, visit
// 1, causal, paired / single TFLOP/s): d64 1k 256/287, 4k 378/383 (fraction
// 0.17); d128 1k 387/400, 4k 596/530, 16k 586/524 (0.34); d256 1k 420/413, 4k
// 644/542, 16k 637/427 (0.69-1.0). Rule: M >= 16 and the fraction >= 1/4.
//
// Varlen batches (AttnFwdParams::is_varlen()): the host does not know the
// sequences' lengths (cu_seqlens stays on the device; no synchronisation), so
// every (batch, head) pair gets ceil(max_seqlen_q / kBlockM) query-block
// ranks, as a dense batch of max_seqlen_q. Rank r is the r-th query block
// counted from the end of the pair's own sequence (its heaviest block first,
// as above), and the ranks a sequence does not have (r >= its query blocks)
// are tiles with no rows: FwdTile gives them rows = 0 from cu_seqlens alone,
// so the producer and the consumers, which decode each tile themselves, skip
// the same tiles without telling each other. Such batches always take the
// dynamic order below (never pairs).
//
// Dense batches with per-entry key lengths (seqused_k, the KV-cache prefill)
// run the kVarlen instance too, but every entry has seqlen_q rows: the ranks
// are a dense batch's (none empty).
//
// L2 groups of equal size: a group holds what fits in kL2GroupBytes, but the
// groups of a call are made about equal (ceil(bh / groups) pairs each), so
// that the order does not end on a small group whose heavy tiles alone make
// the last rounds (simulated, d128 causal 512-1k: 0.86 -> 0.91 of a balanced
// assignment).
//
// The dynamic order (calls whose tiles differ in weight: AttnFwdParams::
// tiles_differ(), with a zeroed counter from the binding; unless paired, see
// FwdSchedule::make): CTA c takes tile c first, then whichever tile of the
// global order is next when it is about to finish its current one (an atomic
// counter: a longest-first list schedule inside each L2 group). Simulated
// with a fixed cost of 1.5 key blocks a tile: 0.96-0.99 of a balanced
// assignment where the static striding gives 0.85-0.92 (d128/d256 causal
// 512-1k, where the rule does not pair). Measured (session 17, causal, one
// run, dynamic / static TFLOP/s): d128 512 330/318, 1k 457/430; d64 1k
// 260/245; d256 1k 461/419 (benchmarks/NOTES.md, "The tile order").
//
// An attn_mask that differs by head but not by batch entry (a (1, H, L, S)
// relative-position bias) is read whole by every batch entry: in the order
// above, the entries of one head are a group (or more) apart, so each reads
// the mask from memory again (B times the mask's bytes: 2.1 GB at b4 h16
// n4096, bf16). Such calls count the (batch, head) pairs batch-minor
// (batch_minor: pair u is batch u % B of head u / B), so the B tiles that
// share a mask tile run side by side and read it once from L2.
//
// The roles: a scheduler thread (warp 1 of the producer warpgroup; a paged
// call's producer leader itself) finds each tile and hands it to every thread
// of the producer and the consumers through a two-slot mailbox in shared
// memory (FwdTileMailbox); the producer asks for the next tile (the dynamic
// order) before it issues the current tile's last load.
#pragma once

#include "../../flash_params.h"
#include "../ptx.cuh"
#include "tma.cuh"

namespace flashattn {

struct FwdSchedule {
  int num_m_blocks = 0;         // query blocks of a head (M; varlen: ranks, for max_seqlen_q)
  int num_tiles = 0;            // num_m_blocks * batch * heads_q
  int group_bh = 1;             // (batch, head) pairs per L2 group
  bool paired = false;          // hand out (m, M - 1 - m) pairs (masked calls)
  bool batch_minor = false;     // pairs counted batch first (an attn_mask shared by the batch entries)
  int rounds = 0;               // rounds of the CTA loop (set_ctas; the static order)
  int* tile_counter = nullptr;  // the dynamic order's counter (zeroed); nullptr: static

  // L2 bytes the K/V of one group may take: about half of an H100/H200's.
  static constexpr int64_t kL2GroupBytes = int64_t(24) << 20;

  // pairs_first: masked calls that the rule below pairs keep the pairs
  // (measured faster than the dynamic order at head dim 256 from 4k on); so
  // do calls of 64 query blocks or more (d128 from 8k). Else every call
  // whose tiles differ takes the dynamic order when the binding gave a
  // counter.
  static FwdSchedule make(const AttnFwdParams& p, int block_m, int sm_count, bool pairs_first) {
    FwdSchedule s;
    s.num_m_blocks = ceil_div(p.seqlen_q, block_m);
    const int64_t num_bh = int64_t(p.batch) * p.heads_q;
    s.num_tiles = static_cast<int>(num_bh * s.num_m_blocks);  // the binding layer checks it fits
    // K and V bytes per query head (a GQA group shares them: count them once per group);
    // varlen: for max_seqlen_k keys, a bound (groups no larger than their K/V allows).
    const int64_t kv_bytes = int64_t(p.seqlen_k) * p.head_dim * 2 * 2 / p.heads_ratio();
    int64_t group = kL2GroupBytes / (kv_bytes > 0 ? kv_bytes : 1);
    group = group < 1 ? 1 : (group > num_bh ? num_bh : group);
    if (num_bh > 0) {  // groups of about equal size (the top of the file)
      const int64_t groups = (num_bh + group - 1) / group;
      group = (num_bh + groups - 1) / groups;
    }
    s.group_bh = static_cast<int>(group);
    const bool masked = p.mask.window_left >= 0 || p.mask.window_right >= 0;
    s.paired = masked && s.num_m_blocks >= 16 && int64_t(4) * sm_count >= int64_t(s.num_m_blocks) * s.group_bh;
    // Sequences of their own lengths (the kVarlen instance) always take the
    // dynamic order: the kernel then has no static one (FwdTiles::find).
    if (p.tile_counter != nullptr && (p.per_sequence() || !(pairs_first || s.num_m_blocks >= 64))) s.paired = false;
    if (!s.paired && p.tiles_differ()) s.tile_counter = p.tile_counter;
    const AttnBias& bias = p.score_mod.bias;
    s.batch_minor =
        bias.ptr != nullptr && bias.batch_stride == 0 && bias.head_stride != 0 && p.batch > 1 && !p.per_sequence();
    return s;
  }
  __host__ __device__ bool dynamic() const { return tile_counter != nullptr; }
  __host__ __device__ int pairs_per_head() const { return (num_m_blocks + 1) / 2; }
  // What the CTAs share out: tiles, or pairs of tiles.
  __host__ __device__ int num_units() const {
    return paired && num_tiles > 0 ? num_tiles / num_m_blocks * pairs_per_head() : num_tiles;
  }
  void set_ctas(int ctas) {
    const int unit_rounds = ceil_div(num_units(), ctas);
    rounds = paired ? 2 * unit_rounds : unit_rounds;
  }
};

// The tile (an index into the global order, decoded by FwdTile) that CTA
// `cta` of `ctas` takes in round `round`; >= num_tiles: none.
__device__ __forceinline__ int fwd_tile_of_round(const FwdSchedule& s, int round, int cta, int ctas) {
  if (!s.paired) return round * ctas + cta;
  const int unit = (round >> 1) * ctas + cta;
  const int pairs = s.pairs_per_head();
  const int group_units = s.group_bh * pairs;
  const int group = unit / group_units;
  const int in_group = unit - group * group_units;
  const int bh0 = group * s.group_bh;
  const int bh_total = s.num_tiles / s.num_m_blocks;
  if (bh0 >= bh_total) return s.num_tiles;
  const int group_size = min(s.group_bh, bh_total - bh0);
  const int pair = in_group / group_size;
  if (pair >= pairs) return s.num_tiles;  // past the last unit (a smaller last group)
  const int bh_in_group = in_group - pair * group_size;
  // m_rank 0 is the heaviest query block (FwdTile); the pair's light half is
  // its mirror, absent for the middle block of an odd count.
  const int m_rank = (round & 1) ? s.num_m_blocks - 1 - pair : pair;
  if ((round & 1) && m_rank == pair) return s.num_tiles;
  return group * s.group_bh * s.num_m_blocks + m_rank * group_size + bh_in_group;
}

// The hand-off of the CTA's tiles from the scheduler (one thread) to every
// thread of the producer and the consumers: two slots, each with a full
// barrier (the scheduler's arrive publishes the slot) and an empty one (every
// reader arrives once it has read it); the k-th tile of the CTA goes through
// slot k % 2. In the dynamic order the scheduler takes tile k + 1 from the
// counter only when the producer asks for it (the request barrier: the
// producer arrives before it issues tile k's last load), so that the CTA
// claims its next tile about kStages key blocks before it finishes the
// current one (claimed at the start of the current tile instead, the
// simulation gives 0.89-0.97 of a balanced assignment instead of 0.96-0.99).
struct FwdTileMailbox {
  uint32_t base;  // (shared-memory address) full[2], empty[2], request, then the slots: int[2]

  __device__ __forceinline__ uint32_t full(int k) const { return base + 8 * k; }
  __device__ __forceinline__ uint32_t empty(int k) const { return base + 16 + 8 * k; }
  __device__ __forceinline__ uint32_t request() const { return base + 32; }
  __device__ __forceinline__ uint32_t slot(int k) const { return base + 40 + 4 * k; }
  static constexpr int kBytes = 5 * 8 + 2 * 4;

  // Before the CTA-wide barrier, by one thread.
  __device__ __forceinline__ void init(int readers) const {
    for (int k = 0; k < 2; ++k) {
      mbar_init(full(k), 1);
      mbar_init(empty(k), readers);
    }
    mbar_init(request(), 1);
  }
};

// One thread's walk over the CTA's tiles (>= num_tiles: none left). The
// scheduler finds each tile and publishes it (find, publish); every other
// thread of the producer and the consumers reads it (next) once a tile,
// alike, so all walk the same tiles.
class FwdTiles {
 public:
  __device__ __forceinline__ explicit FwdTiles(FwdTileMailbox box) : box_(box) {}

  // The scheduler: the CTA's next tile. Static: round by round
  // (fwd_tile_of_round). Dynamic: blockIdx.x first, then the counter's next
  // value, after the producer's request for it when `on_request` (the
  // producer's own leader finding its tiles, a paged call, asks itself).
  // kDynamicOnly: the kVarlen instance, whose calls always take the dynamic
  // order (FwdSchedule::make), so that its producer has no static arithmetic.
  template <bool kDynamicOnly = false>
  __device__ __forceinline__ int find(const FwdSchedule& s, bool on_request) {
    if (kDynamicOnly || s.dynamic()) {
      if (k_ == 0) return static_cast<int>(blockIdx.x);
      if (on_request) mbar_wait(box_.request(), uint32_t(k_ - 1) & 1);
      return static_cast<int>(gridDim.x) + atomicAdd(s.tile_counter, 1);
    }
    int tile = s.num_tiles;
    if constexpr (!kDynamicOnly) {
      for (; round_ < s.rounds; ++round_) {
        tile = fwd_tile_of_round(s, round_, blockIdx.x, gridDim.x);
        if (tile < s.num_tiles) break;
      }
      ++round_;
    }
    return tile;
  }
  __device__ __forceinline__ int publish(int tile) {
    const int slot = k_ & 1;
    mbar_wait(box_.empty(slot), (uint32_t(k_ >> 1) & 1) ^ 1);  // its readers are done with tile k - 2
    st_shared(box_.slot(slot), tile);
    mbar_arrive(box_.full(slot));  // (release: the readers see the slot)
    ++k_;
    return tile;
  }
  // Every other thread.
  __device__ __forceinline__ int next() {
    const int slot = k_ & 1;
    mbar_wait(box_.full(slot), uint32_t(k_ >> 1) & 1);
    const int tile = ld_shared(box_.slot(slot));
    mbar_arrive(box_.empty(slot));
    ++k_;
    return tile;
  }
  // The producer's leader, once a tile (its last load, or a tile without
  // loads): asks the scheduler for the next one (dynamic order).
  __device__ __forceinline__ void request(const FwdSchedule& s) const {
    if (s.dynamic()) mbar_arrive(box_.request());
  }

 private:
  const FwdTileMailbox box_;
  int k_ = 0;      // tiles handed out so far
  int round_ = 0;  // (the scheduler, static order) the next round to look at
};

// The scheduler role: warp 1 of the producer warpgroup, one thread (its own
// registers: in the producer's 24 the schedule's arithmetic spilled).
template <bool kDynamicOnly>
__device__ __forceinline__ void fwd_tile_scheduler(const FwdSchedule& s, FwdTileMailbox box) {
  FwdTiles tiles(box);
  while (tiles.publish(tiles.find<kDynamicOnly>(s, true)) < s.num_tiles) {
  }
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
    if (s.batch_minor) bh = bh % p.batch * p.heads_q + bh / p.batch;
  }
};

// A tile's coordinates. kVarlen (== p.per_sequence(), a separate kernel
// instance: see SeqInfo) locates the sequence through cu_seqlens (or reads its
// seqused_k); its rows are then <= 0 for a rank past the sequence's query
// blocks (a tile to skip; never with seqused_k, whose entries all have
// seqlen_q rows).
template <int kBlockM, bool kVarlen = false>
struct FwdTile {
  int h, b, h_kv;  // query head, batch, key/value head
  int m0, rows;    // first query row (in the sequence), valid rows
  SeqInfo seq;     // the sequence's rows, lengths and diagonal (a dense batch: the params' constants)

  __device__ __forceinline__ FwdTile(const AttnFwdParams& p, const FwdSchedule& s, int tile)
      : FwdTile(p, s, FwdTileIndex(p, s, tile)) {}

 private:
  __device__ __forceinline__ FwdTile(const AttnFwdParams& p, const FwdSchedule& s, FwdTileIndex ix)
      : h(ix.bh % p.heads_q), b(ix.bh / p.heads_q), h_kv(h / p.heads_ratio()), seq(p, b, kVarlen, kVarlen) {
    if constexpr (kVarlen) {                                 // (never paired: the dynamic order)
      const int m_blocks = ceil_div(seq.seqlen_q, kBlockM);  // this sequence's query blocks
      const int rank = ix.m_rank;
      m0 = (m_blocks - 1 - rank) * kBlockM;
      rows = rank < m_blocks ? min(kBlockM, seq.seqlen_q - m0) : 0;
    } else {
      m0 = (s.num_m_blocks - 1 - ix.m_rank) * kBlockM;
      rows = min(kBlockM, p.seqlen_q - m0);
    }
  }
};

}  // namespace flashattn
