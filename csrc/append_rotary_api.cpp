#include "append_rotary_api.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <limits>
#include <sstream>
#include <string>

#include "kvcache_api.h"

namespace flashattn {
namespace {

constexpr const char* kOp = "flashattn_ext: kvcache_append_rotary: ";

// t (called name) on k_cache's device, in its dtype.
void check_like_cache(const at::Tensor& t, const char* name, const at::Tensor& k_cache) {
  TORCH_CHECK_VALUE(t.device() == k_cache.device(), kOp, name, " is on ", t.device(), " but k_cache is on ",
                    k_cache.device(), "; move them to one device");
  TORCH_CHECK_TYPE(t.scalar_type() == k_cache.scalar_type(), kOp, name, " has dtype ", t.scalar_type(),
                   " but k_cache has ", k_cache.scalar_type(), "; cast them to one dtype");
}

// int32 index tensors on k_cache's device.
void check_int32(const at::Tensor& t, const char* name, const at::Tensor& k_cache) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt, kOp, name, " must have dtype torch.int32, got ", t.scalar_type(),
                   "; pass ", name, ".to(torch.int32)");
  TORCH_CHECK_VALUE(t.device() == k_cache.device(), kOp, name, " is on ", t.device(), " but k_cache is on ",
                    k_cache.device(), "; move them to one device");
}

}  // namespace

void check_append_rotary(const AppendRotaryInputs& in, const BackendSpec& spec) {
  const at::Tensor &kc = in.k_cache, &vc = in.v_cache;
  TORCH_CHECK_VALUE(kc.dim() == 4, kOp, "k_cache must have 4 dimensions ", kKvCacheLayout, ", got shape ",
                    shape_str(kc));
  TORCH_CHECK_VALUE(vc.sizes() == kc.sizes(), kOp, "v_cache has shape ", shape_str(vc), " but k_cache has ",
                    shape_str(kc), "; they must match");
  check_like_cache(vc, "v_cache", kc);
  bool dtype_ok = false;
  std::ostringstream names;
  for (size_t i = 0; i < spec.dtypes.size(); ++i) {
    dtype_ok |= kc.scalar_type() == spec.dtypes[i];
    names << (i ? ", " : "") << spec.dtypes[i];
  }
  TORCH_CHECK_TYPE(dtype_ok, kOp, "k_cache has dtype ", kc.scalar_type(), ", which the ", spec.name,
                   " kernels do not support; use one of ", names.str(), spec.dtype_hint);
  for (const auto& [t, name] : {std::pair{&kc, "k_cache"}, std::pair{&vc, "v_cache"}}) {
    TORCH_CHECK_VALUE(t->stride(3) == 1 || t->size(3) == 1, kOp, name,
                      " must have stride 1 in its last (head_dim) dimension; the cache is updated in place: "
                      "allocate it contiguous in head_dim");
  }
  const int64_t heads_kv = kc.size(2), head_dim = kc.size(3);
  const at::Tensor& seqlens = in.cache_seqlens;
  check_int32(seqlens, "cache_seqlens", kc);
  TORCH_CHECK_VALUE(seqlens.dim() == 1, kOp, "cache_seqlens must have shape (batch,), got ", shape_str(seqlens));
  const int64_t batch = seqlens.size(0);
  if (in.q) {
    const at::Tensor& q = *in.q;
    TORCH_CHECK_VALUE(q.dim() == 4 && q.size(0) == batch && q.size(3) == head_dim, kOp,
                      "q must have shape (batch, seqlen_q, heads_q, head_dim) = (", batch, ", *, *, ", head_dim,
                      "), got ", shape_str(q));
    check_like_cache(q, "q", kc);
  }
  TORCH_CHECK_VALUE(in.k.has_value() == in.v.has_value(), kOp, "k and v must be given together, got only ",
                    in.k ? "k" : "v");
  if (in.k) {
    for (const auto& [t, name] : {std::pair{&*in.k, "k"}, std::pair{&*in.v, "v"}}) {
      TORCH_CHECK_VALUE(t->dim() == 4 && t->size(0) == batch && t->size(2) == heads_kv && t->size(3) == head_dim, kOp,
                        name, " must have shape (batch, seqlen_new, heads_kv, head_dim) = (", batch, ", *, ", heads_kv,
                        ", ", head_dim, "), got ", shape_str(*t));
      check_like_cache(*t, name, kc);
    }
    TORCH_CHECK_VALUE(in.v->size(1) == in.k->size(1), kOp, "v has shape ", shape_str(*in.v), " but k has ",
                      shape_str(*in.k), "; they must match");
  }
  if (in.batch_idx) {
    check_int32(*in.batch_idx, "cache_batch_idx", kc);
    TORCH_CHECK_VALUE(in.batch_idx->dim() == 1 && in.batch_idx->size(0) == batch, kOp,
                      "cache_batch_idx must have shape (batch,) = (", batch, ",), got ", shape_str(*in.batch_idx));
  }
  int64_t capacity = kc.size(1);
  if (in.block_table) {
    const at::Tensor& bt = *in.block_table;
    check_int32(bt, "block_table", kc);
    TORCH_CHECK_VALUE(bt.dim() == 2 && bt.size(0) == batch, kOp,
                      "block_table must have shape (batch, max_blocks_per_seq) = (", batch, ", *), got ",
                      shape_str(bt));
    TORCH_CHECK_VALUE(!in.batch_idx, kOp,
                      "cache_batch_idx cannot be combined with block_table (as in flash-attn); pass None");
    capacity = bt.size(1) * kc.size(1);
  } else if (!in.batch_idx) {
    TORCH_CHECK_VALUE(kc.size(0) == batch, kOp, "k_cache has ", kc.size(0), " rows but cache_seqlens has batch ", batch,
                      "; they must match unless cache_batch_idx maps batch rows to cache rows");
  }
  const int64_t seqlen_new = in.k ? in.k->size(1) : 0;
  TORCH_CHECK_VALUE(seqlen_new <= capacity, kOp, seqlen_new, " new tokens do not fit in a cache of ", capacity,
                    " positions per row");
  // The clamp of a cache row needs a row to land on (no batch row, no append: nothing is written).
  TORCH_CHECK_VALUE(seqlen_new == 0 || batch == 0 || kc.size(0) > 0, kOp,
                    "k_cache has no rows (blocks) to append the new keys to; pass a cache with at least one");
  TORCH_CHECK_VALUE(in.rotary_cos.has_value() == in.rotary_sin.has_value(), kOp,
                    "rotary_cos and rotary_sin must be given together");
  if (in.rotary_cos) {
    const at::Tensor &cos = *in.rotary_cos, &sin = *in.rotary_sin;
    for (const auto& [t, name] : {std::pair{&cos, "rotary_cos"}, std::pair{&sin, "rotary_sin"}}) {
      TORCH_CHECK_VALUE(t->dim() == 2, kOp, name, " must be 2-D (seqlen_ro, rotary_dim / 2), got shape ",
                        shape_str(*t));
      check_like_cache(*t, name, kc);
    }
    TORCH_CHECK_VALUE(sin.sizes() == cos.sizes(), kOp, "rotary_sin has shape ", shape_str(sin), " but rotary_cos has ",
                      shape_str(cos), "; they must match");
    TORCH_CHECK_VALUE(cos.size(1) >= 1 && 2 * cos.size(1) <= head_dim, kOp, "rotary_cos/rotary_sin have ", cos.size(1),
                      " columns (rotary_dim / 2); rotary_dim = ", 2 * cos.size(1),
                      " must be in [2, head_dim = ", head_dim, "]");
    TORCH_CHECK_VALUE(cos.size(0) >= 1, kOp,
                      "rotary_cos/rotary_sin have no rows (seqlen_ro = 0); pass the "
                      "tables of the positions to rotate");
  }
}

at::Tensor alloc_append_rotary_output(const AppendRotaryInputs& in) {
  if (!in.q) return at::empty({0}, in.k_cache.options());
  return at::empty(in.q->sizes(), in.q->options().memory_format(at::MemoryFormat::Contiguous));
}

AppendRotaryParams make_append_rotary_params(const AppendRotaryInputs& in, const at::Tensor& q_out) {
  AppendRotaryParams p;
  const at::Tensor &kc = in.k_cache, &vc = in.v_cache;
  p.batch = in.cache_seqlens.size(0);
  p.heads_kv = kc.size(2);
  p.head_dim = kc.size(3);
  if (in.q) {
    const at::Tensor& q = *in.q;
    p.q = q.data_ptr();
    p.q_out = q_out.data_ptr();
    p.q_batch_stride = q.stride(0), p.q_row_stride = q.stride(1), p.q_head_stride = q.stride(2);
    p.q_dim_stride = q.stride(3);
    p.seqlen_q = q.size(1);
    p.heads_q = q.size(2);
  }
  if (in.k) {
    const at::Tensor &k = *in.k, &v = *in.v;
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    p.k_batch_stride = k.stride(0), p.k_row_stride = k.stride(1), p.k_head_stride = k.stride(2),
    p.k_dim_stride = k.stride(3);
    p.v_batch_stride = v.stride(0), p.v_row_stride = v.stride(1), p.v_head_stride = v.stride(2),
    p.v_dim_stride = v.stride(3);
    p.seqlen_new = k.size(1);
  }
  p.k_cache = kc.data_ptr();
  p.v_cache = vc.data_ptr();
  p.kc_batch_stride = kc.stride(0), p.kc_row_stride = kc.stride(1), p.kc_head_stride = kc.stride(2);
  p.vc_batch_stride = vc.stride(0), p.vc_row_stride = vc.stride(1), p.vc_head_stride = vc.stride(2);
  p.seqlens = in.cache_seqlens.data_ptr<int32_t>();
  p.batch_idx = in.batch_idx ? in.batch_idx->data_ptr<int32_t>() : nullptr;
  p.cache_rows = kc.size(0);
  p.page_size = kc.size(1);
  p.capacity = kc.size(1);
  if (in.block_table) {
    p.block_table = in.block_table->data_ptr<int32_t>();
    p.block_table_stride = in.block_table->stride(0);
    p.block_table_col_stride = in.block_table->stride(1);
    p.capacity = in.block_table->size(1) * kc.size(1);
  }
  if (in.rotary_cos) {
    const at::Tensor &cos = *in.rotary_cos, &sin = *in.rotary_sin;
    p.cos = cos.data_ptr();
    p.sin = sin.data_ptr();
    p.cos_row_stride = cos.stride(0), p.cos_col_stride = cos.stride(1);
    p.sin_row_stride = sin.stride(0), p.sin_col_stride = sin.stride(1);
    p.rotary_dim = 2 * cos.size(1);
    p.seqlen_ro = cos.size(0);
  }
  p.interleaved = in.interleaved;
  p.q_per_token = in.q_per_token;
  return p;
}

}  // namespace flashattn
