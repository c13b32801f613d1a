// The dropout keep mask: a counter-based generator (Philox 4x32-10) keyed so
// that the decision for element (b, h, i, j) of a call is a pure function of
// (seed, offset, b, h, i, j). The forward draws it, the backward regenerates
// it (nothing is stored), and every backend (CPU, mma.sync, Hopper) and the
// Python oracle (flashattn_ext.reference.dropout_keep_mask) draw the same bits:
// a CPU run reproduces a GPU run's dropout exactly. Torch-free, usable from host
// C++ and CUDA device code alike.
//
// THE LAYOUT (every implementation must match it bit for bit):
//
//   Philox4x32-10 (Salmon et al. 2011; the constants and round of curand and
//   of torch's at::Philox4_32): key (k0, k1), counter (c0, c1, c2, c3), ten
//   rounds, the key bumped by (W0, W1) between rounds, output (x0, x1, x2, x3).
//
//   key      k0 = seed & 0xffffffff          k1 = seed >> 32
//   counter  c0 = (j / 32) * 4 + (j % 8) / 2  the key group u of key j
//            c1 = i                           the query (within its sequence)
//            c2, c3 = low, high 32 bits of plane = offset + b * heads_q + h
//                                             (64-bit add, wrapping)
//   output   x_n (n = (j % 32) / 8) holds keys 32 g + 8 n + 2 t and
//            32 g + 8 n + 2 t + 1 (g = j / 32, t = (j % 8) / 2): the even key
//            in its low 16 bits, the odd key in its high 16 bits.
//   keep     element (b, h, i, j) is kept iff its 16-bit slice < keep_threshold,
//            keep_threshold = floor((1 - p) * 65536 + 0.5) (in double), so the
//            keep probability is 1 - p to within 2^-17 (the 1 / (1 - p)
//            rescaling is off by at most 2^-17 / (1 - p) relative, far below a
//            16-bit float's rounding).
//   b, i, j  the indices within the call's own sequence: in a varlen batch b is
//            the sequence, i and j count from the sequence's first query and
//            key, so sequence b's mask is the top-left corner of plane b.
//
// Why this layout. One Philox call gives 8 decisions (16-bit slices: 1/65536
// resolution; FlashAttention-2's 8-bit slices keep a byte <= floor(255 (1 - p)):
// p = 0.1 keeps 230/256 = 0.898, 0.2% short of 0.9). The 8 keys of one call are not consecutive
// but the pattern {8 n + 2 t, 8 n + 2 t + 1 : n = 0..3} of 32 keys: exactly
// the columns one thread holds for one row in the accumulators of mma.sync
// m16n8 (4 n8 tiles) and of wgmma m64nN (thread t of a quad holds columns 2 t,
// 2 t + 1 of every 8), so a GPU thread gets each of its decisions from a call
// of its own, none computed twice and no shuffle. The CPU draws whole groups
// of 32 keys (the 4 calls t = 0..3) and scatters them. The plane index in the
// 64-bit high half of the counter makes every (b, h) a stream of its own.
//
// THE OFFSET. A call consumes dropout_offset_increment(batch, heads_q) planes:
// batch * heads_q rounded up to a multiple of 4 (torch's CUDA generator hands
// out offsets in multiples of 4), so that the next call, drawn at offset +
// increment, shares no counter with this one. On the CPU the seed is drawn
// fresh from torch's generator and the offset is 0 (csrc/dropout_api.cpp).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FLASHATTN_PHILOX_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
// Forced inline: inside the CPU kernels' SIMD clones (cpu/simd_clones.h) a
// call left out of line would run the baseline code.
#define FLASHATTN_PHILOX_HD inline __attribute__((always_inline))
#else
#define FLASHATTN_PHILOX_HD inline
#endif

namespace flashattn {

struct Philox4 {
  uint32_t x[4];
};

FLASHATTN_PHILOX_HD void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__)
  lo = a * b;
  hi = __umulhi(a, b);
#else
  const uint64_t prod = static_cast<uint64_t>(a) * b;
  lo = static_cast<uint32_t>(prod);
  hi = static_cast<uint32_t>(prod >> 32);
#endif
}

// Philox4x32-10 of counter (c0, c1, c2, c3) under key (k0, k1).
FLASHATTN_PHILOX_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                          uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t lo0, hi0, lo1, hi1;
    philox_mulhilo(kM0, c0, lo0, hi0);
    philox_mulhilo(kM1, c2, lo1, hi1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0, c1 = lo1, c2 = n2, c3 = lo0;
    k0 += kW0, k1 += kW1;  // the bump after the last round is never used
  }
  return {{c0, c1, c2, c3}};
}

// One call's dropout: what every kernel needs to regenerate the mask.
struct DropoutParams {
  double p = 0.0;               // 0: no dropout (the kernels run their plain code)
  uint32_t keep_threshold = 0;  // keep iff slice < keep_threshold (see the layout above)
  double scale = 1.0;           // 1 / (1 - p) for the kept probabilities (0 when p == 1)
  uint64_t seed = 0, offset = 0;
  // The CUDA kernels read seed and offset through these device pointers
  // when set (rng_state, int64 (2,) [seed, offset], written by a graph-safe
  // unpack of torch's PhiloxCudaState), so that CUDA graph replays draw fresh
  // masks; the CPU kernels read seed / offset above.
  const int64_t* rng_state = nullptr;
  FLASHATTN_PHILOX_HD bool enabled() const { return p > 0.0; }
};

FLASHATTN_PHILOX_HD uint32_t dropout_keep_threshold(double p) {
  const double t = (1.0 - p) * 65536.0 + 0.5;
  return t <= 0.0 ? 0u : (t >= 65536.0 ? 65536u : static_cast<uint32_t>(t));
}

FLASHATTN_PHILOX_HD uint64_t dropout_offset_increment(int64_t batch, int64_t heads_q) {
  return (static_cast<uint64_t>(batch * heads_q) + 3u) / 4u * 4u;
}

// The key group of key j (counter c0) and the slice of the group's 8 that is j's.
FLASHATTN_PHILOX_HD uint32_t dropout_key_group(int64_t j) {
  return static_cast<uint32_t>((j >> 5) * 4 + ((j >> 1) & 3));
}
FLASHATTN_PHILOX_HD int dropout_slice(int64_t j) { return static_cast<int>(((j >> 3) & 3) * 2 + (j & 1)); }
// Key of slice s (0..7) of group u.
FLASHATTN_PHILOX_HD int64_t dropout_group_key(uint32_t u, int s) {
  return static_cast<int64_t>(u >> 2) * 32 + (s >> 1) * 8 + (u & 3) * 2 + (s & 1);
}

// The 8 keep decisions of group u of query i in plane (b, h): bit s is slice s.
FLASHATTN_PHILOX_HD uint32_t dropout_keep_bits(uint64_t seed, uint64_t plane, uint32_t i, uint32_t u,
                                               uint32_t keep_threshold) {
  const Philox4 r = philox4x32_10(u, i, static_cast<uint32_t>(plane), static_cast<uint32_t>(plane >> 32),
                                  static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  uint32_t bits = 0;
  for (int n = 0; n < 4; ++n) {
    bits |= static_cast<uint32_t>((r.x[n] & 0xffffu) < keep_threshold) << (2 * n);
    bits |= static_cast<uint32_t>((r.x[n] >> 16) < keep_threshold) << (2 * n + 1);
  }
  return bits;
}

FLASHATTN_PHILOX_HD uint64_t dropout_plane(uint64_t offset, int64_t b, int64_t heads_q, int64_t h) {
  return offset + static_cast<uint64_t>(b * heads_q + h);
}

// Whether element (b, h, i, j) is kept (one decision: for tests and probes;
// kernels draw groups).
FLASHATTN_PHILOX_HD bool dropout_keep(const DropoutParams& d, int64_t b, int64_t heads_q, int64_t h, int64_t i,
                                      int64_t j) {
  return (dropout_keep_bits(d.seed, dropout_plane(d.offset, b, heads_q, h), static_cast<uint32_t>(i),
                            dropout_key_group(j), d.keep_threshold) >>
          dropout_slice(j)) &
         1u;
}

}  // namespace flashattn
