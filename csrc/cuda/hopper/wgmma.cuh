// Hopper (sm90a) warpgroup matrix products: shared-memory matrix descriptors
// and the fences that order wgmma.mma_async against ordinary instructions.
//
// The tiles are the SmemTile layout of ../tile.cuh with 64-element panels:
// each row of a panel is 128 bytes and its 16-byte chunks are XOR-swizzled with
// (row & 7). That is exactly wgmma's 128-byte swizzle (address bits 4-6 XOR
// bits 7-9) provided every panel starts on a 1024-byte boundary, so the same
// tiles, filled by the same cp.async copies, feed ldmatrix and wgmma alike.
#pragma once

#include "../ptx.cuh"
#include "wgmma_ops.cuh"

namespace flashattn {

// Descriptor of a 128-byte-swizzled operand starting at shared address `addr`.
//   K-major  (rows x 16 contraction columns): sbo = 1024 (the next 8 rows), lbo unused.
//   MN-major (16 contraction rows x N columns): sbo = 1024 (the next 8
//     contraction rows), lbo = the distance between 64-column panels.
// Moving the start by a multiple of 16 bytes moves the operand: the swizzle is
// applied to the final address, so a k-step inside a panel is +32 bytes (K-major).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(lbo_bytes >> 4) << 16) | (uint64_t(sbo_bytes >> 4) << 32) |
         (uint64_t(1) << 62);
}

// Byte offsets are added to a descriptor's start-address field (bits 0-13).
__device__ __forceinline__ uint64_t desc_add(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

// The byte offset of k-step ks (16 columns) of a K-major operand stored as
// 64-column panels of panel_bytes each: 32 bytes a step inside a panel.
__device__ __forceinline__ uint32_t kmajor_step(int ks, uint32_t panel_bytes) {
  return (ks / 4) * panel_bytes + (ks % 4) * 32;
}

// Before the first wgmma of a batch: register writes by ordinary instructions
// (cleared accumulators, packed A fragments) become visible to it.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Wait until at most N committed groups of this warpgroup are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Shared-memory writes of the generic proxy (st.shared, cp.async) become
// visible to wgmma (the async proxy); a barrier must follow for other threads.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Keeps the compiler from moving reads or writes of an accumulator across
// this point (wgmma writes it asynchronously, behind the compiler's back).
template <int kN>
__device__ __forceinline__ void pin_registers(float (&acc)[kN][4]) {
#pragma unroll
  for (int i = 0; i < kN; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(acc[i][e])::"memory");
}

}  // namespace flashattn
