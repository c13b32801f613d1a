// mask_summary.h: one CTA of 64 threads per summary entry, a thread per query
// row of the entry's band reading its (up to) 16 keys; the CTA ANDs the rows'
// verdicts. A read of the whole mask, coalesced along the keys when they are
// contiguous: for a (4, 1, 4096, 4096) bf16 mask 128 MiB, tens of microseconds
// on an H200, against a millisecond for the attention itself.
#include "mask_summary.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace flashattn {
namespace {

template <BiasKind kKind>
__device__ __forceinline__ void classify(const void* base, int64_t off, bool& identity, bool& hidden) {
  if constexpr (kKind == BiasKind::kBool) {
    const bool v = static_cast<const unsigned char*>(base)[off] != 0;
    identity &= v;
    hidden &= !v;
  } else {
    float v;
    if constexpr (kKind == BiasKind::kFloat32) {
      v = static_cast<const float*>(base)[off];
    } else if constexpr (kKind == BiasKind::kBFloat16) {
      v = __bfloat162float(static_cast<const __nv_bfloat16*>(base)[off]);
    } else {
      v = __half2float(static_cast<const __half*>(base)[off]);
    }
    identity &= v == 0.f;
    hidden &= v == -INFINITY;
  }
}

template <BiasKind kKind>
__global__ void __launch_bounds__(kMaskSummaryRows) mask_summary_kernel(const AttnBias bias, MaskSummaryShape shape,
                                                                         uint8_t* out) {
  const int64_t entry = blockIdx.x;  // (plane, band, column), column fastest
  const int64_t col = entry % shape.cols, band = (entry / shape.cols) % shape.bands;
  const int64_t plane = entry / (shape.cols * shape.bands);
  const int64_t b = plane / shape.heads, h = plane % shape.heads;
  const int64_t row = band * kMaskSummaryRows + threadIdx.x;
  bool identity = true, hidden = true;
  if (row < shape.rows_q) {
    const char* base = static_cast<const char*>(bias.ptr);
    const int64_t elem = kKind == BiasKind::kBool ? 1 : (kKind == BiasKind::kFloat32 ? 4 : 2);
    base += (b * bias.batch_stride + h * bias.head_stride + row * bias.row_stride) * elem;
    const int64_t c_end = min(shape.cols_k, (col + 1) * kMaskSummaryCols);
    for (int64_t c = col * kMaskSummaryCols; c < c_end; ++c) classify<kKind>(base, c * bias.col_stride, identity, hidden);
  }
  identity = __syncthreads_and(identity);
  hidden = __syncthreads_and(hidden);
  if (threadIdx.x == 0) out[entry] = identity ? kMaskIdentity : (hidden ? kMaskHidden : kMaskMixed);
}

}  // namespace

MaskSummaryShape mask_summary_shape(const AttnBias& bias, int64_t batch, int64_t heads, int64_t seqlen_q,
                                    int64_t seqlen_k) {
  MaskSummaryShape s;
  s.batch = bias.batch_stride ? batch : 1;
  s.heads = bias.head_stride ? heads : 1;
  s.rows_q = bias.row_stride ? seqlen_q : 1;
  s.cols_k = bias.col_stride ? seqlen_k : 1;
  s.bands = (s.rows_q + kMaskSummaryRows - 1) / kMaskSummaryRows;
  s.cols = (s.cols_k + kMaskSummaryCols - 1) / kMaskSummaryCols;
  return s;
}

cudaError_t launch_mask_summary(AttnBias& bias, const MaskSummaryShape& shape, uint8_t* out, cudaStream_t stream) {
  const int64_t entries = shape.bytes();
  if (entries == 0) return cudaSuccess;
  if (entries > INT32_MAX) return cudaErrorInvalidValue;  // a grid's x extent (the binding checks first)
  const unsigned grid = static_cast<unsigned>(entries);
  switch (bias.kind) {
    case BiasKind::kBool: mask_summary_kernel<BiasKind::kBool><<<grid, kMaskSummaryRows, 0, stream>>>(bias, shape, out); break;
    case BiasKind::kFloat16:
      mask_summary_kernel<BiasKind::kFloat16><<<grid, kMaskSummaryRows, 0, stream>>>(bias, shape, out);
      break;
    case BiasKind::kBFloat16:
      mask_summary_kernel<BiasKind::kBFloat16><<<grid, kMaskSummaryRows, 0, stream>>>(bias, shape, out);
      break;
    default: mask_summary_kernel<BiasKind::kFloat32><<<grid, kMaskSummaryRows, 0, stream>>>(bias, shape, out); break;
  }
  bias.summary = out;
  bias.summary_col_step = bias.col_stride ? 1 : 0;
  bias.summary_band_stride = bias.row_stride ? static_cast<int>(shape.cols) : 0;
  bias.summary_head_stride = bias.head_stride ? shape.bands * shape.cols : 0;
  bias.summary_batch_stride = bias.batch_stride ? shape.heads * shape.bands * shape.cols : 0;
  return cudaGetLastError();
}

}  // namespace flashattn
