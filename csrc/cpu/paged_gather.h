// The CPU path's reading of a paged KV cache (flash-attn's block_table) where
// the forward's tiled path runs (it takes keys one row stride apart): the keys
// of one row gathered into a dense (1, n, heads_kv, head_dim) tensor. The
// decoding-shaped calls of fwd_kvcache read the pages in place instead (the
// few-queries path, flash_cpu.h's fwd_cpu_runs_few_queries), and so do those
// sequences of varlen_fwd_paged: read_pages_in_place.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/floor_divide.h>
#include <ATen/ops/remainder.h>

#include "flash_cpu.h"

namespace flashattn {

// Sets up p (made from the cache's first block: its pointers and strides) to
// read row b of a paged cache in place: its keys the n positions of the row's
// page table from *first_pos (0 when null), KvCacheView's rule. Returns whether
// the forward reads pages in place for such a call (its few-queries path);
// when it does not, the caller gathers the keys instead.
inline bool read_pages_in_place(AttnFwdParams& p, const at::Tensor& table_i32, int64_t b, int64_t n,
                                const at::Tensor& cache, const int32_t* first_pos) {
  p.seqlen_k = static_cast<int>(n);
  p.kv.block_table = table_i32.data_ptr<int32_t>() + b * table_i32.stride(0);
  p.kv.max_blocks = static_cast<int>(table_i32.size(1));
  p.kv.page_size = static_cast<int>(cache.size(1));
  p.kv.cache_rows = static_cast<int>(cache.size(0));
  p.kv.leftpad = first_pos;
  return fwd_cpu_runs_few_queries(p);
}

// Positions [lo, hi) of the row whose page table (int64 block indices) is
// `table_row`: position p is row p % page_size of block table_row[p / page_size].
inline at::Tensor gather_paged_keys(const at::Tensor& cache, const at::Tensor& table_row, int64_t lo, int64_t hi) {
  const int64_t page = cache.size(1);
  const auto pos = at::arange(lo, hi, table_row.options());
  const auto blocks = table_row.index_select(0, at::floor_divide(pos, page));
  const c10::List<std::optional<at::Tensor>> rows_of_pages{blocks, at::remainder(pos, page)};
  return cache.index(rows_of_pages).unsqueeze(0);
}

}  // namespace flashattn
