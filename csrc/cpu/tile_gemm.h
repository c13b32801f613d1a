// Row-major tile products for the CPU kernels:
//
//   C[m x n] = A[m x k] . B[k x n]          (accumulate = false)
//   C[m x n] += A[m x k] . B[k x n]         (accumulate = true)
//
// Every matrix has a unit column stride and a leading dimension (row stride,
// in elements) at least its width. Only this one product form exists: the
// kernels lay their tiles out (transposing while they load) so that each
// product of the algorithm is an "A times B" with no transpose flag.
//
// float goes to oneDNN's brgemm micro-kernel through at::native::cpublas
// (the cpublas::gemm overloads are not exported from libtorch, brgemm is);
// double goes to a small register-blocked kernel of our own.
#pragma once

#include <cstdint>

namespace flashattn {
namespace cpu {

void gemm_nn(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
             int64_t ldc, bool accumulate);

void gemm_nn(int64_t m, int64_t n, int64_t k, const double* a, int64_t lda, const double* b, int64_t ldb, double* c,
             int64_t ldc, bool accumulate);

}  // namespace cpu
}  // namespace flashattn
