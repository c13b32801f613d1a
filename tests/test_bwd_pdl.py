"""Programmatic dependent launch (PDL) in the Hopper warp-specialized backward
(launch_bwd_sm90_ws in csrc/cuda/flash_launch.cuh): the preprocessing, main and
dQ conversion kernels overlap their launches, each dependent waiting
(griddepcontrol.wait) before it reads what the kernel before it wrote.

These tests compare the kernels' gradients with PDL against the same kernels
launched plainly (FLASHATTN_DISABLE_PDL=1, read on every call): a wait missing
or too early shows up as a dQ that kept a stale accumulator or a dK / dV
computed from a stale D. dK and dV must match bitwise (no atomics), and so must
dQ in deterministic mode; otherwise dQ (bulk reduce-adds in any order) within
rounding. The
same backward captured in a CUDA graph (PDL edges between kernel nodes) must
replay to the eager results. Runs on sm90 only (elsewhere nothing is launched
with PDL)."""

import pytest
import torch
from helpers import is_sm90, randn

from flashattn_ext import _ops

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not is_sm90(), reason="PDL runs in the warp-specialized Hopper backward (sm90)"),
]

# Short sequences (where PDL matters: the kernels are short) and one longer
# (several waves of the main kernel); d128 runs flash_bwd_sm90_ws_kernel,
# d256 flash_bwd_sm90_ws_split_kernel; GQA and a causal mask for the
# deterministic order's variants.
CASES = [
    # b, seqlen, heads_q, heads_kv, d, causal
    (4, 512, 16, 16, 128, False),
    (2, 1024, 16, 4, 128, True),
    (2, 1000, 8, 8, 256, False),
    (1, 4096, 8, 8, 128, False),
]


def _inputs(b, n, hq, hkv, d, dtype=torch.bfloat16):
    q = randn((b, n, hq, d), dtype, "cuda")
    k = randn((b, n, hkv, d), dtype, "cuda")
    v = randn((b, n, hkv, d), dtype, "cuda")
    return q, k, v


def _bwd_call(q, k, v, causal, deterministic):
    scale = q.shape[-1] ** -0.5
    wr = 0 if causal else -1
    out, lse = _ops.fwd_op(q, k, v, scale, -1, wr, True)
    dout = randn(out.shape, out.dtype, "cuda")
    return lambda: _ops.bwd(dout, q, k, v, out, lse, scale, -1, wr, True, deterministic)


def _assert_grads(got, want, exact_dq, what):
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        if exact_dq or name != "dq":
            assert torch.equal(g, w), f"{what}: {name} differs bitwise"
        else:
            torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2, msg=lambda m, n=name: f"{what}: {n}: {m}")


@pytest.mark.parametrize("case", CASES, ids=[f"b{c[0]}-n{c[1]}-h{c[2]}/{c[3]}-d{c[4]}-c{int(c[5])}" for c in CASES])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic-dq"])
def test_pdl_matches_plain_launches(case, deterministic, monkeypatch):
    b, n, hq, hkv, d, causal = case
    q, k, v = _inputs(b, n, hq, hkv, d)
    call = _bwd_call(q, k, v, causal, deterministic)
    monkeypatch.setenv("FLASHATTN_DISABLE_PDL", "1")
    plain = call()
    monkeypatch.delenv("FLASHATTN_DISABLE_PDL")
    for rep in range(3):  # repeats: a race shows up on some runs only
        _assert_grads(call(), plain, deterministic, f"PDL, repeat {rep}")


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic-dq"])
def test_pdl_varlen_matches_plain_launches(deterministic, monkeypatch):
    lens = [5, 700, 0, 129, 1024, 64]  # a sequence without rows, partial blocks
    hq, hkv, d = 8, 2, 128
    total = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = randn((total, hq, d), torch.bfloat16, "cuda")
    k = randn((total, hkv, d), torch.bfloat16, "cuda")
    v = randn((total, hkv, d), torch.bfloat16, "cuda")
    scale = d**-0.5
    m = max(lens)
    out, lse = _ops.varlen_fwd(q, k, v, cu, cu, m, m, scale, -1, 0, True)
    dout = randn(out.shape, out.dtype, "cuda")

    def call():
        return _ops.varlen_bwd(dout, q, k, v, out, lse, cu, cu, m, m, scale, -1, 0, True, deterministic)

    monkeypatch.setenv("FLASHATTN_DISABLE_PDL", "1")
    plain = call()
    monkeypatch.delenv("FLASHATTN_DISABLE_PDL")
    for rep in range(3):
        _assert_grads(call(), plain, deterministic, f"varlen PDL, repeat {rep}")


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic-dq"])
def test_pdl_backward_in_cuda_graph(deterministic):
    """The backward captured in a CUDA graph (its PDL launches become
    programmatic edges) replays to the eager gradients, also after its inputs
    change in place."""
    q, k, v = _inputs(2, 1024, 16, 16, 128)
    scale = 128**-0.5
    out, lse = _ops.fwd_op(q, k, v, scale, -1, -1, True)
    dout = randn(out.shape, out.dtype, "cuda")

    def call():
        return _ops.bwd(dout, q, k, v, out, lse, scale, -1, -1, True, deterministic)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    for rep in range(3):
        if rep == 2:  # new values in the same buffers
            dout.copy_(randn(dout.shape, dout.dtype, "cuda"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_grads(captured, call(), deterministic, f"graph replay {rep}")
