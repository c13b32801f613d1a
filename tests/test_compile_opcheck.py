"""The ops as torch.library sees them: opcheck (schema, fake kernels, autograd
registration, AOT dispatch) on fwd and bwd with a few sample inputs, and
torch.compile(fullgraph=True) of code calling flash_attn_func and
scaled_dot_product_attention, forward and backward, without graph breaks."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import make_bshd, randn

import flashattn_ext
from flashattn_ext import FlashAttnFallbackWarning

attention = torch.ops.flashattn_ext.attention.default
fwd = torch.ops.flashattn_ext.fwd.default
bwd = torch.ops.flashattn_ext.bwd.default


def _samples(device):
    """(q, k, v, scale, window_left, window_right, bottom_right, deterministic)."""
    lo = torch.float32 if device == "cpu" else torch.float16
    out = []
    q, k, v = randn((2, 9, 4, 16), lo, device), randn((2, 13, 2, 16), lo, device), randn((2, 13, 2, 16), lo, device)
    out.append((q, k, v, 0.25, -1, 0, True, False))  # causal bottom-right, GQA
    q = make_bshd(1, 17, 2, 40, torch.bfloat16, device, "transposed")
    k = make_bshd(1, 5, 1, 40, torch.bfloat16, device, "sliced")
    v = make_bshd(1, 5, 1, 40, torch.bfloat16, device, "sliced")
    out.append((q, k, v, 0.1, 3, 2, False, True))  # window, top-left, MQA, non-contiguous
    if device == "cpu":
        q, k, v = (randn((1, 6, 2, 8), torch.float64, device) for _ in range(3))
        out.append((q, k, v, 0.5, -1, -1, True, False))
    return out


def test_opcheck_fwd(device):
    for args in _samples(device):
        q, k, v = (x.detach().requires_grad_() for x in args[:3])
        torch.library.opcheck(attention, (q, k, v) + args[3:])
        torch.library.opcheck(attention, args)  # without requires_grad
        torch.library.opcheck(fwd, args[:-1])  # the forward alone: no deterministic, not differentiable
        # torch's (B, H, L, E) layout, as the SDPA drop-in passes it
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        torch.library.opcheck(attention, (qt, kt, vt) + args[3:] + (True,))


def test_opcheck_bwd(device):
    for args in _samples(device):
        q, k, v = args[:3]
        out, lse = fwd(*args[:-1])
        dout = randn(out.shape, out.dtype, q.device)
        torch.library.opcheck(bwd, (dout, q, k, v, out, lse) + args[3:])


varlen_attention = torch.ops.flashattn_ext.varlen_attention.default
varlen_fwd = torch.ops.flashattn_ext.varlen_fwd.default
varlen_bwd = torch.ops.flashattn_ext.varlen_bwd.default


def _varlen_samples(device):
    """(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
    window_left, window_right, bottom_right, deterministic)."""
    lo = torch.float32 if device == "cpu" else torch.float16

    def cu(*c):
        return torch.tensor(c, dtype=torch.int32, device=device)

    out = []
    q, k, v = randn((9, 4, 16), lo, device), randn((13, 2, 16), lo, device), randn((13, 2, 16), lo, device)
    out.append((q, k, v, cu(0, 3, 3, 9), cu(0, 5, 7, 13), 6, 6, 0.25, -1, 0, True, False))  # causal, GQA, empty seq
    q = randn((7, 3, 48), torch.bfloat16, device)[:, 1:, :40]  # sliced: strided heads, head_dim 40
    k = randn((12, 1, 40), torch.bfloat16, device)
    v = randn((12, 1, 40), torch.bfloat16, device)
    out.append((q, k, v, cu(0, 7), cu(0, 12), 9, 12, 0.1, 3, 2, False, True))  # window, top-left, MQA, bounds > lengths
    return out


def test_opcheck_varlen(device):
    for args in _varlen_samples(device):
        q, k, v = (x.detach().requires_grad_() for x in args[:3])
        torch.library.opcheck(varlen_attention, (q, k, v) + args[3:])
        torch.library.opcheck(varlen_attention, args)
        torch.library.opcheck(varlen_fwd, args[:-1])
        out, lse = varlen_fwd(*args[:-1])
        dout = randn(out.shape, out.dtype, out.device)
        torch.library.opcheck(varlen_bwd, (dout,) + args[:3] + (out, lse) + args[3:])


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = (
            torch.empty(2, 9, 4, 16, dtype=torch.float16),
            torch.empty(2, 13, 2, 16, dtype=torch.float16),
            torch.empty(2, 13, 2, 16, dtype=torch.float16),
        )
        out, lse = fwd(q, k, v, 0.25, -1, 0, True)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert lse.shape == (2, 4, 9) and lse.dtype == torch.float32
        dq, dk, dv = bwd(out, q, k, v, out, lse, 0.25, -1, 0, True, False)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        _, lse64 = attention(q.double(), k.double(), v.double(), 0.25, -1, 0, True, False)
        assert lse64.dtype == torch.float64


def _model(q, k, v, qs, ks, vs):
    # flash layout (B, S, H, D) and torch layout (B, H, L, E) in one graph
    a = flashattn_ext.flash_attn_func(q, k, v, causal=True)
    b, lse = flashattn_ext.flash_attn_func(q * 0.5, k, v, window_size=(4, 2), return_lse=True)
    c = flashattn_ext.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
    return a.sum() + b.square().sum() + (c * c.detach()).sum() + lse.sum(), a, b, c


def _inputs(device, dtype, n=(23, 31, 19, 27)):
    q = randn((2, n[0], 4, 32), dtype, device)
    k, v = randn((2, n[1], 2, 32), dtype, device), randn((2, n[1], 2, 32), dtype, device)
    qs = randn((2, 4, n[2], 32), dtype, device)
    ks, vs = randn((2, 2, n[3], 32), dtype, device), randn((2, 2, n[3], 32), dtype, device)
    return [x.requires_grad_() for x in (q, k, v, qs, ks, vs)]


def _run(fn, inputs):
    loss, *outs = fn(*inputs)
    grads = torch.autograd.grad(loss, inputs)
    return [loss, *outs, *grads]


@pytest.mark.parametrize(
    "backend,dynamic", [("inductor", False), ("aot_eager", True)], ids=["inductor", "aot_eager_dynamic"]
)
@pytest.mark.dtypes(torch.float32, torch.bfloat16)
def test_compile_fullgraph(device, dtype, backend, dynamic):
    if backend == "inductor" and device == "cpu" and dtype != torch.float32:
        pytest.skip("one inductor compile on the CPU is enough (slow to compile on small machines)")
    torch._dynamo.reset()
    inputs = _inputs(device, dtype)
    expected = _run(_model, inputs)
    compiled = torch.compile(_model, fullgraph=True, backend=backend, dynamic=dynamic)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlashAttnFallbackWarning)
        got = _run(compiled, inputs)
        if dynamic:  # other sequence lengths through the same dynamic-shape graph
            inputs2 = _inputs(device, dtype, (40, 17, 33, 50))
            for e, g in zip(_run(_model, inputs2), _run(compiled, inputs2)):
                torch.testing.assert_close(g, e, rtol=1e-2, atol=1e-2 * max(1.0, e.abs().max().item()))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=tol, atol=tol * max(1.0, e.abs().max().item()))


@pytest.mark.dtypes(torch.float32, torch.float16)
def test_compile_fallback_warns_without_graph_break(device, dtype):
    """An ineligible call inside compiled code still goes to torch, warns (once,
    at trace time), and does not break the graph."""
    torch._dynamo.reset()
    q, k = (randn((1, 2, 9, 16), dtype, device) for _ in range(2))
    v = randn((1, 2, 9, 24), dtype, device)  # a value head dim of its own: torch's

    def f(q, k, v):
        return flashattn_ext.scaled_dot_product_attention(q, k, v) + 1

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    with pytest.warns(FlashAttnFallbackWarning, match="value head dim"):
        out = compiled(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v) + 1)


def test_compile_deterministic_flag(device):
    """torch.use_deterministic_algorithms reaches the op inside compiled code, and
    flipping it after compilation is seen (a guard, not a stale constant)."""
    torch._dynamo.reset()
    dtype = torch.float32 if device == "cpu" else torch.float16
    q = randn((1, 8, 2, 16), dtype, device)
    flags = []

    def backend(gm, example_inputs):
        for n in gm.graph.nodes:
            if n.op == "call_function" and "flashattn_ext" in str(n.target):
                flags.append(n.args[-1])
        return gm.forward

    f = torch.compile(lambda q: flashattn_ext.flash_attn_func(q, q, q), fullgraph=True, backend=backend)
    prev = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        f(q)
        torch.use_deterministic_algorithms(True, warn_only=True)
        f(q)
    finally:
        torch.use_deterministic_algorithms(prev)
    assert flags == [False, True]
