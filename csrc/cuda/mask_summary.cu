// mask_summary.h. A CTA of 256 threads makes 64 entries of one band: thread
// (column c, row group r) reads 16 rows x the entry's 16 keys, consecutive
// threads consecutive 16-key chunks of a row (coalesced when the keys are
// contiguous), and the four row groups AND their verdicts in shared memory.
// One read of the mask: for a (4, 1, 4096, 4096) bool mask 64 MiB, a few tens
// of microseconds on an H200, against a millisecond or more for the attention.
// Where a row's 16 keys are contiguous and 16-byte aligned (kVec: the mask's
// keys dense, its base and row stride aligned, checked by the launcher) a
// thread reads them with 16-byte loads (1, 2 or 4 of them); one load per
// element issued 16x the instructions, which bound the kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "mask_summary.h"

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

constexpr int kEntriesPerCta = 64, kRowGroups = 4, kRowsPerGroup = kMaskSummaryRows / kRowGroups;

// The 16 contiguous elements at p (16-byte aligned), classified.
template <BiasKind kKind>
__device__ __forceinline__ void classify_vec16(const char* p, int valid, bool& identity, bool& hidden) {
  constexpr int kBytes = 16 * bias_element_bytes(kKind), kWords = kBytes / 16;
  uint4 w[kWords];
#pragma unroll
  for (int i = 0; i < kWords; ++i) w[i] = __ldg(reinterpret_cast<const uint4*>(p) + i);
  const auto* e = reinterpret_cast<const char*>(w);
#pragma unroll
  for (int c = 0; c < 16; ++c)
    if (c < valid) classify<kKind>(e, c, identity, hidden);
}

template <BiasKind kKind, bool kVec>
__global__ void __launch_bounds__(kEntriesPerCta* kRowGroups)
    mask_summary_kernel(const AttnBias bias, MaskSummaryShape shape, int64_t chunks, uint8_t* out) {
  __shared__ uint8_t verdict[kRowGroups][kEntriesPerCta];
  const int tc = threadIdx.x % kEntriesPerCta, tr = threadIdx.x / kEntriesPerCta;
  const int64_t chunk = blockIdx.x % chunks, band = (blockIdx.x / chunks) % shape.bands;
  const int64_t plane = blockIdx.x / (chunks * shape.bands);
  const int64_t b = plane / shape.heads, h = plane % shape.heads;
  const int64_t col = chunk * kEntriesPerCta + tc;
  bool identity = true, hidden = true, seen = false;  // seen: the group had a row of the mask
  if (col < shape.cols) {
    constexpr int64_t elem = bias_element_bytes(kKind);
    const char* base = bias.plane(static_cast<int>(b), static_cast<int>(h));
    const int64_t c_first = col * kMaskSummaryCols;
    for (int i = 0; i < kRowsPerGroup; ++i) {
      const int64_t row = band * kMaskSummaryRows + tr * kRowsPerGroup + i;
      if (row >= shape.rows_q) break;
      seen = true;
      const char* row_base = base + row * bias.row_stride * elem;
      if constexpr (kVec) {
        classify_vec16<kKind>(row_base + c_first * elem, static_cast<int>(shape.cols_k - c_first), identity, hidden);
      } else {
#pragma unroll
        for (int c = 0; c < kMaskSummaryCols; ++c)  // unrolled with a guard: the row's loads in flight together
          if (c_first + c < shape.cols_k) classify<kKind>(row_base, (c_first + c) * bias.col_stride, identity, hidden);
      }
    }
  }
  constexpr uint8_t kNoRows = 0xff;  // a group past the mask's last row: no say
  verdict[tr][tc] = !seen ? kNoRows : (identity ? kMaskIdentity : (hidden ? kMaskHidden : kMaskMixed));
  __syncthreads();
  if (tr == 0 && col < shape.cols) {
    uint8_t v = verdict[0][tc];  // group 0 always has a row
#pragma unroll
    for (int g = 1; g < kRowGroups; ++g) {
      const uint8_t w = verdict[g][tc];
      v = w == kNoRows || w == v ? v : uint8_t(kMaskMixed);
    }
    out[(plane * shape.bands + band) * shape.cols + col] = v;
  }
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
  const int64_t chunks = (shape.cols + kEntriesPerCta - 1) / kEntriesPerCta;
  const int64_t ctas = shape.batch * shape.heads * shape.bands * chunks;
  if (ctas > INT32_MAX) return cudaErrorInvalidValue;  // a grid's x extent (the binding checks first)
  const unsigned grid = static_cast<unsigned>(ctas);
  constexpr int kThreads = kEntriesPerCta * kRowGroups;
  // 16-byte loads: dense keys in whole 16-key chunks (no chunk reads past a
  // row's last key), the base and every plane and row 16-byte aligned.
  const int64_t elem = bias_element_bytes(bias.kind);
  const bool vec = bias.col_stride == 1 && shape.cols_k % kMaskSummaryCols == 0 &&
                   reinterpret_cast<uintptr_t>(bias.ptr) % 16 == 0 && (bias.row_stride * elem) % 16 == 0 &&
                   (bias.batch_stride * elem) % 16 == 0 && (bias.head_stride * elem) % 16 == 0;
  auto launch = [&](auto kind) {
    constexpr BiasKind kKind = decltype(kind)::value;
    if (vec) {
      mask_summary_kernel<kKind, true><<<grid, kThreads, 0, stream>>>(bias, shape, chunks, out);
    } else {
      mask_summary_kernel<kKind, false><<<grid, kThreads, 0, stream>>>(bias, shape, chunks, out);
    }
  };
  switch (bias.kind) {
    case BiasKind::kBool: launch(std::integral_constant<BiasKind, BiasKind::kBool>{}); break;
    case BiasKind::kFloat16: launch(std::integral_constant<BiasKind, BiasKind::kFloat16>{}); break;
    case BiasKind::kBFloat16: launch(std::integral_constant<BiasKind, BiasKind::kBFloat16>{}); break;
    default: launch(std::integral_constant<BiasKind, BiasKind::kFloat32>{}); break;
  }
  bias.summary = out;
  bias.summary_col_step = bias.col_stride ? 1 : 0;
  bias.summary_band_stride = bias.row_stride ? static_cast<int>(shape.cols) : 0;
  bias.summary_head_stride = bias.head_stride ? shape.bands * shape.cols : 0;
  bias.summary_batch_stride = bias.batch_stride ? shape.heads * shape.bands * shape.cols : 0;
  return cudaGetLastError();
}

}  // namespace flashattn
