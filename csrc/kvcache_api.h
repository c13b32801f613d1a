// The binding layer of flashattn_ext::fwd_kvcache (attention against a KV
// cache), shared by the CPU and CUDA kernels: argument validation (shapes,
// dtypes, devices; each error names the argument and the fix), output
// allocation and the torch-free KvcacheParams. The values of the integer
// tensors are not read here: the CUDA kernels read them on the device (no host
// synchronisation), the CPU kernel checks them as it reads them.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "attention_api.h"
#include "kvcache_params.h"

namespace flashattn {

// k_cache / v_cache as the KV-cache ops take them, for error messages.
constexpr const char* kKvCacheLayout =
    "(batch_cache, seqlen_cache, heads_kv, head_dim), or with block_table (num_blocks, page_size, heads_kv, "
    "head_dim)";

struct KvcacheInputs {
  const at::Tensor& q;
  const at::Tensor& k_cache;
  const at::Tensor& v_cache;
  const at::Tensor& seqlens_k;
  const std::optional<at::Tensor>& batch_idx;
  const std::optional<at::Tensor>& leftpad;
  const std::optional<at::Tensor>& block_table;
  // flash-attn's score modifications (make_score_mod, attention_api.h).
  double softcap;
  const std::optional<at::Tensor>& alibi_slopes;
};

// Validates everything but the integer tensors' values, and the scalars.
void check_kvcache(const KvcacheInputs& in, double softmax_scale, int64_t window_left, int64_t window_right,
                   int64_t num_splits, const BackendSpec& spec);

// Keys a row can hold: seqlen_cache, or max_blocks_per_seq * page_size when paged.
int64_t kvcache_capacity(const KvcacheInputs& in);

// out (batch, seqlen_q, heads_q, head_dim) in q's dtype, lse (batch, heads_q, seqlen_q).
std::tuple<at::Tensor, at::Tensor> alloc_kvcache_outputs(const at::Tensor& q);

// bhsd=True (the schema's flag): q, k_cache, v_cache given in torch's (batch,
// heads, seqlen, head_dim) layout; the kernel layout is their transpose(1, 2).
// Returns the tensor as the kernels take it (a view, no copy), and checks that
// bhsd comes without block_table (a paged cache has no such layout).
at::Tensor kernel_layout(const at::Tensor& t, bool bhsd);
void check_bhsd(bool bhsd, const std::optional<at::Tensor>& block_table);

// The fwd_kvcache kernel a backend registers: its implementation `Impl` (the
// op's arguments but bhsd, kernel layout) with the bhsd flag applied around it:
// the inputs as kernel-layout views, the output back as a view (see ops.cpp).
template <auto Impl>
std::tuple<at::Tensor, at::Tensor> fwd_kvcache_entry(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& seqlens_k,
    const std::optional<at::Tensor>& batch_idx, const std::optional<at::Tensor>& leftpad,
    const std::optional<at::Tensor>& block_table, double softmax_scale, int64_t window_left, int64_t window_right,
    int64_t num_splits, bool bhsd, double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  check_bhsd(bhsd, block_table);
  auto [out, lse] =
      Impl(kernel_layout(q, bhsd), kernel_layout(k_cache, bhsd), kernel_layout(v_cache, bhsd), seqlens_k, batch_idx,
           leftpad, block_table, softmax_scale, window_left, window_right, num_splits, softcap, alibi_slopes);
  return {kernel_layout(out, bhsd), lse};
}

// Fills the params (sizes, strides, pointers, scalars); num_splits and the
// workspace are the CUDA binding's business. An undefined in.seqlens_k (not
// from the op: fwd's short queries on CUDA's decoding kernel) leaves
// seqlens_k nullptr, every row holding the whole cache (row_seqlen_k).
KvcacheParams make_kvcache_params(const KvcacheInputs& in, const at::Tensor& out, const at::Tensor& lse,
                                  double softmax_scale, int64_t window_left, int64_t window_right);

}  // namespace flashattn
