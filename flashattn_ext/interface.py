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
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from . import _ops
from .reference import visible_mask

__all__ = [
    "flash_attn_func",
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


def build_info() -> dict:
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


@torch.compiler.assume_constant_result
def _cuda_arch_supported(device_index: int) -> bool:
    major, minor = torch.cuda.get_device_capability(device_index)
    cap = 10 * major + minor
    # A cubin for sm_XY runs on sm_XZ with Z >= Y (same major); no PTX is shipped.
    return any(a // 10 == major and a <= cap for a in _BUILD["archs"])


def _check_cuda_build(q: torch.Tensor) -> None:
    if q.is_cuda and not _BUILD["cuda"]:
        raise RuntimeError(
            "flashattn_ext: q is on CUDA but this build of flashattn_ext has no CUDA kernels "
            "(built without nvcc or with FLASHATTN_CPU_ONLY=1); rebuild with CUDA, or use the CPU"
        )


# --------------------------------------------------------------------------
# flash_attn_func


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    return_lse=False,
):
    """Exact attention, flash-attn's ``flash_attn_func`` interface.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim),
    heads_kv dividing heads_q (GQA/MQA). Returns out with q's shape, and with
    ``return_lse=True`` also lse (batch, heads_q, seqlen_q) in float32 (float64 for
    float64 inputs), the natural-log log-sum-exp of the scaled scores (-inf on rows
    that see no key; it carries no gradient).

    softmax_scale: default 1 / sqrt(head_dim). causal: aligned bottom-right when
    seqlen_q != seqlen_k (query i sees key j iff j <= i + seqlen_k - seqlen_q), as in
    flash-attn >= 2.1; window_size (left, right): -1 is unbounded, causal sets right
    to 0. A query row that sees no key outputs zeros. deterministic: bitwise
    reproducible backward (also on when torch.use_deterministic_algorithms(True)).

    Not supported: softcap, alibi_slopes, return_attn_probs (NotImplementedError).
    dropout_p > 0 is computed by torch's scaled_dot_product_attention with an
    explicit mask (one-time FlashAttnFallbackWarning; O(seqlen_q * seqlen_k) memory).
    """
    if softcap != 0.0:
        raise NotImplementedError(f"flash_attn_func: softcap={softcap} is not supported by flashattn_ext; pass softcap=0.0")
    if alibi_slopes is not None:
        raise NotImplementedError("flash_attn_func: alibi_slopes is not supported by flashattn_ext; pass alibi_slopes=None")
    if return_attn_probs:
        raise NotImplementedError(
            "flash_attn_func: return_attn_probs=True is not supported by flashattn_ext (the kernels never "
            "materialize the probabilities); use return_lse=True for the log-sum-exp"
        )
    _check_cuda_build(q)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    window_left, window_right = window_size
    if causal:
        window_right = 0
    deterministic = bool(deterministic) or torch.are_deterministic_algorithms_enabled()
    q, k, v = _ops.unit_last_stride(q), _ops.unit_last_stride(k), _ops.unit_last_stride(v)
    if dropout_p > 0.0:
        return _flash_attn_dropout_fallback(q, k, v, dropout_p, scale, window_left, window_right, return_lse)
    out, lse = _ops.fwd(q, k, v, float(scale), int(window_left), int(window_right), True, deterministic)
    return (out, lse) if return_lse else out


def _flash_attn_dropout_fallback(q, k, v, dropout_p, scale, window_left, window_right, return_lse):
    # The op validates the inputs (same errors as the kernel path) and gives the
    # lse, which dropout does not change.
    with torch.no_grad():
        _, lse = _ops.fwd(q, k, v, float(scale), int(window_left), int(window_right), True, False)
    _warn_once(
        "flash_attn_func:dropout",
        "flashattn_ext: dropout_p > 0 is not implemented by the kernels; flash_attn_func computes it with "
        "torch.nn.functional.scaled_dot_product_attention and an explicit mask (slower, O(seqlen_q * seqlen_k) memory)",
        4,
    )
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    mask = None
    if window_left >= 0 or window_right >= 0:
        mask = visible_mask(seqlen_q, seqlen_k, window_left, window_right, seqlen_k - seqlen_q, q.device)
    kwargs = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, dropout_p=dropout_p, scale=scale, **kwargs
    ).transpose(1, 2)
    if mask is not None:
        # Rows that see no key are zero whatever the backend does with them.
        dead = ~mask.any(dim=1)  # (seqlen_q,)
        out = out.masked_fill(dead.view(1, seqlen_q, 1, 1), 0.0)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------
# scaled_dot_product_attention: eligibility as small predicates, each returning
# None (fine) or the reason it refuses. The first refusal sends the call to
# torch; the warning is keyed by the predicate, so each reason warns once.


def _dims(t):
    """(batch, heads, seqlen, head_dim) of a rank-3 (heads = 1) or rank-4 tensor."""
    if t.dim() == 3:
        return t.shape[0], 1, t.shape[1], t.shape[2]
    return tuple(t.shape)


def _check_tensors(query, key, value, **_):
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a tensor"
        if t.layout != torch.strided or t.is_nested:
            return f"{name} is not a dense strided tensor (layout {t.layout}, nested={t.is_nested})"
    return None


def _check_rank(query, key, value, **_):
    if query.dim() not in (3, 4) or key.dim() != query.dim() or value.dim() != query.dim():
        return (
            f"the kernels take rank-4 (batch, heads, L, E) or rank-3 inputs of one rank, got query, key, value "
            f"of ranks {query.dim()}, {key.dim()}, {value.dim()}"
        )
    return None


def _check_device(query, key, value, **_):
    dev = query.device
    if key.device != dev or value.device != dev:
        return f"query, key, value are on different devices ({dev}, {key.device}, {value.device})"
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        return f"device {dev.type} has no flashattn_ext kernels (cpu and cuda only)"
    if not _BUILD["cuda"]:
        return "this build of flashattn_ext has no CUDA kernels"
    if not _cuda_arch_supported(dev.index if dev.index is not None else torch.cuda.current_device()):
        return f"the CUDA kernels were built for archs {_BUILD['archs']}, which cannot run on this GPU"
    return None


_DTYPES = {
    "cpu": (torch.float32, torch.float64, torch.bfloat16, torch.float16),
    "cuda": (torch.float16, torch.bfloat16),
}


def _check_dtype(query, key, value, **_):
    if key.dtype != query.dtype or value.dtype != query.dtype:
        return f"query, key, value have different dtypes ({query.dtype}, {key.dtype}, {value.dtype})"
    if query.dtype not in _DTYPES[query.device.type]:
        return f"dtype {query.dtype} is not supported by the {query.device.type} kernels (they take {_DTYPES[query.device.type]})"
    return None


def _check_attn_mask(attn_mask, **_):
    if attn_mask is not None:
        return "attn_mask is given (the kernels support no mask or is_causal only)"
    return None


def _check_dropout(dropout_p, **_):
    if dropout_p > 0.0:
        return "dropout_p > 0 (the kernels have no dropout; note torch applies it whenever dropout_p > 0, training or not)"
    return None


def _check_shapes(query, key, value, **_):
    bq, hq, lq, e = _dims(query)
    bk, hk, sk, ek = _dims(key)
    bv, hv, sv, ev = _dims(value)
    if not (bq == bk == bv):
        return f"batch sizes differ (query {bq}, key {bk}, value {bv}): broadcasting is left to torch"
    if ek != e:
        return f"key head dim {ek} differs from query head dim {e}"
    if sv != sk or hv != hk:
        return f"key {tuple(key.shape)} and value {tuple(value.shape)} disagree on heads or length"
    return None


def _check_value_head_dim(query, value, **_):
    if value.shape[-1] != query.shape[-1]:
        return f"value head dim {value.shape[-1]} differs from query head dim {query.shape[-1]}"
    return None


def _check_heads(query, key, enable_gqa, **_):
    hq, hk = _dims(query)[1], _dims(key)[1]
    if hq == hk or hk == 1:  # hk == 1: torch broadcasts the single key/value head (MQA)
        return None
    if enable_gqa and hq % hk == 0:
        return None
    return f"{hq} query heads and {hk} key/value heads (GQA needs enable_gqa=True and divisibility)"


def _check_sizes(query, key, value, **_):
    for name, t in (("query", query), ("key", key), ("value", value)):
        for s in t.shape:
            if s == 0:
                return f"{name} has a zero-size dimension {tuple(t.shape)}"
            if s > _INT_MAX:
                return f"{name} has a dimension larger than 2^31 - 1 {tuple(t.shape)}"
    return None


def _check_head_dim(query, **_):
    e = query.shape[-1]
    if e > _MAX_HEAD_DIM:
        return f"head dim {e} is larger than {_MAX_HEAD_DIM}"
    if query.device.type == "cuda" and e > max(_BUILD["head_dims"], default=0):
        return f"head dim {e} is larger than the largest compiled CUDA head dim {max(_BUILD['head_dims'], default=0)}"
    return None


_SDPA_CHECKS = (
    _check_tensors,
    _check_rank,
    _check_device,
    _check_dtype,
    _check_attn_mask,
    _check_dropout,
    _check_shapes,
    _check_value_head_dim,
    _check_heads,
    _check_sizes,
    _check_head_dim,
)


def _sdpa_refusal(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    for check in _SDPA_CHECKS:
        reason = check(
            query=query,
            key=key,
            value=value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        if reason is not None:
            return check.__name__[len("_check_"):], reason
    return None, None


def _check_invalid_for_torch(query, key, value):
    # Invalid inputs that torch 2.11 mishandles instead of rejecting: its CPU
    # flash backend returns an answer for key/value lengths that differ, and its
    # CUDA backends crash the process on a key head dim different from the
    # query's. Raise here instead of handing them over.
    tensors = all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in (query, key, value))
    if not tensors:
        return
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
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return out
    dead = ~attn_mask.any(dim=-1, keepdim=True)  # (..., L, 1), broadcasts against out
    return out.masked_fill(dead, 0.0)


def sdpa_fallback_reason(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
) -> Optional[str]:
    """Why ``scaled_dot_product_attention`` would hand this call to torch, or None
    when the flashattn_ext kernels compute it."""
    return _sdpa_refusal(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)[1]


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """Drop-in replacement of ``torch.nn.functional.scaled_dot_product_attention``.

    Same layout (N, ..., L, E) and semantics: is_causal aligned top-left (query i
    sees keys 0..i), default scale 1 / sqrt(E), GQA only with enable_gqa=True
    (a single key/value head broadcasts, as in torch). The flashattn_ext kernels
    run for rank-3/4 inputs without attn_mask and dropout whose dtype/device they
    support; the output is then a (B, H, L, E)-shaped view of a (B, L, H, E)
    buffer, like torch's flash backend returns. Every other call goes to torch's
    function, with a one-time FlashAttnFallbackWarning per reason (see
    ``sdpa_fallback_reason``); invalid inputs raise torch's own errors.
    """
    _check_invalid_for_torch(query, key, value)
    key_name, reason = _sdpa_refusal(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if reason is not None:
        kwargs = {"enable_gqa": True} if enable_gqa else {}
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
    rank3 = query.dim() == 3
    if rank3:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    deterministic = torch.are_deterministic_algorithms_enabled()
    # (B, H, L, E) -> (B, L, H, E) views: no copy unless head_dim is strided.
    q = _ops.unit_last_stride(query.transpose(1, 2))
    k = _ops.unit_last_stride(key.transpose(1, 2))
    v = _ops.unit_last_stride(value.transpose(1, 2))
    out, _ = _ops.fwd(q, k, v, float(scale), -1, 0 if is_causal else -1, False, deterministic)
    out = out.transpose(1, 2)
    return out.squeeze(1) if rank3 else out
