"""Our kernels behind torch's own ``scaled_dot_product_attention``.

    import flashattn_ext
    flashattn_ext.activate()        # SDPA's flash backend now runs flashattn_ext's kernels
    ...                             # an unmodified model calling F.scaled_dot_product_attention
    flashattn_ext.deactivate()      # torch's kernels again

``activate()`` goes through torch's registry of flash-attention implementations
(``torch.nn.attention.register_flash_attention_impl`` /
``activate_flash_attention_impl`` / ``restore_flash_attention_impl``, torch >=
2.11; the mechanism torch uses for FlashAttention-3/4). What it registers, as
overrides of aten's kernels for one dispatch key:

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

The SDPA-layout ones (``_scaled_dot_product_flash_attention`` / ``_backward``,
``_scaled_dot_product_flash_attention_for_cpu`` / ``_backward``: what SDPA
calls) are C++ kernels (csrc/backend.cpp: a ``torch::Library`` that
``flashattn_ext::_backend_register`` creates and ``_backend_unregister``
destroys), so that a call behind SDPA never enters Python: a Python kernel of
``torch.library`` is called boxed, with the GIL, which cost more host time than
the rest of the call. FA2's ``_flash_attention_*`` stay ``torch.library``
overrides written here (their schemas differ between torch versions; SDPA does
not reach them while ours take its flash op). The refusal rules are the C++
ones either way (this module calls them through ``_backend_*_refusal``).

torch's autograd formulas, meta kernels and backend selection stay torch's:
every output has the shape, dtype and strides torch's own kernel (and its meta
function, which torch.compile traces with) gives. A call that reaches one of
these ops but that our kernels cannot take (alibi, seqused_k, a debug mask,
dropout on the CPU op, a mask torch's CPU kernel rejects, a dtype / head dim /
device they do not cover) goes to the kernel torch had registered there before (``torch.library.get_kernel``),
exactly as without the registration; ``calls()`` counts which route each call
took.

SDPA's memory-efficient op (``_scaled_dot_product_efficient_attention`` /
``_backward``, C++ too) is overridden on CUDA as well: it is where CUDA SDPA
sends a call with an attn_mask, which FLASH does not take.

``activate(first=True)`` also puts SDPA's FLASH backend, then the
memory-efficient one, first in torch's backend priority order (on the H200
torch tries cuDNN first otherwise);
``deactivate()`` restores the previous order.
"""

from __future__ import annotations

import collections
import contextlib
import math
import warnings

import torch

from . import _ops
from .interface import _BUILD, _CUDA_MAX_HEAD_DIM

__all__ = ["IMPL_NAME", "activate", "deactivate", "is_active", "activated", "calls", "reset_calls"]

IMPL_NAME = "flashattn_ext"
MIN_TORCH = (2, 11)

aten = torch.ops.aten

# The C++ overrides (csrc/backend.cpp) and their refusal rules.
_cxx = torch.ops.flashattn_ext

# (op, route) -> number of calls of the Python overrides (FA2's ops); the C++
# ones count their own (_backend_calls). route is IMPL_NAME or "torch: <why ours refused>".
_calls: collections.Counter = collections.Counter()


def calls() -> dict:
    """{(aten op, route): count} since the last reset_calls(): route is
    ``"flashattn_ext"`` for calls our kernels ran, ``"torch: <reason>"`` for
    calls handed to torch's kernel."""
    merged = collections.Counter(_calls)
    for op, route, n in zip(*_cxx._backend_calls()):
        merged[(op, route)] += n
    return dict(merged)


def reset_calls() -> None:
    _calls.clear()
    _cxx._backend_reset_calls()


# ----------------------------------------------------------------------------- eligibility
# The refusal rules are csrc/backend.cpp's (the C++ overrides apply them there,
# unremembered: in C++ they cost less than a lookup would); the Python overrides
# of FA2's ops call them through these ops, each naming why it refused (None:
# our kernels take it).


# The tensor rules read only each tensor's layout, shape, dtype and device (and
# the build and GPUs, which do not change), so for the Python overrides their
# verdict is remembered per signature of those: a model calls the same few
# shapes again and again, and reading the signature costs a fraction of a call
# into the rules.
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
    """Rank-4 q, k, v with the sequence at ``seq_dim`` (2: SDPA's (B, H, L, E),
    1: FlashAttention's (B, S, H, D)), remembered per signature."""
    sig = _signature((q, k, v), ("dense", seq_dim))
    if sig is None:
        return _cxx._backend_dense_refusal(q, k, v, seq_dim) or None
    return _remembered(_refusals, sig, lambda: _cxx._backend_dense_refusal(q, k, v, seq_dim) or None)


def _varlen_refusal(q, k, v, cu_q, cu_k):
    """FA2's packed (total, heads, head_dim) layout, remembered per signature."""
    compute = lambda: _cxx._backend_varlen_refusal(q, k, v, cu_q, cu_k) or None  # noqa: E731
    if cu_q is None or cu_k is None:
        return compute()
    sig = _signature((q, k, v, cu_q, cu_k), "varlen")
    return compute() if sig is None else _remembered(_refusals, sig, compute)


# The scalar rules' verdicts, per value (a model passes the same few).
_scalar_refusals: dict = {}


def _dropout_refusal(dropout_p):
    p = float(dropout_p)
    return _remembered(_scalar_refusals, ("dropout", p), lambda: _cxx._backend_dropout_refusal(p) or None)


def _scale_refusal(scale):
    s = None if scale is None else float(scale)
    return _remembered(_scalar_refusals, ("scale", s), lambda: _cxx._backend_scale_refusal(s) or None)


def _bwd_refusal(grad_out, q, out, lse, lse_shape):
    """grad_out, out and lse against q, remembered per signature of its tensors."""
    lse_shape = tuple(lse_shape)
    sig = _signature((grad_out, q, out, lse), ("bwd", lse_shape))
    compute = lambda: _cxx._backend_bwd_refusal(grad_out, q, out, lse, list(lse_shape)) or None  # noqa: E731
    if sig is None:
        return compute()
    return _remembered(_refusals, sig, compute)


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


def _scale_of(scale, q):
    return float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _deterministic():
    return torch.are_deterministic_algorithms_enabled()


def _rng_outputs(q):
    # What torch's flash forward returns for philox seed / offset without dropout:
    # uninitialised tensors of these shapes (never read; no fill kernels launched).
    return torch.empty((2,), dtype=torch.uint64, device=q.device), torch.empty((), dtype=torch.uint64, device=q.device)


# ----------------------------------------------------------------------------- CUDA: FA2's ops, in Python
# These stay Python overrides: their schemas differ between torch versions
# (newer torch adds out, block_table, num_splits, compute_auxiliary and the
# _no_dropout_inplace variant), which a C++ kernel would have to be built for,
# and SDPA does not reach them while ours take its flash op
# (_scaled_dot_product_flash_attention, in C++): they serve direct callers
# (flash_attn-style code, torch's varlen_attn) and the calls torch's SDPA flash
# kernel makes when ours refuse (those then refuse too: a debug mask). With
# dropout, the rng_state output carries our state to the backward (tagged as
# ours: csrc/backend.cpp tagged_rng_state).
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
        _dropout_refusal(dropout_p)
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


def _fa2_forward_run(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, window, scale, dropout_p=0.0, rng=None):
    """out (with query's layout) and lse of FA2's forward on our kernels (rng: our
    dropout state, int64 (2,), with dropout_p > 0)."""
    wl, wr = window
    sc = _scale_of(scale, query)
    p = float(dropout_p)
    q, k, v = (_ops.unit_last_stride(x) for x in (query, key, value))
    # FlashAttention-2's causal and windows are aligned bottom-right: bottom_right=True.
    if cum_seq_q is not None:
        return _ops.varlen_fwd(
            q, k, v, cum_seq_q, cum_seq_k, int(max_q), int(max_k), sc, wl, wr, True, 0.0, None, p, rng
        )  # fmt: skip
    return _ops.fwd_op(q, k, v, sc, wl, wr, True, 0.0, None, None, p, rng)


def _draw_rng(query, cum_seq_q):
    """A fresh dropout state for an FA2 call (batch x heads_q planes, as our kernels number them)."""
    if cum_seq_q is not None:
        return _cxx.dropout_rng_state(query, cum_seq_q.shape[0] - 1, query.shape[1])
    return _cxx.dropout_rng_state(query, query.shape[0], query.shape[2])


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
        p = float(a["dropout_p"])
        rng = _draw_rng(query, a["cum_seq_q"]) if p > 0 else None
        out, lse = _fa2_forward_run(
            query, a["key"], a["value"], a["cum_seq_q"], a["cum_seq_k"], a["max_q"], a["max_k"], window,
            kwargs.get("scale"), p, rng,
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
        if rng is not None:  # the backward regenerates our keep mask from it
            seed = _cxx._backend_tagged_rng_state(rng)
        return out, lse, seed, offset, torch.empty(0, dtype=query.dtype, device=query.device)

    return op, impl


def _flash_forward_inplace(orig):
    """aten._flash_attention_forward_no_dropout_inplace (torch > 2.11; torch's
    varlen_attn calls it): writes the output into its first argument, returns lse."""
    op = "_flash_attention_forward_no_dropout_inplace"

    def impl(keyset, out, *args, **kwargs):
        a = dict(zip(_FA2_FWD_ARGS, args))
        window = _window(kwargs.get("window_size_left"), kwargs.get("window_size_right"), a["is_causal"])
        why = ("dropout_p > 0" if float(a["dropout_p"]) != 0.0 else None) or _fa2_forward_refusal(
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
            _dropout_refusal(dropout_p)
            or ("a window size below -1" if window is None else None)
            or ("unknown arguments " + ", ".join(sorted(extra)) if extra else None)
            or _scale_refusal(scale)
            or shape_why
            or _bwd_refusal(grad_out, query, out, logsumexp, lse_shape)
            or (_cxx._backend_rng_state_refusal(float(dropout_p), rng_state, query) or None)
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
        p = float(dropout_p)
        rng = rng_state.view(torch.int64) if p > 0 else None
        if varlen:
            grads = _ops.varlen_bwd(
                go, q, k, v, o, lse, cum_seq_q, cum_seq_k, int(max_q), int(max_k), sc, wl, wr, True, _deterministic(),
                0.0, None, p, rng,
            )  # fmt: skip
        else:
            grads = _ops.bwd(go, q, k, v, o, lse, sc, wl, wr, True, _deterministic(), 0.0, None, None, p, rng)
        return tuple(_as_like(x, g) for x, g in zip((query, key, value), grads))

    return op, impl


_FA2_OPS = (_flash_forward, _flash_backward)
if hasattr(aten, "_flash_attention_forward_no_dropout_inplace"):  # torch > 2.11
    _FA2_OPS += (_flash_forward_inplace,)
_OP_NAMES = {
    _flash_forward: "_flash_attention_forward",
    _flash_forward_inplace: "_flash_attention_forward_no_dropout_inplace",
    _flash_backward: "_flash_attention_backward",
}

# The C++ overrides (csrc/backend.cpp), by dispatch key of torch's kernels.
_CPU_OPS_CXX = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")
_SDPA_OPS_CXX = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward")
# SDPA's memory-efficient op: what CUDA SDPA runs for a call with an attn_mask
# (FLASH takes none); activate(first=True) puts it right after FLASH.
_EFFICIENT_OPS_CXX = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward")


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


class _CxxLibrary:
    """The C++ overrides (csrc/backend.cpp) of ops for dispatch_key, each falling
    back to the kernel torch has there now: a torch::Library that
    flashattn_ext::_backend_register creates and _destroy() destroys (which
    deregisters its kernels), as torch.library.Library's _destroy() does."""

    def __init__(self, dispatch_key, ops):
        self.handle = _cxx._backend_register(dispatch_key, list(ops))

    def _destroy(self):
        if self.handle is not None:
            _cxx._backend_unregister(self.handle)
            self.handle = None


def _configure():
    """Tells the C++ rules the CUDA kernels' largest head dim (derived here, in
    interface, where the drop-in's routing uses it too)."""
    _cxx._backend_configure(_CUDA_MAX_HEAD_DIM)


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
    """The CUDA key's overrides (the SDPA flash ops in C++, FA2's in Python) for
    another dispatch key (the tests run the CUDA path's code on the CPU this way;
    torch has no CPU kernels for these ops, so a call ours refuse raises there).
    Returns a handle; remove() undoes it."""
    _configure()
    libraries = [_CxxLibrary(dispatch_key, _SDPA_OPS_CXX + _EFFICIENT_OPS_CXX), _library(dispatch_key, _FA2_OPS)]
    return _Handle(libraries, None)


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


def _init_cuda_sdp_priority():
    """Makes torch set its default CUDA backend order now, before we change it.

    torch sets it lazily, at the first CUDA SDPA backend selection
    (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, priority_order's
    priority_order_init_: cuDNN first on sm90 / sm100), overwriting an order set
    before that call: activate(first=True) before a process's first CUDA SDPA call
    had FLASH first only until that call (test_backend's first CUDA case ran cuDNN).
    One selection on tiny tensors (no kernel runs) makes torch do it here."""
    if not torch.cuda.is_available():
        return
    t = torch.zeros((1, 1, 1, 8), dtype=torch.float16, device="cuda")
    torch._fused_sdp_choice(t, t, t)


def _register_fn():
    _configure()
    libraries = [_CxxLibrary("CPU", _CPU_OPS_CXX)]
    if _BUILD["cuda"]:
        libraries += [_CxxLibrary("CUDA", _SDPA_OPS_CXX + _EFFICIENT_OPS_CXX), _library("CUDA", _FA2_OPS)]
    priority = None
    if _first:
        _init_cuda_sdp_priority()
        priority = list(torch._C._get_sdp_priority_order())
        backends = torch.nn.attention.SDPBackend
        ours = [int(backends.FLASH_ATTENTION), int(backends.EFFICIENT_ATTENTION)]  # (masked calls: the second)
        torch._C._set_sdp_priority_order(ours + [b for b in priority if b not in ours])
    return _Handle(libraries, priority)


def activate(first: bool = False) -> None:
    """Make flashattn_ext's kernels torch's flash-attention implementation.

    After this, ``torch.nn.functional.scaled_dot_product_attention`` (and
    torch.compile'd code calling it, and torch's context parallelism) runs our
    kernels wherever torch picks its FLASH backend or its memory-efficient one
    (CUDA; masked calls take the latter) or its CPU flash kernel (CPU), forward
    and backward; calls our kernels cannot take run torch's kernel as before.
    first=True: SDPA tries FLASH, then memory-efficient, before cuDNN / the
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
