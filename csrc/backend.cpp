// flashattn_ext.activate()'s hot overrides, in C++ (flashattn_ext/backend.py
// drives them; its docstring says what activation does).
//
// activate() overrides aten's SDPA-layout flash ops behind torch's own
// scaled_dot_product_attention:
//   _scaled_dot_product_flash_attention_for_cpu / _backward (CPU) and
//   _scaled_dot_product_flash_attention / _backward (CUDA; the tests register
//   these for the CPU key too, where they run on the CPU kernels).
// Registered from Python through torch.library, such a kernel is called boxed,
// with the GIL, its arguments converted to Python objects: ~40 us per call of
// host time on a CPU, more than the rest of the call. Here they are unboxed C++
// kernels of a torch::Library (IMPL, "aten", one dispatch key) that
// _backend_register creates and _backend_unregister destroys (a Library's
// destructor deregisters its kernels: c10::RegistrationHandleRAII), so that
// torch's registry (register_flash_attention_impl / activate / restore), which
// calls backend.py's register function and the remove() of what it returns,
// still decides when they are there.
//
// Each kernel checks the call (the refusal rules below, the only copy of them:
// backend.py's remaining Python overrides, FA2's _flash_attention_forward /
// _backward, call them through the _backend_*_refusal ops), runs our fwd / bwd
// ops with the arguments torch's kernel would have run, and returns every output
// in the layout torch's kernel and its meta function give it; a call it refuses
// goes to the kernel torch had registered for that key before (captured at
// registration: OperatorHandle::getComputedKernelForDispatchKey, what
// torch.library.get_kernel returns in Python, called boxed with the keyset the
// call came with). calls(): a counter per op for our route and one per (op,
// reason) for torch's (_backend_calls).
#include <ATen/core/Tensor.h>
#include <ATen/core/boxing/impl/boxing.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty_permuted.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#ifdef FLASHATTN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include <array>
#include <atomic>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "attention_api.h"

#ifndef FLASHATTN_CUDA_ARCHS
#define FLASHATTN_CUDA_ARCHS ""
#endif

namespace flashattn {
namespace backend {
namespace {

using OptTensor = std::optional<at::Tensor>;

// ----------------------------------------------------------------------------- configuration

// The CUDA kernels' largest head dim (interface._CUDA_MAX_HEAD_DIM, derived in
// Python from the build's head dims, where the drop-in's routing uses it too),
// set by backend.py before it registers (_backend_configure).
std::atomic<int64_t> g_cuda_max_head_dim{0};

#ifdef FLASHATTN_WITH_CUDA
// The archs this build's CUDA kernels were compiled for (setup.py's
// FLASHATTN_CUDA_ARCHS, as build_info reports them), e.g. {80, 90}.
std::vector<int> compiled_archs() {
  std::vector<int> archs;
  int value = -1;
  for (const char* c = FLASHATTN_CUDA_ARCHS;; ++c) {
    if (*c >= '0' && *c <= '9') {
      value = (value < 0 ? 0 : 10 * value) + (*c - '0');
    } else {
      if (value >= 0) archs.push_back(value);
      value = -1;
      if (*c == '\0') break;
    }
  }
  return archs;
}

// Python's repr of the archs tuple (interface._BUILD["archs"]): "(80, 90)", "(90,)".
std::string archs_text() {
  const auto archs = compiled_archs();
  std::string text = "(";
  for (size_t i = 0; i < archs.size(); ++i) text += (i ? ", " : "") + std::to_string(archs[i]);
  return text + (archs.size() == 1 ? ",)" : ")");
}

#endif

// Whether this build's CUDA kernels run on CUDA device `index`: a cubin for
// sm_XY runs on sm_XZ with Z >= Y (same major); no PTX is shipped. The one
// copy of the rule: interface._cuda_arch_supported (the drop-in's routing)
// asks it through the _cuda_arch_supported op. Remembered per device (the
// first call reads the device's properties, which initialises CUDA, as
// torch.cuda.get_device_capability did).
bool cuda_arch_supported(int64_t index) {
#ifdef FLASHATTN_WITH_CUDA
  constexpr int64_t kRemembered = 64;
  static std::atomic<int8_t> verdicts[kRemembered];  // 0 unknown, 1 runs, 2 does not
  if (index >= 0 && index < kRemembered) {
    const int8_t known = verdicts[index].load(std::memory_order_relaxed);
    if (known != 0) return known == 1;
  }
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(index));
  const int cap = 10 * prop->major + prop->minor;
  bool ok = false;
  for (const int a : compiled_archs()) ok = ok || (a / 10 == prop->major && a <= cap);
  if (index >= 0 && index < kRemembered) verdicts[index].store(ok ? 1 : 2, std::memory_order_relaxed);
  return ok;
#else
  (void)index;
  return false;  // no CUDA kernels in this build
#endif
}

// ----------------------------------------------------------------------------- refusal rules
// Each returns why our kernels cannot take the call, "" when they can, in the
// words calls() reports ("torch: <why>").

// Python's names of the dtypes (what backend.py's messages said: f"{dtype}").
std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kBool: return "torch.bool";
    case at::kComplexHalf: return "torch.complex32";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    case at::kFloat8_e5m2: return "torch.float8_e5m2";
    case at::kFloat8_e4m3fn: return "torch.float8_e4m3fn";
    case at::kFloat8_e5m2fnuz: return "torch.float8_e5m2fnuz";
    case at::kFloat8_e4m3fnuz: return "torch.float8_e4m3fnuz";
    default: return std::string("torch.") + c10::toString(t);
  }
}

bool dense_strided(const at::Tensor& t) { return t.layout() == at::kStrided && !t.is_nested(); }

// Dropout where the op cannot carry our state to its backward: torch's CPU flash
// op carries no RNG state from its forward to its backward (and torch's CPU SDPA
// does not route dropout to it either); the memory-efficient op's seed / offset
// scalars are torch's Philox pair, not ours.
std::string stateless_dropout_refusal(double dropout_p) { return dropout_p != 0.0 ? "dropout_p > 0" : ""; }

// Dropout behind SDPA's CUDA flash op: its rng_state output carries our
// [seed, offset] to the backward (tagged_rng_state). Outside [0, 1) torch's
// kernel decides (and raises).
std::string dropout_refusal(double dropout_p) {
  return dropout_p >= 0.0 && dropout_p < 1.0 ? "" : "dropout_p outside [0, 1)";
}

// Our dropout state as SDPA's flash op returns it (uint64 (2,), [seed, offset],
// on q's device), tagged as ours: a view of a 3-element storage, which torch's
// kernels never make. A backward with dropout takes a state only with that tag,
// so that one from torch's kernel (a forward ours refused: return_debug_mask)
// goes back to torch's backward instead of regenerating the wrong mask.
constexpr int64_t kTaggedRngElements = 3;

at::Tensor tagged_rng_state(const at::Tensor& rng_state) {
  at::Tensor tagged = at::empty({kTaggedRngElements}, rng_state.options());
  tagged.narrow(0, 0, 2).copy_(rng_state);  // (a device copy: no host sync, graph-capturable)
  return tagged.narrow(0, 0, 2).view(at::kUInt64);
}

// The backward's refusal for the philox_seed it is given ("" with no dropout).
std::string rng_state_refusal(double dropout_p, const at::Tensor& philox_seed, const at::Tensor& q) {
  if (dropout_p == 0.0) return "";
  const bool ours = philox_seed.defined() && philox_seed.scalar_type() == at::kUInt64 && philox_seed.dim() == 1 &&
                    philox_seed.size(0) == 2 && philox_seed.stride(0) == 1 && philox_seed.storage_offset() == 0 &&
                    philox_seed.device() == q.device() &&
                    philox_seed.storage().nbytes() == kTaggedRngElements * static_cast<int64_t>(sizeof(int64_t));
  return ours ? "" : "dropout with an rng_state our forward did not make";
}

// An optional tensor from C++ callers (torch's autograd formulas) may hold an
// undefined tensor where Python would have seen None: both are "no mask".
bool has_mask(const OptTensor& attn_mask) { return attn_mask.has_value() && attn_mask->defined(); }

// Whether mask (2 to 4 dimensions) broadcasts to SDPA's (B, H, L, S) of q, k (4-D).
bool broadcasts_to_scores(const at::Tensor& m, const at::Tensor& q, const at::Tensor& k) {
  const int64_t full[4] = {q.size(0), q.size(1), q.size(2), k.size(2)};
  for (int64_t d = 0; d < m.dim(); ++d) {
    const int64_t size = m.size(d), want = full[4 - m.dim() + d];
    if (size != want && size != 1) return false;
  }
  return true;
}

// The memory-efficient op's attn_bias, as SDPA hands it over: q's dtype (a bool
// mask converted), expanded to (B, H, L, S) with stride-0 broadcast dimensions,
// its rows maybe padded to 16 elements. Ours read it through its strides.
std::string efficient_bias_refusal(const OptTensor& bias, const at::Tensor& q, const at::Tensor& k) {
  if (!has_mask(bias)) return "";
  const at::Tensor& m = *bias;
  if (!dense_strided(m) || m.scalar_type() != q.scalar_type() || m.device() != q.device() || m.dim() != 4)
    return "attn_bias is not a dense 4-D tensor of the query's dtype and device";
  if (q.dim() != 4 || k.dim() != 4) return "";  // (the shape rules name it)
  return broadcasts_to_scores(m, q, k) ? "" : "attn_bias does not broadcast to (batch, heads, seqlen_q, seqlen_k)";
}

// The CPU flash op's attn_mask (SDPA hands it a bool mask converted to q's
// dtype, -inf where hidden): our kernels take what torch's kernel takes, a mask
// of q's dtype with 2 or 4 dimensions that broadcasts to (B, H, L, S); anything
// else goes to torch's kernel, which raises its own error.
std::string cpu_attn_mask_refusal(const OptTensor& attn_mask, const at::Tensor& q, const at::Tensor& k) {
  if (!has_mask(attn_mask)) return "";
  const at::Tensor& m = *attn_mask;
  if (!dense_strided(m) || m.scalar_type() != q.scalar_type() || m.device() != q.device())
    return "attn_mask is not a dense tensor of the query's dtype and device";
  if (m.dim() != 2 && m.dim() != 4) return "attn_mask has neither 2 nor 4 dimensions";
  if (q.dim() != 4 || k.dim() != 4) return "";  // (the shape rules name it)
  return broadcasts_to_scores(m, q, k) ? "" : "attn_mask does not broadcast to (batch, heads, seqlen_q, seqlen_k)";
}

std::string scale_refusal(const std::optional<double>& scale) {
  if (!scale.has_value() || std::isfinite(*scale)) return "";
  // Python's float formatting of a non-finite value (f"scale {scale} ...").
  const char* text = std::isnan(*scale) ? "nan" : (*scale > 0 ? "inf" : "-inf");
  return std::string("scale ") + text + " is not finite";
}

// q, k, v of either layout: heads_* are the head counts, seq_dim the sequence
// dimension (2: SDPA's (B, H, L, E), 1: FlashAttention's (B, S, H, D), 0: FA2's
// varlen (total, H, D)).
std::string common_refusal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t heads_q,
                           int64_t heads_k, int64_t heads_v, int64_t seq_dim) {
  const at::Device dev = q.device();
  if (k.device() != dev || v.device() != dev) return "query, key, value are on different devices";
  const bool cuda = dev.is_cuda();
  if (!cuda && !dev.is_cpu()) {
    return std::string("no flashattn_ext kernels for device ") + c10::DeviceTypeName(dev.type(), /*lower_case=*/true);
  }
  if (cuda) {
#ifndef FLASHATTN_WITH_CUDA
    return "this build of flashattn_ext has no CUDA kernels";
#else
    const int64_t index = dev.has_index() ? dev.index() : at::cuda::current_device();
    if (!cuda_arch_supported(index))
      return "the CUDA kernels were built for archs " + archs_text() + ", not this GPU's";
#endif
  }
  if (!(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type())) {
    return "query, key, value have different dtypes";
  }
  const auto dt = q.scalar_type();
  const bool dtype_ok = cuda ? (dt == at::kHalf || dt == at::kBFloat16)
                             : (dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16 || dt == at::kHalf);
  if (!dtype_ok) return "dtype " + dtype_name(dt) + " is not supported by the " + (cuda ? "cuda" : "cpu") + " kernels";
  const int64_t e = q.size(-1);
  if (k.size(-1) != e || v.size(-1) != e) return "key / value head dim differs from the query's";
  if (e > (cuda ? g_cuda_max_head_dim.load(std::memory_order_relaxed) : int64_t{kMaxHeadDim})) {
    return "head dim " + std::to_string(e) + " is larger than the kernels' largest";
  }
  if (heads_k != heads_v || heads_k < 1 || heads_q % heads_k != 0) {
    return std::to_string(heads_q) + " query heads and " + std::to_string(heads_k) + " / " + std::to_string(heads_v) +
           " key / value heads";
  }
  if (q.dim() == 4 && !(q.size(0) == k.size(0) && k.size(0) == v.size(0))) return "batch sizes differ";
  if (k.size(seq_dim) != v.size(seq_dim)) return "key and value lengths differ";
  for (const at::Tensor* t : {&q, &k, &v}) {
    if (t->numel() == 0) return "an empty input";
    for (const int64_t s : t->sizes()) {
      if (s > int64_t{2147483647}) return "a dimension larger than 2^31 - 1";
    }
  }
  return "";
}

// Rank-4 q, k, v with the sequence at seq_dim (2: SDPA's, 1: FlashAttention's); heads at the other of dims 1, 2.
std::string dense_refusal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t seq_dim) {
  const std::pair<const at::Tensor*, const char*> named[] = {{&q, "query"}, {&k, "key"}, {&v, "value"}};
  for (const auto& [t, name] : named) {
    if (!dense_strided(*t)) return std::string(name) + " is not a dense strided tensor";
    if (t->dim() != 4) return std::string(name) + " has " + std::to_string(t->dim()) + " dimensions, not 4";
  }
  const int64_t head_dim = 3 - seq_dim;
  return common_refusal(q, k, v, q.size(head_dim), k.size(head_dim), v.size(head_dim), seq_dim);
}

// FA2's packed variable-length layout.
std::string varlen_refusal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& cu_q,
                           const OptTensor& cu_k) {
  const bool has_q = cu_q.has_value() && cu_q->defined(), has_k = cu_k.has_value() && cu_k->defined();
  if (!has_q || !has_k) return "only one of cum_seq_q / cum_seq_k is given";
  const std::pair<const at::Tensor*, const char*> named[] = {{&q, "query"}, {&k, "key"}, {&v, "value"}};
  for (const auto& [t, name] : named) {
    if (!dense_strided(*t) || t->dim() != 3)
      return std::string(name) + " is not a dense (total, heads, head_dim) tensor";
  }
  const std::pair<const at::Tensor*, const char*> cus[] = {{&*cu_q, "cum_seq_q"}, {&*cu_k, "cum_seq_k"}};
  for (const auto& [cu, name] : cus) {
    if (cu->scalar_type() != at::kInt || cu->dim() != 1 || cu->device() != q.device() || cu->size(0) < 2) {
      return std::string(name) + " is not an int32 (batch + 1,) tensor on the query's device";
    }
  }
  if (cu_q->size(0) != cu_k->size(0)) return "cum_seq_q and cum_seq_k differ in length";
  return common_refusal(q, k, v, q.size(1), k.size(1), v.size(1), 0);
}

// The backward's extra tensors: grad_out and out as the query, the log-sum-exp
// our forward returns (its dtype, lse_shape).
std::string bwd_refusal(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& out, const at::Tensor& lse,
                        at::IntArrayRef lse_shape) {
  const std::pair<const at::Tensor*, const char*> named[] = {{&grad_out, "grad_out"}, {&out, "out"}};
  for (const auto& [t, name] : named) {
    if (t->sizes() != q.sizes() || t->scalar_type() != q.scalar_type() || t->device() != q.device() ||
        t->layout() != at::kStrided) {
      return std::string(name) + " does not match the query";
    }
  }
  if (lse.scalar_type() != lse_dtype(q.scalar_type()) || lse.sizes() != lse_shape || lse.device() != q.device()) {
    return "the log-sum-exp is not the forward's of our kernels";
  }
  return "";
}

// The first refusal of a list of them, in order ("" when none).
template <typename... Rules>
std::string first_refusal(Rules&&... rules) {
  std::string why;
  ((why.empty() ? (void)(why = rules()) : (void)0), ...);
  return why;
}

// ----------------------------------------------------------------------------- calls() bookkeeping

enum OpId { kCpuFwd, kCpuBwd, kSdpaFwd, kSdpaBwd, kEffFwd, kEffBwd, kNumOps };
const char* const kOpNames[kNumOps] = {
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention",         "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention",     "_scaled_dot_product_efficient_attention_backward",
};

// Our route: one relaxed atomic add per call. torch's route (rare, and a
// reason string is built anyway): a map under a mutex.
std::atomic<int64_t> g_ours[kNumOps];
std::mutex g_refused_mutex;
std::map<std::pair<int, std::string>, int64_t> g_refused;

void count_ours(OpId op) { g_ours[op].fetch_add(1, std::memory_order_relaxed); }

void count_refused(OpId op, const std::string& why) {
  std::lock_guard<std::mutex> lock(g_refused_mutex);
  ++g_refused[{op, why}];
}

// ----------------------------------------------------------------------------- torch's kernel, before ours

// The kernel torch had for (op, dispatch key) when ours was registered; none
// when torch has none there (these CUDA ops on the CPU key, as the tests
// register them).
struct Original {
  c10::OperatorHandle op;
  std::optional<c10::SafeKernelFunction> kernel;
  std::string name, key;

  template <typename Ret, typename... Args>
  Ret call(c10::DispatchKeySet keyset, Args&&... args) const {
    TORCH_CHECK_NOT_IMPLEMENTED(kernel.has_value(), "aten::", name,
                                ": flashattn_ext's kernels refused this call and torch has no ", key,
                                " kernel for it (see flashattn_ext.backend.calls() for the reason)");
    torch::jit::Stack stack;
    stack.reserve(sizeof...(Args));
    torch::jit::push(stack, std::forward<Args>(args)...);
    kernel->callBoxed(op, keyset, &stack);
    return c10::impl::PopResult<Ret>::call(stack);
  }
};

std::shared_ptr<const Original> original(const std::string& name, c10::DispatchKey key) {
  auto state =
      std::make_shared<Original>(Original{c10::Dispatcher::singleton().findSchemaOrThrow(("aten::" + name).c_str(), ""),
                                          std::nullopt, name, c10::toString(key)});
  try {
    state->kernel = state->op.getComputedKernelForDispatchKey(key);
  } catch (const c10::Error&) {
    // "no kernel for <key> for aten::<name>": what get_kernel raises in Python (backend.py's _NoKernel then).
  }
  return state;
}

// ----------------------------------------------------------------------------- layouts

// The strides torch.empty_like(ref) gives (those of torch's kernels' outputs
// and of their meta functions); they depend on ref's sizes and strides alone:
// remembered per pair, per thread (no lock), computed on the meta device.
std::vector<int64_t> like_strides(const at::Tensor& ref) {
  thread_local std::map<std::vector<int64_t>, std::vector<int64_t>> memo;
  std::vector<int64_t> key(ref.sizes().begin(), ref.sizes().end());
  key.insert(key.end(), ref.strides().begin(), ref.strides().end());
  auto it = memo.find(key);
  if (it == memo.end()) {
    if (memo.size() >= 4096) memo.clear();
    it = memo.emplace(std::move(key), at::empty_like(ref, ref.options().device(at::kMeta)).strides().vec()).first;
  }
  return it->second;
}

// x, or x copied into torch.empty_like(ref) when its strides differ.
at::Tensor as_like(const at::Tensor& ref, const at::Tensor& x) {
  if (x.strides() == at::IntArrayRef(like_strides(ref))) return x;
  at::Tensor y = at::empty_like(ref);
  y.copy_(x);
  return y;
}

// (B, H, L, E) -> a (B, L, H, E) view with unit stride on E (the kernels' layout).
at::Tensor bshd(const at::Tensor& x) { return unit_last_stride(x.transpose(1, 2)); }

// A gradient of the kernels, (B, L, H, E), as a (B, H, L, E) view of a (B, L, H,
// E) buffer (what torch's CPU and memory-efficient backwards return): ours is
// such a buffer when contiguous (a strided head_dim was copied, so it is);
// otherwise copied into one.
at::Tensor bhld_view(const at::Tensor& g) {
  if (g.is_contiguous()) return g.transpose(1, 2);
  at::Tensor y = at::empty_permuted(g.transpose(1, 2).sizes(), {0, 2, 1, 3}, g.options());
  y.copy_(g.transpose(1, 2));
  return y;
}

double scale_of(const std::optional<double>& scale, const at::Tensor& q) {
  return scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
}

bool deterministic() { return at::globalContext().deterministicAlgorithms(); }

// ----------------------------------------------------------------------------- our ops
// Through the dispatcher (a typed handle: one lookup of the kernel table, no
// boxing): the CUDA kernels' functions live in csrc/cuda/, and the dispatcher
// picks the device's. Called below autograd (torch's autograd kernel of the
// aten op already excluded it), so these reach the kernels themselves.

using FwdSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                                  int64_t, int64_t, bool, double, const OptTensor&, const OptTensor&,
                                                  double, const OptTensor&);
using BwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              double, int64_t, int64_t, bool, bool, double,
                                                              const OptTensor&, const OptTensor&, double,
                                                              const OptTensor&);

// Our forward on SDPA's (B, H, L, E) tensors: out (a (B, H, L, E) view of a
// (B, L, H, E) buffer) and lse (B, H, L).
std::tuple<at::Tensor, at::Tensor> sdpa_layout_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const std::optional<double>& scale, bool is_causal,
                                                       bool bottom_right, double dropout_p = 0.0,
                                                       const OptTensor& rng_state = std::nullopt,
                                                       const OptTensor& attn_mask = std::nullopt) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("flashattn_ext::fwd", "").typed<FwdSig>();
  auto [out, lse] = op.call(bshd(q), bshd(k), bshd(v), scale_of(scale, q), -1, is_causal ? 0 : -1, bottom_right, 0.0,
                            std::nullopt, has_mask(attn_mask) ? attn_mask : std::nullopt, dropout_p, rng_state);
  return {out.transpose(1, 2), lse};
}

// A fresh dropout state for a call on SDPA's (B, H, L, E) q (torch's generator, as the drop-in draws it).
at::Tensor draw_rng_state(const at::Tensor& q) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("flashattn_ext::dropout_rng_state", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, int64_t)>();
  return op.call(q, q.size(0), q.size(1));
}

// Our backward on SDPA's tensors: dq, dk, dv in the kernels' (B, L, H, E) buffers.
std::tuple<at::Tensor, at::Tensor, at::Tensor> sdpa_layout_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<double>& scale, bool is_causal, bool bottom_right,
    double dropout_p = 0.0, const OptTensor& rng_state = std::nullopt, const OptTensor& attn_mask = std::nullopt) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("flashattn_ext::bwd", "").typed<BwdSig>();
  return op.call(bshd(grad_out), bshd(q), bshd(k), bshd(v), bshd(out), lse.contiguous(), scale_of(scale, q), -1,
                 is_causal ? 0 : -1, bottom_right, deterministic(), 0.0, std::nullopt,
                 has_mask(attn_mask) ? attn_mask : std::nullopt, dropout_p, rng_state);
}

// ----------------------------------------------------------------------------- the overrides
// Each is a lambda holding torch's kernel of its (op, key); its signature is the
// aten op's with the DispatchKeySet first, passed on to torch's kernel when ours
// refuse. (Should a torch version change one of these schemas, registering
// raises at activate(), naming both signatures: the dispatcher checks a C++
// kernel's signature against the schema. A static_assert against ATen's
// generated signature would instead fail the whole extension's build.)

using CpuFwdRet = std::tuple<at::Tensor, at::Tensor>;
using CpuBwdRet = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using SdpaFwdRet = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::SymInt, c10::SymInt, at::Tensor,
                              at::Tensor, at::Tensor>;
using SdpaBwdRet = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// torch's CPU flash op (top-left causal: query i sees keys 0..i).
auto cpu_forward(std::shared_ptr<const Original> orig) {
  return [orig](c10::DispatchKeySet ks, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                double dropout_p, bool is_causal, const OptTensor& attn_mask,
                std::optional<double> scale) -> CpuFwdRet {
    const std::string why =
        first_refusal([&] { return cpu_attn_mask_refusal(attn_mask, query, key); },
                      [&] { return stateless_dropout_refusal(dropout_p); }, [&] { return scale_refusal(scale); },
                      [&] { return dense_refusal(query, key, value, 2); });
    if (!why.empty()) {
      count_refused(kCpuFwd, why);
      return orig->call<CpuFwdRet>(ks, query, key, value, dropout_p, is_causal, attn_mask, scale);
    }
    count_ours(kCpuFwd);
    auto [out, lse] =
        sdpa_layout_forward(query, key, value, scale, is_causal, /*bottom_right=*/false, 0.0, std::nullopt, attn_mask);
    // torch's CPU kernel (and its meta function) return lse as a (B, L, H) buffer seen as (B, H, L).
    at::Tensor lse_t = at::empty_permuted(lse.sizes(), {0, 2, 1}, lse.options());
    lse_t.copy_(lse);
    // A row the mask hides whole: torch's kernel returns lse 0 there (ours -inf;
    // our backward reads either the same way: every score of the row is -inf).
    if (has_mask(attn_mask)) lse_t.masked_fill_(lse_t.isneginf(), 0.0);
    return {as_like(query, out), lse_t};
  };
}

auto cpu_backward(std::shared_ptr<const Original> orig) {
  return [orig](c10::DispatchKeySet ks, const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
                const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse, double dropout_p, bool is_causal,
                const OptTensor& attn_mask, std::optional<double> scale) -> CpuBwdRet {
    const std::string why =
        first_refusal([&] { return cpu_attn_mask_refusal(attn_mask, query, key); },
                      [&] { return stateless_dropout_refusal(dropout_p); }, [&] { return scale_refusal(scale); },
                      [&] { return dense_refusal(query, key, value, 2); },
                      [&] { return bwd_refusal(grad_out, query, out, lse, query.sizes().slice(0, 3)); });
    if (!why.empty()) {
      count_refused(kCpuBwd, why);
      return orig->call<CpuBwdRet>(ks, grad_out, query, key, value, out, lse, dropout_p, is_causal, attn_mask, scale);
    }
    count_ours(kCpuBwd);
    auto [dq, dk, dv] = sdpa_layout_backward(grad_out, query, key, value, out, lse, scale, is_causal,
                                             /*bottom_right=*/false, 0.0, std::nullopt, attn_mask);
    // torch's CPU backward returns (B, L, H, E) buffers seen as (B, H, L, E).
    return {bhld_view(dq), bhld_view(dk), bhld_view(dv)};
  };
}

// What torch's flash forward returns for philox seed / offset without dropout:
// uninitialised tensors of these shapes (never read; no fill kernels launched).
std::pair<at::Tensor, at::Tensor> rng_outputs(const at::Tensor& q) {
  const auto options = q.options().dtype(at::kUInt64);
  return {at::empty({2}, options), at::empty({}, options)};
}

// SDPA's CUDA flash op (what CUDA SDPA and torch's context parallelism call).
auto sdpa_forward(std::shared_ptr<const Original> orig) {
  return [orig](c10::DispatchKeySet ks, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                double dropout_p, bool is_causal, bool return_debug_mask, std::optional<double> scale) -> SdpaFwdRet {
    const std::string why = first_refusal(
        [&] { return dropout_refusal(dropout_p); }, [&] { return return_debug_mask ? "return_debug_mask" : ""; },
        [&] { return scale_refusal(scale); }, [&] { return dense_refusal(query, key, value, 2); });
    if (!why.empty()) {
      count_refused(kSdpaFwd, why);
      return orig->call<SdpaFwdRet>(ks, query, key, value, dropout_p, is_causal, return_debug_mask, scale);
    }
    count_ours(kSdpaFwd);
    // torch's kernel hands this call to FA2, whose causal is bottom-right (SDPA
    // itself only selects it for causal calls with equal lengths): the same here.
    auto [seed, offset] = rng_outputs(query);
    OptTensor rng_state;
    if (dropout_p > 0.0) {
      rng_state = draw_rng_state(query);
      seed = tagged_rng_state(*rng_state);
    }
    auto [out, lse] =
        sdpa_layout_forward(query, key, value, scale, is_causal, /*bottom_right=*/true, dropout_p, rng_state);
    at::Tensor debug = at::empty({0}, query.options());
    return {as_like(query, out),      lse,  at::Tensor(), at::Tensor(), c10::SymInt(query.size(2)),
            c10::SymInt(key.size(2)), seed, offset,       debug};
  };
}

auto sdpa_backward(std::shared_ptr<const Original> orig) {
  return [orig](c10::DispatchKeySet ks, const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
                const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
                const at::Tensor& cum_seq_q, const at::Tensor& cum_seq_k, c10::SymInt max_q, c10::SymInt max_k,
                double dropout_p, bool is_causal, const at::Tensor& philox_seed, const at::Tensor& philox_offset,
                std::optional<double> scale) -> SdpaBwdRet {
    const std::string why =
        first_refusal([&] { return dropout_refusal(dropout_p); }, [&] { return scale_refusal(scale); },
                      [&] { return dense_refusal(query, key, value, 2); },
                      [&] { return bwd_refusal(grad_out, query, out, logsumexp, query.sizes().slice(0, 3)); },
                      [&] { return rng_state_refusal(dropout_p, philox_seed, query); });
    if (!why.empty()) {
      count_refused(kSdpaBwd, why);
      return orig->call<SdpaBwdRet>(ks, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                                    std::move(max_q), std::move(max_k), dropout_p, is_causal, philox_seed,
                                    philox_offset, scale);
    }
    count_ours(kSdpaBwd);
    const OptTensor rng_state = dropout_p > 0.0 ? OptTensor(philox_seed.view(at::kLong)) : std::nullopt;
    auto [dq, dk, dv] = sdpa_layout_backward(grad_out, query, key, value, out, logsumexp, scale, is_causal,
                                             /*bottom_right=*/true, dropout_p, rng_state);
    return {as_like(query, dq.transpose(1, 2)), as_like(key, dk.transpose(1, 2)), as_like(value, dv.transpose(1, 2))};
  };
}

// SDPA's memory-efficient op (what CUDA SDPA runs for a call with an attn_mask
// when FLASH, which takes none, comes first; activate(first=True) puts it
// second). Top-left causal, the bias added to the scaled scores.
using EffFwdRet = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using EffBwdRet = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Its log-sum-exp: (B, H, L rounded up to 32) float32 (torch's kernel and meta
// function; the padding is never read), or (B, H, 0) when not asked for.
int64_t efficient_lse_len(int64_t seqlen_q, bool compute_log_sumexp) {
  return compute_log_sumexp ? (seqlen_q + 31) / 32 * 32 : 0;
}

auto efficient_forward(std::shared_ptr<const Original> orig) {
  return [orig](c10::DispatchKeySet ks, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                const OptTensor& attn_bias, bool compute_log_sumexp, double dropout_p, bool is_causal,
                std::optional<double> scale) -> EffFwdRet {
    const std::string why =
        first_refusal([&] { return stateless_dropout_refusal(dropout_p); },
                      [&] { return efficient_bias_refusal(attn_bias, query, key); },
                      [&] { return scale_refusal(scale); }, [&] { return dense_refusal(query, key, value, 2); });
    if (!why.empty()) {
      count_refused(kEffFwd, why);
      return orig->call<EffFwdRet>(ks, query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, scale);
    }
    count_ours(kEffFwd);
    auto [out, lse] =
        sdpa_layout_forward(query, key, value, scale, is_causal, /*bottom_right=*/false, 0.0, std::nullopt, attn_bias);
    const int64_t lq = query.size(2);
    at::Tensor lse_padded =
        at::empty({query.size(0), query.size(1), efficient_lse_len(lq, compute_log_sumexp)}, lse.options());
    if (compute_log_sumexp) lse_padded.narrow(2, 0, lq).copy_(lse);
    // (out: a (B, H, L, E) view of a (B, L, H, E) buffer, as torch's kernel returns it.)
    const auto scalar = at::TensorOptions().dtype(at::kLong);  // torch's seed / offset without dropout
    return {out, lse_padded, at::empty({}, scalar), at::empty({}, scalar)};
  };
}

using BwdMaskGradSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    double, int64_t, int64_t, bool, bool, const at::Tensor&, double, const OptTensor&);

auto efficient_backward(std::shared_ptr<const Original> orig) {
  return [orig](c10::DispatchKeySet ks, const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
                const at::Tensor& value, const at::Tensor& attn_bias, const at::Tensor& out,
                const at::Tensor& logsumexp, const at::Tensor& philox_seed, const at::Tensor& philox_offset,
                double dropout_p, std::array<bool, 4> grad_input_mask, bool is_causal,
                std::optional<double> scale) -> EffBwdRet {
    const OptTensor bias = attn_bias.defined() ? OptTensor(attn_bias) : std::nullopt;
    const int64_t lse_len = query.dim() == 4 ? efficient_lse_len(query.size(2), true) : 0;
    const std::string why = first_refusal(
        [&] { return stateless_dropout_refusal(dropout_p); }, [&] { return efficient_bias_refusal(bias, query, key); },
        [&] { return scale_refusal(scale); }, [&] { return dense_refusal(query, key, value, 2); },
        [&] {
          return bwd_refusal(grad_out, query, out, logsumexp, {query.size(0), query.size(1), lse_len});
        });
    if (!why.empty()) {
      count_refused(kEffBwd, why);
      return orig->call<EffBwdRet>(ks, grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed,
                                   philox_offset, dropout_p, grad_input_mask, is_causal, scale);
    }
    count_ours(kEffBwd);
    const at::Tensor lse = logsumexp.narrow(2, 0, query.size(2)).contiguous();
    at::Tensor dq, dk, dv, grad_bias;
    if (bias.has_value() && grad_input_mask[3]) {
      static auto op =
          c10::Dispatcher::singleton().findSchemaOrThrow("flashattn_ext::bwd_mask_grad", "").typed<BwdMaskGradSig>();
      at::Tensor dmask;
      std::tie(dq, dk, dv, dmask) =
          op.call(bshd(grad_out), bshd(query), bshd(key), bshd(value), bshd(out), lse, scale_of(scale, query), -1,
                  is_causal ? 0 : -1, /*bottom_right=*/false, deterministic(), attn_bias, 0.0, std::nullopt);
      // torch's kernel (and its meta function) return the bias's gradient in a
      // buffer whose rows are padded to 16 elements.
      const int64_t cols = attn_bias.size(-1), padded = (cols + 15) / 16 * 16;
      std::vector<int64_t> sizes = attn_bias.sizes().vec();
      sizes.back() = padded;
      grad_bias = at::empty(sizes, attn_bias.options()).narrow(-1, 0, cols);
      grad_bias.copy_(dmask);
    } else {
      std::tie(dq, dk, dv) = sdpa_layout_backward(grad_out, query, key, value, out, lse, scale, is_causal,
                                                  /*bottom_right=*/false, 0.0, std::nullopt, bias);
    }
    // (B, L, H, E) buffers seen as (B, H, L, E), as torch's kernel returns them.
    return {bhld_view(dq), bhld_view(dk), bhld_view(dv), grad_bias};
  };
}

// ----------------------------------------------------------------------------- registration

// Drops the dispatcher's "Overriding a previously registered kernel" warning
// while ours are registered (overriding torch's kernel is the point); any other
// warning goes to the handler that was there.
class OverrideWarningFilter : public c10::WarningHandler {
 public:
  explicit OverrideWarningFilter(c10::WarningHandler* next) : next_(next) {}
  void process(const c10::Warning& warning) override {
    if (warning.msg().find("Overriding a previously registered kernel") != std::string::npos) return;
    if (next_ != nullptr) next_->process(warning);
  }

 private:
  c10::WarningHandler* next_;
};

// The libraries registered now, by handle. Never destroyed (a process exiting
// while activated leaves its kernels registered rather than deregister them
// during static destruction, when the dispatcher may be gone).
std::mutex g_libraries_mutex;
auto& g_libraries = *new std::map<int64_t, std::unique_ptr<torch::Library>>();
int64_t g_next_handle = 1;

// Registers the overrides named in ops for dispatch_key ("CPU", "CUDA"),
// each falling back to the kernel torch has there now. Returns the handle
// _backend_unregister takes.
int64_t backend_register(const std::string& dispatch_key, const std::vector<std::string>& ops) {
  const c10::DispatchKey key = c10::parseDispatchKey(dispatch_key);
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", key, __FILE__, __LINE__);
  OverrideWarningFilter filter(c10::WarningUtils::get_warning_handler());
  c10::WarningUtils::WarningHandlerGuard guard(&filter);
  for (const std::string& name : ops) {
    auto orig = original(name, key);  // fetched before ours replaces it
    if (name == kOpNames[kCpuFwd]) {
      lib->impl(name.c_str(), torch::CppFunction(cpu_forward(orig)));
    } else if (name == kOpNames[kCpuBwd]) {
      lib->impl(name.c_str(), torch::CppFunction(cpu_backward(orig)));
    } else if (name == kOpNames[kSdpaFwd]) {
      lib->impl(name.c_str(), torch::CppFunction(sdpa_forward(orig)));
    } else if (name == kOpNames[kSdpaBwd]) {
      lib->impl(name.c_str(), torch::CppFunction(sdpa_backward(orig)));
    } else if (name == kOpNames[kEffFwd]) {
      lib->impl(name.c_str(), torch::CppFunction(efficient_forward(orig)));
    } else if (name == kOpNames[kEffBwd]) {
      lib->impl(name.c_str(), torch::CppFunction(efficient_backward(orig)));
    } else {
      TORCH_CHECK_VALUE(false, "flashattn_ext: no C++ override for aten::", name);
    }
  }
  std::lock_guard<std::mutex> lock(g_libraries_mutex);
  const int64_t handle = g_next_handle++;
  g_libraries.emplace(handle, std::move(lib));
  return handle;
}

// Destroys the library of handle (its kernels deregister; torch's are the
// computed ones again). Returns whether the handle was registered.
bool backend_unregister(int64_t handle) {
  std::unique_ptr<torch::Library> lib;
  {
    std::lock_guard<std::mutex> lock(g_libraries_mutex);
    auto it = g_libraries.find(handle);
    if (it == g_libraries.end()) return false;
    lib = std::move(it->second);
    g_libraries.erase(it);
  }
  lib.reset();  // outside our lock: deregistering takes the dispatcher's
  return true;
}

void backend_configure(int64_t cuda_max_head_dim) {
  g_cuda_max_head_dim.store(cuda_max_head_dim, std::memory_order_relaxed);
}

std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<int64_t>> backend_calls() {
  std::vector<std::string> ops, routes;
  std::vector<int64_t> counts;
  for (int op = 0; op < kNumOps; ++op) {
    const int64_t n = g_ours[op].load(std::memory_order_relaxed);
    if (n == 0) continue;
    ops.emplace_back(kOpNames[op]);
    routes.emplace_back("flashattn_ext");
    counts.push_back(n);
  }
  std::lock_guard<std::mutex> lock(g_refused_mutex);
  for (const auto& [op_why, n] : g_refused) {
    ops.emplace_back(kOpNames[op_why.first]);
    routes.emplace_back("torch: " + op_why.second);
    counts.push_back(n);
  }
  return {ops, routes, counts};
}

void backend_reset_calls() {
  for (auto& n : g_ours) n.store(0, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(g_refused_mutex);
  g_refused.clear();
}

}  // namespace
}  // namespace backend
}  // namespace flashattn

// Internal ops of flashattn_ext/backend.py (leading underscore: not API).
// Catch-all kernels: they take no tensors to dispatch on, or read only their
// metadata.
TORCH_LIBRARY_FRAGMENT(flashattn_ext, m) {
  namespace b = flashattn::backend;
  m.def("_backend_configure(int cuda_max_head_dim) -> ()", &b::backend_configure);
  // interface._cuda_arch_supported's answer (False in a build without CUDA kernels).
  m.def("_cuda_arch_supported(int device_index) -> bool", &b::cuda_arch_supported);
  m.def("_backend_register(str dispatch_key, str[] ops) -> int", &b::backend_register);
  m.def("_backend_unregister(int handle) -> bool", &b::backend_unregister);
  m.def("_backend_calls() -> (str[] ops, str[] routes, int[] counts)", &b::backend_calls);
  m.def("_backend_reset_calls() -> ()", &b::backend_reset_calls);
  // The refusal rules for backend.py's Python overrides (FA2's ops): "" when ours take the call.
  m.def("_backend_dropout_refusal(float dropout_p) -> str", &b::dropout_refusal);
  m.def("_backend_rng_state_refusal(float dropout_p, Tensor? philox_seed, Tensor q) -> str",
        [](double dropout_p, const std::optional<at::Tensor>& seed, const at::Tensor& q) {
          return b::rng_state_refusal(dropout_p, seed.has_value() ? *seed : at::Tensor(), q);
        });
  // Our dropout state as the flash ops return it (uint64 (2,), tagged as ours).
  m.def("_backend_tagged_rng_state(Tensor rng_state) -> Tensor", &b::tagged_rng_state);
  m.def("_backend_scale_refusal(float? scale) -> str",
        [](std::optional<double> scale) { return b::scale_refusal(scale); });
  m.def("_backend_dense_refusal(Tensor q, Tensor k, Tensor v, int seq_dim) -> str", &b::dense_refusal);
  m.def("_backend_varlen_refusal(Tensor q, Tensor k, Tensor v, Tensor? cu_q, Tensor? cu_k) -> str", &b::varlen_refusal);
  m.def("_backend_bwd_refusal(Tensor grad_out, Tensor q, Tensor out, Tensor lse, int[] lse_shape) -> str",
        [](const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& out, const at::Tensor& lse,
           std::vector<int64_t> lse_shape) { return b::bwd_refusal(grad_out, q, out, lse, lse_shape); });
}
