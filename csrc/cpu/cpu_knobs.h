// Environment knobs of the CPU kernels, read at each call (so that a
// benchmark can time a choice beside the default in one process, as the CUDA
// path's FLASHATTN_DISABLE_TMA does):
//
//   FLASHATTN_CPU_NO_KEY_SPLIT=1   no flash-decoding key split (flash_cpu_fwd.cpp)
#pragma once

#include <cstdlib>
#include <cstring>

namespace flashattn {
namespace cpu {

inline bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

}  // namespace cpu
}  // namespace flashattn
