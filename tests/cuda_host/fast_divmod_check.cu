// mask.cuh's FastDivmod (the backward kernels' query-block decode, QuerySweep)
// against integer division, on the host: every n < 20000 for every divisor up
// to 5000, and 2M random (n, d) pairs below 2^31. Run by tests/test_mask_rule.py.
#include <cstdio>
#include <random>

#include "../../csrc/cuda/mask.cuh"

int main() {
  using flashattn::FastDivmod;
  long n_checked = 0, bad = 0;
  auto check = [&](int n, int d, const FastDivmod& f) {
    ++n_checked;
    if (f.div(n) != n / d) {
      if (++bad < 10) std::printf("mismatch: %d / %d = %d, FastDivmod says %d\n", n, d, n / d, f.div(n));
    }
  };
  std::mt19937_64 rng(1);
  for (int d = 1; d < 5000; ++d) {
    const FastDivmod f(d);
    for (int n = 0; n < 20000; ++n) check(n, d, f);
    for (int k = 0; k < 200; ++k) check(static_cast<int>(rng() % (1u << 31)), d, f);
  }
  for (int k = 0; k < 2000000; ++k) {
    const int d = 1 + static_cast<int>(rng() % ((1u << 31) - 1));
    check(static_cast<int>(rng() % (1u << 31)), d, FastDivmod(d));
  }
  std::printf("%ld divisions, %ld mismatches\n", n_checked, bad);
  return bad != 0;
}
