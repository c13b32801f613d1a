// Thin wrappers over the sm80+ instructions the kernels are built from:
// cp.async (global -> shared without registers), ldmatrix (shared -> the
// register fragments of mma.sync) and mma.sync m16n8k16 with fp32 accumulation;
// and the sm90 grid dependency controls of programmatic dependent launch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace flashattn {

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// A 32-bit word at a shared-memory address (smem_u32).
__device__ __forceinline__ void st_shared(uint32_t addr, int value) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(value) : "memory");
}
__device__ __forceinline__ int ld_shared(uint32_t addr) {
  int value;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(value) : "r"(addr) : "memory");
  return value;
}

// 16-byte global -> shared copy that reads only the first src_bytes (0 .. 16)
// and zero-fills the rest (a chunk running past the end of a row; src must
// still be a valid, 16-byte aligned address).
__device__ __forceinline__ void cp_async_16_zfill(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// The whole 16 bytes, or (!pred) zeros and nothing read.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool pred) {
  cp_async_16_zfill(dst, src, pred ? 16 : 0);
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most N groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// D = A * B + D for a 16x8 tile; A 16x16 row-major, B 16x8 column-major.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                         const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two floats -> one register holding two 16-bit values (lo in the low half).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ __forceinline__ float to_float<__half>(__half x) {
  return __half2float(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 2^x on the FMA pipe, for x <= 0 (softmax exponents after the max shift),
// so that a kernel can move part of its exponentials off the MUFU unit (16
// results a clock an SM on Hopper: at head dim 64 the forward's exponentials
// take as long as its tensor-core work). x = n + f with n = round(x), |f| <= 1/2;
// 2^f by a degree-3 polynomial (minimax relative error 1.0e-4 with the constant
// term exactly 1: under half an ulp of fp16, the precision P is rounded to) and
// 2^n as a float built from n's bits. Exact where it matters: 2^0 = 1, and
// x <= -127 (masked -inf included) gives +0 (the scale's exponent field is 0);
// NaN stays NaN (max.NaN keeps it, and NaN * scale is NaN), as ex2 does, so the
// non-finite rule sees it. Nine instructions (FMNMX, 3 FADD, 3 FFMA, SHL, FMUL)
// against MUFU.EX2's one issue slot and eight MUFU cycles a warp.
__device__ __forceinline__ float poly_exp2(float x) {
  float xc;
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(xc) : "f"(x), "f"(-127.f));
  // 1.5 * 2^23 rounds to an integer in the mantissa; + 127 puts n + 127 (the
  // biased exponent) in its low bits.
  constexpr float kMagic = 12582912.f + 127.f;
  const float t = __fadd_rn(xc, kMagic);
  const float f = __fsub_rn(xc, __fsub_rn(t, kMagic));  // in [-1/2, 1/2]
  float p = __fmaf_rn(0.05500906f, f, 0.24221097f);
  p = __fmaf_rn(p, f, 0.6932829f);
  p = __fmaf_rn(p, f, 1.f);
  const float scale = __uint_as_float(__float_as_uint(t) << 23);  // 2^n; 0 at n = -127
  return __fmul_rn(p, scale);
}

// Reductions over the 4 lanes of a quad: the lanes that hold one accumulator row.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// Float atomics into the fp32 dq accumulator; Hopper has a 2-wide form.
__device__ __forceinline__ void atomic_add2(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(a, b));
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

// Programmatic dependent launch (sm90+; the host side is pdl_launch.h). A
// kernel launched with programmatic stream serialization may start while the
// previous kernel of its stream still runs: pdl_wait() blocks until that grid
// has completed and its memory writes are visible, so it must come before the
// first access to anything the previous kernel writes (or reads, if this kernel
// writes it). pdl_launch_dependents() lets the next kernel's CTAs be scheduled
// once every CTA of this grid has executed it or exited; it orders no memory
// (the dependent's pdl_wait does), so any point is correct and only the
// timing changes. Both are no-ops on a plain launch and below sm90.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// exp(x) = exp2(x * kLog2e): the kernels keep scores in log2 units.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

}  // namespace flashattn
