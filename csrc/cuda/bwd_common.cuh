// What every backward kernel family shares (the mma.sync kernels of
// flash_bwd_kernel.cuh and the Hopper kernels of hopper/): the lse in log2
// units, the dQ accumulator's layout, the preprocessing kernel (D = rowsum(dO *
// O), the accumulator zeroed), the dQ conversion kernel and its non-finite
// slow path, and the cp.async load of a per-row vector. Kept apart so that no
// kernel family's file includes another's.
#pragma once

#include "../flash_params.h"
#include "dispatch.h"
#include "kernel_traits.h"
#include "nonfinite_fixup.cuh"
#include "tile.cuh"

namespace flashattn {

// lse (natural log) -> log2 units; a row that saw no key (-inf) gets +inf so
// that exp2(s - lse) is 0 there instead of inf.
__device__ __forceinline__ float lse_to_log2(float lse) { return lse == -INFINITY ? INFINITY : lse * kLog2e; }

// Element offset of dq_accum[b, h, row 0] (layout: flash_params.h). A varlen
// sequence's rows start kBwdBlockM rows further per earlier sequence: the
// atomics of a partial last query block write up to kBwdBlockM - 1 rows past
// the sequence's end, which must not be the next sequence's rows.
__device__ __forceinline__ int64_t dq_accum_offset(const AttnBwdParams& p, const SeqInfo& seq, int b, int h) {
  const int64_t row0 = seq.varlen ? seq.q_start + int64_t(b) * kBwdBlockM : 0;
  return b * p.dq_accum_batch_stride + h * p.dq_accum_head_stride + row0 * p.dq_accum_row_stride;
}

// D[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d], kLanesPerRow lanes a row
// (8 elements each), several rows a warp. The rows run over (b, h, i < seqlen_q);
// in a varlen batch seqlen_q is max_seqlen_q and rows past a sequence's end idle.
// It also zeroes the dQ accumulator (when p.dq_accum_ptr is set), which saves a
// separate memset:
//   kWholeBlocks = false (the atomic-dQ kernels): dq_accum[b, h, i, 0:head_dim],
//     the only part convert_dq_kernel reads (the atomics also land on padding
//     rows and columns, which nothing reads);
//   kWholeBlocks = true (the warp-specialized Hopper backward): its tiles are
//     added whole in DqFragLayout order, 64 rows x row_stride floats each, so
//     rows run up to the next multiple of 64 and every column of them is
//     zeroed (rows past seqlen_q compute no D). Varlen: up to the next
//     multiple of 64 of the sequence's own seqlen_q (its rows and padding
//     rows of its own, dq_accum_offset); rows i past that, up to max_seqlen_q
//     rounded, would be the next sequence's (or past the accumulator) and idle.
template <typename T, int kLanesPerRow, bool kWholeBlocks = false>
__global__ void bwd_preprocess_kernel(const AttnBwdParams p) {
  const int rows_per_head = kWholeBlocks ? ceil_div(p.seqlen_q, 64) * 64 : p.seqlen_q;
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kLanesPerRow;  // over (b, h, i)
  const int sub = threadIdx.x % kLanesPerRow;
  const int64_t total = int64_t(p.batch) * p.heads_q * rows_per_head;
  const int i = static_cast<int>(row % rows_per_head);
  const int h = static_cast<int>((row / rows_per_head) % p.heads_q);
  const int b = static_cast<int>(row / (int64_t(rows_per_head) * p.heads_q));
  const SeqInfo seq(p, row < total ? b : 0);           // (cu_seqlens has batch + 1 entries)
  const bool valid = row < total && i < seq.seqlen_q;  // no early return: the whole warp takes part in the shuffles
  float* acc =
      p.dq_accum_ptr == nullptr || row >= total
          ? nullptr
          : static_cast<float*>(p.dq_accum_ptr) + dq_accum_offset(p, seq, b, h) + int64_t(i) * p.dq_accum_row_stride;
  float sum = 0.f;
  int64_t dsum_index = 0;
  if (valid) {
    const T* o = static_cast<const T*>(p.o_ptr) + seq.q_offset(p.o_batch_stride, p.o_row_stride, b) +
                 int64_t(i) * p.o_row_stride + h * p.o_head_stride;
    const T* dout = static_cast<const T*>(p.do_ptr) + seq.q_offset(p.do_batch_stride, p.do_row_stride, b) +
                    int64_t(i) * p.do_row_stride + h * p.do_head_stride;
    dsum_index = seq.rowvec_offset(p, b, h) + i;
    for (int c = sub * 8; c < p.head_dim; c += kLanesPerRow * 8) {
      const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
      const uint4 dv = *reinterpret_cast<const uint4*>(dout + c);
      const T* oe = reinterpret_cast<const T*>(&ov);
      const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
      for (int e = 0; e < 8; ++e) sum += to_float(oe[e]) * to_float(de[e]);
    }
  }
  if (acc != nullptr && (kWholeBlocks ? !seq.varlen || i < ceil_div(seq.seqlen_q, 64) * 64 : valid)) {
    const int64_t cols = kWholeBlocks ? p.dq_accum_row_stride : p.head_dim;
    for (int64_t c = sub * 8; c < cols; c += kLanesPerRow * 8) {
      reinterpret_cast<float4*>(acc + c)[0] = make_float4(0.f, 0.f, 0.f, 0.f);
      reinterpret_cast<float4*>(acc + c)[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
#pragma unroll
  for (int off = kLanesPerRow / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffff, sum, off);
  if (valid && sub == 0) static_cast<float*>(p.dsum_ptr)[dsum_index] = sum;
}

// One 8-column chunk of convert_dq_kernel; true when it holds a non-finite value.
template <typename T>
__device__ __forceinline__ bool convert_dq_chunk(const AttnBwdParams& p, const SeqInfo& seq, int b, int h, int i,
                                                 int c) {
  const float* acc = static_cast<const float*>(p.dq_accum_ptr) + dq_accum_offset(p, seq, b, h) +
                     int64_t(i) * p.dq_accum_row_stride + c;
  const float4 a = reinterpret_cast<const float4*>(acc)[0];
  const float4 bb = reinterpret_cast<const float4*>(acc)[1];
  const float s = p.softmax_scale;
  uint4 out;
  out.x = pack2<T>(a.x * s, a.y * s);
  out.y = pack2<T>(a.z * s, a.w * s);
  out.z = pack2<T>(bb.x * s, bb.y * s);
  out.w = pack2<T>(bb.z * s, bb.w * s);
  T* dq = static_cast<T*>(p.dq_ptr) + seq.q_offset(p.dq_batch_stride, p.dq_row_stride, b) +
          int64_t(i) * p.dq_row_stride + h * p.dq_head_stride + c;
  *reinterpret_cast<uint4*>(dq) = out;
  using nonfinite::is_bad;
  return is_bad(a.x) || is_bad(a.y) || is_bad(a.z) || is_bad(a.w) || is_bad(bb.x) || is_bad(bb.y) || is_bad(bb.z) ||
         is_bad(bb.w);
}

// The slow path of convert_dq_kernel (nonfinite_fixup.cuh), whole warp: each
// row with a non-finite chunk in this warp is recomputed once and this warp's
// chunks of it rewritten (after their normal stores, same warp).
template <typename T>
__device__ __forceinline__ void fix_dq_chunks(const AttnBwdParams& p, bool valid, bool bad, int64_t row, int chunk,
                                              int lane) {
  unsigned pending = __ballot_sync(0xffffffffu, bad);
  while (pending != 0) {
    const int leader = __ffs(pending) - 1;
    const int64_t r = __shfl_sync(0xffffffffu, row, leader);
    const unsigned same = __ballot_sync(0xffffffffu, valid && row == r);  // consecutive lanes, consecutive chunks
    pending &= ~same;
    const int first = __ffs(same) - 1, last = 31 - __clz(same);
    const int c_lo = __shfl_sync(0xffffffffu, chunk, first) * 8, c_hi = c_lo + (last - first + 1) * 8;
    const int i = static_cast<int>(r % p.seqlen_q);
    const int h = static_cast<int>((r / p.seqlen_q) % p.heads_q);
    const int b = static_cast<int>(r / (int64_t(p.seqlen_q) * p.heads_q));
    const SeqInfo seq(p, b);
    T* dq = static_cast<T*>(p.dq_ptr) + seq.q_offset(p.dq_batch_stride, p.dq_row_stride, b) +
            int64_t(i) * p.dq_row_stride + h * p.dq_head_stride;
    // (One conversion kernel serves both instances: the score mod is a runtime property here.)
    if (p.score_mod.any() || p.dropout.enabled()) {
      nonfinite::fix_dq_row_global<8, T>(nonfinite::fixup_args(p, seq, b), h, i, dq, c_lo, c_hi, lane,
                                         nonfinite::ModScore(p, b));
    } else {
      nonfinite::fix_dq_row_global<8, T>(nonfinite::fixup_args(p, seq, b), h, i, dq, c_lo, c_hi, lane);
    }
  }
}

// dq[b, i, h, :] = scale * dq_accum[b, h, i, :], in the input dtype (i < seqlen_q:
// max_seqlen_q in a varlen batch, where threads past a sequence's end idle).
// (At most 64 registers: the slow path's call would otherwise set the register
// count, and the occupancy, of this memory-bound kernel; it may spill instead.)
template <typename T>
__global__ void __launch_bounds__(256, 4) convert_dq_kernel(const AttnBwdParams p) {
  const int chunks_per_row = p.head_dim / 8;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // over (b, h, i, chunk)
  const int64_t total = int64_t(p.batch) * p.heads_q * p.seqlen_q * chunks_per_row;
  const int chunk = static_cast<int>(idx % chunks_per_row);
  const int64_t row = idx / chunks_per_row;
  const int i = static_cast<int>(row % p.seqlen_q);
  const int h = static_cast<int>((row / p.seqlen_q) % p.heads_q);
  const int b = static_cast<int>(row / (int64_t(p.seqlen_q) * p.heads_q));
  const SeqInfo seq(p, idx < total ? b : 0);  // (cu_seqlens has batch + 1 entries)
  // No early return: the whole warp takes part in the non-finite vote below.
  const bool valid = idx < total && i < seq.seqlen_q;
  bool bad = false;
  if (valid) bad = convert_dq_chunk<T>(p, seq, b, h, i, chunk * 8);
  // The non-finite rule (nonfinite_fixup.cuh): the rows of the chunks with a NaN / inf, exactly.
  if (__any_sync(0xffffffffu, bad)) fix_dq_chunks<T>(p, valid, bad, valid ? row : -1, chunk, threadIdx.x & 31);
}

// Reads a[0, n) of a per-row float vector into shared memory, 4 bytes per
// cp.async; entries past n are zero-filled.
template <int kN, int kNThreads>
__device__ __forceinline__ void copy_rowvec_async(float* smem, const float* gmem, int n, int tid) {
  for (int i = tid; i < kN; i += kNThreads) {
    const bool pred = i < n;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(smem + i)),
                 "l"(pred ? gmem + i : gmem), "r"(pred ? 4 : 0));
  }
}

}  // namespace flashattn
