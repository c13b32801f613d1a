// What the binding layer (kvcache_cuda.cpp) calls of the split-KV decoding
// kernels (flash_decode_kernel.cuh): one explicit instantiation per (dtype,
// kernel head dim) under instantiations/decode_*. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include "../kvcache_params.h"

namespace flashattn {

// Keys per pipeline stage of the decoding kernel: a split is a whole number of
// such blocks, and the automatic split count keeps at least two per split.
constexpr int kDecodeBlockN = 64;

// Rows of a CTA's query tile are 16 * m_tiles, m_tiles in {1, 2, 4}: every
// warp keeps the fp32 output of all of them in registers, so wide heads hold
// fewer (at most 128 accumulator registers a thread).
constexpr int decode_max_m_tiles(int head_dim) { return head_dim <= 64 ? 4 : (head_dim <= 128 ? 2 : 1); }

// The m_tiles a CTA uses for group_rows = (heads_q / heads_kv) * seqlen_q
// packed query rows: the fewest 16-row tiles holding them, up to the maximum
// (more rows: several CTAs per group, each reading the group's keys).
constexpr int decode_m_tiles(int head_dim, int group_rows) {
  const int need = (group_rows + 15) / 16;
  int m_tiles = 1;
  while (m_tiles < need && m_tiles < decode_max_m_tiles(head_dim)) m_tiles *= 2;
  return m_tiles;
}

// Launches the split kernel on a grid (num_splits, heads_kv * query tiles,
// batch) and, when num_splits > 1, the combine kernel. m_tiles as above.
template <typename T, int kHeadDim>
cudaError_t run_decode(const KvcacheParams& params, int m_tiles, cudaStream_t stream);

// Resident CTAs per SM of the split kernel with m_tiles (the occupancy the
// automatic split count aims to fill); 0 when the query fails.
template <typename T, int kHeadDim>
int decode_ctas_per_sm(int m_tiles);

}  // namespace flashattn
