// The split-KV decoding kernels (flash_decode_kernel.cuh) as the CUDA bindings
// launch them: the split count, the fp32 split workspace and the dispatch to
// one (dtype, kernel head dim) instantiation. Two bindings use them:
// fwd_kvcache (kvcache_cuda.cpp) and fwd, for a short query against many keys
// (attention_cuda.cpp: a model's decode step through flash_attn_func or the
// SDPA drop-in), which decode_route below picks.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "../kvcache_params.h"

namespace flashattn {

// The longest query and the fewest keys per query row for which fwd runs on
// the decoding kernels. At most 16 query rows: one 16-row tile per head of a
// group without GQA (a decode step, speculative decoding's few tokens). At
// least 4 keys a query row: below that the main forward's 64-row query blocks
// are not mostly idle. Measured (session 5, benchmarks/route_sweep.py, 32/8
// heads, d128, bf16): at q 2-16 the decoding kernel is 1.3-4.5x faster than
// the main forward (b1, 16k keys, q 8: 46 us against 202); at q 32 level.
constexpr int64_t kDecodeRouteMaxSeqlenQ = 16;
constexpr int64_t kDecodeRouteMinKeysPerQuery = 4;

// Whether fwd runs a dense call (q (batch, seqlen_q, heads_q, head_dim)
// against keys (batch, seqlen_k, heads_kv, head_dim)) on the decoding
// kernels instead of the main forward: a short query against many keys
// (above), the decoding grid's limits (batch on grid.z, heads_kv x query
// tiles on grid.y, 65535 each), and a call whose result is the same there:
// plain (no attn_mask, no dropout, no ALiBi: softcap is elementwise and the
// kernels share it) and a window that is none or aligned bottom-right (the
// decoding kernel's alignment; torch's top-left causal is not). Reads the
// shapes only. FLASHATTN_DISABLE_DECODE_ROUTE=1 (read on every call, as the
// other timing switches) keeps every call on the main forward.
bool decode_route(int64_t batch, int64_t seqlen_q, int64_t heads_q, int64_t heads_kv, int64_t seqlen_k, int kdim,
                  bool plain, bool windowed, bool bottom_right);

// Runs the decoding kernels for params (make_kvcache_params; capacity > 0,
// batch > 0) on the current stream: the split count from num_splits (0:
// automatic, choose_num_splits), its workspace, the launch. Raises, naming
// `caller`, when the grid exceeds its limits or a launch fails.
void launch_decode(KvcacheParams& params, int64_t num_splits, int kdim, const at::Tensor& q, const char* caller);

}  // namespace flashattn
