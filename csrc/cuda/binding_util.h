// Host helpers of the CUDA bindings: what the CUDA backend accepts, the
// device check, the compiled head dims and the (dtype, head dim) dispatch, the
// kernels' 16-byte layout requirement, used by attention_cuda.cpp (fwd, bwd and
// their varlen forms) and kvcache_cuda.cpp (fwd_kvcache).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <utility>

#include "../attention_api.h"

namespace flashattn {

inline const BackendSpec kCudaSpec{
    "CUDA",
    {at::kHalf, at::kBFloat16},
    "; cast float32 inputs to bfloat16 or float16 (flashattn_ext.scaled_dot_product_attention falls back to "
    "torch for float32 on CUDA)"};

inline void check_device(const at::Tensor& q) {
  const auto* prop = at::cuda::getDeviceProperties(q.device().index());
  TORCH_CHECK(prop->major >= 8,
              "flashattn_ext: the CUDA kernels need compute capability 8.0 or newer (mma.sync bf16); ", "device ",
              q.device(), " is ", prop->major, ".", prop->minor);
}

// The head dims of the kernels compiled into this build, ascending
// (setup.py: FLASHATTN_HDIMS, from csrc/cuda/generate_instantiations.py;
// FLASHATTN_HEAD_DIMS is the same list as a string, for the messages).
#ifndef FLASHATTN_HDIMS
#define FLASHATTN_HDIMS
#endif
#ifndef FLASHATTN_HEAD_DIMS
#define FLASHATTN_HEAD_DIMS ""
#endif
template <int... kDims>
struct HeadDimList {};
using CompiledHeadDims = HeadDimList<FLASHATTN_HDIMS>;

template <int... kDims>
int smallest_at_least(HeadDimList<kDims...>, int64_t head_dim) {
  int found = 0;
  ((found == 0 && kDims >= head_dim ? (found = kDims) : 0), ...);
  return found;
}

// A switch of the environment ("1"), read on every call: the timing switches
// (FLASHATTN_DISABLE_TMA, FLASHATTN_DISABLE_SM90, FLASHATTN_DISABLE_PDL, ...).
inline bool env_flag(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && value[0] == '1' && value[1] == '\0';
}

// Compute capability x 10 of q's device, which picks architecture-specific
// kernels. FLASHATTN_DISABLE_SM90=1 (read on every call) reports an sm90
// device as 80, so that the mma.sync kernels can be timed against the wgmma ones.
inline int device_arch(const at::Tensor& q) {
  const auto* prop = at::cuda::getDeviceProperties(q.device().index());
  const int arch = prop->major * 10 + prop->minor;
  return (arch == 90 && env_flag("FLASHATTN_DISABLE_SM90")) ? 80 : arch;
}

// Whether kernels that support programmatic dependent launch get it
// (pdl_launch.h): sm90+ devices as device_arch reports them (the grid
// dependency controls need sm90), unless FLASHATTN_DISABLE_PDL=1 (read on every
// call), which keeps the plain launch so that both can be timed in one build.
inline bool pdl_enabled(const at::Tensor& q) { return device_arch(q) >= 90 && !env_flag("FLASHATTN_DISABLE_PDL"); }

// The zeroed int32 with which the CTAs of Hopper's persistent forward take
// their tiles in the dynamic order (AttnFwdParams::tile_counter,
// cuda/hopper/tile_scheduler.cuh): one a call, from the caching allocator,
// zeroed on the current stream (a 4-byte memset, no synchronisation; a graph
// capture records it as a memset node). The caller keeps the tensor alive
// until the kernel is queued.
inline at::Tensor zeroed_tile_counter(const at::Tensor& q) {
  at::Tensor counter = at::empty({1}, q.options().dtype(at::kInt));
  C10_CUDA_CHECK(cudaMemsetAsync(counter.data_ptr(), 0, sizeof(int), at::cuda::getCurrentCUDAStream().stream()));
  return counter;
}

// ... for a forward call that runs on the TMA forward (an sm90 device, TMA
// allowed) and whose tiles differ in weight; reads device_arch and allow_tma.
inline at::Tensor add_tile_counter(AttnFwdParams& params, const at::Tensor& q) {
  if (params.device_arch != 90 || !params.allow_tma || !params.tiles_differ()) return {};
  at::Tensor counter = zeroed_tile_counter(q);
  params.tile_counter = counter.data_ptr<int>();
  return counter;
}

// The smallest compiled kernel head dim that holds head_dim (the kernels
// zero-fill the columns past head_dim).
inline int kernel_head_dim(int64_t head_dim) {
  const int found = smallest_at_least(CompiledHeadDims{}, head_dim);
  TORCH_CHECK_VALUE(found != 0, "flashattn_ext: no CUDA kernel for head_dim ", head_dim,
                    " in this build (compiled head dims: " FLASHATTN_HEAD_DIMS
                    "); rebuild with FLASHATTN_HEAD_DIMS including a head dim >= ",
                    head_dim);
  return found;
}

// Calls f(std::integral_constant<int, D>{}) for the compiled kernel head dim D
// (FA2's static_switch idea: a run-time value becomes a template argument).
template <int... kDims, typename F>
cudaError_t with_head_dim_of(HeadDimList<kDims...>, int kernel_dim, F&& f) {
  cudaError_t err = cudaErrorInvalidValue;
  ((kernel_dim == kDims ? (err = f(std::integral_constant<int, kDims>{}), 0) : 0), ...);
  return err;
}

template <typename F>
cudaError_t with_kernel_head_dim(int kernel_dim, F&& f) {
  return with_head_dim_of(CompiledHeadDims{}, kernel_dim, std::forward<F>(f));
}

// The same for the element type: bfloat16 or float16.
template <typename F>
cudaError_t with_element_type(at::ScalarType dtype, F&& f) {
  return dtype == at::kBFloat16 ? f(__nv_bfloat16{}) : f(__half{});
}

// The kernels move 16-byte chunks: every row of every operand must start
// 16-byte aligned and the head dim must be a multiple of 8. Inputs that are
// not so (odd head dims, views with odd strides) are copied into a padded
// contiguous buffer; the fast path (any layout with head_dim % 8 == 0 and
// strides that are multiples of 8) uses the tensors as they are.
inline bool kernel_ready(const at::Tensor& t) {
  if (t.size(3) % 8 != 0) return false;
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int i = 0; i < 3; ++i)
    if (t.size(i) > 1 && t.stride(i) % 8 != 0) return false;
  return true;
}

inline at::Tensor make_kernel_ready(const at::Tensor& t) {
  if (kernel_ready(t)) return t;
  const int64_t pad = (8 - t.size(3) % 8) % 8;
  if (pad == 0) return t.clone(at::MemoryFormat::Contiguous);
  return at::constant_pad_nd(t, {0, pad}, 0).contiguous();
}

// Undoes the head-dim padding of an output.
inline at::Tensor unpad(const at::Tensor& t, int64_t head_dim) {
  return t.size(3) == head_dim ? t : t.narrow(3, 0, head_dim).contiguous();
}

}  // namespace flashattn
