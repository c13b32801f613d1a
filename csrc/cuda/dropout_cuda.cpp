// The CUDA implementations of the dropout ops (schemas in ../ops.cpp, the CPU
// ones in ../dropout_api.cpp).
//
// dropout_rng_state: torch's graph-safe draw, as FlashAttention-2 makes it:
// philox_cuda_state(increment) under the CUDA generator's mutex (the offset
// advances by dropout_offset_increment of ../philox.h, a multiple of 4 as the
// generator requires), unpacked on the device into an int64 (2,) CUDA tensor
// [seed, offset]. No host synchronisation; under CUDA graph capture the
// unpack reads the generator's seed and offset when it runs, so that every
// replay draws a fresh mask (and torch.manual_seed reproduces eager runs).
//
// dropout_keep_mask: the keep mask drawn on the device from a CUDA rng_state,
// bit for bit the CPU op's for the same [seed, offset].
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <mutex>

#include "../attention_api.h"
#include "../philox.h"
#include "dropout_kernels.h"

namespace flashattn {
namespace {

at::Tensor dropout_rng_state_cuda(const at::Tensor& like, int64_t batch, int64_t heads_q) {
  TORCH_CHECK_VALUE(batch >= 0 && heads_q >= 0, "flashattn_ext: dropout_rng_state: batch and heads_q must be >= 0");
  const c10::cuda::CUDAGuard guard(like.device());
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(like.device().index()));
  at::PhiloxCudaState philox;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    philox = gen->philox_cuda_state(dropout_offset_increment(batch, heads_q));
  }
  at::Tensor state = at::empty({2}, like.options().dtype(at::kLong));
  const cudaError_t err =
      launch_unpack_rng_state(philox, state.data_ptr<int64_t>(), at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "flashattn_ext: dropout_rng_state's kernel failed: ", cudaGetErrorString(err));
  return state;
}

at::Tensor dropout_keep_mask_cuda(const at::Tensor& rng_state, int64_t batch, int64_t heads_q, int64_t seqlen_q,
                                  int64_t seqlen_k, double dropout_p) {
  TORCH_CHECK_VALUE(batch >= 0 && heads_q >= 0 && seqlen_q >= 0 && seqlen_k >= 0,
                    "flashattn_ext: dropout_keep_mask: sizes must be >= 0");
  const c10::cuda::CUDAGuard guard(rng_state.device());
  // make_dropout checks rng_state (on its own device: the mask is drawn there) whenever p > 0.
  DropoutParams d = make_dropout(dropout_p, rng_state, rng_state.device());
  // p = 0 keeps everything (and needs no rng_state read: the threshold passes every slice).
  const uint32_t threshold = d.enabled() ? d.keep_threshold : dropout_keep_threshold(0.0);
  at::Tensor keep = at::empty({batch, heads_q, seqlen_q, seqlen_k}, rng_state.options().dtype(at::kBool));
  if (!d.enabled()) return keep.fill_(true);
  const cudaError_t err = launch_keep_mask(d.rng_state, threshold, batch, heads_q, seqlen_q, seqlen_k,
                                           keep.data_ptr<bool>(), at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "flashattn_ext: dropout_keep_mask's kernel failed: ", cudaGetErrorString(err));
  return keep;
}

}  // namespace
}  // namespace flashattn

TORCH_LIBRARY_IMPL(flashattn_ext, CUDA, m) {
  m.impl("dropout_rng_state", &flashattn::dropout_rng_state_cuda);
  m.impl("dropout_keep_mask", &flashattn::dropout_keep_mask_cuda);
}
