// Dropout on the CPU kernels' key-major tiles (row = key, column = query, as
// tile_ops.h lays them out): the keep mask of csrc/philox.h for the tile's
// keys [k0, k0 + keys) and queries [q0, q0 + queries) of one (b, h) plane,
// drawn once per tile into a byte per element and applied to as many tiles as
// need it (the backward applies it to dP^T and to P^T). The decisions depend on
// the indices only, never on the tile grid or the thread, so the forward, the
// backward and any thread count see the same mask.
#pragma once

#include <cstdint>

#include "../philox.h"

namespace flashattn {
namespace cpu {

// keep (keys x queries, ld keep_ld): 1 where element (query q0 + c, key k0 + r)
// is kept, 0 where it is dropped.
inline void dropout_keep_tile(const DropoutParams& d, uint64_t plane, int64_t k0, int keys, int64_t q0, int queries,
                              uint8_t* keep, int64_t keep_ld) {
  constexpr int kChunk = 64;  // queries whose bits are drawn together (the loop the compiler can vectorize)
  uint32_t bits[kChunk];
  const int64_t k_end = k0 + keys;
  for (int64_t g = k0 / 32; g * 32 < k_end; ++g) {
    for (uint32_t t = 0; t < 4; ++t) {
      const uint32_t u = static_cast<uint32_t>(g * 4 + t);
      for (int c0 = 0; c0 < queries; c0 += kChunk) {
        const int n = queries - c0 < kChunk ? queries - c0 : kChunk;
        for (int c = 0; c < n; ++c)
          bits[c] = dropout_keep_bits(d.seed, plane, static_cast<uint32_t>(q0 + c0 + c), u, d.keep_threshold);
        for (int s = 0; s < 8; ++s) {
          const int64_t key = dropout_group_key(u, s);
          if (key < k0 || key >= k_end) continue;
          uint8_t* row = keep + (key - k0) * keep_ld + c0;
          for (int c = 0; c < n; ++c) row[c] = static_cast<uint8_t>((bits[c] >> s) & 1u);
        }
      }
    }
  }
}

// t (keys x queries, ld t_ld): kept entries times kept_scale, dropped ones 0
// (a select, not a product: a dropped infinity or NaN leaves no trace).
template <typename acc_t>
void apply_keep_tile(const uint8_t* keep, int64_t keep_ld, int keys, int queries, acc_t kept_scale, acc_t* t,
                     int64_t t_ld) {
  for (int r = 0; r < keys; ++r) {
    const uint8_t* k = keep + r * keep_ld;
    acc_t* row = t + r * t_ld;
    for (int c = 0; c < queries; ++c) row[c] = k[c] ? row[c] * kept_scale : acc_t(0);
  }
}

}  // namespace cpu
}  // namespace flashattn
