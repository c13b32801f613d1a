// CPU memory of 2 MiB and more on transparent huge pages: the CPU kernels'
// large scratch (ScratchArray, work_queue.h: the forward's layout of all value
// tiles) and the tensors they return (out, dq, dk, dv). Both are read and
// written tile by tile across many pages: on 4 KiB pages a fresh buffer costs a
// fault per page on first touch and the tile walks miss the TLB. On the 2-core
// AVX2 EPYC (THP "madvise", b4 h16 n1k d128 float32 forward, one thread) the
// scratch on huge pages took ours / torch's from 1.04-1.06 to 0.99, the output
// too to 0.96 (benchmarks/cpu_perf_log.md, session 25). torch's own allocator
// does the same only with THP_MEM_ALLOC_ENABLE=1.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

#include <cstddef>

namespace flashattn {
namespace cpu {

// 64-byte aligned, uninitialized; from 2 MiB on, 2 MiB aligned and advised
// onto huge pages (madvise MADV_HUGEPAGE; where the kernel gives none, plain
// pages). Freed by free_huge.
void* alloc_huge(size_t bytes);
void free_huge(void* p);

// at::empty(sizes, options) for a CPU tensor, its storage from alloc_huge (a
// normal resizable tensor; its memory goes past c10's CPU allocator, so torch's
// memory profiler does not count it).
at::Tensor empty_huge(at::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace cpu
}  // namespace flashattn
