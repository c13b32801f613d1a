"""flash_attn_varlen_func and the packed forms (flash_attn_{qkv,kv}packed_func,
flash_attn_varlen_{qkv,kv}packed_func): flash-attn's signatures and semantics.

Every sequence of a varlen batch is checked against the oracle on its own
(tolerance.check_attention: out, lse and the gradients under the one rule),
with causal aligned bottom-right per sequence; sequences of length 0 are checked
exactly (no rows / zero rows, lse -inf, zero gradients).

The varlen functions make one call of the fused varlen kernels (the
varlen_fwd / varlen_bwd ops, which read cu_seqlens on the device):
test_one_fused_call checks that, test_cuda_varlen_kernel_paths runs every CUDA
kernel that takes varlen batches (each head dim, Hopper and mma.sync,
atomic and deterministic dQ) against the oracle, and test_cuda_no_host_sync
runs forward and backward under torch.cuda.set_sync_debug_mode("error")."""

import re

import pytest
import torch
from helpers import KernelCalls, cuda_kernel_names, is_sm90, randn

import flashattn_ext
from flashattn_ext import (
    _ops,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from flashattn_ext.tolerance import check_attention


def cu(lens, device):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def make_varlen(lens_q, lens_k, hq, hkv, d, dtype, device):
    q = randn((sum(lens_q), hq, d), dtype, device)
    k = randn((sum(lens_k), hkv, d), dtype, device)
    v = randn((sum(lens_k), hkv, d), dtype, device)
    return q, k, v


def bounds(lens):
    c = [0, *torch.tensor(lens).cumsum(0).tolist()]
    return list(zip(c[:-1], c[1:]))


def run_varlen(q, k, v, lens_q, lens_k, dout=None, op_deterministic=None, **kw):
    """flash_attn_varlen_func(**kw), or with op_deterministic=True/False the
    varlen_attention op itself with that flag (torch's deterministic mode, which
    the poison fixture turns on, would otherwise force the deterministic dQ)."""
    leaves = [x.detach().requires_grad_(dout is not None) for x in (q, k, v)]
    cq, ck = cu(lens_q, q.device), cu(lens_k, q.device)
    if op_deterministic is None:
        out, lse = flash_attn_varlen_func(*leaves, cq, ck, max(lens_q), max(lens_k), return_lse=True, **kw)
    else:
        wl, wr = kw.get("window_size", (-1, -1))
        wr = 0 if kw.get("causal", False) else wr
        scale = kw.get("softmax_scale", q.shape[-1] ** -0.5)
        out, lse = _ops.varlen_attention(
            *leaves, cq, ck, max(lens_q), max(lens_k), scale, wl, wr, True, op_deterministic
        )
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[1], q.shape[0])
    assert lse.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32)
    grads = torch.autograd.grad(out, leaves, dout) if dout is not None else None
    return out, lse, grads


def check_varlen(q, k, v, lens_q, lens_k, with_grads=True, bottom_right=True, op_deterministic=None, **kw):
    """Ours against the oracle, sequence by sequence. Returns the list of
    failure messages (empty when all pass)."""
    dout = randn(q.shape, q.dtype, q.device) if with_grads else None
    out, lse, grads = run_varlen(q, k, v, lens_q, lens_k, dout, op_deterministic, **kw)
    dq, dk, dv = grads if grads is not None else (None, None, None)
    bad = []
    for i, ((sq, eq), (sk, ek)) in enumerate(zip(bounds(lens_q), bounds(lens_k))):
        n_q, n_k = eq - sq, ek - sk
        if n_q == 0:
            if grads is not None:  # keys nobody queries get no gradient
                assert torch.equal(dk[sk:ek], torch.zeros_like(dk[sk:ek])), f"sequence {i}: dk"
                assert torch.equal(dv[sk:ek], torch.zeros_like(dv[sk:ek])), f"sequence {i}: dv"
            continue
        if n_k == 0:  # rows that see no key
            assert torch.equal(out[sq:eq], torch.zeros_like(out[sq:eq])), f"sequence {i}: out"
            assert torch.isneginf(lse[:, sq:eq]).all(), f"sequence {i}: lse"
            if grads is not None:
                assert torch.equal(dq[sq:eq], torch.zeros_like(dq[sq:eq])), f"sequence {i}: dq"
            continue
        sl_q, sl_k = slice(sq, eq), slice(sk, ek)
        seq_kw = dict(kw)
        if seq_kw.get("alibi_slopes") is not None and seq_kw["alibi_slopes"].dim() == 2:
            seq_kw["alibi_slopes"] = seq_kw["alibi_slopes"][i]  # (batch, heads): per sequence
        g = None
        if grads is not None:
            g = (dq[sl_q][None], dk[sl_k][None], dv[sl_k][None])
        res = check_attention(
            q[sl_q][None],
            k[sl_k][None],
            v[sl_k][None],
            out[sl_q][None],
            lse[:, sl_q][None],
            dout[sl_q][None] if dout is not None else None,
            g,
            bottom_right=bottom_right,
            **seq_kw,
        )
        bad += [f"sequence {i} (len_q {n_q}, len_k {n_k}): {c.message()}" for c in res if not c.ok]
    return bad


# (lens_q, lens_k, heads_q, heads_kv, head_dim, kwargs)
CASES = {
    "equal-with-0-and-1": ([5, 0, 1, 17, 3], [5, 0, 1, 17, 3], 4, 4, 16, {}),
    "equal-causal": ([5, 0, 1, 17, 3], [5, 0, 1, 17, 3], 4, 4, 16, {"causal": True}),
    "q-shorter-causal-gqa": ([3, 1, 8, 0, 2], [9, 4, 8, 2, 2], 4, 2, 32, {"causal": True}),
    "q-longer-causal-mqa": ([9, 4, 1, 2, 6], [3, 0, 6, 2, 1], 4, 1, 16, {"causal": True}),
    "q-longer-noncausal": ([9, 4, 1, 3], [3, 2, 6, 0], 2, 2, 16, {}),
    "window": ([12, 1, 7, 4], [10, 5, 7, 9], 4, 2, 16, {"window_size": (3, 1)}),
    "window-causal": ([12, 6, 2], [7, 6, 9], 2, 1, 64, {"window_size": (2, 5), "causal": True}),
    "scale": ([7, 3], [4, 11], 2, 2, 16, {"softmax_scale": 0.3, "causal": True}),
    # Several query / key blocks of the CUDA kernels (64 and 128 rows) per sequence,
    # partial last blocks, empty sequences between long ones.
    "long-causal-gqa": ([130, 0, 257, 1, 64], [200, 3, 129, 0, 257], 4, 2, 64, {"causal": True}),
    "long-window-mqa": ([70, 193, 5], [300, 64, 129], 4, 1, 32, {"window_size": (40, 7)}),
    "all-keys-empty": ([3, 9], [0, 0], 2, 2, 16, {"causal": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_varlen_against_oracle(device, dtype, case):
    lens_q, lens_k, hq, hkv, d, kw = CASES[case]
    q, k, v = make_varlen(lens_q, lens_k, hq, hkv, d, dtype, device)
    bad = check_varlen(q, k, v, lens_q, lens_k, **kw)
    assert not bad, "; ".join(bad)


@pytest.mark.dtypes(torch.float32)
def _slopes(shape, device):
    return (torch.rand(shape, dtype=torch.float32) * 0.4 + 0.05).to(device)


# flash-attn's softcap and ALiBi (csrc/flash_params.h ScoreMod), forward and
# backward, each sequence's ALiBi distance from its own lengths.
@pytest.mark.dtypes(torch.float32, torch.bfloat16)
@pytest.mark.parametrize("mod", ["softcap", "alibi-h", "alibi-bh", "both-bh"])
@pytest.mark.parametrize(
    "case", ["equal-causal", "q-shorter-causal-gqa", "q-longer-noncausal", "window", "long-causal-gqa"]
)
def test_varlen_score_mod(device, dtype, case, mod):
    lens_q, lens_k, hq, hkv, d, kw = CASES[case]
    q, k, v = make_varlen(lens_q, lens_k, hq, hkv, d, dtype, device)
    b = len(lens_q)
    mods = {
        "softcap": dict(softcap=1.5),
        "alibi-h": dict(alibi_slopes=_slopes((hq,), device)),
        "alibi-bh": dict(alibi_slopes=_slopes((b, hq), device)),
        "both-bh": dict(softcap=2.0, alibi_slopes=_slopes((b, hq), device)),
    }
    bad = check_varlen(q, k, v, lens_q, lens_k, **kw, **mods[mod])
    assert not bad, "; ".join(bad)


def test_alignment_is_per_sequence_bottom_right(device, dtype):
    """The check can fail: the same outputs judged against a top-left diagonal
    (or against one offset for the whole batch) are wrong."""
    lens_q, lens_k = [3, 6, 2], [8, 6, 5]
    q, k, v = make_varlen(lens_q, lens_k, 2, 2, 16, dtype, device)
    assert not check_varlen(q, k, v, lens_q, lens_k, causal=True)
    assert check_varlen(q, k, v, lens_q, lens_k, causal=True, bottom_right=False)
    # A single bottom-right offset over the packed totals (total_k - total_q) is not the rule either.
    out, _, _ = run_varlen(q, k, v, lens_q, lens_k, causal=True)
    wrong = flash_attn_func(q[None], k[None], v[None], causal=True)[0]
    assert not torch.allclose(out, wrong, atol=1e-3)


def test_varlen_equals_per_sequence_calls(device, dtype):
    """Exactly flash_attn_func on each sequence; sequences do not see each other."""
    lens_q, lens_k = [4, 1, 7], [6, 3, 7]
    q, k, v = make_varlen(lens_q, lens_k, 4, 2, 16, dtype, device)
    out = flash_attn_varlen_func(q, k, v, cu(lens_q, device), cu(lens_k, device), 7, 7, causal=True)
    for (sq, eq), (sk, ek) in zip(bounds(lens_q), bounds(lens_k)):
        ref = flash_attn_func(q[None, sq:eq], k[None, sk:ek], v[None, sk:ek], causal=True)[0]
        assert torch.equal(out[sq:eq], ref)
    # Changing the second sequence's keys leaves the others alone.
    k2 = k.clone()
    k2[6:9] = randn((3, 2, 16), dtype, device)
    out2 = flash_attn_varlen_func(q, k2, v, cu(lens_q, device), cu(lens_k, device), 7, 7, causal=True)
    assert torch.equal(out2[:4], out[:4]) and torch.equal(out2[5:], out[5:])
    assert not torch.equal(out2[4:5], out[4:5])


@pytest.mark.dtypes(torch.float32, torch.bfloat16, torch.float16)
def test_varlen_max_seqlen_is_a_bound(device, dtype):
    lens = [3, 5]
    q, k, v = make_varlen(lens, lens, 2, 2, 16, dtype, device)
    a = flash_attn_varlen_func(q, k, v, cu(lens, device), cu(lens, device), 5, 5, causal=True)
    b = flash_attn_varlen_func(q, k, v, cu(lens, device), cu(lens, device), 64, 100, causal=True)
    assert torch.equal(a, b)


@pytest.mark.dtypes(torch.float32, torch.bfloat16)
def test_varlen_strided_inputs(device, dtype):
    """Views (a strided head_dim, a sliced head dim) give the contiguous answer."""
    lens_q, lens_k = [4, 0, 3], [2, 5, 3]
    q, k, v = make_varlen(lens_q, lens_k, 2, 2, 16, dtype, device)
    qs = torch.stack([q, torch.zeros_like(q)], -1)[..., 0]
    ks = torch.cat([k, torch.zeros_like(k)], -1)[..., :16]
    args = (cu(lens_q, device), cu(lens_k, device), 4, 5)
    assert qs.stride(-1) == 2
    assert torch.equal(flash_attn_varlen_func(qs, ks, v, *args), flash_attn_varlen_func(q, k, v, *args))


def test_varlen_all_queries_empty(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q = torch.zeros((0, 2, 16), device=device, dtype=dtype, requires_grad=True)
    k, v = (randn((5, 2, 16), dtype, device).requires_grad_() for _ in range(2))
    out, lse = flash_attn_varlen_func(q, k, v, cu([0, 0], device), cu([2, 3], device), 0, 3, return_lse=True)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)
    # Keys nobody queries get zero gradients (max_seqlen_q = 0: empty grids).
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.zeros_like(out))
    assert dq.shape == q.shape and torch.equal(dk, torch.zeros_like(dk)) and torch.equal(dv, torch.zeros_like(dv))


def test_one_fused_call(device):
    """One call of the varlen kernels for the whole batch, forward and backward
    (not one per sequence), and cu_seqlens reach them as given, on q's device."""
    dtype = torch.float32 if device == "cpu" else torch.float16
    lens_q, lens_k = [3, 0, 5, 1], [4, 2, 5, 0]
    q, k, v = (x.requires_grad_() for x in make_varlen(lens_q, lens_k, 4, 2, 16, dtype, device))
    cq, ck = cu(lens_q, device), cu(lens_k, device)
    with KernelCalls() as calls:
        out = flash_attn_varlen_func(q, k, v, cq, ck, 5, 5, causal=True)
        out.backward(torch.ones_like(out))
    assert [name for name, _ in calls.calls] == ["varlen_fwd", "varlen_bwd"]
    fwd_args = calls.calls[0][1]
    assert fwd_args[3] is cq and fwd_args[4] is ck and fwd_args[5:7] == (5, 5)


@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen_backward_poisoned(device, deterministic, poison):
    """Every output element is written (torch.empty returns NaNs here), with
    either dQ path, through the op (the poison fixture's deterministic mode
    would force deterministic=True through flash_attn_varlen_func)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    lens_q, lens_k = [70, 0, 1, 130], [3, 9, 0, 200]
    q, k, v = make_varlen(lens_q, lens_k, 4, 2, 64, dtype, device)
    bad = check_varlen(q, k, v, lens_q, lens_k, op_deterministic=deterministic, causal=True)
    assert not bad, "; ".join(bad)


def test_varlen_deterministic_is_bitwise(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    lens_q, lens_k = [150, 3, 0, 77], [200, 3, 5, 64]
    q, k, v = make_varlen(lens_q, lens_k, 4, 1, 64, dtype, device)
    dout = randn(q.shape, dtype, device)
    runs = [run_varlen(q, k, v, lens_q, lens_k, dout, deterministic=True)[2] for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("kernels", ["sm90-tma", "sm90-cp-async", "mma-sync"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic-dq"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256, 40])
def test_cuda_varlen_kernel_paths(head_dim, deterministic, kernels, monkeypatch, poison):
    """Every CUDA kernel that runs varlen batches, against the oracle: on an
    H200 the warp-specialized TMA forward and backward (64/96/128/192/256,
    atomic and deterministic dQ), with FLASHATTN_DISABLE_TMA=1 the Hopper
    cp.async forward (64/128/192/256) and backward (64/128, atomic dQ); with
    FLASHATTN_DISABLE_SM90=1 the mma.sync forward and backward; the
    deterministic dQ kernel; preprocessing and dQ conversion; head dim 40
    through the padded copy. Poisoned outputs: nothing unwritten."""
    if kernels == "sm90-cp-async":
        monkeypatch.setenv("FLASHATTN_DISABLE_TMA", "1")
    if kernels == "mma-sync":
        monkeypatch.setenv("FLASHATTN_DISABLE_SM90", "1")
    device, dtype = "cuda", torch.bfloat16
    lens_q, lens_k = [130, 0, 1, 257, 64, 17], [200, 5, 0, 129, 64, 300]
    for causal, hq, hkv in ((True, 4, 2), (False, 3, 1)):
        q, k, v = make_varlen(lens_q, lens_k, hq, hkv, head_dim, dtype, device)
        bad = check_varlen(q, k, v, lens_q, lens_k, op_deterministic=deterministic, causal=causal)
        assert not bad, f"causal={causal}: " + "; ".join(bad)


# The warp-specialized TMA forward on varlen batches (flash_fwd_sm90_ws_kernel.cuh):
# (lens_q, lens_k, heads_q, heads_kv, kwargs). Lengths 0 and 1, lengths on both
# sides of the query tiles (128 / 192 rows) and key blocks (64 / 128 rows), several
# tiles per sequence, keys empty where queries are not, GQA / MQA.
TMA_VARLEN_CASES = {
    "mixed-causal-gqa": (
        [0, 1, 127, 128, 129, 300, 191, 193, 64, 5],
        [3, 1, 0, 128, 130, 257, 200, 64, 65, 1],
        4,
        2,
        {"causal": True},
    ),
    "mixed-noncausal-mqa": ([1, 700, 0, 129, 63, 385], [700, 1, 9, 64, 129, 383], 6, 1, {}),
    "q-longer-causal": ([450, 17, 200], [100, 3, 199], 4, 4, {"causal": True}),
    "window": ([300, 5, 257], [300, 260, 129], 4, 2, {"window_size": (37, 5)}),
    # Long enough (max_seqlen_q >= 16 query tiles, few heads) for the scheduler to
    # hand out causal pairs (hopper/tile_scheduler.cuh): the shorter sequences pair
    # ranks inside their own query blocks.
    "long-causal-paired": ([4100, 1000, 0, 2500, 3, 129], [4100, 1000, 5, 2600, 3, 129], 2, 1, {"causal": True}),
}


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(TMA_VARLEN_CASES))
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_varlen_tma_forward(head_dim, dtype, case, monkeypatch, poison):
    """The forward of a varlen batch on the TMA kernel: against the oracle, and
    equal (bitwise, out and lse) to the same kernel's dense call on each
    sequence alone, whose tiles see zeros where the varlen tiles read the next
    sequence's rows (masked keys, query rows not stored). On an H200 the
    profiler must show the warp-specialized kernel."""
    device = "cuda"
    # The dense call of a short sequence against many keys (5 against 260) would
    # otherwise run on the decoding kernels (decode_route), not the same kernel.
    monkeypatch.setenv("FLASHATTN_DISABLE_DECODE_ROUTE", "1")
    lens_q, lens_k, hq, hkv, kw = TMA_VARLEN_CASES[case]
    q, k, v = make_varlen(lens_q, lens_k, hq, hkv, head_dim, dtype, device)
    bad = check_varlen(q, k, v, lens_q, lens_k, with_grads=False, **kw)
    assert not bad, "; ".join(bad)
    cq, ck = cu(lens_q, device), cu(lens_k, device)
    run = lambda: flash_attn_varlen_func(q, k, v, cq, ck, max(lens_q), max(lens_k), return_lse=True, **kw)  # noqa: E731
    out, lse = run()
    if is_sm90():
        assert any("flash_fwd_sm90_ws_kernel" in n for n in cuda_kernel_names(run))
    for i, ((sq, eq), (sk, ek)) in enumerate(zip(bounds(lens_q), bounds(lens_k))):
        if eq == sq or ek == sk:  # checked by check_varlen (a dense call takes no empty sequence)
            continue
        ref, ref_lse = flash_attn_func(q[None, sq:eq], k[None, sk:ek], v[None, sk:ek], return_lse=True, **kw)
        assert torch.equal(out[sq:eq], ref[0]), f"sequence {i}: out differs from the dense call"
        assert torch.equal(lse[:, sq:eq], ref_lse[0]), f"sequence {i}: lse differs from the dense call"


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_varlen_tma_nonfinite_neighbour(head_dim):
    """The TMA forward reads past a sequence's end into the next one (the last
    key block of sequence 0 holds rows of sequence 1). Non-finite keys and
    values there are masked or recomputed (the non-finite rule's exact path):
    sequence 0 still matches the oracle, and so does sequence 2, whose rows
    follow the ones with the non-finite values."""
    device, dtype = "cuda", torch.bfloat16
    lens = [100, 50, 30]
    q, k, v = make_varlen(lens, lens, 4, 2, head_dim, dtype, device)
    k[100], v[100] = float("inf"), float("nan")  # the first row of sequence 1
    k[101], v[101] = float("nan"), float("inf")
    for causal in (False, True):
        out, lse = flash_attn_varlen_func(
            q, k, v, cu(lens, device), cu(lens, device), 100, 100, causal=causal, return_lse=True
        )
        res = check_attention(
            q[None, :100], k[None, :100], v[None, :100], out[None, :100], lse[None, :, :100], causal=causal
        )
        assert all(c.ok for c in res), f"causal={causal}: " + "; ".join(c.message() for c in res if not c.ok)
        res = check_attention(
            q[None, 150:], k[None, 150:], v[None, 150:], out[None, 150:], lse[None, :, 150:], causal=causal
        )
        assert all(c.ok for c in res), f"causal={causal}, sequence 2: " + "; ".join(
            c.message() for c in res if not c.ok
        )


# The warp-specialized TMA backward on varlen batches (flash_bwd_sm90_ws_kernel.cuh
# for head dims 64/96/128, flash_bwd_sm90_ws_split_kernel.cuh for 192/256).
TMA_BWD_KERNELS = ("flash_bwd_sm90_ws_kernel", "flash_bwd_sm90_ws_split_kernel")


def _grads_of(q, k, v, dout, fn):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    return torch.autograd.grad(out, leaves, dout)


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(TMA_VARLEN_CASES))
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic-dq"])
def test_cuda_varlen_tma_backward(head_dim, dtype, case, deterministic, monkeypatch, poison):
    """The backward of a varlen batch on the TMA kernels: against the oracle,
    and equal (bitwise) to the same kernel's dense call on each sequence alone:
    the kernel zeroes the rows past a sequence's end in shared memory, so its
    tiles hold what TMA's zero fill gives the dense call. dK and dV always
    (the same sweep order); dQ in deterministic mode, where the key blocks add
    in the same fixed order (the plain order: FLASHATTN_DQ_PLAIN_ORDER=1, as
    varlen batches never rotate). On an H200 the profiler must show a
    warp-specialized backward kernel."""
    device = "cuda"
    monkeypatch.setenv("FLASHATTN_DQ_PLAIN_ORDER", "1")
    monkeypatch.setenv("FLASHATTN_DISABLE_DECODE_ROUTE", "1")  # the dense calls on the same kernels (see above)
    lens_q, lens_k, hq, hkv, kw = TMA_VARLEN_CASES[case]
    q, k, v = make_varlen(lens_q, lens_k, hq, hkv, head_dim, dtype, device)
    bad = check_varlen(q, k, v, lens_q, lens_k, op_deterministic=deterministic, **kw)
    assert not bad, "; ".join(bad)
    cq, ck = cu(lens_q, device), cu(lens_k, device)
    dout = randn(q.shape, dtype, device)
    wl, wr = kw.get("window_size", (-1, -1))
    wr = 0 if kw.get("causal", False) else wr
    scale = head_dim**-0.5

    def varlen(q_, k_, v_):
        return _ops.varlen_attention(q_, k_, v_, cq, ck, max(lens_q), max(lens_k), scale, wl, wr, True, deterministic)[
            0
        ]

    run = lambda: _grads_of(q, k, v, dout, varlen)  # noqa: E731
    dq, dk, dv = run()
    if is_sm90():
        names = cuda_kernel_names(run)
        assert any(any(t in n for t in TMA_BWD_KERNELS) for n in names), names
    for i, ((sq, eq), (sk, ek)) in enumerate(zip(bounds(lens_q), bounds(lens_k))):
        if eq == sq or ek == sk:  # checked by check_varlen (a dense call takes no empty sequence)
            continue

        def dense(q_, k_, v_):
            return _ops.attention(q_[None], k_[None], v_[None], scale, wl, wr, True, deterministic)[0][0]

        rq, rk, rv = _grads_of(q[sq:eq], k[sk:ek], v[sk:ek], dout[sq:eq], dense)
        assert torch.equal(dk[sk:ek], rk), f"sequence {i}: dk differs from the dense call"
        assert torch.equal(dv[sk:ek], rv), f"sequence {i}: dv differs from the dense call"
        if deterministic:
            assert torch.equal(dq[sq:eq], rq), f"sequence {i}: dq differs from the dense call"


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic-dq"])
def test_cuda_varlen_tma_backward_nonfinite_neighbour(head_dim, deterministic):
    """The TMA backward reads past a sequence's end into the next one: the last
    query block of sequence 0 holds Q / dO rows of sequence 1, its last key
    block K / V rows. Non-finite values there must not reach sequence 0's
    gradients (0 * inf in a product: the kernel zeroes those rows in shared
    memory), nor sequence 2's, whose rows follow."""
    device, dtype = "cuda", torch.bfloat16
    lens = [100, 50, 30]
    q, k, v = make_varlen(lens, lens, 4, 2, head_dim, dtype, device)
    dout = randn(q.shape, dtype, device)
    for t in (q, k, v, dout):  # the first rows of sequence 1
        t[100], t[101] = float("inf"), float("nan")
    c = cu(lens, device)
    for causal in (False, True):
        wr = 0 if causal else -1

        def varlen(q_, k_, v_):
            return _ops.varlen_attention(q_, k_, v_, c, c, 100, 100, head_dim**-0.5, -1, wr, True, deterministic)

        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out, lse = varlen(*leaves)
        dq, dk, dv = torch.autograd.grad(out, leaves, dout)
        for lo, hi in ((0, 100), (150, 180)):
            s = slice(lo, hi)
            res = check_attention(
                q[None, s],
                k[None, s],
                v[None, s],
                out[None, s],
                lse[None, :, s],
                dout[None, s],
                (dq[None, s], dk[None, s], dv[None, s]),
                causal=causal,
            )
            assert all(r.ok for r in res), f"causal={causal}, rows {lo}:{hi}: " + "; ".join(
                r.message() for r in res if not r.ok
            )


@pytest.mark.cuda
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_varlen_backward_dispatch(monkeypatch, deterministic):
    """run_bwd sends varlen batches to the warp-specialized TMA backward on sm90
    (head dims 128 and 256: both kernels) and FLASHATTN_DISABLE_TMA=1 to the
    fallbacks (the cp.async wgmma kernel; deterministic: the mma.sync dQ pass),
    with the same results up to rounding."""
    if not is_sm90():
        pytest.skip("the TMA kernels run on sm90 only")
    device, dtype = "cuda", torch.bfloat16
    lens_q, lens_k = [130, 0, 1, 257], [200, 5, 0, 129]
    for d, kernel in ((128, "flash_bwd_sm90_ws_kernel"), (256, "flash_bwd_sm90_ws_split_kernel")):
        q, k, v = make_varlen(lens_q, lens_k, 4, 2, d, dtype, device)
        dout = randn(q.shape, dtype, device)
        cq, ck = cu(lens_q, device), cu(lens_k, device)

        def varlen(q_, k_, v_):
            return _ops.varlen_attention(q_, k_, v_, cq, ck, 257, 200, d**-0.5, -1, 0, True, deterministic)[0]

        run = lambda: _grads_of(q, k, v, dout, varlen)  # noqa: E731
        monkeypatch.delenv("FLASHATTN_DISABLE_TMA", raising=False)
        names = cuda_kernel_names(run)
        assert any(kernel in n for n in names), names
        tma = run()
        monkeypatch.setenv("FLASHATTN_DISABLE_TMA", "1")
        names = cuda_kernel_names(run)
        assert not any(any(t in n for t in TMA_BWD_KERNELS) for n in names), names
        for a, b in zip(run(), tma):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=0)


@pytest.mark.cuda
def test_cuda_varlen_forward_dispatch(monkeypatch):
    """run_fwd sends varlen batches to the warp-specialized TMA kernel on sm90
    and FLASHATTN_DISABLE_TMA=1 to the cp.async wgmma kernel (the fallback),
    with the same results up to rounding."""
    if not is_sm90():
        pytest.skip("the TMA kernels run on sm90 only")
    device, dtype = "cuda", torch.bfloat16
    lens_q, lens_k = [130, 0, 1, 257], [200, 5, 0, 129]
    q, k, v = make_varlen(lens_q, lens_k, 4, 2, 128, dtype, device)
    cq, ck = cu(lens_q, device), cu(lens_k, device)
    run = lambda: flash_attn_varlen_func(q, k, v, cq, ck, 257, 200, causal=True)  # noqa: E731
    names = cuda_kernel_names(run)
    assert any("flash_fwd_sm90_ws_kernel" in n for n in names), names
    tma = run()
    monkeypatch.setenv("FLASHATTN_DISABLE_TMA", "1")
    names = cuda_kernel_names(run)
    assert any("flash_fwd_sm90_kernel" in n for n in names), names
    assert not any("flash_fwd_sm90_ws_kernel" in n for n in names), names
    torch.testing.assert_close(run(), tma, atol=2e-2, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_no_host_sync(deterministic):
    """Forward and backward never synchronise the host with the device: the
    kernels read cu_seqlens where they are (flash-attn's contract)."""
    device, dtype = "cuda", torch.float16
    lens_q, lens_k = [5, 0, 130, 1], [7, 3, 129, 0]
    q, k, v = (x.requires_grad_() for x in make_varlen(lens_q, lens_k, 4, 2, 64, dtype, device))
    cq, ck = cu(lens_q, device), cu(lens_k, device)
    dout = randn(q.shape, dtype, device)
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, lse = flash_attn_varlen_func(
            q, k, v, cq, ck, 130, 129, causal=True, deterministic=deterministic, return_lse=True
        )
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        qkv = torch.stack([q.detach(), q.detach(), q.detach()], 1).requires_grad_()
        flash_attn_varlen_qkvpacked_func(qkv, cq, 130).backward(dout)
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()


@pytest.mark.cuda
def test_cuda_bad_cu_seqlens_stay_in_bounds():
    """The CUDA path cannot check cu_seqlens' values without a synchronisation:
    wrong values give unspecified rows but no access outside the tensors (the
    kernels clamp them); the device stays usable. compute-sanitizer (memcheck)
    on this test shows the accesses."""
    device, dtype = "cuda", torch.float16
    q, k, v = (x.requires_grad_() for x in make_varlen([9, 4], [6, 6], 4, 2, 64, dtype, device))
    bad = {
        "decreasing": ([0, 9, 2], [0, 12, 6]),
        "past-the-end": ([0, 500, 100000], [0, -7, 2**31 - 1]),
        "negative": ([-100, -1, 13], [0, 6, 12]),
    }
    for cq, ck in bad.values():
        cq, ck = torch.tensor(cq, dtype=torch.int32, device=device), torch.tensor(ck, dtype=torch.int32, device=device)
        for det in (False, True):
            out = flash_attn_varlen_func(q, k, v, cq, ck, 9, 6, causal=True, deterministic=det)
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    # A max_seqlen below the longest sequence cuts it (rows past the bound are not computed).
    flash_attn_varlen_func(q, k, v, cu([9, 4], device), cu([6, 6], device), 2, 2)
    torch.cuda.synchronize()
    assert not check_varlen(q, k, v, [9, 4], [6, 6], causal=True)  # the device still works


def test_varlen_compiles_without_graph_break(device):
    """No host read of cu_seqlens anywhere: torch.compile(fullgraph=True) traces it."""
    torch._dynamo.reset()
    dtype = torch.float32 if device == "cpu" else torch.float16
    lens_q, lens_k = [3, 0, 6], [5, 2, 6]
    q, k, v = (x.requires_grad_() for x in make_varlen(lens_q, lens_k, 4, 2, 16, dtype, device))
    cq, ck = cu(lens_q, device), cu(lens_k, device)

    def f(q, k, v, cq, ck):
        return flash_attn_varlen_func(q * 2, k, v, cq, ck, 6, 6, causal=True).square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    expected = torch.autograd.grad(f(q, k, v, cq, ck), (q, k, v))
    got = torch.autograd.grad(compiled(q, k, v, cq, ck), (q, k, v))
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e)


def test_varlen_vmap_and_grad(device):
    """torch.func: vmap folds the vmapped dimension into the heads (cu_seqlens
    shared); grad goes through the varlen backward (deterministic: bitwise
    comparable on CUDA too). vmap over cu_seqlens raises."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    lens_q, lens_k = [4, 0, 7], [6, 3, 7]
    cq, ck = cu(lens_q, device), cu(lens_k, device)
    qs = randn((3, sum(lens_q), 4, 16), dtype, device)
    ks, vs = randn((3, sum(lens_k), 2, 16), dtype, device), randn((3, sum(lens_k), 2, 16), dtype, device)

    def f(q, k, v):
        return flash_attn_varlen_func(q, k, v, cq, ck, 7, 7, causal=True, deterministic=True)

    got = torch.func.vmap(f)(qs, ks, vs)
    expected = torch.stack([f(qs[i], ks[i], vs[i]) for i in range(3)])
    assert torch.equal(got, expected) if device == "cpu" else torch.allclose(got, expected, atol=1e-2)
    g = torch.func.grad(lambda q: f(q, ks[0], vs[0]).float().square().sum())(qs[0])
    q0 = qs[0].clone().requires_grad_()
    (ref,) = torch.autograd.grad(f(q0, ks[0], vs[0]).float().square().sum(), q0)
    assert torch.equal(g, ref)
    per_sample = torch.func.vmap(torch.func.grad(lambda q, k, v: f(q, k, v).float().square().sum()))(qs, ks, vs)
    for i in range(3):
        qi = qs[i].clone().requires_grad_()
        (ri,) = torch.autograd.grad(f(qi, ks[i], vs[i]).float().square().sum(), qi)
        torch.testing.assert_close(per_sample[i], ri)
    with pytest.raises(NotImplementedError, match="vmap over cu_seqlens"):
        torch.func.vmap(lambda c: flash_attn_varlen_func(qs[0], ks[0], vs[0], c, ck, 7, 7))(cq.expand(2, -1))


# ----------------------------------------------------------------------------- packed forms


def _grads(out, leaves, dout):
    return torch.autograd.grad(out, leaves, dout)


@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked(device, dtype, causal):
    qkv = randn((2, 9, 3, 4, 16), dtype, device).requires_grad_()
    with KernelCalls() as calls:
        out = flash_attn_qkvpacked_func(qkv, causal=causal)
    # The kernels read q, k, v in place: views into qkv, no copy.
    fwd_args = next(args for name, args in calls.calls if name == "fwd")
    for x in fwd_args[:3]:
        assert x.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    q, k, v = (qkv.detach()[:, :, i].clone().requires_grad_() for i in range(3))
    ref = flash_attn_func(q, k, v, causal=causal)
    assert torch.equal(out, ref)
    dout = randn(out.shape, dtype, device)
    (dqkv,) = _grads(out, [qkv], dout)
    assert torch.equal(dqkv, torch.stack(_grads(ref, [q, k, v], dout), dim=2))


@pytest.mark.parametrize("heads_kv", [4, 2, 1])
def test_kvpacked(device, dtype, heads_kv):
    q = randn((2, 5, 4, 16), dtype, device).requires_grad_()
    kv = randn((2, 8, 2, heads_kv, 16), dtype, device).requires_grad_()
    out, lse = flash_attn_kvpacked_func(q, kv, causal=True, window_size=(3, -1), return_lse=True)
    k, v = (kv.detach()[:, :, i].clone().requires_grad_() for i in range(2))
    q2 = q.detach().clone().requires_grad_()
    ref, ref_lse = flash_attn_func(q2, k, v, causal=True, window_size=(3, -1), return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    dout = randn(out.shape, dtype, device)
    dq, dkv = _grads(out, [q, kv], dout)
    rq, rk, rv = _grads(ref, [q2, k, v], dout)
    assert torch.equal(dq, rq) and torch.equal(dkv, torch.stack([rk, rv], dim=2))


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_qkvpacked(device, dtype, causal):
    lens = [6, 0, 1, 9]
    qkv = randn((sum(lens), 3, 2, 16), dtype, device).requires_grad_()
    c = cu(lens, device)
    out, lse = flash_attn_varlen_qkvpacked_func(qkv, c, 9, causal=causal, return_lse=True)
    q, k, v = (qkv.detach()[:, i].clone().requires_grad_() for i in range(3))
    ref, ref_lse = flash_attn_varlen_func(q, k, v, c, c, 9, 9, causal=causal, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    dout = randn(out.shape, dtype, device)
    (dqkv,) = _grads(out, [qkv], dout)
    assert torch.equal(dqkv, torch.stack(_grads(ref, [q, k, v], dout), dim=1))


def test_varlen_kvpacked(device, dtype):
    lens_q, lens_k = [3, 0, 5, 2], [7, 2, 1, 0]
    q = randn((sum(lens_q), 4, 16), dtype, device).requires_grad_()
    kv = randn((sum(lens_k), 2, 2, 16), dtype, device).requires_grad_()
    cq, ck = cu(lens_q, device), cu(lens_k, device)
    out = flash_attn_varlen_kvpacked_func(q, kv, cq, ck, 5, 7, causal=True)
    k, v = (kv.detach()[:, i].clone().requires_grad_() for i in range(2))
    q2 = q.detach().clone().requires_grad_()
    ref = flash_attn_varlen_func(q2, k, v, cq, ck, 5, 7, causal=True)
    assert torch.equal(out, ref)
    dout = randn(out.shape, dtype, device)
    dq, dkv = _grads(out, [q, kv], dout)
    rq, rk, rv = _grads(ref, [q2, k, v], dout)
    assert torch.equal(dq, rq) and torch.equal(dkv, torch.stack([rk, rv], dim=1))


# ----------------------------------------------------------------------------- errors


def _valid(device):
    lens_q, lens_k = [3, 2], [4, 4]
    q, k, v = make_varlen(lens_q, lens_k, 4, 2, 16, torch.float32 if device == "cpu" else torch.float16, device)
    return dict(
        q=q, k=k, v=v, cu_seqlens_q=cu(lens_q, device), cu_seqlens_k=cu(lens_k, device), max_seqlen_q=3, max_seqlen_k=4
    )


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


# name -> (changes to the valid call, exception, message pattern)
VARLEN_ERRORS = {
    "cu_q-not-tensor": (lambda a, d: dict(cu_seqlens_q=[0, 3, 5]), TypeError, r"cu_seqlens_q must be a torch.Tensor"),
    "cu_q-int64": (lambda a, d: dict(cu_seqlens_q=a["cu_seqlens_q"].long()), TypeError, r"cu_seqlens_q .*int32"),
    "cu_k-float": (lambda a, d: dict(cu_seqlens_k=a["cu_seqlens_k"].float()), TypeError, r"cu_seqlens_k .*int32"),
    "cu_q-2d": (lambda a, d: dict(cu_seqlens_q=a["cu_seqlens_q"][None]), ValueError, r"cu_seqlens_q must be 1-D"),
    "cu_k-one-element": (lambda a, d: dict(cu_seqlens_k=_i32([8], d)), ValueError, r"cu_seqlens_k must have batch"),
    "cu_q-start": (lambda a, d: dict(cu_seqlens_q=_i32([1, 3, 5], d)), ValueError, r"cu_seqlens_q must start at 0"),
    "cu_k-decreasing": (
        lambda a, d: dict(cu_seqlens_k=_i32([0, 6, 4, 8], d), cu_seqlens_q=_i32([0, 1, 3, 5], d)),
        ValueError,
        r"cu_seqlens_k must be non-decreasing",
    ),
    "cu_q-total": (lambda a, d: dict(cu_seqlens_q=_i32([0, 3, 4], d)), ValueError, r"cu_seqlens_q ends at 4 .* 5"),
    "cu_k-total": (lambda a, d: dict(cu_seqlens_k=_i32([0, 4, 9], d)), ValueError, r"cu_seqlens_k ends at 9 .* 8"),
    "cu-batch-mismatch": (
        lambda a, d: dict(cu_seqlens_k=_i32([0, 4, 6, 8], d)),
        ValueError,
        r"cu_seqlens_q has 3 elements but cu_seqlens_k has 4",
    ),
    "cu_q-device": (
        lambda a, d: dict(cu_seqlens_q=a["cu_seqlens_q"].to("meta" if d == "cpu" else "cpu")),
        ValueError,
        r"cu_seqlens_q is on",
    ),
    "max_seqlen_q-small": (lambda a, d: dict(max_seqlen_q=2), ValueError, r"max_seqlen_q=2 is smaller .* \(3\)"),
    "max_seqlen_k-small": (lambda a, d: dict(max_seqlen_k=3), ValueError, r"max_seqlen_k=3 is smaller .* \(4\)"),
    "max_seqlen_k-type": (lambda a, d: dict(max_seqlen_k=4.0), TypeError, r"max_seqlen_k must be an int"),
    "q-rank4": (lambda a, d: dict(q=a["q"][None]), ValueError, r"q must have 3 dimensions"),
    "k-rank2": (lambda a, d: dict(k=a["k"][:, 0]), ValueError, r"k must have 3 dimensions"),
    "v-rank4": (lambda a, d: dict(v=a["v"][None]), ValueError, r"v must have 3 dimensions"),
    "q-not-tensor": (lambda a, d: dict(q=a["q"].tolist()), TypeError, r"q must be a torch.Tensor"),
    "heads-divisibility": (lambda a, d: dict(q=a["q"][:, :3]), ValueError, r"3 heads, not a multiple of the 2"),
    "v-heads": (lambda a, d: dict(v=a["v"][:, :1]), ValueError, r"v has 1 heads but k has 2"),
    "v-tokens": (lambda a, d: dict(v=a["v"][:7]), ValueError, r"v has 7 tokens but k has 8"),
    "head_dim": (lambda a, d: dict(k=a["k"][..., :8]), ValueError, r"head_dim differs: q 16, k 8"),
    "dtype": (lambda a, d: dict(k=a["k"].double()), TypeError, r"k has dtype Double but q"),
    "k-device": (lambda a, d: dict(k=a["k"].to("meta")), ValueError, r"k is on meta"),
    "softcap": (lambda a, d: dict(softcap=float("nan")), ValueError, r"softcap must be a finite number >= 0"),
    "alibi_slopes": (
        lambda a, d: dict(alibi_slopes=torch.ones(3, device=d)),
        ValueError,
        r"alibi_slopes must have shape \(nheads,\)",
    ),
    "return_attn_probs": (lambda a, d: dict(return_attn_probs=True), NotImplementedError, r"return_attn_probs"),
    # block_table's errors: test_varlen_paged_errors.
    "window_size": (lambda a, d: dict(window_size=(-2, 0)), ValueError, r"window_size"),
    "dropout_p": (lambda a, d: dict(dropout_p=1.5), ValueError, r"dropout_p must be in \[0, 1\]"),
    "softmax_scale": (lambda a, d: dict(softmax_scale=float("inf")), ValueError, r"softmax_scale must be finite"),
}


# Checks of cu_seqlens' values, which need them on the host: made by the CPU
# kernels only (on CUDA they would synchronise; test_cuda_bad_cu_seqlens_stay_in_bounds).
VALUE_CHECKS = {"cu_q-start", "cu_k-decreasing", "cu_q-total", "cu_k-total", "max_seqlen_q-small", "max_seqlen_k-small"}


@pytest.mark.parametrize("case", list(VARLEN_ERRORS))
def test_varlen_errors(device, case):
    args = _valid(device)
    flash_attn_varlen_func(**args)  # the valid call passes
    change, exc, pattern = VARLEN_ERRORS[case]
    args.update(change(args, device))
    if case == "return_attn_probs":  # served (both devices): S_dmask, None without dropout
        assert flash_attn_varlen_func(**args)[2] is None
        return
    if device == "cuda" and case in VALUE_CHECKS:
        out = flash_attn_varlen_func(**args)  # not checked: no error, no access outside the tensors
        torch.cuda.synchronize()
        assert out.shape == args["q"].shape
        return
    with pytest.raises(exc, match=pattern) as info:
        flash_attn_varlen_func(**args)
    assert "flash_attn_varlen_func" in str(info.value) or "flashattn_ext" in str(info.value)


def _op_args(device):
    a = _valid(device)
    return [a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 3, 4, 0.25, -1, 0, True]


# The varlen ops' own checks (csrc/attention_api.cpp check_varlen_qkv), the
# same in the fake kernels (flashattn_ext/_ops.py): index -> replacement.
OP_ERRORS = {
    "q-rank4": (0, lambda x: x[None], ValueError, r"q must have 3 dimensions"),
    "k-dtype": (1, lambda x: x.double(), TypeError, r"k has dtype Double but q"),
    "v-heads-zero": (2, lambda x: x[:, :0], ValueError, r"v has shape .*heads and head_dim must be at least 1"),
    "v-tokens": (2, lambda x: x[:7], ValueError, r"v has 7 tokens but k has 8"),
    "head_dim": (1, lambda x: x[..., :8], ValueError, r"head_dim differs: q 16, k 8, v 16"),
    "heads": (0, lambda x: x[:, :3], ValueError, r"q has 3 heads, not a multiple of the 2"),
    "q-stride": (0, lambda x: torch.cat([x, x], -1)[..., ::2], ValueError, r"q must have stride 1"),
    "cu-int64": (3, lambda x: x.long(), TypeError, r"cu_seqlens_q must have dtype int32, got Long"),
    "cu-2d": (4, lambda x: x[None], ValueError, r"cu_seqlens_k must be 1-D"),
    "cu-short": (4, lambda x: x[:1], ValueError, r"cu_seqlens_k must have batch \+ 1 >= 2"),
    "cu-strided": (3, lambda x: torch.stack([x, x], -1)[:, 0], ValueError, r"cu_seqlens_q must be contiguous"),
    "cu-batch": (
        4,
        lambda x: torch.cat([x, x[-1:]]),
        ValueError,
        r"cu_seqlens_q has 3 elements but cu_seqlens_k has 4",
    ),
    "max-negative": (5, lambda x: -1, ValueError, r"max_seqlen_q must be in \[0, 2\^31 - 1\]"),
    "scale": (7, lambda x: float("nan"), ValueError, r"softmax_scale must be finite"),
}


@pytest.mark.parametrize("case", list(OP_ERRORS))
def test_varlen_op_errors_match_fake(device, case):
    """The op and its fake (meta) kernel reject the same inputs with the same words."""
    i, change, exc, pattern = OP_ERRORS[case]
    args = _op_args(device)
    args[i] = change(args[i])
    with pytest.raises(exc, match=pattern):
        _ops.varlen_fwd(*args)
    meta = [
        torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta") if isinstance(a, torch.Tensor) else a
        for a in args
    ]
    with pytest.raises(exc, match=pattern):
        _ops.varlen_fwd(*meta)


def test_packed_errors(device):
    dtype = torch.float32 if device == "cpu" else torch.float16
    qkv = randn((2, 5, 3, 2, 16), dtype, device)
    with pytest.raises(ValueError, match=re.escape("qkv must have shape (batch, seqlen, 3, heads, head_dim)")):
        flash_attn_qkvpacked_func(qkv[:, :, :2])
    with pytest.raises(ValueError, match="qkv must have shape"):
        flash_attn_qkvpacked_func(qkv[0])
    with pytest.raises(ValueError, match=re.escape("kv must have shape (batch, seqlen_k, 2, heads_kv, head_dim)")):
        flash_attn_kvpacked_func(qkv[:, :, 0], qkv)
    with pytest.raises(ValueError, match=re.escape("qkv must have shape (total, 3, heads, head_dim)")):
        flash_attn_varlen_qkvpacked_func(qkv, cu([5, 5], device), 5)
    with pytest.raises(ValueError, match=re.escape("kv must have shape (total_k, 2, heads_kv, head_dim)")):
        flash_attn_varlen_kvpacked_func(qkv[0, :, 0], qkv[0], cu([5], device), cu([5], device), 5, 5)
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor"):
        flash_attn_qkvpacked_func(qkv.tolist())
    # return_attn_probs is served (tests/test_dropout.py): S_dmask, None without dropout.
    assert flash_attn_qkvpacked_func(qkv, return_attn_probs=True)[2] is None
    assert flash_attn_varlen_qkvpacked_func(qkv[0], cu([5], device), 5, return_attn_probs=True)[2] is None
    if device == "cpu":  # a value of cu_seqlens: checked on the CPU only (on CUDA it would need a host sync)
        with pytest.raises(ValueError, match="cu_seqlens_q ends at 4"):
            flash_attn_varlen_qkvpacked_func(qkv[0], cu([4], device), 5)


def test_exported():
    for name in (
        "flash_attn_varlen_func",
        "flash_attn_qkvpacked_func",
        "flash_attn_kvpacked_func",
        "flash_attn_varlen_qkvpacked_func",
        "flash_attn_varlen_kvpacked_func",
    ):
        assert name in flashattn_ext.__all__ and callable(getattr(flashattn_ext, name))


# ----------------------------------------------------------------------------- paged k/v (block_table)
#
# flash-attn 2.8's flash_attn_varlen_func(..., block_table=...): k and v are
# paged caches (num_blocks, page_block_size, heads_kv, head_dim), key position
# p of sequence b at block_table[b, p // page], row p % page; cu_seqlens_k
# gives the lengths only. The CPU and CUDA serve it (forward only); other
# devices raise NotImplementedError naming block_table (checked here on the
# meta device).


def make_paged(keys, page, dtype, device, generator=None, fill=float("nan")):
    """Each sequence's contiguous keys (n_b, h, d) scattered into shuffled pages
    of a paged cache, every other row (unused pages, the tail of a sequence's
    last page) `fill` (NaN: a kernel reading anything but the sequence's own
    keys fails the checks), and the table's unused entries out of range.
    Returns (paged (num_blocks, page, h, d), block_table (batch, max_blocks))."""
    h, d = keys[0].shape[1:]
    used = [-(-k.shape[0] // page) for k in keys]
    num_blocks = sum(used) + 3
    per = max(used) + 1
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    paged = torch.full((num_blocks, page, h, d), fill, dtype=torch.float32).to(dtype)
    table = torch.full((len(keys), per), num_blocks + 7, dtype=torch.int32)
    for b, kb in enumerate(keys):
        for j in range(used[b]):
            blk = perm.pop()
            table[b, j] = blk
            rows = kb[j * page : (j + 1) * page]
            paged[blk, : rows.shape[0]] = rows.cpu()
    return paged.to(device), table.to(device)


# (lens_q, lens_k, heads_q, heads_kv, head_dim, kwargs); sequences of unequal
# lengths with an empty query sequence, one without keys and keys over several pages.
PAGED_CASES = {
    "noncausal-gqa": ([5, 0, 17, 3, 2], [40, 9, 300, 0, 33], 4, 2, 32, {}),
    "causal-mqa": ([1, 8, 0, 20, 33], [37, 8, 5, 64, 17], 4, 1, 16, {"causal": True}),
    "window": ([12, 1, 7, 4], [70, 5, 7, 290], 2, 2, 16, {"window_size": (9, 3)}),
    "window-causal-gqa": ([12, 6, 2], [7, 260, 19], 4, 2, 64, {"window_size": (5, 0), "causal": True}),
    "softcap-causal": ([9, 0, 30], [18, 4, 270], 4, 2, 32, {"softcap": 1.5, "causal": True}),
    "alibi-bh": ([4, 11, 3], [40, 11, 0], 4, 2, 16, {"alibi_slopes": "bh", "causal": True}),
    "alibi-h-window": ([6, 2], [25, 300], 2, 1, 16, {"alibi_slopes": "h", "window_size": (20, 2)}),
    # The head dims of the Hopper TMA forward (64 above; 128: 128-key tiles, 256: 64-key tiles).
    "d128-causal-gqa": ([70, 0, 200, 3], [300, 5, 450, 130], 4, 2, 128, {"causal": True}),
    "d256-window": ([40, 9], [190, 333], 2, 1, 256, {"window_size": (100, 0)}),
}


def _paged_case(case, dtype, device, page, fill=float("nan")):
    lens_q, lens_k, hq, hkv, d, kw = PAGED_CASES[case]
    kw = dict(kw)
    if kw.get("alibi_slopes") == "bh":
        kw["alibi_slopes"] = _slopes((len(lens_q), hq), device)
    elif kw.get("alibi_slopes") == "h":
        kw["alibi_slopes"] = _slopes((hq,), device)
    q = randn((sum(lens_q), hq, d), dtype, device)
    keys = [randn((n, hkv, d), dtype, device) for n in lens_k]
    values = [randn((n, hkv, d), dtype, device) for n in lens_k]
    kc, table = make_paged(keys, page, dtype, device, fill=fill)
    # v's pages in k's places (one table for both).
    vc = torch.full_like(kc, fill)
    for b, vb in enumerate(values):
        for j in range(-(-vb.shape[0] // page)):
            rows = vb[j * page : (j + 1) * page]
            vc[table[b, j].item(), : rows.shape[0]] = rows
    return lens_q, lens_k, q, keys, values, kc, vc, table, kw


@pytest.mark.dtypes(torch.float32, torch.bfloat16)
@pytest.mark.parametrize("page", [16, 256])
@pytest.mark.parametrize("case", list(PAGED_CASES))
def test_varlen_paged_matches_gathered_calls_and_oracle(device, dtype, case, page):
    if device != "cpu":
        pytest.skip("CPU (the CUDA kernels: test_varlen_paged_cuda)")
    lens_q, lens_k, q, keys, values, kc, vc, table, kw = _paged_case(case, dtype, device, page)
    cq, ck = cu(lens_q, device), cu(lens_k, device)
    out, lse = flash_attn_varlen_func(
        q, kc, vc, cq, ck, max(lens_q), max(lens_k), block_table=table, return_lse=True, **kw
    )
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    bad = []
    for b, (sq, eq) in enumerate(bounds(lens_q)):
        n_q, n_k = eq - sq, lens_k[b]
        if n_q == 0:
            continue
        if n_k == 0:  # no key to see: zeros, lse -inf
            assert torch.equal(out[sq:eq], torch.zeros_like(out[sq:eq])), f"sequence {b}: out"
            assert torch.isneginf(lse[:, sq:eq]).all(), f"sequence {b}: lse"
            continue
        seq_kw = dict(kw)
        if seq_kw.get("alibi_slopes") is not None and seq_kw["alibi_slopes"].dim() == 2:
            seq_kw["alibi_slopes"] = seq_kw["alibi_slopes"][b]
        # Exactly the per-sequence call on the gathered, contiguous cache.
        ref, ref_lse = flash_attn_with_kvcache(
            q[None, sq:eq], keys[b][None], values[b][None], return_softmax_lse=True, **seq_kw
        )
        assert torch.equal(out[sq:eq], ref[0]), f"sequence {b}: out differs from the gathered call"
        assert torch.equal(lse[:, sq:eq], ref_lse[0]), f"sequence {b}: lse differs from the gathered call"
        res = check_attention(
            q[None, sq:eq], keys[b][None], values[b][None], out[None, sq:eq], lse[None, :, sq:eq], **seq_kw
        )
        bad += [f"sequence {b} (len_q {n_q}, len_k {n_k}): {c.message()}" for c in res if not c.ok]
    assert not bad, "; ".join(bad)


PAGED_ROUTES = {"tma": {}, "sm80": {"FLASHATTN_DISABLE_SM90": "1"}}


@pytest.mark.cuda
@pytest.mark.dtypes(torch.bfloat16, torch.float16)
@pytest.mark.parametrize("tails", ["finite", "nan"])
@pytest.mark.parametrize("page", [16, 48, 256])
@pytest.mark.parametrize("case", list(PAGED_CASES))
@pytest.mark.parametrize("route", list(PAGED_ROUTES))
def test_varlen_paged_cuda(device, dtype, case, page, tails, route, monkeypatch):
    """The CUDA kernels reading the pages in place (on an H200 the TMA forward,
    one box per page or per 16-row part of one; FLASHATTN_DISABLE_SM90=1 the
    mma.sync forward, row by row): bitwise the same call on the gathered,
    packed contiguous keys (the same kernel, the same tiles), when the rows
    past a sequence's keys are finite; NaN there (what a cache from
    torch.empty may hold) is masked, and the non-finite rule's exact recompute
    of the rows it reaches keeps them within the tolerance of the oracle."""
    if device != "cuda":
        pytest.skip("CUDA kernels (the CPU op: test_varlen_paged_matches_gathered_calls_and_oracle)")
    for name, value in PAGED_ROUTES[route].items():
        monkeypatch.setenv(name, value)
    fill = 0.25 if tails == "finite" else float("nan")
    lens_q, lens_k, q, keys, values, kc, vc, table, kw = _paged_case(case, dtype, device, page, fill=fill)
    cq, ck = cu(lens_q, device), cu(lens_k, device)
    out, lse = flash_attn_varlen_func(
        q, kc, vc, cq, ck, max(lens_q), max(lens_k), block_table=table, return_lse=True, **kw
    )
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    if tails == "finite":
        ref, ref_lse = flash_attn_varlen_func(
            q, torch.cat(keys), torch.cat(values), cq, ck, max(lens_q), max(lens_k), return_lse=True, **kw
        )
        assert torch.equal(out, ref), "out differs from the call on the gathered keys"
        assert torch.equal(lse, ref_lse), "lse differs from the call on the gathered keys"
    bad = []
    for b, (sq, eq) in enumerate(bounds(lens_q)):
        if eq == sq:
            continue
        if lens_k[b] == 0:
            assert torch.equal(out[sq:eq], torch.zeros_like(out[sq:eq])) and torch.isneginf(lse[:, sq:eq]).all()
            continue
        seq_kw = dict(kw)
        if seq_kw.get("alibi_slopes") is not None and seq_kw["alibi_slopes"].dim() == 2:
            seq_kw["alibi_slopes"] = seq_kw["alibi_slopes"][b]
        res = check_attention(
            q[None, sq:eq], keys[b][None], values[b][None], out[None, sq:eq], lse[None, :, sq:eq], **seq_kw
        )
        bad += [f"sequence {b}: {c.message()}" for c in res if not c.ok]
    assert not bad, "; ".join(bad)


@pytest.mark.cuda
def test_varlen_paged_cuda_graph(device):
    """The paged varlen forward reads nothing on the host: it captures in a CUDA
    graph, and a replay after the page table changed reads the new pages."""
    if device != "cuda":
        pytest.skip("CUDA graphs")
    lens_q, lens_k, q, keys, values, kc, vc, table, kw = _paged_case("causal-mqa", torch.bfloat16, device, 16, 0.0)
    cq, ck = cu(lens_q, device), cu(lens_k, device)
    args = (q, kc, vc, cq, ck, max(lens_q), max(lens_k))
    eager = flash_attn_varlen_func(*args, block_table=table, **kw)
    static_table = table.clone()
    graph = torch.cuda.CUDAGraph()
    flash_attn_varlen_func(*args, block_table=static_table, **kw)  # warm-up outside the capture
    with torch.cuda.graph(graph):
        captured = flash_attn_varlen_func(*args, block_table=static_table, **kw)
    graph.replay()
    assert torch.equal(captured, eager)
    swapped = table.clone()
    swapped[3, [0, 3]] = table[3, [3, 0]]
    static_table.copy_(swapped)
    graph.replay()
    assert torch.equal(captured, flash_attn_varlen_func(*args, block_table=swapped, **kw))
    assert not torch.equal(captured, eager)


def test_varlen_paged_compile(device):
    """torch.compile(fullgraph=True) traces the paged call (the op's fake kernel;
    the value checks stay out of the graph) and gives the eager answer."""
    lens_q, lens_k, q, keys, values, kc, vc, table, kw = _paged_case("causal-mqa", torch.float32, device, 16, 0.0)
    if device == "cuda":
        q, kc, vc = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    cq, ck = cu(lens_q, device), cu(lens_k, device)

    def f(q, kc, vc, t):
        return flash_attn_varlen_func(q, kc, vc, cq, ck, max(lens_q), max(lens_k), block_table=t, **kw)

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, kc, vc, table)
    assert torch.equal(out, f(q, kc, vc, table))


def test_varlen_paged_check_can_fail(device):
    """The checks above see a wrong page: the same causal call with two of a
    sequence's pages swapped in its table row no longer matches the gathered
    call, and the other sequences do not change."""
    if device != "cpu":
        pytest.skip("CPU only")
    lens_q, lens_k, q, keys, values, kc, vc, table, kw = _paged_case("causal-mqa", torch.float32, device, 16)
    cq, ck = cu(lens_q, device), cu(lens_k, device)
    good = flash_attn_varlen_func(q, kc, vc, cq, ck, 33, 64, causal=True, block_table=table)
    swapped = table.clone()
    swapped[3, [0, 3]] = table[3, [3, 0]]
    bad = flash_attn_varlen_func(q, kc, vc, cq, ck, 33, 64, causal=True, block_table=swapped)
    sq, eq = bounds(lens_q)[3]
    ref = flash_attn_with_kvcache(q[None, sq:eq], keys[3][None], values[3][None], causal=True)[0]
    assert torch.equal(good[sq:eq], ref) and not torch.allclose(bad[sq:eq], ref, atol=1e-4)
    assert torch.equal(bad[:sq], good[:sq]) and torch.equal(bad[eq:], good[eq:])


def test_varlen_paged_cu_seqlens_k_gives_lengths_only(device):
    """As in flash-attn (block_info.h: with a page table the keys are located by
    block_table alone), cu_seqlens_k's offsets do not move a sequence's keys:
    only its differences count."""
    if device != "cpu":
        pytest.skip("CPU only")
    a = _paged_valid(device)
    out = flash_attn_varlen_func(**a)
    shifted = flash_attn_varlen_func(**dict(a, cu_seqlens_k=a["cu_seqlens_k"] + 5))
    assert torch.equal(out, shifted)


@pytest.mark.dtypes(torch.float32)
def test_varlen_kvpacked_paged(device, dtype):
    """flash_attn_varlen_kvpacked_func(..., block_table=...) with kv (num_blocks,
    page, 2, heads_kv, head_dim): the paged flash_attn_varlen_func on its views."""
    if device != "cpu":
        pytest.skip("CPU only")
    lens_q, lens_k, q, keys, values, kc, vc, table, kw = _paged_case("causal-mqa", dtype, device, 16)
    kv = torch.stack([kc, vc], dim=2)
    cq, ck = cu(lens_q, device), cu(lens_k, device)
    out = flash_attn_varlen_kvpacked_func(q, kv, cq, ck, 33, 64, causal=True, block_table=table)
    ref = flash_attn_varlen_func(q, kc, vc, cq, ck, 33, 64, causal=True, block_table=table)
    assert torch.equal(out, ref)


def test_varlen_paged_forward_only(device):
    """As in flash-attn, a forward with block_table under autograd runs (the
    same output); its backward raises NotImplementedError naming block_table."""
    if device != "cpu":
        pytest.skip("CPU only")
    lens_q, lens_k, q, keys, values, kc, vc, table, kw = _paged_case("causal-mqa", torch.float32, device, 16)
    cq, ck = cu(lens_q, device), cu(lens_k, device)
    with torch.no_grad():
        ref = flash_attn_varlen_func(q, kc, vc, cq, ck, 33, 64, causal=True, block_table=table)
    qg = q.clone().requires_grad_()
    out = flash_attn_varlen_func(qg, kc, vc, cq, ck, 33, 64, causal=True, block_table=table)
    assert torch.equal(out, ref) and out.requires_grad
    with pytest.raises(NotImplementedError, match="no backward with block_table"):
        out.sum().backward()


def _paged_valid(device):
    lens_q, lens_k = [3, 2], [20, 4]
    q = randn((5, 4, 16), torch.float32, device)
    kc = randn((4, 16, 2, 16), torch.float32, device)
    return dict(
        q=q,
        k=kc,
        v=kc.clone(),
        cu_seqlens_q=cu(lens_q, device),
        cu_seqlens_k=cu(lens_k, device),
        max_seqlen_q=3,
        max_seqlen_k=20,
        block_table=_i32([[2, 0], [3, 99]], device),  # 99: past sequence 1's keys, never read
    )


PAGED_ERRORS = {
    "table-int64": (lambda a, d: dict(block_table=a["block_table"].long()), TypeError, r"block_table must have dtype"),
    "table-list": (lambda a, d: dict(block_table=[[2, 0], [3, 1]]), TypeError, r"block_table must be a torch.Tensor"),
    "table-1d": (lambda a, d: dict(block_table=_i32([2, 0], d)), ValueError, r"block_table must have shape"),
    "table-batch": (lambda a, d: dict(block_table=_i32([[2, 0]], d)), ValueError, r"block_table must have shape"),
    "table-range": (lambda a, d: dict(block_table=_i32([[2, 4], [3, 1]], d)), ValueError, r"block_table\[0\] holds"),
    "table-negative": (lambda a, d: dict(block_table=_i32([[2, 0], [-1, 1]], d)), ValueError, r"block_table\[1\]"),
    "capacity": (
        lambda a, d: dict(cu_seqlens_k=_i32([0, 33, 37], d), max_seqlen_k=33),
        ValueError,
        r"sequence 0 has 33 keys .* block_table holds 2 blocks of 16",
    ),
    "k-3d": (lambda a, d: dict(k=a["k"][0], v=a["v"][0]), ValueError, r"with block_table, k is a paged cache"),
    "page-8": (
        lambda a, d: dict(k=a["k"].reshape(8, 8, 2, 16), v=a["v"].reshape(8, 8, 2, 16)),
        ValueError,
        r"page_block_size .* multiple of 16, got 8",
    ),
    "v-shape": (lambda a, d: dict(v=a["v"][:3]), ValueError, r"v has shape .* but k has"),
    "heads": (lambda a, d: dict(q=a["q"][:, :3]), ValueError, r"3 heads, not a multiple of the 2"),
    "dtype": (lambda a, d: dict(k=a["k"].double()), TypeError, r"k has dtype torch.float64 but q"),
    "max_seqlen_k": (lambda a, d: dict(max_seqlen_k=19), ValueError, r"max_seqlen_k=19 is smaller"),
    "cu_q-total": (lambda a, d: dict(cu_seqlens_q=_i32([0, 3, 4], d)), ValueError, r"cu_seqlens_q ends at 4"),
    "cu_k-decreasing": (lambda a, d: dict(cu_seqlens_k=_i32([0, 20, 4], d)), ValueError, r"non-decreasing"),
    "alibi": (lambda a, d: dict(alibi_slopes=torch.ones(3, 4, device=d)), ValueError, r"alibi_slopes must have"),
    "dropout": (lambda a, d: dict(dropout_p=0.1), NotImplementedError, r"dropout_p > 0 .* block_table"),
    "probs": (lambda a, d: dict(return_attn_probs=True), NotImplementedError, r"return_attn_probs.*block_table"),
}


@pytest.mark.parametrize("case", list(PAGED_ERRORS))
def test_varlen_paged_errors(device, case):
    if device != "cpu":
        pytest.skip("CPU only (test_varlen_paged_unserved_device: the other devices)")
    args = _paged_valid(device)
    flash_attn_varlen_func(**args)  # the valid call passes
    change, exc, pattern = PAGED_ERRORS[case]
    args.update(change(args, device))
    with pytest.raises(exc, match=pattern) as info:
        flash_attn_varlen_func(**args)
    assert "flash_attn_varlen_func" in str(info.value)


@pytest.mark.parametrize("form", ["varlen", "kvpacked"])
def test_varlen_paged_unserved_device(form):
    """Issue 25 must-have 4: where no kernel reads paged k/v (a device other than
    the CPU and CUDA; meta stands in for one on any machine), the call raises
    NotImplementedError naming block_table and the fix, before any shape check
    (flash-attn's paged k of rank 4, and a wrong rank too, never a rank error)."""
    where = "meta"
    a = _paged_valid("cpu")
    a = {n: (t.to(where) if isinstance(t, torch.Tensor) else t) for n, t in a.items()}
    for k in (a["k"], a["k"][0]):  # the paged rank, and a wrong one
        with pytest.raises(NotImplementedError, match=r"block_table .*CPU and CUDA only.*block_table=None") as info:
            if form == "varlen":
                flash_attn_varlen_func(**dict(a, k=k, v=k))
            else:
                kv = torch.stack([k, k], dim=-3)
                flash_attn_varlen_kvpacked_func(
                    a["q"], kv, a["cu_seqlens_q"], a["cu_seqlens_k"], 3, 20, block_table=a["block_table"]
                )
        assert "flash_attn_varlen" in str(info.value)
