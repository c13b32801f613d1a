#include "flash_cpu.h"
#include <c10/util/Exception.h>
namespace flashattn {
void run_fwd_cpu(const AttnFwdParams&) { TORCH_CHECK(false, "not yet"); }
void run_bwd_cpu(const AttnBwdParams&) { TORCH_CHECK(false, "not yet"); }
}
