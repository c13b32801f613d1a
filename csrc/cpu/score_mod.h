// flash_params.h's ScoreMod (softcap, ALiBi, torch SDPA's attn_mask) on the
// CPU kernels' key-major score tiles (row = key, column = query, as in
// tile_ops.h). The kernels ask any() once per tile and call apply() only
// then, so the plain path keeps its code and its speed; apply() branches once
// per tile on which mods are on.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "../flash_params.h"
#include "tile_ops.h"

namespace flashattn {
namespace cpu {

// The modification for one (sequence b, query head h).
template <typename acc_t>
struct TileScoreMod {
  acc_t softcap = 0;  // 0: none
  acc_t slope = 0;
  bool alibi = false;
  int64_t diag = 0;  // seqlen_k - seqlen_q of the sequence: query i sits at key i + diag (ALiBi's distance)
  AttnBias bias;     // the attn_mask, ptr at (b, h); kind kNone: none

  TileScoreMod() = default;
  TileScoreMod(const ScoreMod& m, int b, int h, int64_t seqlen_q, int64_t seqlen_k) {
    if (m.has_softcap()) softcap = static_cast<acc_t>(m.softcap);
    if (m.has_alibi()) alibi = true, slope = static_cast<acc_t>(m.slope(b, h));
    diag = seqlen_k - seqlen_q;
    if (m.has_bias()) {
      bias = m.bias;
      bias.ptr = m.bias.plane(b, h);
    }
  }

  bool any() const { return softcap > 0 || alibi || bias.ptr != nullptr; }

  // s_t: keys x queries (key k0 + r, query q0 + c), leading dimension ld.
  // In: scores to be multiplied by `scale`; out: the modified scaled scores,
  //   softcap * tanh(scale * s / softcap) - slope * |q0 + c + diag - k0 - r|.
  // dtanh (nullptr: not wanted; else ld like s_t): 1 - tanh^2, the softcap's
  // derivative that the backward multiplies dS by (1 without softcap: not written).
  // An attn_mask never comes with softcap or ALiBi (make_score_mod refuses
  // it): its tile is scaled and added in one pass (add_bias).
  void apply(acc_t* s_t, int64_t ld, int keys, int queries, acc_t scale, int64_t k0, int64_t q0, acc_t* dtanh) const {
    if (bias.ptr) {
      switch (bias.kind) {
        case BiasKind::kBool: return add_bias<bool>(s_t, ld, keys, queries, k0, q0, scale);
        case BiasKind::kFloat16: return add_bias<c10::Half>(s_t, ld, keys, queries, k0, q0, scale);
        case BiasKind::kBFloat16: return add_bias<c10::BFloat16>(s_t, ld, keys, queries, k0, q0, scale);
        case BiasKind::kFloat32: return add_bias<float>(s_t, ld, keys, queries, k0, q0, scale);
        default: return add_bias<double>(s_t, ld, keys, queries, k0, q0, scale);
      }
    }
    // softcap, then ALiBi on the capped scores (flash-attn's order), each a
    // SIMD-cloned tile op (tile_ops.h; this header's own loops would run the
    // build's baseline SSE2: libm's tanh an element cost the forward 4x).
    if (softcap > 0) softcap_tile(s_t, ld, keys, queries, scale, softcap, dtanh);
    if (alibi) alibi_tile(s_t, ld, keys, queries, softcap > 0 ? acc_t(1) : scale, slope, q0 + diag - k0);
  }

  // Asks the caches for the mask of the block of `keys` keys from k0 x the
  // queries [q0, min(q0 + queries, seqlen_q)) (nothing without a mask, or
  // with keys not contiguous in it). For loops that walk the mask down a key
  // column (the backward's key tiles: one query tile after another), whose
  // rows lie a mask row apart, a pattern the hardware prefetchers do not
  // follow: there each of the block's cache lines was a miss (session 29: a
  // float bias cost the float32 backward 30% over the unmasked one).
  void prefetch(int keys, int queries, int64_t k0, int64_t q0, int64_t seqlen_q) const {
    if (!bias.ptr || bias.col_stride != 1 || q0 >= seqlen_q) return;
    const int64_t elem = bias_element_bytes(bias.kind), row_bytes = keys * elem;
    const int64_t rows = bias.row_stride == 0 ? 1 : std::min<int64_t>(queries, seqlen_q - q0);
    const char* base = static_cast<const char*>(bias.ptr) + (q0 * bias.row_stride + k0) * elem;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(base + i * bias.row_stride * elem + off);
  }

  // Whether the attn_mask hides every element of the block of `keys` keys
  // from k0 x `queries` queries from q0 (all False, or all -inf): the
  // kernels then skip the block (its P is 0, and what a row does not see
  // cannot make it NaN: the non-finite rule). Stops at the first visible
  // element, so a block that is not hidden costs a load or a few.
  bool hides(int keys, int queries, int64_t k0, int64_t q0) const {
    if (!bias.ptr) return false;
    switch (bias.kind) {
      case BiasKind::kBool: return hides_as<bool>(keys, queries, k0, q0);
      case BiasKind::kFloat16: return hides_as<c10::Half>(keys, queries, k0, q0);
      case BiasKind::kBFloat16: return hides_as<c10::BFloat16>(keys, queries, k0, q0);
      case BiasKind::kFloat32: return hides_as<float>(keys, queries, k0, q0);
      default: return hides_as<double>(keys, queries, k0, q0);
    }
  }

 private:
  template <typename mask_t>
  bool hides_as(int keys, int queries, int64_t k0, int64_t q0) const {
    const mask_t* m = static_cast<const mask_t*>(bias.ptr) + q0 * bias.row_stride + k0 * bias.col_stride;
    // A block the mask hides is read whole (a document mask hides most of
    // them), so a row's keys are tested together, not one branch a key: a
    // bool row 8 bytes a word, a float row without an early exit inside it.
    // With one row for every query (row stride 0) one row decides.
    const int rows = bias.row_stride == 0 ? 1 : queries;
    for (int c = 0; c < rows; ++c) {  // a query's keys: contiguous in a row-major mask
      const mask_t* mr = m + c * bias.row_stride;
      if constexpr (std::is_same_v<mask_t, bool>) {
        if (bias.col_stride == 1) {
          uint64_t any = 0;
          int r = 0;
          for (; r + 8 <= keys; r += 8) {
            uint64_t word;
            std::memcpy(&word, mr + r, sizeof(word));
            any |= word;
          }
          for (; r < keys; ++r) any |= static_cast<uint64_t>(mr[r]);
          if (any) return false;
          continue;
        }
        for (int r = 0; r < keys; ++r)
          if (mr[r * bias.col_stride]) return false;
      } else {
        bool hidden = true;
        for (int r = 0; r < keys; ++r)
          hidden &= static_cast<double>(mr[r * bias.col_stride]) == -std::numeric_limits<double>::infinity();
        if (!hidden) return false;
      }
    }
    return true;
  }

  // s_t[r][c] = scale * s_t[r][c] + mask(query q0 + c, key k0 + r); a bool
  // mask sets -inf where it is false. The mask is row-major (a query's keys
  // contiguous), the tile key-major. A float mask whose keys are contiguous
  // (and whose type the tile ops take: the score type's own, or a 16-bit one
  // into float) goes through add_tile_transposed's 8 x 8 blocks. Otherwise 16
  // keys at a time, query by query, so that each mask load continues a run of
  // one query row and the 16 tile rows written stay in L1. Read key by key as
  // it was, each load touched another mask row 4 KB+ apart, and a float bias
  // cost the float32 forward more than its products (session 29: b2 h8 n1024
  // d64, 2 threads, 49 ms against 27 unmasked).
  template <typename mask_t>
  void add_bias(acc_t* s_t, int64_t ld, int keys, int queries, int64_t k0, int64_t q0, acc_t scale) const {
    const mask_t* m = static_cast<const mask_t*>(bias.ptr) + q0 * bias.row_stride + k0 * bias.col_stride;
    constexpr bool kTileOp =
        std::is_same_v<mask_t, acc_t> ||
        (std::is_same_v<acc_t, float> && (std::is_same_v<mask_t, c10::BFloat16> || std::is_same_v<mask_t, c10::Half>));
    if constexpr (kTileOp) {
      if (bias.col_stride == 1) return add_tile_transposed(m, bias.row_stride, queries, keys, scale, s_t, ld);
    }
    if constexpr (std::is_same_v<mask_t, bool>) {
      if (bias.row_stride == 0) {  // one row for every query (a key padding mask): a key's tile row at once
        for (int r = 0; r < keys; ++r) {
          acc_t* s = s_t + r * ld;
          if (!m[r * bias.col_stride]) {
            std::fill(s, s + queries, -std::numeric_limits<acc_t>::infinity());
          } else if (scale != acc_t(1)) {
            for (int c = 0; c < queries; ++c) s[c] *= scale;
          }
        }
        return;
      }
    }
    constexpr int kKeys = 16;
    for (int r0 = 0; r0 < keys; r0 += kKeys) {
      const int r1 = std::min(keys, r0 + kKeys);
      for (int c = 0; c < queries; ++c) {
        const mask_t* mr = m + c * bias.row_stride;
        acc_t* s = s_t + c;
        for (int r = r0; r < r1; ++r) {
          acc_t& x = s[r * ld];
          if constexpr (std::is_same_v<mask_t, bool>) {
            x = mr[r * bias.col_stride] ? x * scale : -std::numeric_limits<acc_t>::infinity();
          } else {
            x = x * scale + static_cast<acc_t>(mr[r * bias.col_stride]);
          }
        }
      }
    }
  }
};

}  // namespace cpu
}  // namespace flashattn
