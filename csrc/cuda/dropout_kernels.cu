// dropout_kernels.h.
// <tuple> before ATen/cuda/PhiloxUtils.cuh, which uses std::tuple without
// including it (include sorting would put it after: the H200 build failed so).
// clang-format off
#include <tuple>
#include <ATen/cuda/PhiloxUtils.cuh>
// clang-format on

#include "../philox.h"
#include "dropout_kernels.h"

namespace flashattn {
namespace {

__global__ void unpack_rng_state_kernel(at::PhiloxCudaState state, int64_t* rng_state) {
  const auto [seed, offset] = at::cuda::philox::unpack(state);
  rng_state[0] = static_cast<int64_t>(seed);
  rng_state[1] = static_cast<int64_t>(offset);
}

// One thread per (row, key group): the group's 8 decisions (one Philox call)
// scattered to their keys (philox.h's layout). Grid-stride: the count can pass
// the grid's 2^31 blocks.
__global__ void keep_mask_kernel(const int64_t* rng_state, uint32_t keep_threshold, int64_t heads_q, int64_t seqlen_q,
                                 int64_t seqlen_k, int64_t groups, int64_t total, bool* keep) {
  const uint64_t seed = static_cast<uint64_t>(rng_state[0]), offset = static_cast<uint64_t>(rng_state[1]);
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t u = idx % groups, row = idx / groups;  // row = (b * heads_q + h) * seqlen_q + i
    const int64_t i = row % seqlen_q, bh = row / seqlen_q;
    const uint64_t plane = dropout_plane(offset, bh / heads_q, heads_q, bh % heads_q);
    const uint32_t bits =
        dropout_keep_bits(seed, plane, static_cast<uint32_t>(i), static_cast<uint32_t>(u), keep_threshold);
    bool* dst = keep + row * seqlen_k;
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      const int64_t j = dropout_group_key(static_cast<uint32_t>(u), s);
      if (j < seqlen_k) dst[j] = (bits >> s) & 1u;
    }
  }
}

}  // namespace

cudaError_t launch_unpack_rng_state(at::PhiloxCudaState state, int64_t* rng_state, cudaStream_t stream) {
  unpack_rng_state_kernel<<<1, 1, 0, stream>>>(state, rng_state);
  return cudaGetLastError();
}

cudaError_t launch_keep_mask(const int64_t* rng_state, uint32_t keep_threshold, int64_t batch, int64_t heads_q,
                             int64_t seqlen_q, int64_t seqlen_k, bool* keep, cudaStream_t stream) {
  const int64_t groups = (seqlen_k + 31) / 32 * 4;
  const int64_t total = batch * heads_q * seqlen_q * groups;
  if (total == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  keep_mask_kernel<<<static_cast<unsigned>(blocks < (1 << 20) ? blocks : (1 << 20)), kThreads, 0, stream>>>(
      rng_state, keep_threshold, heads_q, seqlen_q, seqlen_k, groups, total, keep);
  return cudaGetLastError();
}

}  // namespace flashattn
