// Online softmax over a warp's accumulator rows (seed section 2.7).
//
// Each lane holds 2 rows per 16-row m-tile (g and g+8) and, of each row, the
// columns 2t, 2t+1 of every 8-column n-tile; the other three lanes of its quad
// hold the rest of the row, so a row max is a quad reduction. The running sum
// stays lane-partial until finalize (a sum is a sum, whichever lane adds).
//
// With a positive scale the running max is kept in raw score units and the
// scale is folded into one FFMA per element: p = exp2(s * scale_log2 - m * scale_log2).
// Any other scale (negative or zero, legal in torch's SDPA) takes a slower
// path that scales first.
#pragma once

#include "ptx.cuh"

namespace flashattn {

template <int kMT>
struct OnlineSoftmax {
  float row_max[kMT][2];  // raw units (positive scale) or scaled log2 units
  float row_sum[kMT][2];  // lane-partial sum of exp

  __device__ __forceinline__ OnlineSoftmax() {
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) row_max[mi][h] = -INFINITY, row_sum[mi][h] = 0.f;
  }

  // s: scores of one key block (masked entries -inf), overwritten with P.
  // correction: the factor the output rows must be multiplied by for the new
  // row max (see rescale); kept apart so a kernel can compute P while the
  // previous block's P V is still running into O.
  // kPolyEvery > 0: the exponentials of every kPolyEvery-th n-tile (the same
  // columns in every lane, so no divergence) run on the FMA pipe (poly_exp2),
  // the rest on MUFU; 0: all on MUFU.
  template <bool kPositiveScale, int kPolyEvery = 0, int kNT>
  __device__ __forceinline__ void softmax_rows(float (&s)[kMT][kNT][4], float scale_log2, float (&correction)[kMT][2]) {
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (!kPositiveScale) {
#pragma unroll
          for (int ni = 0; ni < kNT; ++ni)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& x = s[mi][ni][2 * h + e];
              x = (x == -INFINITY) ? -INFINITY : x * scale_log2;
            }
        }
        float mx = row_max[mi][h];
#pragma unroll
        for (int ni = 0; ni < kNT; ++ni) mx = fmaxf(mx, fmaxf(s[mi][ni][2 * h], s[mi][ni][2 * h + 1]));
        mx = quad_max(mx);
        const float sc = kPositiveScale ? scale_log2 : 1.f;
        // A row that has seen only masked keys keeps max -inf; use 0 as its
        // shift so exp2(-inf - shift) is 0 rather than NaN.
        const float shift = (mx == -INFINITY) ? 0.f : mx * sc;
        correction[mi][h] = fast_exp2(row_max[mi][h] * sc - shift);
        row_max[mi][h] = mx;
        float sum = 0.f;
#pragma unroll
        for (int ni = 0; ni < kNT; ++ni)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float x = s[mi][ni][2 * h + e] * sc - shift;
            float pv;
            if constexpr (kPolyEvery > 0) {
              pv = ni % kPolyEvery == kPolyEvery - 1 ? poly_exp2(x) : fast_exp2(x);
            } else {
              pv = fast_exp2(x);
            }
            s[mi][ni][2 * h + e] = pv;
            sum += pv;
          }
        row_sum[mi][h] = row_sum[mi][h] * correction[mi][h] + sum;
      }
  }

  template <int kDT>
  __device__ __forceinline__ static void rescale(float (&o)[kMT][kDT][4], const float (&correction)[kMT][2]) {
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int di = 0; di < kDT; ++di)
          o[mi][di][2 * h] *= correction[mi][h], o[mi][di][2 * h + 1] *= correction[mi][h];
  }

  // Both at once: P for this block and O rescaled.
  template <bool kPositiveScale, int kNT, int kDT>
  __device__ __forceinline__ void update(float (&s)[kMT][kNT][4], float (&o)[kMT][kDT][4], float scale_log2) {
    float correction[kMT][2];
    softmax_rows<kPositiveScale>(s, scale_log2, correction);
    rescale(o, correction);
  }

  // O /= l, and lse (natural log of the scaled scores); rows that saw no key
  // get O = 0 and lse = -inf.
  template <int kDT>
  // out_scale multiplies O too (dropout's 1 / (1 - p)); lse stays the softmax's.
  __device__ __forceinline__ void finalize(float (&o)[kMT][kDT][4], float scale_log2, bool positive_scale,
                                           float (&lse)[kMT][2], float out_scale = 1.f) {
    constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float l = quad_sum(row_sum[mi][h]);
        const bool empty = l == 0.f;  // a NaN l (a NaN score the row sees) is not "no key": it propagates
        const float inv = empty ? 0.f : out_scale / l;
        const float m_log2 = positive_scale ? row_max[mi][h] * scale_log2 : row_max[mi][h];
        lse[mi][h] = empty ? -INFINITY : (m_log2 + __log2f(l)) * kLn2;
#pragma unroll
        for (int di = 0; di < kDT; ++di) o[mi][di][2 * h] *= inv, o[mi][di][2 * h + 1] *= inv;
      }
  }
};

}  // namespace flashattn
