"""User-facing functions.

* ``flash_attn_func``: the flash-attn package's signature and layout
  (batch, seqlen, heads, head_dim); switching is a change of import.
* ``scaled_dot_product_attention``: torch's signature, layout (..., heads, L, E)
  and semantics; calls the kernels when they can compute the answer exactly and
  otherwise hands the call to ``torch.nn.functional.scaled_dot_product_attention``
  with a one-time warning naming the reason (never a silent wrong answer).
"""

from __future__ import annotations

import math
import numbers
import os
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _ops
from .reference import alibi_bias, compute_dtype, visible_mask

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
    "scaled_dot_product_attention",
    "sdpa_fallback_reason",
    "build_info",
    "FlashAttnFallbackWarning",
]

_MAX_HEAD_DIM = 256
_INT_MAX = 2**31 - 1


class FlashAttnFallbackWarning(UserWarning):
    """A call was handed to torch's attention because the kernels cannot do it."""


def _parse_build_info(info: str) -> dict:
    """Parses "cuda=1;archs=80;90;head_dims=32,64": an item without "=" continues
    the previous value (archs are themselves ';'-separated)."""
    fields, last = {}, None
    for item in info.split(";"):
        if "=" in item:
            last, _, value = item.partition("=")
            fields[last.strip()] = value.strip()
        elif last is not None and item.strip():
            fields[last] += ";" + item.strip()

    def ints(s):
        return tuple(int(x) for x in s.replace(";", ",").split(",") if x.strip())

    return {
        "cuda": fields.get("cuda", "0") == "1",
        "archs": ints(fields.get("archs", "")),
        "head_dims": ints(fields.get("head_dims", "")),
    }


# Read once at import: a plain dict is free to consult under torch.compile.
_BUILD = _parse_build_info(torch.ops.flashattn_ext.build_info())


def build_info() -> dict[str, bool | tuple[int, ...]]:
    """What this build holds: {"cuda": bool, "archs": (80, 90), "head_dims": (32, ...)}."""
    return dict(_BUILD)


# --------------------------------------------------------------------------
# Warnings. Emitted from a function torch.compile treats as a constant: it runs
# (and warns) once while tracing, and leaves no graph break behind.

_warned: set = set()


@torch.compiler.assume_constant_result
def _warn_once(key: str, message: str, stacklevel: int) -> bool:
    """stacklevel: frames up to the user's call (1 is this function)."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, FlashAttnFallbackWarning, stacklevel=stacklevel)
    return True


_cuda_arch_ok: dict = {}  # device index -> whether the compiled archs run there


@torch.compiler.assume_constant_result
def _cuda_arch_supported(device_index: int) -> bool:
    ok = _cuda_arch_ok.get(device_index)
    if ok is None:
        # The rule (a cubin for sm_XY runs on sm_XZ, Z >= Y) is csrc/backend.cpp's,
        # which the activated overrides apply too.
        ok = _cuda_arch_ok[device_index] = torch.ops.flashattn_ext._cuda_arch_supported(device_index)
    return ok


# --------------------------------------------------------------------------
# Argument checks of flash_attn_func. The common call (tensors, Python bools,
# a tuple of ints, a float or None) passes a few type tests; anything else
# goes through these, which convert what flash-attn accepts and raise a
# TypeError / ValueError naming the argument for the rest. Tensor checks
# (rank, dtype, device, shapes, strides) are the op's (csrc/attention_api.cpp).


def _type_name(x) -> str:
    t = type(x)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _require_tensors(fn: str, names: tuple, values: tuple) -> None:
    for name, t in zip(names, values):
        if not isinstance(t, Tensor):
            hint = f"; convert it with torch.from_numpy({name})" if type(t).__module__ == "numpy" else ""
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {_type_name(t)}{hint}")


def _require_bool(fn: str, name: str, x) -> bool:
    if type(x) is bool:
        return x
    if type(x).__module__ == "numpy" and type(x).__name__ in ("bool", "bool_"):
        return bool(x)
    raise TypeError(f"{fn}: {name} must be a bool, got {_type_name(x)} {x!r}")


def _real(fn: str, name: str, x) -> float:
    """A Python/NumPy real number or a one-element tensor, as a float."""
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, Tensor) and x.numel() == 1 and not x.is_complex() and x.dtype != torch.bool:
        return float(x.item())
    raise TypeError(f"{fn}: {name} must be a real number, got {_type_name(x)} {x!r}")


def _window_size(x) -> tuple:
    """(left, right) as ints, -1 unbounded; widths beyond any sequence (>= 2^31) are unbounded."""
    fn = "flash_attn_func"
    if isinstance(x, (str, bytes)) or not hasattr(x, "__len__") or len(x) != 2:
        raise TypeError(
            f"{fn}: window_size must be a pair (left, right) of ints, -1 for unbounded, got {_type_name(x)} {x!r}; "
            "e.g. window_size=(128, 0) for a causal window of 128 past keys, (-1, -1) for none"
        )
    out = []
    for side, w in zip(("left", "right"), x):
        if isinstance(w, bool) or not (
            isinstance(w, numbers.Integral)
            or (isinstance(w, Tensor) and w.numel() == 1 and not w.is_floating_point() and not w.is_complex())
        ):
            raise TypeError(f"{fn}: window_size ({side}) must be an int, got {_type_name(w)} {w!r}")
        w = int(w)
        if w < -1:
            raise ValueError(
                f"{fn}: window_size ({side}) must be -1 (unbounded) or >= 0, got {w}; window_size=(-1, -1) is no window"
            )
        out.append(-1 if w > _INT_MAX else w)
    return out[0], out[1]


def _dropout_p(fn: str, x) -> float:
    p = _real(fn, "dropout_p", x)
    if not 0.0 <= p <= 1.0:  # NaN fails too
        raise ValueError(f"{fn}: dropout_p must be in [0, 1], got {p}")
    return p


def _default_scale(q: Tensor) -> float:
    d = q.shape[-1] if q.dim() > 0 else 1
    return 1.0 / math.sqrt(d) if d > 0 else 1.0  # the op rejects a zero-size head dim


def _reject_nested(names: tuple, values: tuple) -> None:
    for name, t in zip(names, values):
        if t.is_nested:
            raise TypeError(
                f"flash_attn_func: {name} is a nested tensor; the kernels take dense (batch, seqlen, heads, head_dim) "
                "tensors of one shape: pad the batch, or pack it for flash_attn_varlen_func"
            )


def _score_mods(fn, softcap, alibi_slopes):
    """flash-attn's score modifications as the ops take them: () when there are
    none (the ops' defaults: the plain kernels), else (softcap, alibi_slopes).
    softcap: a real number >= 0 (0: none); alibi_slopes: None or a float32
    tensor (heads_q,) or (batch, heads_q) on q's device, which the op checks."""
    if softcap is None or (type(softcap) is float and softcap == 0.0):
        softcap = 0.0
    else:
        softcap = _real(fn, "softcap", softcap)
        if not (math.isfinite(softcap) and softcap >= 0.0):
            raise ValueError(f"{fn}: softcap must be a finite number >= 0 (0: no softcapping), got {softcap}")
    if alibi_slopes is not None and not isinstance(alibi_slopes, Tensor):
        raise TypeError(
            f"{fn}: alibi_slopes must be None or a float32 torch.Tensor of shape (nheads,) or (batch, nheads), "
            f"got {_type_name(alibi_slopes)}"
        )
    if softcap == 0.0 and alibi_slopes is None:
        return ()
    return (softcap, alibi_slopes)


def _check_alibi_slopes(fn, alibi_slopes, batch, heads_q, device):
    """The op's checks of alibi_slopes (csrc/attention_api.cpp make_score_mod),
    for the paths that must refuse before they write anything (the KV-cache append)."""
    if alibi_slopes is None:
        return
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(
            f"{fn}: alibi_slopes must have dtype torch.float32, got {alibi_slopes.dtype}; pass alibi_slopes.float()"
        )
    if alibi_slopes.device != device:
        raise ValueError(
            f"{fn}: alibi_slopes is on {alibi_slopes.device} but q is on {device}; pass alibi_slopes.to(q.device)"
        )
    shape = tuple(alibi_slopes.shape)
    if shape not in ((heads_q,), (batch, heads_q)):
        raise ValueError(
            f"{fn}: alibi_slopes must have shape (nheads,) = ({heads_q},) or (batch, nheads) = ({batch}, {heads_q}), "
            f"got {shape}"
        )


def _want_attn_probs(fn, return_attn_probs) -> bool:
    """return_attn_probs, checked (the kernels of both devices draw the dropout
    mask S_dmask shows)."""
    return return_attn_probs is not False and _require_bool(fn, "return_attn_probs", return_attn_probs)


def _rng_state(q, batch, heads_q):
    """A call's dropout state [seed, offset], drawn from torch's generator of q's device."""
    return torch.ops.flashattn_ext.dropout_rng_state(q, batch, heads_q)


def _round128(n: int) -> int:
    return (n + 127) // 128 * 128


def _s_dmask_plane(q, k, lse, keep, scale, wl, wr, softcap, slopes, out):
    """S_dmask of one sequence into out (heads_q, >= seqlen_q, >= seqlen_k):
    q (seqlen_q, heads_q, d), k (seqlen_k, heads_kv, d), lse (heads_q,
    seqlen_q), keep (heads_q, seqlen_q, seqlen_k), slopes (heads_q,) or None."""
    seqlen_q, seqlen_k = q.shape[0], k.shape[0]
    acc = compute_dtype(q.dtype)
    qh = q.detach().transpose(0, 1).to(acc)
    kh = k.detach().transpose(0, 1).to(acc).repeat_interleave(q.shape[1] // k.shape[1], dim=0)
    s = torch.matmul(qh, kh.transpose(-2, -1)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        s = s + alibi_bias(slopes, seqlen_q, seqlen_k, q.device).to(acc)
    if wl >= 0 or wr >= 0:
        s = s.masked_fill(~visible_mask(seqlen_q, seqlen_k, wl, wr, seqlen_k - seqlen_q, q.device), float("-inf"))
    probs = torch.exp(s - lse.to(acc).unsqueeze(-1)).nan_to_num(0.0)  # rows without keys: lse -inf
    out[:, :seqlen_q, :seqlen_k] = torch.where(keep, probs, -probs).to(out.dtype)


def _s_dmask(q, k, lse, p, rng_state, scale, wl, wr, mods):
    """flash-attn 2's S_dmask of a dense call (q, k (batch, seqlen, heads, d)):
    (batch, heads_q, seqlen_q rounded up to 128, seqlen_k likewise) in q's
    dtype, the probabilities of the softmax without dropout (exp(s - lse), from
    the kernels' lse), negated where the dropout drops them (the kernels' own
    keep mask, flashattn_ext::dropout_keep_mask), 0 where the mask hides a key
    and in the padding; dropout_mask = S_dmask >= 0, as flash-attn's tests read
    it. (flash-attn 2's kernels leave them unnormalized; their sign is the same.)"""
    batch, seqlen_q, heads_q = q.shape[:3]
    seqlen_k = k.shape[1]
    keep = torch.ops.flashattn_ext.dropout_keep_mask(rng_state, batch, heads_q, seqlen_q, seqlen_k, p)
    out = q.new_zeros(batch, heads_q, _round128(seqlen_q), _round128(seqlen_k))
    softcap, slopes = _mods_parts(mods)
    with torch.no_grad():
        for b in range(batch):
            slopes_b = slopes[b] if slopes is not None and slopes.dim() == 2 else slopes
            _s_dmask_plane(q[b], k[b], lse[b], keep[b], scale, wl, wr, softcap, slopes_b, out[b])
    return out


def _mods_parts(mods):
    """(softcap, alibi_slopes) of the score-mod arguments the ops take (_score_mods)."""
    softcap = mods[0] if len(mods) > 0 else 0.0
    slopes = mods[1] if len(mods) > 1 else None
    return softcap, slopes


def _s_dmask_varlen(q, k, lse, cu_q, cu_k, max_q, max_k, p, rng_state, scale, wl, wr, mods):
    """_s_dmask of a varlen batch (q (total_q, heads_q, d), lse (heads_q,
    total_q)): (batch, heads_q, max_seqlen_q rounded up to 128, max_seqlen_k
    likewise), sequence b in the top-left corner of entry b (its mask is that
    corner of plane b: csrc/philox.h counts queries and keys per sequence)."""
    batch, heads_q = cu_q.shape[0] - 1, q.shape[1]
    keep = torch.ops.flashattn_ext.dropout_keep_mask(rng_state, batch, heads_q, max_q, max_k, p)
    out = q.new_zeros(batch, heads_q, _round128(max_q), _round128(max_k))
    softcap, slopes = _mods_parts(mods)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    with torch.no_grad():
        for b in range(batch):
            sq, eq, sk, ek = bq[b], bq[b + 1], bk[b], bk[b + 1]
            slopes_b = slopes[b] if slopes is not None and slopes.dim() == 2 else slopes
            _s_dmask_plane(
                q[sq:eq],
                k[sk:ek],
                lse[:, sq:eq],
                keep[b, :, : eq - sq, : ek - sk],
                scale,
                wl,
                wr,
                softcap,
                slopes_b,
                out[b],
            )
    return out


# --------------------------------------------------------------------------
# flash_attn_func


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention, flash-attn's ``flash_attn_func`` interface.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim),
    heads_kv dividing heads_q (GQA/MQA). Note the layout: torch's (batch, heads,
    seqlen, head_dim) tensors must be transposed (``q.transpose(1, 2)``) or given
    to ``scaled_dot_product_attention`` instead; a wrong layout cannot be detected
    when its sizes happen to fit. Returns out with q's shape, and with
    ``return_lse=True`` also lse (batch, heads_q, seqlen_q) in float32 (float64 for
    float64 inputs), the natural-log log-sum-exp of the scaled scores (-inf on rows
    that see no key; it carries no gradient).

    softmax_scale: default 1 / sqrt(head_dim). causal: aligned bottom-right when
    seqlen_q != seqlen_k (query i sees key j iff j <= i + seqlen_k - seqlen_q), as in
    flash-attn >= 2.1; window_size (left, right): -1 is unbounded, causal sets right
    to 0. A query row that sees no key outputs zeros. deterministic: bitwise
    reproducible backward (also on when torch.use_deterministic_algorithms(True)).
    A NaN or infinity in q, k or v reaches exactly the output rows that see it
    (README, "Errors, non-finite inputs and transforms").

    softcap > 0: the scaled scores s become softcap * tanh(s / softcap) (Gemma 2's
    attention logit softcapping); alibi_slopes, float32 (heads_q,) or (batch,
    heads_q): minus slope * |i + seqlen_k - seqlen_q - j| is added to them (after
    the softcap), query i, key j, as flash-attn defines it; the slopes get no
    gradient. lse is that of the modified scores.

    dropout_p in (0, 1]: the kernels (CPU and CUDA) drop probabilities
    themselves (the keep mask of csrc/philox.h, drawn from torch's generator of
    q's device: torch.manual_seed reproduces it, a CUDA graph's replays draw
    fresh masks; the same rng_state gives the same mask on either device; kept
    ones scaled by 1 / (1 - dropout_p); lse is that of the softmax without
    dropout), with every mask and score mod; return_attn_probs=True returns
    (out, lse, S_dmask) as flash-attn 2 does: S_dmask (batch, heads_q, seqlen_q
    and seqlen_k rounded up to 128) the probabilities with the dropped ones
    negated, None without dropout.
    Double backward raises when attempted.
    """
    fn = "flash_attn_func"
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)):
        _require_tensors(fn, ("q", "k", "v"), (q, k, v))
    if q.is_nested or k.is_nested or v.is_nested:  # before any size is read: they have none
        _reject_nested(("q", "k", "v"), (q, k, v))
    if type(causal) is not bool:
        causal = _require_bool(fn, "causal", causal)
    if type(deterministic) is not bool:
        deterministic = _require_bool(fn, "deterministic", deterministic)
    if type(return_lse) is not bool:
        return_lse = _require_bool(fn, "return_lse", return_lse)
    want_probs = _want_attn_probs(fn, return_attn_probs)
    mods = (
        ()
        if alibi_slopes is None and type(softcap) is float and softcap == 0.0
        else _score_mods(fn, softcap, alibi_slopes)
    )
    if (
        type(window_size) is tuple
        and len(window_size) == 2
        and type(window_size[0]) is int
        and type(window_size[1]) is int
        and -1 <= window_size[0] <= _INT_MAX
        and -1 <= window_size[1] <= _INT_MAX
    ):
        window_left, window_right = window_size
    else:
        window_left, window_right = _window_size(window_size)
    if causal:
        window_right = 0
    if softmax_scale is None:
        scale = _default_scale(q)
    elif type(softmax_scale) is float:
        scale = softmax_scale
    else:
        scale = _real(fn, "softmax_scale", softmax_scale)
    p = 0.0 if type(dropout_p) is float and dropout_p == 0.0 else _dropout_p(fn, dropout_p)
    # The op takes any strides (it copies a strided head_dim, nothing else).
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    if p > 0.0:  # the kernels' dropout; the rng_state drawn here so that S_dmask can show its mask
        rng_state = _rng_state(q, q.shape[0], q.shape[2])
        softcap, slopes = _mods_parts(mods)
        out, lse = _ops.attention(
            q, k, v, scale, window_left, window_right, True, deterministic, False, softcap, slopes, None, p, rng_state
        )
    elif mods:
        out, lse = _ops.attention(q, k, v, scale, window_left, window_right, True, deterministic, False, *mods)
    else:  # the plain call, the op's defaults (no score-mod arguments to convert)
        out, lse = _ops.attention(q, k, v, scale, window_left, window_right, True, deterministic)
    if want_probs:  # flash-attn 2: S_dmask only with dropout, else None
        s_dmask = _s_dmask(q, k, lse, p, rng_state, scale, window_left, window_right, mods) if p > 0.0 else None
        return out, lse, s_dmask
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------
# scaled_dot_product_attention.
#
# The common eligible call is recognized by _fast_eligible: a few attribute
# tests, inline, no allocation. Everything else goes through _sdpa_refusal,
# which walks the conditions in order and returns the first reason the kernels
# cannot take the call (the key of the one-time warning) or None when they can
# after all (rank-3 inputs, autocast, a scale given as an int, ...).

_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_CUDA_DTYPES = (torch.float16, torch.bfloat16)
_DTYPES = {"cpu": _CPU_DTYPES, "cuda": _CUDA_DTYPES}
_CUDA_MAX_HEAD_DIM = min(_MAX_HEAD_DIM, max(_BUILD["head_dims"], default=0))


_STRIDED = torch.strided


def _fast_eligible(query, key, value, enable_gqa) -> bool:
    """The kernels take the call as it is (rank-4 dense tensors of one
    supported dtype and device, shapes they cover). False means "look closer",
    not "refused". On the decode step's path: each tensor attribute read costs
    ~0.05 us (more on a server CPU), so the tests read as few as they can."""
    if query.layout is not _STRIDED or key.layout is not _STRIDED or value.layout is not _STRIDED:
        return False
    if query.is_nested or key.is_nested or value.is_nested:
        return False
    kv_shape = key.shape
    try:  # rank 4 (an unpacking ValueError otherwise)
        b, h, lq, e = query.shape
        bk, hk, s, ek = kv_shape
    except ValueError:
        return False
    dtype = query.dtype
    if key.dtype is not dtype or value.dtype is not dtype or value.shape != kv_shape or b != bk or e != ek:
        return False
    # No empty dimension (zero key heads with enable_gqa would divide by zero
    # below), none above int32 (sizes are >= 0, so the or exceeds _INT_MAX
    # exactly when one of them does).
    if not (b and h and lq and e and hk and s) or (b | h | lq | hk | s) > _INT_MAX:
        return False
    if hk != h and hk != 1 and not (enable_gqa and h % hk == 0):
        return False
    if query.is_cpu:
        return key.is_cpu and value.is_cpu and dtype in _CPU_DTYPES and e <= _MAX_HEAD_DIM
    if query.is_cuda:
        index = query.get_device()
        return (
            key.get_device() == index
            and value.get_device() == index
            and dtype in _CUDA_DTYPES
            and e <= _CUDA_MAX_HEAD_DIM
            and _BUILD["cuda"]
            and _cuda_arch_supported(index)
        )
    return False


def _dims(t):
    """(batch, heads, seqlen, head_dim) of a rank-3 (heads = 1) or rank-4 tensor."""
    if t.dim() == 3:
        return t.shape[0], 1, t.shape[1], t.shape[2]
    return tuple(t.shape)


def _sdpa_refusal(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """(key, reason) of the first condition the kernels do not meet, or (None, None)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            return "tensors", f"{name} is not a tensor"
        if t.layout != torch.strided or t.is_nested:
            return "tensors", f"{name} is not a dense strided tensor (layout {t.layout}, nested={t.is_nested})"
    if type(is_causal) is not bool or type(enable_gqa) is not bool:
        return "args", f"is_causal / enable_gqa of types {_type_name(is_causal)} / {_type_name(enable_gqa)}, not bool"
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            return "args", f"scale of type {_type_name(scale)}"
        if not math.isfinite(scale):
            return "scale", f"scale={scale} is not finite"
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        return "args", f"dropout_p of type {_type_name(dropout_p)}"
    if query.dim() not in (3, 4) or key.dim() != query.dim() or value.dim() != query.dim():
        return "rank", (
            f"the kernels take rank-4 (batch, heads, L, E) or rank-3 inputs of one rank, got query, key, value "
            f"of ranks {query.dim()}, {key.dim()}, {value.dim()}"
        )
    dev = query.device
    if key.device != dev or value.device != dev:
        return "device", f"query, key, value are on different devices ({dev}, {key.device}, {value.device})"
    if dev.type not in ("cpu", "cuda"):
        return "device", f"device {dev.type} has no flashattn_ext kernels (cpu and cuda only)"
    if dev.type == "cuda":
        if not _BUILD["cuda"]:
            return "device", "this build of flashattn_ext has no CUDA kernels"
        if not _cuda_arch_supported(dev.index if dev.index is not None else torch.cuda.current_device()):
            return "device", f"the CUDA kernels were built for archs {_BUILD['archs']}, which cannot run on this GPU"
    dtypes = {query.dtype, key.dtype, value.dtype}
    if torch.is_autocast_enabled(dev.type):
        # torch's autocast casts floating inputs (float64 aside) to its dtype; so does ours (csrc/autograd.cpp).
        low = torch.get_autocast_dtype(dev.type)
        dtypes = {low if d.is_floating_point and d != torch.float64 else d for d in dtypes}
    if len(dtypes) != 1:
        return "dtype", f"query, key, value have different dtypes ({query.dtype}, {key.dtype}, {value.dtype})"
    (dtype,) = dtypes
    if dtype not in _DTYPES[dev.type]:
        return "dtype", f"dtype {dtype} is not supported by the {dev.type} kernels (they take {_DTYPES[dev.type]})"
    if attn_mask is not None:
        reason = _mask_refusal(attn_mask, query, key, dtype, is_causal)
        if reason is not None:
            return "attn_mask", reason
    bq, hq, lq, e = _dims(query)
    bk, hk, sk, ek = _dims(key)
    bv, hv, sv, ev = _dims(value)
    if not (bq == bk == bv):
        return "shapes", f"batch sizes differ (query {bq}, key {bk}, value {bv}): broadcasting is left to torch"
    if ek != e:
        return "shapes", f"key head dim {ek} differs from query head dim {e}"
    if sv != sk or hv != hk:
        return "shapes", f"key {tuple(key.shape)} and value {tuple(value.shape)} disagree on heads or length"
    if ev != e:
        return "value_head_dim", f"value head dim {ev} differs from query head dim {e}"
    if not (hq == hk or hk == 1 or (enable_gqa and hk > 0 and hq % hk == 0)):  # hk == 1: torch broadcasts (MQA)
        return "heads", f"{hq} query heads and {hk} key/value heads (GQA needs enable_gqa=True and divisibility)"
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.shape[-1] == 0:
            return "sizes", f"{name} has head dim 0 {tuple(t.shape)}"
        for size in t.shape:  # (zero batch, heads or lengths: the kernels return torch's empty / zero output)
            if size > _INT_MAX:
                return "sizes", f"{name} has a dimension larger than 2^31 - 1 {tuple(t.shape)}"
    if e > _MAX_HEAD_DIM:
        return "head_dim", f"head dim {e} is larger than {_MAX_HEAD_DIM}"
    if dev.type == "cuda" and e > _CUDA_MAX_HEAD_DIM:
        return "head_dim", f"head dim {e} is larger than the largest compiled CUDA head dim {_CUDA_MAX_HEAD_DIM}"
    return None, None


def _mask_refusal(attn_mask, query, key, dtype, is_causal):
    """Why the kernels cannot take this attn_mask (None: they read it in place).
    They take torch's masks as they are: bool (True = attend) or float32 / the
    query's dtype, added to the scaled scores, of any shape that broadcasts to
    (batch, heads, L, S) and any strides (csrc/attention_api.cpp add_attn_mask);
    what torch would reject is left to torch, which raises its own error."""
    if not isinstance(attn_mask, Tensor):
        return f"attn_mask of type {_type_name(attn_mask)}"
    if attn_mask.layout != torch.strided or attn_mask.is_nested:
        return f"attn_mask is not a dense strided tensor (layout {attn_mask.layout})"
    if is_causal:
        return "attn_mask together with is_causal=True"
    if attn_mask.dtype not in (torch.bool, torch.float32, dtype):
        return f"attn_mask has dtype {attn_mask.dtype} (torch takes bool, float32 or the query's dtype)"
    if attn_mask.device != query.device:
        return f"attn_mask is on {attn_mask.device}, the query on {query.device}"
    b, h, lq, _ = _dims(query)
    full = (b, h, lq, key.shape[-2])
    # Rank-3 inputs: the mask broadcasts to (B, L, S), so a rank-4 mask is torch's error.
    if query.dim() == 3 and attn_mask.dim() == 4:
        return f"attn_mask of rank 4 {tuple(attn_mask.shape)} with rank-3 inputs (torch needs one of rank <= 3)"
    m = attn_mask.unsqueeze(1) if query.dim() == 3 and attn_mask.dim() == 3 else attn_mask  # rank 3: (B, L, S)
    if not 2 <= m.dim() <= 4 or any(s != f and s != 1 for s, f in zip(m.shape, full[4 - m.dim() :])):
        return f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (batch, heads, L, S) = {full}"
    return None


def _check_invalid_for_torch(query, key, value, attn_mask, dropout_p=0.0, enable_gqa=False):
    # Invalid inputs that torch 2.11 mishandles instead of rejecting: its CPU
    # flash backend returns an answer for key/value lengths that differ, its
    # CUDA backends crash the process on a key head dim different from the
    # query's, a mask on the meta device gives uninitialised memory on the
    # CPU, and enable_gqa=True with zero key or value heads divides by zero
    # (SIGFPE, CPU and CUDA). Raise here instead of handing them over.
    tensors = all(isinstance(t, Tensor) and t.dim() >= 2 for t in (query, key, value))
    if not tensors:
        return
    # torch's CUDA SDPA crashes the process on a dropout_p outside [0, 1]
    # (seen with -0.5 on the H200); its CPU path raises a RuntimeError (for a
    # negative value or NaN with a message about dropout > 0). Reject it on
    # every device with torch's CPU error type and a message that says why.
    if isinstance(dropout_p, (int, float)) and not isinstance(dropout_p, bool) and not 0.0 <= dropout_p <= 1.0:
        raise RuntimeError(
            f"flashattn_ext.scaled_dot_product_attention: dropout_p has to be between 0 and 1, but got {dropout_p}"
        )
    if isinstance(attn_mask, Tensor) and attn_mask.device != query.device:
        raise RuntimeError(
            f"flashattn_ext.scaled_dot_product_attention: attn_mask is on {attn_mask.device} but query is on "
            f"{query.device}; move attn_mask to the query's device"
        )
    if enable_gqa is True and min(query.dim(), key.dim(), value.dim()) >= 3 and 0 in (key.shape[-3], value.shape[-3]):
        raise RuntimeError(
            f"flashattn_ext.scaled_dot_product_attention: enable_gqa=True with key / value of {key.shape[-3]} / "
            f"{value.shape[-3]} heads (dimension -3); grouped-query attention needs at least one key/value head"
        )
    if key.shape[-2] != value.shape[-2]:
        raise RuntimeError(
            f"flashattn_ext.scaled_dot_product_attention: key has {key.shape[-2]} positions but value has "
            f"{value.shape[-2]}; key and value must share their sequence length (dimension -2)"
        )
    if key.shape[-1] != query.shape[-1]:
        raise RuntimeError(
            f"flashattn_ext.scaled_dot_product_attention: key has head dim {key.shape[-1]} but query has head dim "
            f"{query.shape[-1]}; query and key must share their last dimension"
        )


def _zero_dead_rows(out, attn_mask):
    """Rows whose boolean mask admits no key are zero (torch's documented
    semantics; some of its CUDA backends return NaN there)."""
    if not isinstance(attn_mask, Tensor) or attn_mask.dtype != torch.bool:
        return out
    dead = ~attn_mask.any(dim=-1, keepdim=True)  # (..., L, 1), broadcasts against out
    return out.masked_fill(dead, 0.0)


def sdpa_fallback_reason(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> str | None:
    """Why ``scaled_dot_product_attention`` would hand this call to torch, or None
    when the flashattn_ext kernels compute it."""
    return _sdpa_refusal(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)[1]


def _sdpa_kernels(query, key, value, is_causal, scale, attn_mask=None, dropout_p=0.0):
    """The kernel path. The op takes the (B, H, L, E) tensors as they are (bhsd=True:
    it reads them through (B, L, H, E) views, copying only a strided head_dim) and
    returns a (B, H, L, E) view of a (B, L, H, E) buffer. attn_mask goes to the
    kernels as it is (no expansion, no copy). dropout_p > 0: the op draws
    its rng_state from torch's generator (rank 3: batch entry b is plane b, as
    (B, L, E) is (B, 1, L, E))."""
    if query.dim() == 3:
        if attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(1)  # (B, L, S) -> (B, 1, L, S)
        q4, k4, v4 = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        return _sdpa_kernels(q4, k4, v4, is_causal, scale, attn_mask, dropout_p).squeeze(1)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    elif type(scale) is not float:
        scale = float(scale)
    wr = 0 if is_causal else -1
    deterministic = torch.are_deterministic_algorithms_enabled()
    if dropout_p != 0.0:
        return _ops.attention(
            query, key, value, scale, -1, wr, False, deterministic, True, 0.0, None, attn_mask, float(dropout_p)
        )[0]
    if attn_mask is None:
        return _ops.attention(query, key, value, scale, -1, wr, False, deterministic, True)[0]
    return _ops.attention(query, key, value, scale, -1, wr, False, deterministic, True, 0.0, None, attn_mask)[0]


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Drop-in replacement of ``torch.nn.functional.scaled_dot_product_attention``.

    Same layout (N, ..., L, E) and semantics: is_causal aligned top-left (query i
    sees keys 0..i), default scale 1 / sqrt(E), GQA only with enable_gqa=True
    (a single key/value head broadcasts, as in torch), the inputs cast to the
    autocast dtype under torch.autocast. The flashattn_ext kernels run for
    rank-3/4 inputs whose dtype/device they support (with dropout: the
    kernels' own dropout, whose mask torch.manual_seed reproduces but which
    is not torch's bernoulli stream), with or
    without an attn_mask (bool or float32 / the query's dtype, any broadcast
    shape and strides, read in place; not together with is_causal; a float mask
    that requires grad gets its gradient); a row the mask hides entirely is zero; the output is then a (B, H, L, E)-shaped view of a (B, L, H, E)
    buffer, like torch's flash backend returns. On CUDA a short query against
    many keys (a decode step) runs on the split-KV decoding kernels of
    ``flash_attn_with_kvcache`` (the forward's own choice: no mask, no dropout,
    not top-left causal; README, "The SDPA drop-in at a decode step"). Every other call
    goes to torch's function, with a one-time FlashAttnFallbackWarning per reason
    (see ``sdpa_fallback_reason``); invalid inputs raise torch's own errors.
    """
    if (
        attn_mask is None
        and (scale is None or type(scale) is float)
        and type(is_causal) is bool
        and type(enable_gqa) is bool
        and type(dropout_p) is float
        and dropout_p == 0.0
        and isinstance(query, Tensor)
        and isinstance(key, Tensor)
        and isinstance(value, Tensor)
        and _fast_eligible(query, key, value, enable_gqa)
        and (scale is None or math.isfinite(scale))
    ):
        if scale is None:
            scale = 1.0 / math.sqrt(query.shape[-1])
        return _ops.attention(
            query,
            key,
            value,
            scale,
            -1,
            0 if is_causal else -1,
            False,
            torch.are_deterministic_algorithms_enabled(),
            True,
        )[0]
    _check_invalid_for_torch(query, key, value, attn_mask, dropout_p, enable_gqa)
    key_name, reason = _sdpa_refusal(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if reason is None:
        return _sdpa_kernels(query, key, value, is_causal, scale, attn_mask, dropout_p)
    kwargs = {"enable_gqa": enable_gqa} if enable_gqa is not False else {}
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kwargs
    )
    out = _zero_dead_rows(out, attn_mask)
    # Only after torch accepted the call: invalid inputs raise torch's error, unwarned.
    _warn_once(
        "sdpa:" + key_name,
        f"flashattn_ext.scaled_dot_product_attention: {reason}; "
        "using torch.nn.functional.scaled_dot_product_attention for such calls",
        3,
    )
    return out


# --------------------------------------------------------------------------
# Packed and variable-length forms of flash_attn_func (flash-attn's
# flash_attn_{qkv,kv}packed_func and flash_attn_varlen{,_qkvpacked,_kvpacked}_func).
#
# The varlen functions make one call of the varlen_attention op: the kernels
# read cu_seqlens on the device (FlashAttention-2's varlen kernels), forward
# and backward, with no host synchronisation. Nothing here reads cu_seqlens'
# values: the CPU kernels check them (host memory, free to read); the CUDA
# kernels cannot without a synchronisation and do not, as flash-attn's
# (README, "Variable-length batches").


def _common_args(
    fn,
    q,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    return_attn_probs,
    return_lse,
):
    """flash_attn_func's argument checks, under the name ``fn``. Returns
    (dropout_p, scale, window_left, window_right, deterministic, return_lse, mods),
    mods the score modifications as the ops take them (_score_mods)."""
    if type(causal) is not bool:
        causal = _require_bool(fn, "causal", causal)
    if type(deterministic) is not bool:
        deterministic = _require_bool(fn, "deterministic", deterministic)
    if type(return_lse) is not bool:
        return_lse = _require_bool(fn, "return_lse", return_lse)
    _want_attn_probs(fn, return_attn_probs)  # (checks its type)
    mods = _score_mods(fn, softcap, alibi_slopes)
    try:
        window_left, window_right = _window_size(window_size)
    except (TypeError, ValueError) as e:  # its messages name flash_attn_func
        raise type(e)(str(e).replace("flash_attn_func:", f"{fn}:", 1)) from None
    if causal:
        window_right = 0
    if softmax_scale is None:
        scale = _default_scale(q)
    else:
        scale = _real(fn, "softmax_scale", softmax_scale)
        if not math.isfinite(scale):
            raise ValueError(f"{fn}: softmax_scale must be finite, got {scale}")
    p = 0.0 if type(dropout_p) is float and dropout_p == 0.0 else _dropout_p(fn, dropout_p)
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    return p, scale, window_left, window_right, deterministic, return_lse, mods


def _check_cu_seqlens(fn, name, cu, q, max_name, max_seqlen):
    """cu_seqlens: int32, 1-D, (batch + 1,), on q's device; max_seqlen an int.
    Only what needs no read of the values (that would synchronise on CUDA)."""
    if not isinstance(cu, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor of dtype int32, got {_type_name(cu)}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{fn}: {name} must have dtype torch.int32, got {cu.dtype}; pass {name}.to(torch.int32)")
    if cu.dim() != 1:
        raise ValueError(f"{fn}: {name} must be 1-D (batch + 1,), got shape {tuple(cu.shape)}")
    if cu.shape[0] < 2:
        raise ValueError(
            f"{fn}: {name} must have batch + 1 >= 2 elements (0, then the end of each sequence), got {cu.shape[0]}"
        )
    if cu.device != q.device:
        raise ValueError(f"{fn}: {name} is on {cu.device} but q is on {q.device}; move it to q's device")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"{fn}: {max_name} must be an int, got {_type_name(max_seqlen)} {max_seqlen!r}")
    return int(max_seqlen) if isinstance(max_seqlen, numbers.Integral) else max_seqlen


def _check_varlen_qkv(fn, q, k, v):
    _require_tensors(fn, ("q", "k", "v"), (q, k, v))
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.is_nested:
            raise TypeError(f"{fn}: {name} is a nested tensor; pass the packed (total_tokens, heads, head_dim) tensor")
        if t.dim() != 3:
            what = "total_q, heads_q" if name == "q" else "total_k, heads_kv"
            raise ValueError(
                f"{fn}: {name} must have 3 dimensions ({what}, head_dim) (the sequences packed along dimension 0), "
                f"got shape {tuple(t.shape)}"
            )
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"{fn}: v has {v.shape[0]} tokens but k has {k.shape[0]}; k and v must share dimension 0")
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"{fn}: v has {v.shape[1]} heads but k has {k.shape[1]}; k and v must share dimension 1")
    if k.shape[2] != q.shape[2] or v.shape[2] != q.shape[2]:
        raise ValueError(
            f"{fn}: head_dim differs: q {q.shape[2]}, k {k.shape[2]}, v {v.shape[2]}; q, k and v must share dimension 2"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"{fn}: q has {q.shape[1]} heads, not a multiple of the {k.shape[1]} heads of k and v; for "
            "GQA/MQA the key/value heads must divide the query heads"
        )
    # The rest (device, dtype, head_dim range, ...) is the op's own check.


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Tensor | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention over a batch of sequences of different lengths, packed
    along dimension 0 (flash-attn's ``flash_attn_varlen_func``).

    q: (total_q, heads_q, head_dim), k, v: (total_k, heads_kv, head_dim), heads_kv
    dividing heads_q (GQA/MQA); cu_seqlens_q / cu_seqlens_k: int32 (batch + 1,) on
    q's device, the cumulative lengths (sequence i is rows cu[i]:cu[i + 1]);
    max_seqlen_q / max_seqlen_k: bounds on the lengths (at least the largest).
    Each sequence attends only to its own keys; causal is aligned bottom-right per
    sequence (query i sees key j iff j <= i + len_k - len_q); window_size, scale,
    deterministic as in ``flash_attn_func``. Lengths may be 0: a query sequence
    of length 0 produces no rows, one whose key sequence is empty outputs zeros
    (lse -inf). Returns out (total_q, heads_q, head_dim) and, with
    ``return_lse=True``, lse (heads_q, total_q) in float32 (float64 for float64),
    flash-attn's varlen layout.

    One call of the kernels for the whole batch, which read cu_seqlens on the
    device: no host synchronisation (and no graph break under torch.compile).
    The values of cu_seqlens and the max_seqlen bounds are checked on the CPU
    only; on CUDA, as in flash-attn, they are trusted (reading them would
    synchronise): wrong values give wrong rows (never an access outside the
    tensors), a max_seqlen below a sequence's length cuts that sequence.
    softcap and alibi_slopes as in ``flash_attn_func`` (ALiBi's distance with
    each sequence's own lengths; (batch, heads_q) slopes: one row a sequence).
    dropout_p > 0 and return_attn_probs as in ``flash_attn_func``, in the
    kernels (sequence b draws plane b of the keep mask, its queries and keys
    counted from its own first row; S_dmask (batch, heads_q, max_seqlen_q and
    max_seqlen_k rounded up to 128), sequence b in its top-left corner; building
    it reads cu_seqlens to the host, a synchronisation on CUDA: a debugging aid).

    block_table (flash-attn 2.8's paged KV): int32 (batch, max_blocks_per_seq);
    k and v are then paged caches (num_blocks, page_block_size, heads_kv,
    head_dim), page_block_size any multiple of 16 (flash-attn: of 256), and
    key position p of sequence b is row p % page_block_size of block
    block_table[b, p // page_block_size]; cu_seqlens_k gives only the lengths
    (cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys, from position 0). Forward
    only (the backward raises NotImplementedError, as flash-attn has none), no
    dropout; causal, windows, GQA, softcap and ALiBi as without it. One call of
    the kernels, which read the page table on the device (on sm90 the TMA
    forward, one box per page); values unchecked on CUDA as above.
    """
    fn = "flash_attn_varlen_func"
    # Before the shape checks: with block_table, k and v are flash-attn's paged
    # caches (num_blocks, page_block_size, heads_kv, head_dim), not 3-D.
    if block_table is not None:
        return _varlen_paged(
            fn,
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            deterministic,
            return_attn_probs,
            block_table,
            return_lse,
        )
    _check_varlen_qkv(fn, q, k, v)
    p, scale, wl, wr, deterministic, return_lse, mods = _common_args(
        fn,
        q,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        return_lse,
    )
    max_q = _check_cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q, q, "max_seqlen_q", max_seqlen_q)
    max_k = _check_cu_seqlens(fn, "cu_seqlens_k", cu_seqlens_k, q, "max_seqlen_k", max_seqlen_k)
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(
            f"{fn}: cu_seqlens_q has {cu_seqlens_q.shape[0]} elements but cu_seqlens_k has {cu_seqlens_k.shape[0]}; "
            "both must be (batch + 1,)"
        )
    want_probs = _want_attn_probs(fn, return_attn_probs)
    # The op takes any strides (it copies a strided head_dim, nothing else).
    if p > 0.0:  # the kernels' dropout (csrc/philox.h: sequence b is plane b, counted from its first row)
        rng_state = _rng_state(q, cu_seqlens_q.shape[0] - 1, q.shape[1])
        softcap, slopes = _mods_parts(mods)
        out, lse = _ops.varlen_attention(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_q,
            max_k,
            scale,
            wl,
            wr,
            True,
            deterministic,
            softcap,
            slopes,
            p,
            rng_state,
        )
    else:
        out, lse = _ops.varlen_attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale, wl, wr, True, deterministic, *mods
        )
    if want_probs:
        s_dmask = None
        if p > 0.0:
            s_dmask = _s_dmask_varlen(
                q, k, lse, cu_seqlens_q, cu_seqlens_k, max_q, max_k, p, rng_state, scale, wl, wr, mods
            )
        return out, lse, s_dmask
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------
# flash_attn_varlen_func with block_table (paged k/v, flash-attn 2.8).
#
# flash-attn (csrc/flash_attn/flash_api.cpp mha_varlen_fwd, run through its
# split-KV kernel; src/block_info.h): sequence b has cu_seqlens_q[b + 1] -
# cu_seqlens_q[b] queries and cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys, key
# position p at block_table[b, p // page_block_size], row p % page_block_size
# (cu_seqlens_k's offsets are not used to locate keys); causal / windows
# bottom-right per sequence. Its public flash_attn_varlen_func passes no
# seqused_k (only its internal op has it), and neither do we. It asks for
# page_block_size % 256 == 0; we take any multiple of 16, the rule of
# flash_attn_with_kvcache here. It has no backward with block_table (the
# autograd node calls the dense varlen backward, which fails on the 4-D k):
# here the forward runs and the backward raises NotImplementedError.
#
# One flashattn_ext::varlen_fwd_paged call (csrc/paged_varlen_api.h): on
# CUDA the forward kernels read the keys through the page table on the device
# (the TMA forward's per-page boxes on sm90, the mma.sync forward elsewhere);
# the CPU op reads the pages in place for sequences of up to 8 queries and
# gathers the others' keys from their pages. The checks that
# read the integers' values run where that is free (CPU tensors; on CUDA only
# with FLASHATTN_KVCACHE_CHECK=1, a host synchronisation), as for
# flash_attn_with_kvcache.


class _PagedForwardOnly(torch.autograd.Function):
    """The output of a paged varlen forward under autograd: its backward
    raises (flash-attn has no backward with block_table)."""

    @staticmethod
    def forward(ctx, out, lse, *inputs):
        ctx.mark_non_differentiable(lse)
        return out.view_as(out), lse

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            "flash_attn_varlen_func: no backward with block_table (paged k/v; flash-attn has none either); "
            "run the forward under torch.no_grad(), or pass contiguous packed k/v (block_table=None) to train"
        )


def _paged_served(fn, q):
    """Raises, before any shape check, where no kernel reads paged k/v."""
    if q.device.type not in ("cpu", "cuda"):
        raise NotImplementedError(
            f"{fn}: block_table (paged k/v) is supported on the CPU and CUDA only, not on {q.device.type}; pass "
            "contiguous packed k/v (total_k, heads_kv, head_dim) with block_table=None"
        )


def _check_block_table(fn, block_table, batch, q):
    if not isinstance(block_table, Tensor):
        raise TypeError(f"{fn}: block_table must be a torch.Tensor of dtype int32, got {_type_name(block_table)}")
    if block_table.dtype != torch.int32:
        raise TypeError(f"{fn}: block_table must have dtype torch.int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(
            f"{fn}: block_table must have shape (batch, max_blocks_per_seq) = ({batch}, *), got "
            f"{tuple(block_table.shape)}"
        )
    if block_table.device != q.device:
        raise ValueError(f"{fn}: block_table is on {block_table.device} but q is on {q.device}")


def _check_paged_qkv(fn, q, k, v):
    layout = "(num_blocks, page_block_size, heads_kv, head_dim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.is_nested:
            raise TypeError(f"{fn}: {name} is a nested tensor; pass a dense tensor")
    if q.dim() != 3:
        raise ValueError(f"{fn}: q must have 3 dimensions (total_q, heads_q, head_dim), got shape {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{fn}: with block_table, {name} is a paged cache {layout}; got shape {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{fn}: {name} has dtype {t.dtype} but q has {q.dtype}; they must match")
        if t.device != q.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but q is on {q.device}")
    if v.shape != k.shape:
        raise ValueError(f"{fn}: v has shape {tuple(v.shape)} but k has {tuple(k.shape)}; they must match {layout}")
    if k.shape[3] != q.shape[2]:
        raise ValueError(f"{fn}: head_dim differs: q {q.shape[2]}, k and v {k.shape[3]}; they must match")
    if k.shape[2] == 0 or q.shape[1] % k.shape[2] != 0:
        raise ValueError(
            f"{fn}: q has {q.shape[1]} heads, not a multiple of the {k.shape[2]} heads of k and v; for "
            "GQA/MQA the key/value heads must divide the query heads"
        )
    if k.shape[1] == 0 or k.shape[1] % 16 != 0:
        raise ValueError(
            f"{fn}: with block_table, k and v are {layout} and page_block_size (dimension 1) must be a "
            f"positive multiple of 16, got {k.shape[1]}"
        )


def _paged_lengths(fn, cu, name, max_len, max_name, total=None):
    """Sequence lengths from cu_seqlens (host values: the CPU path only)."""
    c = cu.tolist()
    if total is not None and c[0] != 0:
        raise ValueError(f"{fn}: {name} must start at 0, got {c[0]}")
    lens = []
    for i in range(len(c) - 1):
        if c[i + 1] < c[i]:
            raise ValueError(
                f"{fn}: {name} must be non-decreasing, got {name}[{i}] = {c[i]} > {name}[{i + 1}] = {c[i + 1]}"
            )
        lens.append(c[i + 1] - c[i])
    if total is not None and c[-1] != total:
        raise ValueError(f"{fn}: {name} ends at {c[-1]} but q holds {total} tokens (its dimension 0)")
    if lens and max(lens) > max_len:
        raise ValueError(
            f"{fn}: {max_name}={max_len} is smaller than the longest sequence of {name} ({max(lens)}); "
            "it must be at least the largest length"
        )
    return lens


def _varlen_paged(
    fn,
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    return_attn_probs,
    block_table,
    return_lse,
):
    """flash_attn_varlen_func(..., block_table=...): see the section's comment."""
    _require_tensors(fn, ("q", "k", "v"), (q, k, v))
    _paged_served(fn, q)
    _check_paged_qkv(fn, q, k, v)
    if return_attn_probs is not False and _require_bool(fn, "return_attn_probs", return_attn_probs):
        raise NotImplementedError(f"{fn}: return_attn_probs=True is not supported with block_table; pass False")
    p, scale, wl, wr, _, return_lse, mods = _common_args(
        fn, q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, False, return_lse
    )
    if p > 0.0:
        raise NotImplementedError(
            f"{fn}: dropout_p > 0 is not supported with block_table (flash-attn's paged kernel has no dropout); "
            "pass dropout_p=0.0"
        )
    max_q = _check_cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q, q, "max_seqlen_q", max_seqlen_q)
    max_k = _check_cu_seqlens(fn, "cu_seqlens_k", cu_seqlens_k, q, "max_seqlen_k", max_seqlen_k)
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(
            f"{fn}: cu_seqlens_q has {cu_seqlens_q.shape[0]} elements but cu_seqlens_k has {cu_seqlens_k.shape[0]}; "
            "both must be (batch + 1,)"
        )
    batch = cu_seqlens_q.shape[0] - 1
    _check_block_table(fn, block_table, batch, q)
    softcap, slopes = _mods_parts(mods)
    _check_alibi_slopes(fn, slopes, batch, q.shape[1], q.device)
    if _kvcache_host_checks(q.device):
        _check_paged_values(fn, q, k, cu_seqlens_q, cu_seqlens_k, max_q, max_k, block_table)
    with torch.no_grad():
        qd = q.detach() if q.stride(-1) == 1 else _ops.unit_last_stride(q.detach())
        out, lse = _ops.varlen_fwd_paged(
            qd,
            k.detach(),
            v.detach(),
            cu_seqlens_q,
            cu_seqlens_k,
            block_table,
            max_q,
            max_k,
            scale,
            wl,
            wr,
            softcap,
            slopes,
        )
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out, lse = _PagedForwardOnly.apply(out, lse, q, k, v)
    return (out, lse) if return_lse else out


def _check_paged_values(fn, q, k, cu_seqlens_q, cu_seqlens_k, max_q, max_k, block_table):
    """The checks that read cu_seqlens' and block_table's values (host reads)."""
    _paged_lengths(fn, cu_seqlens_q, "cu_seqlens_q", max_q, "max_seqlen_q", total=q.shape[0])
    lens_k = _paged_lengths(fn, cu_seqlens_k, "cu_seqlens_k", max_k, "max_seqlen_k")
    page, num_blocks = k.shape[1], k.shape[0]
    capacity = block_table.shape[1] * page
    table = block_table.cpu()
    for b, n in enumerate(lens_k):
        if n > capacity:
            raise ValueError(
                f"{fn}: sequence {b} has {n} keys (cu_seqlens_k) but block_table holds {block_table.shape[1]} "
                f"blocks of {page} keys ({capacity}) per sequence"
            )
        used = table[b, : (n + page - 1) // page]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
            raise ValueError(
                f"{fn}: block_table[{b}] holds block indices outside [0, {num_blocks}) (k's num_blocks) in the "
                "blocks the sequence uses"
            )


def _unpack(fn, name, t, n, dim, layout):
    """The n tensors packed along dimension ``dim`` of ``t`` (views)."""
    _require_tensors(fn, (name,), (t,))
    if t.is_nested:
        raise TypeError(f"{fn}: {name} is a nested tensor; pass a dense {layout} tensor")
    if t.dim() != dim + 3 or t.shape[dim] != n:
        raise ValueError(f"{fn}: {name} must have shape {layout}, got {tuple(t.shape)}")
    return t.unbind(dim)


def flash_attn_qkvpacked_func(
    qkv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """``flash_attn_func`` on qkv (batch, seqlen, 3, heads, head_dim): q, k, v are
    views of it (no copy when head_dim has unit stride) and the gradient is
    qkv's. Same arguments and results as ``flash_attn_func``."""
    q, k, v = _unpack("flash_attn_qkvpacked_func", "qkv", qkv, 3, 2, "(batch, seqlen, 3, heads, head_dim)")
    return flash_attn_func(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        return_lse,
    )


def flash_attn_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """``flash_attn_func`` on q (batch, seqlen_q, heads_q, head_dim) and kv
    (batch, seqlen_k, 2, heads_kv, head_dim): k, v are views of kv."""
    k, v = _unpack("flash_attn_kvpacked_func", "kv", kv, 2, 2, "(batch, seqlen_k, 2, heads_kv, head_dim)")
    return flash_attn_func(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        return_lse,
    )


def flash_attn_varlen_qkvpacked_func(
    qkv: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """``flash_attn_varlen_func`` on qkv (total, 3, heads, head_dim), with one
    cu_seqlens / max_seqlen for queries and keys; q, k, v are views of qkv."""
    q, k, v = _unpack("flash_attn_varlen_qkvpacked_func", "qkv", qkv, 3, 1, "(total, 3, heads, head_dim)")
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        None,
        return_lse,
    )


def flash_attn_varlen_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    return_lse: bool = False,
    block_table: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """``flash_attn_varlen_func`` on q (total_q, heads_q, head_dim) and kv
    (total_k, 2, heads_kv, head_dim); k, v are views of kv. With block_table
    (an extension: flash-attn's kvpacked form has none; last, so that
    flash-attn's positional calls keep their meaning) kv is a paged cache
    (num_blocks, page_block_size, 2, heads_kv, head_dim), as in
    ``flash_attn_varlen_func``."""
    fn = "flash_attn_varlen_kvpacked_func"
    if block_table is None:
        k, v = _unpack(fn, "kv", kv, 2, 1, "(total_k, 2, heads_kv, head_dim)")
    else:
        _require_tensors(fn, ("q",), (q,))
        _paged_served(fn, q)
        k, v = _unpack(fn, "kv", kv, 2, 2, "(num_blocks, page_block_size, 2, heads_kv, head_dim) with block_table")
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        block_table,
        return_lse,
    )


# --------------------------------------------------------------------------
# flash_attn_with_kvcache (inference with a KV cache).
#
# The new keys are rotated and appended, and q rotated, by device-side torch
# ops (index arithmetic on the device integer tensors, index_put_); then one
# call of flashattn_ext::fwd_kvcache, whose CUDA kernels read cache_seqlens,
# cache_leftpad, cache_batch_idx and block_table on the device (split-KV
# decoding, csrc/cuda/flash_decode_kernel.cuh). Nothing on the CUDA path reads a
# device value on the host, so a decode step captures in a CUDA graph and
# traces under torch.compile(fullgraph=True).
#
# Checks that need the integers' values (ranges, repeated cache rows, the
# rotary table's length) read them, so they run where that is free: on CPU
# tensors in eager mode, and on CUDA only when FLASHATTN_KVCACHE_CHECK=1 (a
# host synchronisation per call, for debugging). Otherwise, as in flash-attn,
# they are not checked; out-of-range values are clamped into range so that
# nothing is read or written outside the tensors, and the result is
# unspecified.


def _int_vector(fn, name, x, batch, device):
    """cache_seqlens / cache_leftpad / cache_batch_idx: an int32 (batch,) tensor on
    q's device. Checks dtype, shape and device (not the values)."""
    if not isinstance(x, Tensor):
        kind = "an int or " if name == "cache_seqlens" else ""
        raise TypeError(f"{fn}: {name} must be {kind}a torch.Tensor of dtype int32, got {_type_name(x)}")
    if x.dtype != torch.int32:
        raise TypeError(f"{fn}: {name} must have dtype torch.int32, got {x.dtype}; pass {name}.to(torch.int32)")
    if tuple(x.shape) != (batch,):
        raise ValueError(f"{fn}: {name} must have shape (batch,) = ({batch},), got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{fn}: {name} is on {x.device} but q is on {device}; move it to q's device")
    return x


def _kvcache_host_checks(device) -> bool:
    """Whether the checks that read the integer tensors' values run (see above)."""
    if torch.compiler.is_compiling():
        return False
    return device.type == "cpu" or os.environ.get("FLASHATTN_KVCACHE_CHECK", "0") == "1"


def _check_kvcache_values(fn, seqlens, leftpad, batch_idx, block_table, capacity, page, n_cache, seqlen_new, need_ro):
    """The checks that read values (host tensors, or a host sync on CUDA).
    need_ro: (seqlen_ro, span) when rotary is applied: positions up to
    cache_seqlens[b] + span - 1 are rotated."""
    seq = seqlens.tolist()
    paged = block_table is not None
    for b, s in enumerate(seq):
        if s < 0 or s + seqlen_new > capacity:
            raise ValueError(
                f"{fn}: cache_seqlens[{b}] = {s} is outside [0, {capacity - seqlen_new}]: the cache holds {capacity} "
                f"positions per row{' (max_blocks_per_seq * page_block_size)' if paged else ''} and {seqlen_new} new "
                "tokens are appended"
            )
    if batch_idx is not None:
        rows = batch_idx.tolist()
        for b, r in enumerate(rows):
            if not 0 <= r < n_cache:
                raise ValueError(f"{fn}: cache_batch_idx[{b}] = {r} is outside [0, {n_cache}) (k_cache's rows)")
        if seqlen_new and len(set(rows)) != len(rows):
            raise ValueError(f"{fn}: cache_batch_idx has repeated rows; with k/v each cache row can be appended once")
    if leftpad is not None:
        for b, (lp, s) in enumerate(zip(leftpad.tolist(), seq)):
            if not 0 <= lp <= s:
                raise ValueError(f"{fn}: cache_leftpad[{b}] = {lp} is outside [0, cache_seqlens[{b}] = {s}]")
    if paged:
        bt = block_table.cpu()
        for b, s in enumerate(seq):
            used = bt[b, : -(-(s + seqlen_new) // page)]
            if used.numel() and (used.min() < 0 or used.max() >= n_cache):
                raise ValueError(
                    f"{fn}: block_table[{b}] holds block indices outside [0, {n_cache}) (k_cache's num_blocks) "
                    "in the blocks the row uses"
                )
    if need_ro is not None and seq:
        seqlen_ro, span = need_ro
        need = max(seq) + span
        if seqlen_ro < need:
            raise ValueError(
                f"{fn}: rotary_cos/rotary_sin have {seqlen_ro} positions (seqlen_ro) but positions up to "
                f"{need - 1} are rotated; seqlen_ro must be at least {need}"
            )


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None,
    cache_seqlens: Tensor | int | None = None,
    cache_batch_idx: Tensor | None = None,
    cache_leftpad: Tensor | None = None,
    block_table: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention against a KV cache, updated in place (flash-attn's
    ``flash_attn_with_kvcache``), for inference.

    q: (batch, seqlen_q, heads_q, head_dim). k_cache, v_cache: (batch_cache,
    seqlen_cache, heads_kv, head_dim), or with ``block_table`` a paged cache
    (num_blocks, page_block_size, heads_kv, head_dim); heads_kv divides heads_q;
    unit stride on head_dim. k, v (optional, together): (batch, seqlen_new,
    heads_kv, head_dim), written into the cache **in place** at positions
    cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1; row b then attends
    to the keys [cache_leftpad[b], cache_seqlens[b] + seqlen_new) of its cache
    row. cache_seqlens: int32 (batch,) or an int, the cache lengths before the
    append (None: the whole cache, only without k/v). cache_batch_idx: int32
    (batch,), the cache row of each batch row (default: row b; not with
    block_table). cache_leftpad: int32 (batch,), keys before it are ignored.
    block_table: int32 (batch, max_blocks_per_seq), position p of row b lives
    in block block_table[b, p // page_block_size] (page_block_size a multiple of 16).

    rotary_cos / rotary_sin: (seqlen_ro, rotary_dim / 2), q's dtype, applied to
    the first rotary_dim dims of k (new) at positions cache_seqlens[b] + i and of
    q at the same positions when causal or local (window_size != (-1, -1)),
    otherwise to all of q at position cache_seqlens[b]; interleaved (GPT-J,
    pairs 2i, 2i + 1) or not (GPT-NeoX, halves). Positions are absolute cache
    indices (cache_leftpad included), as in flash-attn. Only with k/v given (flash-attn
    ignores them otherwise; this raises).

    causal is aligned bottom-right against the row's visible keys; window_size
    and softmax_scale as in ``flash_attn_func``. num_splits: on CUDA the number
    of parts each row's keys are split into (split-KV decoding; 0 picks it from
    the SM count and the shapes; clamped to the 64-key blocks of a row);
    ignored on the CPU. On an sm90 GPU a prefill (seqlen_q >= 32; the environment
    variable FLASHATTN_KVCACHE_PREFILL_MIN_Q moves the threshold) with num_splits
    0 or 1, on a contiguous cache (cache_batch_idx and cache_leftpad included) or
    a paged one without cache_leftpad, runs the warp-specialized forward kernel
    with per-row key counts instead, reading the cache's rows or pages in place
    (same results within the tolerance rule). Returns out (batch, seqlen_q, heads_q, head_dim) and,
    with return_softmax_lse, lse (batch, heads_q, seqlen_q) in float32 (float64
    for float64). A row with no visible key outputs zeros (lse -inf).

    No host synchronisation on CUDA: the integer tensors stay on the device, a
    call captures in a CUDA graph and traces under torch.compile. Hence their
    values (ranges, repeated cache_batch_idx rows with k/v, the rotary table's
    length) are checked on the CPU only, or on CUDA with the environment
    variable FLASHATTN_KVCACHE_CHECK=1 (a host sync per call); unchecked
    out-of-range values are clamped (no access outside the tensors) and give
    unspecified results, as in flash-attn. Runs under torch.no_grad() (no
    autograd; inputs may require grad). softcap and alibi_slopes as in
    ``flash_attn_func``: ALiBi's distance with row b's key count (query i at key
    cache_seqlens[b] - seqlen_q + i, after the append).
    """
    # The common call (no append, no rotary, plain scalars) is handed straight to
    # the op, whose checks (csrc/kvcache_api.cpp; on the CPU also the values)
    # cover everything it needs; only when the op refuses the call, or it is not
    # of that form, does the checked path below run, which validates the call in
    # full and raises the error in its words (nothing was written: no append).
    if (
        k is None
        and v is None
        and rotary_cos is None
        and rotary_sin is None
        and alibi_slopes is None
        and type(causal) is bool
        and type(return_softmax_lse) is bool
        and type(rotary_interleaved) is bool
        and type(num_splits) is int
        and (softmax_scale is None or type(softmax_scale) is float)
        and (softcap is None or (type(softcap) is float and softcap == 0.0))
        and isinstance(q, Tensor)
        and isinstance(k_cache, Tensor)
    ):
        try:
            result = _kvcache_decode(
                q,
                k_cache,
                v_cache,
                cache_seqlens,
                cache_batch_idx,
                cache_leftpad,
                block_table,
                softmax_scale,
                causal,
                window_size,
                num_splits,
            )
        except Exception:  # noqa: BLE001  (the checked path raises it, in its words)
            result = None
        if result is not None:
            return result if return_softmax_lse else result[0]
    return _flash_attn_with_kvcache_checked(
        q,
        k_cache,
        v_cache,
        k,
        v,
        rotary_cos,
        rotary_sin,
        cache_seqlens,
        cache_batch_idx,
        cache_leftpad,
        block_table,
        softmax_scale,
        causal,
        window_size,
        softcap,
        rotary_interleaved,
        alibi_slopes,
        num_splits,
        return_softmax_lse,
    )


# Constant int32 (batch,) length tensors (flash_attn_with_kvcache's
# cache_seqlens given as None or an int), kept per (device, stream, batch, value): the
# kernels read the lengths from memory, and a decode step asks for the same
# ones in every layer. Filled once on the stream that uses them (so the fill is
# ordered before every read); never during a CUDA graph capture (the fill would
# only be recorded) nor under torch.compile (traced as a plain torch.full).
_LENGTHS: dict = {}
_LENGTHS_MAX = 64


def _lengths(batch: int, value: int, like: Tensor) -> Tensor:
    """An int32 (batch,) tensor of ``value`` on ``like``'s device; do not write to it."""
    if torch.compiler.is_compiling():
        return torch.full((batch,), value, dtype=torch.int32, device=like.device)
    if like.is_cuda:
        index = like.get_device()
        if torch.cuda.is_current_stream_capturing():
            return torch.full((batch,), value, dtype=torch.int32, device=like.device)
        key = (index, torch._C._cuda_getCurrentRawStream(index), batch, value)
    elif like.is_cpu:
        key = (-1, 0, batch, value)
    else:
        return torch.full((batch,), value, dtype=torch.int32, device=like.device)
    t = _LENGTHS.get(key)
    if t is None:
        if len(_LENGTHS) >= _LENGTHS_MAX:
            _LENGTHS.clear()
        t = _LENGTHS[key] = torch.full((batch,), value, dtype=torch.int32, device=like.device)
    return t


def _kvcache_decode(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    cache_batch_idx,
    cache_leftpad,
    block_table,
    softmax_scale,
    causal,
    window_size,
    num_splits,
):
    """flash_attn_with_kvcache without append or rotary: (out, lse) from one call
    of the op, or None when the call needs the checked path (a Python-side check
    the op does not make, or the value checks FLASHATTN_KVCACHE_CHECK asks for on
    CUDA). Raises whatever the op raises."""
    if (
        type(window_size) is tuple
        and len(window_size) == 2
        and type(window_size[0]) is int
        and type(window_size[1]) is int
        and -1 <= window_size[0] <= _INT_MAX
        and -1 <= window_size[1] <= _INT_MAX
    ):
        wl, wr = window_size
    else:
        return None
    if causal:
        wr = 0
    if num_splits < 0:
        return None
    if q.is_cuda and _kvcache_host_checks(q.device):
        return None
    if block_table is not None and k_cache.shape[1] % 16 != 0:  # page_block_size: checked in Python only
        return None
    if not isinstance(cache_seqlens, Tensor):
        capacity = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
        if cache_seqlens is None:
            cache_seqlens = capacity
        elif type(cache_seqlens) is not int or not 0 <= cache_seqlens <= capacity:
            return None
        cache_seqlens = _lengths(q.shape[0], cache_seqlens, q)
    scale = 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else softmax_scale
    if q.stride(-1) != 1:
        q = _ops.unit_last_stride(q)
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
        with torch.no_grad():
            return _ops.fwd_kvcache(
                q,
                k_cache,
                v_cache,
                cache_seqlens,
                cache_batch_idx,
                cache_leftpad,
                block_table,
                scale,
                wl,
                wr,
                num_splits,
            )
    return _ops.fwd_kvcache(
        q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, scale, wl, wr, num_splits
    )


def _flash_attn_with_kvcache_checked(
    q,
    k_cache,
    v_cache,
    k,
    v,
    rotary_cos,
    rotary_sin,
    cache_seqlens,
    cache_batch_idx,
    cache_leftpad,
    block_table,
    softmax_scale,
    causal,
    window_size,
    softcap,
    rotary_interleaved,
    alibi_slopes,
    num_splits,
    return_softmax_lse,
):
    """flash_attn_with_kvcache with every check in Python, before anything is
    written into the cache (the append, rotary, and the calls the op refused)."""
    fn = "flash_attn_with_kvcache"
    _require_tensors(fn, ("q", "k_cache", "v_cache"), (q, k_cache, v_cache))
    if (k is None) != (v is None):
        raise ValueError(
            f"{fn}: k and v must be given together (the new keys and values), got only {'k' if v is None else 'v'}"
        )
    if k is not None:
        _require_tensors(fn, ("k", "v"), (k, v))
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(f"{fn}: rotary_cos and rotary_sin must be given together")
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"{fn}: num_splits must be an int (0: automatic), got {_type_name(num_splits)}")
    if num_splits < 0:
        raise ValueError(f"{fn}: num_splits must be >= 0 (0: automatic), got {num_splits}")
    rotary_interleaved = _require_bool(fn, "rotary_interleaved", rotary_interleaved)
    _, scale, wl, wr, _, return_lse, mods = _common_args(
        fn, q, 0.0, softmax_scale, causal, window_size, softcap, alibi_slopes, False, False, return_softmax_lse
    )
    if q.dim() == 4:
        _check_alibi_slopes(fn, alibi_slopes, q.shape[0], q.shape[2], q.device)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)) + (
        (("k", k), ("v", v)) if k is not None else ()
    ):
        if t.is_nested or t.dim() != 4:
            raise ValueError(f"{fn}: {name} must be a dense 4-D tensor, got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but q is on {q.device}")
        if t.dtype != q.dtype:
            raise TypeError(f"{fn}: {name} has dtype {t.dtype} but q has {q.dtype}; they must match")
    batch, seqlen_q, heads_q, d = q.shape
    paged = block_table is not None
    cache_layout = (
        "(num_blocks, page_block_size, heads_kv, head_dim)"
        if paged
        else "(batch_cache, seqlen_cache, heads_kv, head_dim)"
    )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"{fn}: v_cache has shape {tuple(v_cache.shape)} but k_cache {tuple(k_cache.shape)}; they must match"
        )
    n_cache, len_cache, heads_kv, d_cache = k_cache.shape
    if d_cache != d:
        raise ValueError(f"{fn}: k_cache has head_dim {d_cache} but q has {d}; k_cache must be {cache_layout}")
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(
            f"{fn}: q has {heads_q} heads, not a multiple of the {heads_kv} heads of k_cache/v_cache; for GQA/MQA "
            "the key/value heads must divide the query heads"
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1 and d > 1:
            raise ValueError(
                f"{fn}: {name} must have stride 1 in its last (head_dim) dimension, got strides {tuple(t.stride())}; "
                "the cache is read and updated in place, so it is not copied: allocate it contiguous in head_dim"
            )
    seqlen_new = 0
    if k is not None:
        if k.shape != v.shape:
            raise ValueError(f"{fn}: v has shape {tuple(v.shape)} but k {tuple(k.shape)}; they must match")
        if k.shape[0] != batch or k.shape[2] != heads_kv or k.shape[3] != d:
            raise ValueError(
                f"{fn}: k must have shape (batch, seqlen_new, heads_kv, head_dim) = ({batch}, *, {heads_kv}, {d}), "
                f"got {tuple(k.shape)}"
            )
        seqlen_new = k.shape[1]
    # What the op would refuse for the device (its checks run after the append),
    # checked before anything is written into the cache.
    if q.device.type in ("cpu", "cuda") and q.dtype not in _ops._KERNEL_DTYPES[q.device.type]:
        _ops.check_qkv(q[:1, :1], k_cache[:1, :1], v_cache[:1, :1], unit_stride=False)  # raises, in its words
    if d > _MAX_HEAD_DIM or (q.device.type == "cuda" and d > _CUDA_MAX_HEAD_DIM):
        raise ValueError(
            f"{fn}: head_dim {d} is larger than {_CUDA_MAX_HEAD_DIM if q.device.type == 'cuda' else _MAX_HEAD_DIM}, "
            f"the largest the {'compiled CUDA' if q.device.type == 'cuda' else 'CPU'} kernels take"
        )

    if paged:
        if not isinstance(block_table, Tensor):
            raise TypeError(f"{fn}: block_table must be a torch.Tensor of dtype int32, got {_type_name(block_table)}")
        if block_table.dtype != torch.int32:
            raise TypeError(f"{fn}: block_table must have dtype torch.int32, got {block_table.dtype}")
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(
                f"{fn}: block_table must have shape (batch, max_blocks_per_seq) = ({batch}, *), got {tuple(block_table.shape)}"
            )
        if block_table.device != q.device:
            raise ValueError(f"{fn}: block_table is on {block_table.device} but q is on {q.device}")
        if len_cache % 16 != 0:
            raise ValueError(
                f"{fn}: with block_table, k_cache is {cache_layout} and page_block_size (dimension 1) must be a "
                f"multiple of 16, got {len_cache}"
            )
        if cache_batch_idx is not None:
            raise ValueError(f"{fn}: cache_batch_idx cannot be combined with block_table (as in flash-attn); pass None")
        capacity = block_table.shape[1] * len_cache
    else:
        capacity = len_cache
        if cache_batch_idx is None:
            if n_cache != batch:
                raise ValueError(
                    f"{fn}: k_cache has {n_cache} rows but q has batch {batch}; they must match unless cache_batch_idx "
                    "maps batch rows to cache rows"
                )
        else:
            _int_vector(fn, "cache_batch_idx", cache_batch_idx, batch, q.device)
    if seqlen_new > capacity:
        raise ValueError(
            f"{fn}: {seqlen_new} new tokens do not fit in a cache of {capacity} positions per row"
            f"{' (max_blocks_per_seq * page_block_size)' if paged else ''}"
        )
    if cache_seqlens is None:
        if k is not None:
            raise ValueError(f"{fn}: cache_seqlens is required when k and v are given (where to append them)")
        seqlens = _lengths(batch, capacity, q)
    elif isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        s = int(cache_seqlens)  # a Python int: checked here on every device
        if s < 0 or s + seqlen_new > capacity:
            raise ValueError(
                f"{fn}: cache_seqlens[0] = {s} is outside [0, {capacity - seqlen_new}]: the cache holds {capacity} "
                f"positions per row{' (max_blocks_per_seq * page_block_size)' if paged else ''} and {seqlen_new} new "
                "tokens are appended"
            )
        seqlens = _lengths(batch, s, q)
    else:
        seqlens = _int_vector(fn, "cache_seqlens", cache_seqlens, batch, q.device)
    if cache_leftpad is not None:
        _int_vector(fn, "cache_leftpad", cache_leftpad, batch, q.device)
    local = wl >= 0 or wr >= 0  # causal sets wr = 0
    span = max(seqlen_new, seqlen_q if local else 1)  # rotated positions past cache_seqlens[b]
    if rotary_cos is not None:
        if k is None:
            raise ValueError(
                f"{fn}: rotary_cos/rotary_sin are only applied together with new k/v (flash-attn's rule); "
                "pass k and v or leave rotary out"
            )
        _require_tensors(fn, ("rotary_cos", "rotary_sin"), (rotary_cos, rotary_sin))
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if t.dtype != q.dtype:
                raise TypeError(f"{fn}: {name} has dtype {t.dtype} but q has {q.dtype}; they must match")
            if t.device != q.device:
                raise ValueError(f"{fn}: {name} is on {t.device} but q is on {q.device}")
            if t.dim() != 2:
                raise ValueError(f"{fn}: {name} must be 2-D (seqlen_ro, rotary_dim / 2), got shape {tuple(t.shape)}")
        if rotary_sin.shape != rotary_cos.shape:
            raise ValueError(
                f"{fn}: rotary_sin has shape {tuple(rotary_sin.shape)} but rotary_cos {tuple(rotary_cos.shape)}"
            )
        half = rotary_cos.shape[1]
        if half == 0 or 2 * half > d:
            raise ValueError(
                f"{fn}: rotary_cos/rotary_sin have {half} columns (rotary_dim / 2); rotary_dim = {2 * half} must be "
                f"in [2, head_dim = {d}]"
            )
    checked = _kvcache_host_checks(q.device)
    if checked:
        _check_kvcache_values(
            fn,
            seqlens,
            cache_leftpad,
            cache_batch_idx if not paged else None,
            block_table,
            capacity,
            len_cache,
            n_cache,
            seqlen_new,
            (rotary_cos.shape[0], span) if rotary_cos is not None else None,
        )

    with torch.no_grad():
        if rotary_cos is not None or seqlen_new:
            # Rotary on q and the new keys and the append, in place: one op
            # (csrc/append_rotary_params.h has its position and clamping rules;
            # reference.kvcache_append_rotary_ref is the same in plain torch).
            q_rot = _ops.kvcache_append_rotary(
                q if rotary_cos is not None else None,
                k,
                v,
                k_cache,
                v_cache,
                seqlens,
                cache_batch_idx,
                block_table,
                rotary_cos,
                rotary_sin,
                rotary_interleaved,
                local,
            )
            if rotary_cos is not None:
                q = q_rot
            seqlens = seqlens + seqlen_new if seqlen_new else seqlens
        out, lse = _ops.fwd_kvcache(
            _ops.unit_last_stride(q),
            k_cache,
            v_cache,
            seqlens,
            cache_batch_idx if not paged else None,
            cache_leftpad,
            block_table,
            scale,
            wl,
            wr,
            num_splits,
            False,
            *mods,
        )
    return (out, lse) if return_lse else out
