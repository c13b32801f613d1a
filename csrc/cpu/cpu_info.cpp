// flashattn_ext::cpu_runtime_info: what the CPU kernels do on this machine,
// for benchmarks and tests (an op of no tensors, registered for every
// dispatch key).
#include <torch/library.h>

#include <string>

#include "work_queue.h"

namespace flashattn {
namespace {

// "key=value;...":
//   peak_workers   the most worker threads of the kernels' parallel loops
//                  that ran at once since the last reset (reset_peak=True
//                  reads and restarts it)
std::string cpu_runtime_info(bool reset_peak) {
  return "peak_workers=" + std::to_string(cpu::WorkerBudget::peak_running(reset_peak));
}

}  // namespace
}  // namespace flashattn

TORCH_LIBRARY_FRAGMENT(flashattn_ext, m) {
  m.def("cpu_runtime_info(bool reset_peak=False) -> str", &flashattn::cpu_runtime_info);
}
