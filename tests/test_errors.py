"""Every bad input is rejected with an error that names the argument: the
checks of csrc/attention_api.cpp through the raw ops and through
flash_attn_func, the same checks in the fake (meta) kernels, and the
Python-level refusals of flash_attn_func. The full table of bad-input kinds is
tests/test_bad_inputs.py."""

import math

import pytest
import torch
from helpers import randn

import flashattn_ext

fwd = torch.ops.flashattn_ext.fwd
bwd = torch.ops.flashattn_ext.bwd


def _dtype(device):
    return torch.float32 if device == "cpu" else torch.float16


def _qkv(device, b=2, sq=5, sk=7, hq=4, hkv=2, d=16, dtype=None):
    dt = dtype or _dtype(device)
    return randn((b, sq, hq, d), dt, device), randn((b, sk, hkv, d), dt, device), randn((b, sk, hkv, d), dt, device)


def _fwd(q, k, v, scale=0.25, wl=-1, wr=-1):
    return fwd(q, k, v, scale, wl, wr, True)


# name -> (builder(q, k, v) -> (q, k, v), exception type, message regex)
FWD_CASES = {
    "q_rank3": (lambda q, k, v: (q[0], k, v), ValueError, r"q must have 4 dimensions"),
    "k_rank5": (lambda q, k, v: (q, k[None], v), ValueError, r"k must have 4 dimensions"),
    "v_rank3": (lambda q, k, v: (q, k, v[0]), ValueError, r"v must have 4 dimensions"),
    "k_dtype": (lambda q, k, v: (q, k.double(), v), TypeError, r"k has dtype Double but q has dtype"),
    "v_dtype": (lambda q, k, v: (q, k, v.to(torch.bfloat16)), TypeError, r"v has dtype BFloat16 but q has dtype"),
    "int_dtype": (
        lambda q, k, v: (q.int(), k.int(), v.int()),
        TypeError,
        r"q has dtype Int, which the \w+ kernels do not support",
    ),
    "q_zero_head_dim": (lambda q, k, v: (q[..., :0], k, v), ValueError, r"q has head_dim 0 \(shape \[2, 5, 4, 0\]\)"),
    "v_zero_batch": (lambda q, k, v: (q, k, v[:0]), ValueError, r"batch sizes differ: q 2, k 2, v 0"),
    "k_head_dim": (lambda q, k, v: (q, k[..., :8], v), ValueError, r"k has head_dim 8 but q has head_dim 16"),
    "v_head_dim": (lambda q, k, v: (q, k, v[..., :8]), ValueError, r"v has head_dim 8 but q has 16"),
    "head_dim_264": (
        lambda q, k, v: tuple(torch.zeros(*x.shape[:3], 264, dtype=x.dtype, device=x.device) for x in (q, k, v)),
        ValueError,
        r"head_dim 264 is larger than 256",
    ),
    "batch": (lambda q, k, v: (q, k[:1], v[:1]), ValueError, r"batch sizes differ: q 2, k 1, v 1"),
    "v_seqlen": (lambda q, k, v: (q, k, v[:, :3]), ValueError, r"v has seqlen 3 but k has 7"),
    "v_heads": (lambda q, k, v: (q, k, v[:, :, :1]), ValueError, r"v has 1 heads but k has 2"),
    "heads_not_divisible": (
        lambda q, k, v: (q[:, :, :3], k, v),
        ValueError,
        r"q has 3 heads, not a multiple of the 2 heads of k and v",
    ),
    "q_last_stride": (
        lambda q, k, v: (q.transpose(2, 3).contiguous().transpose(2, 3)[..., :4, :4], k[..., :4], v[..., :4]),
        ValueError,
        r"q must have stride 1 in its last \(head_dim\) dimension",
    ),
    "k_last_stride": (
        lambda q, k, v: (q, torch.cat([k, k], -1)[..., ::2], v),
        ValueError,
        r"k must have stride 1 in its last",
    ),
    "v_last_stride": (
        lambda q, k, v: (q, k, torch.cat([v, v], -1)[..., ::2]),
        ValueError,
        r"v must have stride 1 in its last",
    ),
    "q_too_long": (
        lambda q, k, v: (q[:1, :1].expand(2**31, 1, *q.shape[2:]), k, v),  # stride 0: no memory
        ValueError,
        r"q dimension 0 has size 2147483648, larger than 2\^31 - 1",
    ),
    "k_too_long": (
        lambda q, k, v: (q, k[:, :1].expand(2, 2**31, *k.shape[2:]), v),
        ValueError,
        r"k dimension 1 has size 2147483648, larger than 2\^31 - 1",
    ),
}


@pytest.mark.parametrize("case", list(FWD_CASES))
def test_fwd_op_errors(device, case):
    build, exc, msg = FWD_CASES[case]
    q, k, v = build(*_qkv(device))
    with pytest.raises(exc, match=msg):
        _fwd(q, k, v)
    if case in ("q_last_stride", "k_last_stride", "v_last_stride"):
        flashattn_ext.flash_attn_func(q, k, v)  # the Python API makes head_dim contiguous instead
    else:
        with pytest.raises(exc, match=msg):  # the same error through the Python API
            flashattn_ext.flash_attn_func(q, k, v)


def _to_meta(x):
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")


@pytest.mark.parametrize("case", list(FWD_CASES))
def test_fwd_op_errors_meta(device, case):
    """The fake (meta) kernels validate exactly like the real ones: meta tensors
    and torch.compile's tracing see the same errors (issue #9, finding 3)."""
    build, exc, msg = FWD_CASES[case]
    q, k, v = (_to_meta(x) for x in build(*_qkv(device)))
    with pytest.raises(exc, match=msg):
        _fwd(q, k, v)
    if case not in ("q_last_stride", "k_last_stride", "v_last_stride"):
        with pytest.raises(exc, match=msg):
            flashattn_ext.flash_attn_func(q, k, v)


@pytest.mark.parametrize("window", [(-2, -1), (-1, -5), (-3, 0)])
def test_bad_window(device, window):
    q, k, v = _qkv(device)
    with pytest.raises(
        ValueError, match=r"window sizes must be -1 \(unbounded\) or >= 0, got window_left=-?\d+, window_right=-?\d+"
    ):
        _fwd(q, k, v, wl=window[0], wr=window[1])
    with pytest.raises(ValueError, match=r"window_size \((left|right)\) must be -1 \(unbounded\) or >= 0, got -\d"):
        flashattn_ext.flash_attn_func(q, k, v, window_size=window)


@pytest.mark.parametrize("scale", [math.inf, -math.inf, math.nan])
def test_bad_softmax_scale(device, scale):
    q, k, v = _qkv(device)
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        _fwd(q, k, v, scale=scale)
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        flashattn_ext.flash_attn_func(q, k, v, softmax_scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.cuda
def test_cuda_rejects_float32_float64(dtype):
    q, k, v = _qkv("cuda", dtype=dtype)
    with pytest.raises(TypeError, match=r"q has dtype \w+, which the CUDA kernels do not support"):
        _fwd(q, k, v)


@pytest.mark.cuda
@pytest.mark.parametrize("which", ["k", "v"])
def test_device_mismatch(which):
    q, k, v = _qkv("cuda")
    if which == "k":
        k = k.cpu()
    else:
        v = v.cpu()
    with pytest.raises(ValueError, match=rf"{which} is on cpu but q is on cuda"):
        _fwd(q, k, v)
    with pytest.raises(ValueError, match=rf"{which} is on cpu but q is on cuda"):
        flashattn_ext.flash_attn_func(q, k, v)


@pytest.mark.skipif(
    flashattn_ext.build_info()["cuda"] or not torch.cuda.is_available(), reason="needs a GPU and a CPU-only build"
)
def test_cuda_tensors_without_cuda_build():
    q, k, v = _qkv("cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="has no CUDA kernels"):
        flashattn_ext.flash_attn_func(q, k, v)


# ----------------------------------------------------------------------------- backward op


def _bwd_inputs(device):
    q, k, v = _qkv(device)
    out, lse = _fwd(q, k, v)
    dout = randn(out.shape, out.dtype, device)
    return dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse)


def _call_bwd(t):
    return bwd(t["dout"], t["q"], t["k"], t["v"], t["out"], t["lse"], 0.25, -1, -1, True, False)


# name -> (field, transform, exception, regex)
BWD_CASES = {
    "dout_shape": ("dout", lambda x: x[:, :3], ValueError, r"dout has shape \[2, 3, 4, 16\] but q has \[2, 5, 4, 16\]"),
    "dout_dtype": ("dout", lambda x: x.double(), TypeError, r"dout has dtype Double but q has dtype"),
    "dout_last_stride": (
        "dout",
        lambda x: torch.cat([x, x], -1)[..., ::2],
        ValueError,
        r"dout must have stride 1 in its last",
    ),
    "out_shape": ("out", lambda x: x[:, :, :2], ValueError, r"out has shape \[2, 5, 2, 16\] but q has"),
    "out_dtype": ("out", lambda x: x.to(torch.bfloat16), TypeError, r"out has dtype BFloat16 but q has dtype"),
    "out_last_stride": (
        "out",
        lambda x: torch.cat([x, x], -1)[..., ::2],
        ValueError,
        r"out must have stride 1 in its last",
    ),
    "lse_dtype": ("lse", lambda x: x.double(), TypeError, r"lse has dtype Double, expected Float"),
    "lse_shape_transposed": (
        "lse",
        lambda x: x.transpose(1, 2).contiguous(),
        ValueError,
        r"lse has shape \[2, 5, 4\], expected \(batch, heads_q, seqlen_q\) = \(2, 4, 5\)",
    ),
    "lse_rank": ("lse", lambda x: x[0], ValueError, r"lse has shape \[4, 5\], expected"),
    "lse_noncontiguous": (
        "lse",
        lambda x: x.transpose(1, 2).contiguous().transpose(1, 2),
        ValueError,
        r"lse must be contiguous",
    ),
    "q_rank": ("q", lambda x: x[0], ValueError, r"q must have 4 dimensions"),
    "heads": ("k", lambda x: torch.cat([x, x[:, :, :1]], 2), ValueError, r"v has 2 heads but k has 3"),
}


@pytest.mark.parametrize("case", list(BWD_CASES))
def test_bwd_op_errors(device, case):
    field, transform, exc, msg = BWD_CASES[case]
    t = _bwd_inputs(device)
    _call_bwd(t)  # valid as built
    t[field] = transform(t[field])
    with pytest.raises(exc, match=msg):
        _call_bwd(t)


@pytest.mark.parametrize("case", list(BWD_CASES))
def test_bwd_op_errors_meta(device, case):
    field, transform, exc, msg = BWD_CASES[case]
    t = _bwd_inputs(device)
    t[field] = transform(t[field])
    t = {name: _to_meta(x) for name, x in t.items()}
    with pytest.raises(exc, match=msg):
        _call_bwd(t)


@pytest.mark.cuda
@pytest.mark.parametrize("field", ["dout", "out", "lse"])
def test_bwd_device_mismatch(field):
    t = _bwd_inputs("cuda")
    t[field] = t[field].cpu()
    with pytest.raises(ValueError, match=rf"{field} is on cpu but q is on cuda"):
        _call_bwd(t)


# ----------------------------------------------------------------------------- Python-level refusals


def test_lse_has_no_gradient(device):
    q, k, v = (x.requires_grad_() for x in _qkv(device))
    _, lse = flashattn_ext.flash_attn_func(q, k, v, return_lse=True)
    assert not lse.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        lse.sum().backward()
