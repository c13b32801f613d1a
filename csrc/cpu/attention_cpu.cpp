// CPU implementation of flashattn_ext::fwd / bwd: validation and allocation
// through the shared binding layer, then the tiled kernels of flash_cpu.h.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <limits>

#include "../attention_api.h"
#include "flash_cpu.h"
#include "huge_pages.h"

namespace flashattn {
namespace {

const BackendSpec kCpuSpec{"CPU", {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}, ""};

std::tuple<at::Tensor, at::Tensor> fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           double softmax_scale, int64_t window_left, int64_t window_right,
                                           bool bottom_right, double softcap,
                                           const std::optional<at::Tensor>& alibi_slopes,
                                           const std::optional<at::Tensor>& attn_mask, double dropout_p,
                                           const std::optional<at::Tensor>& rng_state) {
  check_qkv(q, k, v, kCpuSpec);
  auto mask = make_mask(window_left, window_right, bottom_right, q.size(1), k.size(1));
  auto out = cpu::empty_huge(q.sizes(), q.options());  // (huge_pages.h: the tile stores' TLB)
  auto lse = alloc_fwd_lse(q);
  auto params = make_fwd_params(q, k, v, out, lse, softmax_scale, mask);
  params.score_mod = make_score_mod(softcap, alibi_slopes, q, q.size(0), q.size(2));
  add_attn_mask(params.score_mod, attn_mask, q, k);
  params.dropout = make_dropout(dropout_p, rng_state, q.device());
  // Nothing to compute (torch's SDPA semantics): an empty output, or zeros and lse -inf without keys.
  if (is_empty_call(q, k)) return {out.zero_(), lse.fill_(-std::numeric_limits<double>::infinity())};
  run_fwd_cpu(params);
  return {out, lse};
}

// bwd and bwd_mask_grad: dq, dk, dv and, with mask_grad, the attn_mask's
// gradient (undefined otherwise).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, double softmax_scale, int64_t window_left, int64_t window_right, bool bottom_right,
    bool deterministic, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& attn_mask, bool mask_grad, double dropout_p,
    const std::optional<at::Tensor>& rng_state) {
  check_qkv(q, k, v, kCpuSpec);
  check_bwd_extras(dout, q, out, lse);
  auto mask = make_mask(window_left, window_right, bottom_right, q.size(1), k.size(1));
  auto dq = cpu::empty_huge(q.sizes(), q.options());
  auto dk = cpu::empty_huge(k.sizes(), k.options());
  auto dv = cpu::empty_huge(v.sizes(), v.options());
  auto params = make_bwd_params(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, mask, deterministic);
  params.score_mod = make_score_mod(softcap, alibi_slopes, q, q.size(0), q.size(2));
  add_attn_mask(params.score_mod, attn_mask, q, k);
  params.dropout = make_dropout(dropout_p, rng_state, q.device());
  const bool empty = is_empty_call(q, k);
  // The pass that writes it stores every element (flash_cpu_bwd.cpp): no zeroing.
  const at::Tensor dmask_buffer =
      mask_grad ? attn_mask_grad_buffer(params.score_mod.bias, *attn_mask, q, k, /*zeroed=*/empty, false)
                : at::Tensor();
  if (empty) {
    dq.zero_(), dk.zero_(), dv.zero_();
  } else {
    run_bwd_cpu(params);
  }
  return {dq, dk, dv, mask_grad ? attn_mask_grad_result(dmask_buffer, *attn_mask) : at::Tensor()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, double softmax_scale, int64_t window_left, int64_t window_right, bool bottom_right,
    bool deterministic /*the CPU backward always is*/, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& attn_mask, double dropout_p, const std::optional<at::Tensor>& rng_state) {
  auto [dq, dk, dv, unused] = backward(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, bottom_right,
                                       deterministic, softcap, alibi_slopes, attn_mask, false, dropout_p, rng_state);
  return {dq, dk, dv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_mask_grad_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, double softmax_scale, int64_t window_left, int64_t window_right, bool bottom_right,
    bool deterministic, const at::Tensor& attn_mask, double dropout_p, const std::optional<at::Tensor>& rng_state) {
  return backward(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, bottom_right, deterministic, 0.0,
                  std::nullopt, attn_mask, true, dropout_p, rng_state);
}

// Variable-length batches: q (total_q, heads_q, head_dim), k, v (total_k,
// heads_kv, head_dim). cu_seqlens live in host memory here, so their values
// are checked (the CUDA path cannot without a synchronisation), and the
// kernels' grids are sized by the longest sequences rather than by the
// caller's bounds.
struct VarlenLengths {
  int64_t max_q, max_k;
};

VarlenLengths check_varlen_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q,
                               const at::Tensor& cu_k, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  check_varlen_qkv(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, kCpuSpec);
  return {check_cu_seqlens_values(cu_q, "cu_seqlens_q", q.size(0), "q", max_seqlen_q, "max_seqlen_q"),
          check_cu_seqlens_values(cu_k, "cu_seqlens_k", k.size(0), "k", max_seqlen_k, "max_seqlen_k")};
}

std::tuple<at::Tensor, at::Tensor> varlen_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                                  int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
                                                  int64_t window_left, int64_t window_right, bool bottom_right,
                                                  double softcap, const std::optional<at::Tensor>& alibi_slopes,
                                                  double dropout_p, const std::optional<at::Tensor>& rng_state) {
  const auto len = check_varlen_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  const auto mask = make_mask(window_left, window_right, bottom_right, len.max_q, len.max_k);
  auto out = cpu::empty_huge(q.sizes(), q.options());
  auto lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(lse_dtype(q.scalar_type())));
  auto params = make_varlen_fwd_params(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0), lse,
                                       cu_seqlens_q, cu_seqlens_k, len.max_q, len.max_k, softmax_scale, mask);
  params.score_mod = make_score_mod(softcap, alibi_slopes, q, cu_seqlens_q.size(0) - 1, q.size(1));
  params.dropout = make_dropout(dropout_p, rng_state, q.device());
  run_fwd_cpu(params);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, double softmax_scale, int64_t window_left, int64_t window_right, bool bottom_right,
    bool deterministic /*the CPU backward always is*/, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    double dropout_p, const std::optional<at::Tensor>& rng_state) {
  const auto len = check_varlen_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  check_varlen_bwd_extras(dout, q, out, lse);
  const auto mask = make_mask(window_left, window_right, bottom_right, len.max_q, len.max_k);
  auto dq = cpu::empty_huge(q.sizes(), q.options());
  auto dk = cpu::empty_huge(k.sizes(), k.options());
  auto dv = cpu::empty_huge(v.sizes(), v.options());
  auto params =
      make_varlen_bwd_params(dout.unsqueeze(0), q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0), lse,
                             dq.unsqueeze(0), dk.unsqueeze(0), dv.unsqueeze(0), cu_seqlens_q, cu_seqlens_k, len.max_q,
                             len.max_k, softmax_scale, mask, deterministic);
  params.score_mod = make_score_mod(softcap, alibi_slopes, q, cu_seqlens_q.size(0) - 1, q.size(1));
  params.dropout = make_dropout(dropout_p, rng_state, q.device());
  run_bwd_cpu(params);
  return {dq, dk, dv};
}

}  // namespace
}  // namespace flashattn

TORCH_LIBRARY_IMPL(flashattn_ext, CPU, m) {
  m.impl("fwd", &flashattn::fwd_cpu);
  m.impl("bwd", &flashattn::bwd_cpu);
  m.impl("bwd_mask_grad", &flashattn::bwd_mask_grad_cpu);
  m.impl("varlen_fwd", &flashattn::varlen_fwd_cpu);
  m.impl("varlen_bwd", &flashattn::varlen_bwd_cpu);
}
