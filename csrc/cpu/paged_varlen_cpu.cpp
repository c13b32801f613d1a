// CPU implementation of flashattn_ext::varlen_fwd_paged (flash_attn_varlen_func
// with block_table): each sequence is one call of the forward kernels
// (flash_cpu_fwd.cpp; the calls run as one parallel loop) on its packed
// queries against its keys [0, len_k), read from their pages in place by
// decoding-shaped sequences and gathered for the others (paged_gather.h),
// causal and windows aligned bottom-right. The integer
// arguments are host tensors here, so their values are checked first, each
// error naming the argument: a rejected call computes nothing.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <limits>
#include <optional>
#include <vector>

#include "../paged_varlen_api.h"
#include "flash_cpu.h"
#include "paged_gather.h"

namespace flashattn {
namespace {

const BackendSpec kCpuSpec{"CPU", {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}, ""};

// Lengths from cumulative counts: non-decreasing, at most max_len; from 0 and
// ending at `total` when the counts locate rows (cu_seqlens_q).
std::vector<int64_t> lengths_of(const at::Tensor& cu_t, const char* name, int64_t max_len, const char* max_name,
                                int64_t total) {
  const int32_t* cu = cu_t.data_ptr<int32_t>();
  const int64_t n = cu_t.size(0);
  if (total >= 0) TORCH_CHECK_VALUE(cu[0] == 0, "flashattn_ext: ", name, " must start at 0, got ", cu[0]);
  std::vector<int64_t> lens(n - 1);
  for (int64_t i = 0; i + 1 < n; ++i) {
    TORCH_CHECK_VALUE(cu[i + 1] >= cu[i], "flashattn_ext: ", name, " must be non-decreasing, got ", name, "[", i,
                      "] = ", cu[i], " > ", name, "[", i + 1, "] = ", cu[i + 1]);
    lens[i] = int64_t(cu[i + 1]) - cu[i];
    TORCH_CHECK_VALUE(lens[i] <= max_len, "flashattn_ext: ", max_name, "=", max_len,
                      " is smaller than the longest sequence of ", name, " (", lens[i],
                      "); it must be at least the largest length");
  }
  if (total >= 0)
    TORCH_CHECK_VALUE(cu[n - 1] == total, "flashattn_ext: ", name, " ends at ", cu[n - 1], " but q holds ", total,
                      " tokens (its dimension 0)");
  return lens;
}

std::tuple<at::Tensor, at::Tensor> varlen_fwd_paged_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                                                        const at::Tensor& v_cache, const at::Tensor& cu_seqlens_q,
                                                        const at::Tensor& cu_seqlens_k, const at::Tensor& block_table,
                                                        int64_t max_seqlen_q, int64_t max_seqlen_k,
                                                        double softmax_scale, int64_t window_left, int64_t window_right,
                                                        double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  const PagedVarlenInputs in{q,           k_cache,      v_cache,      cu_seqlens_q, cu_seqlens_k,
                             block_table, max_seqlen_q, max_seqlen_k, softcap,      alibi_slopes};
  check_paged_varlen(in, softmax_scale, window_left, window_right, kCpuSpec);
  const int64_t batch = cu_seqlens_q.size(0) - 1, page = k_cache.size(1), num_blocks = k_cache.size(0);
  const ScoreMod score_mod = make_score_mod(softcap, alibi_slopes, q, batch, q.size(1));
  const auto starts_q = cu_seqlens_q.contiguous();
  const auto lens_q = lengths_of(starts_q, "cu_seqlens_q", max_seqlen_q, "max_seqlen_q", q.size(0));
  const auto lens_k = lengths_of(cu_seqlens_k.contiguous(), "cu_seqlens_k", max_seqlen_k, "max_seqlen_k", -1);
  const at::Tensor table = block_table.to(at::kLong);
  const at::Tensor table_i32 = block_table.contiguous();  // (int32: checked)
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(lens_k[b] <= block_table.size(1) * page, "flashattn_ext: sequence ", b, " has ", lens_k[b],
                      " keys (cu_seqlens_k) but block_table holds ", block_table.size(1), " blocks of ", page,
                      " keys per sequence");
    const int64_t used = (lens_k[b] + page - 1) / page;
    if (used == 0) continue;
    const auto blocks = table[b].narrow(0, 0, used);
    TORCH_CHECK_VALUE(blocks.min().item<int64_t>() >= 0 && blocks.max().item<int64_t>() < num_blocks,
                      "flashattn_ext: block_table[", b, "] holds block indices outside [0, ", num_blocks,
                      ") (k_cache's num_blocks) in the blocks the sequence uses");
  }
  auto [out, lse] = alloc_paged_varlen_outputs(q);
  out.zero_();  // a sequence without keys: zeros, lse -inf (MaskParams' rule)
  lse.fill_(-std::numeric_limits<double>::infinity());

  std::vector<AttnFwdParams> calls;
  std::vector<at::Tensor> held;  // gathered keys / values and per-sequence lse, alive until the calls ran
  std::vector<std::pair<int64_t, at::Tensor>> lse_parts;
  const int32_t* sq = starts_q.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n_q = lens_q[b], n_k = lens_k[b];
    if (n_q == 0 || n_k == 0) continue;
    const auto q_b = q.narrow(0, sq[b], n_q).unsqueeze(0), out_b = out.narrow(0, sq[b], n_q).unsqueeze(0);
    auto lse_b = at::empty({1, q.size(1), n_q}, lse.options());  // the kernels' (batch, heads, seqlen) layout
    held.push_back(lse_b);
    lse_parts.emplace_back(sq[b], lse_b);
    const auto mask = make_mask(window_left, window_right, /*bottom_right=*/true, n_q, n_k);
    auto seq_call = [&](const at::Tensor& kb, const at::Tensor& vb) {
      AttnFwdParams p = make_fwd_params(q_b, kb, vb, out_b, lse_b, softmax_scale, mask);
      p.score_mod = score_mod_of_row(score_mod, b);  // a batch of one: sequence b's slopes
      return p;
    };
    // Decoding-shaped sequences read their pages in place; the rest are gathered.
    AttnFwdParams p = seq_call(k_cache.narrow(0, 0, 1), v_cache.narrow(0, 0, 1));
    if (read_pages_in_place(p, table_i32, b, n_k, k_cache, nullptr)) {
      calls.push_back(p);
      continue;
    }
    const auto kb = gather_paged_keys(k_cache, table[b], 0, n_k), vb = gather_paged_keys(v_cache, table[b], 0, n_k);
    held.insert(held.end(), {kb, vb});
    calls.push_back(seq_call(kb, vb));
  }
  run_fwd_cpu(calls.data(), static_cast<int64_t>(calls.size()));
  for (const auto& [start, part] : lse_parts) lse.narrow(1, start, part.size(2)).copy_(part[0]);
  return {out, lse};
}

}  // namespace
}  // namespace flashattn

TORCH_LIBRARY_IMPL(flashattn_ext, CPU, m) { m.impl("varlen_fwd_paged", &flashattn::varlen_fwd_paged_cpu); }
