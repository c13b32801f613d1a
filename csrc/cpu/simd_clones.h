// FLASHATTN_SIMD_CLONES: compile a hot function several times (AVX-512, AVX2,
// baseline) and pick the best at load time.
//
// The extension is built with the compiler's baseline flags (x86-64 = SSE2),
// so the element-wise tile loops (exp, conversions, transposes) would run at a
// quarter of the vector width the CPU has. GCC's target_clones attribute emits
// one copy per target plus an ifunc resolver, without per-file build flags and
// without requiring those instructions at run time. Functions inlined into a
// cloned function are compiled for the clone's target too, so only the
// tile-level entry points carry the attribute; the helpers they call are
// FLASHATTN_INLINE, forced inline, since a helper the compiler chose to leave
// out of line would run the baseline code. Elsewhere both expand to (almost)
// nothing.
//
// FLASHATTN_HAVE_SIMD_CLONES: 1 where FLASHATTN_SIMD_CLONES clones. A clone
// cannot tell which target it is compiled for, so code that needs one ISA's
// intrinsics (dropout.cpp's Philox rounds) is written as GCC function versions
// instead, __attribute__((target("arch=x86-64-v4"))) / ("arch=x86-64-v3") /
// ("default") of one function, resolved at load time like the clones, under
// #if FLASHATTN_HAVE_SIMD_CLONES with a portable version in the #else.
//
// FLASHATTN_VECTOR_EXT: 1 where GCC-style vector types with
// __builtin_shufflevector / __builtin_convertvector exist (GCC 12+, Clang);
// the 8 x 8 transposes and the double GEMM block use them, with scalar loops
// as the fallback elsewhere (e.g. MSVC). -DFLASHATTN_VECTOR_EXT=0 forces the
// fallback, to test it.
#pragma once

#ifndef FLASHATTN_VECTOR_EXT
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define FLASHATTN_VECTOR_EXT 1
#else
#define FLASHATTN_VECTOR_EXT 0
#endif
#endif

#if defined(__GNUC__)
#define FLASHATTN_INLINE inline __attribute__((always_inline))
#else
#define FLASHATTN_INLINE inline
#endif

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && (__GNUC__ >= 11)
#define FLASHATTN_HAVE_SIMD_CLONES 1
#define FLASHATTN_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FLASHATTN_HAVE_SIMD_CLONES 0
#define FLASHATTN_SIMD_CLONES
#endif
