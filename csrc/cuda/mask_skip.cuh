// Key blocks of a query tile that torch SDPA's attn_mask hides outright,
// read from its per-call summary (AttnBias::summary, mask_summary.cu): such a
// block is neither loaded nor computed, so a block-diagonal document mask over
// packed sequences costs about what the varlen call on the same sequences
// costs (issue 21, must-have 3), on the device, with no host synchronisation.
//
// Skipping is exact: a hidden block contributes exp(-inf) = 0 to every row's
// sum and nothing to its output, and a row that every block hides ends as a row
// that sees no key (output 0, lse -inf), as the masked computation gives it.
// The values under hidden keys are never read, as the non-finite rule wants
// (what a row does not see cannot make it NaN).
//
// Every role of a kernel that skips (the producer's loads, the consumers'
// GEMMs) must visit the same blocks in the same order, or the K/V ring's
// phases slip: they all decide from the same summary bytes (summary_code).
#pragma once

#include "../flash_params.h"

namespace flashattn {

// The summary code of queries [i0, i1] x keys [j0, j1]: kMaskHidden /
// kMaskIdentity when every entry they touch is, else kMaskMixed (no summary:
// kMaskMixed). The range starts on a tile of kRows x kCols
// (i0 a multiple of kRows, j0 of kCols) and ends inside it, so its entries are
// at most kBands bands x kColumns columns (one of either when the tile is
// smaller than an entry): unrolled, their loads in flight together. One thread.
template <int kRows, int kCols>
__device__ __forceinline__ int summary_code(const AttnBias& src, int b, int h, int i0, int i1, int j0, int j1) {
  if (src.summary == nullptr) return kMaskMixed;
  static_assert(kRows % kMaskSummaryRows == 0 || kMaskSummaryRows % kRows == 0, "tiles of whole entries or in one");
  static_assert(kCols % kMaskSummaryCols == 0 || kMaskSummaryCols % kCols == 0, "tiles of whole entries or in one");
  constexpr int kBands = kRows >= kMaskSummaryRows ? kRows / kMaskSummaryRows : 1;
  constexpr int kColumns = kCols >= kMaskSummaryCols ? kCols / kMaskSummaryCols : 1;
  const uint8_t* sum = src.summary + b * src.summary_batch_stride + h * src.summary_head_stride;
  // A dimension the mask broadcasts has one entry (stride 0): index 0.
  const int band0 = src.summary_band_stride ? i0 / kMaskSummaryRows : 0;
  const int bands = src.summary_band_stride ? i1 / kMaskSummaryRows - band0 + 1 : 1;
  const int c0 = src.summary_col_step ? j0 / kMaskSummaryCols : 0;
  const int cols = src.summary_col_step ? j1 / kMaskSummaryCols - c0 + 1 : 1;
  bool hidden = true, identity = true;
#pragma unroll
  for (int r = 0; r < kBands; ++r)
#pragma unroll
    for (int c = 0; c < kColumns; ++c)
      if (r < bands && c < cols) {
        const uint8_t v = __ldg(sum + (band0 + r) * src.summary_band_stride + (c0 + c) * src.summary_col_step);
        hidden &= v == kMaskHidden;
        identity &= v == kMaskIdentity;
      }
  return hidden ? kMaskHidden : (identity ? kMaskIdentity : kMaskMixed);
}

// The steps of a kernel's loop (j = 0 .. steps - 1: the forward's key blocks
// of a query tile, the backward's query blocks of a key block) whose tile
// `code` (its summary code) does not say hidden, in order. kSkip = false (the
// instances without an attn_mask): every step, and no code.
template <bool kSkip, typename Code>
struct VisibleSteps {
  Code code;  // code(j): step j's tile's summary code
  int steps;
  uint32_t bits = 0;   // (next_warp) bit k: step base + k is visible
  uint32_t ident = 0;  // ... and left alone by the mask (kMaskIdentity)
  int base = 0x7fffffff;

  // Whole warp, j warp-uniform: the first visible step >= j (>= steps: none),
  // 32 steps a lookup (each lane one step, a ballot).
  __device__ __forceinline__ int next_warp(int j) {
    if constexpr (kSkip) {
      while (j < steps) {
        if (j < base || j >= base + 32) {
          base = j;
          const int s = j + (threadIdx.x & 31);
          const int c = s < steps ? code(s) : kMaskHidden;
          bits = __ballot_sync(0xffffffffu, c != kMaskHidden);
          ident = __ballot_sync(0xffffffffu, c == kMaskIdentity);
        }
        const uint32_t ahead = bits >> (j - base);
        if (ahead) return j + __ffs(ahead) - 1;
        j = base + 32;
      }
    }
    return j;
  }
  // The code of a step next_warp has just returned (in the current window):
  // kMaskIdentity or kMaskMixed.
  __device__ __forceinline__ int code_of(int j) const {
    const unsigned k = unsigned(j - base);  // (past the window, e.g. j = steps: mixed)
    return kSkip && k < 32u && (ident >> k) & 1u ? int(kMaskIdentity) : int(kMaskMixed);
  }
};
template <bool kSkip, typename Code>
__device__ __forceinline__ VisibleSteps<kSkip, Code> visible_steps(Code code, int steps) {
  return VisibleSteps<kSkip, Code>{code, steps};
}

// The backward's form: a CTA's visible steps as a bitmap in shared memory,
// filled by the whole CTA once before its roles split (kMaxSteps / 32 words;
// every step counts as visible when the CTA has more steps, or without a
// summary). Its roles run with few registers (the producer and dQ writer
// warps) or none to spare (the consumers): reading a bit costs them nothing
// live across their loops, where a window of the lookup above spilled
// hundreds of bytes in the producer warpgroup (d128, ptxas).
template <bool kSkip>
struct StepBitmap {
  static constexpr int kMaxSteps = 1024, kWords = kMaxSteps / 32;
  static constexpr int kSmemBytes = kSkip ? kWords * 4 : 0;  // (the traits reserve it for every instance)
  const uint32_t* bits;                                      // nullptr: every step visible
  int steps;

  // Whole CTA (kThreads threads numbered tid), before a CTA-wide barrier.
  template <int kThreads, typename Code>
  static __device__ __forceinline__ StepBitmap fill(uint32_t* smem, int steps, Code code, bool have_summary, int tid) {
    if constexpr (kSkip) {
      if (have_summary && steps <= kMaxSteps) {
        for (int w = tid / 32; w < (steps + 31) / 32; w += kThreads / 32) {
          const int j = w * 32 + tid % 32;
          const uint32_t word = __ballot_sync(0xffffffffu, j < steps && code(j) != kMaskHidden);
          if (tid % 32 == 0) smem[w] = word;
        }
        return StepBitmap{smem, steps};
      }
    }
    return StepBitmap{nullptr, steps};
  }
  // The first visible step >= j (>= steps: none). Any thread.
  __device__ __forceinline__ int next(int j) const {
    if constexpr (kSkip) {
      if (bits != nullptr) {
        for (; j < steps; j = (j | 31) + 1) {
          const uint32_t ahead = bits[j >> 5] >> (j & 31);
          if (ahead) return j + __ffs(ahead) - 1;
        }
      }
    }
    return j;
  }
};

// The forward's key-block steps of a query tile of kBlockM rows at m0 (rows of
// them in the sequence): step j visits key block n_max - 1 - j.
template <int kBlockM, int kBlockN, bool kSkip>
__device__ __forceinline__ auto visible_key_steps(const AttnBias& src, int b, int h, int m0, int rows, int n_max,
                                                  int seqlen_k, int blocks) {
  const int last_row = m0 + min(rows, kBlockM) - 1;
  return visible_steps<kSkip>(
      [&src, b, h, m0, last_row, n_max, seqlen_k](int j) {
        const int n0 = (n_max - 1 - j) * kBlockN;
        return summary_code<kBlockM, kBlockN>(src, b, h, m0, last_row, n0, min(n0 + kBlockN, seqlen_k) - 1);
      },
      blocks);
}

}  // namespace flashattn
