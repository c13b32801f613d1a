#include "attention_api.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>

namespace flashattn {

std::string shape_str(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

namespace {

std::string strides_str(const at::Tensor& t) {
  std::ostringstream os;
  os << t.strides();
  return os.str();
}

std::string dtype_list(const BackendSpec& spec) {
  std::string s;
  for (auto d : spec.dtypes) {
    if (!s.empty()) s += ", ";
    s += c10::toString(d);
  }
  return s;
}

void check_rank4(const at::Tensor& t, const char* name, const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == 4, "flashattn_ext: ", name, " must have 4 dimensions ", layout, ", got shape ",
                    shape_str(t), "; reshape it (flash_attn_func takes (batch, seqlen, heads, head_dim))");
}

// Zero batch, heads or sequence lengths are calls with nothing to compute
// (is_empty_call); a zero head_dim has no meaning (no scale 1 / sqrt(0)).
void check_head_dim_nonzero(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.size(-1) > 0, "flashattn_ext: ", name, " has head_dim 0 (shape ", shape_str(t),
                    "); the head dimension must be at least 1");
}

void check_last_dim_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.stride(-1) == 1, "flashattn_ext: ", name,
                    " must have stride 1 in its last (head_dim) dimension, got strides ", strides_str(t), "; pass ",
                    name,
                    ".contiguous() (flash_attn_func and scaled_dot_product_attention do this only "
                    "when needed)");
}

void check_same_dtype(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK_TYPE(t.scalar_type() == q.scalar_type(), "flashattn_ext: ", name, " has dtype ", t.scalar_type(),
                   " but q has dtype ", q.scalar_type(), "; cast them to one dtype");
}

// The kernels index with 64-bit offsets but size loop bounds with int.
void check_fits_int(const at::Tensor& t, const char* name) {
  for (int64_t i = 0; i < t.dim(); ++i) {
    TORCH_CHECK_VALUE(t.size(i) <= INT32_MAX, "flashattn_ext: ", name, " dimension ", i, " has size ", t.size(i),
                      ", larger than 2^31 - 1; split the call");
  }
}

void check_head_dim_supported(int64_t head_dim) {
  TORCH_CHECK_VALUE(head_dim <= kMaxHeadDim, "flashattn_ext: head_dim ", head_dim, " is larger than ", kMaxHeadDim,
                    ", the largest the kernels support; split the heads or use torch's attention");
}

void check_heads_divide(int64_t heads_q, int64_t heads_kv) {
  TORCH_CHECK_VALUE(heads_kv == 0 ? heads_q == 0 : heads_q % heads_kv == 0, "flashattn_ext: q has ", heads_q,
                    " heads, not a multiple of the ", heads_kv,
                    " heads of k and v; for GQA/MQA the key/value heads must divide the query heads");
}

void check_qkv_last_dim_contiguous(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_last_dim_contiguous(q, "q");
  check_last_dim_contiguous(k, "k");
  check_last_dim_contiguous(v, "v");
}

// dout, out and lse of either backward against q; lse_shape is the shape of
// the forward's lse, lse_layout the names of its dimensions.
void check_bwd_tensors(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& out, const at::Tensor& lse,
                       at::IntArrayRef lse_shape, const char* lse_layout) {
  check_same_device(dout, "dout", q);
  check_same_device(out, "out", q);
  check_same_device(lse, "lse", q);
  check_same_dtype(dout, "dout", q);
  check_same_dtype(out, "out", q);
  TORCH_CHECK_VALUE(dout.sizes() == q.sizes(), "flashattn_ext: dout has shape ", shape_str(dout), " but q has ",
                    shape_str(q), "; dout must have the shape of the forward output");
  TORCH_CHECK_VALUE(out.sizes() == q.sizes(), "flashattn_ext: out has shape ", shape_str(out), " but q has ",
                    shape_str(q), "; pass the output of the forward");
  TORCH_CHECK_TYPE(lse.scalar_type() == lse_dtype(q.scalar_type()), "flashattn_ext: lse has dtype ", lse.scalar_type(),
                   ", expected ", lse_dtype(q.scalar_type()), "; pass the lse of the forward");
  TORCH_CHECK_VALUE(lse.sizes() == lse_shape, "flashattn_ext: lse has shape ", shape_str(lse), ", expected ",
                    lse_layout, " = (", c10::Join(", ", lse_shape), "); pass the lse of the forward");
  TORCH_CHECK_VALUE(lse.is_contiguous(), "flashattn_ext: lse must be contiguous; pass the lse of the forward");
  check_last_dim_contiguous(dout, "dout");
  check_last_dim_contiguous(out, "out");
}

}  // namespace

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK_VALUE(t.device() == q.device(), "flashattn_ext: ", name, " is on ", t.device(), " but q is on ",
                    q.device(), "; move them to one device");
}

void check_devices_and_dtypes(const at::Tensor& q, const at::Tensor& k, const char* k_name, const at::Tensor& v,
                              const char* v_name, const BackendSpec& spec) {
  check_same_device(k, k_name, q);
  check_same_device(v, v_name, q);
  check_same_dtype(k, k_name, q);
  check_same_dtype(v, v_name, q);
  bool dtype_ok = false;
  for (auto d : spec.dtypes) dtype_ok |= (q.scalar_type() == d);
  TORCH_CHECK_TYPE(dtype_ok, "flashattn_ext: q has dtype ", q.scalar_type(), ", which the ", spec.name,
                   " kernels do not support; use one of ", dtype_list(spec), spec.dtype_hint);
}

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const BackendSpec& spec) {
  check_rank4(q, "q", "(batch, seqlen_q, heads_q, head_dim)");
  check_rank4(k, "k", "(batch, seqlen_k, heads_kv, head_dim)");
  check_rank4(v, "v", "(batch, seqlen_k, heads_kv, head_dim)");
  check_devices_and_dtypes(q, k, "k", v, "v", spec);
  check_head_dim_nonzero(q, "q");
  check_head_dim_nonzero(k, "k");
  check_head_dim_nonzero(v, "v");
  check_fits_int(q, "q");
  check_fits_int(k, "k");

  const int64_t head_dim = q.size(3);
  TORCH_CHECK_VALUE(k.size(3) == head_dim, "flashattn_ext: k has head_dim ", k.size(3), " but q has head_dim ",
                    head_dim, "; q and k must share their last dimension");
  TORCH_CHECK_VALUE(v.size(3) == head_dim, "flashattn_ext: v has head_dim ", v.size(3), " but q has ", head_dim,
                    "; a value head dim different from the query's is not supported by the kernels "
                    "(scaled_dot_product_attention falls back to torch for it)");
  check_head_dim_supported(head_dim);
  TORCH_CHECK_VALUE(k.size(0) == q.size(0) && v.size(0) == q.size(0), "flashattn_ext: batch sizes differ: q ",
                    q.size(0), ", k ", k.size(0), ", v ", v.size(0), "; q, k and v must share dimension 0");
  TORCH_CHECK_VALUE(v.size(1) == k.size(1), "flashattn_ext: v has seqlen ", v.size(1), " but k has ", k.size(1),
                    "; k and v must share dimension 1 (seqlen_k)");
  TORCH_CHECK_VALUE(v.size(2) == k.size(2), "flashattn_ext: v has ", v.size(2), " heads but k has ", k.size(2),
                    "; k and v must share dimension 2 (heads_kv)");
  check_heads_divide(q.size(2), k.size(2));
  check_qkv_last_dim_contiguous(q, k, v);
}

void reject_backend(const std::vector<std::pair<const at::Tensor*, const char*>>& tensors) {
  for (const auto& [t, name] : tensors) {
    if (!t->defined()) continue;
    TORCH_CHECK_TYPE(
        !t->is_nested(), "flashattn_ext: ", name, " is a nested tensor; the kernels take dense ",
        "(strided) tensors of one shape: pad the batch, or use torch.nn.functional.scaled_dot_product_attention");
    TORCH_CHECK_TYPE(!t->is_quantized(), "flashattn_ext: ", name, " is quantized (", t->scalar_type(), "); pass ", name,
                     ".dequantize()");
    TORCH_CHECK_TYPE(t->layout() == at::kStrided && !t->is_mkldnn(), "flashattn_ext: ", name, " has layout ",
                     t->layout(), "; the kernels take dense (strided) tensors: pass ", name, ".to_dense()");
    const auto type = t->device().type();
#ifdef FLASHATTN_WITH_CUDA
    const bool has_kernels = type == at::kCPU || type == at::kCUDA || type == at::kMeta;
#else
    TORCH_CHECK_NOT_IMPLEMENTED(type != at::kCUDA, "flashattn_ext: ", name, " is on ", t->device(),
                                " but this build of flashattn_ext has no CUDA kernels (built without nvcc or with "
                                "FLASHATTN_CPU_ONLY=1); rebuild with CUDA, or use the CPU");
    const bool has_kernels = type == at::kCPU || type == at::kMeta;
#endif
    TORCH_CHECK_NOT_IMPLEMENTED(has_kernels, "flashattn_ext: ", name, " is on ", t->device(),
                                ", which has no flashattn_ext kernels (cpu and cuda only); move the tensors, or use "
                                "torch.nn.functional.scaled_dot_product_attention");
  }
  std::ostringstream os;
  for (const auto& [t, name] : tensors) {
    if (t->defined()) os << " " << name << ": " << t->toString() << " on " << t->device() << ";";
  }
  TORCH_CHECK_NOT_IMPLEMENTED(false, "flashattn_ext: no kernel for these inputs (", os.str(), ")");
}

void check_bwd_extras(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& out, const at::Tensor& lse) {
  check_bwd_tensors(dout, q, out, lse, {q.size(0), q.size(2), q.size(1)}, "(batch, heads_q, seqlen_q)");
}

DropoutParams make_dropout(double dropout_p, const std::optional<at::Tensor>& rng_state, const at::Device& device) {
  TORCH_CHECK_VALUE(std::isfinite(dropout_p) && dropout_p >= 0.0 && dropout_p <= 1.0,
                    "flashattn_ext: dropout_p must be in [0, 1], got ", dropout_p);
  DropoutParams d;
  if (dropout_p == 0.0) return d;
  TORCH_CHECK_VALUE(rng_state.has_value() && rng_state->defined(),
                    "flashattn_ext: dropout_p > 0 needs rng_state, an int64 (2,) tensor [seed, offset] "
                    "(flashattn_ext::dropout_rng_state draws one)");
  const at::Tensor& s = *rng_state;
  // On q's device: the CPU kernels read it here, the CUDA kernels on the
  // device (a host read would synchronise, and a captured graph would replay
  // the captured values instead of the generator's advancing offset).
  TORCH_CHECK_VALUE(s.scalar_type() == at::kLong && s.dim() == 1 && s.size(0) == 2 && s.device() == device,
                    "flashattn_ext: rng_state must be an int64 (2,) tensor [seed, offset] on ", device,
                    " (q's device), got ", s.scalar_type(), " of shape ", s.sizes(), " on ", s.device());
  d.p = dropout_p;
  d.keep_threshold = dropout_keep_threshold(dropout_p);
  d.scale = dropout_p < 1.0 ? 1.0 / (1.0 - dropout_p) : 0.0;
  if (device.is_cpu()) {
    const at::Tensor c = s.contiguous();
    d.seed = static_cast<uint64_t>(c.data_ptr<int64_t>()[0]);
    d.offset = static_cast<uint64_t>(c.data_ptr<int64_t>()[1]);
  } else {
    // (No copy: the kernels are queued after this returns, a copy's memory could be reused before they read it.)
    TORCH_CHECK_VALUE(s.stride(0) == 1, "flashattn_ext: rng_state must be contiguous, got stride ", s.stride(0));
    d.rng_state = s.data_ptr<int64_t>();
  }
  return d;
}

bool is_empty_call(const at::Tensor& q, const at::Tensor& k) { return q.numel() == 0 || k.size(1) == 0; }

ScoreMod make_score_mod(double softcap, const std::optional<at::Tensor>& alibi_slopes, const at::Tensor& q,
                        int64_t batch, int64_t heads_q) {
  ScoreMod mod;
  TORCH_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0,
                    "flashattn_ext: softcap must be a finite number >= 0 (0: no softcapping), got ", softcap);
  mod.softcap = softcap;
  if (!alibi_slopes.has_value() || !alibi_slopes->defined()) return mod;
  const at::Tensor& s = *alibi_slopes;
  TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat, "flashattn_ext: alibi_slopes must have dtype torch.float32, got ",
                   s.scalar_type(), "; pass alibi_slopes.float()");
  TORCH_CHECK_VALUE(s.device() == q.device(), "flashattn_ext: alibi_slopes is on ", s.device(), " but q is on ",
                    q.device(), "; pass alibi_slopes.to(q.device)");
  const bool per_head = s.dim() == 1 && s.size(0) == heads_q;
  const bool per_batch = s.dim() == 2 && s.size(0) == batch && s.size(1) == heads_q;
  TORCH_CHECK_VALUE(per_head || per_batch, "flashattn_ext: alibi_slopes must have shape (nheads,) = (", heads_q,
                    ",) or (batch, nheads) = (", batch, ", ", heads_q, "), got ", s.sizes());
  TORCH_CHECK_VALUE(heads_q <= 1 || s.stride(-1) == 1,
                    "flashattn_ext: alibi_slopes must have a unit stride on the heads; pass alibi_slopes.contiguous()");
  mod.alibi_slopes = s.data_ptr<float>();
  mod.alibi_batch_stride = per_batch && batch > 1 ? s.stride(0) : 0;
  return mod;
}

void add_attn_mask(ScoreMod& mod, const std::optional<at::Tensor>& attn_mask, const at::Tensor& q,
                   const at::Tensor& k) {
  if (!attn_mask.has_value() || !attn_mask->defined()) return;
  const at::Tensor& m = *attn_mask;
  TORCH_CHECK_VALUE(!mod.has_softcap() && !mod.has_alibi(),
                    "flashattn_ext: attn_mask cannot be combined with softcap or alibi_slopes; add them to the mask");
  const auto dt = m.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kBool || dt == at::kFloat || dt == q.scalar_type(),
                   "flashattn_ext: attn_mask must be bool, float32 or the dtype of q (", q.scalar_type(), "), got ", dt,
                   "; pass attn_mask.to(q.dtype)");
  TORCH_CHECK_VALUE(m.device() == q.device(), "flashattn_ext: attn_mask is on ", m.device(), " but q is on ",
                    q.device(), "; pass attn_mask.to(q.device)");
  TORCH_CHECK_VALUE(!m.is_nested() && m.layout() == at::kStrided, "flashattn_ext: attn_mask must be a dense tensor");
  const int64_t full[4] = {q.size(0), q.size(2), q.size(1), k.size(1)};  // (batch, heads_q, seqlen_q, seqlen_k)
  const int64_t rank = m.dim();
  TORCH_CHECK_VALUE(rank >= 2 && rank <= 4, "flashattn_ext: attn_mask must have 2 to 4 dimensions that broadcast to ",
                    "(batch, heads, seqlen_q, seqlen_k) = (", full[0], ", ", full[1], ", ", full[2], ", ", full[3],
                    "), got shape ", m.sizes());
  int64_t stride[4] = {0, 0, 0, 0};
  for (int64_t d = 0; d < rank; ++d) {
    const int64_t dim = 4 - rank + d, size = m.size(d);
    TORCH_CHECK_VALUE(size == full[dim] || size == 1, "flashattn_ext: attn_mask of shape ", m.sizes(),
                      " does not broadcast to (batch, heads, seqlen_q, seqlen_k) = (", full[0], ", ", full[1], ", ",
                      full[2], ", ", full[3], ")");
    stride[dim] = size == 1 ? 0 : m.stride(d);
  }
  AttnBias& b = mod.bias;
  b.ptr = m.data_ptr();
  switch (dt) {
    case at::kBool: b.kind = BiasKind::kBool; break;
    case at::kHalf: b.kind = BiasKind::kFloat16; break;
    case at::kBFloat16: b.kind = BiasKind::kBFloat16; break;
    case at::kFloat: b.kind = BiasKind::kFloat32; break;
    default: b.kind = BiasKind::kFloat64; break;  // float64 q (the CPU kernels)
  }
  b.batch_stride = stride[0], b.head_stride = stride[1], b.row_stride = stride[2], b.col_stride = stride[3];
}

at::Tensor attn_mask_grad_buffer(AttnBias& bias, const at::Tensor& attn_mask, const at::Tensor& q, const at::Tensor& k,
                                 bool zeroed, bool expanded) {
  TORCH_CHECK_TYPE(at::isFloatingType(attn_mask.scalar_type()),
                   "flashattn_ext: only a floating-point attn_mask has a gradient, got ", attn_mask.scalar_type());
  const int64_t full[4] = {q.size(0), q.size(2), q.size(1), k.size(1)};
  std::vector<int64_t> sizes(4, 1);
  const int64_t rank = attn_mask.dim();
  for (int64_t d = 0; d < 4; ++d) {
    const int64_t size = d < 4 - rank ? 1 : attn_mask.size(d - (4 - rank));
    sizes[d] = expanded ? full[d] : size;
  }
  auto options = q.options().dtype(lse_dtype(q.scalar_type()));
  at::Tensor buffer = zeroed ? at::zeros(sizes, options) : at::empty(sizes, options);
  int64_t* strides[4] = {&bias.grad_batch_stride, &bias.grad_head_stride, &bias.grad_row_stride, &bias.grad_col_stride};
  for (int d = 0; d < 4; ++d) *strides[d] = sizes[d] == 1 ? 0 : buffer.stride(d);
  bias.grad = buffer.data_ptr();
  return buffer;
}

at::Tensor attn_mask_grad_result(const at::Tensor& buffer, const at::Tensor& attn_mask) {
  const int64_t rank = attn_mask.dim();
  std::vector<int64_t> summed;
  for (int64_t d = 0; d < 4; ++d) {
    const int64_t size = d < 4 - rank ? 1 : attn_mask.size(d - (4 - rank));
    if (size == 1 && buffer.size(d) != 1) summed.push_back(d);
  }
  at::Tensor grad = summed.empty() ? buffer : buffer.sum(summed, /*keepdim=*/true);
  return grad.view(attn_mask.sizes()).to(attn_mask.scalar_type());
}

MaskParams make_mask(int64_t window_left, int64_t window_right, bool bottom_right, int64_t seqlen_q, int64_t seqlen_k) {
  TORCH_CHECK_VALUE(window_left >= -1 && window_right >= -1, "flashattn_ext: window sizes must be -1 (unbounded) or ",
                    ">= 0, got window_left=", window_left, ", window_right=", window_right);
  MaskParams mask;
  // A window at least as wide as the sequence masks nothing: keep the cheaper
  // unbounded form (and stay inside int).
  mask.window_left = window_left >= seqlen_k + seqlen_q ? -1 : static_cast<int>(window_left);
  mask.window_right = window_right >= seqlen_k + seqlen_q ? -1 : static_cast<int>(window_right);
  mask.diag_offset = bottom_right ? static_cast<int>(seqlen_k - seqlen_q) : 0;
  mask.bottom_right = bottom_right;
  return mask;
}

at::ScalarType lse_dtype(at::ScalarType input) { return input == at::kDouble ? at::kDouble : at::kFloat; }

at::Tensor alloc_fwd_lse(const at::Tensor& q) {
  return at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(lse_dtype(q.scalar_type())));
}

std::tuple<at::Tensor, at::Tensor> alloc_fwd_outputs(const at::Tensor& q) {
  return {at::empty(q.sizes(), q.options()), alloc_fwd_lse(q)};
}

namespace {

ScalarKind scalar_kind(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return ScalarKind::kFloat16;
    case at::kBFloat16: return ScalarKind::kBFloat16;
    case at::kFloat: return ScalarKind::kFloat32;
    case at::kDouble: return ScalarKind::kFloat64;
    default: TORCH_CHECK_TYPE(false, "flashattn_ext: unsupported dtype ", t);
  }
}

}  // namespace

void set_qkvo(QkvoParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
              const at::Tensor& lse) {
  p.q_ptr = q.data_ptr();
  p.k_ptr = k.data_ptr();
  p.v_ptr = v.data_ptr();
  p.o_ptr = out.data_ptr();
  p.lse_ptr = lse.data_ptr();
  p.q_batch_stride = q.stride(0), p.q_row_stride = q.stride(1), p.q_head_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_row_stride = k.stride(1), p.k_head_stride = k.stride(2);
  p.v_batch_stride = v.stride(0), p.v_row_stride = v.stride(1), p.v_head_stride = v.stride(2);
  p.o_batch_stride = out.stride(0), p.o_row_stride = out.stride(1), p.o_head_stride = out.stride(2);
}

AttnFwdParams make_fwd_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                              const at::Tensor& lse, double softmax_scale, const MaskParams& mask) {
  TORCH_CHECK_VALUE(std::isfinite(softmax_scale), "flashattn_ext: softmax_scale must be finite, got ", softmax_scale);
  AttnFwdParams p;
  set_qkvo(p, q, k, v, out, lse);
  p.batch = static_cast<int>(q.size(0));
  p.seqlen_q = static_cast<int>(q.size(1));
  p.heads_q = static_cast<int>(q.size(2));
  p.head_dim = static_cast<int>(q.size(3));
  p.seqlen_k = static_cast<int>(k.size(1));
  p.heads_kv = static_cast<int>(k.size(2));
  p.dtype = scalar_kind(q.scalar_type());
  p.softmax_scale = softmax_scale;
  p.softmax_scale_log2 = static_cast<float>(softmax_scale * M_LOG2E);
  p.mask = mask;
  return p;
}

AttnBwdParams make_bwd_params(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dq, const at::Tensor& dk,
                              const at::Tensor& dv, double softmax_scale, const MaskParams& mask, bool deterministic) {
  AttnBwdParams p;
  static_cast<AttnFwdParams&>(p) = make_fwd_params(q, k, v, out, lse, softmax_scale, mask);
  p.do_ptr = dout.data_ptr();
  p.do_batch_stride = dout.stride(0), p.do_row_stride = dout.stride(1), p.do_head_stride = dout.stride(2);
  p.dq_ptr = dq.data_ptr();
  p.dk_ptr = dk.data_ptr();
  p.dv_ptr = dv.data_ptr();
  p.dq_batch_stride = dq.stride(0), p.dq_row_stride = dq.stride(1), p.dq_head_stride = dq.stride(2);
  p.dk_batch_stride = dk.stride(0), p.dk_row_stride = dk.stride(1), p.dk_head_stride = dk.stride(2);
  p.dv_batch_stride = dv.stride(0), p.dv_row_stride = dv.stride(1), p.dv_head_stride = dv.stride(2);
  p.deterministic = deterministic;
  return p;
}

// ---------------------------------------------------------------------------
// Variable-length batches

namespace {

void check_rank3(const at::Tensor& t, const char* name, const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == 3, "flashattn_ext: ", name, " must have 3 dimensions ", layout,
                    " (the sequences packed along dimension 0), got shape ", shape_str(t));
}

}  // namespace

void check_cu_seqlens(const at::Tensor& cu, const char* name, const at::Tensor& q) {
  TORCH_CHECK_TYPE(cu.scalar_type() == at::kInt, "flashattn_ext: ", name, " must have dtype int32, got ",
                   cu.scalar_type(), "; pass ", name, ".to(torch.int32)");
  TORCH_CHECK_VALUE(cu.dim() == 1, "flashattn_ext: ", name, " must be 1-D (batch + 1,), got shape ", shape_str(cu));
  TORCH_CHECK_VALUE(cu.size(0) >= 2, "flashattn_ext: ", name,
                    " must have batch + 1 >= 2 elements (0, then the end of each sequence), got ", cu.size(0));
  TORCH_CHECK_VALUE(cu.device() == q.device(), "flashattn_ext: ", name, " is on ", cu.device(), " but q is on ",
                    q.device(), "; move it to q's device");
  TORCH_CHECK_VALUE(cu.is_contiguous(), "flashattn_ext: ", name, " must be contiguous; pass ", name, ".contiguous()");
}

void check_max_seqlen(int64_t max_seqlen, const char* name) {
  TORCH_CHECK_VALUE(max_seqlen >= 0 && max_seqlen <= INT32_MAX, "flashattn_ext: ", name,
                    " must be in [0, 2^31 - 1] (a bound on the sequence lengths), got ", max_seqlen);
}

void check_varlen_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                      const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                      const BackendSpec& spec) {
  check_rank3(q, "q", "(total_q, heads_q, head_dim)");
  check_rank3(k, "k", "(total_k, heads_kv, head_dim)");
  check_rank3(v, "v", "(total_k, heads_kv, head_dim)");
  check_devices_and_dtypes(q, k, "k", v, "v", spec);
  // The token dimension may be 0 (every sequence empty); heads and head_dim may not.
  auto check_heads_and_dim = [](const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.size(1) > 0 && t.size(2) > 0, "flashattn_ext: ", name, " has shape ", shape_str(t),
                      "; heads and head_dim must be at least 1");
  };
  check_heads_and_dim(q, "q");
  check_heads_and_dim(k, "k");
  check_heads_and_dim(v, "v");
  check_fits_int(q, "q");
  check_fits_int(k, "k");
  const int64_t head_dim = q.size(2);
  TORCH_CHECK_VALUE(k.size(2) == head_dim && v.size(2) == head_dim, "flashattn_ext: head_dim differs: q ", head_dim,
                    ", k ", k.size(2), ", v ", v.size(2), "; q, k and v must share dimension 2");
  check_head_dim_supported(head_dim);
  TORCH_CHECK_VALUE(v.size(0) == k.size(0), "flashattn_ext: v has ", v.size(0), " tokens but k has ", k.size(0),
                    "; k and v must share dimension 0 (total_k)");
  TORCH_CHECK_VALUE(v.size(1) == k.size(1), "flashattn_ext: v has ", v.size(1), " heads but k has ", k.size(1),
                    "; k and v must share dimension 1 (heads_kv)");
  check_heads_divide(q.size(1), k.size(1));
  check_qkv_last_dim_contiguous(q, k, v);
  check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q);
  check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", q);
  TORCH_CHECK_VALUE(cu_seqlens_q.size(0) == cu_seqlens_k.size(0), "flashattn_ext: cu_seqlens_q has ",
                    cu_seqlens_q.size(0), " elements but cu_seqlens_k has ", cu_seqlens_k.size(0),
                    "; both must be (batch + 1,)");
  check_max_seqlen(max_seqlen_q, "max_seqlen_q");
  check_max_seqlen(max_seqlen_k, "max_seqlen_k");
}

int64_t check_cu_seqlens_values(const at::Tensor& cu_seqlens, const char* name, int64_t total, const char* tensor,
                                int64_t max_seqlen, const char* max_name) {
  TORCH_INTERNAL_ASSERT(cu_seqlens.device().is_cpu());
  const int* cu = cu_seqlens.data_ptr<int>();
  const int64_t n = cu_seqlens.size(0);
  TORCH_CHECK_VALUE(cu[0] == 0, "flashattn_ext: ", name, " must start at 0, got ", cu[0]);
  int64_t longest = 0;
  for (int64_t i = 0; i + 1 < n; ++i) {
    TORCH_CHECK_VALUE(cu[i + 1] >= cu[i], "flashattn_ext: ", name, " must be non-decreasing, got ", name, "[", i,
                      "] = ", cu[i], " > ", name, "[", i + 1, "] = ", cu[i + 1]);
    longest = std::max<int64_t>(longest, cu[i + 1] - cu[i]);
  }
  TORCH_CHECK_VALUE(cu[n - 1] == total, "flashattn_ext: ", name, " ends at ", cu[n - 1], " but ", tensor, " holds ",
                    total, " tokens (its dimension 0); the last element of ", name,
                    " must be the total number of tokens");
  TORCH_CHECK_VALUE(max_seqlen >= longest, "flashattn_ext: ", max_name, "=", max_seqlen,
                    " is smaller than the longest sequence of ", name, " (", longest,
                    "); it must be at least the largest length");
  return longest;
}

void check_varlen_bwd_extras(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& out,
                             const at::Tensor& lse) {
  check_bwd_tensors(dout, q, out, lse, {q.size(1), q.size(0)}, "(heads_q, total_q)");
}

namespace {

// The varlen fields over params filled from (1, total, heads, head_dim) views.
void set_varlen(AttnFwdParams& p, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                int64_t max_seqlen_k) {
  p.cu_seqlens_q = cu_seqlens_q.data_ptr<int>();
  p.cu_seqlens_k = cu_seqlens_k.data_ptr<int>();
  p.batch = static_cast<int>(cu_seqlens_q.size(0) - 1);
  p.total_q = p.seqlen_q;  // the views' dimension 1
  p.total_k = p.seqlen_k;
  p.seqlen_q = static_cast<int>(max_seqlen_q);
  p.seqlen_k = static_cast<int>(max_seqlen_k);
  // Rows are located by cu_seqlens (SeqInfo), never by a batch index.
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = 0;
}

}  // namespace

AttnFwdParams make_varlen_fwd_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
                                     const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                                     double softmax_scale, const MaskParams& mask) {
  AttnFwdParams p = make_fwd_params(q, k, v, out, lse, softmax_scale, mask);
  set_varlen(p, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  return p;
}

AttnBwdParams make_varlen_bwd_params(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                     const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                                     const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                     int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
                                     const MaskParams& mask, bool deterministic) {
  AttnBwdParams p = make_bwd_params(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, mask, deterministic);
  set_varlen(p, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  p.do_batch_stride = p.dq_batch_stride = p.dk_batch_stride = p.dv_batch_stride = 0;
  return p;
}

// (A size-1 head_dim keeps any stride through contiguous(), hence the clone.)
at::Tensor unit_last_stride(const at::Tensor& x) {
  if (x.dim() == 0 || x.stride(-1) == 1) return x;
  at::Tensor y = x.contiguous();
  return y.stride(-1) == 1 ? y : y.clone(at::MemoryFormat::Contiguous);
}

}  // namespace flashattn
