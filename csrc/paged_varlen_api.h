// The binding layer of flashattn_ext::varlen_fwd_paged (flash_attn_varlen_func
// with block_table, flash-attn 2.8's paged KV), shared by the CPU and CUDA
// implementations: argument validation (each error names the argument and the
// fix), the outputs and, for the CUDA kernels, the torch-free AttnFwdParams.
//
// q (total_q, heads_q, head_dim) packed as in varlen_fwd (sequence b is rows
// cu_seqlens_q[b] .. cu_seqlens_q[b + 1]); k_cache, v_cache (num_blocks,
// page_size, heads_kv, head_dim); sequence b has cu_seqlens_k[b + 1] -
// cu_seqlens_k[b] keys (cu_seqlens_k's offsets do not locate them), key
// position p at row p % page_size of block block_table[b, p / page_size];
// causal and windows aligned bottom-right per sequence. Returns out like q and
// lse (heads_q, total_q). The values of the integer tensors are read by the
// CUDA kernels on the device (no host synchronisation; clamped, not checked)
// and checked by the CPU implementation.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "attention_api.h"

namespace flashattn {

struct PagedVarlenInputs {
  const at::Tensor& q;
  const at::Tensor& k_cache;
  const at::Tensor& v_cache;
  const at::Tensor& cu_seqlens_q;
  const at::Tensor& cu_seqlens_k;
  const at::Tensor& block_table;
  int64_t max_seqlen_q, max_seqlen_k;
  double softcap;
  const std::optional<at::Tensor>& alibi_slopes;
};

// Everything but the integer tensors' values.
void check_paged_varlen(const PagedVarlenInputs& in, double softmax_scale, int64_t window_left, int64_t window_right,
                        const BackendSpec& spec);

// out like q, lse (heads_q, total_q) in the accumulation type.
std::tuple<at::Tensor, at::Tensor> alloc_paged_varlen_outputs(const at::Tensor& q);

// The call as one varlen forward over the packed queries and the paged cache
// (KvCacheView in flash_params.h), for kernels that read SeqInfo.
AttnFwdParams make_paged_varlen_params(const PagedVarlenInputs& in, const at::Tensor& out, const at::Tensor& lse,
                                       double softmax_scale, int64_t window_left, int64_t window_right);

}  // namespace flashattn
