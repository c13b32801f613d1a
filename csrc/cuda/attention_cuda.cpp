// CUDA implementation of flashattn_ext::fwd / bwd: validation through the
// shared binding layer, the kernels' layout requirements, workspace
// allocation, and the dispatch to one (dtype, head dim) instantiation.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdlib>
#include <string>
#include <type_traits>

#include "../attention_api.h"
#include "../kvcache_api.h"
#include "binding_util.h"
#include "decode_launch.h"
#include "dispatch.h"
#include "mask_summary.h"

namespace flashattn {
namespace {

void check_grid(int64_t blocks, const char* what) {
  TORCH_CHECK_VALUE(blocks <= INT32_MAX, "flashattn_ext: the ", what, " needs ", blocks,
                    " thread blocks, more than a CUDA grid holds (2^31 - 1); split the batch");
}

// The archs the kernels were built for (setup.py's -DFLASHATTN_CUDA_ARCHS), for the error below.
#ifdef FLASHATTN_CUDA_ARCHS
#define FLASHATTN_BUILT_ARCHS FLASHATTN_CUDA_ARCHS
#else
#define FLASHATTN_BUILT_ARCHS "(unknown)"
#endif

// cudaFuncSetAttribute answers "invalid argument" when a kernel asks for more
// shared memory per block than the device has: say so, with the numbers.
void check_launch(cudaError_t err, const char* what, int kernel_dim, const at::Tensor& q) {
  if (err == cudaSuccess) return;
  const auto* prop = at::cuda::getDeviceProperties(q.device().index());
  // A build for other archs (setup.py builds a GPU machine's own arch by default).
  TORCH_CHECK(err != cudaErrorNoKernelImageForDevice, "flashattn_ext: the CUDA kernels were built for archs ",
              FLASHATTN_BUILT_ARCHS, " and this GPU (", prop->name, ") is sm_", prop->major, prop->minor,
              "; rebuild for it, e.g. TORCH_CUDA_ARCH_LIST=\"", prop->major, ".", prop->minor,
              "\" pip install --no-build-isolation -e .");
  TORCH_CHECK(err != cudaErrorInvalidValue, "flashattn_ext: CUDA ", what, " kernel for head dim ", kernel_dim,
              " failed to launch (", cudaGetErrorString(err), "); a likely cause is shared memory: the kernels for ",
              "head dims >= 128 take up to 161 KiB per block and this GPU (", prop->name, ") allows ",
              prop->sharedMemPerBlockOptin / 1024, " KiB; use a smaller head dim, or torch's attention on this GPU");
  TORCH_CHECK(false, "flashattn_ext: CUDA ", what, " kernel failed: ", cudaGetErrorString(err));
}

// The mask summary of an attn_mask call (mask_summary.h), in a tensor the
// caller keeps alive until the kernels have been queued.
at::Tensor summarize_attn_mask(AttnBias& bias, const at::Tensor& q, int64_t seqlen_k) {
  if (bias.ptr == nullptr) return {};
  const MaskSummaryShape shape = mask_summary_shape(bias, q.size(0), q.size(2), q.size(1), seqlen_k);
  TORCH_CHECK_VALUE(shape.bytes() <= INT32_MAX, "flashattn_ext: attn_mask is too large for the CUDA kernels' summary (",
                    shape.bytes(), " blocks of 64 x 16); split the batch");
  auto summary = at::empty({shape.bytes()}, q.options().dtype(at::kByte));
  const cudaError_t err =
      launch_mask_summary(bias, shape, summary.data_ptr<uint8_t>(), at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "flashattn_ext: the attn_mask summary kernel failed: ", cudaGetErrorString(err));
  return summary;
}

// Runs the forward kernel (AttnFwdParams) or the backward kernel
// (AttnBwdParams) of q's dtype and kernel head dim kdim on the current stream,
// and checks that it launched.
template <typename Params>
void launch(const Params& params, int kdim, const at::Tensor& q) {
  constexpr bool kBackward = std::is_same_v<Params, AttnBwdParams>;
  const auto stream = at::cuda::getCurrentCUDAStream().stream();
  const cudaError_t err = with_element_type(q.scalar_type(), [&](auto elem) {
    return with_kernel_head_dim(kdim, [&](auto dim) {
      using T = decltype(elem);
      if constexpr (kBackward) {
        return run_bwd<T, decltype(dim)::value>(params, stream);
      } else {
        return run_fwd<T, decltype(dim)::value>(params, stream);
      }
    });
  });
  check_launch(err, kBackward ? "backward" : "forward", kdim, q);
}

// Whether run_bwd tries the warp-specialized backward for params at q's dtype
// and kernel head dim kdim (bwd_tries_sm90_ws, dispatch.h).
bool tries_sm90_ws(const AttnBwdParams& params, int kdim, const at::Tensor& q) {
  bool tries = false;
  with_element_type(q.scalar_type(), [&](auto elem) {
    return with_kernel_head_dim(kdim, [&](auto dim) {
      tries = bwd_tries_sm90_ws<decltype(elem), decltype(dim)::value>(params);
      return cudaSuccess;
    });
  });
  return tries;
}

// A short query against many keys (decode_route: a model's decode step
// through flash_attn_func or the SDPA drop-in) on the split-KV decoding
// kernels: every key of the call visible (no cache lengths: row_seqlen_k),
// the window, aligned bottom-right as theirs, passed on; out and lse as the
// main forward writes them, so that the backward runs from them unchanged.
void run_on_decode_kernels(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                           const at::Tensor& lse, double softmax_scale, int64_t window_left, int64_t window_right,
                           double softcap, int kdim) {
  const at::Tensor all_keys;  // undefined: every row holds seqlen_k keys
  const std::optional<at::Tensor> none;
  const KvcacheInputs in{q, k, v, all_keys, none, none, none, softcap, none};
  KvcacheParams params = make_kvcache_params(in, out, lse, softmax_scale, window_left, window_right);
  launch_decode(params, /*num_splits=*/0, kdim, q, "the forward (a short query on the decoding kernel)");
}

std::tuple<at::Tensor, at::Tensor> fwd_cuda(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                            double softmax_scale, int64_t window_left, int64_t window_right,
                                            bool bottom_right, double softcap,
                                            const std::optional<at::Tensor>& alibi_slopes,
                                            const std::optional<at::Tensor>& attn_mask, double dropout_p,
                                            const std::optional<at::Tensor>& rng_state) {
  // (rng_state on q's device: the kernels read it there, DropoutParams::rng_state.)
  const DropoutParams dropout = make_dropout(dropout_p, rng_state, q_in.device());
  check_qkv(q_in, k_in, v_in, kCudaSpec);
  check_device(q_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const int64_t head_dim = q_in.size(3);
  const int kdim = kernel_head_dim(head_dim);
  const auto mask = make_mask(window_left, window_right, bottom_right, q_in.size(1), k_in.size(1));
  const at::Tensor q = make_kernel_ready(q_in), k = make_kernel_ready(k_in), v = make_kernel_ready(v_in);
  auto [out, lse] = alloc_fwd_outputs(q);
  const bool plain =
      !(attn_mask && attn_mask->defined()) && !dropout.enabled() && !(alibi_slopes && alibi_slopes->defined());
  if (decode_route(q.size(0), q.size(1), q.size(2), k.size(2), k.size(1), kdim, plain,
                   window_left >= 0 || window_right >= 0, bottom_right)) {
    run_on_decode_kernels(q, k, v, out, lse, softmax_scale, window_left, window_right, softcap, kdim);
    return {unpad(out, head_dim), lse};
  }
  check_grid((q.size(1) + 63) / 64 * q.size(0) * q.size(2), "forward");
  auto params = make_fwd_params(q, k, v, out, lse, softmax_scale, mask);
  params.score_mod = make_score_mod(softcap, alibi_slopes, q, q.size(0), q.size(2));
  add_attn_mask(params.score_mod, attn_mask, q, k);
  params.dropout = dropout;
  // Nothing to compute (torch's SDPA semantics): an empty output, or zeros and lse -inf without keys.
  if (is_empty_call(q, k)) return {unpad(out.zero_(), head_dim), lse.fill_(-INFINITY)};
  const at::Tensor mask_summary = summarize_attn_mask(params.score_mod.bias, q, k.size(1));
  params.device_arch = device_arch(q);
  params.allow_tma = !env_flag("FLASHATTN_DISABLE_TMA");
  const at::Tensor tile_counter = add_tile_counter(params, q);
  launch(params, kdim, q);
  return {unpad(out, head_dim), lse};
}

// bwd and bwd_mask_grad: dq, dk, dv and, with mask_grad, the attn_mask's
// gradient (undefined otherwise).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse, double softmax_scale, int64_t window_left, int64_t window_right,
    bool bottom_right, bool deterministic, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& attn_mask, bool mask_grad, double dropout_p,
    const std::optional<at::Tensor>& rng_state) {
  const DropoutParams dropout = make_dropout(dropout_p, rng_state, q_in.device());
  check_qkv(q_in, k_in, v_in, kCudaSpec);
  check_bwd_extras(dout_in, q_in, out_in, lse);
  check_device(q_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const int64_t head_dim = q_in.size(3);
  const int kdim = kernel_head_dim(head_dim);
  const auto mask = make_mask(window_left, window_right, bottom_right, q_in.size(1), k_in.size(1));
  const at::Tensor q = make_kernel_ready(q_in), k = make_kernel_ready(k_in), v = make_kernel_ready(v_in);
  const at::Tensor out = make_kernel_ready(out_in), dout = make_kernel_ready(dout_in);

  auto dq = at::empty(q.sizes(), q.options());
  auto dk = at::empty(k.sizes(), k.options());
  auto dv = at::empty(v.sizes(), v.options());
  const int64_t batch = q.size(0), seqlen_q = q.size(1), heads_q = q.size(2);
  auto f32 = q.options().dtype(at::kFloat);
  auto dsum = at::empty({batch, heads_q, seqlen_q}, f32);
  check_grid((k.size(1) + 63) / 64 * 2 * batch * k.size(2), "backward");
  check_grid((seqlen_q + 63) / 64 * batch * heads_q, "backward");

  auto params = make_bwd_params(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, mask, deterministic);
  params.score_mod = make_score_mod(softcap, alibi_slopes, q, batch, heads_q);
  add_attn_mask(params.score_mod, attn_mask, q, k);
  params.dropout = dropout;  // (before tries_sm90_ws below: the dispatch's rule reads it)
  // The mask's gradient: the kernels add dS into a zeroed float32 buffer
  // (atomics where the mask broadcasts); the deterministic backward writes
  // the full (batch, heads, seqlen_q, seqlen_k) once per element instead and
  // sums in torch (the same buffer when the mask does not broadcast).
  const at::Tensor dmask_buffer =
      mask_grad ? attn_mask_grad_buffer(params.score_mod.bias, *attn_mask, q, k, /*zeroed=*/true, deterministic)
                : at::Tensor();
  auto dmask = [&] { return mask_grad ? attn_mask_grad_result(dmask_buffer, *attn_mask) : at::Tensor(); };
  if (is_empty_call(q, k))
    return {unpad(dq.zero_(), head_dim), unpad(dk.zero_(), head_dim), unpad(dv.zero_(), head_dim), dmask()};
  const at::Tensor mask_summary = summarize_attn_mask(params.score_mod.bias, q, k.size(1));
  params.dsum_ptr = dsum.data_ptr();
  params.device_arch = device_arch(q);
  params.allow_tma = !env_flag("FLASHATTN_DISABLE_TMA");
  params.dq_allow_rotation = !env_flag("FLASHATTN_DQ_PLAIN_ORDER");
  params.bwd_long_steps = !env_flag("FLASHATTN_BWD_D64_SHORT_STEPS");
  // dQ accumulates in fp32 across key blocks: rows padded to the kernel's
  // query block, columns to the kernel head dim (atomics touch all of them);
  // bwd_preprocess_kernel (before the warp-specialized kernel, a memset)
  // zeroes what is read back. Every non-deterministic path adds into it. The
  // deterministic backward needs it, and the zeroed int32 counters of its
  // fixed add order, only where run_bwd tries the warp-specialized kernel
  // (bwd_tries_sm90_ws, the dispatch's own rule). Elsewhere (a head dim
  // without that kernel, FLASHATTN_DISABLE_TMA, FLASHATTN_DISABLE_SM90, a
  // build without sm90a, a device other than sm90) it runs the mma.sync dK/dV
  // kernel and a separate dQ pass that writes dQ itself, as it also does when
  // the warp-specialized kernel declines a layout TMA cannot describe.
  const bool sm90_ws = tries_sm90_ws(params, kdim, q);
  const int64_t seqlen_q_padded = (seqlen_q + kBwdBlockM - 1) / kBwdBlockM * kBwdBlockM;
  // Whole 64-column blocks: the Hopper kernels add dQ in 64 x 64 blocks (at
  // head dim 96 the 128-wide kernel runs, its padding columns zero).
  const int64_t dq_accum_cols = (kdim + 63) / 64 * 64;
  at::Tensor dq_accum =
      deterministic && !sm90_ws ? at::Tensor() : at::empty({batch, heads_q, seqlen_q_padded, dq_accum_cols}, f32);
  at::Tensor dq_semaphore = deterministic && sm90_ws
                                ? at::zeros({batch, heads_q, (seqlen_q + 63) / 64}, q.options().dtype(at::kInt))
                                : at::Tensor();
  if (dq_semaphore.defined()) params.dq_semaphore_ptr = dq_semaphore.data_ptr<int>();
  if (dq_accum.defined()) {
    params.dq_accum_ptr = dq_accum.data_ptr();
    params.dq_accum_batch_stride = dq_accum.stride(0);
    params.dq_accum_head_stride = dq_accum.stride(1);
    params.dq_accum_row_stride = dq_accum.stride(2);
  }
  launch(params, kdim, q);
  return {unpad(dq, head_dim), unpad(dk, head_dim), unpad(dv, head_dim), dmask()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, double softmax_scale, int64_t window_left, int64_t window_right, bool bottom_right,
    bool deterministic, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& attn_mask, double dropout_p, const std::optional<at::Tensor>& rng_state) {
  auto [dq, dk, dv, unused] = backward(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, bottom_right,
                                       deterministic, softcap, alibi_slopes, attn_mask, false, dropout_p, rng_state);
  return {dq, dk, dv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_mask_grad_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, double softmax_scale, int64_t window_left, int64_t window_right, bool bottom_right,
    bool deterministic, const at::Tensor& attn_mask, double dropout_p, const std::optional<at::Tensor>& rng_state) {
  return backward(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, bottom_right, deterministic, 0.0,
                  std::nullopt, attn_mask, true, dropout_p, rng_state);
}

// ---------------------------------------------------------------------------
// Variable-length batches: one launch for the whole batch; the kernels read
// cu_seqlens on the device. Nothing here reads device memory on the host (no
// synchronisation): cu_seqlens' values are not checked (the kernels clamp
// them to the tensors, so bad values give wrong rows, never an access outside
// the tensors), and max_seqlen_q / max_seqlen_k are trusted as bounds (a
// sequence longer than its bound is cut to it). The tensors go through the
// dense helpers as (1, total, heads, head_dim) views.

std::tuple<at::Tensor, at::Tensor> varlen_fwd_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                                   const at::Tensor& v_in, const at::Tensor& cu_seqlens_q,
                                                   const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                                   int64_t max_seqlen_k, double softmax_scale, int64_t window_left,
                                                   int64_t window_right, bool bottom_right, double softcap,
                                                   const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
                                                   const std::optional<at::Tensor>& rng_state) {
  const DropoutParams dropout = make_dropout(dropout_p, rng_state, q_in.device());
  check_varlen_qkv(q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kCudaSpec);
  check_device(q_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const int64_t head_dim = q_in.size(2);
  const int kdim = kernel_head_dim(head_dim);
  const auto mask = make_mask(window_left, window_right, bottom_right, max_seqlen_q, max_seqlen_k);
  const at::Tensor q = make_kernel_ready(q_in.unsqueeze(0)), k = make_kernel_ready(k_in.unsqueeze(0)),
                   v = make_kernel_ready(v_in.unsqueeze(0));
  auto out = at::empty(q.sizes(), q.options());
  auto lse = at::empty({q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  const int64_t batch = cu_seqlens_q.size(0) - 1;
  check_grid((max_seqlen_q + 63) / 64 * batch * q.size(2), "forward");
  auto params = make_varlen_fwd_params(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       softmax_scale, mask);
  params.score_mod = make_score_mod(softcap, alibi_slopes, q, batch, q.size(2));
  params.dropout = dropout;
  params.device_arch = device_arch(q);
  // The warp-specialized TMA forward runs varlen batches too: the same switches as fwd_cuda's.
  params.allow_tma = !env_flag("FLASHATTN_DISABLE_TMA");
  const at::Tensor tile_counter = add_tile_counter(params, q);
  launch(params, kdim, q);
  return {unpad(out, head_dim)[0], lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, int64_t window_left, int64_t window_right,
    bool bottom_right, bool deterministic, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    double dropout_p, const std::optional<at::Tensor>& rng_state) {
  const DropoutParams dropout = make_dropout(dropout_p, rng_state, q_in.device());
  check_varlen_qkv(q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kCudaSpec);
  check_varlen_bwd_extras(dout_in, q_in, out_in, lse);
  check_device(q_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const int64_t head_dim = q_in.size(2);
  const int kdim = kernel_head_dim(head_dim);
  const auto mask = make_mask(window_left, window_right, bottom_right, max_seqlen_q, max_seqlen_k);
  const at::Tensor q = make_kernel_ready(q_in.unsqueeze(0)), k = make_kernel_ready(k_in.unsqueeze(0)),
                   v = make_kernel_ready(v_in.unsqueeze(0));
  const at::Tensor out = make_kernel_ready(out_in.unsqueeze(0)), dout = make_kernel_ready(dout_in.unsqueeze(0));

  auto dq = at::empty(q.sizes(), q.options());
  auto dk = at::empty(k.sizes(), k.options());
  auto dv = at::empty(v.sizes(), v.options());
  const int64_t batch = cu_seqlens_q.size(0) - 1, total_q = q.size(1), heads_q = q.size(2);
  auto f32 = q.options().dtype(at::kFloat);
  auto dsum = at::empty({heads_q, total_q}, f32);
  check_grid((max_seqlen_k + 63) / 64 * 2 * batch * k.size(2), "backward");
  check_grid((max_seqlen_q + 63) / 64 * batch * heads_q, "backward");

  auto params = make_varlen_bwd_params(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, softmax_scale, mask, deterministic);
  params.score_mod = make_score_mod(softcap, alibi_slopes, q, batch, heads_q);
  params.dropout = dropout;  // (before tries_sm90_ws below: the dispatch's rule reads it)
  params.dsum_ptr = dsum.data_ptr();
  params.device_arch = device_arch(q);
  // The warp-specialized TMA backward runs varlen batches too: the same switches as bwd_cuda's.
  params.allow_tma = !env_flag("FLASHATTN_DISABLE_TMA");
  params.dq_allow_rotation = !env_flag("FLASHATTN_DQ_PLAIN_ORDER");
  params.bwd_long_steps = !env_flag("FLASHATTN_BWD_D64_SHORT_STEPS");
  // Each sequence's dQ accumulator rows are followed by kBwdBlockM padding
  // rows of its own (flash_params.h); bwd_preprocess_kernel zeroes the rows
  // read back (the warp-specialized kernel's: whole 64-row blocks of each
  // sequence). Columns: whole 64-column blocks, as in bwd_cuda (the
  // warp-specialized kernel adds 64 x 64 blocks: at head dim 96 the 128-wide
  // kernel's tile is 128 columns a row). The deterministic backward needs the
  // accumulator, and zeroed counters per (sequence, head, 64-query block)
  // (indexed by max_seqlen_q, as a dense batch of that length), only where
  // run_bwd tries the warp-specialized kernel; elsewhere it runs the mma.sync
  // dQ pass, which needs neither.
  const bool sm90_ws = tries_sm90_ws(params, kdim, q);
  const int64_t dq_accum_cols = (kdim + 63) / 64 * 64;
  at::Tensor dq_accum =
      deterministic && !sm90_ws ? at::Tensor() : at::empty({heads_q, total_q + batch * kBwdBlockM, dq_accum_cols}, f32);
  at::Tensor dq_semaphore = deterministic && sm90_ws
                                ? at::zeros({batch, heads_q, (max_seqlen_q + 63) / 64}, q.options().dtype(at::kInt))
                                : at::Tensor();
  if (dq_semaphore.defined()) params.dq_semaphore_ptr = dq_semaphore.data_ptr<int>();
  if (dq_accum.defined()) {
    params.dq_accum_ptr = dq_accum.data_ptr();
    params.dq_accum_batch_stride = 0;  // sequences are located by cu_seqlens (SeqInfo)
    params.dq_accum_head_stride = dq_accum.stride(0);
    params.dq_accum_row_stride = dq_accum.stride(1);
  }
  launch(params, kdim, q);
  return {unpad(dq, head_dim)[0], unpad(dk, head_dim)[0], unpad(dv, head_dim)[0]};
}

}  // namespace
}  // namespace flashattn

TORCH_LIBRARY_IMPL(flashattn_ext, CUDA, m) {
  m.impl("fwd", &flashattn::fwd_cuda);
  m.impl("bwd", &flashattn::bwd_cuda);
  m.impl("bwd_mask_grad", &flashattn::bwd_mask_grad_cuda);
  m.impl("varlen_fwd", &flashattn::varlen_fwd_cuda);
  m.impl("varlen_bwd", &flashattn::varlen_bwd_cuda);
}
