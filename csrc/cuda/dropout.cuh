// Dropout on the accumulator tiles of the CUDA kernels: the keep mask of
// ../philox.h (its layout, bit for bit the CPU's and the oracle's) applied to a
// warp's fragment of P (forward), or of P and dP (backward).
//
// The fragments are those of mma.sync m16n8 and wgmma m64nN (the same
// per-warp layout): thread (g = lane / 4, t = lane % 4) holds, of every
// 16-row m-tile, rows g and g + 8, and of every 8-column n-tile columns 2 t
// and 2 t + 1. Two orientations, as for the mask (mask.cuh):
//   rows: rows are queries, columns keys (the forward's S, the dQ kernel's);
//         one Philox call (query i, key group u = 4 (j / 32) + t) gives the 8
//         decisions of a thread's row over 32 keys: every one used.
//   cols: rows are keys, columns queries (the backward's S^T); a call gives 8
//         keys of one query, of which a thread holds 2 per 16-key m-tile (keys
//         g and g + 8 of it): 4 of the 8 when it holds both m-tiles of the 32,
//         2 when it holds one (the Hopper backward's warps).
// Dropped entries become 0 and kept ones are multiplied by `scale` (1 / (1 - p)
// where the caller does not fold the scale in elsewhere; 1 costs a multiply).
//
// Indices are the sequence's own (b the sequence, i and j from its first query
// and key: philox.h), the key offsets of the fragments multiples of 32.
#pragma once

#include "../philox.h"
#include "tile.cuh"

namespace flashattn {

// The generator of one (batch, head) plane: the seed as Philox's key and the
// plane as the counter's high half, read once per tile.
struct DropoutPlane {
  uint32_t k0, k1, c2, c3;
  uint32_t threshold;

  // The seed and offset come from the device (rng_state, written by the
  // graph-safe unpack of torch's generator state) when the call has them
  // there, else from the params (host-side state: tests, the CPU path).
  __device__ __forceinline__ DropoutPlane(const DropoutParams& d, int b, int heads_q, int h) {
    uint64_t seed = d.seed, offset = d.offset;
    if (d.rng_state != nullptr) {
      seed = static_cast<uint64_t>(__ldg(d.rng_state));
      offset = static_cast<uint64_t>(__ldg(d.rng_state + 1));
    }
    const uint64_t plane = dropout_plane(offset, b, heads_q, h);
    k0 = static_cast<uint32_t>(seed);
    k1 = static_cast<uint32_t>(seed >> 32);
    c2 = static_cast<uint32_t>(plane);
    c3 = static_cast<uint32_t>(plane >> 32);
    threshold = d.keep_threshold;
  }

  // The four Philox words of query i, key group u (philox.h's layout).
  __device__ __forceinline__ Philox4 words(uint32_t i, uint32_t u) const { return philox4x32_10(u, i, c2, c3, k0, k1); }

  // Whether element (i, j) is kept: one decision (the non-finite slow paths).
  __device__ __forceinline__ bool keep(int i, int j) const {
    const Philox4 r = words(static_cast<uint32_t>(i), dropout_key_group(j));
    return keeps(r.x[(j >> 3) & 3], j & 1);
  }

  // Whether 16-bit slice `hi` (0: low, 1: high) of word w keeps its element.
  __device__ __forceinline__ bool keeps(uint32_t w, int hi) const {
    return (hi ? (w >> 16) : (w & 0xffffu)) < threshold;
  }
};

// Rows are queries r0 + mi*16 + g (+8), columns keys c0 + ni*8 + 2t (+1);
// c0 % 32 == 0 and kNT % 4 == 0 (whole key groups).
template <int kMT, int kNT>
__device__ __forceinline__ void apply_dropout_rows(float (&s)[kMT][kNT][4], const DropoutPlane& d, int r0, int c0,
                                                   int lane, float scale) {
  static_assert(kNT % 4 == 0, "dropout: a row's fragment must cover whole 32-key groups");
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t row = static_cast<uint32_t>(r0 + mi * 16 + g + 8 * h);
#pragma unroll
      for (int grp = 0; grp < kNT / 4; ++grp) {
        const uint32_t u = static_cast<uint32_t>(((c0 >> 5) + grp) * 4 + t);
        const Philox4 r = d.words(row, u);
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[mi][grp * 4 + n][2 * h + e];
            x = d.keeps(r.x[n], e) ? x * scale : 0.f;
          }
      }
    }
}

// Rows are keys key0 + mi*16 + g (+8), columns queries q0 + ni*8 + 2t (+1);
// key0 % 32 == 0, or key0 % 16 == 0 with one m-tile (a 16-row m-tile is one
// half of a key group's 32 keys: the Hopper backward's odd warps hold the
// upper half).
template <int kMT, int kNT>
__device__ __forceinline__ void apply_dropout_cols(float (&s)[kMT][kNT][4], const DropoutPlane& d, int key0, int q0,
                                                   int lane, float scale) {
  static_assert(kMT >= 1, "dropout: an empty fragment");
  const int g = lane >> 2, t = lane & 3;
  // Key key0 + mi*16 + g + 8h: group 4 ((key0 + mi*16) / 32) + g / 2, word
  // 2 ((mi*16 / 16) % 2) + h, slice g % 2. A pair of m-tiles (mi, mi + 1)
  // of one group shares each call.
  constexpr int kPairs = (kMT + 1) / 2;
#pragma unroll
  for (int pi = 0; pi < kPairs; ++pi)
#pragma unroll
    for (int ni = 0; ni < kNT; ++ni)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int mi0 = 2 * pi;
        const uint32_t query = static_cast<uint32_t>(q0 + ni * 8 + 2 * t + e);
        const int key_base = key0 + mi0 * 16;  // the first key of this call's m-tiles
        const uint32_t u = static_cast<uint32_t>((key_base >> 5) * 4 + (g >> 1));
        const Philox4 r = d.words(query, u);
        // key_base % 32 is 0 or 16: m-tile mi0 holds words 0, 1 (or 2, 3).
        const int w0 = (key_base & 16) ? 2 : 0;
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          const int mi = mi0 + m;
          if (mi >= kMT) break;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float& x = s[mi][ni][2 * h + e];
            x = d.keeps(r.x[(w0 + 2 * m + h) & 3], g & 1) ? x * scale : 0.f;
          }
        }
      }
}

// The keep decisions of a transposed fragment of one m-tile, as bits (bit
// 4 ni + 2 h + e: element [ni][2 h + e]), for the kernels that apply the mask
// to more than one tile of the same positions (the backward: P for dV, dP for
// dS). Rows are keys key0 + g (+8), key0 % 16 == 0; columns queries
// q0 + ni*8 + 2t (+1). The two lanes of a key pair (g even / odd, lane ^ 4)
// need the same calls, so they share them: lane g draws query column e = g % 2
// of each n-tile, keeps its own key's halves of the two words and trades the
// other key's halves for its partner's (one shuffle an n-tile): 4 of a call's
// 8 decisions used, where each lane drawing its own would use 2. All 32 lanes
// must call it together.
template <int kNT>
struct KeepBits {
  static constexpr int kWords = (kNT * 4 + 31) / 32;
  uint32_t w[kWords];
  __device__ __forceinline__ bool kept(int ni, int k) const {
    return (w[(4 * ni + k) / 32] >> ((4 * ni + k) % 32)) & 1u;
  }
};

template <int kNT>
__device__ __forceinline__ KeepBits<kNT> dropout_keep_bits_cols(const DropoutPlane& d, int key0, int q0, int lane) {
  const int g = lane >> 2, t = lane & 3, odd = g & 1;
  const uint32_t u = static_cast<uint32_t>((key0 >> 5) * 4 + (g >> 1));
  const int word0 = (key0 & 16) ? 2 : 0;  // keys g and g + 8: words word0, word0 + 1
  // This lane's halves (low for an even key, high for an odd one) and the
  // partner's, each pair packed low / high = key g / key g + 8.
  const uint32_t own_sel = odd ? 0x7632u : 0x5410u, other_sel = odd ? 0x5410u : 0x7632u;
  KeepBits<kNT> bits;
#pragma unroll
  for (int i = 0; i < KeepBits<kNT>::kWords; ++i) bits.w[i] = 0u;
#pragma unroll
  for (int ni = 0; ni < kNT; ++ni) {
    const Philox4 r = d.words(static_cast<uint32_t>(q0 + ni * 8 + 2 * t + odd), u);
    const uint32_t w0 = r.x[word0], w1 = r.x[word0 + 1];
    const uint32_t mine = __byte_perm(w0, w1, own_sel);
    const uint32_t theirs = __shfl_xor_sync(0xffffffffu, __byte_perm(w0, w1, other_sel), 4);
    // mine: column e = odd of keys g, g + 8; theirs: column e = 1 - odd.
    const uint32_t k_own0 = (mine & 0xffffu) < d.threshold, k_own1 = (mine >> 16) < d.threshold;
    const uint32_t k_oth0 = (theirs & 0xffffu) < d.threshold, k_oth1 = (theirs >> 16) < d.threshold;
    const uint32_t e0 = odd ? k_oth0 | (k_oth1 << 2) : k_own0 | (k_own1 << 2);  // bits 2h + 0
    const uint32_t e1 = odd ? k_own0 | (k_own1 << 2) : k_oth0 | (k_oth1 << 2);  // bits 2h + 1
    bits.w[(4 * ni) / 32] |= (e0 | (e1 << 1)) << ((4 * ni) % 32);
  }
  return bits;
}

// acc_to_a (tile.cuh) of n-tiles 2 kk, 2 kk + 1 with the dropped entries 0
// (the backward's dV operand: Z * P, the 1 / (1 - p) applied to dV at the end).
template <typename T, int kNT>
__device__ __forceinline__ void acc_to_a_kept(uint32_t (&a)[4], const float (&c)[kNT][4], int kk,
                                              const KeepBits<kNT>& bits) {
  float kept[2][4];
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int k = 0; k < 4; ++k) kept[n][k] = bits.kept(2 * kk + n, k) ? c[2 * kk + n][k] : 0.f;
  acc_to_a<T>(a, kept, 0);
}

// Kept entries of `s` times scale, dropped ones 0 (bits of dropout_keep_bits_cols).
template <int kNT>
__device__ __forceinline__ void apply_keep_bits(float (&s)[kNT][4], const KeepBits<kNT>& bits, float scale) {
#pragma unroll
  for (int ni = 0; ni < kNT; ++ni)
#pragma unroll
    for (int k = 0; k < 4; ++k) s[ni][k] = bits.kept(ni, k) ? s[ni][k] * scale : 0.f;
}

}  // namespace flashattn
