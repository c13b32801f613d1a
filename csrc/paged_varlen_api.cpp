#include "paged_varlen_api.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <string>

namespace flashattn {
namespace {

constexpr const char* kPagedLayout = "(num_blocks, page_size, heads_kv, head_dim)";

}  // namespace

void check_paged_varlen(const PagedVarlenInputs& in, double softmax_scale, int64_t window_left, int64_t window_right,
                        const BackendSpec& spec) {
  const at::Tensor &q = in.q, &k = in.k_cache, &v = in.v_cache;
  TORCH_CHECK_VALUE(q.dim() == 3, "flashattn_ext: q must have 3 dimensions (total_q, heads_q, head_dim), got shape ",
                    shape_str(q));
  TORCH_CHECK_VALUE(k.dim() == 4, "flashattn_ext: with block_table, k_cache is a paged cache ", kPagedLayout,
                    "; got shape ", shape_str(k));
  TORCH_CHECK_VALUE(v.sizes() == k.sizes(), "flashattn_ext: v_cache has shape ", shape_str(v), " but k_cache has ",
                    shape_str(k), "; they must match ", kPagedLayout);
  check_devices_and_dtypes(q, k, "k_cache", v, "v_cache", spec);
  const int64_t head_dim = q.size(2), heads_q = q.size(1), heads_kv = k.size(2), page = k.size(1);
  TORCH_CHECK_VALUE(k.size(3) == head_dim, "flashattn_ext: k_cache has head_dim ", k.size(3), " but q has ", head_dim,
                    "; they must match");
  TORCH_CHECK_VALUE(head_dim >= 1 && head_dim <= kMaxHeadDim, "flashattn_ext: head_dim ", head_dim, " is outside [1, ",
                    kMaxHeadDim, "], the head dims the kernels support");
  TORCH_CHECK_VALUE(heads_q >= 1 && heads_kv >= 1 && heads_q % heads_kv == 0, "flashattn_ext: q has ", heads_q,
                    " heads, not a multiple of the ", heads_kv,
                    " heads of k_cache/v_cache; for GQA/MQA the key/value heads must divide the query heads");
  TORCH_CHECK_VALUE(page >= 16 && page % 16 == 0, "flashattn_ext: with block_table, the page size (dimension 1 of ",
                    "k_cache, ", kPagedLayout, ") must be a positive multiple of 16, got ", page);
  for (const auto& [t, name] : {std::pair{&q, "q"}, std::pair{&k, "k_cache"}, std::pair{&v, "v_cache"}}) {
    TORCH_CHECK_VALUE(t->stride(-1) == 1 || t->size(-1) == 1, "flashattn_ext: ", name,
                      " must have stride 1 in its last (head_dim) dimension; pass a tensor whose head_dim is "
                      "contiguous");
    for (int64_t i = 0; i < t->dim(); ++i)
      TORCH_CHECK_VALUE(t->size(i) <= std::numeric_limits<int32_t>::max(), "flashattn_ext: ", name, " dimension ", i,
                        " has size ", t->size(i), ", larger than 2^31 - 1; split the call");
  }
  check_cu_seqlens(in.cu_seqlens_q, "cu_seqlens_q", q);
  check_cu_seqlens(in.cu_seqlens_k, "cu_seqlens_k", q);
  TORCH_CHECK_VALUE(in.cu_seqlens_q.size(0) == in.cu_seqlens_k.size(0), "flashattn_ext: cu_seqlens_q has ",
                    in.cu_seqlens_q.size(0), " elements but cu_seqlens_k has ", in.cu_seqlens_k.size(0),
                    "; both must be (batch + 1,)");
  const int64_t batch = in.cu_seqlens_q.size(0) - 1;
  const at::Tensor& bt = in.block_table;
  TORCH_CHECK_TYPE(bt.scalar_type() == at::kInt, "flashattn_ext: block_table must have dtype torch.int32, got ",
                   bt.scalar_type(), "; pass block_table.to(torch.int32)");
  TORCH_CHECK_VALUE(bt.dim() == 2 && bt.size(0) == batch,
                    "flashattn_ext: block_table must have shape (batch, max_blocks_per_seq) = (", batch, ", *), got ",
                    shape_str(bt));
  check_same_device(bt, "block_table", q);
  TORCH_CHECK_VALUE(bt.size(1) * page <= std::numeric_limits<int32_t>::max(), "flashattn_ext: block_table holds ",
                    bt.size(1), " blocks of ", page, " keys per sequence, more than 2^31 - 1 keys; split the cache");
  check_max_seqlen(in.max_seqlen_q, "max_seqlen_q");
  check_max_seqlen(in.max_seqlen_k, "max_seqlen_k");
  TORCH_CHECK_VALUE(window_left >= -1 && window_right >= -1,
                    "flashattn_ext: window sizes must be -1 (unbounded) or >= 0, got window_left=", window_left,
                    ", window_right=", window_right);
  TORCH_CHECK_VALUE(std::isfinite(softmax_scale), "flashattn_ext: softmax_scale must be finite, got ", softmax_scale);
}

std::tuple<at::Tensor, at::Tensor> alloc_paged_varlen_outputs(const at::Tensor& q) {
  const auto acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return {at::empty(q.sizes(), q.options()), at::empty({q.size(1), q.size(0)}, q.options().dtype(acc))};
}

AttnFwdParams make_paged_varlen_params(const PagedVarlenInputs& in, const at::Tensor& out, const at::Tensor& lse,
                                       double softmax_scale, int64_t window_left, int64_t window_right) {
  const at::Tensor &k = in.k_cache, &bt = in.block_table;
  const int64_t batch = in.cu_seqlens_q.size(0) - 1;
  const auto mask = make_mask(window_left, window_right, /*bottom_right=*/true, in.max_seqlen_q, in.max_seqlen_k);
  // The (1, total_q, heads, head_dim) views of q and out, the cache as it is:
  // its batch strides are the block strides the page table steps by.
  AttnFwdParams p = make_fwd_params(in.q.unsqueeze(0), k, in.v_cache, out.unsqueeze(0), lse, softmax_scale, mask);
  p.cu_seqlens_q = in.cu_seqlens_q.data_ptr<int>();
  p.cu_seqlens_k = in.cu_seqlens_k.data_ptr<int>();
  p.batch = static_cast<int>(batch);
  p.total_q = static_cast<int>(in.q.size(0));
  // cu_seqlens_k gives lengths only (SeqInfo): no packed key rows to clamp them to.
  p.total_k = std::numeric_limits<int32_t>::max();
  p.seqlen_q = static_cast<int>(in.max_seqlen_q);
  p.seqlen_k = static_cast<int>(in.max_seqlen_k);
  p.q_batch_stride = p.o_batch_stride = 0;
  p.kv.block_table = bt.data_ptr<int32_t>();
  p.kv.table_batch_stride = bt.stride(0);
  p.kv.max_blocks = static_cast<int>(bt.size(1));
  p.kv.page_size = static_cast<int>(k.size(1));
  p.kv.cache_rows = static_cast<int>(k.size(0));
  p.score_mod = make_score_mod(in.softcap, in.alibi_slopes, in.q, batch, in.q.size(1));
  return p;
}

}  // namespace flashattn
