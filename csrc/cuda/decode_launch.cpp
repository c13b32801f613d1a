// The decoding kernels' launch (decode_launch.h): the split count, the split
// workspace, the dispatch; and the rule by which fwd takes them.
#include "decode_launch.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>

#include "binding_util.h"
#include "decode_dispatch.h"
#include "dispatch.h"

namespace flashattn {
namespace {

// Query tiles of a GQA group: its heads_q / heads_kv * seqlen_q rows packed
// into tiles of 16 * m_tiles rows (decode_m_tiles).
struct DecodeTiling {
  int m_tiles;
  int64_t query_tiles;
};

DecodeTiling decode_tiling(int kdim, int64_t heads_q, int64_t heads_kv, int64_t seqlen_q) {
  const int64_t group_rows = heads_q / heads_kv * seqlen_q;
  const int m_tiles = decode_m_tiles(kdim, static_cast<int>(std::min<int64_t>(group_rows, 1 << 20)));
  return {m_tiles, (group_rows + 16 * m_tiles - 1) / (16 * m_tiles)};
}

// The split count. Explicit values are honoured, clamped to [1, key blocks of
// a full row]. 0 (automatic): one split when the CTAs without splitting fill
// 80% of the resident slots (SMs x CTAs per SM); otherwise the smallest count
// whose wave efficiency is within 85% of the best (FlashAttention-2's rule),
// with at least two 64-key blocks per split and at most 128 splits.
int choose_num_splits(int64_t requested, int64_t ctas, int64_t key_blocks, int64_t slots) {
  if (requested > 0) return static_cast<int>(std::max<int64_t>(1, std::min(requested, key_blocks)));
  if (ctas >= (slots * 4) / 5) return 1;
  const int64_t max_splits = std::max<int64_t>(1, std::min<int64_t>({128, key_blocks / 2, slots}));
  auto efficiency = [&](int64_t s) {
    const double waves = double(ctas * s) / double(slots);
    return waves / std::ceil(waves);
  };
  double best = 0.0;
  for (int64_t s = 1; s <= max_splits; ++s) best = std::max(best, efficiency(s));
  for (int64_t s = 1; s <= max_splits; ++s) {
    // A count that gives a split no fewer blocks than the count below it only adds combine work.
    if (s > 1 && (key_blocks + s - 1) / s == (key_blocks + s - 2) / (s - 1)) continue;
    if (efficiency(s) >= 0.85 * best) return static_cast<int>(s);
  }
  return 1;
}

}  // namespace

bool decode_route(int64_t batch, int64_t seqlen_q, int64_t heads_q, int64_t heads_kv, int64_t seqlen_k, int kdim,
                  bool plain, bool windowed, bool bottom_right) {
  if (!plain || (windowed && !bottom_right)) return false;
  if (seqlen_q < 1 || seqlen_q > kDecodeRouteMaxSeqlenQ || seqlen_k < kDecodeRouteMinKeysPerQuery * seqlen_q) {
    return false;
  }
  if (batch < 1 || batch > 65535 || heads_kv < 1 || heads_q % heads_kv != 0) return false;
  if (heads_kv * decode_tiling(kdim, heads_q, heads_kv, seqlen_q).query_tiles > 65535) return false;
  return !env_flag("FLASHATTN_DISABLE_DECODE_ROUTE");
}

void launch_decode(KvcacheParams& params, int64_t num_splits, int kdim, const at::Tensor& q, const char* caller) {
  const int64_t batch = params.batch, seqlen_q = params.seqlen_q, heads_q = params.heads_q, heads_kv = params.heads_kv;
  const auto [m_tiles, query_tiles] = decode_tiling(kdim, heads_q, heads_kv, seqlen_q);
  TORCH_CHECK_VALUE(batch <= 65535, "flashattn_ext: ", caller, " takes at most 65535 batch rows on CUDA, got ", batch,
                    "; split the batch");
  TORCH_CHECK_VALUE(heads_kv * query_tiles <= 65535, "flashattn_ext: ", caller, " on CUDA: heads_kv x ",
                    "ceil(heads_q / heads_kv * seqlen_q / ", 16 * m_tiles, ") = ", heads_kv * query_tiles,
                    " exceeds 65535; split the queries");

  int ctas_per_sm = 0;
  with_element_type(q.scalar_type(), [&](auto elem) {
    return with_kernel_head_dim(kdim, [&](auto dim) {
      ctas_per_sm = decode_ctas_per_sm<decltype(elem), decltype(dim)::value>(m_tiles);
      return cudaSuccess;
    });
  });
  const int64_t slots =
      int64_t(at::cuda::getDeviceProperties(q.device().index())->multiProcessorCount) * std::max(ctas_per_sm, 1);
  const int64_t key_blocks = (params.capacity + kDecodeBlockN - 1) / kDecodeBlockN;
  params.num_splits = choose_num_splits(num_splits, batch * heads_kv * query_tiles, key_blocks, slots);

  // The split workspace, one allocation: fp32 partial outputs (num_splits,
  // batch, heads_q, seqlen_q, kernel head dim), then their lse (num_splits,
  // batch, heads_q, seqlen_q). Kept alive until the kernels are queued.
  at::Tensor workspace;
  if (params.num_splits > 1) {
    const int64_t rows = params.num_splits * batch * heads_q * seqlen_q;
    workspace = at::empty({rows * (q.size(3) + 1)}, q.options().dtype(at::kFloat));
    params.o_accum = workspace.data_ptr<float>();
    params.lse_accum = params.o_accum + rows * q.size(3);
    params.pdl = pdl_enabled(q);
  }
  const auto stream = at::cuda::getCurrentCUDAStream().stream();
  const cudaError_t err = with_element_type(q.scalar_type(), [&](auto elem) {
    return with_kernel_head_dim(
        kdim, [&](auto dim) { return run_decode<decltype(elem), decltype(dim)::value>(params, m_tiles, stream); });
  });
  TORCH_CHECK(err == cudaSuccess, "flashattn_ext: CUDA decoding kernel (head dim ", kdim, ") failed to launch for ",
              caller, ": ", cudaGetErrorString(err));
}

}  // namespace flashattn
