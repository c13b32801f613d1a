#include "kvcache_api.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <string>

namespace flashattn {
namespace {

// cache_seqlens-like arguments: int32 (batch,) on q's device.
void check_int_vector(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt, "flashattn_ext: ", name, " must have dtype torch.int32, got ",
                   t.scalar_type(), "; pass ", name, ".to(torch.int32)");
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == q.size(0), "flashattn_ext: ", name, " must have shape (batch,) = (",
                    q.size(0), ",), got ", shape_str(t));
  check_same_device(t, name, q);
}

}  // namespace

void check_kvcache(const KvcacheInputs& in, double softmax_scale, int64_t window_left, int64_t window_right,
                   int64_t num_splits, const BackendSpec& spec) {
  const at::Tensor& q = in.q;
  TORCH_CHECK_VALUE(q.dim() == 4, "flashattn_ext: q must have 4 dimensions (batch, seqlen_q, heads_q, head_dim), ",
                    "got shape ", shape_str(q));
  TORCH_CHECK_VALUE(in.k_cache.dim() == 4, "flashattn_ext: k_cache must have 4 dimensions ", kKvCacheLayout,
                    ", got shape ", shape_str(in.k_cache));
  TORCH_CHECK_VALUE(in.v_cache.dim() == 4, "flashattn_ext: v_cache must have 4 dimensions ", kKvCacheLayout,
                    ", got shape ", shape_str(in.v_cache));
  check_devices_and_dtypes(q, in.k_cache, "k_cache", in.v_cache, "v_cache", spec);
  TORCH_CHECK_VALUE(in.v_cache.sizes() == in.k_cache.sizes(), "flashattn_ext: v_cache has shape ",
                    shape_str(in.v_cache), " but k_cache has ", shape_str(in.k_cache), "; they must match");
  const int64_t head_dim = q.size(3), heads_q = q.size(2), heads_kv = in.k_cache.size(2);
  TORCH_CHECK_VALUE(in.k_cache.size(3) == head_dim, "flashattn_ext: k_cache has head_dim ", in.k_cache.size(3),
                    " but q has ", head_dim, "; they must match");
  TORCH_CHECK_VALUE(head_dim >= 1 && head_dim <= kMaxHeadDim, "flashattn_ext: head_dim ", head_dim, " is outside [1, ",
                    kMaxHeadDim, "], the head dims the kernels support");
  TORCH_CHECK_VALUE(heads_q >= 1 && heads_kv >= 1 && heads_q % heads_kv == 0, "flashattn_ext: q has ", heads_q,
                    " heads, not a multiple of the ", heads_kv,
                    " heads of k_cache/v_cache; for GQA/MQA the key/value heads must divide the query heads");
  for (const auto& [t, name] :
       {std::pair{&q, "q"}, std::pair{&in.k_cache, "k_cache"}, std::pair{&in.v_cache, "v_cache"}}) {
    TORCH_CHECK_VALUE(t->stride(3) == 1 || t->size(3) == 1, "flashattn_ext: ", name,
                      " must have stride 1 in its last (head_dim) dimension; pass a tensor whose head_dim is "
                      "contiguous");
    for (int64_t i = 0; i < 4; ++i) {
      TORCH_CHECK_VALUE(t->size(i) <= std::numeric_limits<int32_t>::max(), "flashattn_ext: ", name, " dimension ", i,
                        " has size ", t->size(i), ", larger than 2^31 - 1; split the call");
    }
  }
  check_int_vector(in.seqlens_k, "seqlens_k", q);
  if (in.batch_idx) check_int_vector(*in.batch_idx, "cache_batch_idx", q);
  if (in.leftpad) check_int_vector(*in.leftpad, "cache_leftpad", q);
  if (in.block_table) {
    const at::Tensor& bt = *in.block_table;
    TORCH_CHECK_TYPE(bt.scalar_type() == at::kInt, "flashattn_ext: block_table must have dtype torch.int32, got ",
                     bt.scalar_type(), "; pass block_table.to(torch.int32)");
    TORCH_CHECK_VALUE(bt.dim() == 2 && bt.size(0) == q.size(0),
                      "flashattn_ext: block_table must have shape (batch, max_blocks_per_seq) = (", q.size(0),
                      ", *), got ", shape_str(bt));
    check_same_device(bt, "block_table", q);
    TORCH_CHECK_VALUE(!in.batch_idx,
                      "flashattn_ext: cache_batch_idx cannot be combined with block_table (as in "
                      "flash-attn); pass None");
    TORCH_CHECK_VALUE(bt.size(1) * in.k_cache.size(1) <= std::numeric_limits<int32_t>::max(),
                      "flashattn_ext: block_table holds ", bt.size(1), " blocks of ", in.k_cache.size(1),
                      " keys per row, more than 2^31 - 1 keys; split the cache");
  } else if (!in.batch_idx) {
    TORCH_CHECK_VALUE(in.k_cache.size(0) == q.size(0), "flashattn_ext: k_cache has ", in.k_cache.size(0),
                      " rows but q has batch ", q.size(0),
                      "; they must match unless cache_batch_idx maps batch rows to cache rows");
  }
  TORCH_CHECK_VALUE(window_left >= -1 && window_right >= -1,
                    "flashattn_ext: window sizes must be -1 (unbounded) or >= 0, got window_left=", window_left,
                    ", window_right=", window_right);
  TORCH_CHECK_VALUE(std::isfinite(softmax_scale), "flashattn_ext: softmax_scale must be finite, got ", softmax_scale);
  TORCH_CHECK_VALUE(num_splits >= 0, "flashattn_ext: num_splits must be >= 0 (0: automatic), got ", num_splits);
}

at::Tensor kernel_layout(const at::Tensor& t, bool bhsd) { return bhsd && t.dim() == 4 ? t.transpose(1, 2) : t; }

void check_bhsd(bool bhsd, const std::optional<at::Tensor>& block_table) {
  TORCH_CHECK_VALUE(!bhsd || !block_table,
                    "flashattn_ext: fwd_kvcache with bhsd=True takes a contiguous (batch, heads_kv, seqlen, head_dim) "
                    "cache, not a paged one; pass block_table=None or bhsd=False");
}

int64_t kvcache_capacity(const KvcacheInputs& in) {
  return in.block_table ? in.block_table->size(1) * in.k_cache.size(1) : in.k_cache.size(1);
}

std::tuple<at::Tensor, at::Tensor> alloc_kvcache_outputs(const at::Tensor& q) { return alloc_fwd_outputs(q); }

KvcacheParams make_kvcache_params(const KvcacheInputs& in, const at::Tensor& out, const at::Tensor& lse,
                                  double softmax_scale, int64_t window_left, int64_t window_right) {
  const at::Tensor &q = in.q, &k = in.k_cache, &v = in.v_cache;
  KvcacheParams p;
  set_qkvo(p, q, k, v, out, lse);
  p.seqlens_k = in.seqlens_k.defined() ? in.seqlens_k.data_ptr<int32_t>() : nullptr;  // undefined: rows full
  p.batch_idx = in.batch_idx ? in.batch_idx->data_ptr<int32_t>() : nullptr;
  p.leftpad = in.leftpad ? in.leftpad->data_ptr<int32_t>() : nullptr;
  p.block_table = in.block_table ? in.block_table->data_ptr<int32_t>() : nullptr;
  p.block_table_batch_stride = in.block_table ? in.block_table->stride(0) : 0;
  p.batch = static_cast<int>(q.size(0));
  p.seqlen_q = static_cast<int>(q.size(1));
  p.heads_q = static_cast<int>(q.size(2));
  p.heads_kv = static_cast<int>(k.size(2));
  p.head_dim = static_cast<int>(q.size(3));
  p.cache_rows = static_cast<int>(k.size(0));
  p.page_size = in.block_table ? static_cast<int>(k.size(1)) : 0;
  const int64_t capacity = kvcache_capacity(in);
  p.capacity = static_cast<int>(capacity);
  // A window reaching past every key masks nothing: keep the unbounded form
  // (and stay inside int).
  const int64_t reach = capacity + q.size(1);
  p.window_left = window_left >= reach ? -1 : static_cast<int>(window_left);
  p.window_right = window_right >= reach ? -1 : static_cast<int>(window_right);
  p.softmax_scale = softmax_scale;
  p.softmax_scale_log2 = static_cast<float>(softmax_scale * M_LOG2E);
  p.score_mod = make_score_mod(in.softcap, in.alibi_slopes, q, q.size(0), q.size(2));
  return p;
}

}  // namespace flashattn
