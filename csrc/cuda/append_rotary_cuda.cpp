// CUDA implementation of flashattn_ext::kvcache_append_rotary: validation
// through the shared binding layer (append_rotary_api.h), the grid's limits,
// and one launch of append_rotary_kernel.cu on the current stream. Nothing
// here reads a device value (cache_seqlens, cache_batch_idx and block_table
// are read by the kernel), so a call captures in a CUDA graph.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <optional>

#include "../append_rotary_api.h"
#include "append_rotary_kernel.h"

namespace flashattn {
namespace {

const BackendSpec kAppendCudaSpec{"CUDA",
                                  {at::kHalf, at::kBFloat16},
                                  "; cast the cache to bfloat16 or float16 (the CUDA attention kernels take those)"};

at::Tensor kvcache_append_rotary_cuda(const std::optional<at::Tensor>& q, const std::optional<at::Tensor>& k,
                                      const std::optional<at::Tensor>& v, at::Tensor& k_cache, at::Tensor& v_cache,
                                      const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& batch_idx,
                                      const std::optional<at::Tensor>& block_table,
                                      const std::optional<at::Tensor>& rotary_cos,
                                      const std::optional<at::Tensor>& rotary_sin, bool interleaved, bool q_per_token) {
  const AppendRotaryInputs in{q,         k,           v,          k_cache,    v_cache,     cache_seqlens,
                              batch_idx, block_table, rotary_cos, rotary_sin, interleaved, q_per_token};
  check_append_rotary(in, kAppendCudaSpec);
  const c10::cuda::CUDAGuard guard(k_cache.device());
  // The kernel indexes the (batch,) vectors with unit stride: a strided view
  // is copied (on the device, no synchronisation; a no-op for the usual ones).
  const at::Tensor seqlens = cache_seqlens.contiguous();
  const std::optional<at::Tensor> idx = batch_idx ? std::optional<at::Tensor>(batch_idx->contiguous()) : std::nullopt;
  const AppendRotaryInputs inc{q,   k,           v,          k_cache,    v_cache,     seqlens,
                               idx, block_table, rotary_cos, rotary_sin, interleaved, q_per_token};
  at::Tensor q_out = alloc_append_rotary_output(inc);
  const AppendRotaryParams p = make_append_rotary_params(inc, q_out);
  const int64_t rows = std::max(q ? p.seqlen_q : 0, p.seqlen_new);
  TORCH_CHECK_VALUE(p.batch * rows <= std::numeric_limits<int32_t>::max(),
                    "flashattn_ext: kvcache_append_rotary on CUDA takes at most 2^31 - 1 (batch x token) rows, got ",
                    p.batch * rows, "; split the call");
  TORCH_CHECK_VALUE(std::max(p.heads_q, p.heads_kv) <= 65535,
                    "flashattn_ext: kvcache_append_rotary on CUDA takes at most 65535 heads, got ",
                    std::max(p.heads_q, p.heads_kv));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const cudaError_t err = k_cache.scalar_type() == at::kHalf ? launch_append_rotary<__half>(p, stream)
                                                             : launch_append_rotary<__nv_bfloat16>(p, stream);
  TORCH_CHECK(err == cudaSuccess,
              "flashattn_ext: CUDA kernel kvcache_append_rotary failed to launch: ", cudaGetErrorString(err));
  return q_out;
}

}  // namespace
}  // namespace flashattn

TORCH_LIBRARY_IMPL(flashattn_ext, CUDA, m) { m.impl("kvcache_append_rotary", &flashattn::kvcache_append_rotary_cuda); }
