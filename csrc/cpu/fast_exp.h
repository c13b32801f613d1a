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

// exp(x) for float: exp(x) = 2^n exp(r) with n = round(x log2(e)) and
// |r| <= ln(2)/2, exp(r) by the Cephes expf polynomial (about 1 ulp). Plain
// arithmetic and bit casts only, so loops calling it vectorize.
// Arguments below -87.3 (-inf included) give exactly 0, the value a masked or
// vanishing probability must have; the results they would otherwise produce
// (< 1.2e-38) cannot change a softmax sum that includes exp(0) = 1.
FLASHATTN_INLINE float exp_approx(float x) {
  constexpr float kMinArg = -87.3f, kMaxArg = 88.3f;
  const float xc = x < kMinArg ? kMinArg : (x > kMaxArg ? kMaxArg : x);
  // Round to nearest by adding and subtracting 1.5 * 2^23.
  const float n = (xc * 1.44269504088896341f + 12582912.f) - 12582912.f;
  // r = x - n ln2, with ln2 split in two so that n * ln2_hi is exact.
  float r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 127]
  float two_to_n;
  std::memcpy(&two_to_n, &bits, sizeof(float));
  const float y = p * two_to_n;
  return x < kMinArg ? 0.f : y;
}

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
