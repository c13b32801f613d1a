// A kernel's dynamic shared memory limit, raised past the 48 KiB default once
// per (kernel, device) instead of on every launch: the attribute stays set for
// the process (the context), and cudaFuncSetAttribute costs about 2 us of host
// time a call (the profile of a decode step through the SDPA drop-in, session
// 19: one of its ~35 us), while the check below is a lookup under a mutex.
#pragma once

#include <cuda_runtime.h>

namespace flashattn {

// kernel: a __global__ function's address. Safe to call from several host
// threads (the set-attribute call is made at most once per (kernel, device,
// size) that grows the limit).
cudaError_t allow_dynamic_smem(const void* kernel, int bytes);

template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, int bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return allow_dynamic_smem(reinterpret_cast<const void*>(kernel), bytes);
}

}  // namespace flashattn
