"""bfloat16 / float16 tile products on oneDNN's brgemm (csrc/cpu/tile_gemm.h).

By default (FLASHATTN_CPU_LOWP_GEMM=auto) the CPU kernels run the 16-bit
products on brgemm only where the CPU has matrix units for the dtype (AMX), or
for bfloat16 AMD's AVX512-BF16: elsewhere brgemm's bfloat16 is slower than our
float32 path (Intel's AVX512-BF16 without AMX). These tests force
it (FLASHATTN_CPU_LOWP_GEMM=brgemm) wherever oneDNN runs the dtype with the
pairs layout at all (e.g. AVX512-BF16 without AMX), so that the code path is
tested on such machines too, and skip where it cannot run (AVX2: oneDNN has no
bfloat16 brgemm there; float16 without AMX-FP16 reads B in another layout).

The results are held to the same tolerance rule, the same non-finite rule and
the same bitwise thread invariance as the float32 path's.
"""

import pytest
import torch
from test_cpu_kernels import check, make_inputs, run_case
from test_robustness import NONFINITE_SHAPES, _nonfinite_case

fwd_op = torch.ops.flashattn_ext.fwd
bwd_op = torch.ops.flashattn_ext.bwd
NAMES = {torch.bfloat16: "bf16_gemm", torch.float16: "fp16_gemm"}


def runtime_info():
    raw = torch.ops.flashattn_ext.cpu_runtime_info(False)
    return dict(kv.split("=", 1) for kv in raw.split(";"))


def cpu_flags():
    """The first processor's ISA flags, plus "vendor:<vendor_id>" (Linux /proc/cpuinfo)."""
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id") and not any(x.startswith("vendor:") for x in flags):
                    flags.add("vendor:" + line.split(":", 1)[1].strip())
                if line.startswith("flags"):
                    return flags | set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return flags


@pytest.fixture
def seed(_seed):
    return _seed


@pytest.fixture(params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def lowp(request, monkeypatch):
    """The dtype, with its products forced onto brgemm (skipped where it cannot run)."""
    dtype = request.param
    monkeypatch.setenv("FLASHATTN_CPU_LOWP_GEMM", "brgemm")
    info = runtime_info()[NAMES[dtype]]
    if not info.startswith("brgemm"):
        pytest.skip(f"no {dtype} brgemm with the pairs layout on this machine ({info})")
    return dtype


def _own(monkeypatch, fn):
    with monkeypatch.context() as m:
        m.setenv("FLASHATTN_CPU_LOWP_GEMM", "own")
        return fn()


def test_auto_takes_brgemm_only_where_it_is_faster(monkeypatch):
    # The default: brgemm for bfloat16 where the CPU has AMX or is an AMD one
    # with AVX512-BF16 (and oneDNN runs it), our float32 path elsewhere;
    # float16 likewise with AMX-FP16.
    monkeypatch.delenv("FLASHATTN_CPU_LOWP_GEMM", raising=False)
    info, flags = runtime_info(), cpu_flags()
    amd_bf16 = {"vendor:AuthenticAMD", "avx512_bf16"} <= flags
    for name, fast in (("bf16_gemm", "amx_bf16" in flags or amd_bf16), ("fp16_gemm", "amx_fp16" in flags)):
        used, offered = info[name].split("(")
        if not fast:
            assert used == "float32", info
        elif offered == "brgemm)":
            assert used == "brgemm", info
    monkeypatch.setenv("FLASHATTN_CPU_LOWP_GEMM", "own")
    assert runtime_info()["bf16_gemm"].startswith("float32")


LOWP_CASES = [
    # (seqlen_q, seqlen_k, head_dim, heads_q, heads_kv, mask, batch)
    (256, 300, 64, 4, 2, "causal_br", 2),  # full and ragged tiles and blocks
    (300, 700, 128, 8, 4, "window", 2),  # 128-query blocks, the value tiles transposed once
    (200, 70, 64, 2, 2, "causal_br", 2),  # rows without keys
    (130, 257, 96, 6, 1, "none", 1),  # MQA; 96 = three 32-element steps
    (65, 129, 32, 3, 3, "window_left", 2),
    # spans of up to four plain full key tiles in one softmax step (flash_cpu_fwd.cpp,
    # kWideTiles), then the ragged tail; and spans cut short by the causal diagonal
    (512, 1000, 128, 4, 2, "none", 1),
    (448, 448, 64, 2, 1, "causal_br", 1),
]


@pytest.mark.parametrize("case", LOWP_CASES, ids=str)
def test_lowp_against_oracle(seed, lowp, case):
    seqlen_q, seqlen_k, head_dim, heads_q, heads_kv, mask, batch = case
    run_case(seed, lowp, seqlen_q, seqlen_k, head_dim, heads_q=heads_q, heads_kv=heads_kv, mask=mask, batch=batch)
    run_case(
        seed,
        lowp,
        seqlen_q,
        seqlen_k,
        head_dim,
        heads_q=heads_q,
        heads_kv=heads_kv,
        mask=mask,
        batch=1,
        noncontiguous=True,
    )


def test_lowp_large_logits(seed, lowp):
    run_case(seed, lowp, 130, 200, 64, mask="causal", logit_gain=100.0)


def test_lowp_is_used_and_close_to_float32_path(seed, lowp, monkeypatch):
    q, k, v, dout = make_inputs(1, 256, 256, 4, 2, 64, lowp)
    args = (0.125, -1, -1, False)
    out, lse = fwd_op(q, k, v, *args)
    grads = bwd_op(dout, q, k, v, out, lse, *args, False)
    out1, lse1 = _own(monkeypatch, lambda: fwd_op(q, k, v, *args))
    grads1 = _own(monkeypatch, lambda: bwd_op(dout, q, k, v, out, lse, *args, False))
    assert not torch.equal(out, out1), "the brgemm path did not run (P^T is rounded there, not in the float32 path)"
    torch.testing.assert_close(lse, lse1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, out1, atol=2e-2, rtol=2e-2)
    for g, g1 in zip(grads, grads1):
        torch.testing.assert_close(g, g1, atol=5e-2, rtol=5e-2)


def test_lowp_thread_invariant(seed, lowp):
    q, k, v, dout = make_inputs(2, 300, 333, 4, 2, 64, lowp, noncontiguous=True)
    args = (0.125, -1, 0, True)

    def run():
        out, lse = fwd_op(q, k, v, *args)
        return (out, lse) + tuple(bwd_op(dout, q, k, v, out, lse, *args, True))

    threads = torch.get_num_threads()
    results = []
    try:
        for n in (threads, 1, 3):
            torch.set_num_threads(n)
            results.append(run())
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b), f"results differ between thread counts (seed {seed})"


def test_lowp_without_mkldnn_falls_back(seed, lowp, monkeypatch):
    # torch.backends.mkldnn.enabled = False: torch's brgemm refuses the 16-bit
    # products; the kernels take the float32 path (bitwise), never an error.
    q, k, v, _ = make_inputs(1, 128, 128, 2, 2, 64, lowp)
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False  # (flags() warns about oneDNN TF32 on restoring its settings)
    try:
        out = fwd_op(q, k, v, 0.125, -1, -1, False)
    finally:
        torch.backends.mkldnn.enabled = enabled
    out1 = _own(monkeypatch, lambda: fwd_op(q, k, v, 0.125, -1, -1, False))
    assert torch.equal(out[0], out1[0])


def _fused_step_case(seed, dtype, scores, layout, tol):
    # The spans' fused softmax step (csrc/cpu/softmax_span.cpp, on AVX-512
    # with AVX512-BF16: bfloat16's into the pairs operand, float32's back into
    # S^T; float16 has none) against the oracle and against the steps it
    # replaces (the test knob no_fused_softmax; the same operations, so the
    # same values up to FMA contraction). 1024 keys are four spans (512
    # queries: no key split). "rising": scores whose scale grows twelvefold
    # along the keys, so that every span moves the max and O^T and l are
    # rescaled mid-row; "flat": the max settles early. The layouts: k's rows
    # heads * d apart (copied into contiguous tiles first) or already
    # contiguous (read in place).
    q, k, v, dout = make_inputs(1, 512, 1024, 2, 2, 128, dtype, noncontiguous=layout == "bhnd")
    if scores == "rising":
        k = (k.float() * torch.linspace(1.0, 12.0, k.shape[1]).view(1, -1, 1, 1)).to(dtype)
        if layout == "bhnd":
            k = k.transpose(1, 2).contiguous().transpose(1, 2)
    scale = 128**-0.5
    out, lse = fwd_op(q, k, v, scale, -1, -1, False)
    before = torch.ops.flashattn_ext._cpu_test_knob("no_fused_softmax", 1)
    try:
        out2, lse2 = fwd_op(q, k, v, scale, -1, -1, False)
    finally:
        torch.ops.flashattn_ext._cpu_test_knob("no_fused_softmax", before)
    check(q, k, v, out, lse, None, None, scale, -1, -1, False, seed)
    check(q, k, v, out2, lse2, None, None, scale, -1, -1, False, seed)
    torch.testing.assert_close(lse, lse2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, out2, atol=tol, rtol=tol)


@pytest.mark.parametrize("scores", ["flat", "rising"])
@pytest.mark.parametrize("layout", ["bnhd", "bhnd"])
def test_lowp_fused_softmax_step(seed, lowp, scores, layout):
    _fused_step_case(seed, lowp, scores, layout, 2e-2)


@pytest.mark.parametrize("scores", ["flat", "rising"])
@pytest.mark.parametrize("layout", ["bnhd", "bhnd"])
def test_float32_fused_softmax_step(seed, scores, layout):
    # The float32 step has an AVX-512 (with AVX512-BF16) and an AVX2 version;
    # where the machine has neither both calls run the generic one (the
    # oracle check still holds; the next test says which ran).
    _fused_step_case(seed, torch.float32, scores, layout, 1e-5)


def test_fused_softmax_step_follows_the_cpu():
    # cpu_runtime_info names the fused step the forward runs: AVX-512 with
    # AVX512-BF16, else AVX2 with FMA, else none; the test knob turns it off.
    flags = cpu_flags()
    if not any(f.startswith("avx") for f in flags):
        pytest.skip("no /proc/cpuinfo ISA flags on this machine")
    avx512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"} <= flags
    expected = "avx512bf16" if avx512 else "avx2" if {"avx2", "fma"} <= flags else "none"
    assert runtime_info()["fused_softmax"] == expected
    before = torch.ops.flashattn_ext._cpu_test_knob("no_fused_softmax", 1)
    try:
        assert runtime_info()["fused_softmax"] == "none"
    finally:
        torch.ops.flashattn_ext._cpu_test_knob("no_fused_softmax", before)


@pytest.mark.parametrize("shape", [s for s in NONFINITE_SHAPES if s.startswith("tiled")])
@pytest.mark.parametrize("where", ["q", "k", "v", "v_inf", "dout", "all"])
def test_lowp_nonfinite_reaches_only_rows_that_see_it(lowp, shape, where):
    # test_robustness's rule at head dim 64 (the 16-bit products need a
    # multiple of 32; its own cases use 16).
    _nonfinite_case("cpu", lowp, shape, where, d=64)
