#include "tile_ops.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "fast_exp.h"
#include "simd_clones.h"

namespace flashattn {
namespace cpu {
namespace {

// Transposes go through square blocks so that both the rows read and the
// rows written stay in L1.
constexpr int kTransposeBlock = 16;

template <typename acc_t>
inline void fill(acc_t* x, int n, acc_t value) {
  for (int i = 0; i < n; ++i) x[i] = value;
}

}  // namespace

template <typename scalar_t, typename acc_t>
FLASHATTN_SIMD_CLONES void load_tile(const scalar_t* src, int64_t src_ld, int rows, int cols, acc_t* dst,
                                     int64_t dst_ld) {
  for (int r = 0; r < rows; ++r) {
    const scalar_t* s = src + r * src_ld;
    acc_t* d = dst + r * dst_ld;
#pragma omp simd
    for (int c = 0; c < cols; ++c) d[c] = static_cast<acc_t>(s[c]);
  }
}

template <typename scalar_t, typename acc_t>
FLASHATTN_SIMD_CLONES void load_tile_transposed(const scalar_t* src, int64_t src_ld, int rows, int cols, acc_t* dst,
                                                int64_t dst_ld) {
  constexpr int B = kTransposeBlock;
  for (int r0 = 0; r0 < rows; r0 += B) {
    const int r1 = std::min(rows, r0 + B);
    for (int c0 = 0; c0 < cols; c0 += B) {
      const int c1 = std::min(cols, c0 + B);
      if (r1 - r0 == B && c1 - c0 == B) {
        // Full block: convert into a local square, then write it out row by
        // row of the destination; fixed trip counts let the compiler unroll.
        acc_t block[B][B];
        for (int r = 0; r < B; ++r)
          for (int c = 0; c < B; ++c) block[c][r] = static_cast<acc_t>(src[(r0 + r) * src_ld + c0 + c]);
        for (int c = 0; c < B; ++c)
          for (int r = 0; r < B; ++r) dst[(c0 + c) * dst_ld + r0 + r] = block[c][r];
      } else {
        for (int c = c0; c < c1; ++c)
          for (int r = r0; r < r1; ++r) dst[c * dst_ld + r] = static_cast<acc_t>(src[r * src_ld + c]);
      }
    }
  }
}

template <typename acc_t, typename scalar_t>
FLASHATTN_SIMD_CLONES void store_tile(const acc_t* src, int64_t src_ld, int rows, int cols, acc_t scale,
                                      scalar_t* dst, int64_t dst_ld) {
  for (int r = 0; r < rows; ++r) {
    const acc_t* s = src + r * src_ld;
    scalar_t* d = dst + r * dst_ld;
#pragma omp simd
    for (int c = 0; c < cols; ++c) d[c] = static_cast<scalar_t>(scale * s[c]);
  }
}

template <typename acc_t, typename scalar_t>
FLASHATTN_SIMD_CLONES void store_tile_row_scaled(const acc_t* src, int64_t src_ld, int rows, int cols,
                                                 const acc_t* row_scale, scalar_t* dst, int64_t dst_ld) {
  for (int r = 0; r < rows; ++r) {
    const acc_t* s = src + r * src_ld;
    scalar_t* d = dst + r * dst_ld;
    const acc_t scale = row_scale[r];
#pragma omp simd
    for (int c = 0; c < cols; ++c) d[c] = static_cast<scalar_t>(scale * s[c]);
  }
}

template <typename acc_t, typename scalar_t>
FLASHATTN_SIMD_CLONES void store_tile_transposed(const acc_t* src, int64_t src_ld, int rows, int cols, acc_t scale,
                                                 scalar_t* dst, int64_t dst_ld) {
  constexpr int B = kTransposeBlock;
  for (int r0 = 0; r0 < rows; r0 += B) {
    const int r1 = std::min(rows, r0 + B);
    for (int c0 = 0; c0 < cols; c0 += B) {
      const int c1 = std::min(cols, c0 + B);
      for (int r = r0; r < r1; ++r)
        for (int c = c0; c < c1; ++c) dst[r * dst_ld + c] = static_cast<scalar_t>(scale * src[c * src_ld + r]);
    }
  }
}

template <typename scalar_t, typename acc_t>
FLASHATTN_SIMD_CLONES void row_dot(const scalar_t* a, int64_t a_ld, const scalar_t* b, int64_t b_ld, int rows,
                                   int cols, acc_t* out) {
  for (int r = 0; r < rows; ++r) {
    const scalar_t* x = a + r * a_ld;
    const scalar_t* y = b + r * b_ld;
    acc_t sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int c = 0; c < cols; ++c) sum += static_cast<acc_t>(x[c]) * static_cast<acc_t>(y[c]);
    out[r] = sum;
  }
}

template <typename acc_t>
FLASHATTN_SIMD_CLONES void online_softmax_step(acc_t* scores, int64_t ld, int rows, int cols, acc_t scale,
                                               const int* key_lo, const int* key_hi, acc_t* row_max,
                                               acc_t* row_sum, acc_t* o_acc, int64_t o_ld, int head_dim) {
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  for (int r = 0; r < rows; ++r) {
    acc_t* s = scores + r * ld;
    const int lo = key_lo ? key_lo[r] : 0;
    const int hi = key_hi ? key_hi[r] : cols;
    if (lo >= hi) {  // this row sees no key of the tile: P = 0, state unchanged
      fill(s, cols, acc_t(0));
      continue;
    }
    fill(s, lo, acc_t(0));
    fill(s + hi, cols - hi, acc_t(0));

    acc_t tile_max = kNegInf;
#pragma omp simd reduction(max : tile_max)
    for (int c = lo; c < hi; ++c) tile_max = std::max(tile_max, scale * s[c]);
    const acc_t m_old = row_max[r];
    const acc_t m_new = std::max(m_old, tile_max);
    if (m_new == kNegInf) {  // only -inf scores so far (infinite inputs): keep the row empty
      fill(s + lo, hi - lo, acc_t(0));
      continue;
    }

    acc_t sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int c = lo; c < hi; ++c) {
      const acc_t p = exp_approx(scale * s[c] - m_new);
      s[c] = p;
      sum += p;
    }
    // exp(-inf - m_new) = 0: the first tile a row sees discards the (zero) state.
    const acc_t alpha = m_old == m_new ? acc_t(1) : std::exp(m_old - m_new);
    row_sum[r] = row_sum[r] * alpha + sum;
    row_max[r] = m_new;
    if (alpha != acc_t(1)) {
      acc_t* o = o_acc + r * o_ld;
#pragma omp simd
      for (int d = 0; d < head_dim; ++d) o[d] *= alpha;
    }
  }
}

template <typename acc_t>
FLASHATTN_SIMD_CLONES void probs_and_dscores_t(acc_t* s_t, acc_t* dp_t, int64_t ld, int keys, int queries,
                                               acc_t scale, const acc_t* neg_lse, const acc_t* dsum,
                                               const int* query_lo, const int* query_hi) {
  for (int j = 0; j < keys; ++j) {
    acc_t* p = s_t + j * ld;
    acc_t* ds = dp_t + j * ld;
    const int lo = query_lo ? std::min(query_lo[j], queries) : 0;
    const int hi = query_hi ? std::max(query_hi[j], lo) : queries;
    fill(p, lo, acc_t(0));
    fill(ds, lo, acc_t(0));
    fill(p + hi, queries - hi, acc_t(0));
    fill(ds + hi, queries - hi, acc_t(0));
#pragma omp simd
    for (int i = lo; i < hi; ++i) {
      // neg_lse = -inf (row without keys) gives exp(-inf) = 0, not a NaN.
      const acc_t prob = exp_approx(scale * p[i] + neg_lse[i]);
      p[i] = prob;
      ds[i] = prob * (ds[i] - dsum[i]);
    }
  }
}

// Instantiations.
#define FLASHATTN_INSTANTIATE_IO(scalar_t, acc_t)                                                          \
  template void load_tile<scalar_t, acc_t>(const scalar_t*, int64_t, int, int, acc_t*, int64_t);          \
  template void load_tile_transposed<scalar_t, acc_t>(const scalar_t*, int64_t, int, int, acc_t*, int64_t); \
  template void store_tile<acc_t, scalar_t>(const acc_t*, int64_t, int, int, acc_t, scalar_t*, int64_t);  \
  template void store_tile_row_scaled<acc_t, scalar_t>(const acc_t*, int64_t, int, int, const acc_t*,     \
                                                       scalar_t*, int64_t);                               \
  template void store_tile_transposed<acc_t, scalar_t>(const acc_t*, int64_t, int, int, acc_t, scalar_t*, \
                                                       int64_t);                                          \
  template void row_dot<scalar_t, acc_t>(const scalar_t*, int64_t, const scalar_t*, int64_t, int, int, acc_t*);

FLASHATTN_INSTANTIATE_IO(float, float)
FLASHATTN_INSTANTIATE_IO(c10::BFloat16, float)
FLASHATTN_INSTANTIATE_IO(c10::Half, float)
FLASHATTN_INSTANTIATE_IO(double, double)
#undef FLASHATTN_INSTANTIATE_IO

#define FLASHATTN_INSTANTIATE_MATH(acc_t)                                                                      \
  template void online_softmax_step<acc_t>(acc_t*, int64_t, int, int, acc_t, const int*, const int*, acc_t*, \
                                           acc_t*, acc_t*, int64_t, int);                                     \
  template void probs_and_dscores_t<acc_t>(acc_t*, acc_t*, int64_t, int, int, acc_t, const acc_t*,            \
                                           const acc_t*, const int*, const int*);

FLASHATTN_INSTANTIATE_MATH(float)
FLASHATTN_INSTANTIATE_MATH(double)
#undef FLASHATTN_INSTANTIATE_MATH

}  // namespace cpu
}  // namespace flashattn
