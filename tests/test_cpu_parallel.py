"""How the CPU kernels use the threads (csrc/cpu/work_queue.h, flash_cpu_fwd.cpp).

* Flash-decoding: a call with few (batch, kv head) groups and a long key range
  (decoding, or a short query block against a long cache) splits each row's
  keys into parts, one work item each, merged at the end. The number of parts
  follows the shapes only, so results are bitwise identical across thread
  counts; they are held to the tolerance rule like every other result, with the
  masks, GQA groups, cache layouts and the non-finite rule of the unsplit path.
* torch.set_num_threads is the budget of all concurrent calls together: several
  Python threads calling the kernels at once share it instead of each opening a
  team of that many threads.
* The backward runs in one pass per (batch, kv head) when those items keep the
  threads busy, else in two (key tiles, then query tiles); both give the same
  bits, so the choice may follow the thread count.
* The tests that compare the split with no split and one backward pass with
  two choose them through flashattn_ext::_cpu_test_knob (csrc/cpu/cpu_knobs.h),
  a test-only op: the production path reads no environment variable for them.
"""

import contextlib
import os
import threading

import pytest
import torch
from test_cpu_kernels import make_inputs, run_case
from test_kvcache import GROUPS, run_decode_case

import flashattn_ext

fwd_op = torch.ops.flashattn_ext.fwd


@pytest.fixture
def seed(_seed):
    """The test's seed (conftest's _seed has seeded torch with it), for messages."""
    return _seed


def runtime_info(reset=False):
    raw = torch.ops.flashattn_ext.cpu_runtime_info(reset)
    return dict(kv.split("=", 1) for kv in raw.split(";"))


@contextlib.contextmanager
def cpu_test_knob(name, value):
    """A test switch of csrc/cpu/cpu_knobs.h set to value inside the block (process-wide)."""
    before = torch.ops.flashattn_ext._cpu_test_knob(name, value)
    try:
        yield
    finally:
        torch.ops.flashattn_ext._cpu_test_knob(name, before)


@pytest.fixture
def no_split():
    """A function that runs fn() with the key split turned off."""

    def run(fn):
        with cpu_test_knob("no_key_split", 1):
            return fn()

    return run


# ---------------------------------------------------------------------------
# Against the oracle: the fwd op (few-queries and tiled paths) and the KV cache.

SPLIT_CASES = [
    # (seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, mask, batch)
    (1, 2000, 32, 8, 128, "none", 1),  # decoding, a GQA group of 4 per item
    (1, 1030, 8, 1, 64, "causal_br", 2),  # MQA, parts of 256 keys, a ragged last part
    (3, 3000, 6, 2, 40, "window", 1),  # a window: most parts see no key of a row
    (8, 1600, 4, 4, 72, "causal", 1),  # top-left causal: the queries see keys 0..i, one part only
    (5, 777, 6, 3, 13, "window_left", 2),  # an odd head dim
    (40, 2500, 4, 2, 64, "causal_br", 1),  # the tiled path: one query block against a long range
    (100, 900, 2, 1, 96, "window", 1),  # tiled, windows crossing the part boundaries
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("case", SPLIT_CASES, ids=str)
def test_split_fwd_against_oracle(seed, dtype, case):
    seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, mask, batch = case
    run_case(
        seed,
        dtype,
        seqlen_q,
        seqlen_k,
        head_dim,
        heads_q=heads_q,
        heads_kv=heads_kv,
        mask=mask,
        batch=batch,
        check_grads=False,
        noncontiguous=seqlen_q > 1,
    )


@pytest.mark.parametrize(
    "group, layout, mask",
    [
        ("gqa4-q1", "paged256", "none"),
        ("mqa-q1", "leftpad", "causal"),
        ("gqa8-q5", "batch-idx", "window"),
        ("gqa8-q16", "contiguous", "window-causal"),  # 16 queries: the tiled path, split
    ],
)
def test_split_kvcache_against_oracle(group, layout, mask):
    # Rows full, empty, half and one key long (run_decode_case), on a 3072-key cache.
    run_decode_case(torch.float32, 64, GROUPS[group], layout, mask, 0, capacity=3072, batch=4, device="cpu")


def test_split_is_used_and_close_to_unsplit(seed, no_split):
    # The split changes the order of the sums (so some bits differ), never more.
    q, k, v, _ = make_inputs(1, 1, 4096, 32, 8, 128, torch.float32)
    out, lse = fwd_op(q, k, v, 0.125, -1, -1, False)
    out1, lse1 = no_split(lambda: fwd_op(q, k, v, 0.125, -1, -1, False))
    assert not torch.equal(out, out1), "the split path did not run (a 4096-key decode, 8 groups)"
    torch.testing.assert_close(out, out1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, lse1, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------
# Bitwise identical across thread counts and runs.


def _with_threads(n, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_thread_invariant(seed, dtype):
    cap = 3000
    q = torch.randn(3, 1, 16, 64).to(dtype)
    q16 = torch.randn(3, 16, 16, 64).to(dtype)
    kc, vc = (torch.randn(3, cap, 4, 64).to(dtype) for _ in range(2))
    seqlens = torch.tensor([cap, 1500, 700], dtype=torch.int32)

    def calls():
        return (
            flashattn_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, return_softmax_lse=True)
            + flashattn_ext.flash_attn_with_kvcache(
                q16, kc, vc, cache_seqlens=seqlens, causal=True, return_softmax_lse=True
            )
            + fwd_op(q16, kc, vc, 0.125, 30, 0, True)
        )

    threads = torch.get_num_threads()
    results = [_with_threads(n, calls) for n in (threads, 1, 3, 7, threads)]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b), f"results differ between thread counts (seed {seed})"


def test_guided_runs_give_the_same_bits_as_single_items(seed):
    # Workers claim runs of neighbouring items (work_queue.h); a run that
    # skipped or repeated an item would leave rows unwritten or merge a key
    # part twice. Against claiming one item at a time, at several thread
    # counts: the tiled forward (causal, more items than threads), its
    # backward, and a split decode (parts of one row in one run).
    q, k, v = (torch.randn(2, 700, 6, 64) for _ in range(3))
    dout = torch.randn(2, 700, 6, 64)
    qd = torch.randn(3, 1, 16, 64)
    kc, vc = (torch.randn(3, 3000, 4, 64) for _ in range(2))

    def calls():
        out, lse = fwd_op(q, k, v, 0.125, -1, 0, True)
        grads = torch.ops.flashattn_ext.bwd(dout, q, k, v, out, lse, 0.125, -1, 0, True, False)
        decode = flashattn_ext.flash_attn_with_kvcache(qd, kc, vc, return_softmax_lse=True)
        return (out, lse, *grads, *decode)

    for n in (torch.get_num_threads(), 3):
        runs = _with_threads(n, calls)
        with cpu_test_knob("claim_one_item", 1):
            singles = _with_threads(n, calls)
        for a, b in zip(runs, singles):
            assert torch.equal(a, b), f"guided runs change the result at {n} threads (seed {seed})"


# ---------------------------------------------------------------------------
# The non-finite rule across parts: a NaN in a value row reaches exactly the
# queries that see that key, whichever part holds it.


def test_split_nan_reaches_only_queries_that_see_it(seed):
    seqlen_q, n, hq, hkv, d = 4, 2000, 4, 2, 32
    q = torch.randn(1, seqlen_q, hq, d)
    k, v = torch.randn(1, n, hkv, d), torch.randn(1, n, hkv, d)
    args = (0.25, 40, 0, True)  # bottom-right causal window: query i sees keys [n - 4 + i - 40, n - 4 + i]
    out, lse = fwd_op(q, k, v, *args)
    nv = v.clone()
    nv[0, n - 1, 1, 7] = float("nan")  # seen by query 3 only, in the last part
    nv[0, n - 44, 0, 3] = float("nan")  # seen by query 0 only (its window's first key)
    nv[0, 100, 0, 5] = float("inf")  # seen by no query: an early part
    out_n, lse_n = fwd_op(q, k, nv, *args)
    expect = torch.zeros_like(out, dtype=torch.bool)
    expect[0, 3, 2:, 7] = True  # query 3 of the heads of kv head 1
    expect[0, 0, :2, 3] = True  # query 0 of the heads of kv head 0
    assert torch.equal(out_n.isnan(), expect), f"seed {seed}"
    assert torch.equal(out_n[~expect], out[~expect]) and torch.equal(lse_n, lse)


# ---------------------------------------------------------------------------
# Threads: set_num_threads is respected, and several Python threads share it.


def test_workers_follow_set_num_threads(seed):
    q, k, v, _ = make_inputs(2, 300, 300, 8, 2, 64, torch.float32)
    for n in (1, 2, 3):
        runtime_info(reset=True)
        _with_threads(n, lambda: fwd_op(q, k, v, 0.125, -1, -1, False))
        peak = int(runtime_info()["peak_workers"])
        # (at most n; fewer only where the machine started fewer OpenMP threads)
        assert 1 <= peak <= n, f"{peak} workers with set_num_threads({n})"


def test_python_threads_share_the_thread_budget(seed):
    # 4 Python threads at once, set_num_threads(4): without a shared budget
    # each call opens a team of 4 (16 workers); with it, the calls that find
    # the workers taken run on their own thread: at most 4 + 3.
    q, k, v, _ = make_inputs(1, 768, 768, 8, 8, 64, torch.float32)  # ~10 ms a call on 4 cores
    start = threading.Barrier(4)
    errors = []

    def worker():
        try:
            start.wait()
            for _ in range(3):
                fwd_op(q, k, v, 0.125, -1, -1, False)
        except Exception as e:  # surfaced below
            errors.append(e)

    def run():
        runtime_info(reset=True)
        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return int(runtime_info()["peak_workers"])

    peak = _with_threads(4, run)
    assert not errors, errors
    assert peak <= 4 + 3, f"{peak} workers ran at once for 4 Python threads at set_num_threads(4)"


@pytest.mark.skipif(os.cpu_count() < 2, reason="one CPU")
def test_python_threads_results_unchanged(seed):
    # Whatever share of the workers a call gets, its result is the same.
    q, k, v, _ = make_inputs(1, 1, 3000, 16, 4, 64, torch.bfloat16)
    expected = fwd_op(q, k, v, 0.125, -1, -1, False)
    results = []

    def worker():
        for _ in range(4):
            results.append(fwd_op(q, k, v, 0.125, -1, -1, False))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 12
    for r in results:
        assert torch.equal(r[0], expected[0]) and torch.equal(r[1], expected[1])


# ---------------------------------------------------------------------------
# The backward's one pass and two passes: bitwise the same.

BWD_CASES = [
    # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, (window_left, window_right, bottom_right))
    (2, 300, 257, 4, 2, 64, (-1, 0, True)),
    (1, 130, 200, 6, 3, 96, (20, 5, True)),
    (1, 100, 60, 2, 2, 64, (-1, 0, True)),  # rows without keys
    (1, 77, 133, 3, 1, 13, (5, -1, False)),
]


@pytest.mark.parametrize("lowp", ["auto", "brgemm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_bwd_one_pass_equals_two_passes(seed, monkeypatch, dtype, lowp):
    monkeypatch.setenv("FLASHATTN_CPU_LOWP_GEMM", lowp)
    for b, sq, sk, hq, hkv, d, mask in BWD_CASES:
        q, k, v = torch.randn(b, sq, hq, d).to(dtype), torch.randn(b, sk, hkv, d).to(dtype), torch.randn(b, sk, hkv, d)
        v, dout = v.to(dtype), torch.randn(b, sq, hq, d).to(dtype)
        # Non-finite values where masks hide them from some rows (the rule's extra paths).
        v[0, sk // 2, 0, 3], k[0, 1, 0, 2], dout[0, 5, 0, 1] = float("nan"), float("inf"), float("nan")
        out, lse = fwd_op(q, k, v, 0.125, *mask)
        grads = []
        for passes in (1, 2):
            with cpu_test_knob("bwd_passes", passes):
                grads.append(torch.ops.flashattn_ext.bwd(dout, q, k, v, out, lse, 0.125, *mask, False))
        for name, a, c in zip(("dq", "dk", "dv"), *grads):
            assert torch.equal(a.isnan(), c.isnan()) and torch.equal(a.nan_to_num(), c.nan_to_num()), (
                f"{name} differs between one and two passes ({b, sq, sk, hq, hkv, d, mask}, seed {seed})"
            )


# ---------------------------------------------------------------------------
# The test switches (csrc/cpu/cpu_knobs.h): set only through the test-only op,
# not the environment, and restored by it.


def test_test_knobs_are_not_environment_variables(seed, monkeypatch, no_split):
    assert torch.ops.flashattn_ext._cpu_test_knob("no_key_split") == 0
    assert torch.ops.flashattn_ext._cpu_test_knob("bwd_passes") == 0
    with pytest.raises(ValueError, match="no CPU test knob named"):
        torch.ops.flashattn_ext._cpu_test_knob("key_split", 1)
    # The old environment switch no longer turns the split off: a 4096-key
    # decode still splits (its bits differ from the unsplit run's).
    q, k, v, _ = make_inputs(1, 1, 4096, 32, 8, 128, torch.float32)
    monkeypatch.setenv("FLASHATTN_CPU_NO_KEY_SPLIT", "1")
    out = fwd_op(q, k, v, 0.125, -1, -1, False)[0]
    out1 = no_split(lambda: fwd_op(q, k, v, 0.125, -1, -1, False))[0]
    assert not torch.equal(out, out1)
    assert torch.ops.flashattn_ext._cpu_test_knob("no_key_split") == 0, "the knob was not restored"
