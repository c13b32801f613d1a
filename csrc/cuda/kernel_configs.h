// The tile configuration chosen for each head dim. Changing a line here is
// how a kernel is retuned; see benchmarks/NOTES.md for the measurements.
#pragma once

#include "dispatch.h"
#include "kernel_traits.h"

namespace flashattn {

template <int kHeadDim, typename T>
struct KernelConfig;

//                                       FwdTraits<D,   M,   N, warps, minBlocks>       BwdTraits<D, M,   N, warps, dsplit, qstages>     BwdDqTraits<D, M, N, warps>
template <typename T> struct KernelConfig<32, T>  { using Fwd = FwdTraits<32,  128, 128, 4, 2, T>; using Bwd = BwdTraits<32,  64, 128, 8, 1, 2, T>; using BwdDq = BwdDqTraits<32,  64, 64, 4, T>; };
template <typename T> struct KernelConfig<64, T>  { using Fwd = FwdTraits<64,  128,  64, 4, 2, T>; using Bwd = BwdTraits<64,  64, 128, 8, 1, 2, T>; using BwdDq = BwdDqTraits<64,  64, 64, 4, T>; };
template <typename T> struct KernelConfig<96, T>  { using Fwd = FwdTraits<96,  128,  64, 4, 2, T>; using Bwd = BwdTraits<96,  64, 128, 8, 1, 2, T>; using BwdDq = BwdDqTraits<96,  64, 64, 4, T>; };
template <typename T> struct KernelConfig<128, T> { using Fwd = FwdTraits<128, 128,  64, 4, 2, T>; using Bwd = BwdTraits<128, 64, 128, 8, 1, 2, T>; using BwdDq = BwdDqTraits<128, 64, 64, 4, T>; };
template <typename T> struct KernelConfig<192, T> { using Fwd = FwdTraits<192, 128,  64, 8, 1, T>; using Bwd = BwdTraits<192, 64,  64, 4, 2, 1, T>; using BwdDq = BwdDqTraits<192, 64, 64, 4, T>; };
template <typename T> struct KernelConfig<256, T> { using Fwd = FwdTraits<256, 128,  64, 8, 1, T>; using Bwd = BwdTraits<256, 64,  64, 4, 2, 1, T>; using BwdDq = BwdDqTraits<256, 64, 64, 4, T>; };

}  // namespace flashattn
