"""Kernel-level check for a GPU visit: correctness of the CUDA forward and
backward against the float32 oracle over a matrix of shapes (the project's one
tolerance rule, flashattn_ext.tolerance: at most 2x the error of the same naive
computation in the low precision for the output, 3x for the gradients, plus a
small floor), varlen batches sequence by sequence (on an sm90 device the forward
must run the warp-specialized TMA kernel), a bitwise race check (dense and
varlen), and a quick timing against torch's SDPA backends and of the varlen
forward against the dense one. Prints one line per case and a summary; exits
non-zero on any failure. Usage: python benchmarks/kernel_check.py [--json PATH] [--quick]
"""

import argparse
import contextlib
import functools
import json
import math
import os
import statistics
import sys
import time

import torch

import flashattn_ext
from flashattn_ext import _ops
from flashattn_ext.reference import attention_flops
from flashattn_ext.tolerance import check_attention


def check_case(
    b, nq, nk, hq, hk, d, dtype, causal, bottom_right, window=(-1, -1), det=False, layout="bnhd", device="cuda"
):
    """One case, forward and backward through the op, against the oracle with
    flashattn_ext.tolerance.check_attention. Returns (ok, {name: (err, bound)},
    lse_ok, [comparison dicts])."""
    scale = 1.0 / math.sqrt(d)
    wl, wr = window
    if causal:
        wr = 0

    def make(n, h):
        if layout == "bhnd":  # a transposed view, as SDPA users pass it
            return torch.randn(b, h, n, d, device=device, dtype=dtype).transpose(1, 2)
        return torch.randn(b, n, h, d, device=device, dtype=dtype)

    q, k, v = make(nq, hq), make(nk, hk), make(nk, hk)
    for x in (q, k, v):
        x.requires_grad_(True)
    out, lse = _ops.fwd(q, k, v, scale, wl, wr, bottom_right, det)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    comps = check_attention(
        q.detach(),
        k.detach(),
        v.detach(),
        out.detach(),
        lse.detach(),
        dout,
        grads,
        softmax_scale=scale,
        window_size=(wl, wr),
        bottom_right=bottom_right,
    )
    errs = {c.name: (c.err, c.bound) for c in comps}
    lse_ok = all(c.ok for c in comps if c.name == "lse")
    return all(c.ok for c in comps), errs, lse_ok, [c.as_dict() for c in comps]


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _kernel_names(fn, prefix):
    """The kernels named prefix* that fn() launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.name.split("<")[0].split("::")[-1] for e in prof.events() if prefix in e.name}
    return sorted(n for n in names if n.startswith(prefix))


def _fwd_kernel_names(fn):
    """The forward kernels fn() launches."""
    return _kernel_names(fn, "flash_fwd")


def _bwd_kernel_names(fn):
    """The backward kernels fn() launches (flash_bwd*: the dK / dV / dQ kernels)."""
    return _kernel_names(fn, "flash_bwd")


# The warp-specialized TMA backward kernels (head dims 64/96/128, and 192/256).
TMA_BWD_KERNELS = ("flash_bwd_sm90_ws_kernel", "flash_bwd_sm90_ws_split_kernel")


def check_varlen_case(lens_q, lens_k, hq, hk, d, dtype, causal, window=(-1, -1)):
    """A varlen batch, forward and backward through the op, each sequence
    against the oracle (check_attention; sequences without queries or keys:
    zeros / -inf). Returns (ok, {name: (worst err, its bound)}, lse_ok,
    [comparison dicts], forward and backward kernel names): on sm90 the forward
    and the backward must be the warp-specialized TMA kernels."""
    scale = 1.0 / math.sqrt(d)
    wl, wr = window
    if causal:
        wr = 0
    q = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=dtype, requires_grad=True)
    cq, ck = _cu(lens_q), _cu(lens_k)
    args = (cq, ck, max(lens_q), max(lens_k), scale, wl, wr, True)
    out, lse = _ops.varlen_attention(q, k, v, *args, False)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    names = _fwd_kernel_names(lambda: _ops.varlen_fwd(q.detach(), k.detach(), v.detach(), *args))
    bwd_names = _bwd_kernel_names(
        lambda: _ops.varlen_bwd(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), *args, False)
    )
    ok, lse_ok, errs, comps = True, True, {}, []
    bq, bk = _cu(lens_q).tolist(), _cu(lens_k).tolist()
    for i in range(len(lens_q)):
        sq, eq, sk, ek = bq[i], bq[i + 1], bk[i], bk[i + 1]
        if eq == sq:
            continue
        if ek == sk:  # queries that see no key
            good = bool((out[sq:eq] == 0).all()) and bool(torch.isneginf(lse[:, sq:eq]).all())
            ok &= good
            lse_ok &= good
            if not good:
                comps.append(
                    dict(
                        name="out",
                        ok=False,
                        err=0.0,
                        bound=0.0,
                        sequence=i,
                        problem="rows that see no key: not 0 / -inf",
                    )
                )
            continue
        res = check_attention(
            q.detach()[None, sq:eq],
            k.detach()[None, sk:ek],
            v.detach()[None, sk:ek],
            out.detach()[None, sq:eq],
            lse.detach()[None, :, sq:eq],
            dout[None, sq:eq],
            (dq[None, sq:eq], dk[None, sk:ek], dv[None, sk:ek]),
            softmax_scale=scale,
            window_size=(wl, wr),
            bottom_right=True,
        )
        for c in res:
            ok &= c.ok
            lse_ok &= c.ok or c.name != "lse"
            if c.name not in errs or c.err / max(c.bound, 1e-30) > errs[c.name][0] / max(errs[c.name][1], 1e-30):
                errs[c.name] = (c.err, c.bound)
            comps.append(dict(c.as_dict(), sequence=i))
    # Head dims with a warp-specialized forward (32 runs the mma.sync kernel everywhere).
    if torch.cuda.get_device_capability() == (9, 0) and d >= 64 and "flash_fwd_sm90_ws_kernel" not in names:
        ok = False
        comps.append(
            dict(name="dispatch", ok=False, err=0.0, bound=0.0, problem=f"forward ran {names}, not the TMA kernel")
        )
    if torch.cuda.get_device_capability() == (9, 0) and d >= 64 and not any(n in TMA_BWD_KERNELS for n in bwd_names):
        ok = False
        comps.append(
            dict(name="dispatch", ok=False, err=0.0, bound=0.0, problem=f"backward ran {bwd_names}, not the TMA kernel")
        )
    return ok, errs, lse_ok, comps, names + bwd_names


def race_check(dtype, det, reps, causal=True):
    q = torch.randn(2, 1000, 8, 128, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(2, 1000, 2, 128, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(2, 1000, 2, 128, device="cuda", dtype=dtype, requires_grad=True)
    dout = torch.randn(2, 1000, 8, 128, device="cuda", dtype=dtype)
    first = None
    for _ in range(reps):
        out, lse = _ops.fwd(q, k, v, 0.1, -1, 0 if causal else -1, True, det)
        grads = torch.autograd.grad(out, (q, k, v), dout) if det else ()
        cur = (out, lse) + tuple(grads)
        if first is None:
            first = cur
        elif not all(torch.equal(a, b) for a, b in zip(first, cur)):
            return False
    return True


def varlen_race_check(dtype, reps, det_bwd=False, d=128):
    """The varlen forward (the persistent TMA kernel on sm90) is bitwise equal
    over repeats; with det_bwd also the deterministic backward (the TMA
    backward's fixed dQ order on sm90)."""
    lens = [1000, 1, 0, 777, 129, 2048, 64]
    q = torch.randn(sum(lens), 8, d, device="cuda", dtype=dtype)
    k = torch.randn(sum(lens), 2, d, device="cuda", dtype=dtype)
    v = torch.randn(sum(lens), 2, d, device="cuda", dtype=dtype)
    dout = torch.randn_like(q)
    c = _cu(lens)
    first = None
    for _ in range(reps):
        cur = _ops.varlen_fwd(q, k, v, c, c, max(lens), max(lens), 0.1, -1, 0, True)
        if det_bwd:
            cur = tuple(cur) + tuple(
                _ops.varlen_bwd(dout, q, k, v, cur[0], cur[1], c, c, max(lens), max(lens), 0.1, -1, 0, True, True)
            )
        if first is None:
            first = cur
        elif not all(torch.equal(a, b) for a, b in zip(first, cur)):
            return False
    return True


def bench(fn, reps=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        start[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(start, end))
    return times[len(times) // 2]


@contextlib.contextmanager
def env_set(name):
    """Runs the block with the switch `name`=1 (the C++ side reads it on every call)."""
    os.environ[name] = "1"
    try:
        yield
    finally:
        del os.environ[name]


def bench_side_by_side(entries, rounds=3, reps=10):
    """{name: median ms} of entries {name: (context factory, fn)}, timed in
    rounds, every entry once a round: a drift of the GPU over the run, or a
    penalty of whatever is timed first (seen: the first of the variants timed
    one after the other read up to 12% low), then hits them all alike."""
    times = {name: [] for name in entries}
    for _ in range(rounds):
        for name, (ctx, fn) in entries.items():
            with ctx():
                times[name].append(bench(fn, reps))
    return {name: statistics.median(t) for name, t in times.items()}


def quick_perf(dims):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for d in dims:
        for causal in (False, True):
            for n in (1024, 4096):
                b, h = 16384 // n, 2048 // d
                q = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                k = torch.randn_like(q, requires_grad=True)
                v = torch.randn_like(q, requires_grad=True)
                flops = attention_flops(b, h, n, n, d, causal)
                wr = 0 if causal else -1
                out, lse = _ops.fwd(q, k, v, d**-0.5, -1, wr, True, False)
                dout = torch.randn_like(out)
                res = {"d": d, "n": n, "causal": causal}
                fwd = lambda: _ops.fwd(q, k, v, d**-0.5, -1, wr, True, False)  # noqa: E731
                bwd = lambda: _ops.bwd(dout, q, k, v, out, lse, d**-0.5, -1, wr, True, False)  # noqa: E731
                det_bwd = lambda: _ops.bwd(dout, q, k, v, out, lse, d**-0.5, -1, wr, True, True)  # noqa: E731
                plain = contextlib.nullcontext
                entries = {"ours_fwd": (plain, fwd), "ours_bwd": (plain, bwd), "det_bwd": (plain, det_bwd)}
                if torch.cuda.get_device_capability() == (9, 0):
                    # Side by side on an sm90 device: the Hopper kernels without TMA (the
                    # cp.async wgmma kernels) and the mma.sync kernels.
                    variants = [
                        ("FLASHATTN_DISABLE_TMA", "notma", {"fwd": fwd, "bwd": bwd}),
                        ("FLASHATTN_DISABLE_SM90", "sm80", {"fwd": fwd, "bwd": bwd}),
                    ]
                    if d == 64:  # the backward's 64-query steps beside its 128-query steps
                        variants.append(("FLASHATTN_BWD_D64_SHORT_STEPS", "short", {"bwd": bwd}))
                        variants.append(("FLASHATTN_BWD_D64_SHORT_STEPS", "shortdet", {"bwd": det_bwd}))
                    if not causal:  # the deterministic backward's plain sweeps beside the rotated ones
                        variants.append(("FLASHATTN_DQ_PLAIN_ORDER", "detplain", {"bwd": det_bwd}))
                    for env, name, fns in variants:
                        for mode, fn in fns.items():
                            entries[f"{name}_{mode}"] = (functools.partial(env_set, env), fn)
                qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
                for name, be in (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    ctx = functools.partial(sdpa_kernel, be)
                    try:
                        with ctx():
                            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    except Exception as exc:  # a backend that refuses a shape
                        res[name + "_err"] = str(exc)[:100]
                        continue
                    do = torch.randn_like(o)
                    entries[name + "_fwd"] = (ctx, lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
                    entries[name + "_bwd"] = (
                        ctx,
                        lambda o=o, do=do: torch.autograd.grad(o, (qt, kt, vt), do, retain_graph=True),
                    )
                res.update(bench_side_by_side(entries))
                for key in list(res):
                    if key.endswith("_fwd"):
                        res[key.replace("_fwd", "_fwd_tflops")] = flops / res[key] / 1e9
                    if key.endswith("_bwd"):
                        res[key.replace("_bwd", "_bwd_tflops")] = (
                            attention_flops(b, h, n, n, d, causal, "bwd") / res[key] / 1e9
                        )
                rows.append(res)
                detplain = f" / plain order {res['detplain_bwd_tflops']:.0f}" if "detplain_bwd_tflops" in res else ""
                if "short_bwd_tflops" in res:
                    detplain += f", 64-query steps {res['short_bwd_tflops']:.0f} / deterministic {res['shortdet_bwd_tflops']:.0f}"
                print(
                    f"perf d{d} n{n} causal={causal}: fwd ours {res.get('ours_fwd_tflops', 0):.0f} "
                    f"(no TMA {res.get('notma_fwd_tflops', 0):.0f}, mma.sync {res.get('sm80_fwd_tflops', 0):.0f}) "
                    f"fa2 {res.get('fa2_fwd_tflops', 0):.0f} cudnn {res.get('cudnn_fwd_tflops', 0):.0f} | "
                    f"bwd ours {res.get('ours_bwd_tflops', 0):.0f} (deterministic {res.get('det_bwd_tflops', 0):.0f}"
                    f"{detplain}, "
                    f"no TMA {res.get('notma_bwd_tflops', 0):.0f}, "
                    f"mma.sync {res.get('sm80_bwd_tflops', 0):.0f}) "
                    f"fa2 {res.get('fa2_bwd_tflops', 0):.0f} "
                    f"cudnn {res.get('cudnn_bwd_tflops', 0):.0f} TFLOP/s",
                    flush=True,
                )
    return rows


def varlen_perf(dims):
    """The varlen forward and backward against the dense ones on the same
    tokens (16k, bf16, heads 2048 / d): 8 sequences of 2k as one dense batch
    and as a varlen batch (the cost of the varlen path itself; issue #10's
    target is within 5%), the varlen batch with FLASHATTN_DISABLE_TMA=1 (the
    cp.async kernels it ran on before), and mixed lengths (useful FLOPs of the
    real sequences, forward)."""
    rows = []
    mixed = [4096, 512, 3000, 1, 2048, 777, 4000, 1950]  # 16384 tokens
    for d in dims:
        h = 2048 // d
        for causal in (False, True):
            wr = 0 if causal else -1
            q = torch.randn(8, 2048, h, d, device="cuda", dtype=torch.bfloat16)
            k, v = torch.randn_like(q), torch.randn_like(q)
            res = {"d": d, "causal": causal}
            flops = attention_flops(8, h, 2048, 2048, d, causal)
            res["dense_fwd"] = bench(lambda: _ops.fwd_op(q, k, v, d**-0.5, -1, wr, True))
            qv, kv, vv = (x.reshape(8 * 2048, h, d) for x in (q, k, v))
            c = _cu([2048] * 8)
            vfwd = lambda: _ops.varlen_fwd(qv, kv, vv, c, c, 2048, 2048, d**-0.5, -1, wr, True)  # noqa: E731
            res["varlen_fwd"] = bench(vfwd)
            res["varlen_kernels"] = _fwd_kernel_names(vfwd)
            out, lse = _ops.fwd_op(q, k, v, d**-0.5, -1, wr, True)
            dout = torch.randn_like(q)
            res["dense_bwd"] = bench(lambda: _ops.bwd(dout, q, k, v, out, lse, d**-0.5, -1, wr, True, False))
            vout, vlse = vfwd()
            dv_out = dout.reshape(8 * 2048, h, d)
            vbwd = lambda: _ops.varlen_bwd(  # noqa: E731
                dv_out, qv, kv, vv, vout, vlse, c, c, 2048, 2048, d**-0.5, -1, wr, True, False
            )
            res["varlen_bwd"] = bench(vbwd)
            res["varlen_kernels"] += _bwd_kernel_names(vbwd)
            os.environ["FLASHATTN_DISABLE_TMA"] = "1"
            try:
                res["varlen_notma_fwd"] = bench(vfwd)
                res["varlen_notma_bwd"] = bench(vbwd)
            finally:
                del os.environ["FLASHATTN_DISABLE_TMA"]
            cm = _cu(mixed)
            res["mixed_fwd"] = bench(
                lambda: _ops.varlen_fwd(qv, kv, vv, cm, cm, max(mixed), max(mixed), d**-0.5, -1, wr, True)
            )
            mixed_flops = sum(attention_flops(1, h, n, n, d, causal) for n in mixed)
            for key in ("dense_fwd", "varlen_fwd", "varlen_notma_fwd"):
                res[key + "_tflops"] = flops / res[key] / 1e9
            bwd_flops = attention_flops(8, h, 2048, 2048, d, causal, "bwd")
            for key in ("dense_bwd", "varlen_bwd", "varlen_notma_bwd"):
                res[key + "_tflops"] = bwd_flops / res[key] / 1e9
            res["mixed_fwd_tflops"] = mixed_flops / res["mixed_fwd"] / 1e9
            res["varlen_over_dense"] = res["dense_fwd"] / res["varlen_fwd"]
            res["varlen_bwd_over_dense"] = res["dense_bwd"] / res["varlen_bwd"]
            res["varlen_fwd_bwd_over_dense"] = (res["dense_fwd"] + res["dense_bwd"]) / (
                res["varlen_fwd"] + res["varlen_bwd"]
            )
            rows.append(res)
            print(
                f"varlen perf d{d} causal={causal}: fwd dense {res['dense_fwd_tflops']:.0f}, varlen "
                f"{res['varlen_fwd_tflops']:.0f} ({res['varlen_over_dense']:.2f} of dense; "
                f"{res['varlen_kernels']}), varlen no TMA {res['varlen_notma_fwd_tflops']:.0f}, "
                f"mixed lengths {res['mixed_fwd_tflops']:.0f} useful TFLOP/s; bwd dense "
                f"{res['dense_bwd_tflops']:.0f}, varlen {res['varlen_bwd_tflops']:.0f} "
                f"({res['varlen_bwd_over_dense']:.2f} of dense), varlen no TMA {res['varlen_notma_bwd_tflops']:.0f}; "
                f"fwd+bwd varlen {res['varlen_fwd_bwd_over_dense']:.2f} of dense",
                flush=True,
            )
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-perf", action="store_true")
    args = ap.parse_args()
    info = flashattn_ext.build_info()
    dims = list(info["head_dims"])
    print(f"build {info}; device {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)

    cases = []
    for d in dims:
        for dtype in (torch.bfloat16, torch.float16):
            cases.append(dict(b=2, nq=1023, nk=1025, hq=4, hk=4, d=d, dtype=dtype, causal=False, bottom_right=True))
            cases.append(dict(b=2, nq=1025, nk=1023, hq=4, hk=2, d=d, dtype=dtype, causal=True, bottom_right=True))
        cases.append(dict(b=1, nq=113, nk=17, hq=6, hk=1, d=d, dtype=torch.bfloat16, causal=True, bottom_right=True))
        cases.append(dict(b=1, nq=113, nk=17, hq=6, hk=3, d=d, dtype=torch.bfloat16, causal=True, bottom_right=False))
        cases.append(dict(b=3, nq=1, nk=4097, hq=2, hk=2, d=d, dtype=torch.float16, causal=False, bottom_right=True))
        cases.append(
            dict(
                b=1,
                nq=300,
                nk=300,
                hq=2,
                hk=2,
                d=d,
                dtype=torch.bfloat16,
                causal=False,
                bottom_right=True,
                window=(37, 5),
            )
        )
        cases.append(
            dict(
                b=2,
                nq=257,
                nk=513,
                hq=4,
                hk=4,
                d=d,
                dtype=torch.bfloat16,
                causal=True,
                bottom_right=False,
                layout="bhnd",
            )
        )
        cases.append(
            dict(b=2, nq=512, nk=512, hq=4, hk=2, d=d, dtype=torch.bfloat16, causal=True, bottom_right=True, det=True)
        )
        # Unmasked deterministic: rotated sweeps (more query steps than key blocks), odd lengths.
        cases.append(
            dict(b=2, nq=1000, nk=777, hq=4, hk=2, d=d, dtype=torch.bfloat16, causal=False, bottom_right=True, det=True)
        )
    for d in (8, 40, 80, 100):
        if any(x >= d for x in dims):
            cases.append(
                dict(b=2, nq=129, nk=77, hq=2, hk=2, d=d, dtype=torch.bfloat16, causal=False, bottom_right=True)
            )
    if args.quick:
        cases = cases[::3]
    # Varlen batches: lengths 0 and 1, on both sides of the tiles, several tiles a sequence, GQA / MQA.
    varlen_cases = []
    for d in dims:
        for dtype in (torch.bfloat16, torch.float16):
            varlen_cases.append(
                dict(
                    lens_q=[130, 0, 1, 257, 64, 17, 1100],
                    lens_k=[200, 5, 0, 129, 64, 300, 1023],
                    hq=4,
                    hk=2,
                    d=d,
                    dtype=dtype,
                    causal=True,
                )
            )
        varlen_cases.append(
            dict(
                lens_q=[1, 700, 0, 129, 63, 385],
                lens_k=[700, 1, 9, 64, 129, 383],
                hq=6,
                hk=1,
                d=d,
                dtype=torch.bfloat16,
                causal=False,
            )
        )
        varlen_cases.append(
            dict(
                lens_q=[300, 5, 257],
                lens_k=[300, 260, 129],
                hq=4,
                hk=2,
                d=d,
                dtype=torch.bfloat16,
                causal=False,
                window=(37, 5),
            )
        )
    if args.quick:
        varlen_cases = varlen_cases[::2]

    results, failures = [], 0
    t0 = time.time()
    for c in cases:
        try:
            ok, errs, lse_ok, comps = check_case(**c)
        except Exception as exc:  # report, keep going
            ok, errs, lse_ok, comps = False, {"exception": str(exc)[:300]}, False, []
        failures += not ok
        desc = {k: (str(v) if not isinstance(v, (int, bool, tuple)) else v) for k, v in c.items()}
        results.append({"case": desc, "ok": ok, "errs": errs, "lse_ok": lse_ok, "comparisons": comps})
        # name=error/bound per quantity; a failure also gets the rule's own message
        err_s = " ".join(f"{k}={v[0]:.2e}/{v[1]:.2e}" if isinstance(v, tuple) else f"{k}={v}" for k, v in errs.items())
        why = "; ".join(
            c["problem"] or f"{c['name']} error {c['err']:.2e} > bound {c['bound']:.2e}" for c in comps if not c["ok"]
        )
        print(f"{'PASS' if ok else 'FAIL'} {desc} lse_ok={lse_ok} {err_s}" + (f" [{why}]" if why else ""), flush=True)
    varlen_failures = 0
    for c in varlen_cases:
        try:
            ok, errs, lse_ok, comps, names = check_varlen_case(**c)
        except Exception as exc:  # report, keep going
            ok, errs, lse_ok, comps, names = False, {"exception": str(exc)[:300]}, False, [], []
        varlen_failures += not ok
        desc = {k: (str(v) if not isinstance(v, (int, bool, tuple, list)) else v) for k, v in c.items()}
        results.append(
            {
                "case": dict(desc, varlen=True),
                "ok": ok,
                "errs": errs,
                "lse_ok": lse_ok,
                "comparisons": comps,
                "kernels": names,  # forward and backward
            }
        )
        err_s = " ".join(f"{k}={v[0]:.2e}/{v[1]:.2e}" if isinstance(v, tuple) else f"{k}={v}" for k, v in errs.items())
        why = "; ".join(
            c.get("problem")
            or f"sequence {c.get('sequence')} {c['name']} error {c['err']:.2e} > bound {c['bound']:.2e}"
            for c in comps
            if not c["ok"]
        )
        print(
            f"{'PASS' if ok else 'FAIL'} varlen {desc} kernels={names} lse_ok={lse_ok} {err_s}"
            + (f" [{why}]" if why else ""),
            flush=True,
        )
    failures += varlen_failures
    n_cases = len(cases) + len(varlen_cases)
    print(f"correctness: {n_cases - failures}/{n_cases} passed in {time.time() - t0:.1f}s", flush=True)

    race = {}
    # Deterministic with and without the mask: they add dQ in different orders
    # (plain and rotated sweeps, dq_wait_for_turn).
    for det, causal in ((False, True), (True, True), (True, False)):
        race[f"det={det},causal={causal}"] = race_check(torch.bfloat16, det, 20 if args.quick else 100, causal)
    race["varlen_fwd"] = varlen_race_check(torch.bfloat16, 20 if args.quick else 100)
    for d in (64, 256):
        if d in dims:
            race[f"varlen_det_bwd_d{d}"] = varlen_race_check(torch.bfloat16, 10 if args.quick else 30, True, d)
    print(f"race check (bitwise equal over repeats): {race}", flush=True)
    failures += not all(race.values())

    perf = [] if args.no_perf else quick_perf([d for d in (64, 128, 256) if d in dims])
    vperf = [] if args.no_perf else varlen_perf([d for d in (64, 128, 256) if d in dims])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "results": results,
                    "race": race,
                    "perf": perf,
                    "varlen_perf": vperf,
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                },
                f,
                indent=1,
            )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
