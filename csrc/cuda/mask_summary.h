// The per-call summary of torch SDPA's attn_mask for the CUDA kernels
// (AttnBias::summary in ../flash_params.h): one byte per 64 queries x 16 keys
// of every (batch, head) plane the mask has, computed on the device (one read
// of the mask, no host synchronisation) before the attention kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../flash_params.h"

namespace flashattn {

// The summary's shape for a mask over (batch, heads, seqlen_q, seqlen_k): the
// broadcast dimensions (stride 0) have one entry.
struct MaskSummaryShape {
  int64_t batch, heads, bands, cols;  // planes, 64-query bands, 16-key columns
  int64_t rows_q, cols_k;             // the queries and keys the mask spans (1 when broadcast)
  int64_t bytes() const { return batch * heads * bands * cols; }
};

MaskSummaryShape mask_summary_shape(const AttnBias& bias, int64_t batch, int64_t heads, int64_t seqlen_q,
                                    int64_t seqlen_k);

// Writes the summary of `bias` into out (shape.bytes() bytes on the device)
// and points bias's summary fields at it.
cudaError_t launch_mask_summary(AttnBias& bias, const MaskSummaryShape& shape, uint8_t* out, cudaStream_t stream);

}  // namespace flashattn
