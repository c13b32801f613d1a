// Everything between the Python API and the backend kernels that is not a
// backend: the autograd formula, the autocast kernels and the catch-all
// kernels of the ops (schema in csrc/ops.cpp). The varlen_* ops mirror
// attention / fwd / bwd one for one (their own node, VarlenFlashAttnBackward,
// also saves cu_seqlens and the max_seqlen bounds).
//
// Autograd. flashattn_ext::attention is the differentiable op: its kernel on
// the Autograd key runs fwd below autograd and, when an input requires grad,
// records a FlashAttnBackward node holding (q, k, v, out, lse) and the scalar
// arguments, deterministic included; the node's backward calls bwd. The node
// is written the way torch's generated autograd kernels are (a Node subclass
// with SavedVariables, set_history), not as a torch::autograd::Function: that
// costs a few microseconds of host time per call where torch.library's Python
// register_autograd cost tens, and it works under torch.func transforms
// (grad, vjp, jacrev), which refuse C++ autograd Functions. vmap has rules of
// its own (flashattn_ext/_ops.py).
//
// fwd, bwd and fwd_kvcache are not differentiable. Their Autograd kernels attach an Error
// node when an input requires grad, so that backpropagating through them
// raises with a message that says so (torch's default for an op without a
// formula is a warning and a silently wrong gradient). For bwd this is the
// double backward (a gradient penalty, create_graph=True), which torch's SDPA
// flash/efficient/cuDNN backends refuse too. Forward-mode AD (jvp, jacfwd)
// raises at once on all of them.
//
// Autocast (AutocastCPU, AutocastCUDA): attention and fwd cast floating q, k,
// v (not float64) to the autocast dtype, as torch's autocast does for its
// scaled_dot_product_attention. fwd_kvcache has no autocast kernel (autocast
// passes it through): it reads a cache of one dtype in place, which a cast
// would copy, and requires q in that dtype.
//
// kvcache_append_rotary (no gradient: inference, its caches updated in place)
// has no Autograd kernel: torch's fallback bumps the caches' version counters;
// flash_attn_with_kvcache calls it under torch.no_grad().
//
// Catch-all (CompositeExplicitAutograd): for fwd, bwd, fwd_kvcache and kvcache_append_rotary, every backend
// without kernels of its own reaches a kernel that raises an error naming the
// offending argument; for attention it is fwd itself (so inference mode, which
// skips the Autograd key, still runs the kernels).
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "attention_api.h"

namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// (Every op ends with flash-attn's score modifications: double softcap, Tensor? alibi_slopes.)
using OptTensor = std::optional<at::Tensor>;
// (The dense ops, fwd / bwd / attention, then take torch SDPA's Tensor? attn_mask.)
// (Then every op but fwd_kvcache takes dropout: double dropout_p, Tensor? rng_state.)
using FwdSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                                  int64_t, int64_t, bool, double, const OptTensor&, const OptTensor&,
                                                  double, const OptTensor&);
using AttnSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                                   int64_t, int64_t, bool, bool, bool, double, const OptTensor&,
                                                   const OptTensor&, double, const OptTensor&);
using BwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              double, int64_t, int64_t, bool, bool, double,
                                                              const OptTensor&, const OptTensor&, double,
                                                              const OptTensor&);

using BwdMaskGradSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    double, int64_t, int64_t, bool, bool, const at::Tensor&, double, const OptTensor&);

using VarlenFwdSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&, const at::Tensor&, int64_t, int64_t, double,
                                                        int64_t, int64_t, bool, double, const OptTensor&, double,
                                                        const OptTensor&);
using VarlenAttnSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                         const at::Tensor&, const at::Tensor&, int64_t, int64_t, double,
                                                         int64_t, int64_t, bool, bool, double, const OptTensor&, double,
                                                         const OptTensor&);
using VarlenBwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                    const at::Tensor&, const at::Tensor&,
                                                                    const at::Tensor&, const at::Tensor&,
                                                                    const at::Tensor&, const at::Tensor&, int64_t,
                                                                    int64_t, double, int64_t, int64_t, bool, bool,
                                                                    double, const OptTensor&, double, const OptTensor&);

// The arguments the varlen ops share after the tensors they differ in.
struct VarlenArgs {
  at::Tensor cu_seqlens_q, cu_seqlens_k;
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
  double scale = 0;
  int64_t window_left = -1, window_right = -1;
  bool bottom_right = false;
  double softcap = 0;
  OptTensor alibi_slopes;
  double dropout_p = 0;
  OptTensor rng_state;
};

std::tuple<at::Tensor, at::Tensor> call_varlen_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   const VarlenArgs& a) {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("flashattn_ext::varlen_fwd", "").typed<VarlenFwdSig>();
  return op.call(q, k, v, a.cu_seqlens_q, a.cu_seqlens_k, a.max_seqlen_q, a.max_seqlen_k, a.scale, a.window_left,
                 a.window_right, a.bottom_right, a.softcap, a.alibi_slopes, a.dropout_p, a.rng_state);
}

std::tuple<at::Tensor, at::Tensor> call_varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                         const VarlenArgs& a, bool deterministic) {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("flashattn_ext::varlen_attention", "").typed<VarlenAttnSig>();
  return op.call(q, k, v, a.cu_seqlens_q, a.cu_seqlens_k, a.max_seqlen_q, a.max_seqlen_k, a.scale, a.window_left,
                 a.window_right, a.bottom_right, deterministic, a.softcap, a.alibi_slopes, a.dropout_p, a.rng_state);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_varlen_bwd(const at::Tensor& dout, const at::Tensor& q,
                                                               const at::Tensor& k, const at::Tensor& v,
                                                               const at::Tensor& out, const at::Tensor& lse,
                                                               const VarlenArgs& a, bool deterministic) {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("flashattn_ext::varlen_bwd", "").typed<VarlenBwdSig>();
  return op.call(dout, q, k, v, out, lse, a.cu_seqlens_q, a.cu_seqlens_k, a.max_seqlen_q, a.max_seqlen_k, a.scale,
                 a.window_left, a.window_right, a.bottom_right, deterministic, a.softcap, a.alibi_slopes, a.dropout_p,
                 a.rng_state);
}

std::tuple<at::Tensor, at::Tensor> call_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                            int64_t window_left, int64_t window_right, bool bottom_right,
                                            double softcap, const OptTensor& alibi_slopes, const OptTensor& attn_mask,
                                            double dropout_p, const OptTensor& rng_state) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("flashattn_ext::fwd", "").typed<FwdSig>();
  return op.call(q, k, v, scale, window_left, window_right, bottom_right, softcap, alibi_slopes, attn_mask, dropout_p,
                 rng_state);
}

using KvcacheSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&, const std::optional<at::Tensor>&,
                                                      const std::optional<at::Tensor>&,
                                                      const std::optional<at::Tensor>&, double, int64_t, int64_t,
                                                      int64_t, bool, double, const OptTensor&);

std::tuple<at::Tensor, at::Tensor> call_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  double scale, int64_t window_left, int64_t window_right,
                                                  bool bottom_right, bool deterministic, bool bhsd, double softcap,
                                                  const OptTensor& alibi_slopes, const OptTensor& attn_mask,
                                                  double dropout_p, const OptTensor& rng_state) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("flashattn_ext::attention", "").typed<AttnSig>();
  return op.call(q, k, v, scale, window_left, window_right, bottom_right, deterministic, bhsd, softcap, alibi_slopes,
                 attn_mask, dropout_p, rng_state);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_bwd(const at::Tensor& dout, const at::Tensor& q,
                                                        const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                                        const at::Tensor& lse, double scale, int64_t window_left,
                                                        int64_t window_right, bool bottom_right, bool deterministic,
                                                        double softcap, const OptTensor& alibi_slopes,
                                                        const OptTensor& attn_mask, double dropout_p,
                                                        const OptTensor& rng_state) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("flashattn_ext::bwd", "").typed<BwdSig>();
  return op.call(dout, q, k, v, out, lse, scale, window_left, window_right, bottom_right, deterministic, softcap,
                 alibi_slopes, attn_mask, dropout_p, rng_state);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> call_bwd_mask_grad(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, double scale, int64_t window_left, int64_t window_right, bool bottom_right,
    bool deterministic, const at::Tensor& attn_mask, double dropout_p, const OptTensor& rng_state) {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("flashattn_ext::bwd_mask_grad", "").typed<BwdMaskGradSig>();
  return op.call(dout, q, k, v, out, lse, scale, window_left, window_right, bottom_right, deterministic, attn_mask,
                 dropout_p, rng_state);
}

// The rng_state a differentiable call runs with (its backward regenerates the
// mask from it): the caller's, or with dropout a fresh draw for the call's
// batch x heads_q planes (csrc/philox.h; sizes(q) gives them, asked only then,
// so that a call without dropout reads no size: symbolic shapes stay so). The
// draw is an op of its own (dropout_rng_state, nondeterministic_seeded), so
// that a traced graph draws anew at every run instead of baking one seed in.
template <typename Sizes>
OptTensor call_rng_state(double dropout_p, const OptTensor& rng_state, const at::Tensor& q, Sizes sizes) {
  if (!(dropout_p > 0.0) || (rng_state.has_value() && rng_state->defined())) return rng_state;
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("flashattn_ext::dropout_rng_state", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, int64_t)>();
  const auto [batch, heads_q] = sizes();
  return op.call(q, batch, heads_q);
}

// (batch, heads_q) of a dense attention call (q in the caller's layout) and of a varlen one.
auto dense_planes(const at::Tensor& q, bool bhsd) {
  return [&q, bhsd] {
    if (q.dim() != 4) return std::pair<int64_t, int64_t>{1, 1};  // the kernels' checks name the rank
    return std::pair<int64_t, int64_t>{q.size(0), bhsd ? q.size(1) : q.size(2)};
  };
}
auto varlen_planes(const at::Tensor& q, const at::Tensor& cu_seqlens_q) {
  return [&q, &cu_seqlens_q] {
    return std::pair<int64_t, int64_t>{cu_seqlens_q.dim() == 1 ? cu_seqlens_q.size(0) - 1 : 0,
                                       q.dim() == 3 ? q.size(1) : 1};
  };
}

using flashattn::unit_last_stride;

// An input of attention as fwd / bwd take it: (batch, seqlen, heads, head_dim)
// with a unit head_dim stride. A view unless the head_dim was strided. (A
// tensor of another rank passes unchanged: the kernels' check names it.)
at::Tensor kernel_layout(const at::Tensor& x, bool bhsd) {
  if (x.layout() != at::kStrided || x.is_nested() || x.is_mkldnn()) return x;  // for the catch-all to name
  return unit_last_stride(bhsd && x.dim() == 4 ? x.transpose(1, 2) : x);
}

// The kernels' (batch, seqlen, heads, head_dim) output in the caller's layout.
at::Tensor caller_layout(const at::Tensor& x, bool bhsd) { return bhsd ? x.transpose(1, 2) : x; }

template <typename... Tensors>
void check_no_forward_ad(const char* op, const Tensors&... tensors) {
  const bool any = (torch::autograd::isFwGradDefined(tensors) || ...);
  TORCH_CHECK_NOT_IMPLEMENTED(!any,
                              "flashattn_ext: forward-mode AD (torch.func.jvp, torch.func.jacfwd, torch.func.hessian, "
                              "torch.autograd.forward_ad) is not supported (flashattn_ext::",
                              op,
                              " has no forward derivative); use reverse mode (backward, torch.func.grad, vjp, jacrev)");
}

// A new autograd node. torch 2.15 owns nodes by c10::intrusive_ptr, earlier
// versions by std::shared_ptr with torch::autograd::deleteNode as the deleter
// (it frees long chains of nodes without deep recursion). Both branches
// depend on T, so only the installed torch's is compiled; deleteNode is found
// by argument-dependent lookup (T derives from torch::autograd::Node) and
// only where it exists.
template <typename T, typename... Args>
auto make_node(Args&&... args) {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, Node>) {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  } else {
    return std::shared_ptr<T>(new T(std::forward<Args>(args)...), [](T* node) { deleteNode(node); });
  }
}

// What the backward nodes of attention and varlen_attention save: q, k, v as
// the caller passed them (next edges 0, 1, 2), out as returned and lse.
struct AttentionBackwardNode : public Node {
  SavedVariable q_, k_, v_, out_, lse_;

  // Records the node: edges to q, k, v, and the history of out. lse gets none:
  // it shows requires_grad=False, and backpropagating through it alone raises
  // (the kernels take no gradient for it, and one silently dropped would be a
  // wrong answer).
  template <typename NodePtr>
  static void attach(const NodePtr& node, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& out, const at::Tensor& lse) {
    node->set_next_edges(torch::autograd::collect_next_edges(q, k, v));
    node->q_ = SavedVariable(q, false);
    node->k_ = SavedVariable(k, false);
    node->v_ = SavedVariable(v, false);
    torch::autograd::set_history(out, node);
    node->out_ = SavedVariable(out, true);
    node->lse_ = SavedVariable(lse, false);
  }

 protected:
  // For release_variables, under mutex_.
  void reset_saved() {
    q_.reset_data();
    k_.reset_data();
    v_.reset_data();
    out_.reset_data();
    lse_.reset_data();
  }
};

// The backward of attention. Inputs: q, k, v (next edges 0, 1, 2) and, when
// a float attn_mask requires grad, the mask (edge 3: bwd_mask_grad computes
// its gradient; bwd otherwise, which computes nothing for it); one incoming
// gradient, that of out (lse is not differentiable).
struct FlashAttnBackward : public AttentionBackwardNode {
  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const at::Tensor& dout = grads[0];
    if (!dout.defined()) return variable_list(mask_grad ? 4 : 3);
    const at::Tensor q = q_.unpack(), k = k_.unpack(), v = v_.unpack();
    const at::Tensor out = out_.unpack(getptr()), lse = lse_.unpack();
    if (mask_grad) {
      auto [dq, dk, dv, dmask] =
          call_bwd_mask_grad(kernel_layout(dout, bhsd), kernel_layout(q, bhsd), kernel_layout(k, bhsd),
                             kernel_layout(v, bhsd), kernel_layout(out, bhsd), lse, scale, window_left, window_right,
                             bottom_right, deterministic, mask_.unpack(), dropout_p, rng_state);
      return {caller_layout(dq, bhsd), caller_layout(dk, bhsd), caller_layout(dv, bhsd), dmask};
    }
    auto [dq, dk, dv] =
        call_bwd(kernel_layout(dout, bhsd), kernel_layout(q, bhsd), kernel_layout(k, bhsd), kernel_layout(v, bhsd),
                 kernel_layout(out, bhsd), lse, scale, window_left, window_right, bottom_right, deterministic, softcap,
                 alibi_slopes, attn_mask, dropout_p, rng_state);
    return {caller_layout(dq, bhsd), caller_layout(dk, bhsd), caller_layout(dv, bhsd)};
  }
  std::string name() const override { return "FlashAttnBackward"; }
  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    reset_saved();
    alibi_slopes.reset();
    attn_mask.reset();
    rng_state.reset();
    mask_.reset_data();
  }

  // The saved q, k, v are the caller's tensors (the kernels' views are remade
  // in the backward, so that the version checks of autograd see the inputs
  // themselves); out is in the caller's layout.
  double scale = 0;
  int64_t window_left = -1, window_right = -1;
  bool bottom_right = false, deterministic = false, bhsd = false;
  double softcap = 0;
  OptTensor alibi_slopes;  // not differentiable (flash-attn gives the slopes no gradient): a plain tensor
  OptTensor attn_mask;     // a mask without gradient: a plain tensor, as the slopes
  bool mask_grad = false;  // the mask requires grad: saved as mask_ instead, an input of the node
  SavedVariable mask_;
  double dropout_p = 0;
  OptTensor rng_state;  // the forward's (drawn or given): the backward regenerates its keep mask
};

std::tuple<at::Tensor, at::Tensor> attention_below_autograd(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v, double scale, int64_t window_left,
                                                            int64_t window_right, bool bottom_right, bool bhsd,
                                                            double softcap, const OptTensor& alibi_slopes,
                                                            const OptTensor& attn_mask, double dropout_p,
                                                            const OptTensor& rng_state) {
  auto [out, lse] = call_fwd(kernel_layout(q, bhsd), kernel_layout(k, bhsd), kernel_layout(v, bhsd), scale, window_left,
                             window_right, bottom_right, softcap, alibi_slopes, attn_mask, dropout_p, rng_state);
  return {caller_layout(out, bhsd), lse};
}

std::tuple<at::Tensor, at::Tensor> attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      double scale, int64_t window_left, int64_t window_right,
                                                      bool bottom_right, bool deterministic, bool bhsd, double softcap,
                                                      const OptTensor& alibi_slopes, const OptTensor& attn_mask,
                                                      double dropout_p, const OptTensor& rng_state_in) {
  check_no_forward_ad("attention", q, k, v);
  const OptTensor rng_state = call_rng_state(dropout_p, rng_state_in, q, dense_planes(q, bhsd));
  const bool mask_grad =
      attn_mask.has_value() && attn_mask->defined() && attn_mask->requires_grad() && at::GradMode::is_enabled();
  if (mask_grad) check_no_forward_ad("attention", *attn_mask);
  at::Tensor out, lse;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    std::tie(out, lse) = attention_below_autograd(q, k, v, scale, window_left, window_right, bottom_right, bhsd,
                                                  softcap, alibi_slopes, attn_mask, dropout_p, rng_state);
  }
  if (mask_grad || torch::autograd::compute_requires_grad(q, k, v)) {
    auto node = make_node<FlashAttnBackward>();
    node->scale = scale;
    node->window_left = window_left;
    node->window_right = window_right;
    node->bottom_right = bottom_right;
    node->deterministic = deterministic;
    node->bhsd = bhsd;
    node->softcap = softcap;
    node->alibi_slopes = alibi_slopes;
    node->mask_grad = mask_grad;
    if (!mask_grad) node->attn_mask = attn_mask;
    node->dropout_p = dropout_p;
    node->rng_state = rng_state;
    AttentionBackwardNode::attach(node, q, k, v, out, lse);
    if (mask_grad) {
      node->add_next_edge(torch::autograd::impl::gradient_edge(*attn_mask));
      node->mask_ = SavedVariable(*attn_mask, false);
    }
  }
  return {out, lse};
}

// The backward of varlen_attention: as FlashAttnBackward, with cu_seqlens
// (not differentiable, saved as plain tensors: they are int32) and the bounds.
struct VarlenFlashAttnBackward : public AttentionBackwardNode {
  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const at::Tensor& dout = grads[0];
    if (!dout.defined()) return variable_list(3);
    auto [dq, dk, dv] = call_varlen_bwd(unit_last_stride(dout), unit_last_stride(q_.unpack()),
                                        unit_last_stride(k_.unpack()), unit_last_stride(v_.unpack()),
                                        unit_last_stride(out_.unpack(getptr())), lse_.unpack(), args, deterministic);
    return {dq, dk, dv};
  }
  std::string name() const override { return "VarlenFlashAttnBackward"; }
  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    reset_saved();
    args.cu_seqlens_q.reset();
    args.cu_seqlens_k.reset();
    args.alibi_slopes.reset();
    args.rng_state.reset();
  }

  VarlenArgs args;
  bool deterministic = false;
};

VarlenArgs varlen_args(const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                       int64_t max_seqlen_k, double scale, int64_t window_left, int64_t window_right, bool bottom_right,
                       double softcap, const OptTensor& alibi_slopes, double dropout_p, const OptTensor& rng_state) {
  return {cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,     window_left,
          window_right, bottom_right, softcap,      alibi_slopes, dropout_p, rng_state};
}

// Below autograd: the kernels take a unit head_dim stride (copied only when not so).
std::tuple<at::Tensor, at::Tensor> varlen_attention_below_autograd(const at::Tensor& q, const at::Tensor& k,
                                                                   const at::Tensor& v, const VarlenArgs& a) {
  return call_varlen_fwd(kernel_layout(q, false), kernel_layout(k, false), kernel_layout(v, false), a);
}

std::tuple<at::Tensor, at::Tensor> varlen_attention_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double scale, int64_t window_left,
    int64_t window_right, bool bottom_right, bool deterministic, double softcap, const OptTensor& alibi_slopes,
    double dropout_p, const OptTensor& rng_state) {
  check_no_forward_ad("varlen_attention", q, k, v);
  const VarlenArgs args = varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left,
                                      window_right, bottom_right, softcap, alibi_slopes, dropout_p,
                                      call_rng_state(dropout_p, rng_state, q, varlen_planes(q, cu_seqlens_q)));
  at::Tensor out, lse;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    std::tie(out, lse) = varlen_attention_below_autograd(q, k, v, args);
  }
  if (torch::autograd::compute_requires_grad(q, k, v)) {
    auto node = make_node<VarlenFlashAttnBackward>();
    node->args = args;
    node->deterministic = deterministic;
    AttentionBackwardNode::attach(node, q, k, v, out, lse);
  }
  return {out, lse};
}

// Outputs of a non-differentiable op get an Error node when an input requires
// grad: the backward through them raises `message`.
template <typename... Tensors>
void attach_error(const std::vector<at::Tensor>& outputs, const char* message, const Tensors&... inputs) {
  if (!torch::autograd::compute_requires_grad(inputs...)) return;
  auto node = make_node<torch::autograd::Error>(message, torch::autograd::collect_next_edges(inputs...));
  for (const auto& t : outputs) {
    if (torch::autograd::isDifferentiableType(t.scalar_type())) torch::autograd::set_history(t, node);
  }
}

constexpr const char* kFwdNotDifferentiable =
    "flashattn_ext::fwd is the forward kernel alone and has no derivative; call flashattn_ext::attention "
    "(what flash_attn_func and scaled_dot_product_attention call), whose autograd formula runs flashattn_ext::bwd";

constexpr const char* kNoDoubleBackward =
    "flashattn_ext: double backward through flash attention is not supported (a gradient of a gradient, e.g. a "
    "gradient penalty computed with create_graph=True): the backward kernels have no derivative of their own, as in "
    "torch's flash, efficient and cuDNN SDPA backends. Compute such terms with "
    "torch.nn.functional.scaled_dot_product_attention under "
    "torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH)";

std::tuple<at::Tensor, at::Tensor> fwd_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                double scale, int64_t window_left, int64_t window_right,
                                                bool bottom_right, double softcap, const OptTensor& alibi_slopes,
                                                const OptTensor& attn_mask, double dropout_p,
                                                const OptTensor& rng_state) {
  check_no_forward_ad("fwd", q, k, v);
  at::Tensor out, lse;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    std::tie(out, lse) = call_fwd(q, k, v, scale, window_left, window_right, bottom_right, softcap, alibi_slopes,
                                  attn_mask, dropout_p, rng_state);
  }
  attach_error({out}, kFwdNotDifferentiable, q, k, v);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_autograd(const at::Tensor& dout, const at::Tensor& q,
                                                            const at::Tensor& k, const at::Tensor& v,
                                                            const at::Tensor& out, const at::Tensor& lse, double scale,
                                                            int64_t window_left, int64_t window_right,
                                                            bool bottom_right, bool deterministic, double softcap,
                                                            const OptTensor& alibi_slopes, const OptTensor& attn_mask,
                                                            double dropout_p, const OptTensor& rng_state) {
  check_no_forward_ad("bwd", dout, q, k, v, out, lse);
  at::Tensor dq, dk, dv;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    std::tie(dq, dk, dv) = call_bwd(dout, q, k, v, out, lse, scale, window_left, window_right, bottom_right,
                                    deterministic, softcap, alibi_slopes, attn_mask, dropout_p, rng_state);
  }
  attach_error({dq, dk, dv}, kNoDoubleBackward, dout, q, k, v, out, lse);
  return {dq, dk, dv};
}

std::tuple<at::Tensor, at::Tensor> varlen_fwd_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                                       int64_t max_seqlen_q, int64_t max_seqlen_k, double scale,
                                                       int64_t window_left, int64_t window_right, bool bottom_right,
                                                       double softcap, const OptTensor& alibi_slopes, double dropout_p,
                                                       const OptTensor& rng_state) {
  check_no_forward_ad("varlen_fwd", q, k, v);
  at::Tensor out, lse;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    std::tie(out, lse) =
        call_varlen_fwd(q, k, v,
                        varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left,
                                    window_right, bottom_right, softcap, alibi_slopes, dropout_p, rng_state));
  }
  attach_error({out}, kFwdNotDifferentiable, q, k, v);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd_autograd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, double scale, int64_t window_left, int64_t window_right, bool bottom_right,
    bool deterministic, double softcap, const OptTensor& alibi_slopes, double dropout_p, const OptTensor& rng_state) {
  check_no_forward_ad("varlen_bwd", dout, q, k, v, out, lse);
  at::Tensor dq, dk, dv;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    std::tie(dq, dk, dv) =
        call_varlen_bwd(dout, q, k, v, out, lse,
                        varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left,
                                    window_right, bottom_right, softcap, alibi_slopes, dropout_p, rng_state),
                        deterministic);
  }
  attach_error({dq, dk, dv}, kNoDoubleBackward, dout, q, k, v, out, lse);
  return {dq, dk, dv};
}

constexpr const char* kKvcacheNotDifferentiable =
    "flashattn_ext::fwd_kvcache (flash_attn_with_kvcache) is for inference and has no derivative; for training "
    "call flash_attn_func on the keys and values";

// fwd_kvcache: no formula (inference); an Error node makes a backward through
// its output raise instead of silently giving no gradient.
std::tuple<at::Tensor, at::Tensor> fwd_kvcache_autograd(const at::Tensor& q, const at::Tensor& k_cache,
                                                        const at::Tensor& v_cache, const at::Tensor& seqlens_k,
                                                        const std::optional<at::Tensor>& batch_idx,
                                                        const std::optional<at::Tensor>& leftpad,
                                                        const std::optional<at::Tensor>& block_table, double scale,
                                                        int64_t window_left, int64_t window_right, int64_t num_splits,
                                                        bool bhsd, double softcap, const OptTensor& alibi_slopes) {
  check_no_forward_ad("fwd_kvcache", q, k_cache, v_cache);
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("flashattn_ext::fwd_kvcache", "").typed<KvcacheSig>();
  at::Tensor out, lse;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    std::tie(out, lse) = op.call(q, k_cache, v_cache, seqlens_k, batch_idx, leftpad, block_table, scale, window_left,
                                 window_right, num_splits, bhsd, softcap, alibi_slopes);
  }
  attach_error({out}, kKvcacheNotDifferentiable, q, k_cache, v_cache);
  return {out, lse};
}

// ---------------------------------------------------------------------------
// Autocast

template <c10::DeviceType device_type>
at::Tensor autocast_arg(const at::Tensor& t) {
  return at::autocast::cached_cast(at::autocast::get_autocast_dtype(device_type), t, device_type);
}

// A float attn_mask is cast with q, k, v, as torch's autocast casts every
// floating argument of its scaled_dot_product_attention (a bool mask stays).
template <c10::DeviceType device_type>
OptTensor autocast_mask(const OptTensor& m) {
  if (!m.has_value() || !m->defined()) return m;
  return autocast_arg<device_type>(*m);
}

template <c10::DeviceType device_type>
std::tuple<at::Tensor, at::Tensor> attention_autocast(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      double scale, int64_t window_left, int64_t window_right,
                                                      bool bottom_right, bool deterministic, bool bhsd, double softcap,
                                                      const OptTensor& alibi_slopes, const OptTensor& attn_mask,
                                                      double dropout_p, const OptTensor& rng_state) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(device_type));
  return call_attention(autocast_arg<device_type>(q), autocast_arg<device_type>(k), autocast_arg<device_type>(v), scale,
                        window_left, window_right, bottom_right, deterministic, bhsd, softcap, alibi_slopes,
                        autocast_mask<device_type>(attn_mask), dropout_p, rng_state);
}

template <c10::DeviceType device_type>
std::tuple<at::Tensor, at::Tensor> fwd_autocast(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                double scale, int64_t window_left, int64_t window_right,
                                                bool bottom_right, double softcap, const OptTensor& alibi_slopes,
                                                const OptTensor& attn_mask, double dropout_p,
                                                const OptTensor& rng_state) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(device_type));
  return call_fwd(autocast_arg<device_type>(q), autocast_arg<device_type>(k), autocast_arg<device_type>(v), scale,
                  window_left, window_right, bottom_right, softcap, alibi_slopes, autocast_mask<device_type>(attn_mask),
                  dropout_p, rng_state);
}

template <c10::DeviceType device_type>
std::tuple<at::Tensor, at::Tensor> varlen_attention_autocast(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double scale, int64_t window_left,
    int64_t window_right, bool bottom_right, bool deterministic, double softcap, const OptTensor& alibi_slopes,
    double dropout_p, const OptTensor& rng_state) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(device_type));
  return call_varlen_attention(autocast_arg<device_type>(q), autocast_arg<device_type>(k), autocast_arg<device_type>(v),
                               varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left,
                                           window_right, bottom_right, softcap, alibi_slopes, dropout_p, rng_state),
                               deterministic);
}

template <c10::DeviceType device_type>
std::tuple<at::Tensor, at::Tensor> varlen_fwd_autocast(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                                       int64_t max_seqlen_q, int64_t max_seqlen_k, double scale,
                                                       int64_t window_left, int64_t window_right, bool bottom_right,
                                                       double softcap, const OptTensor& alibi_slopes, double dropout_p,
                                                       const OptTensor& rng_state) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(device_type));
  return call_varlen_fwd(autocast_arg<device_type>(q), autocast_arg<device_type>(k), autocast_arg<device_type>(v),
                         varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left,
                                     window_right, bottom_right, softcap, alibi_slopes, dropout_p, rng_state));
}

// ---------------------------------------------------------------------------
// Catch-all kernels

std::tuple<at::Tensor, at::Tensor> attention_composite(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       double scale, int64_t window_left, int64_t window_right,
                                                       bool bottom_right, bool /*deterministic: for the backward*/,
                                                       bool bhsd, double softcap, const OptTensor& alibi_slopes,
                                                       const OptTensor& attn_mask, double dropout_p,
                                                       const OptTensor& rng_state) {
  return attention_below_autograd(q, k, v, scale, window_left, window_right, bottom_right, bhsd, softcap, alibi_slopes,
                                  attn_mask, dropout_p, call_rng_state(dropout_p, rng_state, q, dense_planes(q, bhsd)));
}

std::tuple<at::Tensor, at::Tensor> fwd_unsupported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   double, int64_t, int64_t, bool, double, const OptTensor&,
                                                   const OptTensor&, double, const OptTensor&) {
  flashattn::reject_backend({{&q, "q"}, {&k, "k"}, {&v, "v"}});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_unsupported(const at::Tensor& dout, const at::Tensor& q,
                                                               const at::Tensor& k, const at::Tensor& v,
                                                               const at::Tensor& out, const at::Tensor& lse, double,
                                                               int64_t, int64_t, bool, bool, double, const OptTensor&,
                                                               const OptTensor&, double, const OptTensor&) {
  flashattn::reject_backend({{&q, "q"}, {&k, "k"}, {&v, "v"}, {&dout, "dout"}, {&out, "out"}, {&lse, "lse"}});
}

std::tuple<at::Tensor, at::Tensor> varlen_attention_composite(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double scale, int64_t window_left,
    int64_t window_right, bool bottom_right, bool /*deterministic: for the backward*/, double softcap,
    const OptTensor& alibi_slopes, double dropout_p, const OptTensor& rng_state) {
  return varlen_attention_below_autograd(
      q, k, v,
      varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left, window_right,
                  bottom_right, softcap, alibi_slopes, dropout_p,
                  call_rng_state(dropout_p, rng_state, q, varlen_planes(q, cu_seqlens_q))));
}

std::tuple<at::Tensor, at::Tensor> varlen_fwd_unsupported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                          const at::Tensor& cu_seqlens_q,
                                                          const at::Tensor& cu_seqlens_k, int64_t, int64_t, double,
                                                          int64_t, int64_t, bool, double, const OptTensor&, double,
                                                          const OptTensor&) {
  flashattn::reject_backend(
      {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&cu_seqlens_q, "cu_seqlens_q"}, {&cu_seqlens_k, "cu_seqlens_k"}});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd_unsupported(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t, int64_t, double,
    int64_t, int64_t, bool, bool, double, const OptTensor&, double, const OptTensor&) {
  flashattn::reject_backend({{&q, "q"},
                             {&k, "k"},
                             {&v, "v"},
                             {&dout, "dout"},
                             {&out, "out"},
                             {&lse, "lse"},
                             {&cu_seqlens_q, "cu_seqlens_q"},
                             {&cu_seqlens_k, "cu_seqlens_k"}});
}

std::tuple<at::Tensor, at::Tensor> fwd_kvcache_unsupported(const at::Tensor& q, const at::Tensor& k_cache,
                                                           const at::Tensor& v_cache, const at::Tensor& seqlens_k,
                                                           const std::optional<at::Tensor>& batch_idx,
                                                           const std::optional<at::Tensor>& leftpad,
                                                           const std::optional<at::Tensor>& block_table, double,
                                                           int64_t, int64_t, int64_t, bool, double, const OptTensor&) {
  const at::Tensor none;
  flashattn::reject_backend({{&q, "q"},
                             {&k_cache, "k_cache"},
                             {&v_cache, "v_cache"},
                             {&seqlens_k, "seqlens_k"},
                             {batch_idx ? &*batch_idx : &none, "cache_batch_idx"},
                             {leftpad ? &*leftpad : &none, "cache_leftpad"},
                             {block_table ? &*block_table : &none, "block_table"}});
}

at::Tensor kvcache_append_rotary_unsupported(const OptTensor& q, const OptTensor& k, const OptTensor& v,
                                             at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                                             const OptTensor& batch_idx, const OptTensor& block_table,
                                             const OptTensor& rotary_cos, const OptTensor& rotary_sin, bool, bool) {
  const at::Tensor none;
  auto opt = [&](const OptTensor& t) { return t ? &*t : &none; };
  flashattn::reject_backend({{opt(q), "q"},
                             {opt(k), "k"},
                             {opt(v), "v"},
                             {&k_cache, "k_cache"},
                             {&v_cache, "v_cache"},
                             {&cache_seqlens, "cache_seqlens"},
                             {opt(batch_idx), "cache_batch_idx"},
                             {opt(block_table), "block_table"},
                             {opt(rotary_cos), "rotary_cos"},
                             {opt(rotary_sin), "rotary_sin"}});
}

}  // namespace

TORCH_LIBRARY_IMPL(flashattn_ext, Autograd, m) {
  m.impl("attention", &attention_autograd);
  m.impl("fwd", &fwd_autograd);
  m.impl("bwd", &bwd_autograd);
  m.impl("varlen_attention", &varlen_attention_autograd);
  m.impl("varlen_fwd", &varlen_fwd_autograd);
  m.impl("varlen_bwd", &varlen_bwd_autograd);
  m.impl("fwd_kvcache", &fwd_kvcache_autograd);
}

TORCH_LIBRARY_IMPL(flashattn_ext, AutocastCPU, m) {
  m.impl("attention", &attention_autocast<c10::DeviceType::CPU>);
  m.impl("fwd", &fwd_autocast<c10::DeviceType::CPU>);
  m.impl("varlen_attention", &varlen_attention_autocast<c10::DeviceType::CPU>);
  m.impl("varlen_fwd", &varlen_fwd_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(flashattn_ext, AutocastCUDA, m) {
  m.impl("attention", &attention_autocast<c10::DeviceType::CUDA>);
  m.impl("fwd", &fwd_autocast<c10::DeviceType::CUDA>);
  m.impl("varlen_attention", &varlen_attention_autocast<c10::DeviceType::CUDA>);
  m.impl("varlen_fwd", &varlen_fwd_autocast<c10::DeviceType::CUDA>);
}

TORCH_LIBRARY_IMPL(flashattn_ext, CompositeExplicitAutograd, m) {
  m.impl("attention", &attention_composite);
  m.impl("fwd", &fwd_unsupported);
  m.impl("bwd", &bwd_unsupported);
  m.impl("varlen_attention", &varlen_attention_composite);
  m.impl("varlen_fwd", &varlen_fwd_unsupported);
  m.impl("varlen_bwd", &varlen_bwd_unsupported);
  m.impl("fwd_kvcache", &fwd_kvcache_unsupported);
  m.impl("kvcache_append_rotary", &kvcache_append_rotary_unsupported);
}
