// CPU implementation of flashattn_ext::kvcache_append_rotary: one parallel
// loop over the (batch row, token) pairs; each writes q's row rotated into the
// output and the new key (rotated) and value rows into the cache, at the
// positions and clamps of append_rotary_params.h (the CUDA kernel's rules).
//
// The rotation is computed as the Python path computed it, element by element
// in the same order, so the results are bitwise those of
//   x1 * c - x2 * s,  x1 * s + x2 * c
// in the accumulation dtype (float32 for float16 / bfloat16, float64 for
// float32 / float64: reference.compute_dtype), rounded once to the dtype:
// each product rounded on its own, never contracted into an FMA (the pragmas
// below; GCC's C++ default, -ffp-contract=fast, would fuse them wherever the
// target has FMA: aarch64, or x86 built with -march=native).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <type_traits>

#include "../append_rotary_api.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace flashattn {
namespace {

const BackendSpec kCpuSpec{"CPU", {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}, ""};

template <typename T>
using Acc = std::conditional_t<std::is_same_v<T, float> || std::is_same_v<T, double>, double, float>;

// One head row (head_dim elements, stride `stride`) from src into dst (unit
// stride), its first rotary_dim elements rotated by the angles of table row
// `pos` (pos < 0: no rotary, a copy).
template <typename T>
void rotate_row(const AppendRotaryParams& p, const T* src, int64_t stride, T* dst, int64_t pos) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  const int64_t ro = pos >= 0 ? p.rotary_dim : 0;
  for (int64_t j = 0; j < ro; ++j) {
    const RotaryPair pair = rotary_pair(p, j);
    const T* cos = static_cast<const T*>(p.cos) + pos * p.cos_row_stride + pair.column * p.cos_col_stride;
    const T* sin = static_cast<const T*>(p.sin) + pos * p.sin_row_stride + pair.column * p.sin_col_stride;
    const Acc<T> c = static_cast<Acc<T>>(*cos), s = static_cast<Acc<T>>(*sin);
    const Acc<T> x = static_cast<Acc<T>>(src[j * stride]), y = static_cast<Acc<T>>(src[pair.partner * stride]);
    const Acc<T> x1 = pair.first ? x : y, x2 = pair.first ? y : x;
    Acc<T> r;
    if (pair.first) {
      const Acc<T> a = x1 * c;
      const Acc<T> b = x2 * s;
      r = a - b;
    } else {
      const Acc<T> a = x1 * s;
      const Acc<T> b = x2 * c;
      r = a + b;
    }
    dst[j] = static_cast<T>(r);
  }
  for (int64_t j = ro; j < p.head_dim; ++j) dst[j] = src[j * stride];
}

template <typename T>
void run(const AppendRotaryParams& p) {
  const int64_t rows = std::max(p.q ? p.seqlen_q : 0, p.seqlen_new);
  const bool rotary = p.rotary_dim > 0;
  at::parallel_for(0, p.batch * rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / rows, i = t % rows;
      const int64_t s = p.seqlens[b];
      if (p.q && i < p.seqlen_q) {
        const T* src = static_cast<const T*>(p.q) + b * p.q_batch_stride + i * p.q_row_stride;
        T* dst = static_cast<T*>(p.q_out) + ((b * p.seqlen_q + i) * p.heads_q) * p.head_dim;
        const int64_t pos = rotary ? q_rotary_position(p, s, i) : -1;
        for (int64_t h = 0; h < p.heads_q; ++h) {
          rotate_row(p, src + h * p.q_head_stride, p.q_dim_stride, dst + h * p.head_dim, pos);
        }
      }
      if (p.k && i < p.seqlen_new) {
        const int64_t pos = append_position(p, s, i);
        const CacheSlot slot = cache_slot(p, b, pos);
        const int64_t pos_k = rotary ? k_rotary_position(p, pos) : -1;
        const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + i * p.k_row_stride;
        const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + i * p.v_row_stride;
        T* kc = static_cast<T*>(p.k_cache) + slot.row * p.kc_batch_stride + slot.offset * p.kc_row_stride;
        T* vc = static_cast<T*>(p.v_cache) + slot.row * p.vc_batch_stride + slot.offset * p.vc_row_stride;
        for (int64_t h = 0; h < p.heads_kv; ++h) {
          rotate_row(p, k + h * p.k_head_stride, p.k_dim_stride, kc + h * p.kc_head_stride, pos_k);
          rotate_row(p, v + h * p.v_head_stride, p.v_dim_stride, vc + h * p.vc_head_stride, -1);
        }
      }
    }
  });
}

at::Tensor kvcache_append_rotary_cpu(const std::optional<at::Tensor>& q, const std::optional<at::Tensor>& k,
                                     const std::optional<at::Tensor>& v, at::Tensor& k_cache, at::Tensor& v_cache,
                                     const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& batch_idx,
                                     const std::optional<at::Tensor>& block_table,
                                     const std::optional<at::Tensor>& rotary_cos,
                                     const std::optional<at::Tensor>& rotary_sin, bool interleaved, bool q_per_token) {
  // The integer tensors are read through their pointers: contiguous copies
  // where they are not (a no-op for the usual ones).
  const at::Tensor seqlens = cache_seqlens.contiguous();
  const AppendRotaryInputs in{q,         k,           v,          k_cache,    v_cache,     seqlens,
                              batch_idx, block_table, rotary_cos, rotary_sin, interleaved, q_per_token};
  check_append_rotary(in, kCpuSpec);
  const std::optional<at::Tensor> idx = batch_idx ? std::optional<at::Tensor>(batch_idx->contiguous()) : std::nullopt;
  const AppendRotaryInputs inc{q,   k,           v,          k_cache,    v_cache,     seqlens,
                               idx, block_table, rotary_cos, rotary_sin, interleaved, q_per_token};
  at::Tensor q_out = alloc_append_rotary_output(inc);
  const AppendRotaryParams p = make_append_rotary_params(inc, q_out);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_cache.scalar_type(), "kvcache_append_rotary",
                                  [&] { run<scalar_t>(p); });
  return q_out;
}

}  // namespace
}  // namespace flashattn

TORCH_LIBRARY_IMPL(flashattn_ext, CPU, m) { m.impl("kvcache_append_rotary", &flashattn::kvcache_append_rotary_cpu); }
