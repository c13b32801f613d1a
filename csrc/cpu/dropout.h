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
// is kept, 0 where it is dropped. (Compiled for AVX-512 / AVX2 / baseline,
// simd_clones.h; the queries' Philox calls run as vectors: intrinsics for
// AVX-512 and AVX2, a loop the compiler vectorizes elsewhere, dropout.cpp.)
void dropout_keep_tile(const DropoutParams& d, uint64_t plane, int64_t k0, int keys, int64_t q0, int queries,
                       uint8_t* keep, int64_t keep_ld);

// t (keys x queries, ld t_ld): kept entries times kept_scale, dropped ones 0
// (a select, not a product: a dropped infinity or NaN leaves no trace).
template <typename acc_t>
void apply_keep_tile(const uint8_t* keep, int64_t keep_ld, int keys, int queries, acc_t kept_scale, acc_t* t,
                     int64_t t_ld);

}  // namespace cpu
}  // namespace flashattn
