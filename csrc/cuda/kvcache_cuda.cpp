// CUDA implementation of flashattn_ext::fwd_kvcache: validation through the
// shared binding layer (kvcache_api.h), the kernels' layout requirements, the
// split count, the split workspace and the dispatch to one (dtype, head dim)
// instantiation of the split-KV decoding kernels (flash_decode_kernel.cuh).
//
// Nothing here reads a device value: cache_seqlens, cache_leftpad,
// cache_batch_idx and block_table stay on the device, the kernels read them,
// and the call is capturable in a CUDA graph. The split count depends on the
// shapes only (the capacity of a cache row bounds its keys).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>

#include "../kvcache_api.h"
#include "decode_dispatch.h"

namespace flashattn {
namespace {

const BackendSpec kCudaSpec{
    "CUDA",
    {at::kHalf, at::kBFloat16},
    "; cast float32 inputs to bfloat16 or float16 (flashattn_ext.scaled_dot_product_attention falls back to "
    "torch for float32 on CUDA)"};

// The compiled kernel head dims, ascending (setup.py's FLASHATTN_HDIMS; the
// same list attention_cuda.cpp dispatches over).
#ifndef FLASHATTN_HDIMS
#define FLASHATTN_HDIMS
#endif
#ifndef FLASHATTN_HEAD_DIMS
#define FLASHATTN_HEAD_DIMS ""
#endif
template <int... kDims>
struct DecodeHeadDims {};
using CompiledDecodeHeadDims = DecodeHeadDims<FLASHATTN_HDIMS>;

template <int... kDims>
int smallest_compiled_at_least(DecodeHeadDims<kDims...>, int64_t head_dim) {
  int found = 0;
  ((found == 0 && kDims >= head_dim ? (found = kDims) : 0), ...);
  return found;
}

template <int... kDims, typename F>
cudaError_t with_head_dim(DecodeHeadDims<kDims...>, int kernel_dim, F&& f) {
  cudaError_t err = cudaErrorInvalidValue;
  ((kernel_dim == kDims ? (err = f(std::integral_constant<int, kDims>{}), 0) : 0), ...);
  return err;
}

template <typename F>
auto with_element(at::ScalarType dtype, F&& f) {
  return dtype == at::kBFloat16 ? f(__nv_bfloat16{}) : f(__half{});
}

// The kernels copy 16-byte chunks: rows must start 16-byte aligned and the
// head dim must be a multiple of 8 (as for attention_cuda.cpp's kernels).
bool chunk_ready(const at::Tensor& t) {
  if (t.size(3) % 8 != 0 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int i = 0; i < 3; ++i)
    if (t.size(i) > 1 && t.stride(i) % 8 != 0) return false;
  return true;
}

// A padded contiguous copy for a tensor that is not chunk_ready. For the
// caches this copies the whole cache on every call: only head dims that are
// not a multiple of 8 (or oddly strided caches) take it; the README says so.
at::Tensor make_chunk_ready(const at::Tensor& t) {
  if (chunk_ready(t)) return t;
  const int64_t pad = (8 - t.size(3) % 8) % 8;
  if (pad == 0) return t.clone(at::MemoryFormat::Contiguous);
  return at::constant_pad_nd(t, {0, pad}, 0).contiguous();
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

std::tuple<at::Tensor, at::Tensor> fwd_kvcache_cuda_impl(const at::Tensor& q_in, const at::Tensor& k_cache_in,
                                                         const at::Tensor& v_cache_in, const at::Tensor& seqlens_k_in,
                                                         const std::optional<at::Tensor>& batch_idx_in,
                                                         const std::optional<at::Tensor>& leftpad_in,
                                                         const std::optional<at::Tensor>& block_table_in,
                                                         double softmax_scale, int64_t window_left,
                                                         int64_t window_right, int64_t num_splits) {
  check_kvcache({q_in, k_cache_in, v_cache_in, seqlens_k_in, batch_idx_in, leftpad_in, block_table_in}, softmax_scale,
                window_left, window_right, num_splits, kCudaSpec);
  const auto* prop = at::cuda::getDeviceProperties(q_in.device().index());
  TORCH_CHECK(prop->major >= 8,
              "flashattn_ext: the CUDA kernels need compute capability 8.0 or newer (mma.sync bf16); ", "device ",
              q_in.device(), " is ", prop->major, ".", prop->minor);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const int64_t head_dim = q_in.size(3);
  const int kdim = smallest_compiled_at_least(CompiledDecodeHeadDims{}, head_dim);
  TORCH_CHECK_VALUE(kdim != 0, "flashattn_ext: no CUDA kernel for head_dim ", head_dim,
                    " in this build (compiled head dims: " FLASHATTN_HEAD_DIMS
                    "); rebuild with FLASHATTN_HEAD_DIMS including a head dim >= ",
                    head_dim);

  const at::Tensor q = make_chunk_ready(q_in);
  const at::Tensor k_cache = make_chunk_ready(k_cache_in), v_cache = make_chunk_ready(v_cache_in);
  // The integer vectors are read as plain arrays (a copy only for a strided view).
  const at::Tensor seqlens_k = seqlens_k_in.contiguous();
  const std::optional<at::Tensor> batch_idx = batch_idx_in ? std::optional(batch_idx_in->contiguous()) : std::nullopt;
  const std::optional<at::Tensor> leftpad = leftpad_in ? std::optional(leftpad_in->contiguous()) : std::nullopt;
  std::optional<at::Tensor> block_table = block_table_in;
  if (block_table && block_table->size(1) > 1 && block_table->stride(1) != 1) block_table = block_table->contiguous();

  auto [out, lse] = alloc_kvcache_outputs(q);
  const KvcacheInputs in{q, k_cache, v_cache, seqlens_k, batch_idx, leftpad, block_table};
  const int64_t batch = q.size(0), seqlen_q = q.size(1), heads_q = q.size(2), heads_kv = k_cache.size(2);
  const int64_t capacity = kvcache_capacity(in);
  auto unpad = [&](const at::Tensor& t) { return t.size(3) == head_dim ? t : t.narrow(3, 0, head_dim).contiguous(); };
  if (out.numel() == 0) return {unpad(out), lse};
  if (capacity == 0 || k_cache.size(0) == 0) {  // no key anywhere: zeros, lse -inf
    out.zero_();
    lse.fill_(-std::numeric_limits<double>::infinity());
    return {unpad(out), lse};
  }

  KvcacheParams params = make_kvcache_params(in, out, lse, softmax_scale, window_left, window_right);
  const int64_t group_rows = heads_q / heads_kv * seqlen_q;
  const int m_tiles = decode_m_tiles(kdim, static_cast<int>(std::min<int64_t>(group_rows, 1 << 20)));
  const int64_t query_tiles = (group_rows + 16 * m_tiles - 1) / (16 * m_tiles);
  TORCH_CHECK_VALUE(batch <= 65535,
                    "flashattn_ext: flash_attn_with_kvcache takes at most 65535 batch rows on CUDA, got ", batch,
                    "; split the batch");
  TORCH_CHECK_VALUE(heads_kv * query_tiles <= 65535, "flashattn_ext: flash_attn_with_kvcache on CUDA: heads_kv x ",
                    "ceil(heads_q / heads_kv * seqlen_q / ", 16 * m_tiles, ") = ", heads_kv * query_tiles,
                    " exceeds 65535; split the queries");

  const auto stream = at::cuda::getCurrentCUDAStream().stream();
  int ctas_per_sm = 0;
  with_element(q.scalar_type(), [&](auto elem) {
    return with_head_dim(CompiledDecodeHeadDims{}, kdim, [&](auto dim) {
      ctas_per_sm = decode_ctas_per_sm<decltype(elem), decltype(dim)::value>(m_tiles);
      return cudaSuccess;
    });
  });
  const int64_t slots = int64_t(prop->multiProcessorCount) * std::max(ctas_per_sm, 1);
  const int64_t key_blocks = (capacity + kDecodeBlockN - 1) / kDecodeBlockN;
  params.num_splits = choose_num_splits(num_splits, batch * heads_kv * query_tiles, key_blocks, slots);

  at::Tensor o_accum, lse_accum;  // the split workspace: fp32 partial outputs and their lse
  if (params.num_splits > 1) {
    const auto f32 = q.options().dtype(at::kFloat);
    o_accum = at::empty({params.num_splits, batch, heads_q, seqlen_q, q.size(3)}, f32);
    lse_accum = at::empty({params.num_splits, batch, heads_q, seqlen_q}, f32);
    params.o_accum = o_accum.data_ptr<float>();
    params.lse_accum = lse_accum.data_ptr<float>();
  }
  const cudaError_t err = with_element(q.scalar_type(), [&](auto elem) {
    return with_head_dim(CompiledDecodeHeadDims{}, kdim, [&](auto dim) {
      return run_decode<decltype(elem), decltype(dim)::value>(params, m_tiles, stream);
    });
  });
  TORCH_CHECK(err == cudaSuccess, "flashattn_ext: CUDA decoding kernel (head dim ", kdim,
              ") failed to launch: ", cudaGetErrorString(err));
  return {unpad(out), lse};
}

// bhsd: the (batch, heads, seqlen, head_dim) tensors as (batch, seqlen, heads,
// head_dim) views, and the output back as a view (see ops.cpp).
std::tuple<at::Tensor, at::Tensor> fwd_kvcache_cuda(const at::Tensor& q, const at::Tensor& k_cache,
                                                    const at::Tensor& v_cache, const at::Tensor& seqlens_k,
                                                    const std::optional<at::Tensor>& batch_idx,
                                                    const std::optional<at::Tensor>& leftpad,
                                                    const std::optional<at::Tensor>& block_table, double softmax_scale,
                                                    int64_t window_left, int64_t window_right, int64_t num_splits,
                                                    bool bhsd) {
  check_bhsd(bhsd, block_table);
  auto [out, lse] = fwd_kvcache_cuda_impl(kernel_layout(q, bhsd), kernel_layout(k_cache, bhsd),
                                          kernel_layout(v_cache, bhsd), seqlens_k, batch_idx, leftpad, block_table,
                                          softmax_scale, window_left, window_right, num_splits);
  return {kernel_layout(out, bhsd), lse};
}

}  // namespace
}  // namespace flashattn

TORCH_LIBRARY_IMPL(flashattn_ext, CUDA, m) { m.impl("fwd_kvcache", &flashattn::fwd_kvcache_cuda); }
