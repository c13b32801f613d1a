// flash-attn's score modifications (ScoreMod in ../flash_params.h: softcap and
// ALiBi) on the accumulator tiles of the CUDA kernels: the one place that
// says how a raw score q.k becomes the modified score the softmax sees.
//
// The kernels compile a second instance for calls with a score mod (the
// template flag kScoreMod); the plain instances hold none of this code. In
// that instance the scores leave apply_* in scaled log2 units,
//   x = log2(e) * (softcap * tanh(scale * s / softcap) - slope * |i + off - j|)
// (without softcap: scale * s, without ALiBi: no bias), so the softmax runs
// its positive-scale path with scale_log2 = 1 (whatever the sign of the
// softmax scale: the scale is already applied) and the lse it returns is that
// of the modified scores. The backward recomputes x the same way; softcap's
// derivative 1 - t^2 (t the tanh; d score / d (scale * s)) multiplies dS. The
// backward kernels get t back from P at the dS step,
//   t = (log2(P) + lse_log2 + slope_log2 |i + off - j|) / cap_log2,
// rather than keep 1 - t^2 in registers from S to dS: that array was live
// across the wait for dP and spilled (Hopper d128: 192 bytes); the MUFU.LG2
// it costs instead is not what bounds a backward step.
//
// Which of softcap / ALiBi a call has is a runtime property of the instance,
// uniform over the grid: each tile takes one of three loop bodies (branch
// outside the element loops), so an element pays only for what its call has.
#pragma once

#include "../flash_params.h"
#include "ptx.cuh"

namespace flashattn {

__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The constants of one (batch, head, sequence): what apply_* needs per element.
struct ScoreModTile {
  float in_scale;    // multiplies s: scale / softcap (softcap), scale * log2(e) (none)
  float cap_log2;    // softcap * log2(e)
  float slope_log2;  // slope(b, h) * log2(e); 0 without ALiBi
  int alibi_offset;  // seqlen_k - seqlen_q of the sequence (flash-attn's bottom-right ALiBi)
  bool softcap, alibi;

  __host__ __device__ __forceinline__ ScoreModTile(const ScoreMod& m, float softmax_scale, int b, int h, int seqlen_q,
                                                   int seqlen_k)
      : in_scale(m.has_softcap() ? softmax_scale / static_cast<float>(m.softcap) : softmax_scale * kLog2e),
        cap_log2(static_cast<float>(m.softcap) * kLog2e),
        slope_log2(m.has_alibi() ? m.slope(b, h) * kLog2e : 0.f),
        alibi_offset(seqlen_k - seqlen_q),
        softcap(m.has_softcap()),
        alibi(m.has_alibi()) {}

  // One element (the slow paths: non-finite recompute, decode): raw score s
  // of query row i, key j -> x (log2 units). *dtanh: 1 - t^2 (1 without softcap).
  __device__ __forceinline__ float apply(float s, int i, int j, float* dtanh = nullptr) const {
    float x = s * in_scale;
    float d = 1.f;
    if (softcap) {
      const float t = tanh_approx(x);
      x = cap_log2 * t;
      d = 1.f - t * t;
    }
    if (alibi) x -= slope_log2 * fabsf(float(i + alibi_offset - j));
    if (dtanh) *dtanh = d;
    return x;
  }
};

namespace score_mod_detail {

// Element (mi, ni, 2h + e) of a warp's accumulator tile is row
// row0 + mi*16 + g + 8h, column col0 + ni*8 + 2t + e (mma.sync / wgmma
// layout); kTransposed: rows are keys and columns queries (the backward's S^T).
template <bool kSoftcap, bool kAlibi, bool kTransposed, int kMT, int kNT>
__device__ __forceinline__ void apply_tile(float (&s)[kMT][kNT][4], const ScoreModTile& m, int row0, int col0,
                                           int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + mi * 16 + g + 8 * h;
      // |query + off - key| = |base + sign * c| for the element's column offset c.
      const float base =
          kTransposed ? float(col0 + 2 * t + m.alibi_offset - r) : float(r + m.alibi_offset - col0 - 2 * t);
#pragma unroll
      for (int ni = 0; ni < kNT; ++ni)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[mi][ni][2 * h + e];
          x *= m.in_scale;
          if constexpr (kSoftcap) x = m.cap_log2 * tanh_approx(x);
          if constexpr (kAlibi) {
            const float c = float(ni * 8 + e);
            x -= m.slope_log2 * fabsf(kTransposed ? base + c : base - c);
          }
        }
    }
}

template <bool kTransposed, int kMT, int kNT>
__device__ __forceinline__ void apply_any(float (&s)[kMT][kNT][4], const ScoreModTile& m, int row0, int col0,
                                          int lane) {
  if (m.softcap) {
    if (m.alibi) {
      apply_tile<true, true, kTransposed>(s, m, row0, col0, lane);
    } else {
      apply_tile<true, false, kTransposed>(s, m, row0, col0, lane);
    }
  } else {
    apply_tile<false, true, kTransposed>(s, m, row0, col0, lane);
  }
}

}  // namespace score_mod_detail

// Raw scores -> modified scores in log2 units, rows are queries r0 + ..., columns keys c0 + ...
// Run before the mask (the mask's -inf must not go through tanh).
template <int kMT, int kNT>
__device__ __forceinline__ void apply_score_mod_rows(float (&s)[kMT][kNT][4], const ScoreModTile& m, int r0, int c0,
                                                     int lane) {
  score_mod_detail::apply_any<false>(s, m, r0, c0, lane);
}

// The same for a transposed tile (the backward's S^T: rows are keys key0 + ..., columns queries q0 + ...).
template <int kMT, int kNT>
__device__ __forceinline__ void apply_score_mod_cols(float (&s)[kMT][kNT][4], const ScoreModTile& m, int key0, int q0,
                                                     int lane) {
  score_mod_detail::apply_any<true>(s, m, key0, q0, lane);
}

// dS *= 1 - t^2 where the call has a softcap (dS of the modified score -> dS
// of scale * s), t recovered from P (see the top): p the tile's P (0 where
// masked or underflowed: dS is 0 there, and so is the factor), lse_log2(mi,
// h, ni, e) the element's lse in log2 units. Rows / columns as apply_*; kTransposed: rows are keys.
template <bool kTransposed, int kMT, int kNT, typename LseLog2>
__device__ __forceinline__ void apply_softcap_grad(float (&ds)[kMT][kNT][4], const float (&p)[kMT][kNT][4],
                                                   const ScoreModTile& m, int row0, int col0, int lane,
                                                   LseLog2&& lse_log2) {
  if (!m.softcap) return;
  const int g = lane >> 2, t = lane & 3;
  const float inv_cap = 1.f / m.cap_log2;
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + mi * 16 + g + 8 * h;
      const float base =
          kTransposed ? float(col0 + 2 * t + m.alibi_offset - r) : float(r + m.alibi_offset - col0 - 2 * t);
#pragma unroll
      for (int ni = 0; ni < kNT; ++ni)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pv = p[mi][ni][2 * h + e];
          const float c = float(ni * 8 + e);
          const float bias = m.slope_log2 * fabsf(kTransposed ? base + c : base - c);  // 0 without ALiBi
          const float th = (fast_log2(pv) + lse_log2(mi, h, ni, e) + bias) * inv_cap;
          ds[mi][ni][2 * h + e] *= pv > 0.f ? 1.f - th * th : 0.f;
        }
    }
}

}  // namespace flashattn
