// CUDA implementation of flashattn_ext::varlen_fwd_paged (flash_attn_varlen_func
// with block_table): one varlen forward over the packed queries whose kernels
// read the keys through the page table (KvCacheView, flash_params.h): the
// warp-specialized TMA forward on sm90 (per-page boxes, fwd_sm90_producer.cuh),
// the mma.sync forward elsewhere (row by row). Nothing here reads a device
// value: cu_seqlens and block_table stay on the device (values out of range
// are clamped by the kernels, not checked), and the call is capturable in a
// CUDA graph.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>

#include "../paged_varlen_api.h"
#include "binding_util.h"
#include "dispatch.h"

namespace flashattn {
namespace {

std::tuple<at::Tensor, at::Tensor> varlen_fwd_paged_cuda(const at::Tensor& q_in, const at::Tensor& k_cache_in,
                                                         const at::Tensor& v_cache_in, const at::Tensor& cu_seqlens_q,
                                                         const at::Tensor& cu_seqlens_k,
                                                         const at::Tensor& block_table_in, int64_t max_seqlen_q,
                                                         int64_t max_seqlen_k, double softmax_scale,
                                                         int64_t window_left, int64_t window_right, double softcap,
                                                         const std::optional<at::Tensor>& alibi_slopes) {
  check_paged_varlen({q_in, k_cache_in, v_cache_in, cu_seqlens_q, cu_seqlens_k, block_table_in, max_seqlen_q,
                      max_seqlen_k, softcap, alibi_slopes},
                     softmax_scale, window_left, window_right, kCudaSpec);
  check_device(q_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const int64_t head_dim = q_in.size(2);
  const int kdim = kernel_head_dim(head_dim);
  // The kernels copy 16-byte chunks (binding_util.h): a head dim that is not a
  // multiple of 8, or an oddly strided cache, is copied padded (for the caches
  // the whole cache on every call, as fwd_kvcache does; the README says so).
  const at::Tensor q = make_kernel_ready(q_in.unsqueeze(0))[0];  // (the helpers take 4-D tensors)
  const at::Tensor k_cache = make_kernel_ready(k_cache_in), v_cache = make_kernel_ready(v_cache_in);
  const at::Tensor block_table =
      block_table_in.size(1) > 1 && block_table_in.stride(1) != 1 ? block_table_in.contiguous() : block_table_in;
  auto [out, lse] = alloc_paged_varlen_outputs(q);
  const int64_t batch = cu_seqlens_q.size(0) - 1;
  TORCH_CHECK_VALUE((max_seqlen_q + 63) / 64 * batch * q.size(1) <= std::numeric_limits<int32_t>::max(),
                    "flashattn_ext: the forward needs more than 2^31 - 1 thread blocks; split the batch");
  if (out.numel() == 0) return {unpad(out.unsqueeze(0), head_dim)[0], lse};
  if (k_cache.size(0) == 0 || block_table.size(1) == 0) {  // no key anywhere: zeros, lse -inf
    out.zero_();
    lse.fill_(-std::numeric_limits<double>::infinity());
    return {unpad(out.unsqueeze(0), head_dim)[0], lse};
  }
  const PagedVarlenInputs in{q,           k_cache,      v_cache,      cu_seqlens_q, cu_seqlens_k,
                             block_table, max_seqlen_q, max_seqlen_k, softcap,      alibi_slopes};
  AttnFwdParams params = make_paged_varlen_params(in, out, lse, softmax_scale, window_left, window_right);
  params.device_arch = device_arch(q);
  params.allow_tma = !env_flag("FLASHATTN_DISABLE_TMA");
  const at::Tensor tile_counter = add_tile_counter(params, q);
  const auto stream = at::cuda::getCurrentCUDAStream().stream();
  const cudaError_t err = with_element_type(q.scalar_type(), [&](auto elem) {
    return with_kernel_head_dim(
        kdim, [&](auto dim) { return run_fwd<decltype(elem), decltype(dim)::value>(params, stream); });
  });
  TORCH_CHECK(err == cudaSuccess, "flashattn_ext: CUDA forward kernel (head dim ", kdim,
              ") failed on flash_attn_varlen_func with block_table: ", cudaGetErrorString(err));
  return {unpad(out.unsqueeze(0), head_dim)[0], lse};
}

}  // namespace
}  // namespace flashattn

TORCH_LIBRARY_IMPL(flashattn_ext, CUDA, m) { m.impl("varlen_fwd_paged", &flashattn::varlen_fwd_paged_cuda); }
