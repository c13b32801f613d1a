"""flash_attn_with_kvcache: flash-attn's signature and semantics.

The oracle here is written out plainly: copy the cache, append the new keys and
values (rotated by a plain float64 rotary), rotate q by flash-attn's rule, then
judge each batch row's output and lse with tolerance.check_attention on the
row's visible keys [cache_leftpad, cache_seqlens + seqlen_new). The in-place
update is checked separately: the written rows against the oracle's (exactly
without rotary), every other row of the cache unchanged."""

import math
import re

import pytest
import torch
from helpers import KernelCalls, cuda_kernel_names, is_sm90, randn

from flashattn_ext import flash_attn_func, flash_attn_with_kvcache
from flashattn_ext.reference import compute_dtype, kvcache_append_rotary_ref
from flashattn_ext.tolerance import check_attention

PAGE = 16


# ----------------------------------------------------------------------------- oracle


def rotary_tables(seqlen_ro, rotary_dim, dtype, device, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(seqlen_ro, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)


def rotate_ref(x, cos, sin, positions, interleaved):
    """x (n, heads, d): its first rotary_dim dims rotated, row i by the angle of
    positions[i], in float64, rounded to x's dtype. Interleaved (GPT-J): complex
    numbers x[2i] + 1j x[2i+1]; otherwise (GPT-NeoX) x[i] + 1j x[i + rotary_dim / 2]."""
    ro = 2 * cos.shape[1]
    pos = torch.as_tensor(positions, dtype=torch.long, device=x.device)
    # The tables as given (|cos + i sin| need not be 1 after rounding).
    rot = torch.complex(cos[pos].double(), sin[pos].double())[:, None, :]
    xr = x[..., :ro].double()
    if interleaved:
        z = torch.complex(xr[..., 0::2], xr[..., 1::2]) * rot
        y = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    else:
        z = torch.complex(xr[..., : ro // 2], xr[..., ro // 2 :]) * rot
        y = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((y.to(x.dtype), x[..., ro:]), dim=-1)


def oracle(q, kc, vc, k, v, seqlens, leftpad, cos=None, sin=None, interleaved=True, q_positions="flash-attn", **kw):
    """kc, vc: the logical caches of the batch rows, (batch, capacity, heads_kv, d),
    before the call. Returns (expected logical caches after the call, per-row
    (q_rot, keys, values) that the attention must see)."""
    kc, vc = kc.clone(), vc.clone()
    seqlen_q, n_new = q.shape[1], (k.shape[1] if k is not None else 0)
    local = kw.get("causal", False) or tuple(kw.get("window_size", (-1, -1))) != (-1, -1)
    rows = []
    for b in range(q.shape[0]):
        s, lp = seqlens[b], leftpad[b]
        qb = q[b]
        if n_new:
            kb = k[b]
            if cos is not None:
                kb = rotate_ref(kb, cos, sin, range(s, s + n_new), interleaved)
            kc[b, s : s + n_new] = kb
            vc[b, s : s + n_new] = v[b]
        if cos is not None:
            per_token = local if q_positions == "flash-attn" else q_positions == "per-token"
            qb = rotate_ref(qb, cos, sin, range(s, s + seqlen_q) if per_token else [s] * seqlen_q, interleaved)
        rows.append((qb, kc[b, lp : s + n_new], vc[b, lp : s + n_new]))
    return kc, vc, rows


def check_rows(out, lse, rows, alibi_slopes=None, **kw):
    """Failure messages of every batch row against the oracle (empty: all pass).
    alibi_slopes: (heads,) or (batch, heads), row b's slopes given to its check;
    the row's keys are [cache_leftpad, cache_seqlens + seqlen_new), so the oracle's
    distance i + n_keys - seqlen_q - j is flash-attn's with the row's length."""
    bad = []
    for b, (qb, kb, vb) in enumerate(rows):
        if alibi_slopes is not None:
            kw["alibi_slopes"] = alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes
        if kb.shape[0] == 0:  # no visible key: zeros, lse -inf
            if not (torch.equal(out[b], torch.zeros_like(out[b])) and torch.isneginf(lse[b]).all()):
                bad.append(f"row {b}: sees no key but out != 0 or lse != -inf")
            continue
        res = check_attention(qb[None], kb[None], vb[None], out[b][None], lse[b][None], **kw)
        bad += [f"row {b} (keys {kb.shape[0]}): {c.message()}" for c in res if not c.ok]
    return bad


def to_paged(kc, extra_blocks=3, generator=None, page=PAGE):
    """A contiguous cache (batch, capacity, h, d) as a paged one with blocks in a
    random order (and unused blocks): (paged (num_blocks, page, h, d), block_table)."""
    batch, cap, h, d = kc.shape
    per = cap // page
    num_blocks = batch * per + extra_blocks
    perm = torch.randperm(num_blocks, generator=generator)[: batch * per]
    table = perm.view(batch, per).to(torch.int32)
    paged = randn((num_blocks, page, h, d), kc.dtype, kc.device)
    paged[table.long().flatten()] = kc.reshape(batch * per, page, h, d)
    return paged, table.to(kc.device)


def logical(paged, table):
    batch, per = table.shape
    return paged[table.long().flatten()].view(batch, per * paged.shape[1], *paged.shape[2:])


# ----------------------------------------------------------------------------- cases

# batch 3; name: (seqlen_q, seqlen_new, heads_q, heads_kv, d, cache_seqlens, extras)
# extras: leftpad, batch_idx (a permutation into 5 cache rows), rotary
# (rotary_dim, interleaved), and flash_attn_with_kvcache's mask arguments.
CASES = {
    "decode-append-1-gqa": (1, 1, 4, 2, 32, [5, 0, 17], dict(causal=True)),
    "decode-no-append-mqa": (1, 0, 4, 1, 16, [5, 1, 31], {}),
    "decode-append-1-noncausal": (1, 1, 2, 2, 16, [0, 9, 30], {}),
    "spec-4-append-4-causal": (4, 4, 4, 2, 32, [3, 0, 20], dict(causal=True)),
    "spec-4-append-0-causal": (4, 0, 4, 4, 16, [4, 12, 32], dict(causal=True)),
    "spec-4-append-6-causal-mqa": (4, 6, 4, 1, 16, [0, 7, 26], dict(causal=True)),
    "spec-4-append-4-noncausal": (4, 4, 2, 2, 16, [2, 11, 28], {}),
    "window-causal": (4, 4, 4, 2, 16, [10, 3, 25], dict(causal=True, window_size=(5, 0))),
    "window-two-sided": (4, 2, 2, 1, 16, [13, 6, 22], dict(window_size=(3, 2))),
    "scale": (1, 1, 2, 2, 16, [8, 2, 16], dict(softmax_scale=0.3)),
    "leftpad": (4, 4, 4, 2, 16, [9, 3, 20], dict(leftpad=[4, 3, 1], causal=True)),
    "leftpad-decode-noncausal": (1, 2, 2, 2, 16, [7, 0, 12], dict(leftpad=[7, 0, 12])),
    "leftpad-empty-row": (1, 0, 2, 1, 16, [5, 0, 12], dict(leftpad=[5, 0, 2])),
    "batch-idx": (1, 1, 4, 2, 16, [6, 13, 2], dict(batch_idx=[3, 0, 4], causal=True)),
    "batch-idx-spec-leftpad": (4, 3, 2, 2, 16, [6, 13, 2], dict(batch_idx=[4, 1, 2], leftpad=[2, 0, 1])),
    "rotary-interleaved-causal": (4, 4, 4, 2, 32, [5, 0, 17], dict(rotary=(32, True), causal=True)),
    "rotary-neox-causal": (4, 4, 4, 2, 32, [5, 0, 17], dict(rotary=(32, False), causal=True)),
    "rotary-interleaved-noncausal": (4, 4, 2, 2, 32, [5, 9, 20], dict(rotary=(16, True))),
    "rotary-neox-noncausal-partial": (4, 2, 2, 1, 32, [5, 9, 20], dict(rotary=(16, False))),
    "rotary-decode-window": (1, 1, 4, 2, 32, [5, 1, 27], dict(rotary=(32, False), window_size=(4, 0))),
    "rotary-leftpad": (4, 4, 2, 2, 32, [9, 3, 20], dict(rotary=(32, True), leftpad=[4, 3, 1], causal=True)),
}
CAPACITY = 48  # 3 pages of 16


def setup(case, dtype, device, paged):
    seqlen_q, n_new, hq, hkv, d, seqlens, extras = CASES[case]
    extras = dict(extras)
    batch = len(seqlens)
    leftpad = extras.pop("leftpad", None)
    batch_idx = extras.pop("batch_idx", None)
    rotary = extras.pop("rotary", None)
    n_cache = 5 if batch_idx is not None else batch
    q = randn((batch, seqlen_q, hq, d), dtype, device)
    kc = randn((n_cache, CAPACITY, hkv, d), dtype, device)
    vc = randn((n_cache, CAPACITY, hkv, d), dtype, device)
    k = randn((batch, n_new, hkv, d), dtype, device) if n_new else None
    v = randn((batch, n_new, hkv, d), dtype, device) if n_new else None
    args = dict(k=k, v=v, cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=device), **extras)
    if leftpad is not None:
        args["cache_leftpad"] = torch.tensor(leftpad, dtype=torch.int32, device=device)
    if batch_idx is not None:
        args["cache_batch_idx"] = torch.tensor(batch_idx, dtype=torch.int32, device=device)
    if rotary is not None:
        cos, sin = rotary_tables(CAPACITY, rotary[0], dtype, device)
        args.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=rotary[1])
    table = None
    if paged:
        kc, table = to_paged(kc)
        vc_paged = torch.empty_like(kc).copy_(kc)  # same shape; v's data below
        vc_paged[table.long().flatten()] = vc.reshape(-1, PAGE, hkv, d)
        vc = vc_paged
        args["block_table"] = table
    return q, kc, vc, args, dict(seqlens=seqlens, leftpad=leftpad or [0] * batch, batch_idx=batch_idx)


def logical_rows(kc, vc, args, meta):
    """The logical (batch, CAPACITY, h, d) caches of the batch rows."""
    if args.get("block_table") is not None:
        return logical(kc, args["block_table"]), logical(vc, args["block_table"])
    if meta["batch_idx"] is not None:
        idx = torch.tensor(meta["batch_idx"], device=kc.device)
        return kc[idx], vc[idx]
    return kc, vc


def run_and_check(case, dtype, device, paged, expect_ok=True, score_mod=None, **oracle_overrides):
    """score_mod: flash_attn_with_kvcache's softcap / alibi_slopes, or a function
    (batch, heads_q) -> that dict."""
    q, kc, vc, args, meta = setup(case, dtype, device, paged)
    score_mod = score_mod(q.shape[0], q.shape[2]) if callable(score_mod) else dict(score_mod or {})
    kc0, vc0 = kc.clone(), vc.clone()
    lk0, lv0 = logical_rows(kc0, vc0, args, meta)
    out, lse = flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True, **args, **score_mod)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    mask_kw = {key: args[key] for key in ("causal", "window_size", "softmax_scale") if key in args}
    okw = dict(mask_kw)
    if "rotary_cos" in args:
        okw.update(cos=args["rotary_cos"], sin=args["rotary_sin"], interleaved=args["rotary_interleaved"])
    okw.update(oracle_overrides)
    ek, ev, rows = oracle(q, lk0, lv0, args["k"], args["v"], meta["seqlens"], meta["leftpad"], **okw)
    check_kw = {key: okw[key] for key in ("causal", "window_size", "softmax_scale") if key in okw}
    bad = check_rows(out, lse, rows, **check_kw, **score_mod)
    if not expect_ok:
        return bad
    assert not bad, "; ".join(bad)
    # The in-place update: the logical rows as the oracle wrote them ...
    lk, lv = logical_rows(kc, vc, args, meta)
    if "rotary_cos" in args:  # two roundings of the same rotation: at most one ulp apart
        eps = torch.finfo(dtype).eps
        acc_eps = torch.finfo(compute_dtype(dtype)).eps
        diff = (lk.double() - ek.double()).abs()
        assert (diff <= eps * ek.double().abs() + 8 * acc_eps * ek.double().abs().max()).all(), diff.max()
        # and the unrotated part of k (beyond rotary_dim) exactly
        ro = 2 * args["rotary_cos"].shape[1]
        assert torch.equal(lk[..., ro:], ek[..., ro:])
    else:
        assert torch.equal(lk, ek)
    assert torch.equal(lv, ev)
    # ... and nothing else touched: unmapped cache rows / unused blocks.
    if paged:
        used = torch.zeros(kc.shape[0], dtype=torch.bool)
        used[args["block_table"].long().flatten().cpu()] = True
        assert torch.equal(kc[~used.to(kc.device)], kc0[~used.to(kc.device)])
        assert torch.equal(vc[~used.to(kc.device)], vc0[~used.to(kc.device)])
    elif meta["batch_idx"] is not None:
        others = [r for r in range(kc.shape[0]) if r not in meta["batch_idx"]]
        assert torch.equal(kc[others], kc0[others]) and torch.equal(vc[others], vc0[others])
    return out, lse, kc, vc


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("case", list(CASES))
def test_kvcache_against_oracle(device, dtype, case, paged):
    if paged and "batch_idx" in CASES[case][-1]:
        pytest.skip("cache_batch_idx is not combined with block_table (as in flash-attn)")
    run_and_check(case, dtype, device, paged)


# flash-attn's softcap and ALiBi (csrc/flash_params.h ScoreMod) against the
# oracle: ALiBi's query i sits at key cache_seqlens[b] + seqlen_new - seqlen_q + i.
def _slopes(shape, device):
    return (torch.rand(shape, dtype=torch.float32) * 0.4 + 0.05).to(device)


KV_SCORE_MODS = {
    "softcap": lambda b, h, dev: dict(softcap=1.5),
    "alibi-h": lambda b, h, dev: dict(alibi_slopes=_slopes((h,), dev)),
    "alibi-bh": lambda b, h, dev: dict(alibi_slopes=_slopes((b, h), dev)),
    "both-bh": lambda b, h, dev: dict(softcap=2.0, alibi_slopes=_slopes((b, h), dev)),
}


@pytest.mark.dtypes(torch.float32, torch.bfloat16)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("mod", list(KV_SCORE_MODS))
@pytest.mark.parametrize(
    "case",
    ["decode-append-1-gqa", "decode-no-append-mqa", "spec-4-append-4-causal", "window-two-sided", "leftpad"],
)
def test_kvcache_score_mod(device, dtype, case, mod, paged):
    run_and_check(case, dtype, device, paged, score_mod=lambda b, h: KV_SCORE_MODS[mod](b, h, device))


@pytest.mark.dtypes(torch.float32)
def test_kvcache_score_mod_oracle_can_fail(device, dtype):
    # The check sees the mod: the plain oracle rejects a softcapped, ALiBi'd call.
    q, kc, vc, args, meta = setup("spec-4-append-4-causal", dtype, device, False)
    lk0, lv0 = logical_rows(kc.clone(), vc.clone(), args, meta)
    slopes = _slopes((q.shape[2],), device)
    out, lse = flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True, softcap=0.5, alibi_slopes=slopes, **args)
    _, _, rows = oracle(q, lk0, lv0, args["k"], args["v"], meta["seqlens"], meta["leftpad"], causal=True)
    assert check_rows(out, lse, rows, causal=True)
    assert not check_rows(out, lse, rows, causal=True, softcap=0.5, alibi_slopes=slopes)


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(alibi_slopes="slopes"), TypeError, "alibi_slopes"),
        (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), TypeError, "alibi_slopes.*float32"),
        (dict(alibi_slopes=torch.ones(5)), ValueError, r"alibi_slopes must have shape \(nheads,\)"),
    ],
    ids=["negative-softcap", "not-a-tensor", "float16", "shape"],
)
def test_kvcache_score_mod_errors_before_the_append(device, kw, exc, match):
    q, kc, vc, args, meta = setup("spec-4-append-4-causal", torch.float32, device, False)
    kw = {key: (x.to(device) if isinstance(x, torch.Tensor) else x) for key, x in kw.items()}
    kc0 = kc.clone()
    with pytest.raises(exc, match=match):
        flash_attn_with_kvcache(q, kc, vc, **args, **kw)
    assert torch.equal(kc, kc0)  # nothing appended


@pytest.mark.dtypes(torch.float32)
@pytest.mark.parametrize(
    "case, override",
    [
        ("rotary-interleaved-causal", dict(interleaved=False)),  # the other rotary layout
        ("rotary-neox-causal", dict(interleaved=True)),
        ("rotary-neox-causal", dict(q_positions="single")),  # causal: q per token, not all at cache_seqlens
        ("rotary-interleaved-noncausal", dict(q_positions="per-token")),  # non-causal: all at cache_seqlens
        ("spec-4-append-4-causal", dict(causal=False)),  # the mask matters
        ("leftpad", dict(causal=True, window_size=(-1, 0))),  # sanity: an equivalent spelling passes
    ],
)
def test_oracle_can_fail(device, dtype, case, override):
    """The checks fail when the oracle is given another rule (the last one is an
    equivalent rule, which must pass)."""
    bad = run_and_check(case, dtype, device, False, expect_ok=False, **override)
    if override.get("window_size") == (-1, 0):
        assert not bad
    else:
        assert bad


@pytest.mark.parametrize("case", ["spec-4-append-4-causal", "leftpad", "rotary-neox-causal", "window-two-sided"])
def test_paged_equals_contiguous(device, dtype, case):
    """The same caches, contiguous and paged (page 16, blocks shuffled), give the
    same outputs, lse and written rows."""
    torch.manual_seed(1234)
    q, kc, vc, args, meta = setup(case, dtype, device, False)
    torch.manual_seed(1234)
    _, pk, pv, pargs, _ = setup(case, dtype, device, True)
    assert torch.equal(logical(pk, pargs["block_table"]), kc)
    out, lse = flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True, **args)
    pout, plse = flash_attn_with_kvcache(q, pk, pv, return_softmax_lse=True, **pargs)
    assert torch.equal(out, pout) and torch.equal(lse, plse)
    assert torch.equal(logical(pk, pargs["block_table"]), kc)
    assert torch.equal(logical(pv, pargs["block_table"]), vc)


@pytest.mark.parametrize("leftpad", [None, [37, 5]])
@pytest.mark.parametrize("seqlen_q", [1, 8, 9])
def test_paged_long_cache_equals_contiguous(device, dtype, seqlen_q, leftpad):
    """Decoding-shaped calls against long caches, paged (16-key pages, shuffled) and
    contiguous, give the same outputs and lse bit for bit. On the CPU up to 8
    queries read the pages in place on the few-queries path, with the keys split
    over the cores (1200 keys: several parts); 9 queries take the tiled path on
    the row's gathered keys."""
    gen = torch.Generator().manual_seed(7)
    q = randn((2, seqlen_q, 8, 64), dtype, device)
    kc, vc = randn((2, 1280, 2, 64), dtype, device), randn((2, 1280, 2, 64), dtype, device)
    pk, table = to_paged(kc, generator=gen)
    pv = torch.empty_like(pk)
    pv[table.long().flatten()] = vc.reshape(-1, PAGE, 2, 64)
    kw = dict(cache_seqlens=torch.tensor([1200, 700], dtype=torch.int32, device=device), causal=True)
    if leftpad is not None:
        kw["cache_leftpad"] = torch.tensor(leftpad, dtype=torch.int32, device=device)
    out, lse = flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True, **kw)
    pout, plse = flash_attn_with_kvcache(q, pk, pv, block_table=table, return_softmax_lse=True, **kw)
    assert torch.equal(out, pout) and torch.equal(lse, plse)
    lp = leftpad or [0, 0]
    rows = [(q[b], kc[b, lp[b] : n], vc[b, lp[b] : n]) for b, n in enumerate((1200, 700))]
    bad = check_rows(out, lse, rows, causal=True)
    assert not bad, "; ".join(bad)


def test_equals_flash_attn_func_on_full_cache(device, dtype):
    """cache_seqlens = None attends to the whole cache: flash_attn_func on it
    (the same kernel on the CPU, so bitwise; the decoding kernel on CUDA, so
    both within the tolerance rule)."""
    q = randn((2, 3, 4, 16), dtype, device)
    kc, vc = randn((2, 32, 2, 16), dtype, device), randn((2, 32, 2, 16), dtype, device)
    out, lse = flash_attn_with_kvcache(q, kc, vc, causal=True, return_softmax_lse=True)
    if device == "cpu":
        assert torch.equal(out, flash_attn_func(q, kc, vc, causal=True))
    bad = check_rows(out, lse, [(q[b], kc[b], vc[b]) for b in range(2)], causal=True)
    assert not bad, "; ".join(bad)


@pytest.mark.dtypes(torch.float32)
def test_int_seqlens_num_splits_and_grad_inputs(device, dtype):
    q = randn((2, 1, 4, 16), dtype, device).requires_grad_()
    kc, vc = randn((2, 32, 2, 16), dtype, device), randn((2, 32, 2, 16), dtype, device)
    k, v = randn((2, 1, 2, 16), dtype, device), randn((2, 1, 2, 16), dtype, device)
    kc2, vc2 = kc.clone(), vc.clone()
    a = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=7, causal=True, num_splits=4)
    seq = torch.full((2,), 7, dtype=torch.int32, device=device)
    b = flash_attn_with_kvcache(q.detach(), kc2, vc2, k, v, cache_seqlens=seq, causal=True)
    assert torch.equal(a, b) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert not a.requires_grad
    # a cache that requires grad (a leaf) is updated in place as well
    kc3, vc3 = kc.clone().requires_grad_(), vc.clone().requires_grad_()
    c = flash_attn_with_kvcache(q, kc3, vc3, k, v, cache_seqlens=seq, causal=True)
    assert torch.equal(c, a) and torch.equal(kc3[:, 7:8].detach(), k)


# ----------------------------------------------------------------------------- errors


def _dt(device):
    """The dtype of the error cases: one the device's kernels take."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.float16


def _base(device):
    dt = _dt(device)
    return dict(
        q=randn((2, 1, 4, 16), dt, device),
        k_cache=randn((2, 32, 2, 16), dt, device),
        v_cache=randn((2, 32, 2, 16), dt, device),
        k=randn((2, 1, 2, 16), dt, device),
        v=randn((2, 1, 2, 16), dt, device),
        cache_seqlens=torch.tensor([3, 5], dtype=torch.int32, device=device),
    )


def _i32(x, device):
    return torch.tensor(x, dtype=torch.int32, device=device)


ERRORS = {
    "k-without-v": (lambda a, dev: a.update(v=None), ValueError, "k and v must be given together"),
    "v-without-k": (lambda a, dev: a.update(k=None), ValueError, "k and v must be given together"),
    "q-rank": (lambda a, dev: a.update(q=a["q"][0]), ValueError, "q must be a dense 4-D"),
    "cache-rank": (lambda a, dev: a.update(k_cache=a["k_cache"][0]), ValueError, "k_cache must be a dense 4-D"),
    "cache-dtype": (lambda a, dev: a.update(k_cache=a["k_cache"].double()), TypeError, "k_cache has dtype"),
    "new-dtype": (lambda a, dev: a.update(v=a["v"].double()), TypeError, "v has dtype"),
    "v-cache-shape": (lambda a, dev: a.update(v_cache=a["v_cache"][:, :16]), ValueError, "v_cache has shape"),
    "head-dim": (lambda a, dev: a.update(q=a["q"][..., :8]), ValueError, "k_cache has head_dim 16 but q has 8"),
    "heads": (lambda a, dev: a.update(q=a["q"][:, :, :3]), ValueError, "not a multiple of the 2 heads"),
    "new-shape": (lambda a, dev: a.update(k=a["k"][:, :, :1], v=a["v"][:, :, :1]), ValueError, "k must have shape"),
    "new-kv-shapes": (lambda a, dev: a.update(v=a["v"][:, :0]), ValueError, "v has shape"),
    "cache-batch": (
        lambda a, dev: a.update(k_cache=a["k_cache"][:1], v_cache=a["v_cache"][:1]),
        ValueError,
        "k_cache has 1 rows",
    ),
    "seqlens-dtype": (
        lambda a, dev: a.update(cache_seqlens=a["cache_seqlens"].long()),
        TypeError,
        "cache_seqlens must have dtype torch.int32",
    ),
    "seqlens-type": (lambda a, dev: a.update(cache_seqlens=[3, 5]), TypeError, "cache_seqlens must be an int or"),
    "seqlens-shape": (
        lambda a, dev: a.update(cache_seqlens=_i32([3, 5, 1], dev)),
        ValueError,
        "cache_seqlens must have shape",
    ),
    "seqlens-device": (
        lambda a, dev: a.update(cache_seqlens=_i32([3, 5], "meta")),
        ValueError,
        "cache_seqlens is on meta",
    ),
    "seqlens-negative": (
        lambda a, dev: a.update(cache_seqlens=_i32([-1, 5], dev)),
        ValueError,
        r"cache_seqlens\[0\] = -1",
    ),
    "seqlens-overflow": (
        lambda a, dev: a.update(cache_seqlens=_i32([3, 32], dev)),
        ValueError,
        r"cache_seqlens\[1\] = 32 is outside \[0, 31\]",
    ),
    "seqlens-missing": (lambda a, dev: a.update(cache_seqlens=None), ValueError, "cache_seqlens is required"),
    "leftpad-range": (lambda a, dev: a.update(cache_leftpad=_i32([4, 0], dev)), ValueError, r"cache_leftpad\[0\] = 4"),
    "leftpad-dtype": (
        lambda a, dev: a.update(cache_leftpad=torch.zeros(2, device=dev)),
        TypeError,
        "cache_leftpad must have dtype",
    ),
    "batch-idx-range": (
        lambda a, dev: a.update(cache_batch_idx=_i32([0, 2], dev)),
        ValueError,
        r"cache_batch_idx\[1\] = 2",
    ),
    "batch-idx-repeat": (lambda a, dev: a.update(cache_batch_idx=_i32([1, 1], dev)), ValueError, "repeated rows"),
    "batch-idx-shape": (
        lambda a, dev: a.update(cache_batch_idx=_i32([1], dev)),
        ValueError,
        "cache_batch_idx must have shape",
    ),
    "softcap": (lambda a, dev: a.update(softcap=-5.0), ValueError, "softcap must be a finite number >= 0"),
    "alibi": (
        lambda a, dev: a.update(alibi_slopes=torch.ones(4, dtype=torch.float64, device=dev)),
        TypeError,
        "alibi_slopes must have dtype torch.float32",
    ),
    "window": (lambda a, dev: a.update(window_size=(-2, 0)), ValueError, "flash_attn_with_kvcache: window_size"),
    "num-splits": (lambda a, dev: a.update(num_splits=-1), ValueError, "num_splits must be >= 0"),
    "num-splits-type": (lambda a, dev: a.update(num_splits=1.5), TypeError, "num_splits must be an int"),
    "interleaved-type": (
        lambda a, dev: a.update(rotary_interleaved="yes"),
        TypeError,
        "rotary_interleaved must be a bool",
    ),
}


def _paged(a, dev, table=None, page=16):
    a["k_cache"] = randn((6, page, 2, 16), _dt(dev), dev)
    a["v_cache"] = randn((6, page, 2, 16), _dt(dev), dev)
    a["block_table"] = table if table is not None else _i32([[0, 1], [2, 3]], dev)


ERRORS.update(
    {
        "table-dtype": (
            lambda a, d: _paged(a, d, _i32([[0, 1], [2, 3]], d).long()),
            TypeError,
            "block_table must have dtype",
        ),
        "table-shape": (lambda a, d: _paged(a, d, _i32([0, 1], d)), ValueError, "block_table must have shape"),
        "table-batch": (lambda a, d: _paged(a, d, _i32([[0, 1]], d)), ValueError, "block_table must have shape"),
        "table-range": (
            lambda a, d: _paged(a, d, _i32([[6, 1], [2, 3]], d)),
            ValueError,
            r"block_table\[0\] holds block indices",
        ),
        "table-negative": (lambda a, d: _paged(a, d, _i32([[-1, 1], [2, 3]], d)), ValueError, r"block_table\[0\]"),
        "page-size": (lambda a, d: _paged(a, d, page=24), ValueError, "page_block_size .* multiple of 16"),
        "paged-capacity": (
            lambda a, d: (_paged(a, d), a.update(cache_seqlens=_i32([3, 32], d))),
            ValueError,
            r"max_blocks_per_seq \* page_block_size",
        ),
        "paged-batch-idx": (
            lambda a, d: (_paged(a, d), a.update(cache_batch_idx=_i32([0, 1], d))),
            ValueError,
            "cache_batch_idx cannot be combined with block_table",
        ),
    }
)


def _rot(a, d, rows=32, half=8, only=None, dtype=None):
    dtype = dtype or _dt(d)
    cos, sin = rotary_tables(rows, 2 * half, dtype, d) if half else (torch.ones(rows, 0, dtype=dtype, device=d),) * 2
    a["rotary_cos"] = cos if only != "sin" else None
    a["rotary_sin"] = sin if only != "cos" else None


ERRORS.update(
    {
        "rotary-cos-only": (
            lambda a, d: _rot(a, d, only="cos"),
            ValueError,
            "rotary_cos and rotary_sin must be given together",
        ),
        "rotary-without-k": (
            lambda a, d: (_rot(a, d), a.update(k=None, v=None)),
            ValueError,
            "only applied together with new k/v",
        ),
        "rotary-dtype": (lambda a, d: _rot(a, d, dtype=torch.float64), TypeError, "rotary_cos has dtype"),
        "rotary-too-wide": (
            lambda a, d: _rot(a, d, half=9),
            ValueError,
            r"rotary_dim = 18 must be in \[2, head_dim = 16\]",
        ),
        "rotary-empty": (lambda a, d: _rot(a, d, half=0), ValueError, "rotary_dim = 0"),
        "rotary-short": (lambda a, d: _rot(a, d, rows=5), ValueError, "seqlen_ro must be at least 6"),
        "rotary-rank": (
            lambda a, d: a.update(
                rotary_cos=torch.ones(32, dtype=_dt(d), device=d), rotary_sin=torch.ones(32, dtype=_dt(d), device=d)
            ),
            ValueError,
            "rotary_cos must be 2-D",
        ),
    }
)


# The errors that need the integer tensors' values: raised on the CPU, and on
# CUDA only with FLASHATTN_KVCACHE_CHECK=1 (reading them is a host sync).
VALUE_ERRORS = {
    "seqlens-negative",
    "seqlens-overflow",
    "leftpad-range",
    "batch-idx-range",
    "batch-idx-repeat",
    "table-range",
    "table-negative",
    "paged-capacity",
    "rotary-short",
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors(device, name, monkeypatch):
    mutate, exc, pattern = ERRORS[name]
    if device == "cuda" and name in VALUE_ERRORS:
        monkeypatch.setenv("FLASHATTN_KVCACHE_CHECK", "1")
    args = _base(device)
    mutate(args, device)
    caches = (args["k_cache"].clone(), args["v_cache"].clone())
    with pytest.raises(exc, match=re.compile(pattern)):
        flash_attn_with_kvcache(**args)
    # a rejected call writes nothing
    assert torch.equal(args["k_cache"], caches[0]) and torch.equal(args["v_cache"], caches[1])


def test_errors_base_call_is_valid(device):
    """The calls of test_errors differ from a valid call by their one mutation."""
    args = _base(device)
    out = flash_attn_with_kvcache(**args)
    assert out.shape == args["q"].shape and math.isfinite(out.abs().sum().item())


def test_unchecked_values_stay_in_bounds(device, monkeypatch):
    """Without the value checks (CUDA's default; forced here on the CPU by
    pretending to trace), out-of-range integers are clamped: the call neither
    raises nor touches memory outside the tensors."""
    from flashattn_ext import interface

    monkeypatch.setattr(interface, "_kvcache_host_checks", lambda device: False)
    for mutate in (
        lambda a, d: a.update(cache_seqlens=_i32([-5, 1000], d)),
        lambda a, d: a.update(cache_leftpad=_i32([7, -3], d)),
        lambda a, d: a.update(cache_batch_idx=_i32([9, -1], d)),
        lambda a, d: (_paged(a, d, _i32([[60, -7], [2, 3]], d)), a.update(cache_seqlens=_i32([40, 31], d))),
        lambda a, d: (_rot(a, d, rows=4), a.update(cache_seqlens=_i32([20, 30], d))),
    ):
        args = _base(device)
        mutate(args, device)
        try:
            out = flash_attn_with_kvcache(**args)
        except ValueError:  # the CPU kernel reads (and checks) the values it is given
            assert device == "cpu"
            continue
        if device == "cuda":
            torch.cuda.synchronize()
        assert out.shape == args["q"].shape


# ----------------------------------------------------------------------------- the op


fwd_kvcache = torch.ops.flashattn_ext.fwd_kvcache.default


def _op_samples(device):
    """(q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad, block_table,
    scale, window_left, window_right, num_splits)."""
    lo = torch.float32 if device == "cpu" else torch.float16
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    q = randn((3, 2, 4, 16), lo, device)
    kc, vc = randn((4, 40, 2, 16), lo, device), randn((4, 40, 2, 16), lo, device)
    out = [(q, kc, vc, i32([5, 0, 40]), i32([3, 0, 1]), i32([1, 0, 7]), None, 0.3, -1, 0, 0)]
    pk, pv = randn((7, 16, 2, 16), lo, device), randn((7, 16, 2, 16), lo, device)
    out.append((q, pk, pv, i32([17, 32, 3]), None, None, i32([[4, 0], [6, 1], [2, 5]]), 0.25, 4, 1, 2))
    return out


def test_opcheck_fwd_kvcache(device):
    """Schema, fake kernel and dispatch (not differentiable: no requires_grad
    samples, as for fwd; the next test pins the error a backward gets)."""
    for args in _op_samples(device):
        torch.library.opcheck(fwd_kvcache, args)


def test_fwd_kvcache_not_differentiable(device):
    args = _op_samples(device)[0]
    q = args[0].detach().requires_grad_()
    out, _ = fwd_kvcache(q, *args[1:])
    with pytest.raises(RuntimeError, match="for inference and has no derivative"):
        out.sum().backward()


def test_fwd_kvcache_fake_validates():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(3, 2, 4, 16, dtype=torch.float16)
        kc = torch.empty(3, 40, 2, 16, dtype=torch.float16)
        s = torch.empty(3, dtype=torch.int32)
        out, lse = fwd_kvcache(q, kc, kc, s, None, None, None, 0.25, -1, 0, 0)
        assert out.shape == q.shape and lse.shape == (3, 4, 2) and lse.dtype == torch.float32
        with pytest.raises(TypeError, match="seqlens_k must have dtype torch.int32"):
            fwd_kvcache(q, kc, kc, s.long(), None, None, None, 0.25, -1, 0, 0)
        with pytest.raises(ValueError, match="cache_batch_idx cannot be combined with block_table"):
            fwd_kvcache(q, kc, kc, s, s, None, torch.empty(3, 2, dtype=torch.int32), 0.25, -1, 0, 0)


# ----------------------------------------------------------------------------- the append + rotary op
# flashattn_ext::kvcache_append_rotary (rotary on q and the new keys, the
# append in place; what flash_attn_with_kvcache runs before fwd_kvcache)
# against reference.kvcache_append_rotary_ref, the same rules in plain torch
# ops: bit for bit (the same roundings in the same order, on either device).

kvcache_append_rotary = torch.ops.flashattn_ext.kvcache_append_rotary.default
APPEND_CAP = 48  # 3 pages of 16
# name: (rotary_dim as a fraction of d or None, interleaved)
APPEND_ROTARY = {
    "gptj": (1, True),
    "neox": (1, False),
    "gptj-partial": (2, True),
    "neox-partial": (2, False),
    "none": (None, True),
}


def _append_args(device, dtype, layout, seqlen_q, seqlen_new, rotary, q_per_token, seqlens=(5, 0, 27), d=32):
    """The op's arguments, (q, k, v, k_cache, v_cache, cache_seqlens, cache_batch_idx,
    block_table, rotary_cos, rotary_sin, interleaved, q_per_token); q and k as
    strided views (the op reads any strides)."""
    batch, hq, hkv = len(seqlens), 4, 2
    q = randn((batch, hq, seqlen_q, d), dtype, device).transpose(1, 2)  # (batch, seqlen_q, hq, d), strided
    k = randn((batch, seqlen_new, hkv, d + 8), dtype, device)[..., :d]
    v = randn((batch, seqlen_new, hkv, d), dtype, device)
    n_cache = 5 if layout == "batch-idx" else batch
    kc, vc = randn((n_cache, APPEND_CAP, hkv, d), dtype, device), randn((n_cache, APPEND_CAP, hkv, d), dtype, device)
    idx = table = None
    if layout == "batch-idx":
        idx = torch.tensor([3, 0, 4][:batch], dtype=torch.int32, device=device)
    elif layout == "paged":
        kc, table = to_paged(kc)
        vc = randn(kc.shape, dtype, device)
    frac, interleaved = APPEND_ROTARY[rotary]
    cos = sin = None
    if frac is not None:
        cos, sin = rotary_tables(APPEND_CAP, d // frac, dtype, device)
    lens = torch.tensor(seqlens, dtype=torch.int32, device=device)
    return [q, k, v, kc, vc, lens, idx, table, cos, sin, interleaved, q_per_token]


def _append_both(args):
    """(op's q, k_cache, v_cache), (reference's), each on its own copy of the caches."""
    op_args, ref_args = list(args), list(args)
    op_args[3:5] = (args[3].clone(), args[4].clone())
    ref_args[3:5] = (args[3].clone(), args[4].clone())
    q_op = kvcache_append_rotary(*op_args)
    q_ref = kvcache_append_rotary_ref(*ref_args)
    return (q_op, op_args[3], op_args[4]), (q_ref, ref_args[3], ref_args[4])


def _assert_append_equal(got, expected):
    (q, kc, vc), (q_e, kc_e, vc_e) = got, expected
    if q_e is None:
        assert q.shape == (0,)
    else:
        assert q.is_contiguous() and q.dtype == q_e.dtype
        assert torch.equal(q, q_e), (q.double() - q_e.double()).abs().max()
    assert torch.equal(kc, kc_e), (kc.double() - kc_e.double()).abs().max()
    assert torch.equal(vc, vc_e)


@pytest.mark.parametrize("seqlen_q, seqlen_new", [(1, 1), (4, 4), (3, 5)], ids=["decode", "spec4", "q3-new5"])
@pytest.mark.parametrize("q_per_token", [True, False], ids=["q-per-token", "q-at-seqlen"])
@pytest.mark.parametrize("rotary", list(APPEND_ROTARY))
@pytest.mark.parametrize("layout", ["contiguous", "batch-idx", "paged"])
def test_append_rotary_against_reference(device, dtype, layout, rotary, q_per_token, seqlen_q, seqlen_new):
    args = _append_args(device, dtype, layout, seqlen_q, seqlen_new, rotary, q_per_token)
    got, expected = _append_both(args)
    _assert_append_equal(got, expected)
    # The append wrote the rows it should: nothing else of the caches changed.
    kc0, (_, kc, _) = args[3], got
    changed = (kc != kc0).flatten(2).any(-1)  # (rows, positions)
    assert changed.sum() <= len(args[5]) * seqlen_new


@pytest.mark.parametrize("rotary", ["gptj-partial", "neox"])
@pytest.mark.parametrize("d", [20, 128, 256])
def test_append_rotary_head_dims(device, d, rotary):
    """Head dims that are not a warp multiple (20: a partial warp on CUDA), and
    the largest ones (one thread per element up to 256)."""
    args = _append_args(device, torch.bfloat16, "paged", 2, 2, rotary, True, d=d)
    got, expected = _append_both(args)
    _assert_append_equal(got, expected)


@pytest.mark.parametrize("which", ["no-q", "no-kv", "no-kv-no-rotary"])
def test_append_rotary_optional_parts(device, which):
    """q None: only the append (an empty result); k / v None: only q rotated
    (caches untouched); neither rotary nor k / v: a copy of q."""
    dtype = torch.bfloat16
    args = _append_args(device, dtype, "contiguous", 2, 2, "neox" if which != "no-kv-no-rotary" else "none", True)
    if which == "no-q":
        args[0] = None
    else:
        args[1] = args[2] = None
    got, expected = _append_both(args)
    _assert_append_equal(got, expected)
    if which != "no-q":
        assert torch.equal(got[1], args[3]) and torch.equal(got[2], args[4])
    if which == "no-kv-no-rotary":
        assert torch.equal(got[0], args[0])


@pytest.mark.parametrize("layout", ["contiguous", "batch-idx", "paged"])
def test_append_rotary_clamps_out_of_range_values(device, layout):
    """Unchecked values (CUDA's default) are clamped to the tensors, as the
    reference clamps them: lengths below 0 and past the cache, cache rows and
    blocks outside the cache, positions past the rotary table."""
    dtype = torch.float16 if device == "cuda" else torch.float32
    args = _append_args(device, dtype, layout, 2, 1, "gptj", True, seqlens=(-5, 1000, 10))
    args[8], args[9] = args[8][:7], args[9][:7]  # seqlen_ro 7: row 2's positions clamp to 6
    if layout == "batch-idx":
        args[6] = torch.tensor([9, -1, 2], dtype=torch.int32, device=device)  # -> rows 4, 0, 2
    elif layout == "paged":
        table = args[7].clone()
        table[0, 0], table[1, 2] = -7, 60  # -> block 0, the last block (both unused by the rows' own blocks)
        args[7] = table
    got, expected = _append_both(args)
    if device == "cuda":
        torch.cuda.synchronize()
    _assert_append_equal(got, expected)


def test_flash_attn_with_kvcache_runs_the_op(device):
    """A decode step with rotary and an append: the op, then fwd_kvcache, nothing else of ours."""
    q, kc, vc, k, v, seqlens, cos, sin, table = _decode_inputs(device, torch.bfloat16, False)
    with KernelCalls() as spy:
        _decode_step(q, kc, vc, k, v, seqlens, cos, sin, table)
    assert [name for name, _ in spy.calls] == ["kvcache_append_rotary", "fwd_kvcache"]
    args = spy.calls[0][1]
    assert args[1] is k and args[3] is kc and args[5] is seqlens and args[-1] is True  # causal: q per token


def test_opcheck_kvcache_append_rotary(device):
    lo = torch.float32 if device == "cpu" else torch.float16
    for layout, rotary in (("contiguous", "gptj"), ("batch-idx", "neox-partial"), ("paged", "none")):
        torch.library.opcheck(kvcache_append_rotary, _append_args(device, lo, layout, 2, 3, rotary, True))


def test_kvcache_append_rotary_fake_validates():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        args = _append_args("cpu", torch.float16, "contiguous", 2, 1, "gptj", False)
        q = kvcache_append_rotary(*args)
        assert q.shape == args[0].shape and q.is_contiguous()
        bad = list(args)
        bad[5] = args[5].long()
        with pytest.raises(TypeError, match="cache_seqlens must have dtype torch.int32"):
            kvcache_append_rotary(*bad)
        bad = list(args)
        bad[8] = bad[9] = torch.empty(48, 17, dtype=torch.float16)
        with pytest.raises(ValueError, match=re.escape("rotary_dim = 34 must be in [2, head_dim = 32]")):
            kvcache_append_rotary(*bad)


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda a: a.__setitem__(2, None), ValueError, "k and v must be given together"),
        (lambda a: a.__setitem__(4, a[4][:, :, :1]), ValueError, "v_cache has shape"),
        (lambda a: a.__setitem__(9, None), ValueError, "rotary_cos and rotary_sin must be given together"),
        (lambda a: a.__setitem__(0, a[0][:2]), ValueError, "q must have shape"),
        (lambda a: a.__setitem__(1, a[1][:, :, :1]), ValueError, "k must have shape"),
        (lambda a: a.__setitem__(8, a[8].double()), TypeError, "rotary_cos has dtype Double"),
    ],
)
def test_kvcache_append_rotary_errors_match_fake(device, mutate, exc, match):
    """The real op and its fake kernel refuse the same call in the same words."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _append_args(device, torch.float16, "contiguous", 2, 1, "gptj", True)
    mutate(args)
    with pytest.raises(exc, match=match) as real:
        kvcache_append_rotary(*args)
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(exc, match=match) as fake:
            kvcache_append_rotary(*args)
    assert str(real.value).split("\n")[0] == str(fake.value).split("\n")[0]


def _append_step(q, k, v, kc, vc, lens, idx, table, cos, sin, interleaved, q_per_token):
    return kvcache_append_rotary(q, k, v, kc, vc, lens, idx, table, cos, sin, interleaved, q_per_token)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_append_rotary_compile_fullgraph(device, layout):
    """The op traces under torch.compile(fullgraph=True) (its fake kernel; the
    caches' mutation functionalized and written back) and gives the eager bits."""
    if device == "cpu" and layout == "paged":
        pytest.skip("one CPU compile is enough (slow to compile on small machines)")
    torch._dynamo.reset()
    dtype = torch.bfloat16
    args = _append_args(device, dtype, layout, 1, 1, "neox", True)
    eager = list(args)
    eager[3:5] = (args[3].clone(), args[4].clone())
    q_e = _append_step(*eager)
    backend = "inductor" if device == "cuda" else "aot_eager"
    q_c = torch.compile(_append_step, fullgraph=True, backend=backend)(*args)
    assert torch.equal(q_c, q_e) and torch.equal(args[3], eager[3]) and torch.equal(args[4], eager[4])


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["contiguous", "batch-idx", "paged"])
def test_append_rotary_cuda_graph(layout):
    """One launch, no host synchronisation, captured in a CUDA graph: the replays
    read the new lengths (and block table) written into the captured inputs."""
    device, dtype = "cuda", torch.bfloat16
    args = _append_args(device, dtype, layout, 1, 1, "gptj", True)
    graph, q_out = _no_sync_then_capture(lambda: _append_step(*args))
    for lens in ((9, 3, 40), (0, 47, 12)):
        args[5].copy_(torch.tensor(lens, dtype=torch.int32, device=device))
        for t in (args[0], args[1], args[2]):
            t.copy_(torch.randn_like(t))
        expected = list(args)
        expected[3:5] = (args[3].clone(), args[4].clone())
        q_e = kvcache_append_rotary_ref(*expected)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(q_out, q_e)
        assert torch.equal(args[3], expected[3]) and torch.equal(args[4], expected[4])


# ----------------------------------------------------------------------------- compile, graphs


def _decode_step(q, kc, vc, k, v, seqlens, cos, sin, table):
    return flash_attn_with_kvcache(
        q,
        kc,
        vc,
        k,
        v,
        cos,
        sin,
        seqlens,
        block_table=table,
        causal=True,
        rotary_interleaved=False,
        return_softmax_lse=True,
    )


def _decode_inputs(device, dtype, paged, seqlens=(7, 0, 30)):
    batch, cap, hkv, d = len(seqlens), 48, 2, 32
    q, k, v = (
        randn((batch, 1, 4, d), dtype, device),
        randn((batch, 1, hkv, d), dtype, device),
        randn((batch, 1, hkv, d), dtype, device),
    )
    kc, vc = randn((batch, cap, hkv, d), dtype, device), randn((batch, cap, hkv, d), dtype, device)
    table = None
    if paged:
        kc, table = to_paged(kc)
        vc = randn(kc.shape, dtype, device)
    cos, sin = rotary_tables(cap, d, dtype, device)
    return [q, kc, vc, k, v, torch.tensor(seqlens, dtype=torch.int32, device=device), cos, sin, table]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.dtypes(torch.float32, torch.bfloat16)
def test_compile_decode_step(device, dtype, backend, paged):
    """A decode step (rotary, in-place append, paged or not) traces under
    torch.compile(fullgraph=True) and gives the eager step's results and cache."""
    if backend == "inductor" and device == "cpu" and (dtype != torch.float32 or paged):
        pytest.skip("one inductor compile on the CPU is enough (slow to compile on small machines)")
    torch._dynamo.reset()
    inputs = _decode_inputs(device, dtype, paged)
    eager_in = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    out_e, lse_e = _decode_step(*eager_in)
    compiled = torch.compile(_decode_step, fullgraph=True, backend=backend)
    out_c, lse_c = compiled(*inputs)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out_c, out_e, rtol=tol, atol=tol)
    torch.testing.assert_close(lse_c, lse_e, rtol=tol, atol=tol)
    torch.testing.assert_close(inputs[1], eager_in[1], rtol=tol, atol=tol)  # k_cache, rotated rows may round apart
    assert torch.equal(inputs[2], eager_in[2])  # v_cache, written as given


def _no_sync_then_capture(step):
    """Runs step once warm (off the default stream, as torch's docs ask), once
    under torch's sync debug mode "error" (a host synchronisation raises), then
    captures it in a CUDA graph; returns the graph and the captured outputs."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


@pytest.mark.cuda
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_step_cuda_graph_and_no_sync(paged):
    """A decode step does no host synchronisation (torch's sync debug mode
    raises on one), captures in a CUDA graph, and the replays follow new
    values written into the captured inputs (cache lengths included)."""
    device, dtype = "cuda", torch.bfloat16
    inputs = _decode_inputs(device, dtype, paged)
    graph, (out, lse) = _no_sync_then_capture(lambda: _decode_step(*inputs))
    for new_lens in ((9, 3, 40), (0, 47, 12)):
        fresh = _decode_inputs(device, dtype, paged, new_lens)
        expected = [x.clone() if isinstance(x, torch.Tensor) else x for x in fresh]
        for dst, src in zip(inputs, fresh):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        graph.replay()
        out_e, lse_e = _decode_step(*expected)
        assert torch.equal(out, out_e) and torch.equal(lse, lse_e)
        assert torch.equal(inputs[1], expected[1]) and torch.equal(inputs[2], expected[2])


def _plain_step(q, kc, vc, seqlens):
    """A decode step without append or rotary: flash_attn_with_kvcache's direct path."""
    return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True, return_softmax_lse=True)


def test_plain_step_hands_cache_seqlens_to_the_op_as_given(device):
    """No append, no rotary: one op call, cache_seqlens as given (no copy, no cast),
    q/k_cache/v_cache as given; None and an int become constant length tensors."""
    dtype = torch.bfloat16
    q, kc, vc, _, _, seqlens, *_ = _decode_inputs(device, dtype, False)
    for given in (seqlens, None, 30):
        with KernelCalls() as spy:
            out, lse = _plain_step(q, kc, vc, given)
        ((name, args),) = spy.calls
        assert name == "fwd_kvcache"
        assert args[0] is q and args[1] is kc and args[2] is vc
        if given is seqlens:
            assert args[3] is seqlens
        else:
            expected = kc.shape[1] if given is None else given
            assert args[3].dtype == torch.int32 and args[3].tolist() == [expected] * q.shape[0]
        out_c, lse_c = _flash_attn_checked(q, kc, vc, given)
        assert torch.equal(out, out_c) and torch.equal(lse, lse_c)


def _flash_attn_checked(q, kc, vc, seqlens):
    from flashattn_ext import interface

    return interface._flash_attn_with_kvcache_checked(
        q, kc, vc, None, None, None, None, seqlens, None, None, None, None, True, (-1, -1), 0.0, True, None, 0, True
    )


@pytest.mark.parametrize("seqlens", ["tensor", "none"])
@pytest.mark.dtypes(torch.float32, torch.bfloat16)
def test_compile_plain_step(device, dtype, seqlens):
    """The direct path (no append) traces under torch.compile(fullgraph=True)."""
    torch._dynamo.reset()
    q, kc, vc, _, _, lens, *_ = _decode_inputs(device, dtype, False, seqlens=(48, 48, 48))
    lens = lens if seqlens == "tensor" else None
    out_e, lse_e = _plain_step(q, kc, vc, lens)
    out_c, lse_c = torch.compile(_plain_step, fullgraph=True, backend="aot_eager")(q, kc, vc, lens)
    assert torch.equal(out_c, out_e) and torch.equal(lse_c, lse_e)


@pytest.mark.cuda
@pytest.mark.parametrize("seqlens", ["tensor", "none"])
def test_plain_step_cuda_graph_and_no_sync(seqlens):
    """The direct path: no host sync, captures in a CUDA graph (with cache_seqlens
    None the constant lengths are made inside the capture), replays follow the
    captured inputs."""
    device, dtype = "cuda", torch.bfloat16
    q, kc, vc, _, _, lens, *_ = _decode_inputs(device, dtype, False, seqlens=(7, 0, 30))
    lens = lens if seqlens == "tensor" else None
    step = lambda: _plain_step(q, kc, vc, lens)  # noqa: E731
    graph, (out, lse) = _no_sync_then_capture(step)
    for _ in range(2):
        for t in (q, kc, vc):
            t.copy_(torch.randn_like(t))
        if lens is not None:
            lens.copy_(torch.randint(0, kc.shape[1] + 1, lens.shape, device=device, dtype=torch.int32))
        graph.replay()
        out_e, lse_e = step()
        assert torch.equal(out, out_e) and torch.equal(lse, lse_e)


@pytest.mark.cuda
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged256"])
def test_split_step_cuda_graph_pdl(paged, monkeypatch):
    """Several splits, so the combine kernel runs: on sm90 it is launched with
    programmatic dependent launch (FLASHATTN_DISABLE_PDL=1: the plain launch).
    Captured with PDL, the replays equal eager calls with and without it, bit
    for bit (the same kernels; only the launch differs)."""
    device, dtype = "cuda", torch.bfloat16
    monkeypatch.delenv("FLASHATTN_DISABLE_PDL", raising=False)
    batch, cap, hq, hkv, d = 3, 1024, 8, 2, 64
    q = randn((batch, 1, hq, d), dtype, device)
    kc, vc = randn((batch, cap, hkv, d), dtype, device), randn((batch, cap, hkv, d), dtype, device)
    table = None
    if paged:
        kc, table = to_paged(kc, page=256)
        vc = randn(kc.shape, dtype, device)
    lens = torch.tensor([cap, 0, 517], dtype=torch.int32, device=device)

    def step():
        return flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=lens, block_table=table, causal=True, num_splits=4, return_softmax_lse=True
        )

    graph, (out, lse) = _no_sync_then_capture(step)
    for new_lens in ((300, cap, 1), (cap, 700, 0)):
        for t in (q, kc, vc):
            t.copy_(torch.randn_like(t))
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32, device=device))
        graph.replay()
        out_p, lse_p = step()
        monkeypatch.setenv("FLASHATTN_DISABLE_PDL", "1")
        out_e, lse_e = step()
        monkeypatch.delenv("FLASHATTN_DISABLE_PDL")
        assert torch.equal(out, out_p) and torch.equal(lse, lse_p)
        assert torch.equal(out, out_e) and torch.equal(lse, lse_e)


# ----------------------------------------------------------------------------- the CUDA decoding kernel
# Every path of csrc/cuda/flash_decode_kernel.cuh against the oracle: query
# lengths 1 and more (several query tiles), GQA ratios 1/4/8 and MQA, split
# counts 0 (automatic), 1 (direct write) and 3 (combine kernel), contiguous and
# paged caches (pages of 16 and 256 keys), cache_batch_idx, cache_leftpad, no
# mask, causal and windows, ragged lengths from 0 to the full cache.

KV_CAP = 768  # 12 key blocks of 64; 3 pages of 256, 48 of 16
# (heads_q, heads_kv, seqlen_q): packed rows per GQA group = heads_q / heads_kv * seqlen_q
GROUPS = {
    "mha-q1": (8, 8, 1),
    "gqa4-q1": (8, 2, 1),
    "gqa8-q1": (16, 2, 1),
    "mqa-q1": (8, 1, 1),
    "gqa4-q4": (8, 2, 4),
    "gqa8-q5": (16, 2, 5),  # 40 rows: several m-tiles
    "gqa8-q16": (32, 4, 16),  # 128 rows: several query tiles per group
}
LAYOUTS = ("contiguous", "contiguous-noappend", "batch-idx", "leftpad", "paged16-leftpad", "paged256")
MASKS = {
    "none": {},
    "causal": dict(causal=True),
    "window-causal": dict(causal=True, window_size=(37, 0)),
    "window": dict(window_size=(50, 3)),
}


def run_decode_case(dtype, d, group, layout, mask, num_splits, capacity=KV_CAP, batch=4, device="cuda"):
    hq, hkv, seqlen_q = group
    n_new = 0 if layout == "contiguous-noappend" else seqlen_q
    # ragged: full after the append, empty, middle, one key (then random)
    seqlens = [capacity - n_new, 0, capacity // 2 - 1, 1][:batch]
    seqlens += [int(x) for x in torch.randint(0, capacity - n_new + 1, (batch - len(seqlens),))]
    leftpad = ([70, 0, 100, 0] + [0] * batch)[:batch] if "leftpad" in layout else None
    if leftpad is not None:
        leftpad = [min(lp, s) for lp, s in zip(leftpad, seqlens)]
    q = randn((batch, seqlen_q, hq, d), dtype, device)
    lk0 = randn((batch, capacity, hkv, d), dtype, device)  # the logical caches of the batch rows
    lv0 = randn((batch, capacity, hkv, d), dtype, device)
    k = randn((batch, n_new, hkv, d), dtype, device) if n_new else None
    v = randn((batch, n_new, hkv, d), dtype, device) if n_new else None
    args = dict(k=k, v=v, cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=device), **MASKS[mask])
    if leftpad is not None:
        args["cache_leftpad"] = torch.tensor(leftpad, dtype=torch.int32, device=device)
    batch_idx = None
    if layout == "batch-idx":
        batch_idx = torch.randperm(batch + 2)[:batch]
        kc = randn((batch + 2, capacity, hkv, d), dtype, device)
        vc = randn((batch + 2, capacity, hkv, d), dtype, device)
        kc[batch_idx.to(device)], vc[batch_idx.to(device)] = lk0, lv0
        args["cache_batch_idx"] = batch_idx.to(torch.int32).to(device)
    elif layout.startswith("paged"):
        page = 16 if layout.startswith("paged16") else 256
        torch_gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
        kc, table = to_paged(lk0, generator=torch_gen, page=page)
        vc = randn(kc.shape, dtype, device)
        vc[table.long().flatten()] = lv0.reshape(-1, page, hkv, d)
        args["block_table"] = table
    else:
        kc, vc = lk0.clone(), lv0.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True, num_splits=num_splits, **args)
    ek, ev, rows = oracle(q, lk0, lv0, k, v, seqlens, leftpad or [0] * batch, **MASKS[mask])
    bad = check_rows(out, lse, rows, **MASKS[mask])
    assert not bad, "; ".join(bad)
    if "block_table" in args:
        lk, lv = logical(kc, args["block_table"]), logical(vc, args["block_table"])
    elif batch_idx is not None:
        lk, lv = kc[batch_idx.to(device)], vc[batch_idx.to(device)]
    else:
        lk, lv = kc, vc
    assert torch.equal(lk, ek) and torch.equal(lv, ev)
    return out, lse


@pytest.mark.parametrize("layout, mask", [("paged256", "window-causal"), ("batch-idx", "window"), ("leftpad", "none")])
@pytest.mark.parametrize("group", ["gqa4-q4", "gqa8-q16"])
def test_decode_cases_cpu(group, layout, mask):
    """A few of the CUDA kernel's cases on the CPU op (the same harness; the CPU
    path is the reference semantics the CUDA kernel must match)."""
    run_decode_case(torch.float32, 32, GROUPS[group], layout, mask, 0, capacity=512, device="cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("d, dtype", [(64, torch.float16), (128, torch.bfloat16)], ids=["d64-fp16", "d128-bf16"])
def test_decode_kernel(poison, d, dtype, group, num_splits, layout, mask):
    run_decode_case(dtype, d, GROUPS[group], layout, mask, num_splits)


@pytest.mark.cuda
@pytest.mark.parametrize("num_splits", [0, 1, 5])
@pytest.mark.parametrize("d, dtype", [(64, torch.bfloat16), (128, torch.float16)], ids=["d64-bf16", "d128-fp16"])
def test_decode_kernel_other_dtype(poison, d, dtype, num_splits):
    for group in ("gqa4-q1", "gqa8-q5"):
        run_decode_case(dtype, d, GROUPS[group], "paged16-leftpad", "causal", num_splits)


@pytest.mark.cuda
@pytest.mark.parametrize("d", [32, 96, 192, 256, 40, 20])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_kernel_head_dims(poison, d, dtype):
    """The other kernel head dims, one that runs the next larger kernel (40 ->
    64) and one that is not a multiple of 8 (20: q and the cache are copied,
    padded)."""
    import flashattn_ext

    if not any(kd >= d for kd in flashattn_ext.build_info()["head_dims"]):
        pytest.skip(f"no kernel head dim >= {d} in this build")
    for num_splits in (0, 1):
        run_decode_case(dtype, d, GROUPS["gqa4-q4"], "paged16-leftpad", "window-causal", num_splits, capacity=256)
        run_decode_case(dtype, d, GROUPS["gqa8-q1"], "contiguous", "none", num_splits, capacity=256)


@pytest.mark.cuda
def test_decode_kernel_long_cache_splits_agree(poison):
    """A long cache (8k keys) with the automatic split count and with explicit
    ones: all within the rule, and the explicit count is honoured (results
    differ only by summation order)."""
    seed = int(torch.randint(0, 2**31, (1,)))
    outs = []
    for s in (0, 1, 7, 200):
        torch.manual_seed(seed)  # the same inputs (CPU and CUDA generators) for every split count
        outs.append(run_decode_case(torch.bfloat16, 128, (32, 8, 1), "paged256", "none", s, capacity=8192, batch=2)[0])
    for o in outs[1:]:
        assert (o.float() - outs[0].float()).abs().max() <= 0.02 * outs[0].float().abs().max()


# ----------------------------------------------------------------------------- garbage in the cache's unused slots
# Cache slots past cache_seqlens (and before cache_leftpad) are not keys: a cache
# from torch.empty may hold NaN there. Neither path may let them reach the output
# (the CPU op slices the visible keys; the CUDA decode kernel zero-fills the keys
# outside its CTA's rows' range and never reads them). A NaN at a real key reaches
# only the queries that see it (the non-finite rule, csrc/cuda/nonfinite_fixup.cuh).


def _nan_slots_case(device, dtype, num_splits, layout):
    batch, seqlen_q, hq, hkv, d, cap = 3, 4, 4, 2, 32, 160
    seqlens, leftpad = [70, 0, cap], [5, 0, 9]
    q = randn((batch, seqlen_q, hq, d), dtype, device)
    kc, vc = randn((batch, cap, hkv, d), dtype, device), randn((batch, cap, hkv, d), dtype, device)
    kw = dict(
        cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=device),
        cache_leftpad=torch.tensor(leftpad, dtype=torch.int32, device=device),
        causal=True,
        num_splits=num_splits,
        return_softmax_lse=True,
    )
    nk, nv = kc.clone(), vc.clone()
    for b, (s, lp) in enumerate(zip(seqlens, leftpad)):
        for x in (nk, nv):
            x[b, s:] = float("nan")
            x[b, :lp] = float("nan")
    if layout == "paged":
        page = 16
        table = torch.arange(batch * cap // page, dtype=torch.int32, device=device).flip(0).reshape(batch, -1)

        def paged(x):
            out = torch.empty((batch * cap // page, page, hkv, d), dtype=dtype, device=device)
            out[table.long().flatten()] = x.reshape(-1, page, hkv, d)
            return out

        kc, vc, nk, nv = paged(kc), paged(vc), paged(nk), paged(nv)
        kw["block_table"] = table
    return q, (kc, vc), (nk, nv), kw


@pytest.mark.dtypes(torch.float32, torch.float16)
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_nan_in_unused_cache_slots_never_reaches_output(device, dtype, num_splits, layout):
    q, clean, dirty, kw = _nan_slots_case(device, dtype, num_splits, layout)
    out, lse = flash_attn_with_kvcache(q, *clean, **kw)
    out_n, lse_n = flash_attn_with_kvcache(q, *dirty, **kw)
    assert torch.isfinite(out_n).all() and not lse_n.isnan().any()
    assert torch.equal(out_n, out) and torch.equal(lse_n, lse)


@pytest.mark.dtypes(torch.float32, torch.float16)
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_nan_at_a_real_key_reaches_only_queries_that_see_it(device, dtype, num_splits):
    """Causal decode of 4 queries: the last key of row 0 is seen by query 3 only."""
    q, (kc, vc), _, kw = _nan_slots_case(device, dtype, num_splits, "contiguous")
    out, lse = flash_attn_with_kvcache(q, kc, vc, **kw)
    nv = vc.clone()
    nv[0, 69, 1, 7] = float("nan")  # key seqlens[0] - 1 of kv head 1 (query heads 2, 3)
    out_n, lse_n = flash_attn_with_kvcache(q, kc, nv, **kw)
    expect_nan = torch.zeros_like(out, dtype=torch.bool)
    expect_nan[0, 3, 2:, 7] = True
    assert torch.equal(out_n.isnan(), expect_nan)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out_n[~expect_nan], out[~expect_nan], atol=tol, rtol=tol)
    torch.testing.assert_close(lse_n, lse, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- the prefill route (CUDA)
# Long queries (seqlen_q >= 64, kvcache_cuda.cpp's prefill_route) on a contiguous
# cache without cache_batch_idx / cache_leftpad go to the warp-specialized TMA
# forward, which runs the batch as a dense one with per-row key counts
# (seqused_k = cache_seqlens + seqlen_new; flash_fwd_sm90_ws_kernel.cuh). Query
# lengths on both sides of its 128-row tiles, cache lengths 0, 1, full and
# ragged (the last key block cut inside the TMA box, whose rows past a row's
# keys are the cache's unused slots), a capacity that is not a multiple of the
# key blocks, GQA / MQA, with and without an append, the masks.

PREFILL_CAP = 1000
# name: (seqlen_q, seqlen_new, heads_q, heads_kv, d)
PREFILL_SHAPES = {
    "q100-append100-gqa4": (100, 100, 8, 2, 128),
    "q300-noappend-mha": (300, 0, 4, 4, 128),
    "q513-append513-mqa": (513, 513, 4, 1, 128),
    "q64-append17-gqa2-d64": (64, 17, 4, 2, 64),
    "q40-append8-gqa4": (40, 8, 8, 2, 128),  # just above the route's threshold
    "q129-noappend-gqa2-d256": (129, 0, 4, 2, 256),
}


def _prefill_seqlens(n_new, batch=5, cap=PREFILL_CAP):
    """cache_seqlens (before the append): full after it, empty (no key at all
    without an append), one key, ragged inside a key block, random."""
    top = cap - n_new
    lens = [top, 0, min(1, top), min(333, top)]
    return lens + [int(x) for x in torch.randint(0, top + 1, (batch - len(lens),))]


def run_prefill_case(shape, mask, dtype=torch.bfloat16, nan_slots=False, seqlens=None, device="cuda"):
    seqlen_q, n_new, hq, hkv, d = PREFILL_SHAPES[shape]
    seqlens = _prefill_seqlens(n_new) if seqlens is None else seqlens
    batch = len(seqlens)
    q = randn((batch, seqlen_q, hq, d), dtype, device)
    lk0 = randn((batch, PREFILL_CAP, hkv, d), dtype, device)
    lv0 = randn((batch, PREFILL_CAP, hkv, d), dtype, device)
    if nan_slots:  # what a cache from torch.empty may hold past the keys
        for b, s in enumerate(seqlens):
            lk0[b, s + n_new :] = float("nan")
            lv0[b, s + n_new :] = float("nan")
    k = randn((batch, n_new, hkv, d), dtype, device) if n_new else None
    v = randn((batch, n_new, hkv, d), dtype, device) if n_new else None
    kc, vc = lk0.clone(), lv0.clone()
    args = dict(k=k, v=v, cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=device), **MASKS[mask])

    def call():  # (an append writes the same rows again: cache_seqlens is not advanced)
        return flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True, **args)

    out, lse = call()
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (batch, hq, seqlen_q) and lse.dtype == torch.float32 and lse.is_contiguous()
    ek, ev, rows = oracle(q, lk0, lv0, k, v, seqlens, [0] * batch, **MASKS[mask])
    bad = check_rows(out, lse, rows, **MASKS[mask])
    assert not bad, "; ".join(bad)
    torch.testing.assert_close(kc, ek, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(vc, ev, rtol=0, atol=0, equal_nan=True)
    return out, lse, call


def _head_dim_built(d):
    import flashattn_ext

    return d in flashattn_ext.build_info()["head_dims"]


@pytest.mark.cuda
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("shape", list(PREFILL_SHAPES))
def test_prefill_route(poison, shape, mask):
    """Against the oracle (out, lse, the appended cache); on an H200 the profiler
    must show the TMA forward and not the decoding kernel."""
    if not _head_dim_built(PREFILL_SHAPES[shape][4]):
        pytest.skip("head dim not in this build")
    _, _, call = run_prefill_case(shape, mask)
    if is_sm90():
        names = cuda_kernel_names(call)
        assert any("flash_fwd_sm90_ws_kernel" in n for n in names), names
        assert not any("flash_decode" in n for n in names), names


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_prefill_route_nan_in_unused_cache_slots(poison, dtype, mask):
    """NaN in every slot past a row's keys (K and V, the last key block's TMA
    box included): the output and lse are finite and match the oracle
    (run_prefill_case). The keys are masked; 0 * NaN in P V sends the rows
    through the kernel's exact non-finite recompute, so the result is not
    bitwise the clean cache's (another summation order), only equally close."""
    seqlens = _prefill_seqlens(100)
    out_n, lse_n, _ = run_prefill_case("q100-append100-gqa4", mask, dtype=dtype, seqlens=seqlens, nan_slots=True)
    assert torch.isfinite(out_n).all() and not lse_n.isnan().any()


@pytest.mark.cuda
@pytest.mark.parametrize("mask", ["causal", "window"])
def test_prefill_route_matches_decode_kernel(poison, mask, monkeypatch):
    """The same call on both kernels (FLASHATTN_KVCACHE_PREFILL_MIN_Q moves the
    threshold, read on every call): both within the rule, outputs close."""
    seqlens = _prefill_seqlens(0)
    seed = int(torch.randint(0, 2**31, (1,)))
    torch.manual_seed(seed)
    out, lse, _ = run_prefill_case("q300-noappend-mha", mask, seqlens=seqlens)
    monkeypatch.setenv("FLASHATTN_KVCACHE_PREFILL_MIN_Q", str(1 << 30))
    torch.manual_seed(seed)
    out_d, lse_d, call = run_prefill_case("q300-noappend-mha", mask, seqlens=seqlens)
    if is_sm90():
        names = cuda_kernel_names(call)
        assert any("flash_decode_kernel" in n for n in names) and not any("sm90_ws" in n for n in names), names
    torch.testing.assert_close(out_d.float(), out.float(), atol=2e-2, rtol=2e-2)
    seen = torch.isfinite(lse)
    assert torch.equal(seen, torch.isfinite(lse_d))
    torch.testing.assert_close(lse_d[seen], lse[seen], atol=1e-3, rtol=1e-3)


# Which kernel a prefill (128 queries) with each cache view runs on an H200:
# the TMA forward reads contiguous caches with cache_batch_idx / cache_leftpad
# and paged ones (pages of 16 or 256 keys) through KvCacheView; a paged cache
# with cache_leftpad, an explicit split count and a short query stay on the
# decoding kernel.
PREFILL_VIEWS = {
    "leftpad": True,
    "batch_idx": True,
    "paged16": True,
    "paged256": True,
    "paged16-leftpad": False,
    "short": False,
    "num_splits": False,
}


@pytest.mark.cuda
@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("extra", list(PREFILL_VIEWS))
def test_prefill_route_cache_views(poison, extra, window):
    """A prefill through each cache view against the oracle; on an H200 the
    kernel it ran is the one PREFILL_VIEWS names."""
    device, dtype, d, hq, hkv, cap = "cuda", torch.bfloat16, 64, 4, 2, 512
    batch, seqlen_q = 3, (16 if extra == "short" else 128)
    q = randn((batch, seqlen_q, hq, d), dtype, device)
    lk, lv = randn((batch, cap, hkv, d), dtype, device), randn((batch, cap, hkv, d), dtype, device)
    seqlens = [400, 0, 130]
    mask = dict(window_size=(40, 0)) if window else dict(causal=True)
    kw = dict(cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=device), **mask)
    leftpad = [0] * batch
    kc, vc = lk, lv
    if "leftpad" in extra:
        leftpad = [5, 0, 17]
        kw["cache_leftpad"] = torch.tensor(leftpad, dtype=torch.int32, device=device)
    if extra == "batch_idx":  # the rows in a larger cache, permuted
        rows = [4, 0, 2]
        kc, vc = randn((5, cap, hkv, d), dtype, device), randn((5, cap, hkv, d), dtype, device)
        kc[rows], vc[rows] = lk, lv
        kw["cache_batch_idx"] = torch.tensor(rows, dtype=torch.int32, device=device)
    elif extra == "num_splits":
        kw["num_splits"] = 3
    elif extra.startswith("paged"):
        page = 256 if extra == "paged256" else 16
        kc, table = to_paged(lk, page=page)
        vc = randn(kc.shape, dtype, device)
        vc[table.long().flatten()] = lv.reshape(-1, page, hkv, d)
        kw["block_table"] = table

    def call():
        return flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True, **kw)

    out, lse = call()
    _, _, rows_ = oracle(q, lk, lv, None, None, seqlens, leftpad, **mask)
    bad = check_rows(out, lse, rows_, **mask)
    assert not bad, "; ".join(bad)
    if is_sm90():
        names = cuda_kernel_names(call)
        tma = any("sm90_ws" in n for n in names)
        assert tma == PREFILL_VIEWS[extra] and tma != any("flash_decode_kernel" in n for n in names), names


@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_prefill_cases_cpu(mask):
    """The prefill harness on the CPU op (the reference semantics; the route is
    a CUDA dispatch choice): the oracle, and NaN in the unused slots changes
    nothing."""
    seqlens = _prefill_seqlens(17)
    seed = int(torch.randint(0, 2**31, (1,)))
    torch.manual_seed(seed)
    out, lse, _ = run_prefill_case("q64-append17-gqa2-d64", mask, torch.float32, seqlens=seqlens, device="cpu")
    torch.manual_seed(seed)
    out_n, lse_n, _ = run_prefill_case(
        "q64-append17-gqa2-d64", mask, torch.float32, seqlens=seqlens, nan_slots=True, device="cpu"
    )
    assert torch.equal(out_n, out) and torch.equal(lse_n, lse)
