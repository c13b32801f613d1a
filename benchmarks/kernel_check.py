"""Kernel-level check for a GPU visit: correctness of the CUDA forward and
backward against an fp32 oracle over a matrix of shapes (tolerance rule of
shared/GUIDE.md), a bitwise race check, and a quick timing against torch's
SDPA backends. Prints one line per case and a summary; exits non-zero on any
failure. Usage: python benchmarks/kernel_check.py [--json PATH] [--quick]
"""

import argparse
import json
import math
import os
import sys
import time

import torch

import flashattn_ext  # noqa: F401
from flashattn_ext import _ops


def oracle(q, k, v, scale, window_left, window_right, bottom_right, dtype):
    """Naive attention on (B, N, H, D) inputs in `dtype`; GQA by repeating kv heads."""
    b, nq, hq, d = q.shape
    nk, hk = k.shape[1], k.shape[2]
    qf, kf, vf = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    if hk != hq:
        kf = kf.repeat_interleave(hq // hk, dim=1)
        vf = vf.repeat_interleave(hq // hk, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    i = torch.arange(nq, device=q.device)[:, None]
    j = torch.arange(nk, device=q.device)[None, :]
    off = nk - nq if bottom_right else 0
    visible = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    if window_right >= 0:
        visible &= j <= i + off + window_right
    if window_left >= 0:
        visible &= j >= i + off - window_left
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s.float(), dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    o = torch.matmul(p, vf)
    return o.transpose(1, 2), lse


def rel_err(x, ref):
    return ((x.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()


def check_case(b, nq, nk, hq, hk, d, dtype, causal, bottom_right, window=(-1, -1), det=False, layout="bnhd"):
    dev = "cuda"
    scale = 1.0 / math.sqrt(d)
    wl, wr = window
    if causal:
        wr = 0

    def make(n, h):
        if layout == "bhnd":  # a transposed view, as SDPA users pass it
            return torch.randn(b, h, n, d, device=dev, dtype=dtype).transpose(1, 2)
        return torch.randn(b, n, h, d, device=dev, dtype=dtype)

    q, k, v = make(nq, hq), make(nk, hk), make(nk, hk)
    for x in (q, k, v):
        x.requires_grad_(True)
    out, lse = _ops.fwd(q, k, v, scale, wl, wr, bottom_right, det)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)

    qr, kr, vr = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    ref_o, ref_lse = oracle(qr, kr, vr, scale, wl, wr, bottom_right, torch.float32)
    ref_grads = torch.autograd.grad(ref_o, (qr, kr, vr), dout.float())
    ql, kl, vl = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    low_o, _ = oracle(ql, kl, vl, scale, wl, wr, bottom_right, dtype)
    low_grads = torch.autograd.grad(low_o, (ql, kl, vl), dout)

    errs = {}
    ok = True
    e, base = rel_err(out, ref_o), rel_err(low_o, ref_o)
    errs["o"] = (e, base)
    ok &= e <= 2 * base + 1e-3 and not out.isnan().any().item()
    finite = torch.isfinite(ref_lse)
    lse_ok = torch.equal(torch.isfinite(lse), finite) and (
        (lse[finite] - ref_lse[finite]).abs().max().item() < 1e-3 if finite.any() else True
    )
    ok &= bool(lse_ok)
    for name, g, rg, lg in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, low_grads):
        e, base = rel_err(g, rg), rel_err(lg, rg)
        errs[name] = (e, base)
        ok &= e <= 3 * base + 2e-3 and not g.isnan().any().item()
    return ok, errs, bool(lse_ok)


def race_check(dtype, det, reps):
    q = torch.randn(2, 1000, 8, 128, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(2, 1000, 2, 128, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(2, 1000, 2, 128, device="cuda", dtype=dtype, requires_grad=True)
    dout = torch.randn(2, 1000, 8, 128, device="cuda", dtype=dtype)
    first = None
    for _ in range(reps):
        out, lse = _ops.fwd(q, k, v, 0.1, -1, 0, True, det)
        grads = torch.autograd.grad(out, (q, k, v), dout) if det else ()
        cur = (out, lse) + tuple(grads)
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


def quick_perf(dims):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    rows = []
    for d in dims:
        for causal in (False, True):
            for n in (1024, 4096):
                b, h = 16384 // n, 2048 // d
                q = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                k = torch.randn_like(q, requires_grad=True)
                v = torch.randn_like(q, requires_grad=True)
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                out, lse = _ops.fwd(q, k, v, d**-0.5, -1, 0 if causal else -1, True, False)
                dout = torch.randn_like(out)
                res = {"d": d, "n": n, "causal": causal}
                res["ours_fwd"] = bench(lambda: _ops.fwd(q, k, v, d**-0.5, -1, 0 if causal else -1, True, False))
                res["ours_bwd"] = bench(
                    lambda: _ops.bwd(dout, q, k, v, out, lse, d**-0.5, -1, 0 if causal else -1, True, False)
                )
                if torch.cuda.get_device_capability() == (9, 0):  # the Hopper forward without TMA, for comparison
                    os.environ["FLASHATTN_DISABLE_TMA"] = "1"
                    try:
                        res["notma_fwd"] = bench(
                            lambda: _ops.fwd(q, k, v, d**-0.5, -1, 0 if causal else -1, True, False)
                        )
                    finally:
                        del os.environ["FLASHATTN_DISABLE_TMA"]
                if torch.cuda.get_device_capability() == (9, 0):  # the mma.sync kernels, for comparison
                    os.environ["FLASHATTN_DISABLE_SM90"] = "1"
                    try:
                        res["sm80_fwd"] = bench(
                            lambda: _ops.fwd(q, k, v, d**-0.5, -1, 0 if causal else -1, True, False)
                        )
                        res["sm80_bwd"] = bench(
                            lambda: _ops.bwd(dout, q, k, v, out, lse, d**-0.5, -1, 0 if causal else -1, True, False)
                        )
                    finally:
                        del os.environ["FLASHATTN_DISABLE_SM90"]
                qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
                for name, be in (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        with sdpa_kernel(be):
                            res[name + "_fwd"] = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
                            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                            do = torch.randn_like(o)
                            res[name + "_bwd"] = bench(lambda: torch.autograd.grad(o, (qt, kt, vt), do, retain_graph=True))
                    except Exception as exc:  # a backend that refuses a shape
                        res[name + "_err"] = str(exc)[:100]
                for key in list(res):
                    if key.endswith("_fwd"):
                        res[key.replace("_fwd", "_fwd_tflops")] = flops / res[key] / 1e9
                    if key.endswith("_bwd"):
                        res[key.replace("_bwd", "_bwd_tflops")] = 2.5 * flops / res[key] / 1e9
                rows.append(res)
                print(
                    f"perf d{d} n{n} causal={causal}: fwd ours {res.get('ours_fwd_tflops', 0):.0f} "
                    f"(no TMA {res.get('notma_fwd_tflops', 0):.0f}, mma.sync {res.get('sm80_fwd_tflops', 0):.0f}) "
                    f"fa2 {res.get('fa2_fwd_tflops', 0):.0f} cudnn {res.get('cudnn_fwd_tflops', 0):.0f} | "
                    f"bwd ours {res.get('ours_bwd_tflops', 0):.0f} (mma.sync {res.get('sm80_bwd_tflops', 0):.0f}) "
                    f"fa2 {res.get('fa2_bwd_tflops', 0):.0f} "
                    f"cudnn {res.get('cudnn_bwd_tflops', 0):.0f} TFLOP/s",
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
        cases.append(dict(b=1, nq=300, nk=300, hq=2, hk=2, d=d, dtype=torch.bfloat16, causal=False, bottom_right=True,
                          window=(37, 5)))
        cases.append(dict(b=2, nq=257, nk=513, hq=4, hk=4, d=d, dtype=torch.bfloat16, causal=True, bottom_right=False,
                          layout="bhnd"))
        cases.append(dict(b=2, nq=512, nk=512, hq=4, hk=2, d=d, dtype=torch.bfloat16, causal=True, bottom_right=True,
                          det=True))
    for d in (8, 40, 80, 100):
        if any(x >= d for x in dims):
            cases.append(dict(b=2, nq=129, nk=77, hq=2, hk=2, d=d, dtype=torch.bfloat16, causal=False, bottom_right=True))
    if args.quick:
        cases = cases[::3]

    results, failures = [], 0
    t0 = time.time()
    for c in cases:
        try:
            ok, errs, lse_ok = check_case(**c)
        except Exception as exc:  # report, keep going
            ok, errs, lse_ok = False, {"exception": str(exc)[:300]}, False
        failures += not ok
        desc = {k: (str(v) if not isinstance(v, (int, bool, tuple)) else v) for k, v in c.items()}
        results.append({"case": desc, "ok": ok, "errs": errs, "lse_ok": lse_ok})
        err_s = " ".join(f"{k}={v[0]:.2e}/{v[1]:.2e}" if isinstance(v, tuple) else f"{k}={v}" for k, v in errs.items())
        print(f"{'PASS' if ok else 'FAIL'} {desc} lse_ok={lse_ok} {err_s}", flush=True)
    print(f"correctness: {len(cases) - failures}/{len(cases)} passed in {time.time() - t0:.1f}s", flush=True)

    race = {}
    for det in (False, True):
        race[f"det={det}"] = race_check(torch.bfloat16, det, 20 if args.quick else 100)
    print(f"race check (bitwise equal over repeats): {race}", flush=True)
    failures += not all(race.values())

    perf = [] if args.no_perf else quick_perf([d for d in (64, 128, 256) if d in dims])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "race": race, "perf": perf, "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__}, f, indent=1)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
