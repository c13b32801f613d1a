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

// Rows are queries r0 + g (+8), columns keys c0 + ni*8 + 2t (+1), one m-tile
// (apply_dropout_rows' layout and preconditions: the Hopper forward's S, a
// warp's 16 rows; c0 % 32 == 0, kNT % 4 == 0). The dropout-only forward
// instance draws them after issuing a block's S GEMM and before waiting for
// it, so that the Philox work fills the wait instead of lengthening the
// softmax step; each call gives a thread all 8 of its decisions, as there.
template <int kNT>
struct KeepBitsRows : FragmentKeepBits<1, kNT> {
  static_assert(kNT % 4 == 0, "dropout: a row's fragment must cover whole 32-key groups");
  KeepBitsRows() = default;
  __device__ __forceinline__ KeepBitsRows(const DropoutPlane& d, int r0, int c0, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t row = static_cast<uint32_t>(r0 + g + 8 * h);
#pragma unroll
      for (int grp = 0; grp < kNT / 4; ++grp) {
        const Philox4 r = d.words(row, static_cast<uint32_t>(((c0 >> 5) + grp) * 4 + t));
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int bit = ((grp * 4 + n) * 4) + 2 * h + e;  // element [0][grp * 4 + n][2 h + e]
            this->w[bit / 32] |= static_cast<uint32_t>(d.keeps(r.x[n], e)) << (bit % 32);
          }
      }
    }
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

// One m-tile (kMT = 1: keys key0 + g (+8), key0 % 16 == 0; the Hopper
// backward's warps): the two lanes of a key pair (g even / odd, lane ^ 4) need
// the same Philox calls (query, u = 4 (key0 / 32) + g / 2), of which each
// uses its own key's 16-bit halves of two words. So they share them: lane g
// draws query column e = g % 2 of each n-tile, keeps its own halves and trades
// the other key's for its partner's (one shuffle an n-tile): one call an
// n-tile where drawing alone takes two (4 of a call's 8 decisions used, not 2).
// The draw and the bits are apart (cols_pair_draw, cols_pair_bits) so that the
// host check can stand in for the shuffle.
struct ColsPairDraw {
  uint32_t mine, theirs_part;  // halves (key g in the low 16 bits, key g + 8 in the high): this lane's, the partner's
};
__device__ __forceinline__ ColsPairDraw cols_pair_draw(const DropoutPlane& d, int key0, int q0, int ni, int lane) {
  const int g = lane >> 2, t = lane & 3, odd = g & 1;
  const uint32_t u = static_cast<uint32_t>((key0 >> 5) * 4 + (g >> 1));
  const int word0 = (key0 & 16) ? 2 : 0;  // keys g and g + 8: words word0, word0 + 1
  const Philox4 r = d.words(static_cast<uint32_t>(q0 + ni * 8 + 2 * t + odd), u);
  const uint32_t w0 = r.x[word0], w1 = r.x[word0 + 1];
  const uint32_t lo = (w0 & 0xffffu) | (w1 << 16), hi = (w0 >> 16) | (w1 & 0xffff0000u);
  return {odd ? hi : lo, odd ? lo : hi};
}
// Bits 2 h + e of n-tile ni from this lane's halves (column e = g % 2) and the
// partner's (column 1 - g % 2).
__device__ __forceinline__ uint32_t cols_pair_bits(uint32_t mine, uint32_t theirs, int lane, uint32_t threshold) {
  const int odd = (lane >> 2) & 1;
  const uint32_t own = ((mine & 0xffffu) < threshold) | (uint32_t((mine >> 16) < threshold) << 2);
  const uint32_t other = ((theirs & 0xffffu) < threshold) | (uint32_t((theirs >> 16) < threshold) << 2);
  return odd ? other | (own << 1) : own | (other << 1);
}

#if defined(__CUDACC__)
template <int kNT>
struct KeepBitsCols<1, kNT> : FragmentKeepBits<1, kNT> {
  KeepBitsCols() = default;
  // All 32 lanes together (the shuffle).
  __device__ __forceinline__ KeepBitsCols(const DropoutPlane& d, int key0, int q0, int lane) {
#pragma unroll
    for (int ni = 0; ni < kNT; ++ni) {
      const ColsPairDraw r = cols_pair_draw(d, key0, q0, ni, lane);
      const uint32_t theirs = __shfl_xor_sync(0xffffffffu, r.theirs_part, 4);
      this->w[(4 * ni) / 32] |= cols_pair_bits(r.mine, theirs, lane, d.threshold) << ((4 * ni) % 32);
    }
  }
};
#endif

}  // namespace flashattn
