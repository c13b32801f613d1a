// The element type of a call as a template argument of the CPU kernels.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include "../flash_params.h"

namespace flashattn {
namespace cpu {

// Calls f(scalar_t{}) for the input dtype of the call.
template <typename F>
void with_scalar_type(ScalarKind kind, const char* what, F&& f) {
  switch (kind) {
    case ScalarKind::kFloat32: return f(float{});
    case ScalarKind::kFloat64: return f(double{});
    case ScalarKind::kBFloat16: return f(c10::BFloat16{});
    case ScalarKind::kFloat16: return f(c10::Half{});
  }
  TORCH_CHECK(false, "flashattn_ext: unknown dtype in the CPU ", what);
}

}  // namespace cpu
}  // namespace flashattn
