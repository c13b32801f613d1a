// Torch-free description of one call of flashattn_ext::kvcache_append_rotary
// (flash_attn_with_kvcache's step before the attention): rotary on q, rotary on
// the new keys, and the append of the new keys and values into the cache, in
// place. Shared by the CPU loop (cpu/append_rotary_cpu.cpp) and the CUDA kernel
// (cuda/append_rotary_kernel.cu), and so are the position, clamping and
// rotation rules below: one place for each rule.
//
// Layouts (strides in elements, unit stride on head_dim):
//   q              : (batch, seqlen_q, heads_q, head_dim), any strides; q_out contiguous
//   k, v (new)     : (batch, seqlen_new, heads_kv, head_dim), any strides
//   caches         : (batch_cache, capacity, heads_kv, head_dim), or paged
//                    (num_blocks, page_size, heads_kv, head_dim): position p of
//                    batch row b is block block_table[b][p / page_size], row p % page_size
//   cos, sin       : (seqlen_ro, rotary_dim / 2)
//   seqlens, batch_idx : int32 (batch,); block_table int32 (batch, max_blocks)
//
// The integer values are not checked here (on CUDA they stay on the device):
// out-of-range values are clamped to the tensors, as the Python path's
// `clamp` calls did, so nothing is read or written outside them; the results
// are then unspecified (flash-attn's rule). A checked call (the CPU's, or
// FLASHATTN_KVCACHE_CHECK=1) has valid values, for which every clamp is the identity.
#pragma once

#include <cstdint>

#include "flash_params.h"  // FLASHATTN_HOST_DEVICE

namespace flashattn {

struct AppendRotaryParams {
  // q rotated into q_out (both null: no q). Without rotary, q_out is a copy.
  const void* q = nullptr;
  void* q_out = nullptr;
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0, q_dim_stride = 0;
  // The new keys and values (null: nothing appended).
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0, k_dim_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0, v_dim_stride = 0;
  // The caches, written in place; for a paged cache the batch stride is the block stride.
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  int64_t kc_batch_stride = 0, kc_row_stride = 0, kc_head_stride = 0;
  int64_t vc_batch_stride = 0, vc_row_stride = 0, vc_head_stride = 0;
  const int32_t* seqlens = nullptr;      // (batch,): positions before the append
  const int32_t* batch_idx = nullptr;    // (batch,) or null: cache row of batch row b
  const int32_t* block_table = nullptr;  // (batch, max_blocks) or null: contiguous cache
  int64_t block_table_stride = 0, block_table_col_stride = 0;
  // Rotary tables (null: no rotary).
  const void* cos = nullptr;
  const void* sin = nullptr;
  int64_t cos_row_stride = 0, cos_col_stride = 0, sin_row_stride = 0, sin_col_stride = 0;

  int64_t batch = 0, seqlen_q = 0, seqlen_new = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  int64_t rotary_dim = 0;    // 2 * cos.size(1); 0: no rotary
  int64_t seqlen_ro = 0;     // rows of the tables
  int64_t cache_rows = 0;    // k_cache.size(0): batch_cache, or num_blocks when paged
  int64_t page_size = 0;     // k_cache.size(1): capacity, or page_size when paged
  int64_t capacity = 0;      // positions a cache row holds
  bool interleaved = true;   // GPT-J pairs (2i, 2i + 1); else GPT-NeoX halves (i, i + rotary_dim / 2)
  bool q_per_token = false;  // q row i at position seqlens[b] + i (causal or local); else all at seqlens[b]
};

FLASHATTN_HOST_DEVICE inline int64_t clamp_index(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// The rotary position of q row i of batch row b (s = seqlens[b]).
FLASHATTN_HOST_DEVICE inline int64_t q_rotary_position(const AppendRotaryParams& p, int64_t s, int64_t i) {
  return clamp_index(p.q_per_token ? s + i : s, 0, p.seqlen_ro - 1);
}

// The cache position new row i of batch row b is written at.
FLASHATTN_HOST_DEVICE inline int64_t append_position(const AppendRotaryParams& p, int64_t s, int64_t i) {
  return clamp_index(s + i, 0, p.capacity > 0 ? p.capacity - 1 : 0);
}

// The rotary position of the key written at cache position pos (already >= 0).
FLASHATTN_HOST_DEVICE inline int64_t k_rotary_position(const AppendRotaryParams& p, int64_t pos) {
  return pos < p.seqlen_ro - 1 ? pos : p.seqlen_ro - 1;
}

// The cache row (batch row, or block when paged) and the row within it that
// position pos of batch row b lives at.
struct CacheSlot {
  int64_t row, offset;
};
FLASHATTN_HOST_DEVICE inline CacheSlot cache_slot(const AppendRotaryParams& p, int64_t b, int64_t pos) {
  const int64_t last = p.cache_rows > 0 ? p.cache_rows - 1 : 0;
  if (p.block_table != nullptr) {
    const int64_t block = p.block_table[b * p.block_table_stride + (pos / p.page_size) * p.block_table_col_stride];
    return {clamp_index(block, 0, last), pos % p.page_size};
  }
  return {p.batch_idx != nullptr ? clamp_index(p.batch_idx[b], 0, last) : b, pos};
}

// Which element of head_dim pairs with j under the rotation, whether j is the
// pair's first (x1) element, and the pair's column in the tables.
struct RotaryPair {
  int64_t partner, column;
  bool first;
};
FLASHATTN_HOST_DEVICE inline RotaryPair rotary_pair(const AppendRotaryParams& p, int64_t j) {
  if (p.interleaved) return {j ^ 1, j >> 1, (j & 1) == 0};
  const int64_t half = p.rotary_dim / 2;
  return j < half ? RotaryPair{j + half, j, true} : RotaryPair{j - half, j - half, false};
}

}  // namespace flashattn
