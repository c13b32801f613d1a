// exp() that a compiler can vectorize. The softmax takes one exp per score,
// as many as there are multiply-adds in a 4-wide head_dim's worth of GEMM, so
// a scalar libm call per score would cost more than the matrix products.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd_clones.h"

namespace flashattn {
namespace cpu {

// exp(x) for float, on one float or on a GCC vector of floats (F; U the
// unsigned integer of the same shape): exp(x) = 2^n exp(r) with
// n = round(x log2(e)) and |r| <= ln(2)/2, exp(r) by a degree-6 polynomial,
// minimax for relative error on that interval with p(0) = 1 (so exp(0) = 1
// exactly; fitted by Lawson's iteration: 2e-9 in exact arithmetic, about
// 1 ulp evaluated in float, as the Cephes polynomial it replaced, with two
// operations fewer). Plain arithmetic and bit casts only, so loops calling it
// vectorize; n and its 2^n come from one rounding sum (no float-to-int
// conversion). softmax_span.cpp runs the same steps in AVX-512 intrinsics,
// one instruction each (GCC's vectorizer compiles the clamps into compares
// and blends).
// Arguments are clamped to [-88, 88.3]. At -88, n = -127 and the bits of 2^n
// are 0, so the arguments at or below it (-inf included) give exactly 0, the
// value a masked or vanishing probability must have; the few above it that
// give a nonzero result below 1.2e-38 cannot change a softmax sum that
// includes exp(0) = 1. A NaN passes both clamps (x < lo ? lo : x keeps it)
// and comes out NaN.
constexpr float kExpMinArg = -88.f, kExpMaxArg = 88.3f;
constexpr float kExpLog2e = 1.44269504088896341f;
constexpr float kExpRound = 12582912.f;                                // 1.5 * 2^23
constexpr float kExpLn2Hi = 0.693359375f, kExpLn2Lo = 2.12194440e-4f;  // ln2 = hi - lo
// The polynomial's coefficients, of r^0 .. r^6.
constexpr float kExpPoly[7] = {
    1.f, 1.f, 4.9999994040e-1f, 1.6666431725e-1f, 4.1668001562e-2f, 8.3741554990e-3f, 1.3843653724e-3f};
constexpr uint32_t kExpBiasBits = 127u - 0x4B400000u;  // the rounding sum's bits + this = n + 127
// A degree-5 polynomial of the same fit, for probabilities that are rounded to
// a 16-bit format next (softmax_span.cpp): 1.5e-7 relative evaluated in
// float, 2.5 ulp, far below bfloat16's 2e-3; one multiply-add fewer.
constexpr float kExpPoly5[6] = {
    1.f, 9.9999970198e-01f, 4.9999150634e-01f, 1.6667635739e-01f, 4.1897930205e-02f, 8.2903150469e-03f};

template <typename F, typename U>
FLASHATTN_INLINE F exp_approx_lanes(F x) {
  static_assert(sizeof(F) == sizeof(U), "F and U have the same shape");
  const F lo = F{} + kExpMinArg, hi = F{} + kExpMaxArg;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // Round to nearest by adding 1.5 * 2^23: n sits in the sum's low mantissa bits.
  const F t = x * kExpLog2e + kExpRound;
  const F n = t - kExpRound;
  // r = x - n ln2, with ln2 split in two so that n * ln2_hi is exact.
  F r = x - n * kExpLn2Hi;
  r = r + n * kExpLn2Lo;
  F p = F{} + kExpPoly[6];
  for (int k = 5; k >= 0; --k) p = p * r + kExpPoly[k];
  // 2^n: n + 127 (0 for n = -127) in the exponent field.
  U bits;
  std::memcpy(&bits, &t, sizeof(bits));
  bits = (bits + kExpBiasBits) << 23;
  F two_to_n;
  std::memcpy(&two_to_n, &bits, sizeof(two_to_n));
  return p * two_to_n;
}

FLASHATTN_INLINE float exp_approx(float x) { return exp_approx_lanes<float, uint32_t>(x); }

// exp(x) for double, the same way with Cephes' exp Pade approximant
// (1 + 2 r P(r^2) / (Q(r^2) - r P(r^2)), about 1 ulp on |r| <= ln(2)/2).
// Arguments below -708 give 0 (exp(-708) ~ 3e-308). n is read back from the
// bits of the rounding sum, which keeps every step vectorizable on AVX2.
FLASHATTN_INLINE double exp_approx(double x) {
  constexpr double kMinArg = -708.0, kMaxArg = 709.0;
  const double xc = x < kMinArg ? kMinArg : (x > kMaxArg ? kMaxArg : x);
  // Adding 1.5 * 2^52 rounds to an integer, which lands in the low mantissa bits.
  constexpr double kRound = 6755399441055744.0;
  constexpr int64_t kRoundBits = 0x4338000000000000LL;
  const double t = xc * 1.4426950408889634074 + kRound;
  const double n = t - kRound;
  double r = xc - n * 6.93145751953125e-1;
  r = r - n * 1.42860682030941723212e-6;
  const double rr = r * r;
  const double p = r * ((1.26177193074810590878e-4 * rr + 3.02994407707441961300e-2) * rr + 9.99999999999999999910e-1);
  const double q =
      ((3.00198505138664455042e-6 * rr + 2.52448340349684104192e-3) * rr + 2.27265548208155028766e-1) * rr + 2.0;
  const double e = 1.0 + 2.0 * (p / (q - p));
  int64_t t_bits;
  std::memcpy(&t_bits, &t, sizeof(t));
  const int64_t two_to_n_bits = (t_bits - kRoundBits + 1023) << 52;  // 2^n, n in [-1022, 1023]
  double two_to_n;
  std::memcpy(&two_to_n, &two_to_n_bits, sizeof(double));
  return x < kMinArg ? 0.0 : e * two_to_n;
}

}  // namespace cpu
}  // namespace flashattn
