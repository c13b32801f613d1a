// append_rotary_kernel.h. One CTA per (batch row, token row, head): its
// threads cover head_dim, one element each (a loop for head_dim > the block).
// Token row i of batch row b rotates q row i (i < seqlen_q) and appends new
// row i (i < seqlen_new), both for head h of q / of the cache when h is below
// their head counts; the grid is (batch * max(seqlen_q, seqlen_new),
// max(heads_q, heads_kv)). Each thread computes its own output element from
// its element and its pair's partner (read twice over the pair, from L1), so
// there is no shared memory and no synchronisation.
//
// The rotation is bitwise the CPU's and the Python path's: x1 * c - x2 * s,
// x1 * s + x2 * c in float32, each product and the sum rounded on its own.
// PTX's mul.rn / add.rn / sub.rn with an explicit rounding mode are never
// contracted into an FMA, and as inline PTX they do not get the .ftz that
// --use_fast_math puts on the compiler's own float arithmetic (denormals stay).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "append_rotary_kernel.h"
#include "ptx.cuh"  // to_float / from_float (round to nearest)

namespace flashattn {
namespace {

__device__ __forceinline__ float mul_rn(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float add_rn(float a, float b) {
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float sub_rn(float a, float b) {
  float r;
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// Element j of one head row: rotated by table row pos when j < rotary_dim
// (pos >= 0), else copied.
template <typename T>
__device__ __forceinline__ T rotate_element(const AppendRotaryParams& p, const T* src, int64_t stride, int64_t j,
                                            int64_t pos) {
  if (pos < 0 || j >= p.rotary_dim) return src[j * stride];
  const RotaryPair pair = rotary_pair(p, j);
  const T* cos = static_cast<const T*>(p.cos) + pos * p.cos_row_stride + pair.column * p.cos_col_stride;
  const T* sin = static_cast<const T*>(p.sin) + pos * p.sin_row_stride + pair.column * p.sin_col_stride;
  const float c = to_float(*cos), s = to_float(*sin);
  const float x = to_float(src[j * stride]), y = to_float(src[pair.partner * stride]);
  const float x1 = pair.first ? x : y, x2 = pair.first ? y : x;
  const float r = pair.first ? sub_rn(mul_rn(x1, c), mul_rn(x2, s)) : add_rn(mul_rn(x1, s), mul_rn(x2, c));
  return from_float<T>(r);
}

template <typename T>
__global__ void append_rotary_kernel(const AppendRotaryParams p, int64_t rows) {
  const int64_t t = blockIdx.x, h = blockIdx.y;
  const int64_t b = t / rows, i = t % rows;
  const int64_t s = p.seqlens[b];
  const bool rotary = p.rotary_dim > 0;
  if (p.q != nullptr && i < p.seqlen_q && h < p.heads_q) {
    const T* src = static_cast<const T*>(p.q) + b * p.q_batch_stride + i * p.q_row_stride + h * p.q_head_stride;
    T* dst = static_cast<T*>(p.q_out) + ((b * p.seqlen_q + i) * p.heads_q + h) * p.head_dim;
    const int64_t pos = rotary ? q_rotary_position(p, s, i) : -1;
    for (int64_t j = threadIdx.x; j < p.head_dim; j += blockDim.x)
      dst[j] = rotate_element(p, src, p.q_dim_stride, j, pos);
  }
  if (p.k != nullptr && i < p.seqlen_new && h < p.heads_kv) {
    const int64_t pos = append_position(p, s, i);
    const CacheSlot slot = cache_slot(p, b, pos);
    const int64_t pos_k = rotary ? k_rotary_position(p, pos) : -1;
    const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + i * p.k_row_stride + h * p.k_head_stride;
    const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + i * p.v_row_stride + h * p.v_head_stride;
    T* kc = static_cast<T*>(p.k_cache) + slot.row * p.kc_batch_stride + slot.offset * p.kc_row_stride +
            h * p.kc_head_stride;
    T* vc = static_cast<T*>(p.v_cache) + slot.row * p.vc_batch_stride + slot.offset * p.vc_row_stride +
            h * p.vc_head_stride;
    for (int64_t j = threadIdx.x; j < p.head_dim; j += blockDim.x) {
      kc[j] = rotate_element(p, k, p.k_dim_stride, j, pos_k);
      vc[j] = v[j * p.v_dim_stride];
    }
  }
}

}  // namespace

template <typename T>
cudaError_t launch_append_rotary(const AppendRotaryParams& p, cudaStream_t stream) {
  const int64_t rows = std::max(p.q != nullptr ? p.seqlen_q : 0, p.k != nullptr ? p.seqlen_new : 0);
  const int64_t heads = std::max(p.q != nullptr ? p.heads_q : 0, p.k != nullptr ? p.heads_kv : 0);
  if (p.batch == 0 || rows == 0 || heads == 0 || p.head_dim == 0) return cudaSuccess;
  // A warp multiple covering head_dim (at most 256 = the largest head dim).
  const int threads = static_cast<int>(std::min<int64_t>(256, (p.head_dim + 31) / 32 * 32));
  const dim3 grid(static_cast<unsigned>(p.batch * rows), static_cast<unsigned>(heads));
  append_rotary_kernel<T><<<grid, threads, 0, stream>>>(p, rows);
  return cudaGetLastError();
}

template cudaError_t launch_append_rotary<__half>(const AppendRotaryParams&, cudaStream_t);
template cudaError_t launch_append_rotary<__nv_bfloat16>(const AppendRotaryParams&, cudaStream_t);

}  // namespace flashattn
