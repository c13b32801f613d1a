// CUDA implementation of flashattn_ext::fwd_kvcache: validation through the
// shared binding layer (kvcache_api.h), the kernels' layout requirements, and
// the split-KV decoding kernels (flash_decode_kernel.cuh, launched by
// decode_launch.h with their split count and workspace).
//
// Long queries (prefill against a cache, prefill_route below) go to the
// warp-specialized TMA forward instead (run_fwd with seqused_k = the cache
// lengths; hopper/flash_fwd_sm90_ws_kernel.cuh), whose 128-row query tiles
// are those of a prefill.
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
#include <cstdlib>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>

#include "../kvcache_api.h"
#include "binding_util.h"
#include "decode_launch.h"
#include "dispatch.h"

namespace flashattn {
namespace {

// The query length from which a call goes to the TMA forward (prefill_route).
// The decoding kernel packs a GQA group's rows (heads_q / heads_kv * seqlen_q)
// into query tiles of at most 64 (d <= 64), 32 (d <= 128) or 16 rows, and every
// tile of a group reads all of the group's keys again (NOTES.md, decoding),
// where the forward reads them about once per query head (its CTAs of one head
// share them in L2). Measured (session 6, bench_decode.py's prefill sweep, 8k
// cache, batch 4, 32/8 heads, d128, ms, forward / decoding kernel): q 16
// 0.108 / 0.065, q 32 0.107 / 0.112, q 64 0.109 / 0.200, q 128 0.115 / 0.398:
// level at 32, the forward 1.8x from 64. FLASHATTN_KVCACHE_PREFILL_MIN_Q=n (read
// on every call, as the other switches) moves the threshold for a sweep (a
// huge n keeps every call on the decoding kernel).
constexpr int64_t kPrefillMinSeqlenQ = 32;

int64_t prefill_min_seqlen_q() {
  const char* value = std::getenv("FLASHATTN_KVCACHE_PREFILL_MIN_Q");
  if (value == nullptr || *value == '\0') return kPrefillMinSeqlenQ;
  char* end = nullptr;
  const long long n = std::strtoll(value, &end, 10);
  return (end != nullptr && *end == '\0' && n >= 1) ? n : kPrefillMinSeqlenQ;
}

// Whether a call is a prefill the TMA forward runs as a dense batch with
// per-entry key lengths: a long query and num_splits automatic or 1 (an
// explicit split count is the decoding kernel's), against a contiguous cache
// (with or without cache_batch_idx / cache_leftpad) or a paged one (pages of
// a multiple of 16 keys, without cache_leftpad: flash-attn has no paged cache
// with left padding, the decoding kernel runs that); the forward reads the
// cache through KvCacheView (flash_params.h). The Python side has applied
// rotary to q and appended k / v before the op (seqlens_k is then
// cache_seqlens + seqlen_new). An sm90 device (FLASHATTN_DISABLE_SM90 keeps
// it off, as for the forward); run_fwd may still decline (TMA disabled or
// unable to describe a tensor, a head dim without the kernel): the decoding
// kernel runs then.
bool prefill_route(const KvcacheInputs& in, int64_t num_splits) {
  if (in.q.size(1) < prefill_min_seqlen_q() || num_splits > 1) return false;
  if (in.block_table && (in.leftpad || in.k_cache.size(1) % 16 != 0)) return false;
  if (device_arch(in.q) != 90) return false;
  // The forward's persistent scheduler counts tiles in an int (64-row bound, as fwd_cuda checks).
  return (in.q.size(1) + 63) / 64 * in.q.size(0) * in.q.size(2) <= std::numeric_limits<int32_t>::max();
}

// The prefill as a forward call: the KvcacheParams' pointers and strides (the
// same QkvoParams: q, cache, out, lse in the dense layouts; a paged cache's
// batch stride is its block stride), the cache's capacity as seqlen_k,
// cache_seqlens (after the append) as seqused_k, the page table, cache rows
// and left padding as the KvCacheView, the windows bottom-right per batch
// row. cudaErrorNotSupported: nothing ran.
template <typename T, int kHeadDim>
cudaError_t run_prefill(const KvcacheParams& kp, int* tile_counter, cudaStream_t stream) {
  AttnFwdParams p;
  static_cast<QkvoParams&>(p) = kp;
  p.batch = kp.batch;
  p.heads_q = kp.heads_q;
  p.heads_kv = kp.heads_kv;
  p.seqlen_q = kp.seqlen_q;
  p.seqlen_k = kp.capacity;
  p.head_dim = kp.head_dim;
  p.dtype = std::is_same_v<T, __nv_bfloat16> ? ScalarKind::kBFloat16 : ScalarKind::kFloat16;
  p.softmax_scale = kp.softmax_scale;
  p.softmax_scale_log2 = kp.softmax_scale_log2;
  p.mask.window_left = kp.window_left;
  p.mask.window_right = kp.window_right;
  p.mask.bottom_right = true;  // per entry: seqused_k[b] - seqlen_q (SeqInfo)
  p.score_mod = kp.score_mod;  // ALiBi's distance per entry too: SeqInfo's seqused_k[b] - seqlen_q
  p.device_arch = 90;
  p.allow_tma = !env_flag("FLASHATTN_DISABLE_TMA");
  p.seqused_k = kp.seqlens_k;
  p.kv.cache_rows = kp.cache_rows;
  p.kv.batch_idx = kp.batch_idx;
  p.kv.leftpad = kp.leftpad;
  if (kp.block_table != nullptr) {
    p.kv.block_table = kp.block_table;
    p.kv.table_batch_stride = kp.block_table_batch_stride;
    p.kv.page_size = kp.page_size;
    p.kv.max_blocks = kp.capacity / kp.page_size;
  }
  p.tile_counter = tile_counter;  // (the tiles differ: seqused_k)
  return run_fwd<T, kHeadDim>(p, stream);
}

std::tuple<at::Tensor, at::Tensor> fwd_kvcache_cuda_impl(
    const at::Tensor& q_in, const at::Tensor& k_cache_in, const at::Tensor& v_cache_in, const at::Tensor& seqlens_k_in,
    const std::optional<at::Tensor>& batch_idx_in, const std::optional<at::Tensor>& leftpad_in,
    const std::optional<at::Tensor>& block_table_in, double softmax_scale, int64_t window_left, int64_t window_right,
    int64_t num_splits, double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  check_kvcache(
      {q_in, k_cache_in, v_cache_in, seqlens_k_in, batch_idx_in, leftpad_in, block_table_in, softcap, alibi_slopes},
      softmax_scale, window_left, window_right, num_splits, kCudaSpec);
  check_device(q_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const int64_t head_dim = q_in.size(3);
  const int kdim = kernel_head_dim(head_dim);

  // The kernels copy 16-byte chunks (binding_util.h): a head dim that is not a
  // multiple of 8, or an oddly strided cache, is copied padded, for the caches
  // the whole cache on every call (the README says so).
  const at::Tensor q = make_kernel_ready(q_in);
  const at::Tensor k_cache = make_kernel_ready(k_cache_in), v_cache = make_kernel_ready(v_cache_in);
  // The integer vectors are read as plain arrays (a copy only for a strided view).
  const at::Tensor seqlens_k = seqlens_k_in.contiguous();
  const std::optional<at::Tensor> batch_idx = batch_idx_in ? std::optional(batch_idx_in->contiguous()) : std::nullopt;
  const std::optional<at::Tensor> leftpad = leftpad_in ? std::optional(leftpad_in->contiguous()) : std::nullopt;
  std::optional<at::Tensor> block_table = block_table_in;
  if (block_table && block_table->size(1) > 1 && block_table->stride(1) != 1) block_table = block_table->contiguous();

  auto [out, lse] = alloc_kvcache_outputs(q);
  const KvcacheInputs in{q, k_cache, v_cache, seqlens_k, batch_idx, leftpad, block_table, softcap, alibi_slopes};
  const int64_t capacity = kvcache_capacity(in);
  if (out.numel() == 0) return {unpad(out, head_dim), lse};
  if (capacity == 0 || k_cache.size(0) == 0) {  // no key anywhere: zeros, lse -inf
    out.zero_();
    lse.fill_(-std::numeric_limits<double>::infinity());
    return {unpad(out, head_dim), lse};
  }

  KvcacheParams params = make_kvcache_params(in, out, lse, softmax_scale, window_left, window_right);
  const auto stream = at::cuda::getCurrentCUDAStream().stream();
  if (prefill_route(in, num_splits)) {
    const at::Tensor tile_counter = zeroed_tile_counter(q);
    const cudaError_t err = with_element_type(q.scalar_type(), [&](auto elem) {
      return with_kernel_head_dim(kdim, [&](auto dim) {
        return run_prefill<decltype(elem), decltype(dim)::value>(params, tile_counter.data_ptr<int>(), stream);
      });
    });
    if (err != cudaErrorNotSupported) {
      TORCH_CHECK(err == cudaSuccess, "flashattn_ext: CUDA forward kernel (head dim ", kdim,
                  ") failed on flash_attn_with_kvcache's prefill: ", cudaGetErrorString(err));
      return {unpad(out, head_dim), lse};
    }
  }
  launch_decode(params, num_splits, kdim, q, "flash_attn_with_kvcache");
  return {unpad(out, head_dim), lse};
}

}  // namespace
}  // namespace flashattn

TORCH_LIBRARY_IMPL(flashattn_ext, CUDA, m) {
  m.impl("fwd_kvcache", &flashattn::fwd_kvcache_entry<&flashattn::fwd_kvcache_cuda_impl>);
}
