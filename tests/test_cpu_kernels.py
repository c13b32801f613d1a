"""Kernel-level tests of the CPU forward and backward (csrc/cpu/).

Every result is compared with flashattn_ext.tolerance.check_attention: the
oracle of flashattn_ext.reference (float32, float64 for float32/float64 inputs)
from the same (already rounded) inputs, and THE rule (FlashAttention's): the
kernel's max error against it must be at most 2x (3x for gradients) the error
of the same naive computation done in the input's own precision, plus a small
floor for rounding noise; lse within the accumulation's precision.

The kernels receive softmax_scale as float32 (flash_params.h); the tests use
scales exactly representable in float32 so that float64 inputs can be held to
float64 accuracy.

Inputs are fresh random numbers on each run; each test draws its own seed
and prints it on failure (re-run a case with FLASHATTN_TEST_SEED=<seed>).
"""

import math
import os
import random
import sys

import pytest
import torch
from helpers import assert_all

import flashattn_ext
from flashattn_ext.reference import visible_mask
from flashattn_ext.tolerance import check_attention

fwd_op = torch.ops.flashattn_ext.fwd
bwd_op = torch.ops.flashattn_ext.bwd

# mask name -> (window_left, window_right, bottom_right)
MASKS = {
    "none": (-1, -1, False),
    "causal": (-1, 0, False),  # torch SDPA's is_causal (top-left diagonal)
    "causal_br": (-1, 0, True),  # FlashAttention's causal (bottom-right diagonal)
    "window": (24, 8, True),  # sliding window around the bottom-right diagonal
    "window_left": (16, -1, False),  # keys at most 16 behind the diagonal, any ahead
}


@pytest.fixture
def seed():
    s = int(os.environ.get("FLASHATTN_TEST_SEED", random.SystemRandom().randrange(2**31)))
    torch.manual_seed(s)
    return s


def f32_scale(head_dim):
    """1/sqrt(head_dim) rounded to float32 (the kernels' softmax_scale type)."""
    return float(torch.tensor(1.0 / math.sqrt(head_dim), dtype=torch.float32))


def visible(seqlen_q, seqlen_k, window_left, window_right, bottom_right):
    """(seqlen_q, seqlen_k) bool: key j visible from query i (flash_params.h MaskParams)."""
    return visible_mask(seqlen_q, seqlen_k, window_left, window_right, seqlen_k - seqlen_q if bottom_right else 0)


def check(q, k, v, out, lse, dout, grads, scale, window_left, window_right, bottom_right, seed):
    """The kernel's out, lse (and dq, dk, dv for dout) against the oracle, with the rule."""
    assert_all(
        check_attention(
            q,
            k,
            v,
            out,
            lse,
            dout,
            grads,
            softmax_scale=scale,
            window_size=(window_left, window_right),
            bottom_right=bottom_right,
        ),
        f"seed {seed}",
    )


def make_inputs(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, noncontiguous=False, logit_gain=1.0):
    """q (b, n_q, h_q, d), k, v (b, n_k, h_kv, d), dout like q; optionally as
    transposed views of (b, h, n, d) tensors (non-contiguous, unit last stride).
    logit_gain multiplies the scores (q and k each by its square root)."""

    def rand(n, h, gain=1.0):
        if noncontiguous:
            return (torch.randn(batch, h, n, head_dim) * gain).to(dtype).transpose(1, 2)
        return (torch.randn(batch, n, h, head_dim) * gain).to(dtype)

    g = math.sqrt(logit_gain)
    q, k, v = rand(seqlen_q, heads_q, g), rand(seqlen_k, heads_kv, g), rand(seqlen_k, heads_kv)
    dout = rand(seqlen_q, heads_q)
    return q, k, v, dout


def run_case(
    seed,
    dtype,
    seqlen_q,
    seqlen_k,
    head_dim,
    heads_q=2,
    heads_kv=2,
    mask="none",
    batch=2,
    noncontiguous=False,
    logit_gain=1.0,
    check_grads=True,
    scale=None,
):
    window_left, window_right, bottom_right = MASKS[mask] if isinstance(mask, str) else mask
    scale = f32_scale(head_dim) if scale is None else scale
    q, k, v, dout = make_inputs(
        batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, noncontiguous, logit_gain
    )
    if noncontiguous and heads_q > 1 and seqlen_q > 1:  # (with one head or row the view is contiguous)
        assert not q.is_contiguous() and q.stride(-1) == 1

    out, lse = fwd_op(q, k, v, scale, window_left, window_right, bottom_right)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (batch, heads_q, seqlen_q)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    grads = None
    if check_grads:
        grads = bwd_op(dout, q, k, v, out, lse, scale, window_left, window_right, bottom_right, False)
        for g, x in zip(grads, (q, k, v)):
            assert g.shape == x.shape and g.dtype == dtype
    check(q, k, v, out, lse, dout if check_grads else None, grads, scale, window_left, window_right, bottom_right, seed)

    empty_rows = ~visible(seqlen_q, seqlen_k, window_left, window_right, bottom_right).any(dim=-1)
    if empty_rows.any():
        assert (out[:, empty_rows] == 0).all(), f"rows without keys must be 0 (seed {seed})"
        if check_grads:
            assert (grads[0][:, empty_rows] == 0).all(), f"dq of rows without keys must be 0 (seed {seed})"


# ---------------------------------------------------------------------------
# dtype x mask on odd sizes, head dims spread over the cases.

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
DTYPE_MASK_CASES = [
    # (seqlen_q, seqlen_k, head_dim) per mask, q and k lengths different both ways
    ("none", 113, 211, 40),
    ("causal", 211, 113, 80),
    ("causal_br", 113, 211, 96),
    ("window", 211, 211, 8),
    ("window_left", 150, 97, 64),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("mask,seqlen_q,seqlen_k,head_dim", DTYPE_MASK_CASES, ids=lambda x: str(x))
def test_dtype_and_mask(seed, dtype, mask, seqlen_q, seqlen_k, head_dim):
    run_case(seed, dtype, seqlen_q, seqlen_k, head_dim, mask=mask)


# ---------------------------------------------------------------------------
# Sequence lengths: 1, 17, 113 and the tile edges around 1024, both orders.

SEQLEN_CASES = [
    (1, 1, "none"),
    (1, 17, "none"),
    (17, 1, "causal_br"),  # 16 of 17 rows see no key
    (1, 113, "causal"),
    (113, 17, "causal"),
    (17, 113, "causal_br"),
    (1023, 1025, "causal_br"),
    (1025, 1023, "none"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("seqlen_q,seqlen_k,mask", SEQLEN_CASES, ids=lambda x: str(x))
def test_seqlens(seed, dtype, seqlen_q, seqlen_k, mask):
    big = max(seqlen_q, seqlen_k) > 1000
    run_case(seed, dtype, seqlen_q, seqlen_k, 64, mask=mask, batch=1 if big else 2, heads_q=2, heads_kv=1)


# ---------------------------------------------------------------------------
# Head dims, including ones that are not multiples of 8 (the vector edges).


@pytest.mark.parametrize("head_dim", [1, 8, 40, 64, 80, 96, 128, 192, 256, 13, 200])
def test_head_dims(seed, head_dim):
    dtype = torch.float32 if head_dim % 2 else torch.bfloat16
    run_case(seed, dtype, 77, 133, head_dim, mask="causal_br")
    run_case(seed, torch.float32, 133, 77, head_dim, mask="none", batch=1)


# ---------------------------------------------------------------------------
# GQA / MQA, non-contiguous views, rows without keys, large logits.


@pytest.mark.parametrize("heads_q,heads_kv", [(6, 2), (6, 1), (3, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=lambda d: str(d).split(".")[-1])
def test_gqa_mqa(seed, heads_q, heads_kv, dtype):
    run_case(seed, dtype, 97, 150, 64, heads_q=heads_q, heads_kv=heads_kv, mask="causal_br")
    run_case(seed, dtype, 150, 97, 32, heads_q=heads_q, heads_kv=heads_kv, mask="window")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_noncontiguous(seed, dtype, mask):
    run_case(seed, dtype, 130, 70, 48, heads_q=4, heads_kv=2, mask=mask, noncontiguous=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
def test_zero_row_stride(seed, dtype):
    # k expanded along seqlen (row stride 0, rows "overlapping"): the kernels
    # cannot use such a tile as a GEMM operand in place and must copy it.
    q = torch.randn(2, 150, 4, 32).to(dtype)
    k = torch.randn(2, 1, 2, 32).to(dtype).expand(2, 130, 2, 32)
    v = torch.randn(2, 130, 2, 32).to(dtype)
    dout = torch.randn_like(q)
    scale, args = 0.25, (-1, 0, True)
    out, lse = fwd_op(q, k, v, scale, *args)
    grads = bwd_op(dout, q, k, v, out, lse, scale, *args, False)
    check(q, k, v, out, lse, dout, grads, scale, *args, seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_rows_without_keys(seed, dtype):
    # Bottom-right causal with seqlen_q > seqlen_k: the first 200 - 70 rows see no key.
    run_case(seed, dtype, 200, 70, 64, mask="causal_br")
    # A window narrower than the offset leaves rows without keys at the start too.
    q, k, v, dout = make_inputs(1, 90, 40, 2, 2, 16, dtype)
    out, lse = fwd_op(q, k, v, 0.25, 3, 0, True)
    dq, dk, dv = bwd_op(dout, q, k, v, out, lse, 0.25, 3, 0, True, False)
    assert (out[:, :50] == 0).all() and torch.isneginf(lse[:, :, :50]).all() and (dq[:, :50] == 0).all()
    for t in (out, lse, dq, dk, dv):
        assert not torch.isnan(t).any(), f"NaN (seed {seed})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
def test_large_logits(seed, dtype):
    # Scores 100x larger (~1e2..1e3): exp must not overflow, the softmax is
    # nearly one-hot. (Only q and k grow: with v and dout ~1e2 as well, dS =
    # P (dP - rowsum(dO O)) cancels two numbers ~1e3 in float32, an error of
    # the FlashAttention backward itself, while the naive softmax backward
    # happens to get exactly 0 for a one-hot row; the comparison would then
    # measure that luck rather than the kernel.)
    run_case(seed, dtype, 113, 130, 64, mask="causal", logit_gain=100.0)


@pytest.mark.parametrize("scale", [0.0, -0.375, 2.0])
def test_softmax_scale(seed, scale):
    # Any finite scale: zero (uniform softmax), negative (the max of the
    # scaled scores comes from the smallest products), large.
    run_case(seed, torch.float32, 70, 150, 32, mask="causal_br", scale=scale)
    run_case(seed, torch.float32, 5, 150, 32, mask="window", scale=scale)


def test_large_query_blocks(seed):
    # Enough (batch, head, block) items for the forward's 128-query blocks
    # (smaller problems get smaller blocks, see work_queue.h).
    run_case(seed, torch.float32, 513, 257, 64, batch=2, heads_q=8, heads_kv=2, mask="causal_br")
    run_case(seed, torch.bfloat16, 300, 700, 128, batch=2, heads_q=8, heads_kv=4, mask="window")


@pytest.mark.parametrize("passes", [1, 2])
def test_backward_tile_copies_give_the_same_bits(passes):
    # The backward's float32 products read q, dO, k and v tiles from contiguous
    # copies or in place, by the machine's rule (flash_cpu_bwd.cpp) or the test
    # knob bwd_tiles_in_place (1: in place, 2: copies): the same products, the
    # same bits, in the one-pass and the two-pass backward, with ragged and
    # masked blocks; cpu_runtime_info names the way that runs.
    q, k, v, dout = make_inputs(2, 200, 330, 4, 2, 64, torch.float32)
    assert q.stride(1) == 4 * 64 and k.stride(1) == 2 * 64  # rows not contiguous: the copy path
    out, lse = fwd_op(q, k, v, 0.125, -1, -1, False)
    grads = {}
    before_passes = torch.ops.flashattn_ext._cpu_test_knob("bwd_passes", passes)
    try:
        for way, name in ((1, "in_place"), (2, "copied")):
            before = torch.ops.flashattn_ext._cpu_test_knob("bwd_tiles_in_place", way)
            try:
                assert f"bwd_tiles={name}" in torch.ops.flashattn_ext.cpu_runtime_info(False)
                grads[way] = bwd_op(dout, q, k, v, out, lse, 0.125, 100, 0, True, False)
            finally:
                torch.ops.flashattn_ext._cpu_test_knob("bwd_tiles_in_place", before)
    finally:
        torch.ops.flashattn_ext._cpu_test_knob("bwd_passes", before_passes)
    for copied, in_place in zip(grads[2], grads[1]):
        assert torch.equal(copied, in_place)
    assert all(g.abs().sum() > 0 for g in grads[2])


def test_backward_tile_copies_follow_the_cpu():
    # The machine's rule: in place where the CPU has AVX-512 (measured no
    # faster with copies there), copies elsewhere.
    from test_cpu_lowp import cpu_flags

    flags = cpu_flags()
    if not any(f.startswith("avx") for f in flags):
        pytest.skip("no /proc/cpuinfo ISA flags on this machine")
    expected = "in_place" if "avx512f" in flags else "copied"
    assert f"bwd_tiles={expected}" in torch.ops.flashattn_ext.cpu_runtime_info(False)


# ---------------------------------------------------------------------------
# Random configurations: a different set on every run (the seed is printed
# on failure together with the case).


@pytest.mark.parametrize("case", range(16))
def test_random_config(seed, case):
    rng = random.Random(seed * 1000 + case)
    lengths = [1, 2, 7, 8, 9, 31, 63, 64, 65, 127, 128, 129, 200, 300]
    heads_kv = rng.choice([1, 2, 3])
    config = dict(
        dtype=rng.choice(DTYPES),
        seqlen_q=rng.choice(lengths),
        seqlen_k=rng.choice(lengths),
        head_dim=rng.choice([1, 3, 8, 16, 24, 32, 40, 48, 64, 72, 96, 112, 128, 160, 192, 256]),
        heads_q=heads_kv * rng.choice([1, 2, 3]),
        heads_kv=heads_kv,
        # (window_left, window_right, bottom_right); (0, 0) is the diagonal alone.
        mask=(rng.choice([-1, -1, 0, 1, 5, 40]), rng.choice([-1, -1, 0, 0, 3, 50]), rng.random() < 0.5),
        batch=rng.choice([1, 2]),
        noncontiguous=rng.random() < 0.3,
    )
    try:
        run_case(seed, **config)
    except AssertionError as e:
        raise AssertionError(f"{e}\nconfig: {config}") from None


# ---------------------------------------------------------------------------
# Decode-shaped calls (at most 8 queries): the few-queries path, which takes
# the query heads of a GQA group together (up to 16 rows of heads x queries
# an item, fewer when that would leave threads idle): group sizes that do and
# do not fill an item, masks whose key ranges differ between the rows of one
# item, head dims that are not multiples of the 16 dot-product lanes.

FEW_QUERY_CASES = [
    # (seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, mask)
    (1, 300, 32, 8, 128, "none"),
    (1, 513, 32, 1, 64, "causal_br"),  # MQA: 32 heads, more than one item holds
    (3, 257, 12, 4, 40, "causal_br"),  # 9 rows an item, a 40-wide dot (8-element tail)
    (5, 100, 6, 2, 72, "window"),  # rows with different key windows in one item
    (8, 77, 24, 8, 64, "causal"),  # top-left: row i sees keys 0..i
    (7, 5, 6, 1, 32, "causal_br"),  # more queries than keys: rows 0, 1 see no key (zeros, lse -inf)
    (2, 40, 5, 5, 13, "window_left"),  # MHA, an odd head dim
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", FEW_QUERY_CASES, ids=lambda x: str(x))
def test_few_queries(seed, dtype, case):
    seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, mask = case
    run_case(seed, dtype, seqlen_q, seqlen_k, head_dim, heads_q=heads_q, heads_kv=heads_kv, mask=mask, batch=3)


def test_few_queries_thread_invariant(seed):
    # The grouping of query heads into items follows the thread count; each
    # row's arithmetic must not.
    q, k, v, _ = make_inputs(1, 2, 700, 32, 4, 128, torch.float32, noncontiguous=True)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (threads, 1, 3):
            torch.set_num_threads(n)
            results.append(fwd_op(q, k, v, 0.125, -1, 0, True))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b), f"results differ between thread counts (seed {seed})"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_few_queries_blocked_scores_give_the_same_bits(seed, dtype):
    # On AVX-512 the few-queries scores and P V product take four keys against
    # four rows a pass (tile_ops.cpp few_query_scores_blocked,
    # few_queries_pv_blocked); the knob few_queries_one_key makes them take one
    # key at a time. Each (row, key) sum and each output element is the same
    # sequence of operations, so the outputs are bitwise equal:
    # rows 4 / 6 / 3 (groups of four and the rest), keys not a multiple of
    # four, head dims a multiple of 16 and not, a causal window. (Where the
    # CPU has no AVX-512 both runs take the same code.)
    for seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal in (
        (1, 301, 32, 8, 128, False),
        (2, 258, 6, 2, 64, True),
        (3, 99, 4, 4, 40, False),
        (1, 1000, 8, 2, 256, False),
    ):
        q, k, v, _ = make_inputs(2, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype)
        results = []
        for one_key in (1, 0):
            before = torch.ops.flashattn_ext._cpu_test_knob("few_queries_one_key", one_key)
            try:
                results.append(fwd_op(q, k, v, head_dim**-0.5, -1, 0 if causal else -1, True))
            finally:
                torch.ops.flashattn_ext._cpu_test_knob("few_queries_one_key", before)
        for unblocked, blocked in zip(*results):
            assert torch.equal(blocked, unblocked), f"seed {seed}, {dtype}, q {seqlen_q} k {seqlen_k} d {head_dim}"
        assert results[0][0].abs().sum() > 0


# ---------------------------------------------------------------------------
# Determinism and the autograd path.


@pytest.mark.parametrize("seqlen", [300, 40])
def test_deterministic_and_thread_invariant(seed, seqlen):
    q, k, v, dout = make_inputs(2, seqlen, seqlen - 40 + 1, 6, 2, 64, torch.float32)
    args = (0.125, -1, 0, True, True)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (threads, threads, 1):
            torch.set_num_threads(n)
            out, lse = fwd_op(q, k, v, *args[:-1])  # deterministic: the backward's
            results.append((out, lse) + tuple(bwd_op(dout, q, k, v, out, lse, *args)))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b), f"results differ between runs / thread counts (seed {seed})"


def test_autograd_matches_ops(seed):
    q, k, v, dout = make_inputs(1, 65, 129, 4, 2, 32, torch.float32, noncontiguous=True)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = flashattn_ext._ops.attention(*leaves, 0.25, -1, 0, False, False)
    out.backward(dout)
    out2, lse2 = fwd_op(q, k, v, 0.25, -1, 0, False)
    dq, dk, dv = bwd_op(dout, q, k, v, out2, lse2, 0.25, -1, 0, False, False)
    assert torch.equal(out.detach(), out2) and torch.equal(lse.detach(), lse2)
    for leaf, g in zip(leaves, (dq, dk, dv)):
        assert torch.equal(leaf.grad, g)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_large_outputs_start_on_huge_page_boundaries():
    """The CPU kernels' outputs of 2 MiB and more come from csrc/cpu/huge_pages.h
    (2 MiB aligned, advised onto transparent huge pages), and are ordinary
    tensors: they resize, and free, as at::empty's do."""
    q, k, v = (torch.randn(1, 4096, 8, 64, requires_grad=True) for _ in range(3))  # 8 MiB each
    out = flashattn_ext.flash_attn_func(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    for t in (out, *grads):
        assert t.data_ptr() % (2 << 20) == 0 and t.is_contiguous()
    small = flashattn_ext.flash_attn_func(*(x[:, :64].detach() for x in (q, k, v)))
    assert small.is_contiguous()
    out = out.detach()
    ref = out.clone()
    out.resize_(2, 4096, 8, 64)  # (storage grows through the same allocator)
    assert torch.equal(out[0], ref[0])
