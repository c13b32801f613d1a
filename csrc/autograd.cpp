// The autograd formula of flashattn_ext::fwd, registered in C++ for the
// Autograd dispatch key: out = attention(q, k, v) saves (q, k, v, out, lse)
// and its backward calls flashattn_ext::bwd. A C++ autograd function costs a
// few microseconds of host time per call where torch.library's Python
// register_autograd cost tens; on small problems (GPT-2 sized layers) the host
// path, not the kernels, set the pace.
//
// Both ops are called through the dispatcher below the Autograd key, so the
// backend kernels, the fake kernels (flashattn_ext/_ops.py) and torch.compile's
// tracing all see the same two ops.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::tuple<at::Tensor, at::Tensor> call_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            double scale, int64_t window_left, int64_t window_right, bool bottom_right,
                                            bool deterministic) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("flashattn_ext::fwd", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                 const at::Tensor&, double, int64_t, int64_t, bool,
                                                                 bool)>();
  return op.call(q, k, v, scale, window_left, window_right, bottom_right, deterministic);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_bwd(const at::Tensor& dout, const at::Tensor& q,
                                                        const at::Tensor& k, const at::Tensor& v,
                                                        const at::Tensor& out, const at::Tensor& lse, double scale,
                                                        int64_t window_left, int64_t window_right, bool bottom_right,
                                                        bool deterministic) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("flashattn_ext::bwd", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&, double, int64_t, int64_t, bool, bool)>();
  return op.call(dout, q, k, v, out, lse, scale, window_left, window_right, bottom_right, deterministic);
}

// The kernels need stride 1 on head_dim; copy only when it is not already so
// (a size-1 head_dim keeps any stride through contiguous(), hence the clone).
at::Tensor unit_last_stride(const at::Tensor& x) {
  if (x.dim() == 0 || x.stride(-1) == 1) return x;
  at::Tensor y = x.contiguous();
  return y.stride(-1) == 1 ? y : y.clone(at::MemoryFormat::Contiguous);
}

class FlashAttnFunction : public torch::autograd::Function<FlashAttnFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               double scale, int64_t window_left, int64_t window_right, bool bottom_right,
                               bool deterministic) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = call_fwd(q, k, v, scale, window_left, window_right, bottom_right, deterministic);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["window_left"] = window_left;
    ctx->saved_data["window_right"] = window_right;
    ctx->saved_data["bottom_right"] = bottom_right;
    ctx->saved_data["deterministic"] = deterministic;
    // lse carries no gradient (the bwd kernels take none for it, and one
    // silently dropped would be a wrong answer): marked non-differentiable it
    // shows requires_grad=False and backpropagating through it alone raises.
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);  // so no zero tensor is made for it either
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& dout = grads[0];
    if (!dout.defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
                                 at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    auto [dq, dk, dv] =
        call_bwd(unit_last_stride(dout), saved[0], saved[1], saved[2], saved[3], saved[4],
                 ctx->saved_data["scale"].toDouble(), ctx->saved_data["window_left"].toInt(),
                 ctx->saved_data["window_right"].toInt(), ctx->saved_data["bottom_right"].toBool(),
                 ctx->saved_data["deterministic"].toBool());
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> fwd_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                double scale, int64_t window_left, int64_t window_right,
                                                bool bottom_right, bool deterministic) {
  auto r = FlashAttnFunction::apply(q, k, v, scale, window_left, window_right, bottom_right, deterministic);
  return {r[0], r[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashattn_ext, Autograd, m) { m.impl("fwd", &fwd_autograd); }
