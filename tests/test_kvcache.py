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
from helpers import randn

from flashattn_ext import flash_attn_func, flash_attn_with_kvcache
from flashattn_ext.reference import compute_dtype
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


def check_rows(out, lse, rows, **kw):
    """Failure messages of every batch row against the oracle (empty: all pass)."""
    bad = []
    for b, (qb, kb, vb) in enumerate(rows):
        if kb.shape[0] == 0:  # no visible key: zeros, lse -inf
            if not (torch.equal(out[b], torch.zeros_like(out[b])) and torch.isneginf(lse[b]).all()):
                bad.append(f"row {b}: sees no key but out != 0 or lse != -inf")
            continue
        res = check_attention(qb[None], kb[None], vb[None], out[b][None], lse[b][None], **kw)
        bad += [f"row {b} (keys {kb.shape[0]}): {c.message()}" for c in res if not c.ok]
    return bad


def to_paged(kc, extra_blocks=3, generator=None):
    """A contiguous cache (batch, capacity, h, d) as a paged one with blocks in a
    random order (and unused blocks): (paged (num_blocks, PAGE, h, d), block_table)."""
    batch, cap, h, d = kc.shape
    per = cap // PAGE
    num_blocks = batch * per + extra_blocks
    perm = torch.randperm(num_blocks, generator=generator)[: batch * per]
    table = perm.view(batch, per).to(torch.int32)
    paged = randn((num_blocks, PAGE, h, d), kc.dtype, kc.device)
    paged[table.long().flatten()] = kc.reshape(batch * per, PAGE, h, d)
    return paged, table.to(kc.device)


def logical(paged, table):
    batch, per = table.shape
    return paged[table.long().flatten()].view(batch, per * PAGE, *paged.shape[2:])


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


def run_and_check(case, dtype, device, paged, expect_ok=True, **oracle_overrides):
    q, kc, vc, args, meta = setup(case, dtype, device, paged)
    kc0, vc0 = kc.clone(), vc.clone()
    lk0, lv0 = logical_rows(kc0, vc0, args, meta)
    out, lse = flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True, **args)
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
    bad = check_rows(out, lse, rows, **check_kw)
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


def test_equals_flash_attn_func_on_full_cache(device, dtype):
    """cache_seqlens = None attends to the whole cache: flash_attn_func on it."""
    q = randn((2, 3, 4, 16), dtype, device)
    kc, vc = randn((2, 32, 2, 16), dtype, device), randn((2, 32, 2, 16), dtype, device)
    out = flash_attn_with_kvcache(q, kc, vc, causal=True)
    assert torch.equal(out, flash_attn_func(q, kc, vc, causal=True))


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


def _base(device):
    dt = torch.float32
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
    "softcap": (lambda a, dev: a.update(softcap=5.0), NotImplementedError, "softcap"),
    "alibi": (lambda a, dev: a.update(alibi_slopes=torch.ones(4, device=dev)), NotImplementedError, "alibi_slopes"),
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
    a["k_cache"] = randn((6, page, 2, 16), torch.float32, dev)
    a["v_cache"] = randn((6, page, 2, 16), torch.float32, dev)
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


def _rot(a, d, rows=32, half=8, only=None, dtype=torch.float32):
    cos, sin = rotary_tables(rows, 2 * half, dtype, d) if half else (torch.ones(rows, 0, device=d),) * 2
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
            lambda a, d: a.update(rotary_cos=torch.ones(32, device=d), rotary_sin=torch.ones(32, device=d)),
            ValueError,
            "rotary_cos must be 2-D",
        ),
    }
)


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors(device, name):
    mutate, exc, pattern = ERRORS[name]
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
