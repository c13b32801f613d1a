// The binding layer shared by every backend: input validation (each error
// names the argument and the fix), output allocation and the translation of
// tensors into the torch-free params structs of flash_params.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

#include "flash_params.h"

namespace flashattn {

// What a backend accepts; the checks below word their errors from it.
struct BackendSpec {
  const char* name;                    // "CPU", "CUDA"
  std::vector<at::ScalarType> dtypes;  // accepted input dtypes
  const char* dtype_hint;              // appended to a dtype error
};

constexpr int kMaxHeadDim = 256;

// A tensor's sizes as torch prints them, for error messages.
std::string shape_str(const at::Tensor& t);

// Raises unless t (called name in the error) is on q's device.
void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& q);

// Validates that k and v (named k_name, v_name in the errors) are on q's
// device and of q's dtype, and that the backend has kernels for that dtype.
void check_devices_and_dtypes(const at::Tensor& q, const at::Tensor& k, const char* k_name, const at::Tensor& v,
                              const char* v_name, const BackendSpec& spec);

// Validates q, k, v for either pass: rank, dtype, device, sizes, strides.
void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const BackendSpec& spec);

// For the catch-all kernels (csrc/autograd.cpp), which the dispatcher reaches
// for every backend without kernels of its own (sparse, mkldnn, quantized,
// nested, MPS, XPU, ..., and CUDA in a CPU-only build): raises the error that
// names the first argument no kernel takes, and why. Never returns.
[[noreturn]] void reject_backend(const std::vector<std::pair<const at::Tensor*, const char*>>& tensors);

// Validates dout, out and lse of the backward against q.
void check_bwd_extras(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& out, const at::Tensor& lse);

// Validates the scalar arguments and builds the mask description.
MaskParams make_mask(int64_t window_left, int64_t window_right, bool bottom_right, int64_t seqlen_q, int64_t seqlen_k);

// Validates flash-attn's score modifications and describes them (the slopes'
// pointer: alibi_slopes must outlive the call). softcap: finite, >= 0 (0:
// none). alibi_slopes: float32, (heads_q,) or (batch, heads_q), unit stride on
// the heads, on q's device. `batch` / `heads_q` are the call's (varlen: the
// number of sequences).
ScoreMod make_score_mod(double softcap, const std::optional<at::Tensor>& alibi_slopes, const at::Tensor& q,
                        int64_t batch, int64_t heads_q);

// Validates dropout_p (finite, in [0, 1]) and, when it is > 0, rng_state
// (int64 (2,) [seed, offset], the state flashattn_ext::dropout_rng_state
// draws, on `device`, q's) and describes them (DropoutParams, csrc/philox.h):
// on the CPU the seed and offset are read from rng_state, on CUDA the kernels
// read them on the device (DropoutParams::rng_state; nothing read here).
DropoutParams make_dropout(double dropout_p, const std::optional<at::Tensor>& rng_state, const at::Device& device);

// A dense call with nothing to compute: zero batch, heads or query rows (an
// empty output), or no keys (a zero output, lse -inf), as torch's SDPA gives
// them. The backends return such outputs without a kernel (q, k in (batch,
// seqlen, heads, head_dim)).
bool is_empty_call(const at::Tensor& q, const at::Tensor& k);

// Adds torch SDPA's attn_mask (AttnBias in flash_params.h) to a dense call's
// ScoreMod: bool, or float32 / q's dtype (float64 for float64 q), on q's
// device, of rank 2 to 4 and a shape that broadcasts to (batch, heads_q,
// seqlen_q, seqlen_k) (q, k in (batch, seqlen, heads, head_dim)); read
// through its strides, broadcast dimensions at stride 0. Not with softcap or
// ALiBi. No-op when attn_mask is absent.
void add_attn_mask(ScoreMod& mod, const std::optional<at::Tensor>& attn_mask, const at::Tensor& q, const at::Tensor& k);

// The attn_mask's gradient (flashattn_ext::bwd_mask_grad): allocates the
// buffer the kernels write it into and points bias.grad at it (after
// add_attn_mask). The buffer is in the accumulation type, zeroed when `zeroed`
// (the CUDA kernels add into it), of the mask's shape as (B', H', L', S'),
// rank 4 (a dimension of size 1 where the mask broadcasts: the kernels sum
// over it, stride 0); with `expanded`, of the full (batch, heads_q, seqlen_q,
// seqlen_k), every element written once (the deterministic CUDA backward, which
// then sums in torch). Raises unless the mask is a floating-point one.
at::Tensor attn_mask_grad_buffer(AttnBias& bias, const at::Tensor& attn_mask, const at::Tensor& q, const at::Tensor& k,
                                 bool zeroed, bool expanded);
// The gradient of attn_mask from that buffer: summed over the dimensions the
// mask broadcasts (when expanded), in the mask's shape and dtype.
at::Tensor attn_mask_grad_result(const at::Tensor& buffer, const at::Tensor& attn_mask);

// Accumulation dtype of lse (float64 for float64 inputs, float32 otherwise).
at::ScalarType lse_dtype(at::ScalarType input);

// x, or a copy with stride 1 on its last dimension (head_dim) when it has
// another: the kernels need a unit head_dim stride; copy only when needed.
// (The attention ops' autograd, csrc/autograd.cpp, and the activated overrides
// of aten's flash ops, csrc/backend.cpp.)
at::Tensor unit_last_stride(const at::Tensor& x);

// Allocates out (batch, seqlen_q, heads_q, head_dim) and lse (batch, heads_q, seqlen_q).
std::tuple<at::Tensor, at::Tensor> alloc_fwd_outputs(const at::Tensor& q);
// lse alone, (batch, heads_q, seqlen_q) of lse_dtype (for a caller that allocates out its own way).
at::Tensor alloc_fwd_lse(const at::Tensor& q);

// Fills the pointers and strides of q, k, v, out and lse (4-D tensors).
void set_qkvo(QkvoParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
              const at::Tensor& lse);

// Fills the forward params from validated tensors.
AttnFwdParams make_fwd_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                              const at::Tensor& lse, double softmax_scale, const MaskParams& mask);

// Fills the backward params; dq, dk, dv are allocated by the caller.
AttnBwdParams make_bwd_params(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dq, const at::Tensor& dk,
                              const at::Tensor& dv, double softmax_scale, const MaskParams& mask, bool deterministic);

// ---------------------------------------------------------------------------
// Variable-length batches (the varlen_* ops): q (total_q, heads_q, head_dim),
// k, v (total_k, heads_kv, head_dim), cu_seqlens_q / cu_seqlens_k int32
// (batch + 1,) on q's device, max_seqlen_q / max_seqlen_k the bounds the
// kernels' grids are sized by.

// cu_seqlens-like arguments: int32 (batch + 1,) with batch >= 1, contiguous, on q's device.
void check_cu_seqlens(const at::Tensor& cu, const char* name, const at::Tensor& q);
// A max_seqlen bound: in [0, 2^31 - 1].
void check_max_seqlen(int64_t max_seqlen, const char* name);

// Validates everything that needs no read of cu_seqlens' values: ranks,
// dtypes, devices, sizes, strides (totals may be 0).
void check_varlen_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                      const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                      const BackendSpec& spec);

// Validates the values of cu_seqlens (on the CPU only: reading device
// memory would synchronise the host): 0 first, non-decreasing, the tensor's
// total last, the bound at least the longest sequence. Returns the longest.
int64_t check_cu_seqlens_values(const at::Tensor& cu_seqlens, const char* name, int64_t total, const char* tensor,
                                int64_t max_seqlen, const char* max_name);

// Validates dout, out and lse (heads_q, total_q) of the varlen backward against q.
void check_varlen_bwd_extras(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& out, const at::Tensor& lse);

// Fills the params of a varlen batch from tensors given as (1, total, heads,
// head_dim) views (so that the dense helpers apply) and lse (heads_q, total_q).
AttnFwdParams make_varlen_fwd_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
                                     const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                                     double softmax_scale, const MaskParams& mask);
AttnBwdParams make_varlen_bwd_params(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                     const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                                     const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                     int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
                                     const MaskParams& mask, bool deterministic);

}  // namespace flashattn
