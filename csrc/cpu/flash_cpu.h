// Tiled FlashAttention on the CPU (see flash_cpu.cpp).
#pragma once

#include "../flash_params.h"

namespace flashattn {

void run_fwd_cpu(const AttnFwdParams& params);
void run_bwd_cpu(const AttnBwdParams& params);

}  // namespace flashattn
