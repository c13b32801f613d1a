// Host side of programmatic dependent launch (PDL, sm90+): a kernel launched
// with programmatic stream serialization may begin while the previous kernel of
// its stream is still running, so its launch latency and prologue overlap that
// kernel's tail. The launched kernel must call pdl_wait() (ptx.cuh) before it
// touches what the previous kernel writes; the previous kernel may call
// pdl_launch_dependents() to let it be scheduled before its own last CTAs exit.
// Captured into a CUDA graph, the launch becomes a programmatic edge.
//
// For launch code compiled by nvcc (the plain path is a <<<>>> launch).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

namespace flashattn {

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream
// serialization when `pdl` is set. The caller decides `pdl`: an sm90+ device
// (older ones get the plain launch) and no FLASHATTN_DISABLE_PDL
// (binding_util.h: pdl_enabled), so both launches can be timed in one build.
template <typename... Params, typename... Args>
cudaError_t launch_kernel_pdl(bool pdl, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                              cudaStream_t stream, Args&&... args) {
  if (!pdl) {
    kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
    return cudaGetLastError();
  }
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace flashattn
