// What the binding layer (attention_cuda.cpp) calls: one explicit
// instantiation per (dtype, kernel head dim), each in its own .cu file under
// instantiations/ so they compile in parallel. This header is torch-free.
#pragma once

#include <cuda_runtime.h>

#include "../flash_params.h"

namespace flashattn {

// Query rows per block of the backward kernels; the binding layer pads the
// fp32 dQ accumulator to a multiple of it.
constexpr int kBwdBlockM = 128;

template <typename T, int kHeadDim>
cudaError_t run_fwd(const AttnFwdParams& params, cudaStream_t stream);

template <typename T, int kHeadDim>
cudaError_t run_bwd(const AttnBwdParams& params, cudaStream_t stream);

// Whether run_bwd<T, kHeadDim> tries the warp-specialized TMA backward first
// for these params (flash_launch.cuh: the dispatch's own rule). Only that
// kernel reads the zeroed dQ semaphores of the deterministic mode, and only it
// needs the fp32 dQ accumulator there: the binding layer asks before
// allocating them. Reads device_arch, allow_tma and the varlen fields.
template <typename T, int kHeadDim>
bool bwd_tries_sm90_ws(const AttnBwdParams& params);

}  // namespace flashattn
