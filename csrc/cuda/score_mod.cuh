// flash-attn's score modifications (ScoreMod in ../flash_params.h: softcap and
// ALiBi) on the accumulator tiles of the CUDA kernels: the one place that
// says how a raw score q.k becomes the modified score the softmax sees.
//
// The kernels compile a second instance for calls with a score mod (the
// template flag kScoreMod); the plain instances hold none of this code. In
// that instance the scores leave apply_* in scaled log2 units,
//   x = log2(e) * (softcap * tanh(scale * s / softcap) - slope * |i + off - j|)
// (without softcap: scale * s, without ALiBi: no bias), so the softmax runs
// its positive-scale path with scale_log2 = 1 (whatever the sign of the
// softmax scale: the scale is already applied) and the lse it returns is that
// of the modified scores. The backward recomputes x the same way; softcap's
// derivative 1 - t^2 (t the tanh; d score / d (scale * s)) multiplies dS. The
// backward kernels get t back from P at the dS step,
//   t = (log2(P) + lse_log2 + slope_log2 |i + off - j|) / cap_log2,
// rather than keep 1 - t^2 in registers from S to dS: that array was live
// across the wait for dP and spilled (Hopper d128: 192 bytes); the MUFU.LG2
// it costs instead is not what bounds a backward step.
//
// torch SDPA's attn_mask (AttnBias) is the third modification, in the same
// instance: x = log2(e) * (scale * s + mask[b, h, i, j]) for a float mask,
// log2(e) * scale * s or -inf for a bool one, each element loaded from global
// memory (L2: a tile's mask is read by one CTA, a broadcast mask by many) in
// the mask's own dtype. Its indices are clamped to the sequence, so the loads
// stay in the tensor for the rows and keys past the end (their scores are
// masked or never stored). Being additive, it leaves dS unchanged, and dS is
// its gradient (add_bias_grad_tile, when asked for); it never comes with
// softcap or ALiBi.
//
// A warp first looks its tile up in the mask's summary (AttnBias::summary):
// a tile the mask leaves alone is only scaled, one it hides is set to -inf,
// without reading the mask; only the tiles it cuts through load elements.
//
// Which of softcap / ALiBi / attn_mask a call has is a runtime property of
// the instance, uniform over the grid: each tile takes one loop body (branch
// outside the element loops), so an element pays only for what its call has.
// A kernel may compile the two families apart (ScoreModSet: the Hopper
// forward, whose three-consumer d64 instance spilled 120 bytes with both).
#pragma once

#include "../flash_params.h"
#include "ptx.cuh"

namespace flashattn {

// Which modifications an instance holds: none (the plain kernels), all, or
// one family (flash-attn's softcap / ALiBi, or torch SDPA's attn_mask). The
// Hopper backward compiles the attn_mask's gradient apart too
// (kAttnBiasGrad): in the plain attn_mask instance its reductions, behind a
// runtime branch, cost registers every call paid (d128: spills 20/32 ->
// 36/48 bytes, the bias backward 0.70 -> 0.55 of cuDNN, session 12). The
// Hopper forward compiles the masks whose tiles it copies into shared memory
// apart (kAttnBiasStaged, AttnBias::tiles_copyable,
// hopper/fwd_sm90_bias_stage.cuh): with both ways of reading in one instance
// its d128 spills grew 64/84 -> 176/288 bytes. kDropout (the Hopper forward,
// tuning builds until timed): dropout alone, no score modification (the
// scores reach the softmax unscaled, as in the plain instance), its keep
// bits drawn under the S GEMM (fwd_sm90_mainloop.cuh).
enum class ScoreModSet : int { kNone = 0, kAll, kFlashAttn, kAttnBias, kAttnBiasGrad, kAttnBiasStaged, kDropout };
// Whether the instance's scores go through apply_score_mod_* (into scaled log2 units) before the softmax.
constexpr bool modifies_scores(ScoreModSet s) { return s != ScoreModSet::kNone && s != ScoreModSet::kDropout; }
constexpr bool holds_flash_attn_mods(ScoreModSet s) { return s == ScoreModSet::kAll || s == ScoreModSet::kFlashAttn; }
constexpr bool holds_attn_bias(ScoreModSet s) {
  return s == ScoreModSet::kAll || s == ScoreModSet::kAttnBias || s == ScoreModSet::kAttnBiasGrad ||
         s == ScoreModSet::kAttnBiasStaged;
}
constexpr bool holds_bias_grad(ScoreModSet s) { return s == ScoreModSet::kAll || s == ScoreModSet::kAttnBiasGrad; }

__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// One element of an attn_mask in log2 units: log2(e) * value (float), 0 or
// -inf (bool: attend or not). The element loops are compiled for three widths
// (kBool: 1 byte, kFloat32, and kBFloat16 standing for both 16-bit kinds,
// `bf16` telling them apart per element with a select): one loop body fewer
// per kernel than a body per kind.
//
// Finite values below -1e38 are raised to -1e38 first: masks that hide keys
// with torch.finfo(dtype).min (Hugging Face's) would overflow to -inf once
// multiplied by log2(e), and a row hidden that way must average its keys as
// torch's math does, not become a row of zeros (-inf hides; NaN stays NaN).
__device__ __forceinline__ float bias_to_log2(float v) { return (v < -1e38f && v != -INFINITY ? -1e38f : v) * kLog2e; }

// A 16-bit float mask element (bf16 or fp16, told apart by `bf16`) as float.
__device__ __forceinline__ float bias16_to_float(unsigned short u, bool bf16) {
  return bf16 ? __uint_as_float(uint32_t(u) << 16) : __half2float(__ushort_as_half(u));
}

template <BiasKind kWidth>
__device__ __forceinline__ float load_bias_log2(const void* base, int64_t off, bool bf16) {
  if constexpr (kWidth == BiasKind::kBool) {
    return __ldg(static_cast<const unsigned char*>(base) + off) ? 0.f : -INFINITY;
  } else if constexpr (kWidth == BiasKind::kFloat32) {
    return bias_to_log2(__ldg(static_cast<const float*>(base) + off));
  } else {
    return bias_to_log2(bias16_to_float(__ldg(static_cast<const unsigned short*>(base) + off), bf16));
  }
}

// The constants of one (batch, head, sequence): what apply_* needs per element.
struct ScoreModTile {
  float in_scale;    // multiplies s: scale / softcap (softcap), scale * log2(e) (none)
  float cap_log2;    // softcap * log2(e)
  float slope_log2;  // slope(b, h) * log2(e); 0 without ALiBi
  int alibi_offset;  // seqlen_k - seqlen_q of the sequence (flash-attn's bottom-right ALiBi)
  bool softcap, alibi;
  BiasKind bias_kind;      // kNone: no attn_mask
  const AttnBias& src;     // the attn_mask (kernel parameters: read where used, not kept in registers)
  int b, h;                // the tile's batch entry and query head
  int last_row, last_col;  // seqlen_q - 1, seqlen_k - 1: the clamps of the mask's indices
  // The summary code of an enclosing tile where the caller knows it (the
  // Hopper forward's producer publishes it: kMaskIdentity skips the warp's
  // lookup, one L2 round trip in the consumer's path a block), else kMaskMixed.
  int known_code = kMaskMixed;

  __host__ __device__ __forceinline__ ScoreModTile(const ScoreMod& m, float softmax_scale, int b_, int h_, int seqlen_q,
                                                   int seqlen_k)
      : in_scale(m.has_softcap() ? softmax_scale / static_cast<float>(m.softcap) : softmax_scale * kLog2e),
        cap_log2(static_cast<float>(m.softcap) * kLog2e),
        slope_log2(m.has_alibi() ? m.slope(b_, h_) * kLog2e : 0.f),
        alibi_offset(seqlen_k - seqlen_q),
        softcap(m.has_softcap()),
        alibi(m.has_alibi()),
        bias_kind(m.bias.kind),
        src(m.bias),
        b(b_),
        h(h_),
        last_row(seqlen_q - 1),
        last_col(seqlen_k - 1) {}

  // The attn_mask at (b, h).
  __device__ __forceinline__ const char* bias_base() const {
    // (AttnBias::plane with the tile's copy of the kind: what the measured build compiled.)
    return static_cast<const char*>(src.ptr) + src.offset(b, h) * bias_element_bytes(bias_kind);
  }
  // The summary code of queries [i0, i1] x keys [j0, j1] (inclusive; clamped
  // to the sequence): kMaskIdentity / kMaskHidden when every entry they touch
  // is, else kMaskMixed. Whole warp, warp-uniform arguments: each lane reads
  // one entry (a tile touches at most 2 bands x 16 columns = 32) and the warp
  // votes, one load's latency in all.
  __device__ __forceinline__ int tile_code(int i0, int i1, int j0, int j1) const {
    if (src.summary == nullptr) return kMaskMixed;
    const uint8_t* sum = src.summary + b * src.summary_batch_stride + h * src.summary_head_stride;
    i0 = min(i0, last_row), i1 = min(i1, last_row), j0 = min(j0, last_col), j1 = min(j1, last_col);
    const int band0 = src.summary_band_stride ? i0 / kMaskSummaryRows : 0;
    const int band1 = src.summary_band_stride ? i1 / kMaskSummaryRows : 0;
    const int c0 = src.summary_col_step ? j0 / kMaskSummaryCols : 0;
    const int c1 = src.summary_col_step ? j1 / kMaskSummaryCols : 0;
    const int nc = c1 - c0 + 1, n = (band1 - band0 + 1) * nc;
    const int lane = threadIdx.x & 31;
    bool identity = true, hidden = true;
    for (int e0 = 0; e0 < n; e0 += 32) {
      const int e = e0 + lane;
      const uint8_t v =
          e < n ? __ldg(sum + (band0 + e / nc) * src.summary_band_stride + (c0 + e % nc) * src.summary_col_step)
                : uint8_t(kMaskMixed);
      identity = __all_sync(0xffffffffu, e >= n || v == kMaskIdentity) && identity;
      hidden = __all_sync(0xffffffffu, e >= n || v == kMaskHidden) && hidden;
    }
    return identity ? kMaskIdentity : (hidden ? kMaskHidden : kMaskMixed);
  }
  // The mask of query i, key j in log2 units (a runtime switch: the slow paths only).
  __device__ __forceinline__ float bias_log2(int i, int j) const {
    const void* bias = bias_base();
    const int64_t off = int64_t(min(i, last_row)) * src.row_stride + int64_t(min(j, last_col)) * src.col_stride;
    const bool bf16 = bias_kind == BiasKind::kBFloat16;
    switch (bias_kind) {
      case BiasKind::kBool: return load_bias_log2<BiasKind::kBool>(bias, off, false);
      case BiasKind::kFloat32: return load_bias_log2<BiasKind::kFloat32>(bias, off, false);
      default: return load_bias_log2<BiasKind::kBFloat16>(bias, off, bf16);
    }
  }

  // One element (the slow paths: non-finite recompute, decode): raw score s
  // of query row i, key j -> x (log2 units). *dtanh: 1 - t^2 (1 without softcap).
  __device__ __forceinline__ float apply(float s, int i, int j, float* dtanh = nullptr) const {
    float x = s * in_scale;
    float d = 1.f;
    if (softcap) {
      const float t = tanh_approx(x);
      x = cap_log2 * t;
      d = 1.f - t * t;
    }
    if (alibi) x -= slope_log2 * fabsf(float(i + alibi_offset - j));
    if (bias_kind != BiasKind::kNone) x += bias_log2(i, j);
    if (dtanh) *dtanh = d;
    return x;
  }
};

namespace score_mod_detail {

// Element (mi, ni, 2h + e) of a warp's accumulator tile is row
// row0 + mi*16 + g + 8h, column col0 + ni*8 + 2t + e (mma.sync / wgmma
// layout); kTransposed: rows are keys and columns queries (the backward's S^T).
template <bool kSoftcap, bool kAlibi, bool kTransposed, int kMT, int kNT>
__device__ __forceinline__ void apply_tile(float (&s)[kMT][kNT][4], const ScoreModTile& m, int row0, int col0,
                                           int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + mi * 16 + g + 8 * h;
      // |query + off - key| = |base + sign * c| for the element's column offset c.
      const float base =
          kTransposed ? float(col0 + 2 * t + m.alibi_offset - r) : float(r + m.alibi_offset - col0 - 2 * t);
#pragma unroll
      for (int ni = 0; ni < kNT; ++ni)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[mi][ni][2 * h + e];
          x *= m.in_scale;
          if constexpr (kSoftcap) x = m.cap_log2 * tanh_approx(x);
          if constexpr (kAlibi) {
            const float c = float(ni * 8 + e);
            x -= m.slope_log2 * fabsf(kTransposed ? base + c : base - c);
          }
        }
    }
}

// A warp's tile of an attn_mask call that the mask leaves alone or hides
// whole (its summary code: known, or looked up) is scaled or set to -inf
// here, and true returned; false: the mask cuts through it (its elements
// are needed). Rows / columns as apply_*.
template <bool kTransposed, int kMT, int kNT>
__device__ __forceinline__ bool scaled_or_hidden_whole(float (&s)[kMT][kNT][4], const ScoreModTile& m, int row0,
                                                       int col0) {
  // The tile's queries and keys: rows row0 .. row0 + 16 kMT - 1, columns col0 .. col0 + 8 kNT - 1.
  const int r_last = row0 + 16 * kMT - 1, c_last = col0 + 8 * kNT - 1;
  const int code = m.known_code != kMaskMixed ? m.known_code
                   : kTransposed              ? m.tile_code(col0, c_last, row0, r_last)
                                              : m.tile_code(row0, r_last, col0, c_last);
  if (code == kMaskMixed) return false;
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int ni = 0; ni < kNT; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mi][ni][e] = code == kMaskHidden ? -INFINITY : s[mi][ni][e] * m.in_scale;
  return true;
}

// attn_mask: x = in_scale * s + mask (in log2 units), loaded per element.
template <BiasKind kKind, bool kTransposed, int kMT, int kNT>
__device__ __forceinline__ void apply_bias_tile(float (&s)[kMT][kNT][4], const ScoreModTile& m, int row0, int col0,
                                                int lane) {
  const int g = lane >> 2, t = lane & 3;
  if (scaled_or_hidden_whole<kTransposed>(s, m, row0, col0)) return;
  const bool bf16 = m.bias_kind == BiasKind::kBFloat16;
  // (i, j) = (query, key); transposed tiles run rows over keys.
  const int64_t rs = kTransposed ? m.src.col_stride : m.src.row_stride;
  const int64_t cs = kTransposed ? m.src.row_stride : m.src.col_stride;
  const char* const base = m.bias_base();
  const int last_r = kTransposed ? m.last_col : m.last_row, last_c = kTransposed ? m.last_row : m.last_col;
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = min(row0 + mi * 16 + g + 8 * h, last_r);
      const char* row_base = base + int64_t(r) * rs * bias_element_bytes(kKind);
#pragma unroll
      for (int ni = 0; ni < kNT; ++ni)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = min(col0 + ni * 8 + 2 * t + e, last_c);
          float& x = s[mi][ni][2 * h + e];
          const float b = load_bias_log2<kKind>(row_base, int64_t(c) * cs, bf16);
          if constexpr (kKind == BiasKind::kBool) {
            x = b == 0.f ? x * m.in_scale : -INFINITY;
          } else {
            x = fmaf(x, m.in_scale, b);
          }
        }
    }
}

template <ScoreModSet kSet, bool kTransposed, int kMT, int kNT>
__device__ __forceinline__ void apply_any(float (&s)[kMT][kNT][4], const ScoreModTile& m, int row0, int col0,
                                          int lane) {
  if constexpr (holds_attn_bias(kSet)) {
    switch (m.bias_kind) {
      case BiasKind::kNone: break;
      case BiasKind::kBool: return apply_bias_tile<BiasKind::kBool, kTransposed>(s, m, row0, col0, lane);
      case BiasKind::kFloat32: return apply_bias_tile<BiasKind::kFloat32, kTransposed>(s, m, row0, col0, lane);
      default: return apply_bias_tile<BiasKind::kBFloat16, kTransposed>(s, m, row0, col0, lane);  // 16-bit
    }
  }
  if constexpr (!holds_flash_attn_mods(kSet)) return;
  if (m.softcap) {
    if (m.alibi) {
      apply_tile<true, true, kTransposed>(s, m, row0, col0, lane);
    } else {
      apply_tile<true, false, kTransposed>(s, m, row0, col0, lane);
    }
  } else {
    apply_tile<false, true, kTransposed>(s, m, row0, col0, lane);
  }
}

}  // namespace score_mod_detail

// Raw scores -> modified scores in log2 units, rows are queries r0 + ..., columns keys c0 + ...
// Run before the mask (the mask's -inf must not go through tanh).
template <ScoreModSet kSet = ScoreModSet::kAll, int kMT, int kNT>
__device__ __forceinline__ void apply_score_mod_rows(float (&s)[kMT][kNT][4], const ScoreModTile& m, int r0, int c0,
                                                     int lane) {
  score_mod_detail::apply_any<kSet, false>(s, m, r0, c0, lane);
}

// The same for a transposed tile (the backward's S^T: rows are keys key0 + ..., columns queries q0 + ...).
template <ScoreModSet kSet = ScoreModSet::kAll, int kMT, int kNT>
__device__ __forceinline__ void apply_score_mod_cols(float (&s)[kMT][kNT][4], const ScoreModTile& m, int key0, int q0,
                                                     int lane) {
  score_mod_detail::apply_any<kSet, true>(s, m, key0, q0, lane);
}

// dS *= 1 - t^2 where the call has a softcap (dS of the modified score -> dS
// of scale * s), t recovered from P (see the top): p the tile's P (0 where
// masked or underflowed: dS is 0 there, and so is the factor), lse_log2(mi,
// h, ni, e) the element's lse in log2 units. Rows / columns as apply_*; kTransposed: rows are keys.
template <bool kTransposed, int kMT, int kNT, typename LseLog2>
__device__ __forceinline__ void apply_softcap_grad(float (&ds)[kMT][kNT][4], const float (&p)[kMT][kNT][4],
                                                   const ScoreModTile& m, int row0, int col0, int lane,
                                                   LseLog2&& lse_log2) {
  if (!m.softcap) return;
  const int g = lane >> 2, t = lane & 3;
  const float inv_cap = 1.f / m.cap_log2;
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + mi * 16 + g + 8 * h;
      const float base =
          kTransposed ? float(col0 + 2 * t + m.alibi_offset - r) : float(r + m.alibi_offset - col0 - 2 * t);
#pragma unroll
      for (int ni = 0; ni < kNT; ++ni)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pv = p[mi][ni][2 * h + e];
          const float c = float(ni * 8 + e);
          const float bias = m.slope_log2 * fabsf(kTransposed ? base + c : base - c);  // 0 without ALiBi
          const float th = (fast_log2(pv) + lse_log2(mi, h, ni, e) + bias) * inv_cap;
          ds[mi][ni][2 * h + e] *= pv > 0.f ? 1.f - th * th : 0.f;
        }
    }
}

// The attn_mask's gradient (AttnBias::grad, when the call asks for it): the
// tile's dS (the gradient of the scaled scores, to which a float mask is
// added: the mask's own gradient) added into the float32 gradient buffer by
// reductions (red.global.add: where the mask broadcasts, several CTAs share an
// element). Rows / columns as apply_*; elements past the sequence add nothing,
// nor do zeros (masked elements, a tile the mask hides). A dimension the
// gradient sums over (stride 0) is summed in registers and across the lanes
// that hold it first, so that one lane adds per element of the buffer.
template <bool kTransposed, int kMT, int kNT>
__device__ __forceinline__ void add_bias_grad_tile(const float (&ds)[kMT][kNT][4], const ScoreModTile& m, int row0,
                                                   int col0, int lane) {
  const AttnBias& a = m.src;
  if (a.grad == nullptr) return;
  const int g = lane >> 2, t = lane & 3;
  float* const base = static_cast<float*>(a.grad) + a.grad_offset(m.b, m.h);
  const int64_t rs = kTransposed ? a.grad_col_stride : a.grad_row_stride;
  const int64_t cs = kTransposed ? a.grad_row_stride : a.grad_col_stride;
  const int last_r = kTransposed ? m.last_col : m.last_row, last_c = kTransposed ? m.last_row : m.last_col;
  auto value = [&](int mi, int h, int ni, int e) {
    const int r = row0 + mi * 16 + g + 8 * h, c = col0 + ni * 8 + 2 * t + e;
    return r <= last_r && c <= last_c ? ds[mi][ni][2 * h + e] : 0.f;
  };
  auto add = [&](int r, int c, float v) {
    if (v != 0.f) atomicAdd(base + int64_t(r) * rs + int64_t(c) * cs, v);
  };
  if (rs != 0 && cs != 0) {
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int ni = 0; ni < kNT; ++ni)
#pragma unroll
          for (int e = 0; e < 2; ++e) add(row0 + mi * 16 + g + 8 * h, col0 + ni * 8 + 2 * t + e, value(mi, h, ni, e));
  } else if (rs != 0) {  // the columns sum: over a lane's columns, then over t
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float v = 0.f;
#pragma unroll
        for (int ni = 0; ni < kNT; ++ni) v += value(mi, h, ni, 0) + value(mi, h, ni, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        if (t == 0) add(row0 + mi * 16 + g + 8 * h, 0, v);
      }
  } else if (cs != 0) {  // the rows sum: over a lane's rows, then over g
#pragma unroll
    for (int ni = 0; ni < kNT; ++ni)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = 0.f;
#pragma unroll
        for (int mi = 0; mi < kMT; ++mi) v += value(mi, 0, ni, e) + value(mi, 1, ni, e);
        v += __shfl_xor_sync(0xffffffffu, v, 4);
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        if (g == 0) add(0, col0 + ni * 8 + 2 * t + e, v);
      }
  } else {  // both sum: the whole tile to one element
    float v = 0.f;
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int ni = 0; ni < kNT; ++ni) v += value(mi, h, ni, 0) + value(mi, h, ni, 1);
#pragma unroll
    for (int o = 1; o < 32; o *= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) add(0, 0, v);
  }
}

}  // namespace flashattn
