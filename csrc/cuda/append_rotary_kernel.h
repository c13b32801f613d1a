// The device side of flashattn_ext::kvcache_append_rotary on CUDA
// (append_rotary_cuda.cpp binds it): one launch rotates q and the new keys and
// writes the new keys and values into the cache. Torch-free (the params of
// ../append_rotary_params.h).
#pragma once

#include <cuda_runtime.h>

#include "../append_rotary_params.h"

namespace flashattn {

// T: __half or __nv_bfloat16. Reads cache_seqlens, cache_batch_idx and
// block_table on the device; no host synchronisation, capturable.
template <typename T>
cudaError_t launch_append_rotary(const AppendRotaryParams& p, cudaStream_t stream);

}  // namespace flashattn
