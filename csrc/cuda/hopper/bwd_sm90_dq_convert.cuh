// The epilogue of the warp-specialized Hopper backward's dQ: the fp32
// accumulator, in DqFragLayout order (bwd_sm90_dq_writer.cuh), scaled and
// converted into dq by a kernel of its own once every key block has added,
// with the non-finite rule's slow path (../nonfinite_fixup.cuh).
#pragma once

#include "../../flash_params.h"
#include "../bwd_common.cuh"
#include "../nonfinite_fixup.cuh"
#include "bwd_sm90_dq_writer.cuh"

namespace flashattn {

// The fp32 accumulator's 8 floats that hold columns [8 di, 8 di + 8) of row r of
// 64 x 64 block `block`: pairs of the accumulator threads (w, g, t = 0..3).
__device__ __forceinline__ const float4* dq_frag_chunk(const float* acc, int block, int r, int di) {
  const int w = r / 16, hh = (r / 8) % 2, g = r % 8;
  return reinterpret_cast<const float4*>(acc + DqFragLayout::offset(block, di, hh, w * 32 + g * 4));
}

__device__ __forceinline__ bool any_bad8(float4 x, float4 y) {
  using nonfinite::is_bad;
  return is_bad(x.x) || is_bad(x.y) || is_bad(x.z) || is_bad(x.w) || is_bad(y.x) || is_bad(y.y) || is_bad(y.z) ||
         is_bad(y.w);
}

// The slow path of convert_dq_frag_kernel (../nonfinite_fixup.cuh), whole
// warp, after its normal stores: the rows of this warp's chunks that hold a
// NaN / inf, recomputed exactly over the block's 64 columns.
template <typename Kt, bool kVarlen>
__device__ FLASHATTN_NONFINITE_SLOW void fix_dq_frag_rows(AttnBwdParams p, const float* acc, int block, int row_base,
                                                          int c_lo, int b, int h, int thr) {
  using T = typename Kt::Element;
  const int lane = thr % 32;
  const SeqInfo seq(p, b, kVarlen);
  for (int u = 0; u < 64 * 8 / 128; ++u) {
    const int r = (thr + 128 * u) / 8, di = (thr + 128 * u) % 8;
    bool bad = false;
    if (row_base + r < seq.seqlen_q && c_lo + di * 8 < p.head_dim) {
      const float4* src = dq_frag_chunk(acc, block, r, di);
      bad = any_bad8(src[0], src[1]);
    }
    for (int q = 0; q < 4; ++q) {  // the warp's 4 rows of this unit: lanes 8q .. 8q + 7
      const int row = row_base + ((thr - lane) + 128 * u) / 8 + q;
      if (!__any_sync(0xffffffffu, bad && lane / 8 == q) || row >= seq.seqlen_q) continue;
      T* dq = static_cast<T*>(p.dq_ptr) + seq.q_offset(p.dq_batch_stride, p.dq_row_stride, b) + h * p.dq_head_stride +
              int64_t(row) * p.dq_row_stride;
      // (One conversion kernel serves both instances: the score mod is a runtime property here.)
      if (p.score_mod.any() || p.dropout.enabled()) {
        nonfinite::fix_dq_row_global<(Kt::kHeadDim + 31) / 32, T>(nonfinite::fixup_args(p, seq, b), h, row, dq, c_lo,
                                                                  c_lo + 64, lane, nonfinite::ModScore(p, b));
      } else {
        nonfinite::fix_dq_row_global<(Kt::kHeadDim + 31) / 32, T>(nonfinite::fixup_args(p, seq, b), h, row, dq, c_lo,
                                                                  c_lo + 64, lane);
      }
    }
  }
}

// dq[b, i, h, :] = scale * the accumulator, read in DqFragLayout order: one
// CTA of 128 threads per 64 x 64 block of a (query block, head, batch). A
// thread converts 8 consecutive columns of a row at a time: in DqFragLayout
// they are 8 consecutive floats (4 threads' pairs), so it reads 32 bytes and
// writes 16, and 8 neighbouring threads write a row's 128 contiguous bytes.
// (At most 64 registers: see convert_dq_kernel.)
//
// Varlen (kVarlen): the grid covers ceil(max_seqlen_q / kBlockM) query blocks
// a (sequence, head); a CTA whose query block starts past its sequence's
// seqlen_q returns (the whole CTA: no vote is left half-taken). The tile of
// query block mb is at row mb * kBlockM of the sequence's accumulator rows
// (dq_accum_offset: q_start + b * kBwdBlockM), as the kernel added it; rows
// past seqlen_q are padding and are not read.
template <typename Kt, bool kVarlen>
__global__ void __launch_bounds__(128, 8) convert_dq_frag_kernel(const AttnBwdParams p) {
  using T = typename Kt::Element;
  const int m_blocks = ceil_div(p.seqlen_q, Kt::kBlockM);
  unsigned idx = blockIdx.x;  // (32-bit divisions: the grid is below 2^31 blocks)
  const int block = static_cast<int>(idx % Kt::kDqBlocks);
  idx /= Kt::kDqBlocks;
  const int mb = static_cast<int>(idx % unsigned(m_blocks));
  idx /= unsigned(m_blocks);
  const int h = static_cast<int>(idx % unsigned(p.heads_q));
  const int b = static_cast<int>(idx / unsigned(p.heads_q));
  const int thr = threadIdx.x;
  const SeqInfo seq(p, b, kVarlen);
  if (kVarlen && mb * Kt::kBlockM >= seq.seqlen_q) return;
  const float* acc =
      static_cast<const float*>(p.dq_accum_ptr) +
      (kVarlen ? dq_accum_offset(p, seq, b, h) : b * p.dq_accum_batch_stride + h * p.dq_accum_head_stride) +
      int64_t(mb) * Kt::kBlockM * p.dq_accum_row_stride;
  const int c_lo = (block % Kt::kDqColBlocks) * 64;
  const int row_base = mb * Kt::kBlockM + (block / Kt::kDqColBlocks) * 64;
  T* dq_base = static_cast<T*>(p.dq_ptr) + seq.q_offset(p.dq_batch_stride, p.dq_row_stride, b) + h * p.dq_head_stride;
  const float s = p.softmax_scale;
  bool bad = false;
#pragma unroll
  for (int u = 0; u < 64 * 8 / 128; ++u) {
    const int r = (thr + 128 * u) / 8, di = (thr + 128 * u) % 8;  // row of the block, 8-column chunk
    const int row = row_base + r, col = c_lo + di * 8;
    if (row >= seq.seqlen_q || col >= p.head_dim) continue;
    const float4* src = dq_frag_chunk(acc, block, r, di);
    const float4 x = src[0], y = src[1];
    uint4 out;
    out.x = pack2<T>(x.x * s, x.y * s);
    out.y = pack2<T>(x.z * s, x.w * s);
    out.z = pack2<T>(y.x * s, y.y * s);
    out.w = pack2<T>(y.z * s, y.w * s);
    *reinterpret_cast<uint4*>(dq_base + int64_t(row) * p.dq_row_stride + col) = out;
    bad |= any_bad8(x, y);
  }
  // The non-finite rule: rows with a NaN / inf, exactly (each row's chunks are this warp's).
  if (__any_sync(0xffffffffu, bad)) fix_dq_frag_rows<Kt, kVarlen>(p, acc, block, row_base, c_lo, b, h, thr);
}

}  // namespace flashattn
