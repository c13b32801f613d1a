"""Dropout inside the kernels (issue 22), CPU and CUDA (on sm90 the Hopper TMA
kernels, at head dim 32 and elsewhere the mma.sync ones): the keep mask of
csrc/philox.h against its oracle (reference.dropout_keep_mask) bit for bit and
in its statistics, on both devices and across them (the same rng_state draws
the same mask), the kernels' forward and backward against the oracle with that
exact mask (tolerance rule; every CUDA head dim, deterministic too), the mask
the kernels apply read back exactly (values = identity), the random state
(torch.manual_seed, fresh draws, the CUDA offset's advance, CUDA graph replays,
thread counts, deterministic), the APIs (SDPA drop-in, flash_attn_func with
S_dmask, varlen) and torch.compile."""

import math
import os
import shutil
import subprocess
import warnings

import pytest
import torch
from helpers import assert_all, cuda_kernel_names, is_sm90, randn

import flashattn_ext
from flashattn_ext import FlashAttnFallbackWarning
from flashattn_ext import reference as ref
from flashattn_ext.tolerance import check_attention

ops = torch.ops.flashattn_ext
CPU = "cpu"
CUDA_DTYPE = torch.bfloat16  # the CUDA cases' dtype where a test takes one


def _rng(q, batch, heads):
    return ops.dropout_rng_state(q, batch, heads)


def _seed_offset(seed, offset):
    """int64 (2,) rng_state of uint64 seed and offset."""
    as_i64 = [x - 2**64 if x >= 2**63 else x for x in (seed, offset)]
    return torch.tensor(as_i64, dtype=torch.int64)


# ----------------------------------------------------------------------------- the generator


def test_philox_known_answers():
    """Random123's known-answer vectors of Philox4x32-10 (the oracle's rounds are the standard ones)."""
    kat = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for ctr, key, expected in kat:
        got = ref.philox4x32_10(*(torch.tensor([c]) for c in ctr), *key)
        assert tuple(int(x) for x in got) == expected


@pytest.mark.parametrize(
    "seed,offset,p",
    [(1, 0, 0.1), (2**64 - 1, 2**64 - 3, 0.5), (0x123456789ABCDEF, 2**32 - 2, 0.0625), (7, 12, 1 / 3)],
)
def test_kernel_mask_code_equals_oracle(device, seed, offset, p):
    """The C++ / CUDA generator (dropout_keep_mask runs the kernels' code, on
    rng_state's device) and the oracle draw the same bits: odd lengths (keys not
    a multiple of 32), a plane that carries into the counter's high half, the
    seed's high bits."""
    rs = _seed_offset(seed, offset)
    for shape in ((2, 3, 37, 70), (1, 5, 3, 33), (3, 1, 1, 1)):
        mine = ops.dropout_keep_mask(rs.to(device), *shape, p)
        assert mine.device.type == device and mine.dtype == torch.bool
        assert torch.equal(mine.cpu(), ref.dropout_keep_mask(rs, *shape, p)), shape


def test_keep_fraction():
    """1 - p kept within 0.5% over 10^7 elements (the oracle and the kernels'
    code), and within 6 sigma at each of the 32 key positions of a group (a
    layout slip would leave a position always kept or dropped)."""
    p = 0.1
    rs = _seed_offset(0xC0FFEE, 4)
    shape = (2, 5, 1000, 1000)
    mine = ops.dropout_keep_mask(rs, *shape, p)
    oracle = ref.dropout_keep_mask(rs, *shape, p)
    assert torch.equal(mine, oracle)
    frac = mine.double().mean().item()
    assert abs(frac - (1 - p)) <= 0.005 * (1 - p), frac
    by_position = mine[..., :992].reshape(-1, 32).double().mean(0)
    sigma = math.sqrt(p * (1 - p) / (mine.numel() / 32))
    assert (by_position - (1 - p)).abs().max().item() < 6 * sigma
    # Different planes (b, h) and offsets give different masks.
    assert not torch.equal(mine[0, 0], mine[0, 1])
    assert not torch.equal(mine, ops.dropout_keep_mask(_seed_offset(0xC0FFEE, 16), *shape, p))


def test_keep_mask_edges(device):
    rs = _seed_offset(3, 0).to(device)
    assert bool(ops.dropout_keep_mask(rs, 1, 2, 9, 40, 0.0).all())
    assert not bool(ops.dropout_keep_mask(rs, 1, 2, 9, 40, 1.0).any())
    assert ops.dropout_keep_mask(rs, 0, 2, 9, 40, 0.5).shape == (0, 2, 9, 40)
    assert ref.dropout_keep_threshold(0.1) == 58982  # floor(0.9 * 65536 + 0.5)


@pytest.mark.cuda
def test_cuda_rng_state_and_cross_device_mask():
    """The CUDA draw: an int64 (2,) tensor on q's device, [the generator's
    seed, its Philox offset], the offset advancing by dropout_offset_increment
    per call (3 x 5 planes: 16); torch.manual_seed replays it. The keep mask of
    a CUDA rng_state drawn on the device equals the CPU op's for the same
    values (a CPU run reproduces a GPU run's dropout)."""
    q = torch.zeros(1, device="cuda")
    torch.manual_seed(2024)
    a, b = _rng(q, 3, 5), _rng(q, 3, 5)
    assert a.device == q.device and a.dtype == torch.int64 and a.shape == (2,)
    assert int(a[0]) == int(b[0]) == torch.cuda.initial_seed()
    assert int(b[1]) - int(a[1]) == ref.dropout_offset_increment(3, 5) == 16
    torch.manual_seed(2024)
    assert torch.equal(_rng(q, 3, 5), a)
    shape = (3, 5, 77, 150)
    on_cuda = ops.dropout_keep_mask(b, *shape, 0.3)
    assert torch.equal(on_cuda.cpu(), ops.dropout_keep_mask(b.cpu(), *shape, 0.3))
    assert torch.equal(on_cuda.cpu(), ref.dropout_keep_mask(b, *shape, 0.3))
    assert not torch.equal(on_cuda, ops.dropout_keep_mask(a, *shape, 0.3))


@pytest.mark.skipif(shutil.which("c++") is None, reason="no host C++ compiler (c++)")
def test_cuda_fragment_dropout_follows_the_mask(tmp_path):
    """The CUDA kernels' fragment code (csrc/cuda/dropout.cuh's rows / cols
    application and the dK/dV kernel's KeepBitsCols) compiled for the host
    (tests/cuda_host/dropout_fragment_check.cpp): every element of every lane's
    fragment gets philox.h's decision for its (b, h, query, key). Runs without
    a GPU."""
    exe = tmp_path / "dropout_fragment_check"
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_host", "dropout_fragment_check.cpp")
    cmd = [shutil.which("c++"), "-std=c++17", "-O1", "-Wno-unknown-pragmas", "-o", str(exe), src]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert " 0 mismatches" in run.stdout and not run.stdout.startswith("0 elements"), run.stdout


@pytest.mark.skipif(shutil.which("c++") is None, reason="no host C++ compiler (c++)")
def test_cpu_philox_versions_follow_philox_h(tmp_path):
    """Every version of the CPU kernels' Philox draw (csrc/cpu/dropout.cpp's
    philox_chunk: AVX-512, AVX2 and portable) that this CPU can run, each
    called directly (tests/cpu_host/philox_chunk_check.cpp), gives philox.h's
    words: the tests above only reach the one the CPU's features select."""
    exe = tmp_path / "philox_chunk_check"
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_host", "philox_chunk_check.cpp")
    cmd = [shutil.which("c++"), "-std=c++17", "-O1", "-o", str(exe), src]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert " 0 mismatches" in run.stdout and not run.stdout.startswith("0 words"), run.stdout


# ----------------------------------------------------------------------------- the kernels against the oracle

CASES = {
    # name: (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, kwargs of attention)
    "plain": (2, 130, 97, 4, 4, 64, {}),
    "causal_gqa": (2, 113, 200, 4, 2, 64, {"window_right": 0}),
    "window_mqa": (1, 70, 70, 3, 1, 40, {"window_left": 9, "window_right": 4}),
    "softcap_alibi": (2, 65, 130, 2, 2, 32, {"softcap": 5.0, "alibi": True}),
    "float_mask": (2, 33, 47, 2, 2, 16, {"attn_mask": "float"}),
    "bool_mask": (1, 64, 129, 2, 1, 64, {"attn_mask": "bool"}),
    "one_query": (3, 1, 300, 2, 2, 64, {}),
}


def _call(case, dtype, p, rng_state=None, deterministic=False, device=CPU):
    b, nq, nk, hq, hkv, d, kw = CASES[case]
    q = randn((b, nq, hq, d), dtype, device).requires_grad_()
    k = randn((b, nk, hkv, d), dtype, device).requires_grad_()
    v = randn((b, nk, hkv, d), dtype, device).requires_grad_()
    slopes = torch.rand(hq, device=device) if kw.get("alibi") else None
    mask = None
    if kw.get("attn_mask") == "float":
        mask = randn((b, 1, nq, nk), dtype, device)
    elif kw.get("attn_mask") == "bool":
        mask = torch.rand(nq, nk, device=device) < 0.8
    args = dict(
        window_size=(kw.get("window_left", -1), kw.get("window_right", -1)),
        softcap=kw.get("softcap", 0.0),
        alibi_slopes=slopes,
        attn_mask=mask,
    )
    rs = rng_state if rng_state is not None else _rng(q, b, hq)
    scale = d**-0.5
    out, lse = ops.attention(
        q, k, v, scale, *args["window_size"], True, deterministic, False, args["softcap"], slopes, mask, p, rs
    )
    return (q, k, v), out, lse, rs, args, scale


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.dtypes(torch.float32, torch.bfloat16, torch.float16, torch.float64)
def test_matches_oracle(device, dtype, case):
    """Output, lse (that of the softmax without dropout) and the gradients
    against the oracle with the kernels' exact mask, under the tolerance rule;
    the same check against a mask of another seed fails (the test can fail).
    CUDA: the score-mod instances (dropout alone runs them too) of the Hopper
    TMA kernels on sm90, of the mma.sync kernels elsewhere."""
    p = 0.2
    (q, k, v), out, lse, rs, args, scale = _call(case, dtype, p, device=device)
    dout = randn(out.shape, dtype, device)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    kw = dict(softmax_scale=scale, dropout_p=p, **args)
    assert_all(check_attention(q, k, v, out, lse, dout, grads, rng_state=rs, **kw), case)
    other = check_attention(q, k, v, out, None, None, None, rng_state=_seed_offset(int(rs[0]) + 1, 0), **kw)
    assert not all(c.ok for c in other), "a wrong mask passed: the comparison cannot fail"


@pytest.mark.dtypes(torch.float64, torch.bfloat16)
def test_applied_mask_read_back(device, dtype):
    """The mask the kernels apply, read back exactly: with v = I (head_dim =
    seqlen_k) the output is the dropped, scaled probabilities, 0 exactly where
    dropped; with dO = I (head_dim = seqlen_q) dV = (P o Z)^T, the backward's
    mask. Both equal the oracle's mask on the visible entries (causal, GQA;
    CUDA: the forward's rows layout and the dK/dV kernel's transposed one, over
    two 64-key blocks)."""
    b, hq, hkv, p = 2, 4, 2, 0.3
    n = 64 if device == CPU else 128
    q = randn((b, n, hq, n), dtype, device, 0.1).requires_grad_()
    k = randn((b, n, hkv, n), dtype, device, 0.1)
    v = torch.eye(n, dtype=dtype, device=device).view(1, n, 1, n).expand(b, n, hkv, n).contiguous().requires_grad_()
    rs = _rng(q, b, hq)
    out, _ = ops.attention(q, k, v, n**-0.5, -1, 0, True, False, False, 0.0, None, None, p, rs)
    keep = ref.dropout_keep_mask(rs, b, hq, n, n, p)  # (b, h, i, j)
    visible = ref.visible_mask(n, n, -1, 0, 0)
    assert torch.equal(out.detach().transpose(1, 2).cpu() != 0, keep & visible)
    # The backward: dO = I on each head's rows, dV[j, i] = sum over the group's heads of (P o Z)[i, j].
    dout = torch.eye(n, dtype=dtype, device=device).view(1, n, 1, n).expand(b, n, hq, n)
    (dv,) = torch.autograd.grad(out, (v,), dout)
    kept_t = (keep & visible).transpose(-1, -2).reshape(b, hkv, hq // hkv, n, n).any(2)  # (b, hkv, j, i)
    assert torch.equal(dv.transpose(1, 2).cpu() != 0, kept_t)


def test_p_one_and_zero(device):
    dtype = torch.float32 if device == CPU else CUDA_DTYPE
    q, k, v = (randn((1, 20, 2, 16), dtype, device) for _ in range(3))
    rs = _rng(q, 1, 2)
    out, lse = ops.attention(q, k, v, 0.25, -1, -1, True, False, False, 0.0, None, None, 1.0, rs)
    assert bool((out == 0).all()) and bool(torch.isfinite(lse).all())
    plain, _ = ops.attention(q, k, v, 0.25, -1, -1, True, False)
    same, _ = ops.attention(q, k, v, 0.25, -1, -1, True, False, False, 0.0, None, None, 0.0, rs)
    assert torch.equal(plain, same)


def test_errors(device):
    q = randn((1, 8, 2, 16), torch.float32 if device == CPU else CUDA_DTYPE, device)
    dev = str(q.device)
    with pytest.raises(ValueError, match="dropout_p > 0 needs rng_state"):
        ops.fwd(q, q, q, 0.25, -1, -1, True, 0.0, None, None, 0.1)
    bad = {
        "shape": torch.zeros(3, dtype=torch.int64, device=device),
        "dtype": torch.zeros(2, dtype=torch.int32, device=device),
    }
    if device != CPU:  # a CPU rng_state for a CUDA call (the kernels read it on the device)
        bad["device"] = torch.zeros(2, dtype=torch.int64)
    for name, rs in bad.items():
        with pytest.raises(ValueError, match=rf"rng_state must be an int64 \(2,\) tensor \[seed, offset\] on {dev}"):
            ops.fwd(q, q, q, 0.25, -1, -1, True, 0.0, None, None, 0.1, rs)
    if device != CPU:
        with pytest.raises(ValueError, match="rng_state must be contiguous"):
            ops.fwd(
                q, q, q, 0.25, -1, -1, True, 0.0, None, None, 0.1, torch.zeros(4, dtype=torch.int64, device=device)[::2]
            )
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\]"):
        ops.fwd(q, q, q, 0.25, -1, -1, True, 0.0, None, None, 1.5, _seed_offset(1, 0).to(device))


# ----------------------------------------------------------------------------- the random state


def test_manual_seed_reproduces_and_calls_differ(device):
    q, k, v = (randn((2, 40, 2, 32), torch.bfloat16, device) for _ in range(3))
    torch.manual_seed(1234)
    a = flashattn_ext.flash_attn_func(q, k, v, dropout_p=0.3)
    b = flashattn_ext.flash_attn_func(q, k, v, dropout_p=0.3)
    torch.manual_seed(1234)
    a2 = flashattn_ext.flash_attn_func(q, k, v, dropout_p=0.3)
    assert torch.equal(a, a2)
    assert not torch.equal(a, b)


def test_bitwise_across_threads_and_deterministic():
    """The mask depends on the indices only: forward and backward are the same
    bits with 1 and 2 threads, and from run to run (deterministic=True)."""
    (q, k, v) = (
        randn(s, torch.float32, CPU).requires_grad_() for s in ((2, 150, 4, 64), (2, 90, 2, 64), (2, 90, 2, 64))
    )
    rs = _rng(q, 2, 4)
    dout = randn((2, 150, 4, 64), torch.float32, CPU)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 2):
            torch.set_num_threads(n)
            out, lse = ops.attention(q, k, v, 0.125, -1, 0, True, True, False, 0.0, None, None, 0.25, rs)
            results.append((out, lse, *torch.autograd.grad(out, (q, k, v), dout)))
    finally:
        torch.set_num_threads(threads)
    for r in results[1:]:
        for x, y in zip(results[0], r):
            assert torch.equal(x, y)


# ----------------------------------------------------------------------------- the APIs


def test_sdpa_drop_in_runs_the_kernels(device):
    """The drop-in takes dropout (no fallback warning): the op draws its
    rng_state from torch's generator; the same draw replayed gives the oracle's
    exact mask. Causal, GQA and a mask, forward and backward (CUDA: bf16, the
    tolerance rule)."""
    b, hq, hkv, n, s, d = 2, 4, 2, 33, 45, 32
    dtype = torch.float32 if device == CPU else CUDA_DTYPE
    q = randn((b, hq, n, d), dtype, device).requires_grad_()
    k = randn((b, hkv, s, d), dtype, device).requires_grad_()
    v = randn((b, hkv, s, d), dtype, device).requires_grad_()
    mask = torch.rand(b, 1, n, s, device=device) < 0.9
    for kw in ({"is_causal": True}, {"attn_mask": mask}):
        torch.manual_seed(99)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FlashAttnFallbackWarning)
            out = flashattn_ext.scaled_dot_product_attention(q, k, v, dropout_p=0.4, enable_gqa=True, **kw)
        torch.manual_seed(99)
        rs = _rng(q, b, hq)
        if device != CPU:
            dout = torch.randn_like(out)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            t = lambda x: x.transpose(1, 2)  # noqa: E731  (bshd, as check_attention takes them)
            res = check_attention(
                *(t(x) for x in (q, k, v, out)),
                None,
                t(dout),
                tuple(t(g) for g in grads),
                causal=kw.get("is_causal", False),
                bottom_right=False,
                attn_mask=kw.get("attn_mask"),
                dropout_p=0.4,
                rng_state=rs,
            )
            assert_all(res, str(list(kw)))
            continue
        expected = ref.sdpa_ref(q, k, v, dropout_p=0.4, enable_gqa=True, rng_state=rs, **kw)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
        dout = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), dout)
        want = torch.autograd.grad(expected, (q, k, v), dout.double())
        for g, w in zip(got, want):
            torch.testing.assert_close(g.double(), w.double(), rtol=1e-4, atol=1e-4)


def test_flash_attn_func_s_dmask(device):
    """return_attn_probs=True: (out, lse, S_dmask) as flash-attn 2 gives it,
    S_dmask (batch, heads, seqlen rounded up to 128) with the probabilities,
    negative where dropped (the kernels' mask), 0 where hidden and in the
    padding; None without dropout."""
    b, n, s, h, d, p = 2, 70, 150, 2, 32, 0.25
    dtype = torch.float32 if device == CPU else torch.float16
    q, k, v = (
        randn((b, n, h, d), dtype, device),
        randn((b, s, 1, d), dtype, device),
        randn((b, s, 1, d), dtype, device),
    )
    torch.manual_seed(5)
    out, lse, sd = flashattn_ext.flash_attn_func(q, k, v, dropout_p=p, causal=True, return_attn_probs=True)
    assert sd.shape == (b, h, 128, 256) and sd.dtype == q.dtype
    torch.manual_seed(5)
    rs = _rng(q, b, h)
    keep = ref.dropout_keep_mask(rs, b, h, n, s, p, device)
    visible = ref.visible_mask(n, s, -1, 0, s - n, device)
    assert torch.equal(sd[:, :, :n, :s] > 0, keep & visible)
    assert torch.equal(sd[:, :, :n, :s] < 0, ~keep & visible)
    assert bool((sd[:, :, n:] == 0).all()) and bool((sd[:, :, :, s:] == 0).all())
    q32, k32 = q.float(), k.float().expand(b, s, h, d)
    probs = torch.softmax((torch.einsum("bihd,bjhd->bhij", q32, k32) * d**-0.5).masked_fill(~visible, -math.inf), -1)
    tol = dict(rtol=1e-4, atol=1e-6) if device == CPU else dict(rtol=2e-3, atol=1e-5)  # S_dmask in fp16
    torch.testing.assert_close(sd[:, :, :n, :s].abs().float(), probs, **tol)
    if device == CPU:
        expected = ref.attention_ref(q, k, v, causal=True, dropout_p=p, rng_state=rs)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    else:
        assert_all(check_attention(q, k, v, out, lse, causal=True, dropout_p=p, rng_state=rs))
    assert flashattn_ext.flash_attn_func(q, k, v, return_attn_probs=True)[2] is None


def test_varlen_matches_oracle_per_sequence(device):
    """Varlen: sequence b draws the corner of plane b of the keep mask (its own
    query and key indices); forward and backward per sequence against the
    oracle with that mask; S_dmask likewise."""
    lens_q, lens_k, h, hkv, d, p = [17, 0, 40, 33], [25, 9, 40, 1], 4, 2, 32, 0.3
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)  # noqa: E731
    cu_q, cu_k = cu(lens_q).to(device), cu(lens_k).to(device)
    q = randn((sum(lens_q), h, d), torch.bfloat16, device).requires_grad_()
    k = randn((sum(lens_k), hkv, d), torch.bfloat16, device).requires_grad_()
    v = randn((sum(lens_k), hkv, d), torch.bfloat16, device).requires_grad_()
    torch.manual_seed(11)
    out, lse, sd = flashattn_ext.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), dropout_p=p, causal=True, return_attn_probs=True
    )
    torch.manual_seed(11)
    rs = _rng(q, len(lens_q), h)
    keep = ref.dropout_keep_mask(rs, len(lens_q), h, max(lens_q), max(lens_k), p, device)
    dout = randn(out.shape, out.dtype, device)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for i, (sq, sk) in enumerate(zip(cu_q[:-1].tolist(), cu_k[:-1].tolist())):
        nq, nk = lens_q[i], lens_k[i]
        if nq == 0:
            continue
        sl_q, sl_k = slice(sq, sq + nq), slice(sk, sk + nk)
        kb = keep[i : i + 1, :, :nq, :nk]
        res = check_attention(
            *(x[None, sl].detach() for x, sl in ((q, sl_q), (k, sl_k), (v, sl_k))),
            out[None, sl_q].detach(),
            lse[None, :, sl_q],
            dout[None, sl_q],
            (dq[None, sl_q], dk[None, sl_k], dv[None, sl_k]),
            causal=True,
            dropout_p=p,
            dropout_keep=kb,
        )
        assert_all(res, f"sequence {i}")
        vis = ref.visible_mask(nq, nk, -1, 0, nk - nq, device)
        assert torch.equal(sd[i, :, :nq, :nk] > 0, kb[0] & vis)
    assert sd.shape == (4, h, 128, 128)


def test_compile_fullgraph(device):
    """torch.compile(fullgraph=True) traces dropout: the draw is a node of the
    graph (every run draws anew; manual_seed replays eager's draws)."""
    torch._dynamo.reset()
    dtype = torch.float32 if device == CPU else CUDA_DTYPE
    q = randn((1, 24, 2, 16), dtype, device).requires_grad_()
    qs = randn((1, 2, 24, 16), dtype, device).requires_grad_()

    def f(q, qs):
        a = flashattn_ext.flash_attn_func(q, q, q, dropout_p=0.3, causal=True)
        c = flashattn_ext.scaled_dot_product_attention(qs, qs, qs, dropout_p=0.3)
        return a.sum() + c.square().sum(), a, c

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.manual_seed(3)
    eager = f(q, qs)
    g_eager = torch.autograd.grad(eager[0], (q, qs))
    torch.manual_seed(3)
    got = compiled(q, qs)
    g_got = torch.autograd.grad(got[0], (q, qs))
    # (CUDA: the same kernels and masks; the backward's dQ atomics add in any order.)
    tol = dict(rtol=1e-5, atol=1e-5) if device == CPU else dict(rtol=1e-2, atol=1e-2)
    for e, g in zip((*eager[1:], *g_eager), (*got[1:], *g_got)):
        torch.testing.assert_close(g, e, **tol)
    again = compiled(q, qs)
    assert not torch.equal(again[1], got[1])


def test_opcheck_with_dropout():
    """The ops with dropout and a given rng_state (then deterministic): schema,
    fake kernels, autograd registration, AOT dispatch."""
    q = randn((2, 9, 4, 16), torch.float32, CPU).requires_grad_()
    k = randn((2, 13, 2, 16), torch.float32, CPU).requires_grad_()
    v = randn((2, 13, 2, 16), torch.float32, CPU).requires_grad_()
    rs = _seed_offset(77, 8)
    tail = (0.0, None, None, 0.3, rs)
    torch.library.opcheck(ops.attention.default, (q, k, v, 0.25, -1, 0, True, False, False) + tail)
    torch.library.opcheck(ops.fwd.default, (q.detach(), k.detach(), v.detach(), 0.25, -1, 0, True) + tail)
    out, lse = ops.fwd(q.detach(), k.detach(), v.detach(), 0.25, -1, 0, True, *tail)
    dout = randn(out.shape, out.dtype, CPU)
    torch.library.opcheck(
        ops.bwd.default, (dout, q.detach(), k.detach(), v.detach(), out, lse, 0.25, -1, 0, True, False) + tail
    )
    torch.library.opcheck(ops.dropout_keep_mask.default, (rs, 2, 3, 5, 40, 0.25))


def test_output_unbiased():
    """The mean of the dropped output over fresh draws is the output without
    dropout (kept probabilities scaled by 1 / (1 - p)): within 6 standard
    errors at every element."""
    q, k, v = (randn((1, 64, 2, 32), torch.float64, CPU) for _ in range(3))
    plain = flashattn_ext.flash_attn_func(q, k, v, causal=True)
    draws = torch.stack([flashattn_ext.flash_attn_func(q, k, v, dropout_p=0.5, causal=True) for _ in range(64)])
    stderr = draws.std(0) / math.sqrt(draws.shape[0])
    assert bool(((draws.mean(0) - plain).abs() <= 6 * stderr + 1e-12).all())


# ----------------------------------------------------------------------------- CUDA only


@pytest.mark.cuda
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
def test_cuda_head_dims(head_dim, deterministic):
    """Every CUDA head dim against the oracle with the exact mask: causal GQA,
    query and key counts that end inside a block, forward and backward (the
    dK/dV kernel with dQ atomics, or the deterministic dK/dV + dQ kernels,
    whose bits must repeat)."""
    b, nq, nk, hq, hkv, p = 2, 150, 203, 4, 2, 0.17
    q = randn((b, nq, hq, head_dim), CUDA_DTYPE, "cuda").requires_grad_()
    k = randn((b, nk, hkv, head_dim), CUDA_DTYPE, "cuda").requires_grad_()
    v = randn((b, nk, hkv, head_dim), CUDA_DTYPE, "cuda").requires_grad_()
    rs = _rng(q, b, hq)
    scale = head_dim**-0.5
    out, lse = ops.attention(q, k, v, scale, -1, 0, True, deterministic, False, 0.0, None, None, p, rs)
    dout = randn(out.shape, CUDA_DTYPE, "cuda")
    grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    kw = dict(softmax_scale=scale, causal=True, dropout_p=p)
    assert_all(check_attention(q, k, v, out, lse, dout, grads, rng_state=rs, **kw), f"d{head_dim}")
    other = check_attention(q, k, v, out, None, None, None, rng_state=_seed_offset(int(rs[0]), int(rs[1]) + 8), **kw)
    assert not all(c.ok for c in other), "a wrong mask passed: the comparison cannot fail"
    if deterministic:
        again = torch.autograd.grad(out, (q, k, v), dout)
        for x, y in zip(grads, again):
            assert torch.equal(x, y)


@pytest.mark.cuda
def test_cuda_windowed_softcap_varlen_deterministic():
    """A sliding window with softcap (the score-mod instance with both) and a
    varlen batch with deterministic=True: the dQ kernel's mask (rows layout)
    and the dK/dV kernel's (transposed) against the oracle per sequence."""
    p = 0.3
    (q, k, v), out, lse, rs, args, scale = _call("window_mqa", CUDA_DTYPE, p, deterministic=True, device="cuda")
    dout = randn(out.shape, CUDA_DTYPE, "cuda")
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_all(check_attention(q, k, v, out, lse, dout, grads, rng_state=rs, softmax_scale=scale, dropout_p=p, **args))
    lens_q, lens_k, h, d = [70, 1, 129], [64, 200, 130], 2, 64
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")  # noqa: E731
    q = randn((sum(lens_q), h, d), CUDA_DTYPE, "cuda").requires_grad_()
    k = randn((sum(lens_k), h, d), CUDA_DTYPE, "cuda").requires_grad_()
    v = randn((sum(lens_k), h, d), CUDA_DTYPE, "cuda").requires_grad_()
    torch.manual_seed(21)
    out, lse = flashattn_ext.flash_attn_varlen_func(
        q,
        k,
        v,
        cu(lens_q),
        cu(lens_k),
        max(lens_q),
        max(lens_k),
        dropout_p=p,
        softcap=4.0,
        window_size=(30, 5),
        deterministic=True,
        return_lse=True,
    )
    torch.manual_seed(21)
    keep = ref.dropout_keep_mask(_rng(q, len(lens_q), h), len(lens_q), h, max(lens_q), max(lens_k), p, "cuda")
    dout = randn(out.shape, out.dtype, "cuda")
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    sq = sk = 0
    for i, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        sl_q, sl_k = slice(sq, sq + nq), slice(sk, sk + nk)
        res = check_attention(
            *(x[None, sl].detach() for x, sl in ((q, sl_q), (k, sl_k), (v, sl_k))),
            out[None, sl_q].detach(),
            lse[None, :, sl_q],
            dout[None, sl_q],
            (dq[None, sl_q], dk[None, sl_k], dv[None, sl_k]),
            window_size=(30, 5),
            softcap=4.0,
            dropout_p=p,
            dropout_keep=keep[i : i + 1, :, :nq, :nk],
        )
        assert_all(res, f"sequence {i}")
        sq, sk = sq + nq, sk + nk


@pytest.mark.cuda
def test_cuda_graph_replays_draw_fresh_masks():
    """Under CUDA graph capture the draw (dropout_rng_state's device-side
    unpack) reads the generator's offset at replay: each replay writes a new
    [seed, offset], its forward and backward use that replay's mask, and each
    matches the oracle for its own rng_state."""
    b, n, h, d, p = 2, 96, 2, 64, 0.25
    q, k, v, dout = (randn((b, n, h, d), CUDA_DTYPE, "cuda") for _ in range(4))
    scale = d**-0.5

    def step():
        rs = _rng(q, b, h)
        out, lse = ops.fwd(q, k, v, scale, -1, 0, True, 0.0, None, None, p, rs)
        grads = ops.bwd(dout, q, k, v, out, lse, scale, -1, 0, True, False, 0.0, None, None, p, rs)
        return rs, out, lse, grads

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the capture (allocations, lazy initialisation)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    seen = []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        rs, out, lse, grads = (
            x.clone() if isinstance(x, torch.Tensor) else tuple(g.clone() for g in x) for x in static
        )
        res = check_attention(
            q, k, v, out, lse, dout, grads, softmax_scale=scale, causal=True, dropout_p=p, rng_state=rs
        )
        assert_all(res, f"replay {len(seen)}")
        seen.append((rs.cpu(), out))
    assert len({tuple(rs.tolist()) for rs, _ in seen}) == 3, "every replay draws its own rng_state"
    assert all(int(rs[0]) == int(seen[0][0][0]) for rs, _ in seen)  # the seed stays, the offset advances
    assert not torch.equal(seen[0][1], seen[1][1])


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_dropout_runs_the_hopper_kernels(head_dim):
    """On sm90 a dropout call runs the warp-specialized TMA kernels' score-mod
    instances, forward and backward (192 / 256: the split backward), as the
    same call without dropout runs their plain ones; no mma.sync kernel."""
    if not is_sm90():
        pytest.skip("the Hopper dispatch exists on sm90 only")
    q = randn((1, 256, 2, head_dim), CUDA_DTYPE, "cuda").requires_grad_()

    def call(p):
        out = flashattn_ext.flash_attn_func(q, q, q, dropout_p=p)
        out.backward(torch.ones_like(out))

    for p in (0.1, 0.0):
        names = cuda_kernel_names(lambda: call(p))  # noqa: B023
        assert any("flash_fwd_sm90_ws_kernel" in n for n in names), (p, names)
        assert any("flash_bwd_sm90_ws" in n for n in names), (p, names)
        assert not any("flash_fwd_kernel" in n or "flash_bwd_dkdv_kernel" in n for n in names), (p, names)
