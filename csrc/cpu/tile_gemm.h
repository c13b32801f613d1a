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
// Two implementations:
//  - oneDNN's brgemm micro-kernel through at::native::cpublas (the
//    cpublas::gemm overloads are not exported from libtorch, brgemm is): the
//    fastest for float (~2.5x MKL's sgemm on these sizes on an AVX-512 core),
//    but JIT-compiled per (m, n, k, lda, ldb, ldc) into a per-thread cache
//    that is never emptied. Calls with full_tile = true use it: the few
//    shapes of full tiles, repeated every call.
//  - a register-blocked kernel of our own (GCC vector extensions) for the
//    ragged edge tiles, whose sizes vary with the sequence lengths (each one
//    would leave another compiled kernel behind), and for double always.
#pragma once

#include <cstdint>

namespace flashattn {
namespace cpu {

void gemm_nn(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
             int64_t ldc, bool accumulate, bool full_tile);

void gemm_nn(int64_t m, int64_t n, int64_t k, const double* a, int64_t lda, const double* b, int64_t ldb, double* c,
             int64_t ldc, bool accumulate, bool full_tile);

}  // namespace cpu
}  // namespace flashattn
