// Compile-time shapes of the kernels: block sizes, warps, shared memory.
#pragma once

#include "mask_skip.cuh"
#include "tile.cuh"

namespace flashattn {

// The Hopper backward's shared-memory bitmap of the query blocks an attn_mask
// leaves visible (mask_skip.cuh), after the mbarriers; reserved in every
// instance, so that one traits type serves them all.
constexpr int kSkipBitmapBytes = StepBitmap<true>::kSmemBytes;

// Forward: kBlockM query rows per CTA split over kNWarps warps; key/value
// blocks of kBlockN rows. Shared memory holds Q, one K block and one V block.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kMinBlocksPerSm_, int kStages_,
          typename Element_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;
  static constexpr int kStages = kStages_;  // K/V buffers: 1 (K and V overlap each other) or 2
  static constexpr int kRowsPerWarp = kBlockM / kNWarps;
  static constexpr int kMTilesPerWarp = kRowsPerWarp / 16;
  // Q fragments of a warp cost kRowsPerWarp * kHeadDim / 64 registers per lane.
  static constexpr bool kQInRegs = kRowsPerWarp * kHeadDim / 64 <= 32;

  using TileQ = SmemTile<kBlockM, kHeadDim>;
  using TileKV = SmemTile<kBlockN, kHeadDim>;
  static constexpr int kStageElems = TileKV::kElems;
  static constexpr int kStageBytes = 2 * kStageElems;
  static constexpr int kSmemBytes = (TileQ::kElems + 2 * kStages * TileKV::kElems) * 2;

  static_assert(kRowsPerWarp % 16 == 0, "each warp owns whole 16-row m-tiles");
  static_assert(kStages == 1 || kStages == 2, "K/V stages");
  static_assert(kBlockN % 16 == 0 && kHeadDim % 32 == 0, "tile shapes");
};

// Backward, dK/dV kernel: one CTA per (key block of kBlockN rows, kv head,
// batch, head-dim slice), looping over query blocks of kBlockM rows of every
// query head of the GQA group. Two warp layouts:
//
// kSWarpsQ == 1: warps split the keys only (kBlockN / kNWarps each), which
//   makes S^T, dP^T, P^T and dS^T row-local to a warp: P^T and dS^T feed dV
//   and dK straight from registers. Each Q / dO fragment a warp loads feeds
//   only its own keys, so with 16 keys a warp the kernel is bound by
//   shared-memory traffic.
// kSWarpsQ > 1: S^T and dP^T are tiled 2-D (kSWarpsK x kSWarpsQ warps) and P^T
//   and dS^T go through shared memory to dV, dK (tiled kVWarpsK x kVWarpsD over
//   keys x head dim) and dQ: a few more shared-memory writes, fewer reads.
//
// kDSplit > 1 splits the head dim of the dK, dV (and dQ) outputs over several
// CTAs that each recompute S and dP: it keeps the dK/dV accumulators of large
// head dims inside the register file.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kDSplit_, int kQStages_, int kSWarpsQ_,
          typename Element_, bool kRotate_ = true>
struct BwdTraits {
  using Element = Element_;
  static constexpr bool kRotate = kRotate_;  // stagger the query sweeps of a head's key blocks
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kDSplit = kDSplit_;
  static constexpr int kDOut = kHeadDim / kDSplit;  // output columns per CTA
  static constexpr int kQStages = kQStages_;        // buffers for Q / dO blocks

  // S^T = K Q^T and dP^T = V dO^T: warps tiled kSWarpsK (keys) x kSWarpsQ (queries).
  static constexpr int kSWarpsQ = kSWarpsQ_;
  static constexpr int kSWarpsK = kNWarps / kSWarpsQ;
  static constexpr int kSKeys = kBlockN / kSWarpsK;     // keys of a warp's S^T tile
  static constexpr int kSQueries = kBlockM / kSWarpsQ;  // queries of a warp's S^T tile
  static constexpr bool kPInSmem = kSWarpsQ > 1;
  // dV += P^T dO and dK += dS^T Q: warps tiled kVWarpsK (keys) x kVWarpsD (columns).
  static constexpr int kVWarpsD = kSWarpsQ;
  static constexpr int kVWarpsK = kNWarps / kVWarpsD;
  static constexpr int kVKeys = kBlockN / kVWarpsK;
  static constexpr int kVCols = kDOut / kVWarpsD;

  // dQ = dS K: the kBlockM x kDOut product is split over the warps as
  // kDqWarpsM (query rows) x kDqWarpsD (columns). A warp reads rows x kBlockN
  // of dS and kBlockN x cols of K, so the split with the smallest rows + cols
  // moves the fewest shared-memory bytes.
  static constexpr int dq_cost(int wm) {
    return (wm > kNWarps || kNWarps % wm != 0 || (kBlockM / wm) % 16 != 0 || (kDOut / (kNWarps / wm)) % 16 != 0)
               ? 1 << 30
               : kBlockM / wm + kDOut / (kNWarps / wm);
  }
  static constexpr int best_dq_warps_m() {
    int best = 1;
    for (int wm = 2; wm <= kNWarps; wm *= 2)
      if (dq_cost(wm) < dq_cost(best)) best = wm;
    return best;
  }
  static constexpr int kDqWarpsM = best_dq_warps_m();
  static constexpr int kDqWarpsD = kNWarps / kDqWarpsM;
  static constexpr int kDqRowsPerWarp = kBlockM / kDqWarpsM;
  static constexpr int kDqColsPerWarp = kDOut / kDqWarpsD;

  using TileQ = SmemTile<kBlockM, kHeadDim>;   // Q and dO blocks
  using TileKV = SmemTile<kBlockN, kHeadDim>;  // K and V blocks
  using TileDS = SmemTile<kBlockN, kBlockM>;   // dS^T (and P^T), [key][query]
  static constexpr int kSmemBytes =
      (2 * kQStages * TileQ::kElems + 2 * TileKV::kElems + (kPInSmem ? 2 : 1) * TileDS::kElems) * 2 +
      2 * kQStages * kBlockM * 4;

  static_assert(kSKeys % 16 == 0 && kSQueries % 16 == 0, "S^T warp tiles are whole m-tiles and n-tile pairs");
  static_assert(kVKeys % 16 == 0 && kVCols % 16 == 0, "dV / dK warp tiles");
  static_assert(kPInSmem || (kVKeys == kSKeys && kVCols == kDOut), "the register path keeps a warp's keys");
  static_assert(kNWarps % kDqWarpsM == 0 && kDqRowsPerWarp % 16 == 0 && kDqColsPerWarp % 16 == 0, "dQ split");
  static_assert(kDOut % 16 == 0, "head-dim slice");
};

// Backward, deterministic dQ kernel: one CTA per (query block, head, batch)
// sweeping the key blocks like the forward: S, P, dP, dS, dQ += dS K.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, typename Element_>
struct BwdDqTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kRowsPerWarp = kBlockM / kNWarps;
  static constexpr int kMTilesPerWarp = kRowsPerWarp / 16;

  using TileQ = SmemTile<kBlockM, kHeadDim>;   // Q and dO
  using TileKV = SmemTile<kBlockN, kHeadDim>;  // K and V
  static constexpr int kSmemBytes = (2 * TileQ::kElems + 2 * TileKV::kElems) * 2;
  static_assert(kRowsPerWarp % 16 == 0, "each warp owns whole 16-row m-tiles");
};

// ---- Hopper (sm90a, wgmma) kernels: hopper/*.cuh ----

// The cp.async forward (hopper/flash_fwd_sm90_kernel.cuh).
template <int kHeadDim_, int kBlockN_, typename Element_, int kMinBlocksPerSm_ = 1>
struct FwdSm90Traits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 128;  // two warpgroups of 64 rows
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = 8;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;  // 2: registers capped at 128 a thread

  using TileQ = SmemTile<kBlockM, kHeadDim>;
  using TileKV = SmemTile<kBlockN, kHeadDim>;
  static constexpr int kPanelQ = TileQ::kRows * 128;  // bytes of one 64-column panel
  static constexpr int kPanelKV = TileKV::kRows * 128;
  // +1024: dynamic shared memory is rounded up to a 1024-byte boundary.
  static constexpr int kSmemBytes = 1024 + (TileQ::kElems + 4 * TileKV::kElems) * 2;

  static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "128-byte panels; O fits the register file");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "wgmma N");
};

// The warp-specialized TMA forward (hopper/flash_fwd_sm90_ws_kernel.cuh).
template <int kHeadDim_, int kBlockN_, int kConsumers_, int kStages_, typename Element_, int kPolyExpEvery_ = 0,
          bool kPingPong_ = true>
struct FwdSm90WsTraits {
  using Element = Element_;
  // The consumers take turns at issuing their GEMMs (named barriers), so that
  // one's softmax runs under the other's products; false: each issues as soon
  // as its operands are ready (FA3 turns the turns off above head dim 128).
  static constexpr bool kPingPong = kPingPong_;
  // > 0: the exponentials of every kPolyExpEvery-th 8-key column group of S
  // on the FMA pipe (OnlineSoftmax::softmax_rows, poly_exp2); 0: all on MUFU.
  static constexpr int kPolyExpEvery = kPolyExpEvery_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kConsumers = kConsumers_;  // consumer warpgroups of 64 query rows
  static constexpr int kBlockM = 64 * kConsumers;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kNThreads = 128 * (kConsumers + 1);
  // The CTA is launched at 168 registers a thread (384 threads) and setmaxnreg moves them: what the producer
  // warpgroup gives up the consumers take ((168 - 40) * 128 = (232 - 168) * 256; three consumers: 32 and 160
  // at 128 a thread). Two consumers gave 24 / 240 until the tile scheduler (session 17): at 24 the producer
  // spilled 20-100 bytes; at 232 the consumers do not spill (ptxas sm_90a, every instance timed in the grid).
  static constexpr int kProducerRegs = kConsumers == 2 ? 40 : 32;
  static constexpr int kConsumerRegs = kConsumers == 2 ? 232 : 160;
  static constexpr int kPanels = kHeadDim / 64;
  static constexpr int kOStoreRows = 64;  // one consumer's rows: the box of the O tensor map

  using TileQ = SmemTile<kBlockM, kHeadDim>;  // Q, and O in the epilogue
  using TileKV = SmemTile<kBlockN, kHeadDim>;
  static constexpr int kBytesQ = TileQ::kElems * 2;
  static constexpr int kBytesKV = TileKV::kElems * 2;
  // The rings' and Q's mbarriers, the tile mailbox's five and its two slots, next_step[kStages].
  static constexpr int kBarrierBytes = (4 * kStages + 2 + 5) * 8 + 8 + (kStages + 1) / 2 * 8;
  // +1024: dynamic shared memory is aligned up to 1024 bytes (the swizzle atom).
  static constexpr int kSmemLimit = 227 * 1024;
  static constexpr bool kSeparateO = 1024 + 2 * kBytesQ + 2 * kStages * kBytesKV + kBarrierBytes <= kSmemLimit;
  static constexpr int kSmemBytes = 1024 + (kSeparateO ? 2 : 1) * kBytesQ + 2 * kStages * kBytesKV + kBarrierBytes;
  // The attn_mask instance's mask tiles (hopper/fwd_sm90_bias_stage.cuh): 64 rows x kBlockN 16-bit keys a
  // consumer, after the barriers (aligned to 128 bytes), where they fit.
  static constexpr int kBiasStageBytes = kConsumers * 64 * kBlockN * 2;
  static constexpr bool kBiasStageFits = kSmemBytes + 128 + kBiasStageBytes <= kSmemLimit;
  static constexpr int kSmemBytesBiasStage = kBiasStageFits ? kSmemBytes + 128 + kBiasStageBytes : kSmemBytes;

  static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "128-byte panels; O fits the register file");
  static_assert(kBlockN % 64 == 0 && kBlockN <= 256, "wgmma N of S (64, 128, 192, 256)");
  static_assert(kConsumers == 2 || kConsumers == 3, "register split");
  static_assert(kStages >= 2, "K runs one block ahead of V");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= 65536, "register file");
  static_assert(kSmemBytes <= kSmemLimit, "shared memory");
};

// The backward (hopper/flash_bwd_sm90_kernel.cuh).
template <int kHeadDim_, int kBlockM_, typename Element_, int kNWarpgroups_ = 2>
struct BwdSm90Traits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // queries per step
  static constexpr int kNWarpgroups = kNWarpgroups_;
  static constexpr int kWgKeys = 64;                      // keys of a warpgroup
  static constexpr int kBlockN = kWgKeys * kNWarpgroups;  // keys per CTA
  static constexpr int kNWarps = 4 * kNWarpgroups;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kMinBlocksPerSm = kNWarpgroups == 1 ? 2 : 1;
  static constexpr int kQStages = 2;  // Q / dO double buffering
  static constexpr int kDSplit = 1;
  // The 64 x 64 dQ blocks (see the top of the file): kDqBlocksPerWg per
  // warpgroup over all keys, or one block split over the warpgroups by keys.
  static constexpr int kDqColBlocks = kHeadDim / 64;
  static constexpr int kDqBlocks = (kBlockM / 64) * kDqColBlocks;
  static constexpr bool kDqSplitKeys = kDqBlocks < kNWarpgroups;
  static constexpr int kDqBlocksPerWg = kDqSplitKeys ? 1 : kDqBlocks / kNWarpgroups;

  using TileQ = SmemTile<kBlockM, kHeadDim>;          // Q and dO blocks
  using TileKV = SmemTile<kBlockN, kHeadDim>;         // K and V
  using TileDS = SmemTile<kBlockN, kBlockM>;          // dS^T, [key][query]
  static constexpr int kPanelQ = TileQ::kRows * 128;  // bytes of one 64-column panel
  static constexpr int kPanelKV = TileKV::kRows * 128;
  static constexpr int kPanelDS = TileDS::kRows * 128;
  // +1024: the start of dynamic shared memory is rounded up to a 1024-byte
  // boundary (wgmma's swizzle repeats every 1024 bytes).
  static constexpr int kSmemBytes =
      1024 + (2 * TileKV::kElems + 2 * kQStages * TileQ::kElems + TileDS::kElems) * 2 + 2 * kQStages * kBlockM * 4;

  static_assert((kHeadDim == 64 || kHeadDim == 128) && (kBlockM == 64 || kBlockM == 128), "Hopper backward shapes");
  static_assert(kNWarpgroups == 1 || kNWarpgroups == 2, "warpgroups");
  static_assert(kDqSplitKeys || kDqBlocks % kNWarpgroups == 0, "dQ blocks deal evenly");
  static_assert(TileQ::kPanel == 64 && TileKV::kPanel == 64 && TileDS::kPanel == 64, "128-byte panels");
};

// The warp-specialized TMA backward (hopper/flash_bwd_sm90_ws_kernel.cuh):
// a producer warpgroup (TMA loads; dQ bulk reduce-adds) and two consumer
// warpgroups of 64 keys.
template <int kHeadDim_, int kBlockM_, int kStages_, typename Element_, bool kDqFirst_ = false>
struct BwdSm90WsTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // queries per step
  static constexpr int kBlockN = 128;       // keys per CTA: two consumers of 64
  static constexpr int kStages = kStages_;  // Q / dO ring
  static constexpr int kNThreads = 384;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static constexpr int kPanels = kHeadDim / 64;
  // The 64 x 64 blocks of the dQ tile, dealt evenly to the two consumers; a
  // single block goes to them in turn, step by step.
  static constexpr int kDqColBlocks = kHeadDim / 64;
  static constexpr int kDqBlocks = (kBlockM / 64) * kDqColBlocks;
  static constexpr bool kDqAlternate = kDqBlocks == 1;
  static constexpr int kDqBlocksPerWg = kDqAlternate ? 1 : kDqBlocks / 2;
  static constexpr bool kSplitHeadDim = false;  // the consumers split the keys
  // dV issued after the dS arithmetic instead of under it: with 128 queries a
  // step the registers hold P^T and dP^T in fp32 but not P^T's packed copy too.
  static constexpr bool kDvAfterDs = kBlockM == 128;
  // The step's last products in FlashAttention-3's order: dQ = dS K issued
  // before dK += dS^T Q, and dQ written to shared memory under dK. Else
  // (FLASHATTN_BWD_DQ_FIRST=0 in a tuning build) dK runs under the dS^T store
  // and the consumers' barrier, and dQ is written after every product, with
  // the tensor cores idle.
  static constexpr bool kDqFirst = kDqFirst_ && !kDqAlternate;

  using TileQ = SmemTile<kBlockM, kHeadDim>;          // Q and dO blocks
  using TileKV = SmemTile<kBlockN, kHeadDim>;         // K and V
  using TileDS = SmemTile<kBlockN, kBlockM>;          // dS^T, [key][query]
  static constexpr int kPanelQ = TileQ::kRows * 128;  // bytes of one 64-column panel
  static constexpr int kPanelKV = TileKV::kRows * 128;
  static constexpr int kPanelDS = TileDS::kRows * 128;
  static constexpr int kBytesQ = TileQ::kElems * 2;
  static constexpr int kBytesKV = TileKV::kElems * 2;
  // +1024: dynamic shared memory is aligned up to 1024 bytes (the swizzle atom).
  static constexpr int smem_bytes(int dq_tiles) {
    return 1024 + 2 * kBytesKV + 2 * kStages * kBytesQ + 2 * TileDS::kElems * 2 + dq_tiles * kBlockM * kHeadDim * 4 +
           2 * kStages * kBlockM * 4 + (1 + 2 * kStages) * 8 + kSkipBitmapBytes;
  }
  // fp32 dQ tiles in shared memory: one a consumer when they take turns; else
  // two where they fit (head dim 128: the consumers write step it's tile while
  // the writer warp still adds step it - 1's, or in the deterministic mode
  // waits for its turn to), one otherwise (head dim 64 with 128-query steps:
  // 40 bytes short).
  static constexpr int kDqTiles = kDqAlternate || smem_bytes(2) <= 227 * 1024 ? 2 : 1;
  static constexpr bool kDqDoubleBuffer = !kDqAlternate && kDqTiles == 2;
  static constexpr int kSmemBytes = smem_bytes(kDqTiles);

  static_assert((kHeadDim == 64 || kHeadDim == 128) && (kBlockM == 64 || kBlockM == 128), "shapes");
  static_assert(kDqAlternate || kDqBlocks % 2 == 0, "the dQ blocks deal evenly to the two consumers");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= 65536, "register file");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
};

// The warp-specialized TMA backward for head dims 192 and 256
// (hopper/flash_bwd_sm90_ws_split_kernel.cuh): dK and dV of 64 keys are 256
// registers a thread in one warpgroup, so a CTA owns 64 keys and the two
// consumer warpgroups split the head dim (kCols0 / kCols1 columns of dK, dV, dQ);
// consumer 0 computes S^T and P^T, consumer 1 dP^T and dS^T. Q has kStages
// stages, dO one (the shared-memory budget; see the kernel).
template <int kHeadDim_, typename Element_>
struct BwdSm90WsSplitTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  // Consumer 0's columns (half the head dim rounded up to whole 64-column
  // panels) and consumer 1's (the rest).
  static constexpr int kCols0 = (kHeadDim / 64 + 1) / 2 * 64;
  static constexpr int kCols1 = kHeadDim - kCols0;
  static constexpr int kBlockM = 64;  // queries per step
  static constexpr int kBlockN = 64;  // keys per CTA
  static constexpr int kStages = 2;   // Q ring
  static constexpr int kNThreads = 384;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static constexpr int kPanels = kHeadDim / 64;
  static constexpr bool kSplitHeadDim = true;
  // The dQ tile of a step is kDqBlocks 64 x 64 blocks (DqFragLayout), kDqBlocks / 2 a consumer.
  static constexpr int kDqColBlocks = kHeadDim / 64;
  static constexpr int kDqBlocks = kDqColBlocks;
  static constexpr int kDqPart0Floats = kBlockM * kCols0;  // the shared dQ tile: consumer 0's part, the larger

  using TileQ = SmemTile<kBlockM, kHeadDim>;          // Q and dO blocks
  using TileKV = SmemTile<kBlockN, kHeadDim>;         // K and V
  using TileDS = SmemTile<kBlockN, kBlockM>;          // P^T and dS^T, [key][query]
  static constexpr int kPanelQ = TileQ::kRows * 128;  // bytes of one 64-column panel
  static constexpr int kPanelKV = TileKV::kRows * 128;
  static constexpr int kPanelDS = TileDS::kRows * 128;
  static constexpr int kBytesQ = TileQ::kElems * 2;
  static constexpr int kBytesKV = TileKV::kElems * 2;
  // K, V; Q stages and one dO; P^T (16-bit), dS^T; P^T (fp32); a dQ half; lse / D; mbarriers: K / V, dO
  // full and empty, the Q ring's 2 kStages, and the full / empty pairs of P^T, dS^T and the two dQ parts.
  static constexpr int kSmemBytes = 1024 + 2 * kBytesKV + (kStages + 1) * kBytesQ + 2 * TileDS::kElems * 2 +
                                    TileDS::kElems * 4 + kDqPart0Floats * 4 + 2 * kStages * kBlockM * 4 +
                                    (3 + 2 * kStages + 8) * 8 + kSkipBitmapBytes;

  static_assert(kHeadDim == 192 || kHeadDim == 256, "the head-dim split is built for 192 and 256");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= 65536, "register file");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
};

}  // namespace flashattn
