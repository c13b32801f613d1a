"""Forward correctness of flash_attn_func against the oracle (tolerance rule of
helpers.py): dtypes, causal or not, odd sequence lengths both ways, head dims,
GQA/MQA, non-contiguous inputs, fully masked rows, large logits, sliding
windows. Outputs are poisoned (NaN-filled allocations) in every test here."""

import math

import pytest
import torch
from helpers import (
    KernelCalls,
    assert_rule,
    check_flash,
    make_bshd,
    oracle_and_naive,
    randn,
)

import flashattn_ext
from flashattn_ext import _ops

pytestmark = pytest.mark.usefixtures("poison")

SEQLENS = [(1, 1), (1, 17), (17, 1), (17, 113), (113, 17), (113, 113), (128, 257)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"q{s[0]}k{s[1]}")
def test_seqlens(device, dtype, causal, seqlens):
    sq, sk = seqlens
    q = randn((2, sq, 2, 64), dtype, device)
    k = randn((2, sk, 2, 64), dtype, device)
    v = randn((2, sk, 2, 64), dtype, device)
    check_flash(q, k, v, causal=causal)


@pytest.mark.dtypes(torch.float32, torch.bfloat16, torch.float16)
@pytest.mark.parametrize("case", [(1023, 1025, False), (1025, 1023, True)], ids=["q1023k1025", "q1025k1023-causal"])
def test_long_seqlens(device, dtype, case):
    sq, sk, causal = case
    q, k, v = (randn((1, s, 1, 64), dtype, device) for s in (sq, sk, sk))
    check_flash(q, k, v, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [8, 40, 64, 80, 96, 128, 192, 256])
def test_head_dims(device, dtype, causal, d):
    q = randn((1, 77, 2, d), dtype, device)
    k = randn((1, 131, 2, d), dtype, device)
    v = randn((1, 131, 2, d), dtype, device)
    check_flash(q, k, v, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(6, 2), (6, 1), (5, 5)], ids=["gqa", "mqa", "mha"])
def test_gqa_mqa(device, dtype, causal, heads):
    hq, hkv = heads
    q = randn((2, 33, hq, 40), dtype, device)
    k = randn((2, 45, hkv, 40), dtype, device)
    v = randn((2, 45, hkv, 40), dtype, device)
    check_flash(q, k, v, causal=causal)


@pytest.mark.parametrize("layout", ["transposed", "sliced", "strided_last", "expanded"])
def test_noncontiguous(device, dtype, layout):
    q = make_bshd(2, 37, 4, 32, dtype, device, layout)
    k = make_bshd(2, 51, 2, 32, dtype, device, "transposed" if layout == "expanded" else layout)
    v = make_bshd(2, 51, 2, 32, dtype, device, layout)
    check_flash(q, k, v, causal=True)


@pytest.mark.dtypes(torch.float32, torch.bfloat16)
def test_no_copy_unless_needed(device, dtype):
    """Views with a unit stride on head_dim reach the kernels as they are; only a
    strided head_dim is made contiguous."""
    q = make_bshd(2, 9, 4, 16, dtype, device, "transposed")
    k = make_bshd(2, 11, 2, 16, dtype, device, "sliced")
    v = make_bshd(2, 11, 2, 16, dtype, device, "strided_last")
    with KernelCalls() as spy:
        flashattn_ext.flash_attn_func(q, k, v)
    ((name, (sq, sk, sv, *_)),) = spy.calls
    assert name == "fwd"
    assert sq.data_ptr() == q.data_ptr() and sq.stride() == q.stride()
    assert sk.data_ptr() == k.data_ptr() and sk.stride() == k.stride()
    assert sv.data_ptr() != v.data_ptr() and sv.stride(-1) == 1 and sv.is_contiguous()


def test_head_dim_1_any_stride(device, dtype):
    # head_dim 1 with a non-unit stride: .contiguous() alone would not fix the stride.
    q = randn((1, 5, 2, 2), dtype, device)[..., :1]
    k = randn((1, 6, 2, 3), dtype, device)[..., 1:2]
    v = randn((1, 6, 2, 1), dtype, device)
    check_flash(q, k, v)


def _dead_rows(sq, sk, window, causal):
    from flashattn_ext.reference import visible_mask

    wl, wr = window
    if causal:
        wr = 0
    return ~visible_mask(sq, sk, wl, wr, sk - sq).any(dim=1)


# (seqlen_q, seqlen_k, window_size, causal): each leaves some query rows without any key.
MASKED_CASES = [
    (40, 13, (-1, -1), True),  # bottom-right causal, seqlen_q > seqlen_k: first 27 rows see nothing
    (30, 10, (1, 3), False),  # window entirely left of the keys for the first rows
    (20, 50, (0, 0), False),  # diagonal only: never empty (control case)
    (64, 3, (2, 0), False),  # a narrow window far from the keys for most rows
    (64, 3, (0, -1), False),  # left-only windows never empty a row bottom-right (control case)
]


@pytest.mark.parametrize("case", MASKED_CASES, ids=lambda c: f"q{c[0]}k{c[1]}w{c[2][0]}_{c[2][1]}{'c' if c[3] else ''}")
def test_fully_masked_rows(device, dtype, case):
    sq, sk, window, causal = case
    q = randn((2, sq, 3, 32), dtype, device)
    k = randn((2, sk, 3, 32), dtype, device)
    v = randn((2, sk, 3, 32), dtype, device)
    res = check_flash(q, k, v, causal=causal, window_size=window)
    dead = _dead_rows(sq, sk, window, causal).to(device)
    out, lse = res["out"], res["lse"]
    assert (out[:, dead] == 0).all(), "rows that see no key must be exactly 0"
    assert torch.isneginf(lse[:, :, dead]).all(), "rows that see no key must have lse -inf"
    assert torch.isfinite(lse[:, :, ~dead]).all()
    if case[:3] in ((20, 50, (0, 0)), (64, 3, (0, -1))):
        assert not dead.any()
    else:
        assert dead.any()


@pytest.mark.parametrize("kind", ["scaled_inputs", "large_scale", "one_hot_peak"])
def test_large_logits(device, dtype, kind):
    d = 64
    if kind == "scaled_inputs":
        # logits of std ~64 (float16's naive matmul stays far below its 65504 max)
        q, k = randn((1, 97, 2, d), dtype, device, 8.0), randn((1, 150, 2, d), dtype, device, 8.0)
        kw = {}
    elif kind == "large_scale":
        q, k = randn((1, 97, 2, d), dtype, device), randn((1, 150, 2, d), dtype, device)
        kw = {"softmax_scale": 30.0}
    else:
        # every query far closer to one key than the others: a near one-hot softmax with logits ~1e3
        q = randn((1, 97, 2, d), dtype, device)
        k = torch.cat([q.float() * 4, torch.randn(1, 53, 2, d, device=device)], dim=1).to(dtype)
        kw = {"softmax_scale": 4.0}
    v = randn((1, k.shape[1], 2, d), dtype, device)
    res = check_flash(q, k, v, causal=True, **kw)
    assert torch.isfinite(res["lse"]).all()


WINDOWS = [(0, 0), (5, 3), (16, -1), (-1, 7), (0, -1), (3, 0), (10**6, 10**6)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(71, 71), (50, 93), (93, 50)], ids=lambda s: f"q{s[0]}k{s[1]}")
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.dtypes(torch.float32, torch.bfloat16, torch.float16)
def test_sliding_window(device, dtype, causal, seqlens, window):
    sq, sk = seqlens
    q = randn((1, sq, 2, 32), dtype, device)
    k = randn((1, sk, 2, 32), dtype, device)
    v = randn((1, sk, 2, 32), dtype, device)
    check_flash(q, k, v, causal=causal, window_size=window)


def test_causal_is_window_right_0(device, dtype):
    q = randn((1, 30, 2, 16), dtype, device)
    k = randn((1, 45, 2, 16), dtype, device)
    v = randn((1, 45, 2, 16), dtype, device)
    f = flashattn_ext.flash_attn_func
    torch.testing.assert_close(f(q, k, v, causal=True), f(q, k, v, window_size=(-1, 0)), rtol=0, atol=0)
    torch.testing.assert_close(
        f(q, k, v, causal=True, window_size=(4, 9)), f(q, k, v, window_size=(4, 0)), rtol=0, atol=0
    )
    torch.testing.assert_close(f(q, k, v), f(q, k, v, window_size=(100, 100)), rtol=0, atol=0)


def test_causal_bottom_right(device):
    """seqlen_q < seqlen_k: the last query sees every key; the first sees keys 0..sk-sq."""
    dtype = torch.float32 if device == "cpu" else torch.float16
    sq, sk = 3, 8
    q = randn((1, sq, 1, 16), dtype, device)
    k = randn((1, sk, 1, 16), dtype, device)
    v = randn((1, sk, 1, 16), dtype, device)
    out = flashattn_ext.flash_attn_func(q, k, v, causal=True).float()
    # Row 0 equals full attention over keys 0..5.
    row0 = flashattn_ext.reference.attention_ref(q[:, :1], k[:, :6], v[:, :6]).float()
    torch.testing.assert_close(out[:, :1], row0, rtol=2e-3, atol=2e-3)
    last = flashattn_ext.reference.attention_ref(q[:, -1:], k, v).float()
    torch.testing.assert_close(out[:, -1:], last, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("scale", [None, 0.01, 1.0, 0.3])
def test_softmax_scale(device, dtype, scale):
    q = randn((2, 19, 2, 24), dtype, device)
    k = randn((2, 23, 2, 24), dtype, device)
    v = randn((2, 23, 2, 24), dtype, device)
    check_flash(q, k, v, softmax_scale=scale)


def test_return_lse_shape_and_no_grad(device, dtype):
    q = randn((2, 7, 4, 16), dtype, device).requires_grad_()
    k = randn((2, 9, 2, 16), dtype, device).requires_grad_()
    v = randn((2, 9, 2, 16), dtype, device).requires_grad_()
    out = flashattn_ext.flash_attn_func(q, k, v)
    assert torch.is_tensor(out) and out.shape == q.shape
    out, lse = flashattn_ext.flash_attn_func(q, k, v, return_lse=True)
    assert lse.shape == (2, 4, 7)
    assert out.requires_grad and not lse.requires_grad  # lse carries no gradient


@pytest.mark.dtypes(torch.float64)
def test_float64_accuracy(device, dtype):
    """float64 inputs should give float64-accurate results (error ~1e-13)."""
    q = randn((1, 50, 2, 40), dtype, device)
    k = randn((1, 60, 2, 40), dtype, device)
    v = randn((1, 60, 2, 40), dtype, device)
    oracle, naive = oracle_and_naive(q, k, v)
    out = flashattn_ext.flash_attn_func(q, k, v)
    assert_rule(out, oracle["out"], naive["out"], floor=1e-12)


@pytest.mark.dtypes(torch.float32, torch.float16)
def test_deterministic_flag_reaches_the_op(device, dtype, monkeypatch):
    seen = []
    real = _ops.attention

    def spy(*args):
        seen.append(args[-1])
        return real(*args)

    monkeypatch.setattr(_ops, "attention", spy)
    q = randn((1, 4, 1, 8), dtype, device)
    torch.use_deterministic_algorithms(False)
    flashattn_ext.flash_attn_func(q, q, q)
    flashattn_ext.flash_attn_func(q, q, q, deterministic=True)
    torch.use_deterministic_algorithms(True, warn_only=True)
    flashattn_ext.flash_attn_func(q, q, q)
    assert seen == [False, True, True]


def test_dropout_zeroes_dead_rows(device, dtype):
    """Rows that see no key are zero with dropout too (the kernels, no
    warning, lse -inf there)."""
    import warnings

    q = randn((1, 10, 1, 8), dtype, device)
    k = randn((1, 4, 1, 8), dtype, device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", flashattn_ext.FlashAttnFallbackWarning)
        out, lse = flashattn_ext.flash_attn_func(q, k, k, dropout_p=0.5, causal=True, return_lse=True)
    assert bool((lse[..., :6] == -math.inf).all())
    assert (out[:, :6] == 0).all() and torch.isfinite(out).all()


# ----------------------------------------------------------------------------- GPU only


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_race_forward(dtype, causal):
    """The same inputs 100 times: bitwise-equal outputs and lse (a difference is a race)."""
    q = randn((2, 1000, 4, 128), dtype, "cuda")
    k = randn((2, 1100, 2, 128), dtype, "cuda")
    v = randn((2, 1100, 2, 128), dtype, "cuda")
    out0, lse0 = flashattn_ext.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    for _ in range(100):
        out, lse = flashattn_ext.flash_attn_func(q, k, v, causal=causal, return_lse=True)
        assert torch.equal(out, out0) and torch.equal(lse, lse0)


@pytest.mark.cuda
def test_big_grid():
    """batch * heads = 70000 > 65535: grids must not overflow a 16-bit dimension."""
    dtype = torch.float16
    q = randn((1, 16, 70000, 32), dtype, "cuda")
    k = randn((1, 16, 70000, 32), dtype, "cuda")
    v = randn((1, 16, 70000, 32), dtype, "cuda")
    dout = randn((1, 16, 70000, 32), dtype, "cuda")
    check_flash(q, k, v, dout=dout, causal=True)
    # and along batch
    q, k, v, dout = (x.reshape(70000, 16, 1, 32) for x in (q, k, v, dout))
    check_flash(q, k, v, dout=dout)


# ----------------------------------------------------------------------------- softcap, ALiBi
# flash-attn's score modifications (csrc/flash_params.h ScoreMod) against the
# oracle (reference.attention_ref), forward and backward under the one rule.


def _slopes(shape, device):
    return (torch.rand(shape, dtype=torch.float32) * 0.4 + 0.05).to(device)


def _score_mod(mod, b, h, device):
    return {
        "softcap": lambda: dict(softcap=1.5),
        "alibi-h": lambda: dict(alibi_slopes=_slopes((h,), device)),
        "alibi-bh": lambda: dict(alibi_slopes=_slopes((b, h), device)),
        "both-h": lambda: dict(softcap=2.0, alibi_slopes=_slopes((h,), device)),
        "both-bh": lambda: dict(softcap=0.7, alibi_slopes=_slopes((b, h), device)),
    }[mod]()


# (seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, mask kwargs): both
# alignments of unequal lengths, GQA / MQA, windows, a decoding shape (one query,
# many keys: the key split) and blocks of 64+ rows (the brgemm path's full tiles).
SCORE_MOD_SHAPES = {
    "q37k70-causal-gqa": (37, 70, 4, 2, 64, dict(causal=True)),
    "q70k37-full": (70, 37, 2, 2, 32, {}),
    "q37k70-full-mqa": (37, 70, 4, 1, 64, {}),
    "q130k200-window": (130, 200, 2, 1, 64, dict(window_size=(32, 16))),
    "q129k129-causal-window": (129, 129, 2, 2, 128, dict(causal=True, window_size=(40, -1))),
    "q1k300-decode": (1, 300, 4, 1, 64, dict(causal=True)),
    "q5k300-decode-full": (5, 300, 2, 2, 64, {}),
}


@pytest.mark.dtypes(torch.float32, torch.bfloat16)
@pytest.mark.parametrize("mod", ["softcap", "alibi-h", "alibi-bh", "both-h", "both-bh"])
@pytest.mark.parametrize("shape", list(SCORE_MOD_SHAPES))
def test_score_mod(device, dtype, shape, mod):
    sq, sk, hq, hkv, d, kw = SCORE_MOD_SHAPES[shape]
    q, k, v = (
        randn((2, sq, hq, d), dtype, device),
        randn((2, sk, hkv, d), dtype, device),
        randn((2, sk, hkv, d), dtype, device),
    )
    dout = randn((2, sq, hq, d), dtype, device)
    check_flash(q, k, v, dout, **kw, **_score_mod(mod, 2, hq, device))


@pytest.mark.parametrize("mod", ["softcap", "both-bh"])
def test_score_mod_dtypes(device, dtype, mod):
    q, k, v = (randn((2, s, 2, 64), dtype, device) for s in (45, 77, 77))
    check_flash(q, k, v, randn((2, 45, 2, 64), dtype, device), causal=True, **_score_mod(mod, 2, 2, device))


@pytest.mark.dtypes(torch.float32, torch.bfloat16)
def test_softcap_large_logits(device, dtype):
    # Logits far beyond the cap: tanh saturates, the scores stay within +-softcap.
    q, k, v = (randn((1, s, 2, 64), dtype, device, scale=4.0) for s in (50, 90, 90))
    check_flash(q, k, v, randn((1, 50, 2, 64), dtype, device), softcap=3.0)


@pytest.mark.dtypes(torch.float32)
def test_score_mod_oracle_can_fail(device, dtype):
    # The mods change the answer: the plain oracle rejects them, and each one matters.
    q, k, v = (randn((2, s, 2, 32), dtype, device) for s in (20, 30, 30))
    slopes = _slopes((2, 2), device)
    out, lse = flashattn_ext.flash_attn_func(q, k, v, softcap=0.5, alibi_slopes=slopes, return_lse=True)
    from flashattn_ext.tolerance import check_attention

    assert all(c.ok for c in check_attention(q, k, v, out, lse, softcap=0.5, alibi_slopes=slopes))
    assert not all(c.ok for c in check_attention(q, k, v, out, lse))
    assert not all(c.ok for c in check_attention(q, k, v, out, lse, softcap=0.5))
    assert not all(c.ok for c in check_attention(q, k, v, out, lse, alibi_slopes=slopes))
    assert not all(c.ok for c in check_attention(q, k, v, out, lse, softcap=0.5, alibi_slopes=slopes[0]))


@pytest.mark.dtypes(torch.float32)
def test_score_mod_slopes_get_no_gradient(device, dtype):
    q, k, v = (randn((2, 9, 2, 16), dtype, device).requires_grad_() for _ in range(3))
    slopes = _slopes((2,), device).requires_grad_()
    flashattn_ext.flash_attn_func(q, k, v, alibi_slopes=slopes, softcap=1.0).sum().backward()
    assert slopes.grad is None
    assert q.grad is not None and k.grad is not None and v.grad is not None


@pytest.mark.dtypes(torch.float32)
def test_score_mod_packed_functions(device, dtype):
    qkv = randn((2, 19, 3, 2, 32), dtype, device)
    slopes = _slopes((2, 2), device)
    out = flashattn_ext.flash_attn_qkvpacked_func(qkv, causal=True, softcap=1.0, alibi_slopes=slopes)
    q, k, v = qkv.unbind(2)
    ref = flashattn_ext.flash_attn_func(q, k, v, causal=True, softcap=1.0, alibi_slopes=slopes)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    kv = torch.stack((k, v), dim=2)
    out = flashattn_ext.flash_attn_kvpacked_func(q, kv, causal=True, softcap=1.0, alibi_slopes=slopes)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.dtypes(torch.float32)
def test_score_mod_opcheck(device, dtype):
    # Schema, fake kernel (the meta validation), autograd registration with the new arguments.
    q, k, v = (randn((1, s, 2, 16), dtype, device).requires_grad_() for s in (7, 11, 11))
    slopes = _slopes((1, 2), device)
    args = (q, k, v, 0.25, -1, 0, True, False, False, 1.5, slopes)
    torch.library.opcheck(
        _ops.attention, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration")
    )


_SCORE_MOD_ERRORS = [
    (dict(softcap=-1.0), ValueError, "softcap must be a finite number >= 0"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(alibi_slopes=[0.1, 0.2]), TypeError, "alibi_slopes"),
    (dict(alibi_slopes=torch.ones(2, dtype=torch.float16)), TypeError, r"alibi_slopes must have dtype torch.float32"),
    (dict(alibi_slopes=torch.ones(2, dtype=torch.float64)), TypeError, r"alibi_slopes.float\(\)"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes must have shape \(nheads,\) = \(2,\)"),
    (dict(alibi_slopes=torch.ones(3, 2)), ValueError, r"\(batch, nheads\) = \(2, 2\)"),
    (dict(alibi_slopes=torch.ones(2, 2, 1)), ValueError, "alibi_slopes must have shape"),
    # (made on the device: .to() of a strided CPU tensor would be contiguous)
    (dict(alibi_slopes=lambda dev: torch.ones(2, 4, device=dev)[:, ::2]), ValueError, r"alibi_slopes.contiguous\(\)"),
]


@pytest.mark.parametrize("kw, exc, match", _SCORE_MOD_ERRORS, ids=lambda x: None)
def test_score_mod_errors(device, kw, exc, match):
    q, k, v = (randn((2, 5, 2, 16), torch.float32 if device == "cpu" else torch.float16, device) for _ in range(3))
    kw = {
        key: (x.to(device) if isinstance(x, torch.Tensor) else x(device) if callable(x) else x) for key, x in kw.items()
    }
    with pytest.raises(exc, match=match):
        flashattn_ext.flash_attn_func(q, k, v, **kw)


def test_score_mod_errors_device_and_dropout(device):
    q, k, v = (randn((2, 5, 2, 16), torch.float32 if device == "cpu" else torch.float16, device) for _ in range(3))
    with pytest.raises(ValueError, match=r"alibi_slopes is on meta.*alibi_slopes.to\(q.device\)"):
        flashattn_ext.flash_attn_func(q, k, v, alibi_slopes=torch.ones(2, device="meta"))
    # The kernels take dropout with the score mods (tests/test_dropout.py).
    assert flashattn_ext.flash_attn_func(q, k, v, dropout_p=0.1, softcap=1.0).shape == q.shape
