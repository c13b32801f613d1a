// CPU implementation of flashattn_ext::fwd_kvcache: each batch row is one call
// of the forward kernels (flash_cpu_fwd.cpp; the rows' calls run as one
// parallel loop) on a (1, seqlen_q, heads_q, head_dim) view of q against the
// row's visible keys [leftpad, seqlens_k) of its cache row, causal and
// windows aligned bottom-right against them. A contiguous cache is used in
// place (a view); a paged one is read in place by decoding-shaped calls (the
// forward's few-queries path follows the page table) and gathered row by row
// for the others. The integer arguments are host tensors
// here, so their values are checked, each error naming the argument.
#include <torch/library.h>

#include <limits>
#include <optional>
#include <vector>

#include "../kvcache_api.h"
#include "flash_cpu.h"
#include "paged_gather.h"

namespace flashattn {
namespace {

const BackendSpec kCpuSpec{"CPU", {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}, ""};

std::tuple<at::Tensor, at::Tensor> fwd_kvcache_cpu_impl(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& seqlens_k,
    const std::optional<at::Tensor>& batch_idx, const std::optional<at::Tensor>& leftpad,
    const std::optional<at::Tensor>& block_table, double softmax_scale, int64_t window_left, int64_t window_right,
    int64_t num_splits /*a CUDA performance hint*/, double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  const KvcacheInputs in{q, k_cache, v_cache, seqlens_k, batch_idx, leftpad, block_table, softcap, alibi_slopes};
  const ScoreMod score_mod = make_score_mod(softcap, alibi_slopes, q, q.size(0), q.size(2));
  check_kvcache(in, softmax_scale, window_left, window_right, num_splits, kCpuSpec);
  const int64_t batch = q.size(0), seqlen_q = q.size(1), capacity = kvcache_capacity(in);
  const int64_t cache_rows = k_cache.size(0), page = k_cache.size(1);
  auto [out, lse] = alloc_kvcache_outputs(q);

  // Every value first: a rejected call computes nothing.
  const auto seq = seqlens_k.contiguous();
  const int32_t* sk = seq.data_ptr<int32_t>();
  at::Tensor lp_t = leftpad ? leftpad->contiguous() : at::Tensor();
  at::Tensor idx_t = batch_idx ? batch_idx->contiguous() : at::Tensor();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(sk[b] >= 0 && sk[b] <= capacity, "flashattn_ext: seqlens_k[", b, "] = ", sk[b],
                      " is outside [0, ", capacity, "], the keys a cache row holds");
    if (leftpad) {
      const int32_t lp = lp_t.data_ptr<int32_t>()[b];
      TORCH_CHECK_VALUE(lp >= 0 && lp <= sk[b], "flashattn_ext: cache_leftpad[", b, "] = ", lp,
                        " is outside [0, seqlens_k[", b, "] = ", sk[b], "]");
    }
    if (batch_idx) {
      const int32_t r = idx_t.data_ptr<int32_t>()[b];
      TORCH_CHECK_VALUE(r >= 0 && r < cache_rows, "flashattn_ext: cache_batch_idx[", b, "] = ", r, " is outside [0, ",
                        cache_rows, ") (k_cache's rows)");
    }
  }
  at::Tensor table = block_table ? block_table->to(at::kLong) : at::Tensor();           // (batch, max_blocks)
  const at::Tensor table_i32 = block_table ? block_table->contiguous() : at::Tensor();  // (int32: checked)
  if (block_table) {
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t used = (sk[b] + page - 1) / page;
      if (used == 0) continue;
      const auto blocks = table[b].narrow(0, 0, used);
      TORCH_CHECK_VALUE(blocks.min().item<int64_t>() >= 0 && blocks.max().item<int64_t>() < cache_rows,
                        "flashattn_ext: block_table[", b, "] holds block indices outside [0, ", cache_rows,
                        ") (k_cache's num_blocks) in the blocks the row uses");
    }
  }
  if (batch == 0 || seqlen_q == 0) return {out, lse};

  // One forward call per batch row with keys, all run as one parallel loop
  // (run_fwd_cpu splits a decoding row's keys over the threads). A row's call
  // is the whole call's parameters moved to its batch entry by pointer
  // arithmetic: tensor views of q, out, lse, k and v for each row were most
  // of a decoding step's fixed cost of its own (seven views for a batch of
  // one, ~0.7 us each).
  const AttnFwdParams whole = make_fwd_params(q, k_cache, v_cache, out, lse, softmax_scale, MaskParams{});
  const int64_t elem = q.element_size(), lse_batch_bytes = lse.stride(0) * lse.element_size();
  auto moved = [elem](const void* ptr, int64_t elements) {  // ptr + elements of q's dtype
    return const_cast<char*>(static_cast<const char*>(ptr)) + elements * elem;
  };
  std::vector<AttnFwdParams> calls;
  std::vector<at::Tensor> gathered;  // the paged rows' keys and values, alive until the calls ran
  calls.reserve(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t lp = leftpad ? lp_t.data_ptr<int32_t>()[b] : 0;
    const int64_t n = sk[b] - lp;  // visible keys
    if (n == 0) {                  // no key to see: zeros, lse -inf (MaskParams' rule)
      out.narrow(0, b, 1).zero_();
      lse.narrow(0, b, 1).fill_(-std::numeric_limits<double>::infinity());
      continue;
    }
    // The row's call is a batch of one whose keys are [lp, seqlens_k): its
    // ALiBi distance i + n - seqlen_q - (j - lp) is the row's
    // i + seqlens_k[b] - seqlen_q - j, and its slopes are row b's. k and v
    // start at `key0` of cache row `row` (or of the gathered keys).
    AttnFwdParams p = whole;
    p.batch = 1;
    p.seqlen_k = static_cast<int>(n);
    p.mask = make_mask(window_left, window_right, /*bottom_right=*/true, seqlen_q, n);
    p.score_mod = score_mod_of_row(score_mod, b);
    p.q_ptr = moved(whole.q_ptr, b * whole.q_batch_stride);
    p.o_ptr = moved(whole.o_ptr, b * whole.o_batch_stride);
    p.lse_ptr = static_cast<char*>(whole.lse_ptr) + b * lse_batch_bytes;
    auto keys_at = [&](int64_t row, int64_t key0) {
      p.k_ptr = moved(whole.k_ptr, row * whole.k_batch_stride + key0 * whole.k_row_stride);
      p.v_ptr = moved(whole.v_ptr, row * whole.v_batch_stride + key0 * whole.v_row_stride);
    };
    if (block_table) {
      // Decoding-shaped calls read the pages in place (the few-queries path:
      // key j is position lp + j of the row's table, KvCacheView); the rest
      // gather the row's visible keys first.
      keys_at(0, 0);
      if (read_pages_in_place(p, table_i32, b, n, k_cache, leftpad ? lp_t.data_ptr<int32_t>() + b : nullptr)) {
        calls.push_back(p);
        continue;
      }
      const auto kb = gather_paged_keys(k_cache, table[b], lp, sk[b]);  // (1, n, heads_kv, head_dim)
      const auto vb = gather_paged_keys(v_cache, table[b], lp, sk[b]);
      gathered.push_back(kb);
      gathered.push_back(vb);
      p.kv = whole.kv;  // (read_pages_in_place set the page table for the call it declined)
      p.seqlen_k = static_cast<int>(n);
      p.k_ptr = kb.data_ptr(), p.v_ptr = vb.data_ptr();
      p.k_batch_stride = kb.stride(0), p.k_row_stride = kb.stride(1), p.k_head_stride = kb.stride(2);
      p.v_batch_stride = vb.stride(0), p.v_row_stride = vb.stride(1), p.v_head_stride = vb.stride(2);
      calls.push_back(p);
    } else {
      keys_at(batch_idx ? idx_t.data_ptr<int32_t>()[b] : b, lp);
      calls.push_back(p);
    }
  }
  run_fwd_cpu(calls.data(), static_cast<int64_t>(calls.size()));
  return {out, lse};
}

}  // namespace
}  // namespace flashattn

TORCH_LIBRARY_IMPL(flashattn_ext, CPU, m) {
  m.impl("fwd_kvcache", &flashattn::fwd_kvcache_entry<&flashattn::fwd_kvcache_cpu_impl>);
}
