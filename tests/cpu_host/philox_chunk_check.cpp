// Host check of the CPU kernels' Philox draw (csrc/cpu/dropout.cpp): every
// version of philox_chunk this CPU can run (AVX-512, AVX2, the portable loop),
// called directly rather than through the load-time choice that the kernels
// and the Python tests get, must give philox.h's philox4x32_10 words for every
// query of its chunk, over key groups, seeds, planes and query counters that
// wrap at 2^32. Built by tests/test_dropout.py with the host compiler; prints
// "N words, M mismatches (versions: ...)" and exits non-zero on a mismatch.
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "../../csrc/cpu/dropout.cpp"

using namespace flashattn;
using Words = uint32_t[64];
using ChunkFn = void (*)(uint32_t, uint32_t, uint64_t, uint64_t, Words&, Words&, Words&, Words&);

#if FLASHATTN_HAVE_SIMD_CLONES
// GCC names a function version after its mangled name plus the target (the
// default version keeps the plain name); asm labels reach each one directly.
#define FLASHATTN_PHILOX_CHUNK "_ZN9flashattn3cpu12_GLOBAL__N_112philox_chunkEjjmmRA64_jS3_S3_S3_"
void chunk_avx512(uint32_t, uint32_t, uint64_t, uint64_t, Words&, Words&, Words&,
                  Words&) __asm__(FLASHATTN_PHILOX_CHUNK ".arch_x86_64_v4");
void chunk_avx2(uint32_t, uint32_t, uint64_t, uint64_t, Words&, Words&, Words&,
                Words&) __asm__(FLASHATTN_PHILOX_CHUNK ".arch_x86_64_v3");
void chunk_default(uint32_t, uint32_t, uint64_t, uint64_t, Words&, Words&, Words&,
                   Words&) __asm__(FLASHATTN_PHILOX_CHUNK);
#endif

namespace {

uint64_t state = 0x9E3779B97F4A7C15ull;
uint64_t next() {  // splitmix64
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

int main() {
  struct Version {
    const char* name;
    ChunkFn fn;
  };
  Version versions[3];
  int count = 0;
#if FLASHATTN_HAVE_SIMD_CLONES
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512cd") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    versions[count++] = {"avx512", chunk_avx512};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2"))
    versions[count++] = {"avx2", chunk_avx2};
  versions[count++] = {"default", chunk_default};
#else
  versions[count++] = {"portable", [](uint32_t u, uint32_t i0, uint64_t plane, uint64_t seed, Words& x0, Words& x1,
                                      Words& x2, Words& x3) { cpu::philox_chunk(u, i0, plane, seed, x0, x1, x2, x3); }};
#endif
  long n = 0, bad = 0;
  for (int it = 0; it < 4000; ++it) {
    const uint32_t u = static_cast<uint32_t>(next());
    // Every third chunk's counters wrap at 2^32 (i0 + c for c < 64).
    const uint32_t i0 = it % 3 == 0 ? 0xFFFFFFFFu - static_cast<uint32_t>(next() % 64) : static_cast<uint32_t>(next());
    const uint64_t plane = it % 5 == 0 ? 0xFFFFFFFFull - it % 7 : next(), seed = next();
    for (int v = 0; v < count; ++v) {
      Words x[4];
      std::memset(x, 0, sizeof x);
      versions[v].fn(u, i0, plane, seed, x[0], x[1], x[2], x[3]);
      for (uint32_t c = 0; c < 64; ++c) {
        const Philox4 r = philox4x32_10(u, i0 + c, static_cast<uint32_t>(plane), static_cast<uint32_t>(plane >> 32),
                                        static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
        for (int w = 0; w < 4; ++w, ++n) {
          if (r.x[w] != x[w][c] && ++bad <= 5)
            std::printf("mismatch (%s): u %u i %u word %d: %08x, want %08x\n", versions[v].name, u, i0 + c, w, x[w][c],
                        r.x[w]);
        }
      }
    }
  }
  std::printf("%ld words, %ld mismatches (versions:", n, bad);
  for (int v = 0; v < count; ++v) std::printf(" %s", versions[v].name);
  std::printf(")\n");
  return bad == 0 && n > 0 ? 0 : 1;
}
