// The CPU kernels' dropout tiles (dropout.h), compiled per SIMD target.
#include "dropout.h"

#include "simd_clones.h"

namespace flashattn {
namespace cpu {

namespace {

constexpr int kChunk = 64;  // queries whose Philox calls run together (the loops the compiler vectorizes)

// philox.h's philox4x32_10 of the counters (u, i0 + c, plane lo, plane hi),
// c < kChunk, as a structure of arrays: each round is one loop over c of
// 32 x 32 -> 64-bit products and xors, which the compiler turns into vector
// instructions (the call-per-query form of philox.h vectorized only ~1.5x).
// Bit for bit the same words (the tests compare the mask with the oracle's).
FLASHATTN_INLINE void philox_chunk(uint32_t u, uint32_t i0, uint64_t plane, uint64_t seed, uint32_t (&x0)[kChunk],
                                   uint32_t (&x1)[kChunk], uint32_t (&x2)[kChunk], uint32_t (&x3)[kChunk]) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int c = 0; c < kChunk; ++c) {
    x0[c] = u;
    x1[c] = i0 + static_cast<uint32_t>(c);
    x2[c] = static_cast<uint32_t>(plane);
    x3[c] = static_cast<uint32_t>(plane >> 32);
  }
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    for (int c = 0; c < kChunk; ++c) {
      const uint64_t p0 = static_cast<uint64_t>(kM0) * x0[c], p1 = static_cast<uint64_t>(kM1) * x2[c];
      const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ x1[c] ^ k0;
      const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ x3[c] ^ k1;
      x0[c] = n0, x1[c] = static_cast<uint32_t>(p1), x2[c] = n2, x3[c] = static_cast<uint32_t>(p0);
    }
    k0 += kW0, k1 += kW1;
  }
}

}  // namespace

FLASHATTN_SIMD_CLONES void dropout_keep_tile(const DropoutParams& d, uint64_t plane, int64_t k0, int keys, int64_t q0,
                                             int queries, uint8_t* keep, int64_t keep_ld) {
  uint32_t x[4][kChunk];
  const int64_t k_end = k0 + keys;
  for (int64_t g = k0 / 32; g * 32 < k_end; ++g) {
    for (uint32_t t = 0; t < 4; ++t) {
      const uint32_t u = static_cast<uint32_t>(g * 4 + t);
      for (int c0 = 0; c0 < queries; c0 += kChunk) {
        const int n = queries - c0 < kChunk ? queries - c0 : kChunk;
        philox_chunk(u, static_cast<uint32_t>(q0 + c0), plane, d.seed, x[0], x[1], x[2], x[3]);
        // Slice s = 2 w + e of the group: word w, its low (e = 0) or high 16 bits (philox.h).
        for (int s = 0; s < 8; ++s) {
          const int64_t key = dropout_group_key(u, s);
          if (key < k0 || key >= k_end) continue;
          uint8_t* row = keep + (key - k0) * keep_ld + c0;
          const uint32_t* w = x[s >> 1];
          const int shift = 16 * (s & 1);
          for (int c = 0; c < n; ++c) row[c] = static_cast<uint8_t>(((w[c] >> shift) & 0xffffu) < d.keep_threshold);
        }
      }
    }
  }
}

template <typename acc_t>
FLASHATTN_SIMD_CLONES void apply_keep_tile(const uint8_t* keep, int64_t keep_ld, int keys, int queries,
                                           acc_t kept_scale, acc_t* t, int64_t t_ld) {
  for (int r = 0; r < keys; ++r) {
    const uint8_t* k = keep + r * keep_ld;
    acc_t* row = t + r * t_ld;
    for (int c = 0; c < queries; ++c) row[c] = k[c] ? row[c] * kept_scale : acc_t(0);
  }
}

template void apply_keep_tile<float>(const uint8_t*, int64_t, int, int, float, float*, int64_t);
template void apply_keep_tile<double>(const uint8_t*, int64_t, int, int, double, double*, int64_t);

}  // namespace cpu
}  // namespace flashattn
