// The binding layer of flashattn_ext::kvcache_append_rotary (rotary on q and
// the new keys, the append into the KV cache), shared by the CPU and CUDA
// kernels: argument validation (shapes, dtypes, devices; each error names the
// argument and the fix; flashattn_ext/_ops.py's fake kernel makes the same
// checks in the same words), the output and the torch-free AppendRotaryParams.
// The integer tensors' values are not read here (the kernels clamp them).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "append_rotary_params.h"
#include "attention_api.h"

namespace flashattn {

struct AppendRotaryInputs {
  const std::optional<at::Tensor>& q;
  const std::optional<at::Tensor>& k;
  const std::optional<at::Tensor>& v;
  const at::Tensor& k_cache;
  const at::Tensor& v_cache;
  const at::Tensor& cache_seqlens;
  const std::optional<at::Tensor>& batch_idx;
  const std::optional<at::Tensor>& block_table;
  const std::optional<at::Tensor>& rotary_cos;
  const std::optional<at::Tensor>& rotary_sin;
  bool interleaved;
  bool q_per_token;
};

// Validates everything but the integer tensors' values.
void check_append_rotary(const AppendRotaryInputs& in, const BackendSpec& spec);

// The op's result: q rotated (a contiguous copy of q's shape; a plain copy
// without rotary tables), or an empty (0,) tensor when q is None.
at::Tensor alloc_append_rotary_output(const AppendRotaryInputs& in);

// Fills the params (sizes, strides, pointers) for a checked call.
AppendRotaryParams make_append_rotary_params(const AppendRotaryInputs& in, const at::Tensor& q_out);

}  // namespace flashattn
