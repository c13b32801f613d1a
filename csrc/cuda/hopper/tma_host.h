// Host side of the TMA kernels: building the tensor maps (the descriptors a
// kernel's cp.async.bulk.tensor instructions name) for one call's tensors.
//
// cuTensorMapEncodeTiled is a driver API function; it is looked up once
// through the runtime (no link against libcuda) and only encodes a
// 128-byte structure on the host: no device work, a few hundred nanoseconds.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace flashattn {

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// Describes a (batch, seqlen, heads, head_dim) tensor of 16-bit elements with
// unit head-dim stride (strides in elements) as the 4-D TMA tensor
// (head_dim, heads, seqlen, batch), read and written in boxes of 64 columns
// x box_rows rows with the 128-byte swizzle of SmemTile's panels. Returns
// false when TMA cannot describe the tensor (a stride that is zero or not a
// multiple of 16 bytes, an address not 16-byte aligned); the caller then uses
// a kernel without TMA.
inline bool make_tensor_map_bshd(CUtensorMap* map, const void* ptr, bool bf16, int batch, int seqlen, int heads,
                                 int head_dim, int64_t batch_stride, int64_t row_stride, int64_t head_stride,
                                 int box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr || reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return false;
  const int64_t sizes[3] = {heads, seqlen, batch};
  const int64_t strides[3] = {head_stride, row_stride, batch_stride};
  cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(heads), cuuint64_t(seqlen), cuuint64_t(batch)};
  cuuint64_t byte_strides[3];
  for (int i = 0; i < 3; ++i) {
    // A dimension of size 1 is only ever read at coordinate 0: any legal stride does.
    const int64_t bytes = sizes[i] == 1 ? 16 : strides[i] * 2;
    if (bytes <= 0 || bytes % 16 != 0 || bytes >= (int64_t(1) << 40)) return false;
    byte_strides[i] = cuuint64_t(bytes);
  }
  cuuint32_t box[4] = {64, 1, cuuint32_t(box_rows), 1};
  cuuint32_t element_strides[4] = {1, 1, 1, 1};
  return encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                const_cast<void*>(ptr), dims, byte_strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace flashattn
