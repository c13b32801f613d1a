#include "tile_gemm.h"

#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstring>

#include "simd_clones.h"

namespace flashattn {
namespace cpu {

void gemm_nn(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
             int64_t ldc, bool accumulate) {
  // brgemm computes exactly this row-major product. On x86 with AVX2 or more
  // it runs a oneDNN micro-kernel JIT-compiled for (m, n, k, lda, ldb, ldc)
  // and cached per thread (measured ~2.5x MKL's sgemm on 64..256-sized tiles
  // on an AVX-512 core); elsewhere it falls back to torch's BLAS gemm.
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, accumulate, a, b, c, /*is_vnni=*/false);
}

namespace {

// C[m x n] (+)= A[m x k] B[k x n] for double, in blocks of kRows x kCols
// outputs held in registers (8 AVX-512 vectors) while the k loop streams one
// row of B and one column of A through them. GCC vector extensions keep the
// block in registers in every clone; ragged edges take a scalar loop.
constexpr int kRows = 4;
constexpr int kCols = 16;

#if FLASHATTN_VECTOR_EXT
typedef double Vec8d __attribute__((vector_size(64)));

FLASHATTN_INLINE Vec8d load8(const double* p) {
  Vec8d v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

FLASHATTN_INLINE void store8(double* p, Vec8d v) { std::memcpy(p, &v, sizeof(v)); }

FLASHATTN_INLINE void gemm_block_full(int64_t k, const double* a, int64_t lda, const double* b, int64_t ldb, double* c,
                                      int64_t ldc, bool accumulate) {
  Vec8d acc[kRows][2];
  for (int r = 0; r < kRows; ++r) {
    acc[r][0] = accumulate ? load8(c + r * ldc) : Vec8d{};
    acc[r][1] = accumulate ? load8(c + r * ldc + 8) : Vec8d{};
  }
  for (int64_t p = 0; p < k; ++p) {
    const Vec8d b0 = load8(b + p * ldb), b1 = load8(b + p * ldb + 8);
    for (int r = 0; r < kRows; ++r) {
      const double a_rp = a[r * lda + p];
      acc[r][0] += a_rp * b0;
      acc[r][1] += a_rp * b1;
    }
  }
  for (int r = 0; r < kRows; ++r) {
    store8(c + r * ldc, acc[r][0]);
    store8(c + r * ldc + 8, acc[r][1]);
  }
}

#endif  // FLASHATTN_VECTOR_EXT

FLASHATTN_INLINE void gemm_block_edge(int64_t rows, int64_t cols, int64_t k, const double* a, int64_t lda,
                                      const double* b, int64_t ldb, double* c, int64_t ldc, bool accumulate) {
  for (int64_t r = 0; r < rows; ++r) {
    double* c_row = c + r * ldc;
    if (!accumulate)
      for (int64_t j = 0; j < cols; ++j) c_row[j] = 0;
    for (int64_t p = 0; p < k; ++p) {
      const double a_rp = a[r * lda + p];
      const double* b_row = b + p * ldb;
      for (int64_t j = 0; j < cols; ++j) c_row[j] += a_rp * b_row[j];
    }
  }
}

FLASHATTN_SIMD_CLONES
void gemm_nn_double(int64_t m, int64_t n, int64_t k, const double* a, int64_t lda, const double* b, int64_t ldb,
                    double* c, int64_t ldc, bool accumulate) {
#if FLASHATTN_VECTOR_EXT
  const int64_t m_full = m / kRows * kRows, n_full = n / kCols * kCols;
  for (int64_t i = 0; i < m_full; i += kRows) {
    for (int64_t j = 0; j < n_full; j += kCols)
      gemm_block_full(k, a + i * lda, lda, b + j, ldb, c + i * ldc + j, ldc, accumulate);
    if (n_full < n)
      gemm_block_edge(kRows, n - n_full, k, a + i * lda, lda, b + n_full, ldb, c + i * ldc + n_full, ldc, accumulate);
  }
  if (m_full < m) gemm_block_edge(m - m_full, n, k, a + m_full * lda, lda, b, ldb, c + m_full * ldc, ldc, accumulate);
#else
  gemm_block_edge(m, n, k, a, lda, b, ldb, c, ldc, accumulate);
#endif
}

}  // namespace

void gemm_nn(int64_t m, int64_t n, int64_t k, const double* a, int64_t lda, const double* b, int64_t ldb, double* c,
             int64_t ldc, bool accumulate) {
  gemm_nn_double(m, n, k, a, lda, b, ldb, c, ldc, accumulate);
}

}  // namespace cpu
}  // namespace flashattn
