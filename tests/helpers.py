"""Shared test helpers: input generators and the oracle calls with THE
tolerance rule of the package (flashattn_ext.tolerance: the kernel's max error
against the float32/float64 oracle is at most 2x, 3x for gradients, the error
of the same naive computation done in the low precision, plus a small floor).
"""

import math

import torch

import flashattn_ext
from flashattn_ext.reference import attention_ref, compute_dtype, sdpa_ref
from flashattn_ext.tolerance import FLOOR, check_attention, compare, compare_lse, max_err, oracle_and_naive

ALL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
DTYPES = {
    "cpu": ALL_DTYPES,
    "cuda": (torch.float16, torch.bfloat16),
}


def assert_rule(actual, oracle, naive, factor=2.0, name="out", floor=None, scale=None, extra=0.0):
    """Asserts flashattn_ext.tolerance's rule for one tensor:
    |actual - oracle| <= factor * (|naive - oracle| + extra) + floor * max(max|oracle|, scale).

    scale: the magnitude the rounding noise is relative to when the oracle itself
    is (near) zero: e.g. dq and dk vanish exactly when every query sees a single
    key, while the kernel's dS = P (dP - D) is a difference of two equal, rounded
    quantities; the gradients' common magnitude is the right yardstick then.
    extra: an error term the naive baseline cannot have (recomputation_terms)."""
    c = compare(name, actual, oracle, naive, factor, floor=floor, magnitude=scale, extra=extra)
    assert c.ok, c.message()


def assert_all(comparisons, context=""):
    """Asserts every flashattn_ext.tolerance.Comparison; the message names each failure."""
    bad = [c.message() for c in comparisons if not c.ok]
    assert not bad, "; ".join(bad) + (f" ({context})" if context else "")


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


def check_flash(q, k, v, dout=None, grad_factor=3.0, **kw):
    """flash_attn_func(q, k, v, **kw) against the oracle with the rule: out, lse
    and (with dout) the gradients. Returns our results."""
    # detach() keeps the caller's view (strides, storage): the kernels see exactly it.
    leaves = [x.detach().requires_grad_(dout is not None) for x in (q, k, v)]
    out, lse = flashattn_ext.flash_attn_func(*leaves, return_lse=True, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32)
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    res = {"out": out, "lse": lse}
    grads = None
    if dout is not None:
        grads = torch.autograd.grad(out, leaves, dout)
        for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
            assert g.shape == x.shape and g.dtype == x.dtype, name
            res[name] = g
    ref_kw = {
        key: kw[key] for key in ("softmax_scale", "causal", "window_size", "softcap", "alibi_slopes") if key in kw
    }
    assert_all(check_attention(q, k, v, out, lse, dout, grads, grad_factor=grad_factor, **ref_kw))
    return res


def check_lse(lse, lse_oracle, dtype):
    c = compare_lse(lse, lse_oracle, dtype)
    assert c.ok, c.message()


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


def cuda_kernel_names(fn):
    """Names of the CUDA kernels fn() launches (torch.profiler): the tests that
    check which kernel a call dispatched to."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def is_sm90():
    """An H100/H200 (the warp-specialized Hopper kernels run there)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


__all__ = [
    "ALL_DTYPES",
    "DTYPES",
    "FLOOR",
    "assert_all",
    "assert_rule",
    "check_flash",
    "check_lse",
    "make_bshd",
    "max_err",
    "oracle_and_naive",
    "randn",
    "sdpa_ref",
    "attention_ref",
    "compute_dtype",
    "default_scale",
    "KernelCalls",
    "cuda_kernel_names",
    "is_sm90",
]
