// The device side of the CUDA dropout ops (dropout_cuda.cpp): the graph-safe
// unpack of torch's Philox state into rng_state, and the keep mask of
// ../philox.h drawn on the device. (Only ATen's Philox state header: nvcc
// compiles no other torch header for these.)
#pragma once

#include <ATen/cuda/PhiloxCudaState.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace flashattn {

// rng_state[0] = seed, rng_state[1] = offset of `state`, written by one
// thread on `stream`. Under CUDA graph capture the state holds pointers to
// the generator's seed and offset (at::cuda::philox::unpack reads them when
// the kernel runs), so each replay writes that replay's offset.
cudaError_t launch_unpack_rng_state(at::PhiloxCudaState state, int64_t* rng_state, cudaStream_t stream);

// keep (batch, heads_q, seqlen_q, seqlen_k), contiguous: 1 where element
// (b, h, i, j) is kept under keep_threshold, for the [seed, offset] in
// rng_state (device memory): dropout_keep_bits of ../philox.h, bit for bit the
// CPU op's.
cudaError_t launch_keep_mask(const int64_t* rng_state, uint32_t keep_threshold, int64_t batch, int64_t heads_q,
                             int64_t seqlen_q, int64_t seqlen_k, bool* keep, cudaStream_t stream);

}  // namespace flashattn
