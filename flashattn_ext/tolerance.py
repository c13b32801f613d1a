"""The one tolerance rule every correctness check of this project applies
(the tests, ``benchmarks/kernel_check.py`` and ``python -m flashattn_ext``).

FlashAttention's rule: compute the oracle (:mod:`flashattn_ext.reference`) in
float32 (float64 for float32/float64 inputs) from the very inputs the kernel
saw, and the same naive computation once more in the kernel's low precision
(``upcast=False``). Then, with max norms over all elements,

    |ours - oracle| <= factor * (|naive - oracle| + extra) + floor * magnitude

* ``factor``: 2 for the output (:data:`OUT_FACTOR`), 3 for the gradients
  (:data:`GRAD_FACTOR`);
* ``floor``: a small relative floor for rounding noise that the naive baseline
  happens not to have (:func:`floor_for`: :data:`FLOOR` per dtype, raised with
  the magnitude of the logits, which the kernels form in float32 / float64);
* ``magnitude``: max|oracle|, or a larger common yardstick where the oracle
  itself is (near) zero (the gradients use the largest of dq, dk, dv);
* ``extra``: the error terms of a recomputation backward that no naive baseline
  has (:func:`recomputation_terms`; gradients only).

The log-sum-exp is accumulated in float32 (float64), whatever the input dtype,
so it is held to the accumulation's precision instead
(:func:`compare_lse`: -inf exactly on the rows that see no key, elsewhere at
most :data:`LSE_RTOL` times max(max|lse|, 1)).

:func:`check_attention` applies all of it to one attention call (output, lse
and, with ``dout``, the gradients) and returns one :class:`Comparison` per
quantity; :func:`compare` and :func:`compare_lse` are its parts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .reference import alibi_bias, attention_ref, compute_dtype, visible_mask

__all__ = [
    "OUT_FACTOR",
    "GRAD_FACTOR",
    "FLOOR",
    "ACC_EPS",
    "LSE_RTOL",
    "Comparison",
    "max_err",
    "ulp_at",
    "floor_for",
    "compare",
    "compare_lse",
    "oracle_and_naive",
    "recomputation_terms",
    "check_attention",
]

OUT_FACTOR = 2.0
GRAD_FACTOR = 3.0

# Relative floor, times the magnitude: rounding noise the 2x rule cannot see
# when the naive baseline happens to be exact.
FLOOR = {
    torch.float16: 2.0**-12,
    torch.bfloat16: 2.0**-10,
    torch.float32: 2.0**-18,  # a float32 kernel summing in float32 errs a few times more than MKL
    torch.float64: 1e-12,  # float64 kernels accumulate in float64: ~1e-15 relative
}

# Unit roundoff of the accumulation (logits are formed in float32, or float64).
ACC_EPS = {torch.float16: 2.0**-24, torch.bfloat16: 2.0**-24, torch.float32: 2.0**-24, torch.float64: 2.0**-53}

# lse: relative error, in units of max(max|lse|, 1), set by the accumulation type.
LSE_RTOL = {torch.float16: 1e-5, torch.bfloat16: 1e-5, torch.float32: 1e-5, torch.float64: 1e-10}


@dataclass
class Comparison:
    """One quantity checked against the oracle. ``ok`` is the verdict."""

    name: str
    dtype: str
    err: float
    bound: float
    naive_err: float | None = None
    factor: float | None = None
    floor: float | None = None
    magnitude: float | None = None
    extra: float = 0.0
    problem: str | None = None  # a failure that is not a size: NaN, a shape, the -inf pattern

    @property
    def ok(self) -> bool:
        return self.problem is None and self.err <= self.bound

    def message(self) -> str:
        if self.problem:
            return f"{self.name} ({self.dtype}): {self.problem}"
        rel = "<=" if self.ok else ">"
        if self.naive_err is None:
            return f"{self.name} ({self.dtype}): max error {self.err:.3e} {rel} bound {self.bound:.3e}"
        return (
            f"{self.name} ({self.dtype}): max error {self.err:.3e} {rel} bound {self.bound:.3e} "
            f"(= {self.factor:g} x (naive {self.naive_err:.3e} + extra {self.extra:.1e}) "
            f"+ floor {self.floor:.1e} x magnitude {self.magnitude:.3e})"
        )

    def as_dict(self) -> dict:
        return dict(
            name=self.name,
            dtype=self.dtype,
            ok=self.ok,
            err=self.err,
            bound=self.bound,
            naive_err=self.naive_err,
            factor=self.factor,
            floor=self.floor,
            magnitude=self.magnitude,
            extra=self.extra,
            problem=self.problem,
        )


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def max_err(actual: torch.Tensor, oracle: torch.Tensor) -> float:
    """max |actual - oracle| over the entries where the oracle is finite (in
    float64; 0 for empty tensors). A NaN in ``actual`` there gives NaN."""
    a, b = actual.detach().double(), oracle.detach().double()
    finite = torch.isfinite(b)
    if not finite.any():
        return 0.0
    return (a - b)[finite].abs().max().item()


def ulp_at(dtype: torch.dtype, magnitude: float) -> float:
    """One unit in the last place of ``dtype`` at ``magnitude``: how far apart
    two results can land that agree before their last rounding to ``dtype``
    (two float32 sums on either side of a rounding boundary). Comparing two
    results that each meet the rule against the oracle (a distributed call and
    the single-process one) allows this on top of the rule's bound."""
    finfo = torch.finfo(dtype)
    if not magnitude > finfo.tiny:
        return finfo.tiny * finfo.eps
    return math.ldexp(finfo.eps, math.frexp(magnitude)[1] - 1)


def _max_abs(x: torch.Tensor) -> float:
    x = x.detach()
    x = x[torch.isfinite(x)]
    return x.abs().max().item() if x.numel() else 0.0


def floor_for(dtype: torch.dtype, max_logit: float = 0.0) -> float:
    """The relative floor for ``dtype``: :data:`FLOOR`, or a few ulps of the
    accumulation type at the logits' magnitude when that is larger (logits of
    magnitude L carry ~L * eps absolute rounding, which the exponential turns
    into relative error of the probabilities)."""
    return max(FLOOR[dtype], 4 * ACC_EPS[dtype] * max_logit)


def compare(name, actual, oracle, naive, factor=OUT_FACTOR, floor=None, magnitude=None, extra=0.0) -> Comparison:
    """The rule for one tensor: ``actual`` against ``oracle``, the yardstick
    being the error of ``naive`` (the same computation in ``actual``'s dtype).

    floor: relative floor (default :func:`floor_for` of the dtype);
    magnitude: what the floor is relative to, at least max|oracle|;
    extra: an error term the naive baseline cannot have (added to its error)."""
    dtype = actual.dtype
    c = Comparison(name=name, dtype=_dtype_name(dtype), err=0.0, bound=0.0, factor=factor, extra=extra)
    if actual.shape != oracle.shape:
        c.problem = f"shape {tuple(actual.shape)} != the oracle's {tuple(oracle.shape)}"
        return c
    if naive.dtype != dtype:
        c.problem = f"dtype {dtype}, but the naive baseline is {naive.dtype}"
        return c
    if not bool(torch.isfinite(actual).all()):
        c.problem = "non-finite values (NaN/inf) in the result"
        return c
    if not bool(torch.isfinite(naive).all()):
        c.problem = "the naive low-precision baseline overflowed (fix the inputs)"
        return c
    c.err, c.naive_err = max_err(actual, oracle), max_err(naive, oracle)
    c.magnitude = max(_max_abs(oracle), magnitude or 0.0, 1e-6)
    c.floor = floor_for(dtype) if floor is None else floor
    c.bound = factor * (c.naive_err + extra) + c.floor * c.magnitude
    return c


def compare_lse(lse: torch.Tensor, oracle_lse: torch.Tensor, dtype: torch.dtype, name="lse") -> Comparison:
    """lse against the oracle's: -inf exactly where the oracle has -inf (rows
    that see no key), never NaN or +inf, elsewhere within LSE_RTOL[dtype] x
    max(max|lse|, 1). ``dtype``: the inputs' dtype."""
    c = Comparison(name=name, dtype=_dtype_name(dtype), err=0.0, bound=0.0)
    if lse.shape != oracle_lse.shape:
        c.problem = f"shape {tuple(lse.shape)} != the oracle's {tuple(oracle_lse.shape)}"
        return c
    oracle_lse = oracle_lse.detach().to(lse.dtype)
    dead = torch.isneginf(oracle_lse)
    if torch.isnan(lse).any() or torch.isposinf(lse).any():
        c.problem = "NaN or +inf in lse"
        return c
    if not torch.equal(torch.isneginf(lse), dead):
        c.problem = "lse is not -inf exactly on the rows that see no key"
        return c
    live = ~dead
    if live.any():
        c.err = (lse[live].double() - oracle_lse[live].double()).abs().max().item()
        c.magnitude = max(oracle_lse[live].abs().max().item(), 1.0)
    c.bound = LSE_RTOL[dtype] * (c.magnitude or 1.0)
    return c


def oracle_and_naive(q, k, v, dout=None, mask_grad=False, **kw):
    """The oracle (upcast) and the naive low-precision computation
    (:func:`flashattn_ext.reference.attention_ref` twice) on q, k, v.

    kw: attention_ref's arguments (softmax_scale, causal, window_size,
    bottom_right, layout, softcap, alibi_slopes, attn_mask). Returns two dicts
    {"out", "lse"[, "dq", "dk", "dv"[, "dmask"]]} (gradients when dout is
    given; with mask_grad, that of the float attn_mask too, the naive one in
    the mask's dtype), each in its compute dtype."""
    res = []
    mask = kw.pop("attn_mask", None)
    for upcast in (True, False):
        dt = compute_dtype(q.dtype, upcast)
        leaves = [x.detach().to(dt).requires_grad_(dout is not None) for x in (q, k, v)]
        m = mask
        if mask_grad and dout is not None:
            m = mask.detach().to(dt if upcast else mask.dtype).requires_grad_()
            leaves.append(m)
        out, lse = attention_ref(*leaves[:3], upcast=upcast, return_lse=True, attn_mask=m, **kw)
        r = {"out": out.detach(), "lse": lse.detach()}
        if dout is not None:
            names = ("dq", "dk", "dv", "dmask")[: len(leaves)]
            r.update(zip(names, torch.autograd.grad(out, leaves, dout.to(dt))))
        res.append(r)
    return res


def recomputation_terms(q, k, v, dout, out, scale, visible, softcap=0.0, alibi_slopes=None, attn_mask=None):
    """Two error terms no naive baseline has, computed exactly in float64.

    Returns (max logit magnitude, {"dq": e, "dk": e}):
    - max logit magnitude, max |scale| sum_i |q_i k_i|: the kernels form each
      logit in float32 (float64 for float64 inputs), a dot product whose
      rounding is ~eps times that sum, and the exponential turns it into
      relative error of the probabilities (a recomputing backward's twice);
    - the dq/dk error of a recomputation backward: it needs D = rowsum(dO * O)
      and can only form it from the output as returned, rounded to the input
      dtype; dS = P (dP - D) then inherits P * dD, which this computes; a float
      attn_mask's gradient is dS itself summed over the mask's broadcast
      dimensions, so it inherits the same term ("dmask").
    q, out, dout: (b, n_q, h_q, d); k, v: (b, n_k, h_kv, d); visible: (n_q, n_k) bool;
    attn_mask: torch SDPA's, as attention_ref takes it."""
    qd, kd, vd, dod, od = (x.detach().double() for x in (q, k, v, dout, out))
    b, n_k, h_kv, d = kd.shape
    group = qd.shape[2] // h_kv
    kd, vd = kd.repeat_interleave(group, dim=2), vd.repeat_interleave(group, dim=2)
    logits = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    # A float32 dot product rounds relative to sum |q_i k_i|, not to |q . k|
    # (which cancellation makes smaller), so that is the magnitude the floor uses.
    abs_logits = torch.einsum("bqhd,bkhd->bhqk", qd.abs(), kd.abs()) * abs(scale)
    max_logit = abs_logits.max().item() if abs_logits.numel() else 0.0
    if softcap > 0:  # the scores the softmax sees (the kernels' rounding is that of the raw logits above)
        logits = softcap * torch.tanh(logits / softcap)
    if alibi_slopes is not None:
        logits = logits + alibi_bias(alibi_slopes, logits.shape[-2], logits.shape[-1], logits.device).double()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        visible = visible & attn_mask
    elif attn_mask is not None:
        logits = logits + attn_mask.detach().double()
    p = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    exact_out = torch.einsum("bhqk,bkhd->bqhd", p, vd)
    d_err = (dod * (od - exact_out)).sum(-1).transpose(1, 2)  # (b, h, n_q): D from the rounded output
    ds_err = p * d_err.unsqueeze(-1)
    dq_err = scale * torch.einsum("bhqk,bkhd->bqhd", ds_err, kd)
    dk_err = (scale * torch.einsum("bhqk,bqhd->bkhd", ds_err, qd)).view(b, n_k, h_kv, group, d).sum(3)
    terms = {"dq": dq_err.abs().max().item(), "dk": dk_err.abs().max().item()}
    if attn_mask is not None and attn_mask.dtype != torch.bool and ds_err.numel():
        terms["dmask"] = ds_err.sum_to_size(attn_mask.shape).abs().max().item()
    return max_logit, terms


def check_attention(
    q,
    k,
    v,
    out,
    lse=None,
    dout=None,
    grads=None,
    softmax_scale=None,
    window_size=(-1, -1),
    causal=False,
    bottom_right=True,
    grad_factor=GRAD_FACTOR,
    softcap=0.0,
    alibi_slopes=None,
    attn_mask=None,
    dropout_p=0.0,
    rng_state=None,
    dropout_keep=None,
    dmask=None,
):
    """One attention call of ours against the oracle, with the rule.

    q (b, n_q, h_q, d), k, v (b, n_k, h_kv, d): the inputs the kernel saw (any
    dtype, any device); out (like q) and lse (b, h_q, n_q, or None) its results;
    with ``dout`` (like q), ``grads`` = its (dq, dk, dv) for that output gradient.
    The mask arguments are flash_attn_func's (causal sets window_right to 0),
    plus ``bottom_right`` (False: torch SDPA's top-left diagonal), ``softcap`` and
    ``alibi_slopes`` (flash-attn's score modifications) and torch SDPA's ``attn_mask``
    (broadcastable to (b, h_q, n_q, n_k)); ``dropout_p`` with the call's
    ``rng_state`` (seed, offset): the oracle applies the kernels' exact keep mask
    (or ``dropout_keep``, that mask as a bool tensor: reference.attention_ref).

    ``dmask``: the gradient of a float ``attn_mask`` (with ``grads``), checked as
    the other gradients are.

    Returns [Comparison] for out, lse (when given) and dq, dk, dv (and dmask)
    when given: all(c.ok for c in result) is the verdict, c.message() says why."""
    window_left, window_right = window_size
    if causal:
        window_right = 0
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    with torch.enable_grad():
        oracle, naive = oracle_and_naive(
            q,
            k,
            v,
            dout if grads is not None else None,
            mask_grad=dmask is not None,
            softmax_scale=scale,
            window_size=(window_left, window_right),
            bottom_right=bottom_right,
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            rng_state=rng_state,
            dropout_keep=dropout_keep,
        )
    n_q, n_k = q.shape[1], k.shape[1]
    visible = visible_mask(n_q, n_k, window_left, window_right, n_k - n_q if bottom_right else 0, q.device)
    max_logit, recompute_err = recomputation_terms(
        q, k, v, dout if dout is not None else out, out, scale, visible, softcap, alibi_slopes, attn_mask
    )
    floor = floor_for(q.dtype, max_logit)
    result = [compare("out", out, oracle["out"], naive["out"], OUT_FACTOR, floor=floor)]
    if lse is not None:
        result.append(compare_lse(lse, oracle["lse"], q.dtype))
    if grads is not None:
        magnitude = max(_max_abs(oracle[name]) for name in ("dq", "dk", "dv"))
        grads = (*grads, dmask) if dmask is not None else grads
        for name, g in zip(("dq", "dk", "dv", "dmask"), grads):
            result.append(
                compare(
                    name,
                    g,
                    oracle[name],
                    naive[name],
                    grad_factor,
                    floor=floor,
                    magnitude=magnitude,
                    extra=recompute_err.get(name, 0.0),
                )
            )
    return result
