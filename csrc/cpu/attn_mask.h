// The mask of flash_params.h (MaskParams) in the index arithmetic the tiled
// loops need: per-row key intervals, per-key query intervals, the key (query)
// range a query (key) tile has to visit, and whether a whole block is visible
// so that the element mask can be skipped.
//
// Query i sees key j iff key_begin(i) <= j < key_end(i), where
//   key_begin(i) = i + diag_offset - window_left   (0 when window_left < 0)
//   key_end(i)   = i + diag_offset + window_right + 1   (seqlen_k when window_right < 0)
// clamped to [0, seqlen_k]. Both bounds grow with i (by one per row before
// clamping), which is what makes the block-level shortcuts below exact.
// Arithmetic is in int64: i + diag_offset + window_right can pass 2^31.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../flash_params.h"

namespace flashattn {
namespace cpu {

struct AttnMask {
  int64_t seqlen_q, seqlen_k;
  int64_t diag_offset;
  int64_t window_left, window_right;  // -1: unbounded

  AttnMask(const MaskParams& m, int64_t seqlen_q_, int64_t seqlen_k_)
      : seqlen_q(seqlen_q_),
        seqlen_k(seqlen_k_),
        diag_offset(m.diag_offset),
        window_left(m.window_left),
        window_right(m.window_right) {}

  // The mask of one sequence of a batch: its lengths and its diagonal (per
  // sequence in a varlen batch).
  AttnMask(const MaskParams& m, const SeqInfo& seq)
      : seqlen_q(seq.seqlen_q),
        seqlen_k(seq.seqlen_k),
        diag_offset(seq.diag_offset),
        window_left(m.window_left),
        window_right(m.window_right) {}

  static int64_t clamp(int64_t x, int64_t hi) { return std::min(std::max<int64_t>(x, 0), hi); }

  // Keys visible from query i: [key_begin(i), key_end(i)), possibly empty.
  int64_t key_begin(int64_t i) const { return window_left < 0 ? 0 : clamp(i + diag_offset - window_left, seqlen_k); }
  int64_t key_end(int64_t i) const {
    return window_right < 0 ? seqlen_k : clamp(i + diag_offset + window_right + 1, seqlen_k);
  }

  // Queries that see key j: [query_begin(j), query_end(j)), possibly empty
  // (the same relation solved for i).
  int64_t query_begin(int64_t j) const {
    return window_right < 0 ? 0 : clamp(j - diag_offset - window_right, seqlen_q);
  }
  int64_t query_end(int64_t j) const {
    return window_left < 0 ? seqlen_q : clamp(j - diag_offset + window_left + 1, seqlen_q);
  }

  // Keys seen by at least one query of [q0, q1) lie in [key_begin(q0),
  // key_end(q1 - 1)): the row intervals move monotonically and overlap (the
  // window is at least one key wide), so their union has no holes. An empty
  // range means every row of the tile is fully masked.
  int64_t tile_key_begin(int64_t q0) const { return key_begin(q0); }
  int64_t tile_key_end(int64_t q1) const { return key_end(q1 - 1); }

  // Queries that see at least one key of [k0, k1), by the same argument.
  int64_t tile_query_begin(int64_t k0) const { return query_begin(k0); }
  int64_t tile_query_end(int64_t k1) const { return query_end(k1 - 1); }

  // Every query of [q0, q1) sees every key of [k0, k1): the last row's
  // interval starts before k0 and the first row's ends after k1 - 1.
  bool block_fully_visible(int64_t q0, int64_t q1, int64_t k0, int64_t k1) const {
    return key_begin(q1 - 1) <= k0 && key_end(q0) >= k1;
  }

  // The element mask of block (queries [q0, q0 + rows), keys [k0, k0 + cols))
  // as, per key j, the visible queries [lo[j], hi[j]) in block coordinates.
  // Returns false (lo, hi untouched) when the whole block is visible.
  bool block_query_ranges(int64_t q0, int rows, int64_t k0, int cols, int* lo, int* hi) const {
    if (block_fully_visible(q0, q0 + rows, k0, k0 + cols)) return false;
    for (int j = 0; j < cols; ++j) {
      lo[j] = static_cast<int>(clamp(query_begin(k0 + j) - q0, rows));
      hi[j] = static_cast<int>(clamp(query_end(k0 + j) - q0, rows));
    }
    return true;
  }
};

}  // namespace cpu
}  // namespace flashattn
