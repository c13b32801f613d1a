"""Distributed attention on the CPU (gloo), 2 and 4 ranks, against the
single-process call: flashattn_ext.ring (our ring on torch.distributed's
point-to-point ops: causal with head-tail balancing, q shorter or longer than
k, GQA) and torch's own context parallelism running our kernels on every
block (its all-gather and all-to-all rotations).

One torch.multiprocessing spawn of 4 processes serves every case
(tests/_dist_worker.py): the world group is the 4-rank run, the two halves
{0, 1}, {2, 3} are two 2-rank runs at once. Forward, log-sum-exp and the
gradients, each within the tolerance rule against the oracle and within the
rule's bound of the single-process call.
"""

import json
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
import _dist_worker  # noqa: E402

WORLD = 4
TIMEOUT_S = 240

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    seed = int(os.environ.get("FLASHATTN_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"seed={seed} (replay with FLASHATTN_TEST_SEED={seed})")
    tmp = tmp_path_factory.mktemp("ring")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ctx = mp.start_processes(
        _dist_worker.main,
        args=(WORLD, str(tmp / "init"), seed, str(tmp), repo),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    import time

    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the distributed processes did not finish in {TIMEOUT_S} s (seed {seed})")
    found = {}
    for rank in range(WORLD):
        path = tmp / f"rank{rank}.json"
        if path.exists():
            for r in json.loads(path.read_text()):
                found.setdefault((r["name"], r["world"]), []).append(r)
    return found


@pytest.fixture
def group_of_one():
    """A gloo process group of one rank in this process (no communication), torn down after."""
    if dist.is_initialized():
        pytest.skip("a process group already exists")
    tmp = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ring_group_of_one_{os.getpid()}")
    dist.init_process_group("gloo", init_method=f"file://{tmp}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if os.path.exists(tmp):
            os.remove(tmp)


def _check(results, name, world, groups):
    got = results.get((name, world))
    assert got is not None and len(got) == groups, f"no result for {name} on {world} ranks: {sorted(results)}"
    for r in got:
        assert r["ok"], f"{name}, {world} ranks: " + "; ".join(r["problems"])
    return got


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", [c[0] for c in _dist_worker.RING_CASES])
def test_ring_attention(results, case, world):
    _check(results, case, world, WORLD // world)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", [c[0] for c in _dist_worker.SCORE_CASES])
def test_ring_attention_masks_and_softcap(results, case, world):
    """attn_mask (bool, key padding, a float bias and its gradient) and softcap
    through the ring: each rank's query rows of the mask, the key columns of
    the part it holds at each step read as a view."""
    _check(results, case, world, WORLD // world)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", [c[0] for c in _dist_worker.VARLEN_CASES])
def test_ring_attention_varlen(results, case, world):
    """Packed documents, each balanced on its own (ring_attention_varlen)."""
    _check(results, case, world, WORLD // world)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", [c[0] for c in _dist_worker.BUFFER_CASES])
def test_backward_into_caller_buffers(results, case, world):
    """ring_attention_forward / ring_attention_backward apart: the same bits as
    ring_attention's autograd, the gradients written into strided buffers."""
    _check(results, case, world, WORLD // world)


@pytest.mark.parametrize("world", [2, 4])
def test_serial_transfers_same_bits(results, world):
    """The ring with its transfers completed before each compute (the baseline that
    examples/context_parallel.py --overlap-report measures the overlap against)."""
    _check(results, "serial-transfers", world, WORLD // world)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", [c[0] for c in _dist_worker.TORCH_CP_CASES])
def test_torch_context_parallel_on_our_kernels(results, case, world):
    """Every block of torch's ring ran our kernels: one call of the SDPA flash
    op per step and rank, forward and backward, none refused."""
    for r in _check(results, case, world, WORLD // world):
        assert r["calls"] == {
            "_scaled_dot_product_flash_attention/flashattn_ext": world,
            "_scaled_dot_product_flash_attention_backward/flashattn_ext": world,
        }, r["calls"]


def test_ring_single_rank_matches_flash_attn_func(group_of_one):
    """world 1 (a group of one, no communication): the same kernels as one call,
    so the very same bits when the plan is one call (not causal)."""
    import flashattn_ext
    from flashattn_ext import ring

    for causal in (False, True):
        q = torch.randn(2, 24, 4, 16, requires_grad=True)
        k = torch.randn(2, 40, 2, 16, requires_grad=True)
        v = torch.randn(2, 40, 2, 16, requires_grad=True)
        out = ring.ring_attention(q, k, v, causal=causal)
        ref = flashattn_ext.flash_attn_func(q, k, v, causal=causal)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
        if causal:
            torch.testing.assert_close(out, ref)
            for g, r in zip(grads, ref_grads):
                torch.testing.assert_close(g, r)
        else:
            assert torch.equal(out, ref)
            assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))


@pytest.mark.parametrize("kind", ["bool", "bias", "softcap"])
def test_ring_single_rank_masks_and_softcap(device, kind, group_of_one):
    """world 1 on the device (no communication: this is what runs the CUDA
    kernels on the ring's calls): the plan's chunk-sized calls read the mask's
    columns as strided views, merged through the log-sum-exp; out, lse and the
    gradients (a float mask's too) within the tolerance rule of the oracle."""
    from flashattn_ext import ring
    from flashattn_ext.tolerance import check_attention

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    b, lq, lk, hq, hk, d = 2, 64, 128, 4, 2, 64
    q, k, v, dout = (
        torch.randn(b, n, h, d, device=device).to(dtype) for n, h in ((lq, hq), (lk, hk), (lk, hk), (lq, hq))
    )
    mask, softcap = None, 0.0
    if kind == "bool":
        mask = torch.rand(b, 1, lq, lk, device=device) < 0.7
        mask[1, 0, 5] = False  # a row that sees no key
    elif kind == "bias":
        mask = torch.randn(1, hq, lq, lk, device=device).requires_grad_()
    else:
        softcap = 5.0
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = ring.ring_attention(
        *leaves, causal=True, balanced=True, attn_mask=mask, softcap=softcap, return_lse=True
    )  # fmt: skip
    wrt = leaves + ([mask] if kind == "bias" else [])
    grads = torch.autograd.grad(out, wrt, dout)
    comparisons = check_attention(
        q, k, v, out, lse, dout, grads[:3], causal=True, softcap=softcap,
        attn_mask=None if mask is None else mask.detach(), dmask=grads[3] if kind == "bias" else None,
    )  # fmt: skip
    bad = [c.message() for c in comparisons if not c.ok]
    assert not bad, "; ".join(bad)


@pytest.mark.parametrize("world", [2, 3])
def test_thread_group_ring(device, world):
    """ring.ThreadGroup: the ranks as threads of this process (the one-GPU overlap
    measurement's transport; on CUDA its transfers are copies on side streams):
    the two passes apart (what a CUDA run must call), causal with q shorter than
    k, within the rule of the oracle; on the CPU also through autograd, the same
    bits as the two passes."""
    from flashattn_ext import ring
    from flashattn_ext.tolerance import check_attention

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    b, lq, lk, hq, hk, d = 2, 12 * world, 24 * world, 4, 2, 32
    q, k, v, dout = (
        torch.randn(b, n, h, d, device=device).to(dtype) for n, h in ((lq, hq), (lk, hk), (lk, hk), (lq, hq))
    )
    tg = ring.ThreadGroup(world)

    def step(rank):
        loc = [ring.shard(x, tg) for x in (q, k, v, dout)]
        out, lse = ring.ring_attention_forward(*loc[:3], causal=True, group=tg)
        grads = ring.ring_attention_backward(loc[3], *loc[:3], out, lse, causal=True, group=tg)
        res = [out, lse, *grads]
        if device == "cpu":
            leaves = [x.clone().requires_grad_() for x in loc[:3]]
            out2, lse2 = ring.ring_attention(*leaves, causal=True, group=tg, return_lse=True)
            res += [out2.detach(), lse2, *torch.autograd.grad(out2, leaves, loc[3])]
        return [ring.unshard(x, tg, dim=2 if x.dim() == 3 else 1) for x in res]

    full = tg.run(step, device=device)[0]
    out, lse, dq, dk, dv = full[:5]
    bad = [c.message() for c in check_attention(q, k, v, out, lse, dout, [dq, dk, dv], causal=True) if not c.ok]
    assert not bad, "; ".join(bad)
    if device == "cpu":
        assert all(torch.equal(a, b) for a, b in zip(full[:5], full[5:]))
    with pytest.raises(RuntimeError, match="outside the threads of its run"):
        ring.shard(q, tg)


@pytest.mark.cuda
def test_thread_group_ring_reuses_memory_safely():
    """ring.ThreadGroup on CUDA, four ranks, several steps in one run: each step
    frees blocks whose kernels may still be queued, and the next step's receive
    buffers come from that memory. The copies into them must wait for the
    receiving rank's stream (garbage in K/V would send the kernels down the
    non-finite path: 70x slower and wrong). Every step's result within the rule."""
    from flashattn_ext import ring
    from flashattn_ext.tolerance import check_attention

    world, steps = 4, 3
    b, n, h, d = 1, 4096, 8, 64
    q, k, v, dout = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    tg = ring.ThreadGroup(world)

    def run(rank):
        loc = [ring.shard(x, tg) for x in (q, k, v, dout)]
        results = []
        for _ in range(steps):
            out, lse = ring.ring_attention_forward(*loc[:3], causal=True, group=tg)
            grads = ring.ring_attention_backward(loc[3], *loc[:3], out, lse, causal=True, group=tg)
            results.append([ring.unshard(x, tg, dim=2 if x.dim() == 3 else 1) for x in (out, lse, *grads)])
        return results

    for out, lse, *grads in tg.run(run, device="cuda")[0]:
        bad = [c.message() for c in check_attention(q, k, v, out, lse, dout, grads, causal=True) if not c.ok]
        assert not bad, "; ".join(bad)


def test_plan_covers_each_visible_pair_once():
    """ring._plan against a brute-force mask: for every (query part, key part)
    pair of every rank and step, the calls' masks tile exactly the visible
    (query, key) pairs, each once."""
    from flashattn_ext import ring

    for world, balanced, lq, lk in [
        (2, True, 16, 16),
        (4, True, 8, 24),
        (4, True, 24, 8),
        (3, False, 12, 9),
        (4, False, 4, 4),
    ]:
        offset = lk * world - lq * world
        for r in range(world):
            q_pos = ring._positions(r, world, balanced, lq, offset)
            per = len(ring.chunk_ids(0, world, balanced))
            for s in range(world):
                k_pos = ring._positions(s, world, balanced, lk, 0)
                want = k_pos[None, :] <= q_pos[:, None]
                for by_chunk in (False, True):  # (by_chunk: a call's keys inside one chunk, for attn_mask)
                    got = torch.zeros(lq, lk, dtype=torch.int64)
                    for a, b, c, d, wr in ring._plan(q_pos, k_pos, True, lq // per, lk // per, by_chunk):
                        i = torch.arange(b - a)[:, None]
                        j = torch.arange(d - c)[None, :]
                        got[a:b, c:d] += (j <= i + wr) if wr >= 0 else torch.ones(b - a, d - c, dtype=torch.bool)
                        if by_chunk:
                            assert c // (lk // per) == (d - 1) // (lk // per), (c, d, lk // per)
                            assert bool((k_pos[c:d] == k_pos[c] + torch.arange(d - c)).all())
                    assert torch.equal(got, want.long()), (world, balanced, lq, lk, r, s, by_chunk)


def test_backward_buffer_checks(group_of_one):
    """ring_attention_backward names a buffer of the wrong shape or dtype, and an lse
    that is not the forward's (world 1: a group of one)."""
    from flashattn_ext import ring

    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    out, lse = ring.ring_attention_forward(q, k, v, causal=True)
    dout = torch.randn_like(out)
    with pytest.raises(ValueError, match="dk must be a tensor of shape"):
        ring.ring_attention_backward(dout, q, k, v, out, lse, causal=True, dk=torch.empty(1, 8, 2, 8))
    with pytest.raises(TypeError, match="dv has dtype torch.int32"):
        ring.ring_attention_backward(dout, q, k, v, out, lse, causal=True, dv=torch.empty(1, 8, 2, 16).int())
    with pytest.raises(ValueError, match="lse has shape"):
        ring.ring_attention_backward(dout, q, k, v, out, lse[..., :4], causal=True)
    # A float64 buffer gets the float32 accumulator of these float32 inputs exactly (no rounding).
    dq64 = torch.empty(1, 8, 2, 16, dtype=torch.float64)
    dq, _, _ = ring.ring_attention_backward(dout, q, k, v, out, lse, causal=True, dq=dq64)
    ref = ring.ring_attention_backward(dout, q, k, v, out, lse, causal=True)[0]
    assert dq is dq64 and torch.equal(dq64.float(), ref)


def test_ring_mask_checks(group_of_one):
    """ring_attention names an attn_mask that is not this rank's rows against
    every key column, a mask with softcap, and a mask for packed sequences
    (world 1: a group of one)."""
    from flashattn_ext import ring

    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    with pytest.raises(ValueError, match=r"seqlen_q / world, seqlen_k\) = \(1, 2, 8, 8\).*ring.shard\(mask"):
        ring.ring_attention(q, k, v, attn_mask=torch.ones(8, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="cannot be combined with softcap"):
        ring.ring_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool), softcap=2.0)
    with pytest.raises(TypeError, match="attn_mask must be bool, float32 or the dtype of q"):
        ring.ring_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="softcap must be a finite number"):
        ring.ring_attention(q, k, v, softcap=-1.0)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="packed sequences take no attn_mask"):
        ring.ring_attention_forward(q[0], k[0], v[0], cu_seqlens=cu, attn_mask=torch.ones(8, 8, dtype=torch.bool))


def test_context_parallel_example_threads_check_and_overlap_report(tmp_path):
    """examples/context_parallel.py --threads (the one-GPU overlap measurement's
    script) on the CPU, small: --check holds the gathered result to the oracle,
    --overlap-report compares its two schedules; the script exits 0 only if both agree."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "cp.json"
    cmd = [sys.executable, os.path.join(root, "examples", "context_parallel.py"), "--threads", "2", "--device", "cpu",
           "--seqlen", "256", "--heads", "2", "--head-dim", "32", "--iters", "1", "--warmup", "0", "--check",
           "--overlap-report", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["check_ok"] and res["overlap"]["same_output"] and res["overlap"]["finite"]
