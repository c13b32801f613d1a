// The operator schema, declared once. Each backend registers its kernels with
// TORCH_LIBRARY_IMPL in its own file (csrc/cpu/, csrc/cuda/); the autograd
// formula, the autocast kernels and the catch-all kernels that reject every
// other backend in csrc/autograd.cpp; the fake (meta) kernels, which validate
// like the real ones, and the vmap rules from Python (flashattn_ext/_ops.py).
#include <Python.h>
#include <torch/library.h>

#include <string>

#ifndef FLASHATTN_CUDA_ARCHS
#define FLASHATTN_CUDA_ARCHS ""
#endif
#ifndef FLASHATTN_HEAD_DIMS
#define FLASHATTN_HEAD_DIMS ""
#endif

static std::string build_info() {
#ifdef FLASHATTN_WITH_CUDA
  const char* cuda = "1";
#else
  const char* cuda = "0";
#endif
#ifdef FLASHATTN_TUNING
  const char* tuning = ";tuning=1";
#else
  const char* tuning = "";
#endif
  return std::string("cuda=") + cuda + ";archs=" + FLASHATTN_CUDA_ARCHS + ";head_dims=" + FLASHATTN_HEAD_DIMS + tuning;
}

// `import flashattn_ext._C` loads this library, which registers the ops. The
// module itself is empty; building against the limited API keeps one binary
// valid for every CPython 3.10+.
extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "flashattn_ext kernels (ops live in torch.ops.flashattn_ext)", -1, nullptr,
  };
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(flashattn_ext, m) {
  // q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim).
  // Returns out (batch, seqlen_q, heads_q, head_dim) and the log-sum-exp of the
  // scaled scores, lse (batch, heads_q, seqlen_q) in float32 (float64 for float64
  // inputs); -inf on rows that see no key.
  // window_left / window_right: -1 unbounded; causal is window_right = 0.
  // softcap, alibi_slopes: flash-attn's score modifications (ScoreMod in
  // flash_params.h: softcap * tanh(s / softcap), then minus slope * |i + seqlen_k
  // - seqlen_q - j|; slopes float32 (heads_q,) or (batch, heads_q), no gradient).
  // Every op takes them, last, defaulting to none; bwd needs the forward's.
  // attn_mask (attention, fwd, bwd): torch SDPA's, bool (True = attend) or
  // float32 / q's dtype added to the scaled scores, broadcastable to (batch,
  // heads_q, seqlen_q, seqlen_k) and read through its strides (AttnBias in
  // flash_params.h); its gradient through bwd_mask_grad; not with softcap / ALiBi.
  // bottom_right: align the diagonal to the last key (FlashAttention) instead of
  // the first (torch SDPA).
  // dropout_p, rng_state (every op but fwd_kvcache, last): dropout on the
  // probabilities, kept ones scaled by 1 / (1 - dropout_p); lse stays that of
  // the softmax without dropout. rng_state: int64 (2,) [seed, offset] (uint64
  // bit patterns), the keep mask of csrc/philox.h, so that bwd regenerates the
  // forward's mask from the same rng_state; on q's device: the CPU kernels read
  // it on the host, the CUDA kernels on the device (written there by a
  // graph-safe unpack of torch's Philox state, dropout_rng_state). attention / varlen_attention
  // draw one from torch's generator (dropout_rng_state) when it is None, and
  // their backward reuses it; fwd / bwd require it with dropout_p > 0.
  //
  // attention: the differentiable op the Python API calls. Its autograd formula
  // (csrc/autograd.cpp) saves q, k, v, out, lse and calls bwd; deterministic is
  // only used there (it picks the backward kernels). Below autograd it is fwd.
  // Unlike fwd it takes any strides (a strided head_dim is copied) and, with
  // bhsd=True, q, k, v and out in torch's (batch, heads, seqlen, head_dim)
  // layout (scaled_dot_product_attention): the transpositions are views made
  // here, in C++, where they cost no autograd bookkeeping. lse is
  // (batch, heads_q, seqlen_q) either way.
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, float softmax_scale, int window_left, int window_right, "
      "bool bottom_right, bool deterministic, bool bhsd=False, float softcap=0., Tensor? alibi_slopes=None, "
      "Tensor? attn_mask=None, float dropout_p=0., Tensor? rng_state=None) -> (Tensor out, Tensor lse)");
  // The forward kernels alone. Not differentiable: backpropagating through it
  // raises (use attention).
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, int window_left, int window_right, "
      "bool bottom_right, float softcap=0., Tensor? alibi_slopes=None, Tensor? attn_mask=None, "
      "float dropout_p=0., Tensor? rng_state=None) -> (Tensor out, Tensor lse)");
  // Recomputes the probabilities tile by tile from lse; returns gradients with
  // the shapes of q, k, v. Not differentiable (no double backward): its
  // gradients, when something asks for them, raise.
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float softmax_scale, "
      "int window_left, int window_right, bool bottom_right, bool deterministic, float softcap=0., "
      "Tensor? alibi_slopes=None, Tensor? attn_mask=None, float dropout_p=0., Tensor? rng_state=None) -> (Tensor dq, "
      "Tensor dk, Tensor dv)");
  // bwd for a float attn_mask that requires grad: also its gradient, dS (the
  // gradient of the scaled scores) summed over the dimensions the mask
  // broadcasts, in the mask's shape and dtype (AttnBias::grad in
  // flash_params.h). A separate op, so that bwd computes nothing for it.
  m.def(
      "bwd_mask_grad(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float softmax_scale, "
      "int window_left, int window_right, bool bottom_right, bool deterministic, Tensor attn_mask, "
      "float dropout_p=0., Tensor? rng_state=None) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dmask)");
  // Variable-length batches (flash_attn_varlen_func), FlashAttention-2's varlen
  // layout: the sequences packed along dimension 0, q (total_q, heads_q,
  // head_dim), k, v (total_k, heads_kv, head_dim); cu_seqlens_q / cu_seqlens_k
  // int32 (batch + 1,) cumulative lengths on q's device, read by the kernels
  // (sequence b is rows cu[b]:cu[b + 1]); max_seqlen_q / max_seqlen_k bound the
  // lengths (they size the kernels' grids). bottom_right aligns each
  // sequence's diagonal to its own last key. Returns out with q's shape and lse
  // (heads_q, total_q). The CUDA kernels do not check cu_seqlens' values (that
  // would synchronise the host; they clamp them to the tensors instead); the
  // CPU kernels do. varlen_attention is the differentiable op (autograd
  // formula in csrc/autograd.cpp, any strides: a strided head_dim is copied);
  // varlen_fwd and varlen_bwd are the kernels, as fwd and bwd.
  m.def(
      "varlen_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
      "int max_seqlen_k, float softmax_scale, int window_left, int window_right, bool bottom_right, "
      "bool deterministic, float softcap=0., Tensor? alibi_slopes=None, float dropout_p=0., Tensor? rng_state=None) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
      "int max_seqlen_k, float softmax_scale, int window_left, int window_right, bool bottom_right, "
      "float softcap=0., Tensor? alibi_slopes=None, float dropout_p=0., Tensor? rng_state=None) -> (Tensor out, Tensor "
      "lse)");
  m.def(
      "varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale, int window_left, "
      "int window_right, bool bottom_right, bool deterministic, float softcap=0., Tensor? alibi_slopes=None, "
      "float dropout_p=0., Tensor? rng_state=None) -> (Tensor dq, Tensor dk, Tensor dv)");
  // flash_attn_varlen_func with block_table (flash-attn 2.8's paged KV;
  // csrc/paged_varlen_api.h): q packed as in varlen_fwd, k_cache / v_cache
  // (num_blocks, page_size, heads_kv, head_dim) with page_size a multiple of
  // 16, block_table (batch, max_blocks) int32; sequence b has cu_seqlens_k[b +
  // 1] - cu_seqlens_k[b] keys at positions 0.. of its page-table row; causal
  // and windows bottom-right. Forward only (flash-attn has no backward with
  // block_table), no dropout. Returns out with q's shape and lse (heads_q, total_q).
  m.def(
      "varlen_fwd_paged(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "Tensor block_table, int max_seqlen_q, int max_seqlen_k, float softmax_scale, int window_left, "
      "int window_right, float softcap=0., Tensor? alibi_slopes=None) -> (Tensor out, Tensor lse)");

  // Attention of q (batch, seqlen_q, heads_q, head_dim) against a KV cache, for
  // inference (flash_attn_with_kvcache calls it after appending the new keys):
  // batch row b sees the keys [cache_leftpad[b], seqlens_k[b]) of cache row
  // cache_batch_idx[b] (default b), k_cache/v_cache (batch_cache, seqlen_cache,
  // heads_kv, head_dim) or, with block_table (batch, max_blocks) int32, paged
  // (num_blocks, page_size, heads_kv, head_dim). Causal (window_right = 0) and
  // windows are aligned bottom-right per row: query i sits at key
  // seqlens_k[b] - seqlen_q + i. The int32 (batch,) tensors stay on q's device:
  // the CUDA kernels read them there (no host synchronisation; values out of
  // range are clamped, not checked), the CPU kernel checks them. num_splits:
  // split-KV parts per row on CUDA (0: chosen from the SM count and the shapes).
  // Not differentiable. Returns out and lse as fwd does. bhsd=True: q, the
  // caches and out in torch's (batch, heads, seqlen, head_dim) layout (the
  // SDPA drop-in's decode route; not with block_table), read through
  // transposed views made here, below autograd, where they are cheap.
  m.def(
      "fwd_kvcache(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seqlens_k, Tensor? cache_batch_idx, "
      "Tensor? cache_leftpad, Tensor? block_table, float softmax_scale, int window_left, int window_right, "
      "int num_splits, bool bhsd=False, float softcap=0., Tensor? alibi_slopes=None) -> (Tensor out, Tensor lse)");
  // flash_attn_with_kvcache's step before fwd_kvcache, one kernel: q rotated
  // (returned, a new contiguous tensor; a copy without rotary tables; an
  // empty (0,) tensor when q is None) and the new k (rotated) and v, (batch,
  // seqlen_new, heads_kv, head_dim), written into k_cache / v_cache in place at
  // positions cache_seqlens[b] + i of cache row cache_batch_idx[b] (default
  // b), or through block_table (paged; not with cache_batch_idx). Rotary
  // (rotary_cos / rotary_sin (seqlen_ro, rotary_dim / 2), the caches' dtype)
  // on the first rotary_dim dims, computed in float32 (float64 for float32 /
  // float64 inputs) and rounded once: interleaved GPT-J pairs (2i, 2i + 1),
  // else GPT-NeoX halves; the new key i at its cache position, q row i at
  // cache_seqlens[b] + i when q_per_token (causal / local attention), else
  // every q row at cache_seqlens[b]. The integer values are read by the kernels
  // (on CUDA on the device: no host synchronisation, capturable in a CUDA
  // graph) and clamped to the tensors, not checked (csrc/append_rotary_params.h).
  m.def(
      "kvcache_append_rotary(Tensor? q, Tensor? k, Tensor? v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor cache_seqlens, Tensor? cache_batch_idx, Tensor? block_table, Tensor? rotary_cos, Tensor? rotary_sin, "
      "bool interleaved, bool q_per_token) -> Tensor");
  // Dropout's random state for one call (csrc/dropout_api.cpp): int64 (2,)
  // [seed, offset] for a call of batch x heads_q (b, h) planes (the offset
  // advances by dropout_offset_increment of csrc/philox.h), drawn from torch's
  // default generator of q's device (torch.manual_seed reproduces it, two
  // draws differ), on q's device (CPU: a fresh seed, offset 0; CUDA: the
  // generator's seed and Philox offset, written on the device, graph-safe).
  // Random: tagged nondeterministic_seeded, so that compilers neither fold nor
  // deduplicate it.
  m.def("dropout_rng_state(Tensor q, int batch, int heads_q) -> Tensor", {at::Tag::nondeterministic_seeded});
  // The keep mask of csrc/philox.h, drawn by the kernels' own code: bool
  // (batch, heads_q, seqlen_q, seqlen_k), True = kept. A probe for tests and
  // for return_attn_probs (flash_attn_func's S_dmask).
  m.def(
      "dropout_keep_mask(Tensor rng_state, int batch, int heads_q, int seqlen_q, int seqlen_k, float dropout_p) "
      "-> Tensor");
  // What this build holds, as "key=value;..." (cuda, archs, head dims).
  m.def("build_info() -> str", []() -> std::string { return build_info(); });
}
