// Torch-free description of one attention call.
//
// The binding layer (csrc/attention_api.cpp) is the only code that knows about
// at::Tensor: it validates the inputs, fills these structs and hands them to a
// backend (csrc/cpu/, csrc/cuda/). Kernels see raw pointers, int64 strides in
// elements and precomputed scalars, so they can be compiled by nvcc without
// torch headers and reused by any future front end.
//
// Tensor layouts, as the kernels see them (strides may be anything with a unit
// stride on the head dimension):
//   q, o, dq, do : (batch, seqlen_q, heads_q,  head_dim)
//   k, v, dk, dv : (batch, seqlen_k, heads_kv, head_dim)
//   lse, dsum    : (batch, heads_q, seqlen_q)  float32 (float64 for float64 inputs), contiguous
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FLASHATTN_HOST_DEVICE __host__ __device__
#else
#define FLASHATTN_HOST_DEVICE
#endif

namespace flashattn {

enum class ScalarKind : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2, kFloat64 = 3 };

// Which keys a query may see. Key j is visible from query i iff
//   j <  seqlen_k
//   j <= i + diag_offset + window_right   (when window_right >= 0)
//   j >= i + diag_offset - window_left    (when window_left  >= 0)
// Causal attention is window_right = 0. diag_offset = 0 aligns the diagonal
// top-left (torch's SDPA convention); diag_offset = seqlen_k - seqlen_q aligns
// it bottom-right (FlashAttention's convention). A query row that sees no key
// gets a zero output, log-sum-exp -inf and zero gradients.
struct MaskParams {
  int window_left = -1;   // -1: unbounded
  int window_right = -1;  // -1: unbounded; 0: causal
  int diag_offset = 0;
};

struct AttnFwdParams {
  using index_t = int64_t;

  // Inputs.
  const void* q_ptr = nullptr;
  const void* k_ptr = nullptr;
  const void* v_ptr = nullptr;
  index_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  index_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  index_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;

  // Outputs.
  void* o_ptr = nullptr;
  index_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;
  void* lse_ptr = nullptr;  // contiguous (batch, heads_q, seqlen_q), accumulation type

  // Sizes.
  int batch = 0;
  int heads_q = 0;
  int heads_kv = 0;  // divides heads_q; head h of q reads kv head h / (heads_q / heads_kv)
  int seqlen_q = 0;
  int seqlen_k = 0;
  int head_dim = 0;

  ScalarKind dtype = ScalarKind::kFloat32;

  // Scores are softmax_scale * q.k (kept in double for the float64 CPU path);
  // scale_log2 = softmax_scale * log2(e) lets the CUDA kernels use exp2 with
  // the scale folded in.
  double softmax_scale = 1.0;
  float softmax_scale_log2 = 1.f;

  MaskParams mask;

  // Compute capability x 10 of the device the CUDA kernels run on (90 for
  // H100/H200): picks architecture-specific kernels. 0 on the CPU.
  int device_arch = 0;
  // Hopper: the warp-specialized TMA kernels may run (FLASHATTN_DISABLE_TMA=1
  // clears it, to time the cp.async Hopper kernels beside them).
  bool allow_tma = true;
  // The persistent Hopper forward's tile order: plain striding, or alternating
  // direction every round (FLASHATTN_FWD_BOUSTROPHEDON=1, for timing; slower
  // at d64/d128 causal in the A/B of benchmarks/NOTES.md).
  bool fwd_boustrophedon = false;

  FLASHATTN_HOST_DEVICE int heads_ratio() const { return heads_q / heads_kv; }
};

struct AttnBwdParams : AttnFwdParams {
  // Inputs of the backward pass (q, k, v, o, lse come from AttnFwdParams).
  const void* do_ptr = nullptr;
  index_t do_batch_stride = 0, do_row_stride = 0, do_head_stride = 0;

  // Gradients.
  void* dq_ptr = nullptr;
  void* dk_ptr = nullptr;
  void* dv_ptr = nullptr;
  index_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  index_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  index_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;

  // Workspace owned by the binding layer (CUDA only; nullptr on the CPU):
  //   dsum     : rowsum(dO * O), (batch, heads_q, seqlen_q) float32
  //   dq_accum : float32 accumulator for dq, (batch, seqlen_q_rounded, heads_q, head_dim_rounded)
  void* dsum_ptr = nullptr;
  void* dq_accum_ptr = nullptr;
  index_t dq_accum_batch_stride = 0, dq_accum_row_stride = 0, dq_accum_head_stride = 0;

  // Gradients bitwise reproducible from run to run (no float atomics).
  bool deterministic = false;
  // The deterministic Hopper backward: one int32 counter per (batch, head,
  // 64-query block), zeroed, counting the key blocks whose dQ is added
  // (the adds go in a fixed order). nullptr otherwise.
  int* dq_semaphore_ptr = nullptr;
};

}  // namespace flashattn
