// The tile scheduler of the warp-specialized Hopper backward kernels
// (flash_bwd_sm90_ws_kernel.cuh, flash_bwd_sm90_ws_split_kernel.cuh): which
// key block a CTA owns. (The query blocks a CTA sweeps are QuerySweep's,
// ../mask.cuh.)
#pragma once

#include "../../flash_params.h"
#include "../ptx.cuh"

namespace flashattn {

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

}  // namespace flashattn
