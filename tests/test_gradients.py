"""Gradients of flash_attn_func against the oracle with the 3x rule (helpers.py),
over a reduced version of the forward matrix, plus gradcheck in float64 and
bitwise reproducibility of the deterministic backward on the GPU."""

import pytest
import torch
from helpers import check_flash, make_bshd, randn

import flashattn_ext


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(1, 1), (1, 17), (17, 1), (113, 203), (203, 113)], ids=lambda s: f"q{s[0]}k{s[1]}")
def test_grads_seqlens(device, dtype, causal, seqlens):
    sq, sk = seqlens
    q, k, v = (randn((2, s, 2, 64), dtype, device) for s in (sq, sk, sk))
    check_flash(q, k, v, dout=randn(q.shape, dtype, device), causal=causal)


@pytest.mark.dtypes(torch.bfloat16, torch.float16)
@pytest.mark.parametrize("seqlens", [(1023, 1025), (1025, 1023)], ids=lambda s: f"q{s[0]}k{s[1]}")
def test_grads_long(device, dtype, seqlens):
    sq, sk = seqlens
    q, k, v = (randn((1, s, 1, 64), dtype, device) for s in (sq, sk, sk))
    check_flash(q, k, v, dout=randn(q.shape, dtype, device), causal=True)


@pytest.mark.parametrize("d", [8, 40, 80, 96, 128, 192, 256])
def test_grads_head_dims(device, dtype, d):
    q = randn((1, 77, 2, d), dtype, device)
    k, v = randn((1, 101, 2, d), dtype, device), randn((1, 101, 2, d), dtype, device)
    check_flash(q, k, v, dout=randn(q.shape, dtype, device), causal=True)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(6, 2), (6, 1)], ids=["gqa", "mqa"])
def test_grads_gqa_mqa(device, dtype, causal, heads, deterministic, request):
    if deterministic:
        request.getfixturevalue("poison")  # NaN-filled allocations, deterministic backward
    hq, hkv = heads
    q = randn((2, 33, hq, 40), dtype, device)
    k, v = randn((2, 57, hkv, 40), dtype, device), randn((2, 57, hkv, 40), dtype, device)
    check_flash(q, k, v, dout=randn(q.shape, dtype, device), causal=causal, deterministic=deterministic)


@pytest.mark.parametrize(
    "layout,dout_layout",
    [("transposed", "strided_last"), ("sliced", "transposed"), ("strided_last", "sliced"), ("expanded", "transposed")],
)
def test_grads_noncontiguous(device, dtype, layout, dout_layout):
    q = make_bshd(2, 37, 4, 32, dtype, device, layout)
    k = make_bshd(2, 51, 2, 32, dtype, device, "transposed" if layout == "expanded" else layout)
    v = make_bshd(2, 51, 2, 32, dtype, device, layout)
    dout = make_bshd(2, 37, 4, 32, dtype, device, dout_layout)
    check_flash(q, k, v, dout=dout, causal=True)


@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize(
    "case",
    [(40, 13, (-1, -1), True), (30, 10, (1, 3), False), (64, 3, (2, 0), False)],
    ids=["causal_q40k13", "window1_3_q30k10", "window2_0_q64k3"],
)
def test_grads_fully_masked_rows(device, dtype, case):
    sq, sk, window, causal = case
    q = randn((2, sq, 4, 32), dtype, device)
    k, v = randn((2, sk, 2, 32), dtype, device), randn((2, sk, 2, 32), dtype, device)
    res = check_flash(q, k, v, dout=randn(q.shape, dtype, device), causal=causal, window_size=window)
    from flashattn_ext.reference import visible_mask

    wr = 0 if causal else window[1]
    vis = visible_mask(sq, sk, window[0], wr, sk - sq).to(device)
    dead_q, unseen_k = ~vis.any(dim=1), ~vis.any(dim=0)
    assert dead_q.any()
    for name in ("dq", "dk", "dv"):
        assert torch.isfinite(res[name]).all(), f"{name} has NaN/inf"
    assert (res["dq"][:, dead_q] == 0).all(), "queries that see no key get zero dq"
    if unseen_k.any():
        assert (res["dk"][:, unseen_k] == 0).all() and (res["dv"][:, unseen_k] == 0).all()


@pytest.mark.dtypes(torch.float32, torch.bfloat16, torch.float16)
@pytest.mark.parametrize("window", [(0, 0), (5, 3), (16, -1), (-1, 7)], ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("seqlens", [(50, 93), (93, 50)], ids=lambda s: f"q{s[0]}k{s[1]}")
def test_grads_window(device, dtype, window, seqlens):
    sq, sk = seqlens
    q = randn((1, sq, 2, 32), dtype, device)
    k, v = randn((1, sk, 2, 32), dtype, device), randn((1, sk, 2, 32), dtype, device)
    check_flash(q, k, v, dout=randn(q.shape, dtype, device), window_size=window)


def test_grads_large_logits(device, dtype):
    q, k = randn((1, 97, 2, 64), dtype, device, 8.0), randn((1, 150, 2, 64), dtype, device, 8.0)
    v = randn((1, 150, 2, 64), dtype, device)
    check_flash(q, k, v, dout=randn(q.shape, dtype, device), causal=True)


def test_grads_accumulate_into_existing(device, dtype):
    """Autograd adds our gradients to .grad already there (and to both uses of a shared tensor)."""
    x = randn((1, 20, 2, 16), dtype, device).requires_grad_()
    out = flashattn_ext.flash_attn_func(x, x, x, causal=True)
    (g,) = torch.autograd.grad(out, x, torch.ones_like(out))
    x.grad = torch.full_like(x, 1.5)
    flashattn_ext.flash_attn_func(x, x, x, causal=True).backward(torch.ones_like(out))
    torch.testing.assert_close(x.grad, g + 1.5)


@pytest.mark.dtypes(torch.float64)
@pytest.mark.parametrize(
    "kw",
    [{}, {"causal": True}, {"window_size": (2, 1)}, {"causal": True, "softmax_scale": 0.7}],
    ids=["full", "causal", "window", "causal_scale"],
)
def test_gradcheck(device, dtype, kw):
    """The backward is the derivative of the forward (finite differences, float64)."""
    q = randn((1, 5, 4, 8), dtype, device).requires_grad_()
    k = randn((1, 7, 2, 8), dtype, device).requires_grad_()
    v = randn((1, 7, 2, 8), dtype, device).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda q, k, v: flashattn_ext.flash_attn_func(q, k, v, **kw), (q, k, v), fast_mode=True
    )


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
def test_race_backward_deterministic(dtype, heads):
    """deterministic=True: gradients bitwise equal over repeated runs."""
    hq, hkv = heads
    q = randn((2, 1000, hq, 128), dtype, "cuda").requires_grad_()
    k = randn((2, 1100, hkv, 128), dtype, "cuda").requires_grad_()
    v = randn((2, 1100, hkv, 128), dtype, "cuda").requires_grad_()
    dout = randn(q.shape, dtype, "cuda")

    def grads():
        out = flashattn_ext.flash_attn_func(q, k, v, causal=True, deterministic=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    ref = grads()
    for _ in range(30):
        for a, b in zip(grads(), ref):
            assert torch.equal(a, b)
