"""flashattn_ext.scaled_dot_product_attention as a drop-in for torch's: same
layout and semantics (top-left causal, default scale, enable_gqa), a view as
output, one-time warnings on every fallback, torch's errors on invalid input,
and a small transformer block that gives the same outputs and gradients."""

import contextlib
import math
import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import KernelCalls, assert_rule, compute_dtype, randn, sdpa_ref

import flashattn_ext
from flashattn_ext import FlashAttnFallbackWarning, _ops
from flashattn_ext import scaled_dot_product_attention as sdpa
from flashattn_ext.reference import visible_mask
from flashattn_ext.tolerance import floor_for, recomputation_terms


@contextlib.contextmanager
def no_fallback():
    """A fallback warning becomes an error: the kernels must run."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlashAttnFallbackWarning)
        yield


def check_sdpa(q, k, v, dout=None, mask_grad=False, **kw):
    """Ours vs the oracle (rule), no fallback; returns (out, grads). mask_grad:
    the float attn_mask requires grad too, and its gradient is checked (the
    last of grads)."""
    mask = kw.pop("attn_mask", None)
    oracle, naive = {}, {}
    names = ("dq", "dk", "dv", "dmask") if mask_grad else ("dq", "dk", "dv")
    for upcast, res in ((True, oracle), (False, naive)):
        dt = compute_dtype(q.dtype, upcast)
        leaves = [x.detach().to(dt).requires_grad_(dout is not None) for x in (q, k, v)]
        m = mask
        if mask_grad:
            m = mask.detach().to(dt if upcast else mask.dtype).requires_grad_()
            leaves.append(m)
        out = sdpa_ref(*leaves[:3], upcast=upcast, attn_mask=m, **kw)
        res["out"] = out.detach()
        if dout is not None:
            for name, g in zip(names, torch.autograd.grad(out, leaves, dout.to(dt))):
                res[name] = g
    leaves = [x.detach().requires_grad_(dout is not None) for x in (q, k, v)]
    m = mask
    if mask_grad:
        m = mask.detach().requires_grad_()
        leaves.append(m)
    with no_fallback():
        out = sdpa(*leaves[:3], attn_mask=m, **kw)
    assert out.shape == oracle["out"].shape and out.dtype == q.dtype
    # The rule as check_attention applies it: the floor at the logits' magnitude, the
    # recomputation backward's terms for the gradients.
    max_logit, extra = _recompute_terms(q, k, v, dout if dout is not None else out, out, mask, **kw)
    floor = floor_for(q.dtype, max_logit)
    assert_rule(out, oracle["out"], naive["out"], floor=floor)
    grads = None
    if dout is not None:
        grads = torch.autograd.grad(out, leaves, dout)
        grad_scale = max(oracle[name].abs().max().item() for name in ("dq", "dk", "dv"))
        for name, g in zip(names, grads):
            assert g.shape == oracle[name].shape and g.dtype == leaves[names.index(name)].dtype, name
            assert_rule(g, oracle[name], naive[name], 3.0, name, floor, grad_scale, extra.get(name, 0.0))
    return out, grads


def _recompute_terms(q, k, v, dout, out, mask, is_causal=False, scale=None, enable_gqa=False):
    """(max |logit|, the recomputation backward's error terms) of
    tolerance.recomputation_terms for an SDPA call: (b, h, L, E) inputs, or
    (N, L, E) taken as N heads."""

    def bshd(x):
        return (x.unsqueeze(0) if x.dim() == 3 else x).transpose(1, 2)

    n_q, n_k = q.shape[-2], k.shape[-2]
    visible = visible_mask(n_q, n_k, -1, 0 if is_causal else -1, 0, q.device)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return recomputation_terms(bshd(q), bshd(k), bshd(v), bshd(dout), bshd(out), scale, visible, attn_mask=mask)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "lens", [(1, 1), (1, 17), (17, 1), (17, 113), (113, 17), (64, 64)], ids=lambda s: f"L{s[0]}S{s[1]}"
)
def test_matches_oracle(device, dtype, is_causal, lens):
    L, S = lens
    q, k, v = (
        randn((2, 3, L, 32), dtype, device),
        randn((2, 3, S, 32), dtype, device),
        randn((2, 3, S, 32), dtype, device),
    )
    check_sdpa(q, k, v, is_causal=is_causal)


@pytest.mark.parametrize("lens", [(5, 12), (12, 5)], ids=lambda s: f"L{s[0]}S{s[1]}")
def test_causal_top_left_like_torch(device, dtype, lens):
    """is_causal with L != S: query i sees keys 0..i (torch), not FlashAttention's bottom-right."""
    L, S = lens
    q, k, v = (
        randn((1, 2, L, 16), dtype, device),
        randn((1, 2, S, 16), dtype, device),
        randn((1, 2, S, 16), dtype, device),
    )
    out, _ = check_sdpa(q, k, v, is_causal=True)
    if device == "cpu" or dtype in (torch.float16, torch.bfloat16):
        torch_out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        tol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
        torch.testing.assert_close(out, torch_out, rtol=tol, atol=tol)
    # Row 0 attends to key 0 only: its output is v[..., 0, :].
    torch.testing.assert_close(out[:, :, 0], v[:, :, 0], rtol=0, atol=0)


@pytest.mark.parametrize(
    "heads,gqa",
    [((4, 4), False), ((6, 2), True), ((6, 1), True), ((6, 1), False)],
    ids=["mha", "gqa", "mqa_gqa", "mqa_broadcast"],
)
def test_gqa(device, dtype, heads, gqa):
    hq, hkv = heads
    q = randn((2, hq, 20, 32), dtype, device)
    k, v = randn((2, hkv, 27, 32), dtype, device), randn((2, hkv, 27, 32), dtype, device)
    out, _ = check_sdpa(q, k, v, is_causal=True, enable_gqa=gqa)
    kw = {"enable_gqa": True} if gqa else {}
    torch.testing.assert_close(
        out.float(), F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw).float(), rtol=2e-2, atol=2e-2
    )


@pytest.mark.parametrize("scale", [None, 0.05, 1.0])
def test_scale(device, dtype, scale):
    q, k, v = (randn((1, 2, 9, 24), dtype, device) for _ in range(3))
    check_sdpa(q, k, v, scale=scale)


def test_grads(device, dtype):
    q = randn((2, 4, 33, 40), dtype, device)
    k, v = randn((2, 2, 47, 40), dtype, device), randn((2, 2, 47, 40), dtype, device)
    check_sdpa(q, k, v, dout=randn(q.shape, dtype, device), is_causal=True, enable_gqa=True)


@pytest.mark.dtypes(torch.float32, torch.float16)
def test_output_is_view_without_copies(device, dtype):
    q = randn((2, 4, 10, 16), dtype, device)
    k = randn((2, 12, 4, 16), dtype, device).transpose(1, 2)  # (B, H, S, E) view of a (B, S, H, E) buffer
    v = randn((2, 4, 12, 16), dtype, device)
    with KernelCalls() as spy:
        out = sdpa(q, k, v, is_causal=True)
    assert out.shape == (2, 4, 10, 16)
    assert out.transpose(1, 2).is_contiguous(), "a (B, H, L, E) view of a (B, L, H, E) buffer"
    ((name, (sq, sk, sv, *args)),) = spy.calls
    assert name == "fwd"
    for a, b in ((sq, q), (sk, k), (sv, v)):
        assert a.data_ptr() == b.data_ptr() and a.shape == b.transpose(1, 2).shape, "inputs reach the kernels as views"
    assert tuple(args) == (1.0 / math.sqrt(16), -1, 0, False)  # scale, window (-1, 0), top-left


def test_rank3(device, dtype):
    q, k, v = randn((3, 11, 16), dtype, device), randn((3, 7, 16), dtype, device), randn((3, 7, 16), dtype, device)
    out, _ = check_sdpa(q, k, v, is_causal=True)
    assert out.shape == (3, 11, 16)


@pytest.mark.dtypes(torch.float32, torch.float16)
def test_deterministic_follows_torch_setting(device, dtype, monkeypatch):
    seen = []
    real = _ops.attention
    monkeypatch.setattr(_ops, "attention", lambda *a: seen.append(a[7]) or real(*a))  # deterministic
    q = randn((1, 1, 4, 8), dtype, device)
    prev = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        sdpa(q, q, q)
        torch.use_deterministic_algorithms(True, warn_only=True)
        sdpa(q, q, q)
    finally:
        torch.use_deterministic_algorithms(prev)
    assert seen == [False, True]


# ----------------------------------------------------------------------------- attn_mask in the kernels


def _masks(kind, b, h, lq, lk, dtype, device):
    """torch SDPA masks of every form the kernels read in place."""
    if kind == "bool_padding":  # (B, 1, 1, S): a key padding mask, one sequence of no keys
        m = torch.rand(b, 1, 1, lk, device=device) > 0.3
        m[-1] = False
        return m
    if kind == "bool_full":  # (B, H, L, S), some rows fully masked
        m = torch.rand(b, h, lq, lk, device=device) > 0.5
        m[:, :, lq // 2] = False
        return m
    if kind == "bool_2d":
        return torch.rand(lq, lk, device=device) > 0.2
    if kind == "float_heads":  # (1, H, L, S) in the query's dtype (a relative position bias)
        return randn((1, h, lq, lk), dtype, device)
    if kind == "float32_batch":  # (B, 1, L, S) float32 for any query dtype
        return randn((b, 1, lq, lk), torch.float32, device) * 2
    if kind == "float_minus_inf":  # -inf hides keys, and whole rows
        m = randn((b, h, lq, lk), dtype, device)
        m = m.masked_fill(torch.rand(b, h, lq, lk, device=device) > 0.6, float("-inf"))
        m[:, :, 0] = float("-inf")
        return m
    if kind == "finfo_min":  # Hugging Face's additive form (every row sees key 0)
        m = torch.zeros(b, 1, lq, lk, dtype=dtype, device=device)
        m = m.masked_fill(torch.rand(b, 1, lq, lk, device=device) > 0.5, torch.finfo(dtype).min)
        m[..., 0] = 0
        return m
    if kind == "transposed":  # a (S, L) buffer read through strides
        return randn((b, h, lk, lq), dtype, device).transpose(-1, -2)
    if kind == "expanded":  # stride 0 on batch, heads and queries
        return (torch.rand(1, 1, 1, lk, device=device) > 0.3).expand(b, h, lq, lk)
    raise ValueError(kind)


MASK_KINDS = [
    "bool_padding",
    "bool_full",
    "bool_2d",
    "float_heads",
    "float32_batch",
    "float_minus_inf",
    "finfo_min",
    "transposed",
    "expanded",
]


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize(
    "lens", [(1, 1), (17, 113), (113, 17), (130, 200), (160, 600)], ids=lambda s: f"L{s[0]}S{s[1]}"
)
def test_attn_mask_matches_oracle(device, dtype, kind, lens):
    # (160, 600): full query tiles over several groups of four key tiles, which
    # the CPU forward takes as spans, the mask applied over each span.
    L, S = lens
    b, h, e = 2, 3, 32
    mask = _masks(kind, b, h, L, S, dtype, device)
    if mask.dtype.is_floating_point and mask.dtype not in (torch.float32, dtype):
        pytest.skip("torch takes a float mask of the query's dtype or float32")
    q, k, v = randn((b, h, L, e), dtype, device), randn((b, h, S, e), dtype, device), randn((b, h, S, e), dtype, device)
    assert flashattn_ext.sdpa_fallback_reason(q, k, v, attn_mask=mask) is None
    check_sdpa(q, k, v, dout=randn(q.shape, dtype, device), attn_mask=mask)


def test_attn_mask_row_hidden_by_finfo_min_averages_its_keys(device, dtype):
    # torch's arithmetic absorbs the scores into finfo.min: the row is the mean
    # of its values (its gradient is not exact: the README's limitations).
    q, k, v = (
        randn((1, 2, 6, 16), dtype, device),
        randn((1, 2, 9, 16), dtype, device),
        randn((1, 2, 9, 16), dtype, device),
    )
    mask = torch.zeros(6, 9, dtype=dtype, device=device)
    mask[2] = torch.finfo(dtype).min
    check_sdpa(q, k, v, attn_mask=mask)
    if torch.finfo(dtype).min < -1e30:  # float16's -65504 leaves the scores their differences
        with no_fallback():
            out = sdpa(q, k, v, attn_mask=mask)
        atol = 2e-2 if dtype.itemsize == 2 else 1e-5
        torch.testing.assert_close(out[:, :, 2].float(), v.float().mean(2), atol=atol, rtol=0)


@pytest.mark.parametrize("kind", ["padding", "document", "float_heads"])
def test_attn_mask_long_sequences(device, dtype, kind):
    """seqlen 4160 (% 128 == 64, where cuDNN's masked backward gave NaN in 2026):
    tiles the mask leaves alone, hides and cuts through (the CUDA kernels' summary)."""
    if device == "cpu":
        pytest.skip(
            "CUDA only: the CPU kernels have no summary, and the oracle's (4160, 4160) scores take seconds there"
        )
    n, h, e = 4160, 2, 64
    if kind == "padding":
        mask = (torch.arange(n, device=device) < torch.tensor([n, 3000], device=device)[:, None])[:, None, None]
    elif kind == "document":
        doc = torch.arange(n, device=device) // 1040
        mask = (doc[:, None] == doc[None, :]) & (torch.rand(n, n, device=device) > 0.01)
    else:
        mask = randn((1, h, n, n), dtype, device)
    q, k, v = (randn((2, h, n, e), dtype, device) for _ in range(3))
    check_sdpa(q, k, v, dout=randn(q.shape, dtype, device), attn_mask=mask)


def _bias16(form, b, h, lq, lk, dtype, device):
    """16-bit float biases in the layouts the Hopper forward copies into shared
    memory a key block at a time (keys contiguous, rows 16-byte aligned:
    hopper/fwd_sm90_bias_stage.cuh), and one it must read element by element."""
    if form == "batch":  # (B, 1, L, S), S a multiple of 8
        return randn((b, 1, lq, lk), dtype, device)
    if form == "heads":  # (1, H, L, S), a relative position bias
        return randn((1, h, lq, lk), dtype, device)
    if form == "rows_broadcast":  # (B, 1, 1, S): row stride 0, with -inf keys
        m = randn((b, 1, 1, lk), dtype, device)
        return m.masked_fill(torch.rand(b, 1, 1, lk, device=device) > 0.8, float("-inf"))
    if form == "ragged_keys":  # S not a multiple of 8 inside rows of a multiple of 8: the last chunk zero-filled
        return randn((b, h, lq, lk + 8 - lk % 8), dtype, device)[..., : lk - 3]
    if form == "odd_rows":  # row stride odd: not 16-byte aligned, the element loads
        return randn((b, 1, lq, lk + 1), dtype, device)[..., :lk]
    raise ValueError(form)


@pytest.mark.dtypes(torch.float16, torch.bfloat16)
@pytest.mark.parametrize("form", ["batch", "heads", "rows_broadcast", "ragged_keys", "odd_rows"])
@pytest.mark.parametrize("e", [64, 128, 256])
def test_attn_mask_16bit_bias_layouts_match_oracle(device, dtype, form, e):
    """A 16-bit float bias over several key blocks and query tiles, ragged ends
    on both axes, in each layout (the Hopper forward's shared-memory path and
    its element loads)."""
    b, h, lq, lk = 2, 2, 200, 328
    mask = _bias16(form, b, h, lq, lk, dtype, device)
    lk = mask.shape[-1]
    q, k, v = (
        randn((b, h, lq, e), dtype, device),
        randn((b, h, lk, e), dtype, device),
        randn((b, h, lk, e), dtype, device),
    )
    assert flashattn_ext.sdpa_fallback_reason(q, k, v, attn_mask=mask) is None
    check_sdpa(q, k, v, dout=randn(q.shape, dtype, device), attn_mask=mask)


@pytest.mark.dtypes(torch.float32, torch.bfloat16)
def test_attn_mask_gqa_rank3_and_scale(device, dtype):
    q = randn((2, 8, 40, 64), dtype, device)
    k, v = randn((2, 2, 70, 64), dtype, device), randn((2, 2, 70, 64), dtype, device)
    mask = torch.rand(2, 1, 40, 70, device=device) > 0.4
    check_sdpa(q, k, v, dout=randn(q.shape, dtype, device), attn_mask=mask, enable_gqa=True, scale=0.3)
    q3, k3, v3 = randn((3, 11, 16), dtype, device), randn((3, 7, 16), dtype, device), randn((3, 7, 16), dtype, device)
    out, _ = check_sdpa(q3, k3, v3, attn_mask=randn((3, 11, 7), dtype, device))  # (B, L, S) with rank-3 inputs
    assert out.shape == (3, 11, 16)


@pytest.mark.dtypes(torch.float32, torch.bfloat16)
def test_attn_mask_reaches_the_kernels_in_place(device, dtype):
    q, k, v = (randn((2, 4, 24, 16), dtype, device) for _ in range(3))
    mask = (torch.rand(1, 1, 1, 24, device=device) > 0.5).expand(2, 4, 24, 24)
    with KernelCalls() as spy:
        sdpa(q.requires_grad_(), k, v, attn_mask=mask).sum().backward()
    names = [name for name, _ in spy.calls]
    assert names == ["fwd", "bwd"]
    for _, args in spy.calls:
        m = args[-1]
        assert m.data_ptr() == mask.data_ptr() and m.stride() == mask.stride(), "no copy, no expansion"


# The float masks whose gradient the kernels return: (name, shape as (B, H, L, S)
# with 1 where the mask broadcasts, dtype: "q" for the query's, or float32).
MASK_GRAD_KINDS = {
    "full": ((2, 3, None, None), "q"),  # one bias per (batch, head)
    "heads": ((1, 3, None, None), "q"),  # T5's relative position bias: summed over the batch
    "batch_f32": ((2, 1, None, None), torch.float32),  # summed over the heads
    "2d_f32": ((None, None), torch.float32),  # (L, S): summed over batch and heads
    "keys": ((2, 1, 1, None), "q"),  # a padding bias (B, 1, 1, S): summed over heads and queries
    "per_query": ((1, 3, None, 1), "q"),  # broadcast over the keys
}


def _grad_mask(kind, b, h, lq, lk, dtype, device):
    shape, mdt = MASK_GRAD_KINDS[kind]
    full = {0: b, 1: h, 2: lq, 3: lk} if len(shape) == 4 else {0: lq, 1: lk}
    sizes = [full[i] if s is None else s for i, s in enumerate(shape)]
    return randn(sizes, dtype if mdt == "q" else mdt, device)


@pytest.mark.parametrize("kind", list(MASK_GRAD_KINDS))
@pytest.mark.parametrize("lens", [(1, 1), (17, 113), (113, 17), (130, 200)], ids=lambda s: f"L{s[0]}S{s[1]}")
def test_attn_mask_gradient_matches_oracle(device, dtype, kind, lens):
    L, S = lens
    b, h, e = 2, 3, 32
    mask = _grad_mask(kind, b, h, L, S, dtype, device)
    q, k, v = randn((b, h, L, e), dtype, device), randn((b, h, S, e), dtype, device), randn((b, h, S, e), dtype, device)
    assert flashattn_ext.sdpa_fallback_reason(q, k, v, attn_mask=mask.requires_grad_()) is None
    check_sdpa(q, k, v, dout=randn(q.shape, dtype, device), mask_grad=True, attn_mask=mask)


def _random_call(case, dtype, device):
    """A call drawn from the combinations the drop-in takes: rank 3 or 4, GQA /
    MQA, lengths that differ both ways, head dims that are not powers of two,
    transposed or sliced views, causal, a given scale, a mask of any broadcast
    shape, dtype and strides (expanded, transposed) with dead rows and -inf, its
    gradient. The structure comes from `case` (the same every run), the values
    from the test's seed (fresh every run)."""
    rng = random.Random(case)
    b, h, lq, lk = rng.choice([1, 2, 3]), rng.choice([1, 2, 4]), rng.choice([1, 7, 17, 64]), rng.choice([1, 5, 31, 64])
    e = rng.choice([8, 12, 33, 64, 100])
    hk = rng.choice([d for d in (1, 2, 4) if h % d == 0])
    rank3 = rng.random() < 0.2
    if rank3:  # (N, L, E): N plays the heads, no GQA
        h = hk = 1
    kw = {"enable_gqa": True} if hk != h else {}
    kw["scale"] = rng.choice([None, None, 0.3, 0.0, -0.5])

    def make(shape):
        x = randn(shape, dtype, device)
        layout = rng.choice(["contiguous", "transposed", "sliced"])
        if layout == "transposed":  # a (.., E, L) buffer seen as (.., L, E)
            return randn(shape[:-2] + (shape[-1], shape[-2]), dtype, device).transpose(-1, -2)
        if layout == "sliced":  # a wider head dim, sliced
            return randn(shape[:-1] + (shape[-1] + 3,), dtype, device)[..., : shape[-1]]
        return x

    lead = (b,) if rank3 else (b, h)
    lead_kv = (b,) if rank3 else (b, hk)
    q, k, v = make(lead + (lq, e)), make(lead_kv + (lk, e)), make(lead_kv + (lk, e))
    mask_grad = False
    if rng.random() < 0.3:
        kw["is_causal"] = True
    elif rng.random() < 0.7:
        full = lead + (lq, lk)
        rank = rng.randint(2, len(full))
        shape = tuple(n if rng.random() < 0.6 else 1 for n in full[len(full) - rank :])
        kind = rng.choice(["bool", "float32", "query"])
        if kind == "bool":
            mask = torch.rand(shape, device=device) < 0.75
            if shape[-2] > 1:
                mask[..., rng.randrange(shape[-2]), :] = False  # a dead row: zeros
        else:
            mask = randn(shape, torch.float32 if kind == "float32" else dtype, device)
            if rng.random() < 0.5:
                mask = mask.masked_fill(torch.rand(shape, device=device) < 0.2, float("-inf"))
            mask_grad = rng.random() < 0.5 and mask.isfinite().all().item()
        if rng.random() < 0.3:  # an expanded (stride-0) view of a smaller mask
            mask = mask[..., :1, :].expand(mask.shape)
        elif rng.random() < 0.3:  # a transposed view
            mask = mask.transpose(-1, -2).contiguous().transpose(-1, -2)
        kw["attn_mask"] = mask
    return q, k, v, mask_grad, kw


@pytest.mark.parametrize("case", range(24))
def test_random_calls_match_oracle(device, dtype, case):
    """Random combinations (_random_call) against the oracle by the rule,
    forward and backward, the mask's gradient when it requires one; the
    kernels run every one of them (no fallback)."""
    q, k, v, mask_grad, kw = _random_call(case, dtype, device)
    check_sdpa(q, k, v, dout=randn(q.shape, dtype, device), mask_grad=mask_grad, **kw)


def _document_mask(n, lens, device):
    """A block-diagonal (n, n) bool mask of packed documents of the given lengths."""
    doc = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
    return doc[:, None] == doc[None, :]


@pytest.mark.dtypes(torch.bfloat16)
@pytest.mark.parametrize("e", [64, 128, 256])
@pytest.mark.parametrize("float_mask", [False, True], ids=["bool", "float_grad"])
def test_attn_mask_hidden_tiles_skipped_exactly(device, dtype, e, float_mask):
    """The kernels skip the tiles a mask hides outright (csrc/cuda/mask_skip.cuh,
    TileScoreMod::hides on the CPU):
    documents of unequal lengths (tiles hidden, mixed and visible), a band of
    queries that sees no key (a tile with no visible block: zeros, lse -inf),
    GQA (several query heads a key block), and a float mask's gradient, against
    the oracle; torch's deterministic mode (a hidden step still passes its dQ
    turn) bitwise reproducible."""
    n = 1104  # keys a whole number of 16-key summary entries: its 16-byte loads (mask_summary.cu)
    allowed = _document_mask(n, [300, 64, 500, 240], device)
    allowed[640:770] = False  # queries that see no key
    q = randn((2, 4, n, e), dtype, device)
    k, v = randn((2, 2, n, e), dtype, device), randn((2, 2, n, e), dtype, device)
    dout = randn(q.shape, dtype, device)
    if float_mask:
        mask = torch.zeros(n, n, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))
        check_sdpa(q, k, v, dout=dout, mask_grad=True, attn_mask=mask.requires_grad_(), enable_gqa=True)
    else:
        check_sdpa(q, k, v, dout=dout, attn_mask=allowed, enable_gqa=True)
    prev = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        runs = []
        for _ in range(2):
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            out = sdpa(qq, kk, vv, attn_mask=allowed, enable_gqa=True)
            runs.append((out, *torch.autograd.grad(out, (qq, kk, vv), dout)))
    finally:
        torch.use_deterministic_algorithms(prev)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.dtypes(torch.float32, torch.bfloat16)
def test_attn_mask_gradient_through_views_gqa_and_scale(device, dtype):
    # An expanded view that requires grad (stride 0 on batch and heads: the op
    # gets the full shape, torch's expand sums), hidden keys, GQA and a scale.
    q = randn((2, 4, 40, 64), dtype, device)
    k, v = randn((2, 2, 70, 64), dtype, device), randn((2, 2, 70, 64), dtype, device)
    base = randn((1, 1, 40, 70), dtype, device).masked_fill(torch.rand(40, 70, device=device) > 0.7, float("-inf"))
    base.requires_grad_()
    mask = base.expand(2, 4, 40, 70)
    out = sdpa(q, k, v, attn_mask=mask, enable_gqa=True, scale=0.3)
    (g,) = torch.autograd.grad(out, base, torch.ones_like(out))
    grads = {}
    for upcast in (True, False):  # the oracle, and the naive baseline of the tolerance rule
        dt = compute_dtype(dtype, upcast)
        b = base.detach().to(dt).requires_grad_()
        ref = sdpa_ref(
            *(x.to(dt) for x in (q, k, v)), upcast=upcast, attn_mask=b.expand(2, 4, 40, 70), enable_gqa=True, scale=0.3
        )
        (grads[upcast],) = torch.autograd.grad(ref, b, torch.ones_like(ref))
    assert g.shape == base.shape and g.dtype == dtype
    assert torch.isfinite(g).all() and (g[torch.isinf(base.detach())] == 0).all()
    assert_rule(g, grads[True], grads[False], 3.0, "dmask")


@pytest.mark.cuda
@pytest.mark.dtypes(torch.bfloat16)
def test_attn_mask_gradient_deterministic_is_bitwise(device, dtype):
    # torch's deterministic mode: the mask's gradient written once per element
    # and summed by torch (a broadcast mask), not added by atomics.
    q, k, v = (randn((2, 4, 300, 64), dtype, device) for _ in range(3))
    mask = randn((1, 4, 300, 300), dtype, device).requires_grad_()
    grads = []
    prev = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        for _ in range(3):
            out = sdpa(q, k, v, attn_mask=mask)
            grads.append(torch.autograd.grad(out, mask, torch.ones_like(out))[0])
    finally:
        torch.use_deterministic_algorithms(prev)
    assert all(torch.equal(grads[0], g) for g in grads[1:])


@pytest.mark.dtypes(torch.float32)
def test_attn_mask_gradient_runs_its_own_kernel_only_when_asked(device, dtype):
    q, k, v = (randn((1, 2, 24, 16), dtype, device).requires_grad_() for _ in range(3))
    mask = randn((24, 24), dtype, device)
    for requires_grad, name in ((False, "bwd"), (True, "bwd_mask_grad")):
        with KernelCalls() as spy:
            sdpa(q, k, v, attn_mask=mask.detach().requires_grad_(requires_grad)).sum().backward()
        assert [n for n, _ in spy.calls] == ["fwd", name]


@pytest.mark.dtypes(torch.float16)
def test_attn_mask_errors_name_the_argument(device, dtype):
    q = randn((1, 5, 2, 16), dtype, device)  # (batch, seqlen, heads, dim): the op's layout
    scale = 0.25

    def call(mask, softcap=0.0):
        return _ops.attention(q, q, q, scale, -1, -1, False, False, False, softcap, None, mask)

    with pytest.raises(ValueError, match="attn_mask of shape .* does not broadcast"):
        call(torch.zeros(3, 5, 5, device=device))
    with pytest.raises(ValueError, match="cannot be combined with softcap"):
        call(torch.zeros(5, 5, device=device), softcap=30.0)
    with pytest.raises(TypeError, match="attn_mask must be bool, float32 or the dtype of q"):
        call(torch.zeros(5, 5, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="attn_mask is on"):
        call(torch.zeros(5, 5, dtype=dtype, device="meta"))
    with pytest.raises(TypeError, match="only a floating-point attn_mask has a gradient"):
        _ops.bwd_mask_grad(
            q,
            q,
            q,
            q,
            q,
            torch.zeros(1, 2, 5, device=device),
            scale,
            -1,
            -1,
            False,
            False,
            torch.ones(5, 5, dtype=torch.bool, device=device),
        )


def test_attn_mask_under_vmap_and_compile():
    q, k, v = (randn((3, 2, 4, 9, 16), torch.float32, "cpu") for _ in range(3))
    masks = torch.rand(3, 9, 9) > 0.3  # one mask per vmapped entry
    out = torch.func.vmap(lambda a, b, c, m: sdpa(a, b, c, attn_mask=m))(q, k, v, masks)
    ref = torch.stack([sdpa_ref(q[i], k[i], v[i], attn_mask=masks[i]) for i in range(3)]).float()
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=0)
    compiled = torch.compile(lambda a, b, c, m: sdpa(a, b, c, attn_mask=m), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q[0], k[0], v[0], masks[0]), ref[0], atol=2e-6, rtol=0)


# ----------------------------------------------------------------------------- fallbacks


def _fallback_cases(device, dtype):
    q = randn((2, 4, 9, 16), dtype, device)
    k, v = randn((2, 4, 13, 16), dtype, device), randn((2, 4, 13, 16), dtype, device)
    return {
        "value_head_dim": ((q, k, randn((2, 4, 13, 24), dtype, device)), {}, "value head dim"),
        "rank5": ((q[None], k[None], v[None]), {}, "rank"),
        "batch_broadcast": ((q, k[:1], v[:1]), {}, "batch sizes"),
        "head_dim_512": (tuple(randn((1, 2, 5, 512), dtype, device) for _ in range(3)), {}, "head dim 512"),
    }


CASES = [
    "value_head_dim",
    "rank5",
    "batch_broadcast",
    "head_dim_512",
]


@pytest.mark.parametrize("case", CASES)
def test_fallback_warns_once_and_matches_torch(device, dtype, case):
    args, kw, reason = _fallback_cases(device, dtype)[case]
    assert reason in flashattn_ext.sdpa_fallback_reason(*args, **kw)
    with pytest.warns(FlashAttnFallbackWarning, match=reason) as record:
        out = sdpa(*args, **kw)
    assert record[0].filename == __file__, "the warning points at the caller"
    expected = F.scaled_dot_product_attention(*args, **kw)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlashAttnFallbackWarning)
        sdpa(*args, **kw)  # the second time: no warning


@pytest.mark.parametrize(
    "shapes",
    [
        ((0, 2, 4, 8), (0, 2, 5, 8)),
        ((1, 2, 0, 8), (1, 2, 5, 8)),
        ((1, 2, 4, 8), (1, 2, 0, 8)),
        ((2, 0, 4, 8), (2, 0, 5, 8)),
    ],
    ids=["batch0", "queries0", "keys0", "heads0"],
)
def test_zero_sizes_behave_as_torch(device, dtype, shapes):
    """Zero batch, heads or lengths: torch's empty output, or zeros without keys
    (and zero gradients), from our path, with no fallback."""
    sq, sk = shapes
    q, k, v = randn(sq, dtype, device), randn(sk, dtype, device), randn(sk, dtype, device)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    with no_fallback():
        out = sdpa(*leaves, is_causal=sq[2] == sk[2])
    shape = (*sq[:3], sk[3])
    # torch's own SDPA as the reference where it answers: its CPU path dies of
    # a division by zero on zero heads (not called), and 2.11's CUDA path
    # returns None for a zero batch (the H200, session 12).
    if sq[1] > 0:
        expected = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach())
        assert expected is None and device == "cuda" and sq[0] == 0 or expected.shape == shape
    assert out.shape == shape and out.dtype == q.dtype
    assert (out == 0).all()
    grads = torch.autograd.grad(out.sum(), leaves)
    assert all(g.shape == x.shape and (g == 0).all() for g, x in zip(grads, leaves))
    out_faf = flashattn_ext.flash_attn_func(*(x.detach().transpose(1, 2) for x in (q, k, v)))
    assert out_faf.shape == (shape[0], shape[2], shape[1], shape[3]) and (out_faf == 0).all()


def test_attn_mask_with_is_causal_is_left_to_torch(device, dtype):
    """torch decides what a mask together with is_causal means (2.11's CPU path
    applies both, 2.15 raises): the same answer or the same error, with the
    one-time warning when torch answers."""
    q, k, v = (randn((2, 4, 9, 16), dtype, device) for _ in range(3))
    mask = torch.rand(9, 9, device=device) > 0.3
    mask[:, 0] = True
    assert "is_causal" in flashattn_ext.sdpa_fallback_reason(q, k, v, attn_mask=mask, is_causal=True)
    try:
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    except RuntimeError as e:
        with pytest.raises(RuntimeError, match="attn_mask"):
            sdpa(q, k, v, attn_mask=mask, is_causal=True)
        assert "attn_mask" in str(e)
        return
    with pytest.warns(FlashAttnFallbackWarning, match="is_causal"):
        out = sdpa(q, k, v, attn_mask=mask, is_causal=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_dropout_runs_the_kernels(device, dtype):
    """Dropout is no fallback reason on either device: the kernels apply it
    (their results against the oracle: tests/test_dropout.py)."""
    q, k, v = (randn((2, 4, 9, 16), dtype, device) for _ in range(3))
    assert flashattn_ext.sdpa_fallback_reason(q, k, v, dropout_p=0.2) is None


@pytest.mark.cuda
def test_fallback_float32_on_cuda():
    q, k, v = (randn((1, 2, 9, 16), torch.float32, "cuda") for _ in range(3))
    with pytest.warns(FlashAttnFallbackWarning, match="float32"):
        out = sdpa(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


def test_eligible_has_no_reason(device, dtype):
    q, k, v = (randn((1, 2, 9, 16), dtype, device) for _ in range(3))
    assert flashattn_ext.sdpa_fallback_reason(q, k, v, is_causal=True) is None


@pytest.mark.parametrize("enable_gqa", [False, True])
def test_fast_path_takes_only_what_the_rules_admit(device, dtype, enable_gqa):
    """The drop-in's fast test (interface._fast_eligible, a few attribute reads
    on the common call) admits no call that the full rules
    (sdpa_fallback_reason) refuse: over ranks, empty and int32-sized dims, head
    counts with and without GQA, head dims, mixed dtypes and a non-strided layout."""
    from flashattn_ext.interface import _fast_eligible

    shapes = [
        ((2, 4, 5, 16), (2, 4, 7, 16)),
        ((2, 4, 5, 16), (2, 2, 7, 16)),
        ((2, 4, 5, 16), (2, 3, 7, 16)),
        ((2, 4, 5, 16), (2, 1, 7, 16)),
        ((2, 4, 5, 16), (2, 0, 7, 16)),
        ((0, 4, 5, 16), (0, 4, 7, 16)),
        ((2, 4, 0, 16), (2, 4, 7, 16)),
        ((2, 4, 5, 16), (2, 4, 0, 16)),
        ((2, 4, 5, 16), (1, 4, 7, 16)),
        ((2, 4, 5, 16), (2, 4, 7, 8)),
        ((2, 4, 5, 300), (2, 4, 7, 300)),
        ((5, 16), (7, 16)),
        ((4, 5, 16), (4, 7, 16)),
    ]
    admitted = 0
    for qs, ks in shapes:
        q, k = randn(qs, dtype, device), randn(ks, dtype, device)
        for v in (randn(ks, dtype, device), randn(ks, torch.float64, device), randn(ks[:-1] + (3,), dtype, device)):
            if _fast_eligible(q, k, v, enable_gqa):
                admitted += 1
                assert flashattn_ext.sdpa_fallback_reason(q, k, v, enable_gqa=enable_gqa) is None, (qs, ks, v.shape)
    assert admitted >= (3 if enable_gqa else 2)  # the plain and MQA calls, and GQA with enable_gqa
    sparse = randn((2, 4, 5, 16), dtype, device).to_sparse() if device == "cpu" and dtype != torch.float16 else None
    if sparse is not None:
        assert not _fast_eligible(sparse, sparse, sparse, enable_gqa)


def _error_cases(device):
    f32 = torch.float32 if device == "cpu" else torch.float16
    q = randn((2, 4, 9, 16), f32, device)
    k, v = randn((2, 4, 13, 16), f32, device), randn((2, 4, 13, 16), f32, device)
    k2, v2 = randn((2, 2, 13, 16), f32, device), randn((2, 2, 13, 16), f32, device)
    k3, v3 = randn((2, 3, 13, 16), f32, device), randn((2, 3, 13, 16), f32, device)
    return {
        "dtype_mismatch": ((q, k.double(), v), {}),
        "key_head_dim": ((q, randn((2, 4, 13, 8), f32, device), v), {}),
        "gqa_without_flag": ((q, k2, v2), {}),
        "gqa_not_divisible": ((q, k3, v3), {"enable_gqa": True}),
        "int_dtype": ((q.int(), k.int(), v.int()), {}),
    }


def test_key_head_dim_mismatch_raises(device):
    """torch 2.11's CUDA SDPA crashes the process on this input, so the wrapper
    rejects it itself instead of handing it over."""
    args, kw = _error_cases(device)["key_head_dim"]
    with pytest.raises(RuntimeError, match="key has head dim 8 but query has head dim 16"):
        sdpa(*args, **kw)


@pytest.mark.parametrize(
    "shapes", [((2, 4, 9, 16), (2, 0, 13, 16), (2, 0, 13, 16)), ((4, 9, 16), (0, 13, 16), (2, 13, 16))]
)
def test_gqa_without_key_heads_raises(device, shapes):
    """torch 2.11 divides by the key / value head count under enable_gqa=True
    and dies of SIGFPE when it is zero, so the wrapper rejects it itself."""
    dt = torch.float32 if device == "cpu" else torch.float16
    q, k, v = (randn(s, dt, device) for s in shapes)
    with pytest.raises(RuntimeError, match="needs at least one key/value head"):
        sdpa(q, k, v, enable_gqa=True)


@pytest.mark.parametrize("case", ["dtype_mismatch", "gqa_without_flag", "gqa_not_divisible", "int_dtype"])
def test_invalid_inputs_raise_like_torch(device, case):
    args, kw = _error_cases(device)[case]
    with pytest.raises(Exception) as torch_err:
        F.scaled_dot_product_attention(*args, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlashAttnFallbackWarning)  # no warning before torch's error
        with pytest.raises(type(torch_err.value)) as our_err:
            sdpa(*args, **kw)
    assert str(our_err.value) == str(torch_err.value)


@pytest.mark.parametrize("lens", [(13, 5), (5, 13)])
def test_key_value_length_mismatch_raises(device, lens):
    """torch 2.11's CPU flash backend returns an answer for this invalid input; we raise."""
    dt = torch.float32 if device == "cpu" else torch.float16
    q = randn((2, 4, 9, 16), dt, device)
    k, v = randn((2, 4, lens[0], 16), dt, device), randn((2, 4, lens[1], 16), dt, device)
    with pytest.raises(RuntimeError, match="key and value must share their sequence length"):
        sdpa(q, k, v)


# ----------------------------------------------------------------------------- a model


class TinyBlock(torch.nn.Module):
    """Pre-norm transformer block (causal self-attention with GQA + MLP)."""

    def __init__(self, dim=64, heads=4, kv_heads=2, attn=F.scaled_dot_product_attention):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.hd)
        self.proj = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
        self.attn = attn

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.hd, self.kv_heads * self.hd, self.kv_heads * self.hd], -1
        )
        q = q.view(b, n, self.heads, self.hd).transpose(1, 2)
        k = k.view(b, n, self.kv_heads, self.hd).transpose(1, 2)
        v = v.view(b, n, self.kv_heads, self.hd).transpose(1, 2)
        a = self.attn(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, -1))
        return x + self.mlp(self.norm2(x))


def test_tiny_transformer_block(device, dtype):
    """Swapping torch's attention for ours: same outputs and parameter gradients,
    within the rule against a float64/float32 copy of the block."""
    torch_block = TinyBlock().to(device=device, dtype=dtype)
    hi = compute_dtype(dtype)
    blocks = {
        "ours": TinyBlock(attn=sdpa),
        "oracle": TinyBlock(attn=lambda *a, **kw: sdpa_ref(*a, upcast=False, **kw)),  # the whole block in `hi`
        "naive": TinyBlock(attn=lambda *a, **kw: sdpa_ref(*a, upcast=False, **kw)),
    }
    for name, blk in blocks.items():
        blk.load_state_dict(torch_block.state_dict())
        blk.to(device=device, dtype=hi if name == "oracle" else dtype)
    x = randn((2, 37, 64), dtype, device)
    dy = randn((2, 37, 64), dtype, device)
    res = {}
    for name, blk in list(blocks.items()) + [("torch", torch_block)]:
        xin = x.detach().to(hi if name == "oracle" else dtype).requires_grad_()
        with no_fallback():
            y = blk(xin)
            y.backward(dy.to(y.dtype))
        res[name] = [y.detach(), xin.grad] + [p.grad for p in blk.parameters()]
    names = ["y", "dx"] + [n for n, _ in torch_block.named_parameters()]
    for i, n in enumerate(names):
        assert_rule(res["ours"][i], res["oracle"][i], res["naive"][i], 2.0 if i == 0 else 3.0, n)
        # and torch's own SDPA lands within the same bound (sanity of the oracle block)
        assert_rule(res["torch"][i], res["oracle"][i], res["naive"][i], 2.0 if i == 0 else 3.0, "torch " + n)


# ----------------------------------------------------------------------------- decode route (issue #10 item 3)
# On CUDA the forward runs a short query against many keys (a model's decode
# step) on the split-KV decoding kernels of fwd_kvcache: its own choice
# (csrc/cuda/decode_launch.h decode_route), made in C++ from the shapes, so
# that the drop-in's call costs no more host time than any other. The result
# and what the backward gets (out, lse) are those of the main forward.


def _decode_inputs(device, dtype, b, hq, hk, lq, sk, d, kv_view=False):
    q = randn((b, 1, hq, d), dtype, device).transpose(1, 2)  # a model's projection: (B, L, H, E) seen as (B, H, L, E)
    if lq != 1:
        q = randn((b, hq, lq, d), dtype, device)
    if kv_view:
        k, v = (randn((b, sk, hk, d), dtype, device).transpose(1, 2) for _ in range(2))
    else:
        k, v = (randn((b, hk, sk, d), dtype, device) for _ in range(2))
    return q, k, v


def _ran_decode_kernels(fn):
    from helpers import cuda_kernel_names

    names = cuda_kernel_names(fn)
    return any("flash_decode" in n for n in names), names


DECODE_CUDA_SHAPES = [
    (1, 32, 8, 1, 8192, 128),
    (4, 32, 8, 1, 3000, 128),
    (2, 16, 4, 4, 777, 64),
    (3, 8, 8, 1, 1024, 128),
    (1, 8, 1, 16, 100, 256),
    (2, 6, 2, 1, 300, 60),  # a head dim the kernels pad (a copy, as on the main path)
]


@pytest.mark.cuda
@pytest.mark.parametrize("gqa", [True, False], ids=["enable_gqa", "no_gqa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", DECODE_CUDA_SHAPES, ids=lambda s: "b{}_h{}-{}_q{}_k{}_d{}".format(*s))
def test_decode_route_cuda_matches_oracle(dtype, gqa, shape):
    """The drop-in at decode shapes on CUDA runs the decoding kernels and matches
    the oracle, forward and (inputs requiring grad) backward from their out and lse."""
    b, hq, hk, lq, sk, d = shape
    if not gqa:  # same heads, or torch's broadcast of one key/value head
        hk = hq if hk != 1 else 1
    if d > flashattn_ext.interface._CUDA_MAX_HEAD_DIM:
        pytest.skip(f"head dim {d} not in this build")
    q, k, v = _decode_inputs("cuda", dtype, b, hq, hk, lq, sk, d, kv_view=sk % 2 == 1)
    out, _ = check_sdpa(q, k, v, dout=randn(q.shape, dtype, "cuda"), enable_gqa=gqa)
    assert out.transpose(1, 2).is_contiguous(), "a (B, H, L, E) view of a (B, L, H, E) buffer, as the main path"
    ran, names = _ran_decode_kernels(lambda: sdpa(q, k, v, enable_gqa=gqa))
    assert ran, names


@pytest.mark.cuda
@pytest.mark.parametrize(
    "kw,routed",
    [
        ({}, True),
        ({"is_causal": True}, False),  # torch's top-left causal: query i sees keys 0..i only
        ({"dropout_p": 0.5}, False),
        ({"attn_mask": "bool"}, False),
    ],
    ids=["plain", "causal_top_left", "dropout", "mask"],
)
def test_decode_route_cuda_which_calls(kw, routed):
    """Only calls whose result the decoding kernels give take them; the others
    (checked against the oracle elsewhere) keep the main forward."""
    q, k, v = _decode_inputs("cuda", torch.bfloat16, 2, 8, 2, 1, 512, 64)
    kw = dict(kw)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(2, 1, 1, 512, device="cuda") > 0.3
    if "dropout_p" not in kw and "attn_mask" not in kw:
        check_sdpa(q, k, v, enable_gqa=True, **kw)
    ran, names = _ran_decode_kernels(lambda: sdpa(q, k, v, enable_gqa=True, **kw))
    assert ran is routed, names


@pytest.mark.cuda
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (100, 0), (37, 5)], ids=["none", "causal", "w100", "w37_5"])
@pytest.mark.parametrize("lq", [1, 3, 16])
def test_decode_route_cuda_flash_attn_func(window, lq):
    """flash_attn_func's short queries (causal and windows aligned bottom-right,
    as the decoding kernels') and softcap run there too, forward and backward."""
    from flashattn_ext import flash_attn_func
    from flashattn_ext.tolerance import check_attention

    b, hq, hk, sk, d = 2, 8, 2, 600, 128
    q, k, v = (
        randn(s, torch.bfloat16, "cuda").requires_grad_() for s in ((b, lq, hq, d), (b, sk, hk, d), (b, sk, hk, d))
    )
    causal = window == (-1, 0)
    kw = dict(causal=causal, window_size=(-1, -1) if causal else window, softcap=30.0)
    out, lse = flash_attn_func(q, k, v, return_lse=True, **kw)
    dout = randn(out.shape, out.dtype, "cuda")
    grads = torch.autograd.grad(out, (q, k, v), dout)
    checks = check_attention(q.detach(), k.detach(), v.detach(), out, lse, dout=dout, grads=grads, **kw)
    assert all(c.ok for c in checks), [str(c) for c in checks if not c.ok]
    with torch.no_grad():
        ran, names = _ran_decode_kernels(lambda: flash_attn_func(q, k, v, **kw))
    assert ran, names


@pytest.mark.cuda
def test_decode_route_cuda_disable_switch(monkeypatch):
    """FLASHATTN_DISABLE_DECODE_ROUTE=1 keeps the call on the main forward (the timing switch), same result."""
    q, k, v = _decode_inputs("cuda", torch.bfloat16, 1, 32, 8, 1, 4096, 128)
    routed = sdpa(q, k, v, enable_gqa=True)
    monkeypatch.setenv("FLASHATTN_DISABLE_DECODE_ROUTE", "1")
    ran, names = _ran_decode_kernels(lambda: sdpa(q, k, v, enable_gqa=True))
    assert not ran, names
    torch.testing.assert_close(sdpa(q, k, v, enable_gqa=True), routed, atol=2e-2, rtol=2e-2)


def test_decode_route_compiles():
    """A decode-step call traces under torch.compile(fullgraph=True)."""
    torch._dynamo.reset()
    q, k, v = _decode_inputs("cpu", torch.float32, 2, 8, 2, 1, 300, 64)

    def step(q, k, v):
        return sdpa(q, k, v, attn_mask=None, dropout_p=0.0, scale=0.125, is_causal=False, enable_gqa=True)

    expected = step(q, k, v)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch._dynamo.reset()


@pytest.mark.parametrize("dev", ["cpu", "meta"])
def test_fwd_kvcache_bhsd(dev):
    """fwd_kvcache(bhsd=True) on (B, H, L, E) tensors is fwd_kvcache on their
    (B, L, H, E) transposes, the output a (B, H, L, E) view; not with a block table."""
    q, k, v = (randn(s, torch.float32, "cpu").to(dev) for s in ((2, 6, 3, 16), (2, 2, 40, 16), (2, 2, 40, 16)))
    lens = torch.tensor([40, 17], dtype=torch.int32, device=dev)
    out, lse = _ops.fwd_kvcache(q, k, v, lens, None, None, None, 0.25, -1, -1, 0, True)
    ref, ref_lse = _ops.fwd_kvcache(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), lens, None, None, None, 0.25, -1, -1, 0
    )
    assert out.shape == q.shape and lse.shape == ref_lse.shape and out.transpose(1, 2).is_contiguous()
    if dev == "cpu":
        assert torch.equal(out, ref.transpose(1, 2)) and torch.equal(lse, ref_lse)
    table = torch.zeros((2, 3), dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match="bhsd=True takes a contiguous"):
        _ops.fwd_kvcache(q, k, v, lens, None, None, table, 0.25, -1, -1, 0, True)
