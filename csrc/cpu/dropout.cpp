// The CPU kernels' dropout tiles (dropout.h), compiled per SIMD target.
#include "dropout.h"

#include "simd_clones.h"

#if FLASHATTN_HAVE_SIMD_CLONES
#include <immintrin.h>
#endif

namespace flashattn {
namespace cpu {

namespace {

constexpr int kChunk = 64;  // queries whose Philox calls run together
constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;

// philox.h's philox4x32_10 of the counters (u, i0 + c, plane lo, plane hi),
// c < kChunk, as a structure of arrays: each round is one loop over c of
// 32 x 32 -> 64-bit products and xors, which the compiler turns into vector
// instructions (the call-per-query form of philox.h vectorized only ~1.5x).
// Bit for bit the same words (the tests compare the mask with the oracle's).
// The portable version: the baseline (SSE2) build and other compilers and
// CPUs run it; AVX-512 and AVX2 run the versions below, which compute the same.
FLASHATTN_INLINE void philox_chunk_portable(uint32_t u, uint32_t i0, uint64_t plane, uint64_t seed,
                                            uint32_t (&x0)[kChunk], uint32_t (&x1)[kChunk], uint32_t (&x2)[kChunk],
                                            uint32_t (&x3)[kChunk]) {
  for (int c = 0; c < kChunk; ++c) {
    x0[c] = u;
    x1[c] = i0 + static_cast<uint32_t>(c);
    x2[c] = static_cast<uint32_t>(plane);
    x3[c] = static_cast<uint32_t>(plane >> 32);
  }
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    for (int c = 0; c < kChunk; ++c) {
      const uint64_t p0 = static_cast<uint64_t>(kM0) * x0[c], p1 = static_cast<uint64_t>(kM1) * x2[c];
      const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ x1[c] ^ k0;
      const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ x3[c] ^ k1;
      x0[c] = n0, x1[c] = static_cast<uint32_t>(p1), x2[c] = n2, x3[c] = static_cast<uint32_t>(p0);
    }
    k0 += kW0, k1 += kW1;
  }
}

#if FLASHATTN_HAVE_SIMD_CLONES
// The AVX-512 and AVX2 versions: the draw alone ~2x as fast as the portable
// loop compiled for the same targets (both, on a Zen 4 core). GCC has no
// widening 32 x 32 -> 64-bit multiply of a zmm register of 16 words, so for
// AVX-512 the portable loop zero-extends the words to 64 bits, multiplies them
// with vpmullq (a full 64 x 64-bit product, slower than vpmuludq's 32 x 32 ->
// 64) and packs the halves back with permutes; for AVX2 it multiplies with
// vpmuludq but shuffles the words into its even lanes and back in every round,
// and keeps the state in memory. Here each query's four words live in the low
// halves of 64-bit lanes for all ten rounds, which is what vpmuludq
// (_mm512_mul_epu32 / _mm256_mul_epu32) multiplies: the low 32 bits of each
// lane, unsigned, to a 64-bit product, philox_mulhilo's lo in the low half and
// hi in the high half, so one shift brings hi down and lo is already in place.
// The high halves hold junk between rounds (a product's hi next to the lo kept
// as a word, and what the xors make of it): nothing reads them, and the words
// are truncated to 32 bits at the end. A few vectors of queries go through each
// round together so that the multiplies' latencies overlap (more than these
// spill registers: slower).

// AVX-512: 4 vectors of 8 queries at a time (16 state registers of 32).
#pragma GCC diagnostic push
// GCC 12.1 / 12.2's avx512fintrin.h trips -Wuninitialized on its own
// _mm512_undefined placeholders once inlined (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wuninitialized"
__attribute__((target("arch=x86-64-v4"))) void philox_chunk(uint32_t u, uint32_t i0, uint64_t plane, uint64_t seed,
                                                            uint32_t (&x0)[kChunk], uint32_t (&x1)[kChunk],
                                                            uint32_t (&x2)[kChunk], uint32_t (&x3)[kChunk]) {
  constexpr int kLanes = 8, kVecs = 4;
  const __m512i m0 = _mm512_set1_epi64(kM0), m1 = _mm512_set1_epi64(kM1);
  const __m512i lane = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
  for (int c0 = 0; c0 < kChunk; c0 += kLanes * kVecs) {
    __m512i a[kVecs], b[kVecs], c[kVecs], d[kVecs];  // words 0, 1, 2, 3
    for (int v = 0; v < kVecs; ++v) {
      a[v] = _mm512_set1_epi64(u);
      // The low halves wrap like the uint32_t counter i0 + c does.
      b[v] = _mm512_add_epi64(_mm512_set1_epi64(i0 + static_cast<uint32_t>(c0 + kLanes * v)), lane);
      c[v] = _mm512_set1_epi64(static_cast<uint32_t>(plane));
      d[v] = _mm512_set1_epi64(static_cast<uint32_t>(plane >> 32));
    }
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    for (int round = 0; round < 10; ++round) {
      const __m512i key0 = _mm512_set1_epi64(k0), key1 = _mm512_set1_epi64(k1);
      for (int v = 0; v < kVecs; ++v) {
        const __m512i p0 = _mm512_mul_epu32(a[v], m0), p1 = _mm512_mul_epu32(c[v], m1);
        a[v] = _mm512_ternarylogic_epi64(_mm512_srli_epi64(p1, 32), b[v], key0, 0x96);  // 0x96: a ^ b ^ c
        c[v] = _mm512_ternarylogic_epi64(_mm512_srli_epi64(p0, 32), d[v], key1, 0x96);
        b[v] = p1, d[v] = p0;
      }
      k0 += kW0, k1 += kW1;
    }
    for (int v = 0; v < kVecs; ++v) {
      const int o = c0 + kLanes * v;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x0 + o), _mm512_cvtepi64_epi32(a[v]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x1 + o), _mm512_cvtepi64_epi32(b[v]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x2 + o), _mm512_cvtepi64_epi32(c[v]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x3 + o), _mm512_cvtepi64_epi32(d[v]));
    }
  }
}

#pragma GCC diagnostic pop

// The low halves of the lanes of lo and hi as 8 consecutive words at dst.
__attribute__((target("arch=x86-64-v3"), always_inline)) inline void store_low_halves(uint32_t* dst, __m256i lo,
                                                                                      __m256i hi) {
  const __m256 w = _mm256_shuffle_ps(_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi), 0x88);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute4x64_epi64(_mm256_castps_si256(w), 0xd8));
}

// AVX2: 2 vectors of 4 queries at a time (8 state registers of 16).
__attribute__((target("arch=x86-64-v3"))) void philox_chunk(uint32_t u, uint32_t i0, uint64_t plane, uint64_t seed,
                                                            uint32_t (&x0)[kChunk], uint32_t (&x1)[kChunk],
                                                            uint32_t (&x2)[kChunk], uint32_t (&x3)[kChunk]) {
  constexpr int kLanes = 4, kVecs = 2;
  const __m256i m0 = _mm256_set1_epi64x(kM0), m1 = _mm256_set1_epi64x(kM1);
  const __m256i lane = _mm256_set_epi64x(3, 2, 1, 0);
  for (int c0 = 0; c0 < kChunk; c0 += kLanes * kVecs) {
    __m256i a[kVecs], b[kVecs], c[kVecs], d[kVecs];  // words 0, 1, 2, 3
    for (int v = 0; v < kVecs; ++v) {
      a[v] = _mm256_set1_epi64x(u);
      b[v] = _mm256_add_epi64(_mm256_set1_epi64x(i0 + static_cast<uint32_t>(c0 + kLanes * v)), lane);
      c[v] = _mm256_set1_epi64x(static_cast<uint32_t>(plane));
      d[v] = _mm256_set1_epi64x(static_cast<uint32_t>(plane >> 32));
    }
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    for (int round = 0; round < 10; ++round) {
      const __m256i key0 = _mm256_set1_epi64x(k0), key1 = _mm256_set1_epi64x(k1);
      for (int v = 0; v < kVecs; ++v) {
        const __m256i p0 = _mm256_mul_epu32(a[v], m0), p1 = _mm256_mul_epu32(c[v], m1);
        a[v] = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p1, 32), b[v]), key0);
        c[v] = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p0, 32), d[v]), key1);
        b[v] = p1, d[v] = p0;
      }
      k0 += kW0, k1 += kW1;
    }
    store_low_halves(x0 + c0, a[0], a[1]);
    store_low_halves(x1 + c0, b[0], b[1]);
    store_low_halves(x2 + c0, c[0], c[1]);
    store_low_halves(x3 + c0, d[0], d[1]);
  }
}

// The versions are resolved at load time, like FLASHATTN_SIMD_CLONES; every
// clone of dropout_keep_tile calls them through the ifunc, out of line: one
// call per 64 queries of 8 keys, noise next to its 1280 products. (The kernels
// reach one version per CPU; tests/cpu_host/philox_chunk_check.cpp calls each.)
__attribute__((target("default"))) void philox_chunk(uint32_t u, uint32_t i0, uint64_t plane, uint64_t seed,
                                                     uint32_t (&x0)[kChunk], uint32_t (&x1)[kChunk],
                                                     uint32_t (&x2)[kChunk], uint32_t (&x3)[kChunk]) {
  philox_chunk_portable(u, i0, plane, seed, x0, x1, x2, x3);
}
#else
FLASHATTN_INLINE void philox_chunk(uint32_t u, uint32_t i0, uint64_t plane, uint64_t seed, uint32_t (&x0)[kChunk],
                                   uint32_t (&x1)[kChunk], uint32_t (&x2)[kChunk], uint32_t (&x3)[kChunk]) {
  philox_chunk_portable(u, i0, plane, seed, x0, x1, x2, x3);
}
#endif

}  // namespace

FLASHATTN_SIMD_CLONES void dropout_keep_tile(const DropoutParams& d, uint64_t plane, int64_t k0, int keys, int64_t q0,
                                             int queries, uint8_t* keep, int64_t keep_ld) {
  uint32_t x[4][kChunk];
  const int64_t k_end = k0 + keys;
  for (int64_t g = k0 / 32; g * 32 < k_end; ++g) {
    for (uint32_t t = 0; t < 4; ++t) {
      const uint32_t u = static_cast<uint32_t>(g * 4 + t);
      for (int c0 = 0; c0 < queries; c0 += kChunk) {
        const int n = queries - c0 < kChunk ? queries - c0 : kChunk;
        philox_chunk(u, static_cast<uint32_t>(q0 + c0), plane, d.seed, x[0], x[1], x[2], x[3]);
        // Slice s = 2 w + e of the group: word w, its low (e = 0) or high 16 bits (philox.h).
        for (int s = 0; s < 8; ++s) {
          const int64_t key = dropout_group_key(u, s);
          if (key < k0 || key >= k_end) continue;
          uint8_t* row = keep + (key - k0) * keep_ld + c0;
          const uint32_t* w = x[s >> 1];
          const int shift = 16 * (s & 1);
          for (int c = 0; c < n; ++c) row[c] = static_cast<uint8_t>(((w[c] >> shift) & 0xffffu) < d.keep_threshold);
        }
      }
    }
  }
}

template <typename acc_t>
FLASHATTN_SIMD_CLONES void apply_keep_tile(const uint8_t* keep, int64_t keep_ld, int keys, int queries,
                                           acc_t kept_scale, acc_t* t, int64_t t_ld) {
  for (int r = 0; r < keys; ++r) {
    const uint8_t* k = keep + r * keep_ld;
    acc_t* row = t + r * t_ld;
    for (int c = 0; c < queries; ++c) row[c] = k[c] ? row[c] * kept_scale : acc_t(0);
  }
}

template void apply_keep_tile<float>(const uint8_t*, int64_t, int, int, float, float*, int64_t);
template void apply_keep_tile<double>(const uint8_t*, int64_t, int, int, double, double*, int64_t);

}  // namespace cpu
}  // namespace flashattn
