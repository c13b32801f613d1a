// Tiled FlashAttention on the CPU: forward in flash_cpu_fwd.cpp, backward in
// flash_cpu_bwd.cpp, built from the tile products of tile_gemm.h and the
// element-wise tile operations of tile_ops.h.
#pragma once

#include "../flash_params.h"

namespace flashattn {

// Fills o and lse. Inputs of any strides with a unit head_dim stride;
// float32, float64, bfloat16, float16, accumulating in float32 (float64).
void run_fwd_cpu(const AttnFwdParams& params);

// Several independent forward calls of one dtype (the batch rows of a KV-cache
// call) as one parallel loop: their items share the threads, and a
// decoding-shaped call splits its keys over them (flash-decoding) counting
// the items of all.
void run_fwd_cpu(const AttnFwdParams* calls, int64_t num_calls);

// Whether run_fwd_cpu takes a call on its few-queries (decoding) path, the one
// that also reads a paged KV cache in place (AttnFwdParams::kv; the tiled path
// takes keys one row stride apart: a paged call it would run must be gathered
// first, paged_gather.h).
bool fwd_cpu_runs_few_queries(const AttnFwdParams& p);

// The score mod of batch row b as a call of its own (a batch of one: row b's
// ALiBi slopes): the CPU KV-cache ops run one call per row.
inline ScoreMod score_mod_of_row(const ScoreMod& m, int64_t b) {
  ScoreMod row = m;
  if (row.has_alibi()) row.alibi_slopes += b * m.alibi_batch_stride, row.alibi_batch_stride = 0;
  return row;
}

// Fills dq, dk, dv from dout, q, k, v, o, lse; deterministic.
void run_bwd_cpu(const AttnBwdParams& params);

// Whether the backward's float32 products read the q, dO, k and v tiles from
// contiguous copies (true) or in place (flash_cpu_bwd.cpp bwd_tile_operand:
// the machine's rule, or the test knob bwd_tiles_in_place).
bool bwd_cpu_copies_tiles();

}  // namespace flashattn
