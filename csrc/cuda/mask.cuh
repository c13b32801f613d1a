// Which keys each query sees (see MaskParams in flash_params.h), at three
// granularities: the range of key blocks a query block must visit, whether a
// (query block, key block) tile needs element masking at all, and the
// per-row visible key interval [lo, hi) used to mask the tiles that do.
// Only the tiles on a diagonal or a sequence edge pay for masking.
#pragma once

#include "../flash_params.h"
#include "ptx.cuh"

namespace flashattn {

struct BlockMask {
  int seqlen_q, seqlen_k;
  int window_left, window_right, diag_offset;

  // The mask of a dense batch (every sequence seqlen_q x seqlen_k).
  __device__ __forceinline__ explicit BlockMask(const AttnFwdParams& p)
      : seqlen_q(p.seqlen_q),
        seqlen_k(p.seqlen_k),
        window_left(p.mask.window_left),
        window_right(p.mask.window_right),
        diag_offset(p.mask.diag_offset) {}

  // The mask of one sequence: its own lengths and diagonal (varlen batches).
  __device__ __forceinline__ BlockMask(const AttnFwdParams& p, const SeqInfo& seq)
      : seqlen_q(seq.seqlen_q),
        seqlen_k(seq.seqlen_k),
        window_left(p.mask.window_left),
        window_right(p.mask.window_right),
        diag_offset(seq.diag_offset) {}

  // From its fields (the host check of tests/test_mask_rule.py).
  __host__ __device__ __forceinline__ BlockMask(int seqlen_q_, int seqlen_k_, int window_left_, int window_right_,
                                                int diag_offset_)
      : seqlen_q(seqlen_q_),
        seqlen_k(seqlen_k_),
        window_left(window_left_),
        window_right(window_right_),
        diag_offset(diag_offset_) {}

  __host__ __device__ __forceinline__ static int clamp(int64_t x, int lo, int hi) {
    return static_cast<int>(x < lo ? lo : (x > hi ? hi : x));
  }

  // Visible keys of query row `row`: [lo, hi).
  __host__ __device__ __forceinline__ int key_hi(int row) const {
    return window_right < 0 ? seqlen_k : clamp(int64_t(row) + diag_offset + window_right + 1, 0, seqlen_k);
  }
  __host__ __device__ __forceinline__ int key_lo(int row) const {
    return window_left < 0 ? 0 : clamp(int64_t(row) + diag_offset - window_left, 0, seqlen_k);
  }

  // Key blocks [n_min, n_max) seen by query rows [m0, m0 + rows).
  template <int kBlockN>
  __host__ __device__ __forceinline__ void key_block_range(int m0, int rows, int& n_min, int& n_max) const {
    n_max = ceil_div(key_hi(m0 + rows - 1), kBlockN);
    n_min = key_lo(m0) / kBlockN;
  }

  // Query blocks [m_min, m_max) that see some key of [n0, n0 + cols).
  template <int kBlockM>
  __device__ __forceinline__ void query_block_range(int n0, int cols, int& m_min, int& m_max) const {
    // key j is seen by rows i with j - off - wr <= i <= j - off + wl.
    int64_t first = window_right < 0 ? 0 : int64_t(n0) - diag_offset - window_right;
    int64_t last = window_left < 0 ? int64_t(seqlen_q) - 1 : int64_t(n0) + cols - 1 - diag_offset + window_left;
    first = first < 0 ? 0 : first;
    last = last >= seqlen_q ? seqlen_q - 1 : last;
    if (last < first) {
      m_min = m_max = 0;
      return;
    }
    m_min = static_cast<int>(first / kBlockM);
    m_max = static_cast<int>(last / kBlockM) + 1;
  }

  // Does the tile rows [m0, m0+kBlockM) x keys [n0, n0+kBlockN) contain a masked element?
  // Rows past seqlen_q are not counted: they are never stored.
  template <int kBlockM, int kBlockN>
  __host__ __device__ __forceinline__ bool tile_needs_mask(int m0, int n0) const {
    if (n0 + kBlockN > seqlen_k) return true;
    const int row_last = (m0 + kBlockM < seqlen_q ? m0 + kBlockM : seqlen_q) - 1;
    if (window_right >= 0 && int64_t(n0) + kBlockN - 1 > int64_t(m0) + diag_offset + window_right) return true;
    if (window_left >= 0 && int64_t(n0) < int64_t(row_last) + diag_offset - window_left) return true;
    return false;
  }

  // Whether tile_needs_mask can hold only for the first key block a query
  // tile visits (the forward visits a tile's blocks last first), for every
  // tile of kBlockM rows: then the steps after the first need no mask code
  // (MaskSteps::kFirst, the forward mainloop's policy). The first block
  // visited is the one the ragged key end and a diagonal reach furthest, so
  // without a window edge on the left this holds when the diagonal of every
  // tile lies in one key block: square tiles whose diagonal starts on a block
  // boundary (row i sees keys < i + d + 1, d = diag_offset + window_right, d
  // or d + 1 a multiple of the block). Dense batches (one diagonal for all).
  // tests/cuda_host/mask_rule_check.cu checks it against tile_needs_mask.
  template <int kBlockM, int kBlockN>
  __host__ __device__ __forceinline__ bool masks_first_step_only() const {
    if (window_left >= 0) return false;  // a left window edge cuts the last blocks visited
    if (window_right < 0) return true;   // only the ragged key end: the first block visited
    if (kBlockM != kBlockN) return false;
    const int64_t d = int64_t(diag_offset) + window_right;
    const int64_t r = ((d % kBlockN) + kBlockN) % kBlockN;
    return r == 0 || r == kBlockN - 1;
  }
};

// Which key-block steps of a query tile the forward mainloop applies the
// element mask in (a compile-time policy: the steps without it hold no mask
// code). kFirst: the first step only, for calls where BlockMask::
// masks_first_step_only holds; kAny: any step, by tile_needs_mask.
enum class MaskSteps : int { kAny = 0, kFirst };

// The query block, head and batch a CTA of a one-dimensional query-block grid
// owns (the forward and the deterministic dQ kernel). blockIdx.x runs over
// query blocks fastest, so the CTAs of one head are co-resident and share K/V
// in L2, and the heaviest query blocks (last rows: the most keys under a causal
// mask) start first. In a varlen batch the grid is sized by max_seqlen_q: a
// CTA whose block starts past its sequence's end has rows <= 0 and exits.
// n / d for a divisor fixed at run time and 0 <= n < 2^31 by one multiply-high
// (Granlund and Montgomery, as cutlass::FastDivmod): d >= 1, l = ceil(log2 d),
// m = floor(2^32 (2^l - d) / d) + 1, n / d = (umulhi(m, n) + n) >> l.
struct FastDivmod {
  uint32_t mul = 1, shift = 0;
  FastDivmod() = default;
  __host__ __device__ __forceinline__ explicit FastDivmod(int d) {
    uint32_t l = 0;
    while ((uint64_t(1) << l) < uint64_t(d)) ++l;
    shift = l;
    mul = static_cast<uint32_t>(((uint64_t(1) << 32) * ((uint64_t(1) << l) - uint64_t(d))) / uint64_t(d) + 1);
  }
  __host__ __device__ __forceinline__ int div(int n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(mul, static_cast<uint32_t>(n));
#else
    const uint32_t hi = static_cast<uint32_t>((uint64_t(mul) * uint32_t(n)) >> 32);
#endif
    return static_cast<int>((hi + static_cast<uint32_t>(n)) >> shift);  // hi < n: no overflow below 2^31
  }
};

template <int kBlockM>
struct QueryBlockOfCta {
  int h, b, h_kv;  // query head, batch, key/value head
  int m0, rows;    // first row, valid rows (<= 0: nothing to do)
  SeqInfo seq;     // the sequence's rows and lengths

  // varlen == p.is_varlen(), a constant in kernels compiled once per batch kind (SeqInfo).
  __device__ __forceinline__ QueryBlockOfCta(const AttnFwdParams& p, bool varlen)
      : QueryBlockOfCta(p, static_cast<int>(blockIdx.x / ceil_div(p.seqlen_q, kBlockM)), varlen) {}

 private:
  __device__ __forceinline__ QueryBlockOfCta(const AttnFwdParams& p, int bh, bool varlen)
      : seq(p, bh / p.heads_q, varlen) {
    const int num_m_blocks = ceil_div(p.seqlen_q, kBlockM);
    const int m_block = num_m_blocks - 1 - static_cast<int>(blockIdx.x % num_m_blocks);
    h = bh % p.heads_q;
    b = bh / p.heads_q;
    h_kv = h / p.heads_ratio();
    m0 = m_block * kBlockM;
    rows = min(kBlockM, seq.seqlen_q - m0);
  }
};

// The query side of a backward CTA that owns one key block [n0, n0 + keys):
// the query blocks [m_min, m_max) that see some of its keys, for every query
// head of its GQA group, as steps 0 .. iters - 1. Step `it` visits query head
// hq and rows [m0, m0 + kBlockM). `rotation` starts the sweep `rotation` steps
// in (the key blocks of a head then add their dQ to different rows at a time).
template <int kBlockM>
struct QuerySweep {
  int m_min, m_blocks, iters, hq0, rotation;  // rotation < iters
  FastDivmod by_m_blocks;

  __device__ __forceinline__ QuerySweep(const BlockMask& mask, int n0, int keys, int h_kv, int ratio, int rotation_)
      : hq0(h_kv * ratio) {
    int m_max;
    mask.query_block_range<kBlockM>(n0, keys, m_min, m_max);
    m_blocks = m_max - m_min;
    iters = m_blocks * ratio;
    rotation = iters > 0 ? rotation_ % iters : 0;
    by_m_blocks = FastDivmod(m_blocks > 0 ? m_blocks : 1);
  }

  // The step's place in the unrotated order (head-major, then query block), for 0 <= it < iters.
  __device__ __forceinline__ int order_index(int it) const {
    const int j = it + rotation;
    return j >= iters ? j - iters : j;
  }

  // (Every step of every backward kernel decodes its query block here: a
  // multiply-high instead of the two integer divisions by a runtime divisor,
  // ~20 instructions each, that it cost before.)
  __device__ __forceinline__ void step(int it, int& hq, int& m0) const {
    const int j = order_index(it);
    const int head = by_m_blocks.div(j);
    hq = hq0 + head;
    m0 = (m_min + j - head * m_blocks) * kBlockM;
  }
};

// The output of a query block none of whose rows sees a key: zero rows and
// lse = -inf (MaskParams' rule), written by `nthreads` threads numbered `tid`.
// Shared by the forward kernels, which skip such a block entirely.
template <typename T>
__device__ __forceinline__ void store_unseeing_query_block(const AttnFwdParams& p, const SeqInfo& seq, int b, int h,
                                                           int m0, int rows, int tid, int nthreads) {
  T* gO = static_cast<T*>(p.o_ptr) + seq.q_offset(p.o_batch_stride, p.o_row_stride, b) + h * p.o_head_stride +
          m0 * p.o_row_stride;
  float* gLse = static_cast<float*>(p.lse_ptr) + seq.rowvec_offset(p, b, h) + m0;
  const int chunks = p.head_dim / 8;
  for (int i = tid; i < rows * chunks; i += nthreads) {
    const int r = i / chunks, c = (i % chunks) * 8;
    *reinterpret_cast<uint4*>(gO + r * p.o_row_stride + c) = make_uint4(0, 0, 0, 0);
  }
  for (int r = tid; r < rows; r += nthreads) gLse[r] = -INFINITY;
}

// The element masks of a warp's accumulator tile. Key j is visible from query
// row i iff band_lo <= j - i <= band_hi and j < seqlen_k (key_lo / key_hi
// without their clamps, which only make empty ranges empty). An element's
// j - i is a per-row base plus its column offset c = 8 ni + e, a compile-time
// constant, so each row gets the range [c_lo, c_hi] of visible offsets once
// and each element costs two compares with immediates and a select (the
// per-element key_lo / key_hi with their clamps and 64-bit arithmetic made a
// masked backward step 2.9-3.4x an unmasked one).
__host__ __device__ __forceinline__ int64_t band_lo(const BlockMask& m) {
  return m.window_left < 0 ? -(int64_t(1) << 40) : int64_t(m.diag_offset) - m.window_left;
}
__host__ __device__ __forceinline__ int64_t band_hi(const BlockMask& m) {
  return m.window_right < 0 ? (int64_t(1) << 40) : int64_t(m.diag_offset) + m.window_right;
}

// Sets to `fill` the entries of invisible keys in a warp's accumulator tile
// (-inf for scores, 0 for probabilities). Rows are queries r0 + mi*16 + g (+8);
// columns are keys c0 + ni*8 + 2t (+1).
template <int kMT, int kNT>
__host__ __device__ __forceinline__ void apply_mask_rows(float (&s)[kMT][kNT][4], const BlockMask& mask, int r0, int c0,
                                                         int lane, float fill = -INFINITY) {
  const int g = lane >> 2, t = lane & 3;
  const int64_t blo = band_lo(mask), bhi = band_hi(mask);
  const int col0 = c0 + 2 * t;  // the key of offset c = 0
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = r0 + mi * 16 + g + 8 * h;
      // Key col0 + c: visible iff blo <= col0 + c - row <= bhi and col0 + c < seqlen_k.
      const int64_t hi = bhi + row - col0, k_end = int64_t(mask.seqlen_k) - 1 - col0;
      const int c_lo = BlockMask::clamp(blo + row - col0, 0, kNT * 8);
      const int c_hi = BlockMask::clamp(hi < k_end ? hi : k_end, -1, kNT * 8);
#pragma unroll
      for (int ni = 0; ni < kNT; ++ni)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = ni * 8 + e;
          if (c < c_lo || c > c_hi) s[mi][ni][2 * h + e] = fill;
        }
    }
}

// The same for a transposed tile: rows are keys, columns are queries.
template <int kMT, int kNT>
__host__ __device__ __forceinline__ void apply_mask_cols(float (&s)[kMT][kNT][4], const BlockMask& mask, int key0,
                                                         int q0, int lane, float fill = -INFINITY) {
  const int g = lane >> 2, t = lane & 3;
  const int64_t blo = band_lo(mask), bhi = band_hi(mask);
  const int qb = q0 + 2 * t;  // the query of offset c = 0
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int key = key0 + mi * 16 + g + 8 * h;
      // Query qb + c sees this key iff blo <= key - qb - c <= bhi (and key < seqlen_k).
      const int c_lo = BlockMask::clamp(key - qb - bhi, 0, kNT * 8);
      const int c_hi = key < mask.seqlen_k ? BlockMask::clamp(key - qb - blo, -1, kNT * 8) : -1;
#pragma unroll
      for (int ni = 0; ni < kNT; ++ni)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = ni * 8 + e;
          if (c < c_lo || c > c_hi) s[mi][ni][2 * h + e] = fill;
        }
    }
}

}  // namespace flashattn
