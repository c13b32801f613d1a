#!/usr/bin/env python3
"""A first look at new kernels on a GPU: a few shapes per head dim against the
oracle, printed one line each (a hang or a crash shows which case). With
--bwd the gradients are checked too (relative error of dq, dk, dv); with
--deterministic the deterministic backward, run twice and compared bitwise."""

import argparse
import sys

import torch

import flashattn_ext
from flashattn_ext import reference

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--bwd", action="store_true", help="check the backward too")
ap.add_argument("--dims", default="64,128,192,256")
ap.add_argument(
    "--deterministic",
    action="store_true",
    help="deterministic backward; also checks that a second run is bitwise equal",
)
args = ap.parse_args()

torch.manual_seed(0)
bad = 0


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


for d in (int(x) for x in args.dims.split(",")):
    for b, nq, nk, hq, hk, causal in (
        (1, 128, 128, 2, 2, False),
        (2, 1000, 777, 4, 2, True),
        (1, 300, 4100, 2, 1, False),
        (1, 777, 1000, 2, 2, True),
    ):
        q, k, v = (
            torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=args.bwd)
            for n, h in ((nq, hq), (nk, hk), (nk, hk))
        )
        out, lse = flashattn_ext.flash_attn_func(
            q, k, v, causal=causal, deterministic=args.deterministic, return_lse=True
        )
        torch.cuda.synchronize()
        qf, kf, vf = (x.detach().float().requires_grad_(args.bwd) for x in (q, k, v))
        ref, ref_lse = reference.attention_ref(qf, kf, vf, causal=causal, return_lse=True)
        errs = {"out": rel(out, ref), "lse": (lse - ref_lse).abs().nan_to_num(0).max().item()}
        if args.bwd:
            dout = torch.randn_like(out)
            grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=args.deterministic)
            torch.cuda.synchronize()
            if args.deterministic:
                again = torch.autograd.grad(out, (q, k, v), dout)
                errs["rerun"] = 0.0 if all(torch.equal(a, b) for a, b in zip(grads, again)) else 1.0
            ref_grads = torch.autograd.grad(ref, (qf, kf, vf), dout.float())
            errs.update({n: rel(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
        ok = all(e < 2e-2 for e in errs.values()) and torch.isfinite(out).all().item()
        bad += not ok
        detail = ", ".join(f"{n} {e:.1e}" for n, e in errs.items())
        print(f"{'ok ' if ok else 'BAD'} d{d} b{b} nq{nq} nk{nk} hq{hq} hk{hk} causal={causal}: {detail}", flush=True)
sys.exit(1 if bad else 0)
