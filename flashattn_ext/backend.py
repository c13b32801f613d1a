"""Our kernels behind torch's own ``scaled_dot_product_attention``.

    import flashattn_ext
    flashattn_ext.activate()        # SDPA's flash backend now runs flashattn_ext's kernels
    ...                             # an unmodified model calling F.scaled_dot_product_attention
    flashattn_ext.deactivate()      # torch's kernels again

``activate()`` goes through torch's registry of flash-attention implementations
(``torch.nn.attention.register_flash_attention_impl`` /
``activate_flash_attention_impl`` / ``restore_flash_attention_impl``, torch >=
2.11; the mechanism torch uses for FlashAttention-3/4). What it registers, as
``torch.library.Library("aten", "IMPL")`` overrides:

* CUDA (builds with CUDA kernels): ``_flash_attention_forward`` /
  ``_flash_attention_backward`` (FlashAttention-2's layout (B, S, H, D), dense or
  packed variable-length, FA2's bottom-right causal and windows) and
  ``_scaled_dot_product_flash_attention`` / ``_backward`` (SDPA's layout
  (B, H, L, E)). torch's context parallelism
  (``torch.distributed.tensor.experimental.context_parallel``) calls the latter
  block by block and merges through the returned log-sum-exp, so with the
  registration active it runs our kernels on every block.
* CPU: ``_scaled_dot_product_flash_attention_for_cpu`` / ``_backward``, torch's
  CPU flash op (what SDPA runs on the CPU for most calls; top-left causal as
  torch's), so that all of this is exercised where CI runs.

torch's autograd formulas, meta kernels and backend selection stay torch's:
every output has the shape, dtype and strides torch's own kernel (and its meta
function, which torch.compile traces with) gives. A call that reaches one of
these ops but that our kernels cannot take (dropout, attn_mask, alibi,
seqused_k, a debug mask, a dtype / head dim / device they do not cover) goes to
the kernel torch had registered there before (``torch.library.get_kernel``),
exactly as without the registration; ``calls()`` counts which route each call
took.

``activate(first=True)`` also puts SDPA's FLASH backend first in torch's
backend priority order (on the H200 torch tries cuDNN first otherwise);
``deactivate()`` restores the previous order.
"""

from __future__ import annotations

import collections
import contextlib
import math
import warnings

import torch

from . import _ops
from .interface import _BUILD, _CUDA_MAX_HEAD_DIM, _MAX_HEAD_DIM, _cuda_arch_supported

__all__ = ["IMPL_NAME", "activate", "deactivate", "is_active", "activated", "calls", "reset_calls"]

IMPL_NAME = "flashattn_ext"
MIN_TORCH = (2, 11)

aten = torch.ops.aten

_DTYPES = {
    "cpu": (torch.float32, torch.float64, torch.bfloat16, torch.float16),
    "cuda": (torch.float16, torch.bfloat16),
}

# (op, route) -> number of calls; route is IMPL_NAME or "torch: <why ours refused>".
_calls: collections.Counter = collections.Counter()


def calls() -> dict:
    """{(aten op, route): count} since the last reset_calls(): route is
    ``"flashattn_ext"`` for calls our kernels ran, ``"torch: <reason>"`` for
    calls handed to torch's kernel."""
    return dict(_calls)


def reset_calls() -> None:
    _calls.clear()


# ----------------------------------------------------------------------------- eligibility
# Small predicates, each naming why it refused (None: our kernels take it).


# The tensor predicates read only each tensor's layout, shape, dtype and device
# (and the build, which does not change), so their verdict is remembered per
# signature of those: a model calls the same few shapes again and again, and
# reading the signature costs a fraction of the checks (the overrides run on
# every call: benchmarks/host_overhead.py --activated times them).
_MEMO_MAX = 4096
_refusals: dict = {}  # signature -> reason (None: ours take it)
_MISS = object()


def _signature(tensors, extra):
    """(extra, then (shape, dtype, device) of each tensor), or None for a tensor
    that is not plain strided (its checks run every time)."""
    sig = [extra]
    for t in tensors:
        if t.layout != torch.strided or t.is_nested:
            return None
        sig.append((t.shape, t.dtype, t.device))
    return tuple(sig)


def _remembered(memo, key, compute):
    value = memo.get(key, _MISS)
    if value is _MISS:
        if len(memo) >= _MEMO_MAX:
            memo.clear()
        value = memo[key] = compute()
    return value


def _dense_refusal(q, k, v, seq_dim):
    """_dense_refusal_of, remembered per signature of q, k, v."""
    sig = _signature((q, k, v), ("dense", seq_dim))
    if sig is None:
        return _dense_refusal_of(q, k, v, seq_dim)
    return _remembered(_refusals, sig, lambda: _dense_refusal_of(q, k, v, seq_dim))


def _dense_refusal_of(q, k, v, seq_dim):
    """Rank-4 q, k, v with the sequence at ``seq_dim`` (2: SDPA's (B, H, L, E),
    1: FlashAttention's (B, S, H, D)); heads at the other of dims 1, 2."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.layout != torch.strided or t.is_nested:
            return f"{name} is not a dense strided tensor"
        if t.dim() != 4:
            return f"{name} has {t.dim()} dimensions, not 4"
    head_dim = 3 - seq_dim
    return _common_refusal(q, k, v, q.shape[head_dim], k.shape[head_dim], v.shape[head_dim], seq_dim)


def _common_refusal(q, k, v, heads_q, heads_k, heads_v, seq_dim):
    dev = q.device
    if k.device != dev or v.device != dev:
        return "query, key, value are on different devices"
    if dev.type not in _DTYPES:
        return f"no flashattn_ext kernels for device {dev.type}"
    if dev.type == "cuda":
        if not _BUILD["cuda"]:
            return "this build of flashattn_ext has no CUDA kernels"
        if not _cuda_arch_supported(dev.index if dev.index is not None else torch.cuda.current_device()):
            return f"the CUDA kernels were built for archs {_BUILD['archs']}, not this GPU's"
    if not (q.dtype == k.dtype == v.dtype):
        return "query, key, value have different dtypes"
    if q.dtype not in _DTYPES[dev.type]:
        return f"dtype {q.dtype} is not supported by the {dev.type} kernels"
    e = q.shape[-1]
    if k.shape[-1] != e or v.shape[-1] != e:
        return "key / value head dim differs from the query's"
    if e > (_CUDA_MAX_HEAD_DIM if dev.type == "cuda" else _MAX_HEAD_DIM):
        return f"head dim {e} is larger than the kernels' largest"
    if heads_k != heads_v or heads_k < 1 or heads_q % heads_k != 0:
        return f"{heads_q} query heads and {heads_k} / {heads_v} key / value heads"
    if q.dim() == 4 and not (q.shape[0] == k.shape[0] == v.shape[0]):
        return "batch sizes differ"
    if k.shape[seq_dim] != v.shape[seq_dim]:
        return "key and value lengths differ"
    for t in (q, k, v):
        if t.numel() == 0:
            return "an empty input"
        if max(t.shape) > 2**31 - 1:
            return "a dimension larger than 2^31 - 1"
    return None


def _scale_refusal(scale):
    if scale is not None and not math.isfinite(scale):
        return f"scale {scale} is not finite"
    return None


def _bwd_refusal(grad_out, q, out, lse, lse_shape):
    """_bwd_refusal_of, remembered per signature of its tensors."""
    sig = _signature((grad_out, q, out, lse), ("bwd", tuple(lse_shape)))
    if sig is None:
        return _bwd_refusal_of(grad_out, q, out, lse, lse_shape)
    return _remembered(_refusals, sig, lambda: _bwd_refusal_of(grad_out, q, out, lse, lse_shape))


def _bwd_refusal_of(grad_out, q, out, lse, lse_shape):
    for name, t in (("grad_out", grad_out), ("out", out)):
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device or t.layout != torch.strided:
            return f"{name} does not match the query"
    if lse.dtype != _ops._lse_dtype(q.dtype) or tuple(lse.shape) != tuple(lse_shape) or lse.device != q.device:
        return "the log-sum-exp is not the forward's of our kernels"
    return None


def _window(left, right, is_causal):
    """FA2's window arguments as our kernels take them (-1 unbounded; causal is right = 0)."""
    wl = -1 if left is None else int(left)
    wr = -1 if right is None else int(right)
    if is_causal:
        wr = 0
    if wl < -1 or wr < -1:
        return None
    return wl, wr


# ----------------------------------------------------------------------------- layout helpers


_like_strides: dict = {}  # (shape, strides) -> the strides torch.empty_like gives


def _as_like(ref, x):
    """x, or x copied into torch.empty_like(ref) when its strides differ: the
    layout torch's kernel and its meta function give this output. (empty_like's
    strides depend on ref's shape and strides alone: remembered per pair.)"""
    shape, stride = ref.shape, ref.stride()
    want = _remembered(_like_strides, (shape, stride), lambda: torch.empty_like(ref, device="meta").stride())
    if x.stride() == want:
        return x
    y = torch.empty_like(ref)
    y.copy_(x)
    return y


def _sdpa_layout_forward(query, key, value, scale, is_causal, bottom_right):
    """Our forward on SDPA's (B, H, L, E) tensors: out (a (B, H, L, E) view of a
    (B, L, H, E) buffer) and lse (B, H, L). The attention op with bhsd=True makes
    the transposed views in C++; called from these kernels, below autograd, it is
    the forward kernels alone (csrc/autograd.cpp attention_below_autograd)."""
    wr = 0 if is_causal else -1
    return _ops.attention(query, key, value, _scale_of(scale, query), -1, wr, bottom_right, False, True)


def _bshd(*tensors):
    """(B, H, L, E) -> (B, L, H, E) views with unit stride on E (the kernels' layout)."""
    return [_ops.unit_last_stride(t.transpose(1, 2)) for t in tensors]


def _scale_of(scale, q):
    return float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _deterministic():
    return torch.are_deterministic_algorithms_enabled()


def _rng_outputs(q):
    # What torch's flash forward returns for philox seed / offset without dropout:
    # uninitialised tensors of these shapes (never read; no fill kernels launched).
    return torch.empty((2,), dtype=torch.uint64, device=q.device), torch.empty((), dtype=torch.uint64, device=q.device)


# ----------------------------------------------------------------------------- CPU: torch's CPU flash op


def _cpu_flash_forward(orig):
    op = "_scaled_dot_product_flash_attention_for_cpu"

    def impl(keyset, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        why = (
            ("attn_mask is given" if attn_mask is not None else None)
            or ("dropout_p > 0" if dropout_p != 0.0 else None)
            or _scale_refusal(scale)
            or _dense_refusal(query, key, value, 2)
        )
        if why is not None:
            _calls[(op, "torch: " + why)] += 1
            return orig.call_boxed(keyset, query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        _calls[(op, IMPL_NAME)] += 1
        # torch's CPU flash is top-left causal (query i sees keys 0..i): bottom_right=False.
        out, lse = _sdpa_layout_forward(query, key, value, scale, is_causal, False)
        # torch's CPU kernel (and its meta function) return lse as a (B, L, H) buffer seen as (B, H, L).
        lse_t = torch.empty_permuted(lse.shape, (0, 2, 1), dtype=lse.dtype, device=lse.device)
        lse_t.copy_(lse)
        return _as_like(query, out), lse_t

    return op, impl


def _cpu_flash_backward(orig):
    op = "_scaled_dot_product_flash_attention_for_cpu_backward"

    def impl(keyset, grad_out, query, key, value, out, lse, dropout_p, is_causal, *, attn_mask=None, scale=None):
        why = (
            ("attn_mask is given" if attn_mask is not None else None)
            or ("dropout_p > 0" if dropout_p != 0.0 else None)
            or _scale_refusal(scale)
            or _dense_refusal(query, key, value, 2)
            or _bwd_refusal(grad_out, query, out, lse, query.shape[:3])
        )
        if why is not None:
            _calls[(op, "torch: " + why)] += 1
            return orig.call_boxed(
                keyset, grad_out, query, key, value, out, lse, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
            )
        _calls[(op, IMPL_NAME)] += 1
        go, q, k, v, o = _bshd(grad_out, query, key, value, out)
        wr = 0 if is_causal else -1
        dq, dk, dv = _ops.bwd(
            go, q, k, v, o, lse.contiguous(), _scale_of(scale, query), -1, wr, False, _deterministic()
        )
        # torch's CPU backward returns (B, L, H, E) buffers seen as (B, H, L, E): ours are the same.
        return tuple(g.transpose(1, 2) if g.is_contiguous() else _as_permuted(g.transpose(1, 2)) for g in (dq, dk, dv))

    return op, impl


def _as_permuted(x):
    """x in a (B, L, H, E) buffer seen as (B, H, L, E) (torch.empty_permuted(..., (0, 2, 1, 3)))."""
    if x.transpose(1, 2).is_contiguous():
        return x
    y = torch.empty_permuted(x.shape, (0, 2, 1, 3), dtype=x.dtype, device=x.device)
    y.copy_(x)
    return y


# ----------------------------------------------------------------------------- CUDA: FA2's ops
# Written device-agnostic: tests/test_backend.py registers the same functions
# for the CPU dispatch key (_register_flash_ops) and runs them there.


# Keyword arguments of newer torch versions' FA2 forward ops that ours understand:
# out (write into it), block_table (paged keys: refused unless None), num_splits (a
# hint of how to split the keys: our kernels choose their own), compute_auxiliary
# (False: no rng / debug outputs).
_FA2_NEWER_KWARGS = ("out", "block_table", "num_splits", "compute_auxiliary")


def _fa2_forward_refusal(query, key, value, cum_seq_q, cum_seq_k, dropout_p, return_debug_mask, window, kwargs):
    unknown = sorted(
        set(kwargs)
        - {"scale", "window_size_left", "window_size_right", "seqused_k", "alibi_slopes"}
        - set(_FA2_NEWER_KWARGS)
    )
    out = kwargs.get("out")
    return (
        ("dropout_p > 0" if dropout_p != 0.0 else None)
        or ("return_debug_mask" if return_debug_mask else None)
        or ("seqused_k is given" if kwargs.get("seqused_k") is not None else None)
        or ("alibi_slopes are given" if kwargs.get("alibi_slopes") is not None else None)
        or ("block_table is given" if kwargs.get("block_table") is not None else None)
        or ("a window size below -1" if window is None else None)
        or ("unknown arguments " + ", ".join(unknown) if unknown else None)
        or (
            "out does not match the query"
            if out is not None and (out.shape != query.shape or out.dtype != query.dtype or out.device != query.device)
            else None
        )
        or _scale_refusal(kwargs.get("scale"))
        or (
            _varlen_refusal(query, key, value, cum_seq_q, cum_seq_k)
            if cum_seq_q is not None or cum_seq_k is not None
            else _dense_refusal(query, key, value, 1)
        )
    )


def _fa2_forward_run(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, window, scale):
    """out (with query's layout) and lse of FA2's forward on our kernels."""
    wl, wr = window
    sc = _scale_of(scale, query)
    q, k, v = (_ops.unit_last_stride(x) for x in (query, key, value))
    # FlashAttention-2's causal and windows are aligned bottom-right: bottom_right=True.
    if cum_seq_q is not None:
        return _ops.varlen_fwd(q, k, v, cum_seq_q, cum_seq_k, int(max_q), int(max_k), sc, wl, wr, True)
    return _ops.fwd_op(q, k, v, sc, wl, wr, True)


_FA2_FWD_ARGS = ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal")
_FA2_FWD_ARGS += ("return_debug_mask",)


def _flash_forward(orig):
    op = "_flash_attention_forward"

    def impl(keyset, *args, **kwargs):
        # Positional arguments as in the schema; keyword-only ones passed through as they came.
        a = dict(zip(_FA2_FWD_ARGS, args))
        window = _window(kwargs.get("window_size_left"), kwargs.get("window_size_right"), a["is_causal"])
        why = _fa2_forward_refusal(
            a["query"], a["key"], a["value"], a["cum_seq_q"], a["cum_seq_k"], a["dropout_p"],
            a["return_debug_mask"], window, kwargs,
        )  # fmt: skip
        if why is not None:
            _calls[(op, "torch: " + why)] += 1
            return orig.call_boxed(keyset, *args, **kwargs)
        _calls[(op, IMPL_NAME)] += 1
        query = a["query"]
        out, lse = _fa2_forward_run(
            query, a["key"], a["value"], a["cum_seq_q"], a["cum_seq_k"], a["max_q"], a["max_k"], window,
            kwargs.get("scale"),
        )  # fmt: skip
        dest = kwargs.get("out")
        if dest is not None:  # newer torch: write into the caller's buffer
            dest.copy_(out)
            out = dest
        else:
            out = _as_like(query, out)
        if kwargs.get("compute_auxiliary", True) is False:
            return out, lse, None, None, None
        seed, offset = _rng_outputs(query)
        return out, lse, seed, offset, torch.empty(0, dtype=query.dtype, device=query.device)

    return op, impl


def _flash_forward_inplace(orig):
    """aten._flash_attention_forward_no_dropout_inplace (torch > 2.11; torch's
    varlen_attn calls it): writes the output into its first argument, returns lse."""
    op = "_flash_attention_forward_no_dropout_inplace"

    def impl(keyset, out, *args, **kwargs):
        a = dict(zip(_FA2_FWD_ARGS, args))
        window = _window(kwargs.get("window_size_left"), kwargs.get("window_size_right"), a["is_causal"])
        why = _fa2_forward_refusal(
            a["query"], a["key"], a["value"], a["cum_seq_q"], a["cum_seq_k"], a["dropout_p"],
            a["return_debug_mask"], window, {**kwargs, "out": out},
        )  # fmt: skip
        if why is not None:
            _calls[(op, "torch: " + why)] += 1
            return orig.call_boxed(keyset, out, *args, **kwargs)
        _calls[(op, IMPL_NAME)] += 1
        res, lse = _fa2_forward_run(
            a["query"], a["key"], a["value"], a["cum_seq_q"], a["cum_seq_k"], a["max_q"], a["max_k"], window,
            kwargs.get("scale"),
        )  # fmt: skip
        out.copy_(res)
        return lse

    return op, impl


def _varlen_refusal(q, k, v, cu_q, cu_k):
    if cu_q is None or cu_k is None:
        return "only one of cum_seq_q / cum_seq_k is given"
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.layout != torch.strided or t.is_nested or t.dim() != 3:
            return f"{name} is not a dense (total, heads, head_dim) tensor"
    for name, cu in (("cum_seq_q", cu_q), ("cum_seq_k", cu_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.device != q.device or cu.shape[0] < 2:
            return f"{name} is not an int32 (batch + 1,) tensor on the query's device"
    if cu_q.shape[0] != cu_k.shape[0]:
        return "cum_seq_q and cum_seq_k differ in length"
    return _common_refusal(q, k, v, q.shape[1], k.shape[1], v.shape[1], 0)


def _flash_backward(orig):
    op = "_flash_attention_backward"

    def impl(
        keyset,
        grad_out,
        query,
        key,
        value,
        out,
        logsumexp,
        cum_seq_q,
        cum_seq_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        rng_state,
        unused,
        *,
        scale=None,
        window_size_left=None,
        window_size_right=None,
        **extra,
    ):
        window = _window(window_size_left, window_size_right, is_causal)
        varlen = query.dim() == 3
        if varlen:
            lse_shape = (query.shape[1], query.shape[0])
            shape_why = _varlen_refusal(query, key, value, cum_seq_q, cum_seq_k)
        else:
            lse_shape = (query.shape[0], query.shape[2], query.shape[1])
            shape_why = _dense_refusal(query, key, value, 1)
        why = (
            ("dropout_p > 0" if dropout_p != 0.0 else None)
            or ("a window size below -1" if window is None else None)
            or ("unknown arguments " + ", ".join(sorted(extra)) if extra else None)
            or _scale_refusal(scale)
            or shape_why
            or _bwd_refusal(grad_out, query, out, logsumexp, lse_shape)
        )
        if why is not None:
            _calls[(op, "torch: " + why)] += 1
            return orig.call_boxed(
                keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                is_causal, rng_state, unused, scale=scale, window_size_left=window_size_left,
                window_size_right=window_size_right, **extra,
            )  # fmt: skip
        _calls[(op, IMPL_NAME)] += 1
        wl, wr = window
        sc = _scale_of(scale, query)
        go, q, k, v, o = (_ops.unit_last_stride(x) for x in (grad_out, query, key, value, out))
        lse = logsumexp.contiguous()
        if varlen:
            grads = _ops.varlen_bwd(
                go, q, k, v, o, lse, cum_seq_q, cum_seq_k, int(max_q), int(max_k), sc, wl, wr, True, _deterministic()
            )
        else:
            grads = _ops.bwd(go, q, k, v, o, lse, sc, wl, wr, True, _deterministic())
        return tuple(_as_like(x, g) for x, g in zip((query, key, value), grads))

    return op, impl


def _sdpa_flash_forward(orig):
    op = "_scaled_dot_product_flash_attention"

    def impl(keyset, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        why = (
            ("dropout_p > 0" if dropout_p != 0.0 else None)
            or ("return_debug_mask" if return_debug_mask else None)
            or _scale_refusal(scale)
            or _dense_refusal(query, key, value, 2)
        )
        if why is not None:
            _calls[(op, "torch: " + why)] += 1
            return orig.call_boxed(keyset, query, key, value, dropout_p, is_causal, return_debug_mask, scale=scale)
        _calls[(op, IMPL_NAME)] += 1
        # torch's kernel hands this call to FA2, whose causal is bottom-right (SDPA
        # itself only selects it for causal calls with equal lengths): the same here.
        out, lse = _sdpa_layout_forward(query, key, value, scale, is_causal, True)
        seed, offset = _rng_outputs(query)
        debug = torch.empty(0, dtype=query.dtype, device=query.device)
        return _as_like(query, out), lse, None, None, query.shape[2], key.shape[2], seed, offset, debug

    return op, impl


def _sdpa_flash_backward(orig):
    op = "_scaled_dot_product_flash_attention_backward"

    def impl(
        keyset,
        grad_out,
        query,
        key,
        value,
        out,
        logsumexp,
        cum_seq_q,
        cum_seq_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        philox_seed,
        philox_offset,
        *,
        scale=None,
    ):
        why = (
            ("dropout_p > 0" if dropout_p != 0.0 else None)
            or _scale_refusal(scale)
            or _dense_refusal(query, key, value, 2)
            or _bwd_refusal(grad_out, query, out, logsumexp, query.shape[:3])
        )
        if why is not None:
            _calls[(op, "torch: " + why)] += 1
            return orig.call_boxed(
                keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                is_causal, philox_seed, philox_offset, scale=scale,
            )  # fmt: skip
        _calls[(op, IMPL_NAME)] += 1
        go, q, k, v, o = _bshd(grad_out, query, key, value, out)
        wr = 0 if is_causal else -1
        dq, dk, dv = _ops.bwd(
            go, q, k, v, o, logsumexp.contiguous(), _scale_of(scale, query), -1, wr, True, _deterministic()
        )
        return tuple(_as_like(x, g.transpose(1, 2)) for x, g in zip((query, key, value), (dq, dk, dv)))

    return op, impl


_CPU_OPS = (_cpu_flash_forward, _cpu_flash_backward)
_FLASH_OPS = (_flash_forward, _flash_backward, _sdpa_flash_forward, _sdpa_flash_backward)
if hasattr(aten, "_flash_attention_forward_no_dropout_inplace"):  # torch > 2.11
    _FLASH_OPS += (_flash_forward_inplace,)
_OP_NAMES = {
    _cpu_flash_forward: "_scaled_dot_product_flash_attention_for_cpu",
    _cpu_flash_backward: "_scaled_dot_product_flash_attention_for_cpu_backward",
    _flash_forward: "_flash_attention_forward",
    _flash_forward_inplace: "_flash_attention_forward_no_dropout_inplace",
    _flash_backward: "_flash_attention_backward",
    _sdpa_flash_forward: "_scaled_dot_product_flash_attention",
    _sdpa_flash_backward: "_scaled_dot_product_flash_attention_backward",
}


# ----------------------------------------------------------------------------- registration


class _NoKernel:
    """Stands for the kernel torch does not have (these ops on the CPU key)."""

    def __init__(self, name, dispatch_key):
        self.name, self.dispatch_key = name, dispatch_key

    def call_boxed(self, keyset, *args, **kwargs):
        raise NotImplementedError(
            f"aten::{self.name}: flashattn_ext's kernels refused this call and torch has no "
            f"{self.dispatch_key} kernel for it (see flashattn_ext.backend.calls() for the reason)"
        )


def _original_kernel(name, dispatch_key):
    try:
        return torch.library.get_kernel(f"aten::{name}", dispatch_key)
    except RuntimeError:  # "no kernel for CPU for aten::..."
        return _NoKernel(name, dispatch_key)


def _library(dispatch_key, makers):
    """A Library("aten", "IMPL") with each maker's kernel for dispatch_key; each
    kernel falls back to the one torch had there before (fetched first)."""
    lib = torch.library.Library("aten", "IMPL", dispatch_key)  # noqa: TOR901
    with warnings.catch_warnings():
        # The dispatcher warns that an aten kernel is overridden: that is the point.
        warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
        for make in makers:
            name = _OP_NAMES[make]
            op, impl = make(_original_kernel(name, dispatch_key))
            lib.impl(op, impl, dispatch_key, with_keyset=True, allow_override=True)
    return lib


class _Handle:
    """What torch's registry keeps while we are active; remove() undoes all of it."""

    def __init__(self, libraries, priority):
        self.libraries = libraries
        self.priority = priority  # torch's backend order before activate(first=True), or None

    def remove(self) -> None:
        for lib in self.libraries:
            lib._destroy()
        self.libraries = []
        if self.priority is not None:
            torch._C._set_sdp_priority_order(self.priority)
            self.priority = None


def _register_flash_ops(dispatch_key):
    """The FA2 / SDPA flash overrides for another dispatch key (the tests run the
    CUDA path's code on the CPU this way; torch has no CPU kernels for these ops,
    so a call ours refuse raises there). Returns a handle; remove() undoes it."""
    return _Handle([_library(dispatch_key, _FLASH_OPS)], None)


def _torch_registry():
    import torch.nn.attention as attention

    names = ("register_flash_attention_impl", "activate_flash_attention_impl", "restore_flash_attention_impl")
    names += ("current_flash_attention_impl",)
    missing = [n for n in names if not hasattr(attention, n)]
    if missing or not hasattr(torch.library, "get_kernel"):
        raise RuntimeError(
            f"flashattn_ext.activate() needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (torch.nn.attention's registry of "
            f"flash-attention implementations and torch.library.get_kernel); this is torch {torch.__version__}. "
            "Call flashattn_ext.scaled_dot_product_attention (or flash_attn_func) directly instead."
        )
    return attention


_first = False  # the argument of the pending activate() (read by _register_fn)


def _register_fn():
    libraries = [_library("CPU", _CPU_OPS)]
    if _BUILD["cuda"]:
        libraries.append(_library("CUDA", _FLASH_OPS))
    priority = None
    if _first:
        priority = list(torch._C._get_sdp_priority_order())
        flash = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
        torch._C._set_sdp_priority_order([flash] + [b for b in priority if b != flash])
    return _Handle(libraries, priority)


def activate(first: bool = False) -> None:
    """Make flashattn_ext's kernels torch's flash-attention implementation.

    After this, ``torch.nn.functional.scaled_dot_product_attention`` (and
    torch.compile'd code calling it, and torch's context parallelism) runs our
    kernels wherever torch picks its FLASH backend (CUDA) or its CPU flash
    kernel (CPU), forward and backward; calls our kernels cannot take run
    torch's kernel as before. first=True: SDPA tries FLASH before cuDNN / the
    other backends. Replaces any other activated implementation (FA3, FA4);
    ``deactivate()`` undoes it. Raises RuntimeError naming the torch version on
    torch < 2.11."""
    global _first
    attention = _torch_registry()
    attention.register_flash_attention_impl(IMPL_NAME, register_fn=_register_fn)
    _first = bool(first)
    try:
        attention.activate_flash_attention_impl(IMPL_NAME)
    finally:
        _first = False


def deactivate() -> bool:
    """Restore torch's own kernels (and backend order). Returns whether our
    implementation was active."""
    attention = _torch_registry()
    if attention.current_flash_attention_impl() != IMPL_NAME:
        return False
    attention.restore_flash_attention_impl()
    return True


def is_active() -> bool:
    try:
        return _torch_registry().current_flash_attention_impl() == IMPL_NAME
    except RuntimeError:
        return False


@contextlib.contextmanager
def activated(first: bool = False):
    """``with flashattn_ext.backend.activated(): ...`` activates for the block,
    then restores whatever implementation was active before (torch's own, FA4, ...)."""
    attention = _torch_registry()
    before = attention.current_flash_attention_impl()
    activate(first)
    try:
        yield
    finally:
        deactivate()
        if before is not None and before != IMPL_NAME:
            attention.activate_flash_attention_impl(before)
