"""flash-attn's softcap and ALiBi on each CUDA kernel family, against the oracle
with the tolerance rule: the Hopper TMA kernels (the default route on an H200),
the mma.sync kernels (FLASHATTN_DISABLE_SM90=1; FLASHATTN_DISABLE_TMA=1 routes a
score-mod call there too, the cp.async wgmma kernels having no score-mod
instance), the KV-cache decoding kernel and its TMA prefill route, and the
non-finite recompute (the slow path applies the score mod too). The CPU side of
the same semantics is pinned in test_score_mod.py; these cases need a GPU."""

import pytest
import torch
from helpers import assert_all, check_attention, check_flash, randn

import flashattn_ext

pytestmark = pytest.mark.cuda

ROUTES = {"tma": {}, "no_tma": {"FLASHATTN_DISABLE_TMA": "1"}, "sm80": {"FLASHATTN_DISABLE_SM90": "1"}}
MODS = {
    "softcap": dict(softcap=5.0),
    "alibi": dict(alibi=True),
    "both": dict(softcap=5.0, alibi=True),
}


def slopes_for(b, h, per_batch):
    base = torch.tensor([2 ** (-(i + 1) / 2) for i in range(h)], dtype=torch.float32, device="cuda")
    return base.expand(b, h).contiguous() * torch.rand(b, 1, device="cuda") if per_batch else base


def mod_kwargs(mod, b, h, per_batch=False):
    kw = {}
    if "softcap" in mod:
        kw["softcap"] = mod["softcap"]
    if mod.get("alibi"):
        kw["alibi_slopes"] = slopes_for(b, h, per_batch)
    return kw


@pytest.fixture(params=list(ROUTES), ids=list(ROUTES))
def route(request, monkeypatch):
    for key, value in ROUTES[request.param].items():
        monkeypatch.setenv(key, value)
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mod", list(MODS), ids=list(MODS))
@pytest.mark.parametrize("d", [64, 128, 256])
def test_fwd_bwd(route, dtype, causal, mod, d):
    b, hq, hkv, sq, sk = 2, 4, 2, 300, 333
    q, k, v = (
        randn((b, sq, hq, d), dtype, "cuda"),
        randn((b, sk, hkv, d), dtype, "cuda"),
        randn((b, sk, hkv, d), dtype, "cuda"),
    )
    dout = randn((b, sq, hq, d), dtype, "cuda")
    check_flash(q, k, v, dout, causal=causal, **mod_kwargs(MODS[mod], b, hq, per_batch=d == 128))


@pytest.mark.parametrize("mod", list(MODS), ids=list(MODS))
@pytest.mark.parametrize("window", [(64, 0), (32, 32)], ids=["w64-causal", "w32-32"])
def test_window(route, mod, window):
    b, h, s, d = 1, 2, 513, 128
    q, k, v, dout = (randn((b, s, h, d), torch.bfloat16, "cuda") for _ in range(4))
    check_flash(q, k, v, dout, window_size=window, **mod_kwargs(MODS[mod], b, h))


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_deterministic(deterministic):
    b, h, s, d = 2, 4, 640, 64
    q, k, v, dout = (randn((b, s, h, d), torch.bfloat16, "cuda") for _ in range(4))
    kw = dict(causal=True, deterministic=deterministic, **mod_kwargs(MODS["both"], b, h))
    check_flash(q, k, v, dout, **kw)
    if deterministic:
        grads = []
        for _ in range(2):
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            out = flashattn_ext.flash_attn_func(*leaves, **kw)
            grads.append(torch.autograd.grad(out, leaves, dout))
        for g0, g1 in zip(*grads):
            assert torch.equal(g0, g1)


@pytest.mark.parametrize("mod", list(MODS), ids=list(MODS))
def test_varlen(route, mod):
    lens_q, lens_k = [37, 300, 1], [90, 300, 129]
    h, d = 4, 128
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = randn((sum(lens_q), h, d), torch.bfloat16, "cuda").requires_grad_()
    k = randn((sum(lens_k), h, d), torch.bfloat16, "cuda").requires_grad_()
    v = randn((sum(lens_k), h, d), torch.bfloat16, "cuda").requires_grad_()
    dout = randn(q.shape, torch.bfloat16, "cuda")
    kw = mod_kwargs(MODS[mod], len(lens_q), h, per_batch=True)
    out = flashattn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, **kw)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    # Each sequence against the oracle on its own (its lengths: its own ALiBi offset and diagonal).
    for i in range(len(lens_q)):
        sl_q, sl_k = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        kw_i = dict(kw)
        if "alibi_slopes" in kw:
            kw_i["alibi_slopes"] = kw["alibi_slopes"][i : i + 1]
        seq = [x[sl].detach()[None] for x, sl in ((q, sl_q), (k, sl_k), (v, sl_k))]
        grads = (dq[sl_q][None], dk[sl_k][None], dv[sl_k][None])
        assert_all(
            check_attention(*seq, out[sl_q][None], None, dout[sl_q][None], grads, causal=True, **kw_i), f"seq {i}"
        )


@pytest.mark.parametrize("mod", list(MODS), ids=list(MODS))
@pytest.mark.parametrize("seqlen_q", [1, 4, 200], ids=["decode1", "decode4", "prefill200"])
def test_kvcache(mod, seqlen_q):
    b, hq, hkv, d, cap = 3, 8, 2, 128, 1024
    lens = torch.tensor([1000, 257, 600], dtype=torch.int32, device="cuda")
    q = randn((b, seqlen_q, hq, d), torch.bfloat16, "cuda")
    k_cache, v_cache = randn((b, cap, hkv, d), torch.bfloat16, "cuda"), randn((b, cap, hkv, d), torch.bfloat16, "cuda")
    kw = mod_kwargs(MODS[mod], b, hq, per_batch=True)
    out = flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True, **kw)
    for i in range(b):
        n = int(lens[i])
        kw_i = dict(kw)
        if "alibi_slopes" in kw:
            kw_i["alibi_slopes"] = kw["alibi_slopes"][i : i + 1]
        seq = (q[i : i + 1], k_cache[i : i + 1, :n], v_cache[i : i + 1, :n])
        assert_all(check_attention(*seq, out[i : i + 1], causal=True, **kw_i), f"row {i}")


@pytest.mark.parametrize("mod", list(MODS), ids=list(MODS))
def test_nonfinite_recompute(route, mod):
    """A NaN in a key row that the causal mask hides from the first queries: the
    rows that do not see it are recomputed exactly by the slow path (with the
    score mod), the others are NaN."""
    b, h, s, d = 1, 2, 200, 64
    q, k, v = (randn((b, s, h, d), torch.bfloat16, "cuda") for _ in range(3))
    v[0, 150, 0, 3] = float("nan")
    kw = mod_kwargs(MODS[mod], b, h)
    out = flashattn_ext.flash_attn_func(q, k, v, causal=True, **kw)
    assert torch.isnan(out[0, 150:, 0, 3]).all()
    assert_all(check_attention(q[:, :150], k[:, :150], v[:, :150], out[:, :150], causal=True, **kw))
