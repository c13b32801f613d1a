// The CPU path's reading of a paged KV cache (flash-attn's block_table) where
// the forward's tiled path runs (it takes keys one row stride apart): the keys
// of one row gathered into a dense (1, n, heads_kv, head_dim) tensor. The
// decoding-shaped calls of fwd_kvcache read the pages in place instead (the
// few-queries path, flash_cpu.h's fwd_cpu_runs_few_queries); varlen_fwd_paged
// gathers every sequence.
#pragma once

#include <ATen/ATen.h>

namespace flashattn {

// Positions [lo, hi) of the row whose page table (int64 block indices) is
// `table_row`: position p is row p % page_size of block table_row[p / page_size].
inline at::Tensor gather_paged_keys(const at::Tensor& cache, const at::Tensor& table_row, int64_t lo, int64_t hi) {
  const int64_t page = cache.size(1);
  const auto pos = at::arange(lo, hi, table_row.options());
  const auto blocks = table_row.index_select(0, at::floor_divide(pos, page));
  return cache.index({blocks, at::remainder(pos, page)}).unsqueeze(0);
}

}  // namespace flashattn
