// Host side of programmatic dependent launch (PDL, sm90+): a launch that may
// overlap the end of the kernel before it on the stream. The kernels' side is
// pdl_wait / pdl_launch_dependents (ptx.cuh).
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace flashattn {

// kernel<<<grid, block, smem, stream>>>(args...); with `pdl`, as a
// programmatic dependent of the previous launch on the stream: it may start
// once every CTA of that kernel has executed pdl_launch_dependents (or
// exited), and must pdl_wait before it touches anything that kernel writes.
// Only for an sm90+ device, and only right after a kernel launch on the same
// stream (a copy or memset before it gives no kernel to overlap; under CUDA
// graph capture the attribute becomes a programmatic edge between the two
// kernel nodes). Without `pdl` this is the plain launch.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
                          Args&&... args) {
  if (!pdl) {
    kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
    return cudaGetLastError();
  }
  cudaLaunchAttribute attr[1];
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
