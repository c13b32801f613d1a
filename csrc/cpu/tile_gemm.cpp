#include "tile_gemm.h"

#include <ATen/Context.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_knobs.h"
#include "simd_clones.h"

namespace flashattn {
namespace cpu {
namespace {

// C[m x n] (+)= A[m x k] B[k x n] in blocks of kRows x (NV vectors) outputs
// held in registers while the k loop streams one row of B and one column of
// A through them. Ragged edges are zero-padded to a whole block in small
// per-thread buffers (a loop over a 1..31-wide edge would run scalar and
// cost more than the padded block).
constexpr int kRows = 4;

template <typename T>
FLASHATTN_INLINE void gemm_scalar(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb,
                                  T* c, int64_t ldc, bool accumulate) {
  for (int64_t r = 0; r < m; ++r) {
    T* c_row = c + r * ldc;
    if (!accumulate)
      for (int64_t j = 0; j < n; ++j) c_row[j] = 0;
    for (int64_t p = 0; p < k; ++p) {
      const T a_rp = a[r * lda + p];
      const T* b_row = b + p * ldb;
      for (int64_t j = 0; j < n; ++j) c_row[j] += a_rp * b_row[j];
    }
  }
}

#if FLASHATTN_VECTOR_EXT
// Vector types cross no call boundary outside this file (every helper is
// inlined), so GCC's note that their calling convention differs between
// targets (-Wpsabi) does not apply.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
template <typename T>
struct Vec64 {  // 64 bytes of T: one AVX-512 register, two AVX2 ones
  typedef T type __attribute__((vector_size(64)));
  static constexpr int kLanes = 64 / sizeof(T);
};

template <typename T>
FLASHATTN_INLINE typename Vec64<T>::type load_vec(const T* p) {
  typename Vec64<T>::type v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename T>
FLASHATTN_INLINE void store_vec(T* p, typename Vec64<T>::type v) {
  std::memcpy(p, &v, sizeof(v));
}

// One kRows x (NV * kLanes) block of C.
template <typename T, int NV>
FLASHATTN_INLINE void gemm_block(int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb, T* c, int64_t ldc,
                                 bool accumulate) {
  using V = typename Vec64<T>::type;
  constexpr int L = Vec64<T>::kLanes;
  V acc[kRows][NV];
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = accumulate ? load_vec(c + r * ldc + v * L) : V{};
  for (int64_t p = 0; p < k; ++p) {
    V b_p[NV];
    for (int v = 0; v < NV; ++v) b_p[v] = load_vec(b + p * ldb + v * L);
    for (int r = 0; r < kRows; ++r) {
      const T a_rp = a[r * lda + p];
      for (int v = 0; v < NV; ++v) acc[r][v] += a_rp * b_p[v];
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < NV; ++v) store_vec(c + r * ldc + v * L, acc[r][v]);
}

// Per-thread padding buffers, grown on demand and kept.
template <typename T>
T* edge_buffer(std::vector<T>& buffer, size_t n) {
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

template <typename T>
FLASHATTN_SIMD_CLONES void gemm_nn_registers(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b,
                                             int64_t ldb, T* c, int64_t ldc, bool accumulate) {
  constexpr int L = Vec64<T>::kLanes;
  constexpr int kCols = 2 * L;
  thread_local std::vector<T> a_pad_buffer, b_pad_buffer;

  // The right edge of B (width < kCols), zero-padded to one or two vectors.
  const int64_t n_full = n / kCols * kCols;
  const int edge = static_cast<int>(n - n_full);
  const int edge_cols = edge <= L ? L : kCols;
  T* b_edge = nullptr;
  if (edge > 0) {
    b_edge = edge_buffer(b_pad_buffer, static_cast<size_t>(k) * edge_cols);
    for (int64_t p = 0; p < k; ++p) {
      for (int j = 0; j < edge; ++j) b_edge[p * edge_cols + j] = b[p * ldb + n_full + j];
      for (int j = edge; j < edge_cols; ++j) b_edge[p * edge_cols + j] = 0;
    }
  }

  for (int64_t i = 0; i < m; i += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, m - i));
    const T* a_blk = a + i * lda;
    int64_t a_ld = lda;
    if (rows < kRows) {  // the bottom edge of A, zero-padded to kRows rows
      T* a_pad = edge_buffer(a_pad_buffer, static_cast<size_t>(kRows) * k);
      for (int r = 0; r < kRows; ++r)
        for (int64_t p = 0; p < k; ++p) a_pad[r * k + p] = r < rows ? a_blk[r * lda + p] : T(0);
      a_blk = a_pad, a_ld = k;
    }
    T* c_blk = c + i * ldc;
    // A block of C whose rows or columns stick out goes through a padded copy.
    T c_pad[kRows * kCols];
    auto padded_block = [&](int64_t j, int cols, auto nv, const T* b_blk, int64_t b_ld) {
      constexpr int NV = decltype(nv)::value;
      for (int r = 0; r < kRows; ++r)
        for (int jj = 0; jj < NV * L; ++jj)
          c_pad[r * kCols + jj] = (accumulate && r < rows && jj < cols) ? c_blk[r * ldc + j + jj] : T(0);
      gemm_block<T, NV>(k, a_blk, a_ld, b_blk, b_ld, c_pad, kCols, /*accumulate=*/true);
      for (int r = 0; r < rows; ++r)
        for (int jj = 0; jj < cols; ++jj) c_blk[r * ldc + j + jj] = c_pad[r * kCols + jj];
    };
    for (int64_t j = 0; j < n_full; j += kCols) {
      if (rows == kRows) {
        gemm_block<T, 2>(k, a_blk, a_ld, b + j, ldb, c_blk + j, ldc, accumulate);
      } else {
        padded_block(j, kCols, std::integral_constant<int, 2>{}, b + j, ldb);
      }
    }
    if (edge > 0) {
      if (edge_cols == L) {
        padded_block(n_full, edge, std::integral_constant<int, 1>{}, b_edge, edge_cols);
      } else {
        padded_block(n_full, edge, std::integral_constant<int, 2>{}, b_edge, edge_cols);
      }
    }
  }
}
#else
template <typename T>
void gemm_nn_registers(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb, T* c,
                       int64_t ldc, bool accumulate) {
  gemm_scalar(m, n, k, a, lda, b, ldb, c, ldc, accumulate);
}
#endif  // FLASHATTN_VECTOR_EXT

// The leading dimensions admitted in place (tile_ops.h), process-wide; 0 is a
// free slot. At most kMaxInPlaceLds distinct strides ever reach the JIT cache
// besides the scratch tiles' own.
constexpr int kMaxInPlaceLds = 16;
std::atomic<int64_t> in_place_lds[kMaxInPlaceLds];

}  // namespace

bool ld_admitted_in_place(int64_t ld) {
  thread_local int64_t last_admitted = 0;
  if (ld == last_admitted) return true;
  for (auto& slot : in_place_lds) {
    int64_t seen = slot.load(std::memory_order_acquire);
    if (seen == 0 && slot.compare_exchange_strong(seen, ld, std::memory_order_acq_rel)) seen = ld;
    if (seen == ld) {
      last_admitted = ld;
      return true;
    }
  }
  return false;
}

void gemm_nn(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
             int64_t ldc, bool accumulate, bool full_tile) {
  if (full_tile) {
    // On x86 with AVX2 or more: the oneDNN micro-kernel; elsewhere torch's
    // BLAS gemm behind the same call.
    at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, accumulate, a, b, c, /*is_vnni=*/false);
  } else {
    gemm_nn_registers(m, n, k, a, lda, b, ldb, c, ldc, accumulate);
  }
}

void gemm_nn(int64_t m, int64_t n, int64_t k, const double* a, int64_t lda, const double* b, int64_t ldb, double* c,
             int64_t ldc, bool accumulate, bool /*full_tile*/) {
  gemm_nn_registers(m, n, k, a, lda, b, ldb, c, ldc, accumulate);
}

// ---------------------------------------------------------------------------
// Low-precision products on brgemm.

namespace {

template <typename T>
void brgemm_pairs(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, float* c, int64_t ldc,
                  bool accumulate) {
  const int w = lowp_panel_width(n);
  for (int64_t j = 0; j < n; j += w)
    at::native::cpublas::brgemm(m, w, k, lda, /*ld_b=*/w, ldc, accumulate, a, b + j * k, c + j, /*is_vnni=*/true);
}

// One product of the shapes the kernels use, from small integers (exact in
// every format and in any order of summation), against its exact value: a
// brgemm that throws (no kernel for the dtype on this machine) or reads B in
// another layout (oneDNN's plain one, e.g. float16 without AMX-FP16) fails.
template <typename T>
bool probe_brgemm_pairs() {
  constexpr int M = 16, N = 128, K = 64;
  std::vector<float> a(M * K), b(K * N), expect(M * N, 0.f), got(M * N, -1.f);
  for (int i = 0; i < M * K; ++i) a[i] = static_cast<float>((i * 7 + 3) % 9 - 4);
  for (int i = 0; i < K * N; ++i) b[i] = static_cast<float>((i * 5 + 1) % 7 - 3);
  for (int i = 0; i < M; ++i)
    for (int p = 0; p < K; ++p)
      for (int j = 0; j < N; ++j) expect[i * N + j] += a[i * K + p] * b[p * N + j];
  std::vector<T> a_lp(M * K), b_pairs(K * N);
  for (int i = 0; i < M * K; ++i) a_lp[i] = static_cast<T>(a[i]);
  const int w = lowp_panel_width(N);
  for (int p = 0; p < K; ++p)
    for (int j = 0; j < N; ++j)
      b_pairs[(j / w) * (K * w) + (p / 2) * 2 * w + (j % w) * 2 + p % 2] = static_cast<T>(b[p * N + j]);
  try {
    brgemm_pairs(M, N, K, a_lp.data(), K, b_pairs.data(), got.data(), N, /*accumulate=*/false);
    at::native::cpublas::brgemm_release(/*is_vnni=*/true);
  } catch (const std::exception&) {
    return false;
  }
  return got == expect;
}

template <typename T>
bool brgemm_pairs_works() {
  static const bool works = probe_brgemm_pairs<T>();
  return works;
}

bool brgemm_pairs_works(ScalarKind dtype) {
  if (dtype == ScalarKind::kBFloat16) return brgemm_pairs_works<c10::BFloat16>();
  if (dtype == ScalarKind::kFloat16) return brgemm_pairs_works<c10::Half>();
  return false;
}

// AMD's AVX512-BF16 (Zen 4 and later): its bfloat16 dot products do twice
// the float32 FMA's work per instruction at the same rate, and brgemm's
// bfloat16 ran ~1.9x as fast as our float32 products there (2-core EPYC VM,
// session 13: fwd b4 h16 n1024 d128, 1 thread, 329 against 631 ms; fwd+bwd
// 520 against 1113 ms). Intel's AVX512-BF16 without AMX did not (the
// session 9 VM: ~0.5x of float32 brgemm), hence the vendor.
bool fast_bf16_dot_products() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool fast = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") && __builtin_cpu_supports("avx512bf16");
  }();
  return fast;
#else
  return false;
#endif
}

// Where auto takes brgemm: the matrix units, where oneDNN packs B for brgemm
// because the dot products run on AMX (could_pack: AMX for bfloat16,
// AMX-FP16 for float16), and bfloat16 on AMD's AVX512-BF16 (above);
// elsewhere the brgemm of these dtypes is no faster than our float32
// products.
bool auto_takes_brgemm(ScalarKind dtype) {
  if (dtype == ScalarKind::kBFloat16) return at::native::cpublas::could_pack(at::kBFloat16) || fast_bf16_dot_products();
  if (dtype == ScalarKind::kFloat16) return at::native::cpublas::could_pack(at::kHalf);
  return false;
}

}  // namespace

bool lowp_gemm_enabled(ScalarKind dtype) {
  if (dtype != ScalarKind::kBFloat16 && dtype != ScalarKind::kFloat16) return false;
  const LowpGemm choice = lowp_gemm_choice();
  if (choice == LowpGemm::kOwn) return false;
  if (!at::globalContext().userEnabledMkldnn()) return false;
  if (choice == LowpGemm::kAuto && !auto_takes_brgemm(dtype)) return false;
  return brgemm_pairs_works(dtype);
}

std::string lowp_gemm_status(ScalarKind dtype) {
  if (!at::globalContext().userEnabledMkldnn()) return "unavailable";
  if (!brgemm_pairs_works(dtype)) return "unavailable";
  return auto_takes_brgemm(dtype) ? "brgemm" : "brgemm-available";
}

void gemm_nn_lowp(int64_t m, int64_t n, int64_t k, const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b,
                  float* c, int64_t ldc, bool accumulate) {
  brgemm_pairs(m, n, k, a, lda, b, c, ldc, accumulate);
}

void gemm_nn_lowp(int64_t m, int64_t n, int64_t k, const c10::Half* a, int64_t lda, const c10::Half* b, float* c,
                  int64_t ldc, bool accumulate) {
  brgemm_pairs(m, n, k, a, lda, b, c, ldc, accumulate);
}

void lowp_gemm_release() { at::native::cpublas::brgemm_release(/*is_vnni=*/true); }

}  // namespace cpu
}  // namespace flashattn
