// The dK/dV kernel's dropout decisions held as bits (flash_bwd_kernel.cuh),
// apart so that tests/cuda_host/dropout_fragment_check.cpp checks them on the
// host against philox.h's rule.
#pragma once

#include <cstdint>

#include "dropout.cuh"

namespace flashattn {

// Dropout's keep decisions of a warp's S^T fragment (keys as rows, queries as
// columns: apply_dropout_cols' layout), one bit an element, drawn one 8-query
// n-tile at a time (each of apply_dropout_cols' Philox calls serves one query,
// so these are the calls of one pass over the fragment). The dK/dV kernel
// applies Z twice, to dP and to P, with the undropped P needed in between:
// 32 bits held across the dS computation instead of a float per element, and
// one Philox pass instead of two.
template <int kMT, int kQT>
struct KeepBitsCols {
  static constexpr int kBits = kMT * kQT * 4;
  uint32_t w[(kBits + 31) / 32];

  __device__ __forceinline__ KeepBitsCols() : w{} {}
  __device__ __forceinline__ KeepBitsCols(const DropoutPlane& d, int key0, int q0, int lane) {
#pragma unroll
    for (int i = 0; i < (kBits + 31) / 32; ++i) w[i] = 0u;
#pragma unroll
    for (int qi = 0; qi < kQT; ++qi) {
      float z[kMT][1][4];
#pragma unroll
      for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
        for (int e = 0; e < 4; ++e) z[mi][0][e] = 1.f;
      apply_dropout_cols(z, d, key0, q0 + qi * 8, lane, 1.f);
#pragma unroll
      for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int bit = (mi * kQT + qi) * 4 + e;
          w[bit / 32] |= static_cast<uint32_t>(z[mi][0][e] != 0.f) << (bit % 32);
        }
    }
  }
  __device__ __forceinline__ bool kept(int mi, int qi, int e) const {
    const int bit = (mi * kQT + qi) * 4 + e;
    return (w[bit / 32] >> (bit % 32)) & 1u;
  }
  // x -> x * scale where kept, else 0 (a select: a dropped NaN leaves no trace).
  __device__ __forceinline__ void apply(float (&x)[kMT][kQT][4], float scale) const {
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
      for (int qi = 0; qi < kQT; ++qi)
#pragma unroll
        for (int e = 0; e < 4; ++e) x[mi][qi][e] = kept(mi, qi, e) ? x[mi][qi][e] * scale : 0.f;
  }
};

}  // namespace flashattn
