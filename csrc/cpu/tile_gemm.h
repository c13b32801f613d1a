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
//
// bfloat16 / float16 products with float32 accumulation, on the matrix units
// (AMX) where the CPU has them, and bfloat16 on AMD's AVX512-BF16 (whose dot
// products are twice as fast as float32 FMAs): oneDNN's brgemm through the same
// at::native::cpublas entry point (torch's own CPU flash attention calls it
// likewise). Its B operand is in "pairs" panels: B[k x n] (k even) cut into
// panels of w columns (w = lowp_panel_width(n)), each panel k/2 rows of w
// pairs, element (p, j) at
//   b[(j / w) * (k * w) + (p / 2) * 2 * w + (j % w) * 2 + p % 2]
// (oneDNN's "pack32", the layout of AMX's and AVX512-BF16's dot products:
// two consecutive k of one column side by side). A and C are row-major as
// above. Panels of at most 64 columns, as torch calls it (the widths
// oneDNN's own packing routine supports).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <string>

#include "../flash_params.h"

namespace flashattn {
namespace cpu {

void gemm_nn(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
             int64_t ldc, bool accumulate, bool full_tile);

void gemm_nn(int64_t m, int64_t n, int64_t k, const double* a, int64_t lda, const double* b, int64_t ldb, double* c,
             int64_t ldc, bool accumulate, bool full_tile);

// The panel width of a pairs operand n columns wide: the largest of 64, 48,
// 32, 16 that divides n; 0 when none does (no low-precision product then).
inline int lowp_panel_width(int64_t n) {
  for (int w : {64, 48, 32, 16})
    if (n % w == 0) return w;
  return 0;
}

// Whether the bfloat16 (float16) tile products of this call run on brgemm:
// FLASHATTN_CPU_LOWP_GEMM (cpu_knobs.h) and the machine. auto: where oneDNN
// packs for the dtype (AMX for bfloat16, AMX-FP16 for float16) and bfloat16
// on AMD CPUs with AVX512-BF16 (tile_gemm.cpp: measured there); brgemm
// elsewhere: wherever oneDNN runs the dtype's brgemm with pairs panels. A
// probe product (once per process and dtype, its result checked exactly)
// confirms the layout before the first use; and torch's MKLDNN switch
// (torch.backends.mkldnn.enabled) is asked at every call, as torch does.
bool lowp_gemm_enabled(ScalarKind dtype);

// How the machine and oneDNN stand for one dtype, for cpu_runtime_info:
// "brgemm" (auto takes it), "brgemm-available" (only when forced: no matrix
// units), "unavailable".
std::string lowp_gemm_status(ScalarKind dtype);

// C[m x n] (+)= A[m x k] . B[k x n], B in pairs panels (k even, n a multiple
// of lowp_panel_width(n) > 0), C float32 with leading dimension ldc.
void gemm_nn_lowp(int64_t m, int64_t n, int64_t k, const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b,
                  float* c, int64_t ldc, bool accumulate);
void gemm_nn_lowp(int64_t m, int64_t n, int64_t k, const c10::Half* a, int64_t lda, const c10::Half* b, float* c,
                  int64_t ldc, bool accumulate);

// Ends a worker's low-precision products: frees the matrix units' state
// (AMX tiles) that brgemm configured on this thread.
void lowp_gemm_release();

}  // namespace cpu
}  // namespace flashattn
