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
#pragma once

#if defined(__GNUC__)
#define FLASHATTN_INLINE inline __attribute__((always_inline))
#else
#define FLASHATTN_INLINE inline
#endif

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && (__GNUC__ >= 11)
#define FLASHATTN_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FLASHATTN_SIMD_CLONES
#endif
