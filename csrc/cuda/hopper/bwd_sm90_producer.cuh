// The producer role of the warp-specialized Hopper backward kernels
// (flash_bwd_sm90_ws_kernel.cuh, flash_bwd_sm90_ws_split_kernel.cuh): the
// tensor maps its TMA loads read, and the per-step row vectors (lse, D) its
// lanes copy into each stage. (The producer warp's loop itself is still in
// each kernel: one shared loop perturbed ptxas's scheduling of the consumers'
// prologue, benchmarks/NOTES.md.)
#pragma once

#include "../../flash_params.h"
#include "../bwd_common.cuh"

namespace flashattn {

// The tensor maps of one backward call (tma_host.h): q, k, v, dO as 4-D
// (head_dim, heads, seqlen, batch) tensors read in 64-column boxes.
struct BwdTmaMaps {
  CUtensorMap q, k, v, dout;
};

// The lse (log2 units) and D of a step's kBlockM query rows, kBlockM / 32 a
// lane of the producer warp, loaded one step ahead so that their latency is not
// on the path. Rows past seqlen_q: lse +inf makes P (and so dS, dV, dK, dQ) zero.
template <int kBlockM>
struct StepRowVecs {
  static constexpr int kRowsPerLane = kBlockM / 32;
  float lse[kRowsPerLane], dsum[kRowsPerLane];

  __device__ __forceinline__ void load(const AttnBwdParams& p, int b, int hq, int m0, int lane) {
    const int64_t vec = (int64_t(b) * p.heads_q + hq) * p.seqlen_q + m0;
#pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i) {
      const int r = lane + 32 * i;
      const bool in = m0 + r < p.seqlen_q;
      lse[i] = in ? lse_to_log2(static_cast<const float*>(p.lse_ptr)[vec + r]) : INFINITY;
      dsum[i] = in ? static_cast<const float*>(p.dsum_ptr)[vec + r] : 0.f;
    }
  }
  // Varlen: the sequence's rows of (heads_q, total_q) (SeqInfo); rows past its seqlen_q as above.
  __device__ __forceinline__ void load(const AttnBwdParams& p, const SeqInfo& seq, int b, int hq, int m0, int lane) {
    const int64_t vec = seq.rowvec_offset(p, b, hq) + m0;
#pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i) {
      const int r = lane + 32 * i;
      const bool in = m0 + r < seq.seqlen_q;
      lse[i] = in ? lse_to_log2(static_cast<const float*>(p.lse_ptr)[vec + r]) : INFINITY;
      dsum[i] = in ? static_cast<const float*>(p.dsum_ptr)[vec + r] : 0.f;
    }
  }
  // Into the stage's vectors (kBlockM floats each).
  __device__ __forceinline__ void store(float* stage_lse, float* stage_dsum, int lane) const {
#pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i) {
      stage_lse[lane + 32 * i] = lse[i];
      stage_dsum[lane + 32 * i] = dsum[i];
    }
  }
};

}  // namespace flashattn
