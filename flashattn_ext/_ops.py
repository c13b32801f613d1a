"""Python side of the ops declared in csrc/ops.cpp (the autograd formula,
autocast and catch-all kernels are in C++, csrc/autograd.cpp):

* fake (meta) kernels, so that torch.compile can trace the ops and meta
  tensors get shapes. They validate exactly as the real kernels do
  (csrc/attention_api.cpp: same checks, same messages), so that an input the
  kernels reject is rejected while tracing or on meta tensors too, and a mix of
  devices (a CPU q with meta k, v) raises instead of returning memory nobody
  wrote;
* vmap rules (torch.func.vmap, and jacrev/hessian through it): the vmapped
  dimension is folded into the batch dimension.

The ops take the FlashAttention layout, q (batch, seqlen_q, heads_q, head_dim),
k and v (batch, seqlen_k, heads_kv, head_dim), and return out with q's shape
plus lse (batch, heads_q, seqlen_q)."""

import math

import torch

from . import _C  # noqa: F401  (loads the library, which registers the ops)

attention = torch.ops.flashattn_ext.attention.default  # differentiable; what the Python API calls
fwd_op = torch.ops.flashattn_ext.fwd.default  # the forward kernels alone
bwd = torch.ops.flashattn_ext.bwd.default
bwd_mask_grad = torch.ops.flashattn_ext.bwd_mask_grad.default
fwd_kvcache = torch.ops.flashattn_ext.fwd_kvcache.default  # attention against a KV cache (inference)
varlen_fwd_paged = torch.ops.flashattn_ext.varlen_fwd_paged.default  # flash_attn_varlen_func with block_table
# rotary on q and the new keys, the append into the cache (flash_attn_with_kvcache's step before fwd_kvcache)
kvcache_append_rotary = torch.ops.flashattn_ext.kvcache_append_rotary.default
# The benchmarks (benchmarks/kernel_check.py, tune.py, bench_cpu.py) call
# _ops.fwd(q, k, v, scale, window_left, window_right, bottom_right, deterministic)
# and backpropagate through it: the differentiable op, under its old name.
fwd = attention

_MAX_HEAD_DIM = 256
_INT_MAX = 2**31 - 1


def unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """The kernels need stride 1 on head_dim; copy only when it is not already so."""
    if x.dim() > 0 and x.stride(-1) != 1:
        x = x.contiguous()
        if x.stride(-1) != 1:  # a size-1 head_dim keeps any stride through .contiguous()
            x = x.clone(memory_format=torch.contiguous_format)
    return x


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- validation
# A copy of csrc/attention_api.cpp's checks, in its order and words
# (tests/test_errors.py runs every case through both).

# c10's names of the dtypes (what the C++ messages print).
_C10_NAMES = {
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.float32: "Float",
    torch.float64: "Double",
    torch.uint8: "Byte",
    torch.int8: "Char",
    torch.int16: "Short",
    torch.int32: "Int",
    torch.int64: "Long",
    torch.bool: "Bool",
    torch.complex32: "ComplexHalf",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}

_KERNEL_DTYPES = {
    "cpu": (torch.float32, torch.float64, torch.bfloat16, torch.float16),
    "cuda": (torch.float16, torch.bfloat16),
}
_CUDA_DTYPE_HINT = (
    "; cast float32 inputs to bfloat16 or float16 (flashattn_ext.scaled_dot_product_attention falls back to "
    "torch for float32 on CUDA)"
)


def _c10(dtype):
    return _C10_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _sizes(t):
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _strides(t):
    return "[" + ", ".join(str(s) for s in t.stride()) + "]"


def _rank4(t, name, layout):
    if t.dim() != 4:
        raise ValueError(
            f"flashattn_ext: {name} must have 4 dimensions {layout}, got shape {_sizes(t)}; reshape it "
            "(flash_attn_func takes (batch, seqlen, heads, head_dim))"
        )


def _same_device(t, name, q):
    if t.device != q.device:
        raise ValueError(f"flashattn_ext: {name} is on {t.device} but q is on {q.device}; move them to one device")


def _same_dtype(t, name, q):
    if t.dtype != q.dtype:
        raise TypeError(
            f"flashattn_ext: {name} has dtype {_c10(t.dtype)} but q has dtype {_c10(q.dtype)}; cast them to one dtype"
        )


def _head_dim_nonzero(t, name):
    if t.shape[-1] == 0:
        raise ValueError(
            f"flashattn_ext: {name} has head_dim 0 (shape {_sizes(t)}); the head dimension must be at least 1"
        )


def _fits_int(t, name):
    for i, s in enumerate(t.shape):
        if s > _INT_MAX:
            raise ValueError(f"flashattn_ext: {name} dimension {i} has size {s}, larger than 2^31 - 1; split the call")


def _last_dim_contiguous(t, name):
    if t.stride(-1) != 1:
        raise ValueError(
            f"flashattn_ext: {name} must have stride 1 in its last (head_dim) dimension, got strides {_strides(t)}; "
            f"pass {name}.contiguous() (flash_attn_func and scaled_dot_product_attention do this only when needed)"
        )


def _devices_and_dtypes(q, k, k_name, v, v_name):
    """csrc/attention_api.cpp check_devices_and_dtypes; returns the backend (q's device type)."""
    _same_device(k, k_name, q)
    _same_device(v, v_name, q)
    _same_dtype(k, k_name, q)
    _same_dtype(v, v_name, q)
    backend = q.device.type
    dtypes = _KERNEL_DTYPES.get(backend, _KERNEL_DTYPES["cpu"])
    if q.dtype not in dtypes:
        name = {"cpu": "CPU", "cuda": "CUDA"}.get(backend, backend)
        hint = _CUDA_DTYPE_HINT if backend == "cuda" else ""
        raise TypeError(
            f"flashattn_ext: q has dtype {_c10(q.dtype)}, which the {name} kernels do not support; use one of "
            f"{', '.join(_c10(d) for d in dtypes)}{hint}"
        )
    return backend


def _head_dim_supported(head_dim):
    if head_dim > _MAX_HEAD_DIM:
        raise ValueError(
            f"flashattn_ext: head_dim {head_dim} is larger than {_MAX_HEAD_DIM}, the largest the kernels support; "
            "split the heads or use torch's attention"
        )


def _heads_divide(heads_q, heads_kv):
    if (heads_q != 0) if heads_kv == 0 else (heads_q % heads_kv != 0):
        raise ValueError(
            f"flashattn_ext: q has {heads_q} heads, not a multiple of the {heads_kv} heads of k and v; for "
            "GQA/MQA the key/value heads must divide the query heads"
        )


def _compiled_head_dim(backend, head_dim):
    """csrc/cuda/binding_util.h kernel_head_dim: a CUDA kernel of this build holds head_dim."""
    if backend == "cuda":
        from .interface import _BUILD  # the compiled CUDA head dims

        if head_dim > max(_BUILD["head_dims"], default=0):
            raise ValueError(
                f"flashattn_ext: no CUDA kernel for head_dim {head_dim} in this build (compiled head dims: "
                f"{','.join(str(d) for d in _BUILD['head_dims'])}); rebuild with FLASHATTN_HEAD_DIMS including a head "
                f"dim >= {head_dim}"
            )


def check_qkv(q, k, v, unit_stride=True):
    """csrc/attention_api.cpp check_qkv, for the device q is on (meta tensors:
    any dtype some backend takes). unit_stride=False: the strides are the
    attention op's business (it copies a strided head_dim)."""
    _rank4(q, "q", "(batch, seqlen_q, heads_q, head_dim)")
    _rank4(k, "k", "(batch, seqlen_k, heads_kv, head_dim)")
    _rank4(v, "v", "(batch, seqlen_k, heads_kv, head_dim)")
    backend = _devices_and_dtypes(q, k, "k", v, "v")
    _head_dim_nonzero(q, "q")
    _head_dim_nonzero(k, "k")
    _head_dim_nonzero(v, "v")
    _fits_int(q, "q")
    _fits_int(k, "k")
    head_dim = q.shape[3]
    if k.shape[3] != head_dim:
        raise ValueError(
            f"flashattn_ext: k has head_dim {k.shape[3]} but q has head_dim {head_dim}; q and k must share their last dimension"
        )
    if v.shape[3] != head_dim:
        raise ValueError(
            f"flashattn_ext: v has head_dim {v.shape[3]} but q has {head_dim}; a value head dim different from the "
            "query's is not supported by the kernels (scaled_dot_product_attention falls back to torch for it)"
        )
    _head_dim_supported(head_dim)
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(
            f"flashattn_ext: batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}; q, k and v must share dimension 0"
        )
    if v.shape[1] != k.shape[1]:
        raise ValueError(
            f"flashattn_ext: v has seqlen {v.shape[1]} but k has {k.shape[1]}; k and v must share dimension 1 (seqlen_k)"
        )
    if v.shape[2] != k.shape[2]:
        raise ValueError(
            f"flashattn_ext: v has {v.shape[2]} heads but k has {k.shape[2]}; k and v must share dimension 2 (heads_kv)"
        )
    _heads_divide(q.shape[2], k.shape[2])
    if unit_stride:
        for t, name in ((q, "q"), (k, "k"), (v, "v")):
            _last_dim_contiguous(t, name)
    _compiled_head_dim(backend, head_dim)


def check_scalars(softmax_scale, window_left, window_right):
    """csrc/attention_api.cpp make_mask and make_fwd_params."""
    if window_left < -1 or window_right < -1:
        raise ValueError(
            f"flashattn_ext: window sizes must be -1 (unbounded) or >= 0, got window_left={window_left}, "
            f"window_right={window_right}"
        )
    if not math.isfinite(softmax_scale):
        raise ValueError(f"flashattn_ext: softmax_scale must be finite, got {softmax_scale}")


def _bwd_tensors(dout, q, out, lse, lse_shape, lse_layout):
    """csrc/attention_api.cpp check_bwd_tensors: dout, out and lse of either backward against q;
    lse_shape is the shape of the forward's lse, lse_layout the names of its dimensions."""
    _same_device(dout, "dout", q)
    _same_device(out, "out", q)
    _same_device(lse, "lse", q)
    _same_dtype(dout, "dout", q)
    _same_dtype(out, "out", q)
    if dout.shape != q.shape:
        raise ValueError(
            f"flashattn_ext: dout has shape {_sizes(dout)} but q has {_sizes(q)}; dout must have the shape of the forward output"
        )
    if out.shape != q.shape:
        raise ValueError(
            f"flashattn_ext: out has shape {_sizes(out)} but q has {_sizes(q)}; pass the output of the forward"
        )
    if lse.dtype != _lse_dtype(q.dtype):
        raise TypeError(
            f"flashattn_ext: lse has dtype {_c10(lse.dtype)}, expected {_c10(_lse_dtype(q.dtype))}; pass the lse of the forward"
        )
    if tuple(lse.shape) != tuple(lse_shape):
        raise ValueError(
            f"flashattn_ext: lse has shape {_sizes(lse)}, expected {lse_layout} = ({', '.join(map(str, lse_shape))}); "
            "pass the lse of the forward"
        )
    if not lse.is_contiguous():
        raise ValueError("flashattn_ext: lse must be contiguous; pass the lse of the forward")
    _last_dim_contiguous(dout, "dout")
    _last_dim_contiguous(out, "out")


def check_bwd_extras(dout, q, out, lse):
    """csrc/attention_api.cpp check_bwd_extras."""
    _bwd_tensors(dout, q, out, lse, (q.shape[0], q.shape[2], q.shape[1]), "(batch, heads_q, seqlen_q)")


def _fwd_outputs(q, lse_shape):
    """What the forward fake kernels return: out like q, lse of lse_shape in the accumulation dtype."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return out, torch.empty(lse_shape, dtype=_lse_dtype(q.dtype), device=q.device)


def _empty_like_each(*tensors):
    """What the backward fake kernels return: a new tensor of each one's shape, dtype and device."""
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors)


# ----------------------------------------------------------------------------- fake kernels


def check_score_mod(q, softcap, alibi_slopes, batch, heads_q):
    """csrc/attention_api.cpp make_score_mod's checks (same order, same words)."""
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"flashattn_ext: softcap must be a finite number >= 0 (0: no softcapping), got {softcap}")
    if alibi_slopes is None:
        return
    s = alibi_slopes
    if s.dtype != torch.float32:
        raise TypeError(
            f"flashattn_ext: alibi_slopes must have dtype torch.float32, got {_c10(s.dtype)}; pass alibi_slopes.float()"
        )
    if s.device != q.device:
        raise ValueError(
            f"flashattn_ext: alibi_slopes is on {s.device} but q is on {q.device}; pass alibi_slopes.to(q.device)"
        )
    if tuple(s.shape) not in ((heads_q,), (batch, heads_q)):
        raise ValueError(
            f"flashattn_ext: alibi_slopes must have shape (nheads,) = ({heads_q},) or (batch, nheads) = ({batch}, "
            f"{heads_q}), got {list(s.shape)}"
        )
    if heads_q > 1 and s.stride(-1) != 1:
        raise ValueError(
            "flashattn_ext: alibi_slopes must have a unit stride on the heads; pass alibi_slopes.contiguous()"
        )


def check_attn_mask(q, k, attn_mask, softcap, alibi_slopes):
    """csrc/attention_api.cpp add_attn_mask's checks (same order, same words); q, k (batch, seqlen, heads, dim)."""
    if attn_mask is None:
        return
    m = attn_mask
    if softcap != 0.0 or alibi_slopes is not None:
        raise ValueError(
            "flashattn_ext: attn_mask cannot be combined with softcap or alibi_slopes; add them to the mask"
        )
    if m.dtype not in (torch.bool, torch.float32, q.dtype):
        raise TypeError(
            f"flashattn_ext: attn_mask must be bool, float32 or the dtype of q ({_c10(q.dtype)}), got {_c10(m.dtype)}; "
            "pass attn_mask.to(q.dtype)"
        )
    if m.device != q.device:
        raise ValueError(
            f"flashattn_ext: attn_mask is on {m.device} but q is on {q.device}; pass attn_mask.to(q.device)"
        )
    full = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    if not 2 <= m.dim() <= 4:
        raise ValueError(
            "flashattn_ext: attn_mask must have 2 to 4 dimensions that broadcast to (batch, heads, seqlen_q, "
            f"seqlen_k) = ({full[0]}, {full[1]}, {full[2]}, {full[3]}), got shape {list(m.shape)}"
        )
    for size, want in zip(m.shape, full[4 - m.dim() :]):
        if size != want and size != 1:
            raise ValueError(
                f"flashattn_ext: attn_mask of shape {list(m.shape)} does not broadcast to (batch, heads, seqlen_q, "
                f"seqlen_k) = ({full[0]}, {full[1]}, {full[2]}, {full[3]})"
            )


def check_dropout(dropout_p, rng_state, device, drawn=False):
    """csrc/attention_api.cpp make_dropout's checks (same words); device: q's
    (rng_state must be on it); drawn: the op draws rng_state itself when it is
    None (attention, varlen_attention)."""
    if not (math.isfinite(dropout_p) and 0.0 <= dropout_p <= 1.0):
        raise ValueError(f"flashattn_ext: dropout_p must be in [0, 1], got {dropout_p}")
    if dropout_p == 0.0 or (drawn and rng_state is None):
        return
    if rng_state is None:
        raise ValueError(
            "flashattn_ext: dropout_p > 0 needs rng_state, an int64 (2,) tensor [seed, offset] "
            "(flashattn_ext::dropout_rng_state draws one)"
        )
    if rng_state.dtype != torch.int64 or rng_state.shape != (2,) or rng_state.device != device:
        raise ValueError(
            f"flashattn_ext: rng_state must be an int64 (2,) tensor [seed, offset] on {device} (q's device), got "
            f"{_c10(rng_state.dtype)} of shape {list(rng_state.shape)} on {rng_state.device}"
        )
    if device.type != "cpu" and rng_state.stride(0) != 1:
        raise ValueError(f"flashattn_ext: rng_state must be contiguous, got stride {rng_state.stride(0)}")


@torch.library.register_fake("flashattn_ext::dropout_rng_state")
def _dropout_rng_state_fake(q, batch, heads_q):
    return torch.empty(2, dtype=torch.int64, device=q.device)  # on q's device, as the CPU / CUDA ops draw it


@torch.library.register_fake("flashattn_ext::dropout_keep_mask")
def _dropout_keep_mask_fake(rng_state, batch, heads_q, seqlen_q, seqlen_k, dropout_p):
    return torch.empty(batch, heads_q, seqlen_q, seqlen_k, dtype=torch.bool, device=rng_state.device)


def _fwd_fake_impl(q, k, v, softmax_scale, window_left, window_right, unit_stride=True):
    check_qkv(q, k, v, unit_stride)
    check_scalars(softmax_scale, window_left, window_right)
    return _fwd_outputs(q, (q.shape[0], q.shape[2], q.shape[1]))


@torch.library.register_fake("flashattn_ext::fwd")
def _fwd_fake(
    q,
    k,
    v,
    softmax_scale,
    window_left,
    window_right,
    bottom_right,
    softcap=0.0,
    alibi_slopes=None,
    attn_mask=None,
    dropout_p=0.0,
    rng_state=None,
):
    res = _fwd_fake_impl(q, k, v, softmax_scale, window_left, window_right)
    check_score_mod(q, softcap, alibi_slopes, q.shape[0], q.shape[2])
    check_attn_mask(q, k, attn_mask, softcap, alibi_slopes)
    check_dropout(dropout_p, rng_state, q.device)
    return res


@torch.library.register_fake("flashattn_ext::attention")
def _attention_fake(
    q,
    k,
    v,
    softmax_scale,
    window_left,
    window_right,
    bottom_right,
    deterministic,
    bhsd=False,
    softcap=0.0,
    alibi=None,
    attn_mask=None,
    dropout_p=0.0,
    rng_state=None,
):
    if bhsd:  # csrc/autograd.cpp kernel_layout / caller_layout
        q, k, v = (x.transpose(1, 2) if x.dim() == 4 else x for x in (q, k, v))
    out, lse = _fwd_fake_impl(q, k, v, softmax_scale, window_left, window_right, unit_stride=False)
    check_score_mod(q, softcap, alibi, q.shape[0], q.shape[2])
    check_attn_mask(q, k, attn_mask, softcap, alibi)
    check_dropout(dropout_p, rng_state, q.device, drawn=True)
    return (out.transpose(1, 2) if bhsd else out), lse


@torch.library.register_fake("flashattn_ext::bwd")
def _bwd_fake(
    dout,
    q,
    k,
    v,
    out,
    lse,
    softmax_scale,
    window_left,
    window_right,
    bottom_right,
    deterministic,
    softcap=0.0,
    alibi=None,
    attn_mask=None,
    dropout_p=0.0,
    rng_state=None,
):
    check_qkv(q, k, v)
    check_bwd_extras(dout, q, out, lse)
    check_scalars(softmax_scale, window_left, window_right)
    check_score_mod(q, softcap, alibi, q.shape[0], q.shape[2])
    check_attn_mask(q, k, attn_mask, softcap, alibi)
    check_dropout(dropout_p, rng_state, q.device)
    return _empty_like_each(q, k, v)


@torch.library.register_fake("flashattn_ext::bwd_mask_grad")
def _bwd_mask_grad_fake(
    dout,
    q,
    k,
    v,
    out,
    lse,
    softmax_scale,
    window_left,
    window_right,
    bottom_right,
    deterministic,
    attn_mask,
    dropout_p=0.0,
    rng_state=None,
):
    check_qkv(q, k, v)
    check_bwd_extras(dout, q, out, lse)
    check_scalars(softmax_scale, window_left, window_right)
    check_attn_mask(q, k, attn_mask, 0.0, None)
    check_dropout(dropout_p, rng_state, q.device)
    if not attn_mask.dtype.is_floating_point:
        raise TypeError(f"flashattn_ext: only a floating-point attn_mask has a gradient, got {_c10(attn_mask.dtype)}")
    return (*_empty_like_each(q, k, v), torch.empty_like(attn_mask, memory_format=torch.contiguous_format))


_CACHE_LAYOUT = (
    "(batch_cache, seqlen_cache, heads_kv, head_dim), or with block_table (num_blocks, page_size, heads_kv, head_dim)"
)


def _int_vector(t, name, q):
    if t.dtype != torch.int32:
        raise TypeError(
            f"flashattn_ext: {name} must have dtype torch.int32, got {_c10(t.dtype)}; pass {name}.to(torch.int32)"
        )
    if t.dim() != 1 or t.shape[0] != q.shape[0]:
        raise ValueError(f"flashattn_ext: {name} must have shape (batch,) = ({q.shape[0]},), got {_sizes(t)}")
    _same_device(t, name, q)


def check_kvcache(q, k_cache, v_cache, seqlens_k, batch_idx, leftpad, block_table, softmax_scale, wl, wr, num_splits):
    """csrc/kvcache_api.cpp check_kvcache, in its order and words."""
    if q.dim() != 4:
        raise ValueError(
            f"flashattn_ext: q must have 4 dimensions (batch, seqlen_q, heads_q, head_dim), got shape {_sizes(q)}"
        )
    for t, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if t.dim() != 4:
            raise ValueError(f"flashattn_ext: {name} must have 4 dimensions {_CACHE_LAYOUT}, got shape {_sizes(t)}")
    backend = _devices_and_dtypes(q, k_cache, "k_cache", v_cache, "v_cache")
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"flashattn_ext: v_cache has shape {_sizes(v_cache)} but k_cache has {_sizes(k_cache)}; they must match"
        )
    head_dim, heads_q, heads_kv = q.shape[3], q.shape[2], k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(
            f"flashattn_ext: k_cache has head_dim {k_cache.shape[3]} but q has {head_dim}; they must match"
        )
    if not 1 <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(
            f"flashattn_ext: head_dim {head_dim} is outside [1, {_MAX_HEAD_DIM}], the head dims the kernels support"
        )
    if heads_q < 1 or heads_kv < 1 or heads_q % heads_kv != 0:
        raise ValueError(
            f"flashattn_ext: q has {heads_q} heads, not a multiple of the {heads_kv} heads of k_cache/v_cache; for "
            "GQA/MQA the key/value heads must divide the query heads"
        )
    for t, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        if t.stride(3) != 1 and t.shape[3] != 1:
            raise ValueError(
                f"flashattn_ext: {name} must have stride 1 in its last (head_dim) dimension; pass a tensor whose "
                "head_dim is contiguous"
            )
        for i, s in enumerate(t.shape):
            if s > _INT_MAX:
                raise ValueError(
                    f"flashattn_ext: {name} dimension {i} has size {s}, larger than 2^31 - 1; split the call"
                )
    _int_vector(seqlens_k, "seqlens_k", q)
    if batch_idx is not None:
        _int_vector(batch_idx, "cache_batch_idx", q)
    if leftpad is not None:
        _int_vector(leftpad, "cache_leftpad", q)
    if block_table is not None:
        if block_table.dtype != torch.int32:
            raise TypeError(
                f"flashattn_ext: block_table must have dtype torch.int32, got {_c10(block_table.dtype)}; pass "
                "block_table.to(torch.int32)"
            )
        if block_table.dim() != 2 or block_table.shape[0] != q.shape[0]:
            raise ValueError(
                f"flashattn_ext: block_table must have shape (batch, max_blocks_per_seq) = ({q.shape[0]}, *), got "
                f"{_sizes(block_table)}"
            )
        _same_device(block_table, "block_table", q)
        if batch_idx is not None:
            raise ValueError(
                "flashattn_ext: cache_batch_idx cannot be combined with block_table (as in flash-attn); pass None"
            )
        if block_table.shape[1] * k_cache.shape[1] > _INT_MAX:
            raise ValueError(
                f"flashattn_ext: block_table holds {block_table.shape[1]} blocks of {k_cache.shape[1]} keys per row, "
                "more than 2^31 - 1 keys; split the cache"
            )
    elif batch_idx is None and k_cache.shape[0] != q.shape[0]:
        raise ValueError(
            f"flashattn_ext: k_cache has {k_cache.shape[0]} rows but q has batch {q.shape[0]}; they must match "
            "unless cache_batch_idx maps batch rows to cache rows"
        )
    check_scalars(softmax_scale, wl, wr)
    if num_splits < 0:
        raise ValueError(f"flashattn_ext: num_splits must be >= 0 (0: automatic), got {num_splits}")
    _compiled_head_dim(backend, head_dim)


@torch.library.register_fake("flashattn_ext::fwd_kvcache")
def _fwd_kvcache_fake(
    q,
    k_cache,
    v_cache,
    seqlens_k,
    batch_idx,
    leftpad,
    block_table,
    softmax_scale,
    wl,
    wr,
    splits,
    bhsd=False,
    softcap=0.0,
    alibi_slopes=None,
):
    if bhsd:  # csrc/kvcache_api.cpp check_bhsd / kernel_layout
        if block_table is not None:
            raise ValueError(
                "flashattn_ext: fwd_kvcache with bhsd=True takes a contiguous (batch, heads_kv, seqlen, head_dim) "
                "cache, not a paged one; pass block_table=None or bhsd=False"
            )
        q, k_cache, v_cache = (x.transpose(1, 2) if x.dim() == 4 else x for x in (q, k_cache, v_cache))
    check_kvcache(q, k_cache, v_cache, seqlens_k, batch_idx, leftpad, block_table, softmax_scale, wl, wr, splits)
    check_score_mod(q, softcap, alibi_slopes, q.shape[0], q.shape[2])
    out, lse = _fwd_outputs(q, (q.shape[0], q.shape[2], q.shape[1]))
    return (out.transpose(1, 2) if bhsd else out), lse


@torch.library.register_fake("flashattn_ext::varlen_fwd_paged")
def _varlen_fwd_paged_fake(
    q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_table, max_q, max_k, scale, wl, wr, softcap=0.0, alibi=None
):
    # The shapes the outputs need (csrc/paged_varlen_api.cpp checks the rest in eager
    # mode; flash_attn_varlen_func has checked the call before it gets here).
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            "flashattn_ext: varlen_fwd_paged takes q (total_q, heads_q, head_dim) and k_cache / v_cache "
            f"(num_blocks, page_size, heads_kv, head_dim), got {tuple(q.shape)} and {tuple(k_cache.shape)}"
        )
    check_score_mod(q, softcap, alibi, cu_seqlens_q.shape[0] - 1, q.shape[1])
    return _fwd_outputs(q, (q.shape[1], q.shape[0]))


_APPEND = "flashattn_ext: kvcache_append_rotary: "
_APPEND_DTYPE_HINT = {"cuda": "; cast the cache to bfloat16 or float16 (the CUDA attention kernels take those)"}


def _like_cache(t, name, k_cache):
    if t.device != k_cache.device:
        raise ValueError(
            f"{_APPEND}{name} is on {t.device} but k_cache is on {k_cache.device}; move them to one device"
        )
    if t.dtype != k_cache.dtype:
        raise TypeError(
            f"{_APPEND}{name} has dtype {_c10(t.dtype)} but k_cache has {_c10(k_cache.dtype)}; cast them to one dtype"
        )


def _append_int32(t, name, k_cache):
    if t.dtype != torch.int32:
        raise TypeError(
            f"{_APPEND}{name} must have dtype torch.int32, got {_c10(t.dtype)}; pass {name}.to(torch.int32)"
        )
    if t.device != k_cache.device:
        raise ValueError(
            f"{_APPEND}{name} is on {t.device} but k_cache is on {k_cache.device}; move them to one device"
        )


def check_append_rotary(q, k, v, k_cache, v_cache, seqlens, batch_idx, block_table, cos, sin):
    """csrc/append_rotary_api.cpp check_append_rotary, in its order and words."""
    kc, vc = k_cache, v_cache
    if kc.dim() != 4:
        raise ValueError(f"{_APPEND}k_cache must have 4 dimensions {_CACHE_LAYOUT}, got shape {_sizes(kc)}")
    if vc.shape != kc.shape:
        raise ValueError(f"{_APPEND}v_cache has shape {_sizes(vc)} but k_cache has {_sizes(kc)}; they must match")
    _like_cache(vc, "v_cache", kc)
    backend = kc.device.type
    dtypes = _KERNEL_DTYPES.get(backend, _KERNEL_DTYPES["cpu"])
    if backend == "cpu":  # the C++ BackendSpec's order
        dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    if kc.dtype not in dtypes:
        name = {"cpu": "CPU", "cuda": "CUDA"}.get(backend, backend)
        raise TypeError(
            f"{_APPEND}k_cache has dtype {_c10(kc.dtype)}, which the {name} kernels do not support; use one of "
            f"{', '.join(_c10(d) for d in dtypes)}{_APPEND_DTYPE_HINT.get(backend, '')}"
        )
    for t, name in ((kc, "k_cache"), (vc, "v_cache")):
        if t.stride(3) != 1 and t.shape[3] != 1:
            raise ValueError(
                f"{_APPEND}{name} must have stride 1 in its last (head_dim) dimension; the cache is updated in "
                "place: allocate it contiguous in head_dim"
            )
    heads_kv, head_dim = kc.shape[2], kc.shape[3]
    _append_int32(seqlens, "cache_seqlens", kc)
    if seqlens.dim() != 1:
        raise ValueError(f"{_APPEND}cache_seqlens must have shape (batch,), got {_sizes(seqlens)}")
    batch = seqlens.shape[0]
    if q is not None:
        if q.dim() != 4 or q.shape[0] != batch or q.shape[3] != head_dim:
            raise ValueError(
                f"{_APPEND}q must have shape (batch, seqlen_q, heads_q, head_dim) = ({batch}, *, *, {head_dim}), "
                f"got {_sizes(q)}"
            )
        _like_cache(q, "q", kc)
    if (k is None) != (v is None):
        raise ValueError(f"{_APPEND}k and v must be given together, got only {'k' if v is None else 'v'}")
    if k is not None:
        for t, name in ((k, "k"), (v, "v")):
            if t.dim() != 4 or t.shape[0] != batch or t.shape[2] != heads_kv or t.shape[3] != head_dim:
                raise ValueError(
                    f"{_APPEND}{name} must have shape (batch, seqlen_new, heads_kv, head_dim) = ({batch}, *, "
                    f"{heads_kv}, {head_dim}), got {_sizes(t)}"
                )
            _like_cache(t, name, kc)
        if v.shape[1] != k.shape[1]:
            raise ValueError(f"{_APPEND}v has shape {_sizes(v)} but k has {_sizes(k)}; they must match")
    if batch_idx is not None:
        _append_int32(batch_idx, "cache_batch_idx", kc)
        if batch_idx.dim() != 1 or batch_idx.shape[0] != batch:
            raise ValueError(f"{_APPEND}cache_batch_idx must have shape (batch,) = ({batch},), got {_sizes(batch_idx)}")
    capacity = kc.shape[1]
    if block_table is not None:
        _append_int32(block_table, "block_table", kc)
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(
                f"{_APPEND}block_table must have shape (batch, max_blocks_per_seq) = ({batch}, *), got "
                f"{_sizes(block_table)}"
            )
        if batch_idx is not None:
            raise ValueError(
                f"{_APPEND}cache_batch_idx cannot be combined with block_table (as in flash-attn); pass None"
            )
        capacity = block_table.shape[1] * kc.shape[1]
    elif batch_idx is None and kc.shape[0] != batch:
        raise ValueError(
            f"{_APPEND}k_cache has {kc.shape[0]} rows but cache_seqlens has batch {batch}; they must match unless "
            "cache_batch_idx maps batch rows to cache rows"
        )
    seqlen_new = k.shape[1] if k is not None else 0
    if seqlen_new > capacity:
        raise ValueError(f"{_APPEND}{seqlen_new} new tokens do not fit in a cache of {capacity} positions per row")
    if seqlen_new and batch and kc.shape[0] == 0:
        raise ValueError(
            f"{_APPEND}k_cache has no rows (blocks) to append the new keys to; pass a cache with at least one"
        )
    if (cos is None) != (sin is None):
        raise ValueError(f"{_APPEND}rotary_cos and rotary_sin must be given together")
    if cos is not None:
        for t, name in ((cos, "rotary_cos"), (sin, "rotary_sin")):
            if t.dim() != 2:
                raise ValueError(f"{_APPEND}{name} must be 2-D (seqlen_ro, rotary_dim / 2), got shape {_sizes(t)}")
            _like_cache(t, name, kc)
        if sin.shape != cos.shape:
            raise ValueError(
                f"{_APPEND}rotary_sin has shape {_sizes(sin)} but rotary_cos has {_sizes(cos)}; they must match"
            )
        if not 1 <= cos.shape[1] <= head_dim // 2:
            raise ValueError(
                f"{_APPEND}rotary_cos/rotary_sin have {cos.shape[1]} columns (rotary_dim / 2); rotary_dim = "
                f"{2 * cos.shape[1]} must be in [2, head_dim = {head_dim}]"
            )
        if cos.shape[0] < 1:
            raise ValueError(
                f"{_APPEND}rotary_cos/rotary_sin have no rows (seqlen_ro = 0); pass the tables of the positions to rotate"
            )


@torch.library.register_fake("flashattn_ext::kvcache_append_rotary")
def _kvcache_append_rotary_fake(
    q, k, v, k_cache, v_cache, seqlens, batch_idx, block_table, cos, sin, interleaved, q_per_token
):
    check_append_rotary(q, k, v, k_cache, v_cache, seqlens, batch_idx, block_table, cos, sin)
    if q is None:
        return k_cache.new_empty((0,))
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


# ----------------------------------------------------------------------------- vmap rules
# The vmapped dimension (moved to the front; an unbatched argument is expanded)
# is folded into the batch dimension: one call of the op at the level below.


def _to_front(x, bdim, size):
    """x with its vmapped dimension first (an unbatched x expanded to size)."""
    return x.unsqueeze(0).expand(size, *x.shape) if bdim is None else x.movedim(bdim, 0)


def _fold(x, bdim, size):
    x = _to_front(x, bdim, size)
    return unit_last_stride(x.reshape(size * x.shape[1], *x.shape[2:]))


def _unfold(x, size):
    return x.unflatten(0, (size, x.shape[0] // size))


def _fold_mask(scalars, in_dims, n, batch, index):
    """The attn_mask (scalars[index], when passed) of a vmapped dense op, folded
    as q is: (n, batch, ...) -> (n * batch, ...), broadcast dimensions expanded
    where the fold needs them (a mask not vmapped over keeps its batch of 1)."""
    scalars = list(scalars)
    if len(scalars) <= index:
        return scalars
    m, bdim = scalars[index], in_dims[len(in_dims) - len(scalars) + index]
    if m is None or (bdim is None and (m.dim() < 4 or m.shape[0] == 1)):
        return scalars
    m = _to_front(m, bdim, n)  # (n, *mask)
    while m.dim() < 5:
        m = m.unsqueeze(1)
    m = m.expand(n, batch, *m.shape[2:])
    scalars[index] = m.reshape(n * batch, *m.shape[2:])
    return scalars


def _fwd_vmap_impl(op, mask_index, info, in_dims, q, k, v, *scalars):
    n = info.batch_size
    batch = q.shape[0 if in_dims[0] != 0 else 1]  # q's own batch, its vmapped dimension left out
    q, k, v = (_fold(x, d, n) for x, d in zip((q, k, v), in_dims[:3]))
    out, lse = op(q, k, v, *_fold_mask(scalars, in_dims, n, batch, mask_index))
    return (_unfold(out, n), _unfold(lse, n)), (0, 0)


@torch.library.register_vmap("flashattn_ext::attention")
def _attention_vmap(info, in_dims, q, k, v, *scalars):
    return _fwd_vmap_impl(attention, 8, info, in_dims, q, k, v, *scalars)


@torch.library.register_vmap("flashattn_ext::fwd")
def _fwd_vmap(info, in_dims, q, k, v, *scalars):
    return _fwd_vmap_impl(fwd_op, 6, info, in_dims, q, k, v, *scalars)


@torch.library.register_vmap("flashattn_ext::bwd")
def _bwd_vmap(info, in_dims, dout, q, k, v, out, lse, *scalars):
    n = info.batch_size
    batch = q.shape[0 if in_dims[1] != 0 else 1]
    tensors = [_fold(x, d, n) for x, d in zip((dout, q, k, v, out, lse), in_dims[:6])]
    # lse must be contiguous (batch, heads, seqlen): folding keeps it so unless it was expanded.
    tensors[5] = tensors[5].contiguous()
    dq, dk, dv = bwd(*tensors, *_fold_mask(scalars, in_dims, n, batch, 7))
    return (_unfold(dq, n), _unfold(dk, n), _unfold(dv, n)), (0, 0, 0)


# ----------------------------------------------------------------------------- varlen ops
# varlen_attention / varlen_fwd / varlen_bwd (csrc/ops.cpp): q (total_q, heads_q,
# head_dim), k, v (total_k, heads_kv, head_dim), cu_seqlens int32 (batch + 1,),
# lse (heads_q, total_q). The fake kernels check what csrc/attention_api.cpp
# check_varlen_qkv checks (same order, same words); the values of cu_seqlens
# are not read here (the CPU kernels check them, the CUDA kernels cannot).

varlen_attention = torch.ops.flashattn_ext.varlen_attention.default  # differentiable
varlen_fwd = torch.ops.flashattn_ext.varlen_fwd.default
varlen_bwd = torch.ops.flashattn_ext.varlen_bwd.default


def _rank3(t, name, layout):
    if t.dim() != 3:
        raise ValueError(
            f"flashattn_ext: {name} must have 3 dimensions {layout} (the sequences packed along dimension 0), "
            f"got shape {_sizes(t)}"
        )


def _cu_seqlens(cu, name, q):
    if cu.dtype != torch.int32:
        raise TypeError(
            f"flashattn_ext: {name} must have dtype int32, got {_c10(cu.dtype)}; pass {name}.to(torch.int32)"
        )
    if cu.dim() != 1:
        raise ValueError(f"flashattn_ext: {name} must be 1-D (batch + 1,), got shape {_sizes(cu)}")
    if cu.shape[0] < 2:
        raise ValueError(
            f"flashattn_ext: {name} must have batch + 1 >= 2 elements (0, then the end of each sequence), got {cu.shape[0]}"
        )
    if cu.device != q.device:
        raise ValueError(f"flashattn_ext: {name} is on {cu.device} but q is on {q.device}; move it to q's device")
    if not cu.is_contiguous():
        raise ValueError(f"flashattn_ext: {name} must be contiguous; pass {name}.contiguous()")


def _max_seqlen(m, name):
    if not 0 <= m <= _INT_MAX:
        raise ValueError(f"flashattn_ext: {name} must be in [0, 2^31 - 1] (a bound on the sequence lengths), got {m}")


def check_varlen_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, unit_stride=True):
    """csrc/attention_api.cpp check_varlen_qkv."""
    _rank3(q, "q", "(total_q, heads_q, head_dim)")
    _rank3(k, "k", "(total_k, heads_kv, head_dim)")
    _rank3(v, "v", "(total_k, heads_kv, head_dim)")
    backend = _devices_and_dtypes(q, k, "k", v, "v")
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if t.shape[1] <= 0 or t.shape[2] <= 0:
            raise ValueError(f"flashattn_ext: {name} has shape {_sizes(t)}; heads and head_dim must be at least 1")
    _fits_int(q, "q")
    _fits_int(k, "k")
    head_dim = q.shape[2]
    if k.shape[2] != head_dim or v.shape[2] != head_dim:
        raise ValueError(
            f"flashattn_ext: head_dim differs: q {head_dim}, k {k.shape[2]}, v {v.shape[2]}; q, k and v must share "
            "dimension 2"
        )
    _head_dim_supported(head_dim)
    if v.shape[0] != k.shape[0]:
        raise ValueError(
            f"flashattn_ext: v has {v.shape[0]} tokens but k has {k.shape[0]}; k and v must share dimension 0 (total_k)"
        )
    if v.shape[1] != k.shape[1]:
        raise ValueError(
            f"flashattn_ext: v has {v.shape[1]} heads but k has {k.shape[1]}; k and v must share dimension 1 (heads_kv)"
        )
    _heads_divide(q.shape[1], k.shape[1])
    if unit_stride:
        for t, name in ((q, "q"), (k, "k"), (v, "v")):
            _last_dim_contiguous(t, name)
    _cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q)
    _cu_seqlens(cu_seqlens_k, "cu_seqlens_k", q)
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(
            f"flashattn_ext: cu_seqlens_q has {cu_seqlens_q.shape[0]} elements but cu_seqlens_k has "
            f"{cu_seqlens_k.shape[0]}; both must be (batch + 1,)"
        )
    _max_seqlen(max_seqlen_q, "max_seqlen_q")
    _max_seqlen(max_seqlen_k, "max_seqlen_k")
    _compiled_head_dim(backend, head_dim)


def check_varlen_bwd_extras(dout, q, out, lse):
    """csrc/attention_api.cpp check_varlen_bwd_extras."""
    _bwd_tensors(dout, q, out, lse, (q.shape[1], q.shape[0]), "(heads_q, total_q)")


def _varlen_fwd_fake_impl(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, window_left, window_right, unit_stride):
    check_varlen_qkv(q, k, v, cu_q, cu_k, max_q, max_k, unit_stride)
    check_scalars(softmax_scale, window_left, window_right)
    return _fwd_outputs(q, (q.shape[1], q.shape[0]))


@torch.library.register_fake("flashattn_ext::varlen_fwd")
def _varlen_fwd_fake(
    q,
    k,
    v,
    cu_q,
    cu_k,
    max_q,
    max_k,
    softmax_scale,
    window_left,
    window_right,
    bottom_right,
    softcap=0.0,
    alibi=None,
    dropout_p=0.0,
    rng_state=None,
):
    res = _varlen_fwd_fake_impl(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, window_left, window_right, True)
    check_score_mod(q, softcap, alibi, cu_q.shape[0] - 1, q.shape[1])
    check_dropout(dropout_p, rng_state, q.device)
    return res


@torch.library.register_fake("flashattn_ext::varlen_attention")
def _varlen_attention_fake(
    q,
    k,
    v,
    cu_q,
    cu_k,
    max_q,
    max_k,
    softmax_scale,
    window_left,
    window_right,
    bottom_right,
    deterministic,
    softcap=0.0,
    alibi_slopes=None,
    dropout_p=0.0,
    rng_state=None,
):
    res = _varlen_fwd_fake_impl(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, window_left, window_right, False)
    check_score_mod(q, softcap, alibi_slopes, cu_q.shape[0] - 1, q.shape[1])
    check_dropout(dropout_p, rng_state, q.device, drawn=True)
    return res


@torch.library.register_fake("flashattn_ext::varlen_bwd")
def _varlen_bwd_fake(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_q,
    cu_k,
    max_q,
    max_k,
    softmax_scale,
    window_left,
    window_right,
    bottom_right,
    det,
    softcap=0.0,
    alibi_slopes=None,
    dropout_p=0.0,
    rng_state=None,
):
    check_varlen_qkv(q, k, v, cu_q, cu_k, max_q, max_k)
    check_varlen_bwd_extras(dout, q, out, lse)
    check_scalars(softmax_scale, window_left, window_right)
    check_score_mod(q, softcap, alibi_slopes, cu_q.shape[0] - 1, q.shape[1])
    check_dropout(dropout_p, rng_state, q.device)
    return _empty_like_each(q, k, v)


# vmap: the sequences of every vmapped instance are the same (cu_seqlens is not
# batched), so the vmapped dimension is folded into the heads: q (n, total_q,
# heads_q, d) becomes (total_q, n * heads_q, d). GQA survives the fold: folded q
# head i * heads_q + j reads kv head (i * heads_q + j) // ratio = i * heads_kv + j // ratio.


def _fold_heads(x, bdim, size):
    x = _to_front(x, bdim, size)
    return unit_last_stride(x.movedim(0, 1).reshape(x.shape[1], size * x.shape[2], *x.shape[3:]))


def _unfold_heads(x, size):
    return x.unflatten(1, (size, x.shape[1] // size)).movedim(1, 0)


def _unbatched_cu_seqlens(op, cu_dims):
    if any(d is not None for d in cu_dims):
        raise NotImplementedError(
            f"flashattn_ext::{op}: vmap over cu_seqlens is not supported (the vmapped instances must share their "
            "sequence lengths); loop over them, or pack them into one varlen batch"
        )


def _varlen_fwd_vmap_impl(op, name, info, in_dims, q, k, v, cu_q, cu_k, *scalars):
    _unbatched_cu_seqlens(name, in_dims[3:5])
    n = info.batch_size
    q, k, v = (_fold_heads(x, d, n) for x, d in zip((q, k, v), in_dims[:3]))
    out, lse = op(q, k, v, cu_q, cu_k, *scalars)
    return (_unfold_heads(out, n), lse.unflatten(0, (n, lse.shape[0] // n))), (0, 0)


@torch.library.register_vmap("flashattn_ext::varlen_attention")
def _varlen_attention_vmap(info, in_dims, q, k, v, cu_q, cu_k, *scalars):
    return _varlen_fwd_vmap_impl(varlen_attention, "varlen_attention", info, in_dims, q, k, v, cu_q, cu_k, *scalars)


@torch.library.register_vmap("flashattn_ext::varlen_fwd")
def _varlen_fwd_vmap(info, in_dims, q, k, v, cu_q, cu_k, *scalars):
    return _varlen_fwd_vmap_impl(varlen_fwd, "varlen_fwd", info, in_dims, q, k, v, cu_q, cu_k, *scalars)


@torch.library.register_vmap("flashattn_ext::varlen_bwd")
def _varlen_bwd_vmap(info, in_dims, dout, q, k, v, out, lse, cu_q, cu_k, *scalars):
    _unbatched_cu_seqlens("varlen_bwd", in_dims[6:8])
    n = info.batch_size
    dout, q, k, v, out = (_fold_heads(x, d, n) for x, d in zip((dout, q, k, v, out), in_dims[:5]))
    # lse (n, heads_q, total_q) -> (n * heads_q, total_q), contiguous.
    lse = _to_front(lse, in_dims[5], n)
    lse = lse.reshape(n * lse.shape[1], lse.shape[2]).contiguous()
    dq, dk, dv = varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, *scalars)
    return (_unfold_heads(dq, n), _unfold_heads(dk, n), _unfold_heads(dv, n)), (0, 0, 0)
