// Dropout's keep decisions of a warp's fragment held as bits, one an element
// (bit (mi * kNT + ni) * 4 + e of the fragment's element [mi][ni][e]), drawn
// by dropout.cuh's application onto a fragment of ones, a slice at a time
// (the same Philox calls as one pass over the whole fragment).
//
// Why bits: the dK/dV kernel draws a tile's decisions before its products,
// when only the dK / dV accumulators are live, so that the Philox temporaries
// do not add to the peak of the S^T / dP^T tiles (ptxas, d128 sm_90a, the
// deterministic instance: spills with dropout 108 -> 56 bytes, against the
// draw after dP^T's product), and applies them twice, to dP^T and to P^T,
// with the undropped P^T needed in between. One register for its 32
// elements. (The forward applies dropout.cuh's rows directly after the
// softmax: drawing bits before S = Q K^T there spilled about as much.)
//
// tests/cuda_host/dropout_fragment_check.cpp checks them on the host against
// philox.h's rule.
#pragma once

#include <cstdint>

#include "dropout.cuh"

namespace flashattn {

template <int kMT, int kNT>
struct FragmentKeepBits {
  static constexpr int kBits = kMT * kNT * 4;
  uint32_t w[(kBits + 31) / 32];

  __device__ __forceinline__ FragmentKeepBits() : w{} {}
  __device__ __forceinline__ bool kept(int mi, int ni, int e) const {
    const int bit = (mi * kNT + ni) * 4 + e;
    return (w[bit / 32] >> (bit % 32)) & 1u;
  }
  // x -> x * scale where kept, else 0 (a select: a dropped NaN leaves no trace).
  __device__ __forceinline__ void apply(float (&x)[kMT][kNT][4], float scale) const {
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
      for (int ni = 0; ni < kNT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) x[mi][ni][e] = kept(mi, ni, e) ? x[mi][ni][e] * scale : 0.f;
  }

 protected:
  // Bits of the n-tiles [ni0, ni0 + kSliceNT) from z, a slice of the fragment
  // after dropout.cuh's application to ones (0 where dropped).
  template <int kSliceNT>
  __device__ __forceinline__ void set(const float (&z)[kMT][kSliceNT][4], int ni0) {
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
      for (int n = 0; n < kSliceNT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int bit = (mi * kNT + ni0 + n) * 4 + e;
          w[bit / 32] |= static_cast<uint32_t>(z[mi][n][e] != 0.f) << (bit % 32);
        }
  }
  template <int kSliceNT>
  __device__ __forceinline__ static void ones(float (&z)[kMT][kSliceNT][4]) {
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
      for (int n = 0; n < kSliceNT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) z[mi][n][e] = 1.f;
  }
};

// Rows are keys key0 + mi*16 + g (+8), columns queries q0 + ni*8 + 2t (+1)
// (apply_dropout_cols' layout and preconditions: the backward's S^T); drawn one
// 8-query n-tile at a time (each Philox call serves one query).
template <int kMT, int kNT>
struct KeepBitsCols : FragmentKeepBits<kMT, kNT> {
  KeepBitsCols() = default;
  __device__ __forceinline__ KeepBitsCols(const DropoutPlane& d, int key0, int q0, int lane) {
#pragma unroll
    for (int ni = 0; ni < kNT; ++ni) {
      float z[kMT][1][4];
      this->ones(z);
      apply_dropout_cols(z, d, key0, q0 + ni * 8, lane, 1.f);
      this->set(z, ni);
    }
  }
};

}  // namespace flashattn
