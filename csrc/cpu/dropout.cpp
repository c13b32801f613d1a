// The CPU kernels' dropout tiles (dropout.h), compiled per SIMD target.
#include "dropout.h"

#include "simd_clones.h"

namespace flashattn {
namespace cpu {

FLASHATTN_SIMD_CLONES void dropout_keep_tile(const DropoutParams& d, uint64_t plane, int64_t k0, int keys, int64_t q0,
                                             int queries, uint8_t* keep, int64_t keep_ld) {
  constexpr int kChunk = 64;  // queries whose bits are drawn together (the loop the compiler vectorizes)
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
