// Torch-free description of one call of flashattn_ext::fwd_kvcache: attention
// of a few query rows per batch row against a KV cache, the cache lengths (and
// optionally cache rows, left padding and a page table) given as device
// integers, which the kernels read on the device (no host synchronisation).
//
// Layouts (strides in elements, unit stride on head_dim):
//   q, o          : (batch, seqlen_q, heads_q, head_dim)
//   k, v contiguous: (batch_cache, capacity, heads_kv, head_dim)
//   k, v paged     : (num_blocks, page_size, heads_kv, head_dim); position p of
//                    batch row b is block_table[b][p / page_size], row p % page_size
//   lse           : (batch, heads_q, seqlen_q), contiguous, float32 (float64 for float64)
//   seqlens_k, batch_idx, leftpad : int32 (batch,), contiguous; seqlens_k nullptr
//                    (CUDA, fwd's short queries on the decoding kernel): every row full
//   block_table   : int32 (batch, max_blocks), unit stride on dimension 1
//
// Batch row b sees the keys [leftpad[b], seqlens_k[b]) of its cache row
// (batch_idx[b], default b); query i sits at key position
// seqlens_k[b] - seqlen_q + i (causal and windows aligned bottom-right).
#pragma once

#include <cstdint>

#include "flash_params.h"

namespace flashattn {

// The pointers and strides of q, k, v, o and lse come from QkvoParams; for a
// paged cache the batch stride of k and v is the stride between blocks.
struct KvcacheParams : QkvoParams {
  const int32_t* seqlens_k = nullptr;    // (batch,): keys of each row (after any append); nullptr: capacity
  const int32_t* batch_idx = nullptr;    // (batch,) or nullptr: cache row of each batch row
  const int32_t* leftpad = nullptr;      // (batch,) or nullptr: first visible key
  const int32_t* block_table = nullptr;  // (batch, max_blocks) or nullptr: contiguous cache
  index_t block_table_batch_stride = 0;

  int batch = 0;
  int seqlen_q = 0;
  int heads_q = 0;
  int heads_kv = 0;
  int head_dim = 0;
  int cache_rows = 0;  // batch_cache (contiguous) or num_blocks (paged): the range of cache indices
  int page_size = 0;   // paged only
  int capacity = 0;    // keys a row can hold: seqlen_cache, or max_blocks * page_size

  // -1: unbounded; causal is window_right = 0. Aligned bottom-right per row.
  int window_left = -1;
  int window_right = -1;

  double softmax_scale = 1.0;
  float softmax_scale_log2 = 1.f;
  ScoreMod score_mod;  // flash_params.h; ALiBi's i + seqlen_k - seqlen_q - j with the row's seqlens_k

  // CUDA only: the key range of a row is cut into num_splits parts, each
  // computed by its own CTA into the fp32 workspace (o_accum, lse_accum,
  // laid out (num_splits, batch, heads_q, seqlen_q[, head_dim_kernel])), then
  // merged through the log-sum-exp. num_splits == 1 writes o and lse directly.
  int num_splits = 1;
  float* o_accum = nullptr;
  float* lse_accum = nullptr;
  // CUDA only: launch the combine kernel with programmatic dependent launch
  // (sm90+; the binding sets it, FLASHATTN_DISABLE_PDL clears it).
  bool pdl = false;
};

// The keys of batch row b: seqlens_k[b] within [0, capacity] (a bad value
// cuts the row to the cache, never past it), or the whole capacity when
// seqlens_k is nullptr (fwd's short queries on the decoding kernel,
// csrc/cuda/decode_launch.h: every key of the dense call is visible).
FLASHATTN_HOST_DEVICE inline int row_seqlen_k(const int32_t* seqlens_k, int b, int capacity) {
  if (seqlens_k == nullptr) return capacity;
  const int n = seqlens_k[b];
  return n < 0 ? 0 : (n > capacity ? capacity : n);
}

}  // namespace flashattn
