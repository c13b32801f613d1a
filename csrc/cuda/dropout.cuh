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
//         2 when it holds one (the Hopper backward's warps: there the lanes of
//         a key pair share each call instead, KeepBitsCols<1, kNT> of
//         dropout_keep_bits.cuh).
// Dropped entries become 0 and kept ones are multiplied by `scale` (1 / (1 - p)
// where the caller does not fold the scale in elsewhere; 1 costs a multiply).
//
// Indices are the sequence's own (b the sequence, i and j from its first query
// and key: philox.h), the key offsets of the fragments multiples of 32.
#pragma once

#include "../philox.h"

namespace flashattn {

// The generator of one (batch, head) plane: the seed as Philox's key and the
// plane as the counter's high half, read once per tile.
struct DropoutPlane {
  uint32_t k0 = 0, k1 = 0, c2 = 0, c3 = 0;
  uint32_t threshold = 0;

  DropoutPlane() = default;

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

}  // namespace flashattn
