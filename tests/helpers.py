"""Shared test helpers: input generators, the oracle calls and THE tolerance rule.

The rule (FlashAttention's): compute the oracle in float32 (float64 for
float32/float64 inputs) from the very low-precision inputs the kernel saw; the
kernel's max abs error against it must be at most ``factor`` (2 for outputs, 3
for gradients) times the max abs error of the same naive computation done in
the low precision (reference with upcast=False), plus a small floor relative to
the oracle's magnitude for rounding noise.
"""

import math

import torch

import flashattn_ext
from flashattn_ext.reference import attention_ref, compute_dtype, sdpa_ref, visible_mask

ALL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
DTYPES = {
    "cpu": ALL_DTYPES,
    "cuda": (torch.float16, torch.bfloat16),
}

# Relative floor, times max|oracle|: rounding noise the 2x rule cannot see when
# the naive baseline happens to be exact.
FLOOR = {
    torch.float16: 2.0**-12,
    torch.bfloat16: 2.0**-10,
    torch.float32: 2.0**-18,  # a float32 kernel summing in float32 errs a few times more than MKL
    torch.float64: 1e-10,
}


def max_err(a, b):
    return (a.to(b.dtype) - b).abs().max().item() if a.numel() else 0.0


def recomputation_terms(q, k, v, dout, out, scale, visible):
    """Two error terms no naive baseline has, computed exactly in float64.

    Returns (max |logit|, {"dq": e, "dk": e}):
    - max |logit|: the kernels form each logit in float32 (float64 for float64
      inputs), so logits of magnitude L carry ~L * eps absolute rounding that
      the exponential turns into relative error of the probabilities;
    - the dq/dk error of a recomputation backward: it needs D = rowsum(dO * O)
      and can only form it from the output as returned, rounded to the input
      dtype; dS = P (dP - D) then inherits P * dD, which this computes.
    q, out, dout: (b, n_q, h_q, d); k, v: (b, n_k, h_kv, d); visible: (n_q, n_k) bool."""
    qd, kd, vd, dod, od = (x.detach().double() for x in (q, k, v, dout, out))
    b, n_k, h_kv, d = kd.shape
    group = qd.shape[2] // h_kv
    kd, vd = kd.repeat_interleave(group, dim=2), vd.repeat_interleave(group, dim=2)
    logits = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    max_logit = logits.abs().max().item() if logits.numel() else 0.0
    p = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    exact_out = torch.einsum("bhqk,bkhd->bqhd", p, vd)
    d_err = (dod * (od - exact_out)).sum(-1).transpose(1, 2)  # (b, h, n_q): D from the rounded output
    ds_err = p * d_err.unsqueeze(-1)
    dq_err = scale * torch.einsum("bhqk,bkhd->bqhd", ds_err, kd)
    dk_err = (scale * torch.einsum("bhqk,bqhd->bkhd", ds_err, qd)).view(b, n_k, h_kv, group, d).sum(3)
    return max_logit, {"dq": dq_err.abs().max().item(), "dk": dk_err.abs().max().item()}


# Unit roundoff of the accumulation (logits are formed in float32, or float64).
ACC_EPS = {torch.float16: 2.0**-24, torch.bfloat16: 2.0**-24, torch.float32: 2.0**-24, torch.float64: 2.0**-53}


def logit_floor(dtype, max_logit):
    """Relative floor for logits of magnitude max_logit: a few ulps of the
    accumulation type at that magnitude, or the dtype's usual floor."""
    return max(FLOOR[dtype], 4 * ACC_EPS[dtype] * max_logit)


def assert_rule(actual, oracle, naive, factor=2.0, name="out", floor=None, scale=None, extra=0.0):
    """|actual - oracle| <= factor * |naive - oracle| + floor * max(max|oracle|, scale) + extra (max norms).

    scale: the magnitude the rounding noise is relative to when the oracle itself
    is (near) zero: e.g. dq and dk vanish exactly when every query sees a single
    key, while the kernel's dS = P (dP - D) is a difference of two equal, rounded
    quantities; the gradients' common magnitude is the right yardstick then.
    extra: an error term the naive baseline cannot have (recomputation_terms)."""
    assert actual.shape == oracle.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(oracle.shape)}"
    assert actual.dtype == naive.dtype, f"{name}: dtype {actual.dtype}, naive {naive.dtype}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values (NaN/inf) in the result"
    assert torch.isfinite(naive).all(), f"{name}: the naive low-precision baseline overflowed; fix the test inputs"
    if actual.numel() == 0:
        return
    err = max_err(actual, oracle)
    naive_err = max_err(naive, oracle)
    mag = max(oracle.abs().max().item(), scale or 0.0)
    floor = FLOOR[actual.dtype] if floor is None else floor
    bound = factor * naive_err + floor * max(mag, 1e-6) + extra
    assert err <= bound, (
        f"{name} ({actual.dtype}): max error {err:.3e} > bound {bound:.3e} "
        f"(= {factor} x naive {naive_err:.3e} + floor {floor:.1e} x max|oracle| {mag:.3e} + extra {extra:.1e})"
    )


def randn(shape, dtype, device, scale=1.0):
    return (torch.randn(shape, device=device, dtype=torch.float32) * scale).to(dtype)


def make_bshd(b, s, h, d, dtype, device, layout="contiguous", scale=1.0):
    """A (b, s, h, d) tensor, possibly a non-contiguous view:
    contiguous | transposed (a (b, h, s, d) buffer) | sliced (padded head_dim and
    heads) | strided_last (stride 2 on head_dim) | expanded (stride 0 on batch)."""
    if layout == "contiguous":
        return randn((b, s, h, d), dtype, device, scale)
    if layout == "transposed":
        return randn((b, h, s, d), dtype, device, scale).transpose(1, 2)
    if layout == "sliced":
        return randn((b, s, h + 1, d + 8), dtype, device, scale)[:, :, 1:, :d]
    if layout == "strided_last":
        return randn((b, s, h, d, 2), dtype, device, scale)[..., 0]
    if layout == "expanded":
        return randn((1, s, h, d), dtype, device, scale).expand(b, s, h, d)
    raise ValueError(layout)


def oracle_and_naive(q, k, v, dout=None, **kw):
    """Runs the oracle (upcast) and the naive low-precision reference on q, k, v.

    Returns dicts {"out", "lse", "dq", "dk", "dv"} (gradients when dout is given)."""
    res = []
    for upcast in (True, False):
        dt = compute_dtype(q.dtype, upcast)
        leaves = [x.detach().to(dt).requires_grad_(dout is not None) for x in (q, k, v)]
        out, lse = attention_ref(*leaves, upcast=upcast, return_lse=True, **kw)
        r = {"out": out.detach(), "lse": lse.detach()}
        if dout is not None:
            r["dq"], r["dk"], r["dv"] = torch.autograd.grad(out, leaves, dout.to(dt))
        res.append(r)
    return res


def check_flash(q, k, v, dout=None, grad_factor=3.0, **kw):
    """flash_attn_func(q, k, v, **kw) against the oracle with the rule: out, lse
    and (with dout) the gradients. Returns our results."""
    ref_kw = {key: kw[key] for key in ("softmax_scale", "causal", "window_size") if key in kw}
    oracle, naive = oracle_and_naive(q, k, v, dout, **ref_kw)
    # detach() keeps the caller's view (strides, storage): the kernels see exactly it.
    leaves = [x.detach().requires_grad_(dout is not None) for x in (q, k, v)]
    out, lse = flashattn_ext.flash_attn_func(*leaves, return_lse=True, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32)
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    scale = kw.get("softmax_scale") or default_scale(q.shape[-1])
    window_left, window_right = kw.get("window_size", (-1, -1))
    if kw.get("causal"):
        window_right = 0
    n_q, n_k = q.shape[1], k.shape[1]
    visible = visible_mask(n_q, n_k, window_left, window_right, n_k - n_q, q.device)
    max_logit, recompute_err = recomputation_terms(q, k, v, dout if dout is not None else out, out, scale, visible)
    floor = logit_floor(q.dtype, max_logit)
    assert_rule(out, oracle["out"], naive["out"], 2.0, "out", floor=floor)
    check_lse(lse, oracle["lse"], q.dtype)
    res = {"out": out, "lse": lse}
    if dout is not None:
        grads = torch.autograd.grad(out, leaves, dout)
        grad_scale = max(oracle[name].abs().max().item() for name in ("dq", "dk", "dv"))
        for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
            assert g.shape == x.shape and g.dtype == x.dtype, name
            assert_rule(g, oracle[name], naive[name], grad_factor, name, floor=floor, scale=grad_scale,
                        extra=grad_factor * recompute_err.get(name, 0.0))
            res[name] = g
    return res


# lse is accumulated in float32 (float64) from exact products of the inputs, so
# its error is set by the accumulation, not by the input dtype; in units of the
# magnitude of the logits.
LSE_RTOL = {torch.float16: 1e-5, torch.bfloat16: 1e-5, torch.float32: 1e-5, torch.float64: 1e-6}


def check_lse(lse, lse_oracle, dtype):
    lse_oracle = lse_oracle.to(lse.dtype)
    dead = torch.isneginf(lse_oracle)
    assert torch.equal(torch.isneginf(lse), dead), "lse: -inf exactly on the rows that see no key"
    assert not torch.isnan(lse).any() and not torch.isposinf(lse).any(), "lse: NaN or +inf"
    live = ~dead
    if live.any():
        err = (lse[live] - lse_oracle[live]).abs().max().item()
        mag = max(lse_oracle[live].abs().max().item(), 1.0)
        assert err <= LSE_RTOL[dtype] * mag, f"lse: max error {err:.3e} > {LSE_RTOL[dtype]:.0e} x {mag:.3e}"


def default_scale(d):
    return 1.0 / math.sqrt(d)


class KernelCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the flashattn_ext::fwd / bwd calls (their arguments as the
    kernels get them: the Python API and the attention op's autograd formula,
    in C++, call them below autograd, where a dispatch mode sees them)."""

    def __init__(self):
        super().__init__()
        self.calls = []  # (op name, args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "flashattn_ext":
            self.calls.append((func._opname, args))
        return func(*args, **(kwargs or {}))


__all__ = [
    "ALL_DTYPES", "DTYPES", "FLOOR", "assert_rule", "check_flash", "check_lse", "make_bshd", "max_err",
    "oracle_and_naive", "randn", "sdpa_ref", "attention_ref", "compute_dtype", "default_scale", "KernelCalls",
]
