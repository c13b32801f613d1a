// CPU implementation of flashattn_ext::fwd / bwd: validation and allocation
// through the shared binding layer, then the tiled kernels of flash_cpu.h.
#include <torch/library.h>

#include "../attention_api.h"
#include "flash_cpu.h"

namespace flashattn {
namespace {

const BackendSpec kCpuSpec{"CPU", {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}, ""};

std::tuple<at::Tensor, at::Tensor> fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           double softmax_scale, int64_t window_left, int64_t window_right,
                                           bool bottom_right) {
  check_qkv(q, k, v, kCpuSpec);
  auto mask = make_mask(window_left, window_right, bottom_right, q.size(1), k.size(1));
  auto [out, lse] = alloc_fwd_outputs(q);
  run_fwd_cpu(make_fwd_params(q, k, v, out, lse, softmax_scale, mask));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cpu(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                                       const at::Tensor& v, const at::Tensor& out,
                                                       const at::Tensor& lse, double softmax_scale, int64_t window_left,
                                                       int64_t window_right, bool bottom_right,
                                                       bool deterministic /*the CPU backward always is*/) {
  check_qkv(q, k, v, kCpuSpec);
  check_bwd_extras(dout, q, out, lse);
  auto mask = make_mask(window_left, window_right, bottom_right, q.size(1), k.size(1));
  auto dq = at::empty(q.sizes(), q.options());
  auto dk = at::empty(k.sizes(), k.options());
  auto dv = at::empty(v.sizes(), v.options());
  run_bwd_cpu(make_bwd_params(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, mask, deterministic));
  return {dq, dk, dv};
}

}  // namespace
}  // namespace flashattn

TORCH_LIBRARY_IMPL(flashattn_ext, CPU, m) {
  m.impl("fwd", &flashattn::fwd_cpu);
  m.impl("bwd", &flashattn::bwd_cpu);
}
