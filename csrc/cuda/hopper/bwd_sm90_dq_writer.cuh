// The dQ writer role of the warp-specialized Hopper backward kernels
// (flash_bwd_sm90_ws_kernel.cuh, flash_bwd_sm90_ws_split_kernel.cuh): the
// order of a dQ tile in shared memory and in the fp32 accumulator, and the
// deterministic mode's turns between the key blocks that add to one query
// block.
#pragma once

#include "../../flash_params.h"
#include "../mask.cuh"
#include "../ptx.cuh"
#include "tma.cuh"

namespace flashattn {

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

}  // namespace flashattn
