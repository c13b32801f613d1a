"""The one tolerance rule (flashattn_ext.tolerance) on known inputs: the naive
low-precision computation passes it, results that are wrong by a little more
than rounding fail it, and so do NaNs, a wrong -inf pattern of lse and a
shifted mask. (The kernels are checked with it everywhere else.)"""

import pytest
import torch

from flashattn_ext.reference import attention_ref
from flashattn_ext.tolerance import (
    FLOOR,
    GRAD_FACTOR,
    OUT_FACTOR,
    check_attention,
    compare,
    compare_lse,
    floor_for,
    max_err,
    recomputation_terms,
    ulp_at,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _inputs(dtype, b=2, nq=37, nk=53, hq=4, hk=2, d=32):
    q = torch.randn(b, nq, hq, d).to(dtype)
    k = torch.randn(b, nk, hk, d).to(dtype)
    v = torch.randn(b, nk, hk, d).to(dtype)
    return q, k, v


def _naive(q, k, v, dout, **kw):
    """The naive computation in the inputs' own precision, as a 'kernel'."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = attention_ref(*leaves, upcast=False, return_lse=True, **kw)
    grads = torch.autograd.grad(out, leaves, dout)
    lse_acc = attention_ref(q, k, v, return_lse=True, **kw)[1].to(
        torch.float64 if q.dtype == torch.float64 else torch.float32
    )
    return out.detach(), lse_acc, grads


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("causal", [False, True])
def test_naive_low_precision_passes(dtype, causal):
    q, k, v = _inputs(dtype)
    dout = torch.randn_like(q)
    out, lse, grads = _naive(q, k, v, dout, causal=causal)
    comps = check_attention(q, k, v, out, lse, dout, grads, causal=causal)
    assert [c.name for c in comps] == ["out", "lse", "dq", "dk", "dv"]
    assert all(c.ok for c in comps), [c.message() for c in comps if not c.ok]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_small_errors_fail(dtype):
    q, k, v = _inputs(dtype)
    dout = torch.randn_like(q)
    out, lse, grads = _naive(q, k, v, dout)
    # The output off by 3x the bound in one element.
    c = check_attention(q, k, v, out, lse)[0]
    bad = out.clone()
    bad[1, 7, 2, 5] += 3 * c.bound
    comps = check_attention(q, k, v, bad, lse)
    assert not comps[0].ok and comps[1].ok, comps[0].message()
    assert "max error" in comps[0].message() and ">" in comps[0].message()
    # A gradient off by 3x its bound.
    dk_bound = check_attention(q, k, v, out, lse, dout, grads)[3].bound
    dk = grads[1].clone()
    dk[0, 3, 1, 4] -= 3 * dk_bound
    comps = check_attention(q, k, v, out, lse, dout, (grads[0], dk, grads[2]))
    assert [c.name for c in comps if not c.ok] == ["dk"]


def test_mask_and_lse_mistakes_fail():
    q, k, v = _inputs(torch.float32, nq=53, nk=37)
    out_tl, lse_tl, _ = _naive(q, k, v, torch.randn_like(q), causal=True, bottom_right=False)
    # A top-left causal result judged as bottom-right (flash_attn_func's): wrong.
    comps = check_attention(q, k, v, out_tl, lse_tl, causal=True, bottom_right=True)
    assert not comps[0].ok and not comps[1].ok
    assert "-inf" in comps[1].message()
    assert all(c.ok for c in check_attention(q, k, v, out_tl, lse_tl, causal=True, bottom_right=False))
    nan_out = out_tl.clone()
    nan_out[0, 5, 1, 2] = float("nan")
    c = check_attention(q, k, v, nan_out, causal=True, bottom_right=False)[0]
    assert not c.ok and "non-finite" in c.message()
    c = compare_lse(lse_tl + 1e-3, lse_tl, torch.float32)
    assert not c.ok


def test_rule_arithmetic():
    oracle = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    naive = torch.tensor([1.001, -2.0, 0.5], dtype=torch.float32)
    ok = torch.tensor([1.0, -2.0015, 0.5], dtype=torch.float32)
    c = compare("x", ok, oracle, naive, OUT_FACTOR)
    assert c.ok and c.bound == pytest.approx(OUT_FACTOR * max_err(naive, oracle) + FLOOR[torch.float32] * 2.0)
    assert not compare("x", ok, oracle, naive, 1.0).ok
    assert compare("x", ok, oracle, naive, GRAD_FACTOR, extra=0.0).ok
    assert floor_for(torch.float32, 1e4) > FLOOR[torch.float32]  # large logits raise the floor
    assert floor_for(torch.bfloat16, 0.0) == FLOOR[torch.bfloat16]


def test_ulp_at():
    """One ulp of the dtype at a magnitude: the distance to the next value up."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for x in (0.3, 1.0, 2.5, 3.999, 100.0):
            v = torch.tensor(x, dtype=dtype).item()
            u = ulp_at(dtype, v)
            assert torch.tensor(v + u, dtype=dtype).item() == v + u  # representable: the neighbour
            assert torch.tensor(v + u / 4, dtype=dtype).item() == v  # nothing between
    assert ulp_at(torch.bfloat16, 3.0) == 2.0**-6
    assert ulp_at(torch.bfloat16, 0.0) > 0


def test_recomputation_terms_cover_a_float_mask_gradient():
    """The D = rowsum(dO * O) term of a recomputation backward: zero for the
    exact output, and for a rounded one it is what a float mask's gradient
    (dS summed over the mask's broadcast dimensions) really carries."""
    torch.manual_seed(0)
    q, k, v = _inputs(torch.float64, nq=9, nk=11)
    dout = torch.randn_like(q)
    mask = torch.randn(1, 1, 9, 11, dtype=torch.float64, requires_grad=True)
    visible = torch.ones(9, 11, dtype=torch.bool)

    def out_and_dmask(o_for_d):
        # dS from D formed with o_for_d, as a recomputation backward does
        logits = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, dim=2)) * 0.5 + mask
        p = torch.softmax(logits, dim=-1)
        dp = torch.einsum("bqhd,bkhd->bhqk", dout, v.repeat_interleave(2, dim=2))
        d = (dout * o_for_d).sum(-1).transpose(1, 2).unsqueeze(-1)
        return (p * (dp - d)).sum_to_size(mask.shape)

    exact = attention_ref(q, k, v, softmax_scale=0.5, attn_mask=mask.detach())
    rounded = exact.to(torch.bfloat16).double()
    _, exact_terms = recomputation_terms(q, k, v, dout, exact, 0.5, visible, attn_mask=mask)
    _, rounded_terms = recomputation_terms(q, k, v, dout, rounded, 0.5, visible, attn_mask=mask)
    assert exact_terms["dmask"] < 1e-12
    observed = (out_and_dmask(rounded) - out_and_dmask(exact)).abs().max().item()
    assert rounded_terms["dmask"] == pytest.approx(observed, rel=1e-9) and observed > 1e-4
    assert "dmask" not in recomputation_terms(q, k, v, dout, exact, 0.5, visible, attn_mask=visible)[1]
