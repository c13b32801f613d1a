#!/usr/bin/env python3
"""One attention case, run a few times, for a profiler to capture (the grid's
shapes: bf16, 16k tokens, heads = 2048 / head_dim). Under Nsight Compute:

    ncu --clock-control none -k regex:flash_bwd_sm90 -c 1 --section WarpStateStats \\
        --section SourceCounters python3 benchmarks/profile_case.py --d 128 --n 4096 --bwd

Without a profiler it prints the case's time per call (CUDA events)."""

import argparse

import torch

import flashattn_ext

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--d", type=int, default=128)
ap.add_argument("--n", type=int, default=4096)
ap.add_argument("--causal", action="store_true")
ap.add_argument("--bwd", action="store_true", help="run forward and backward")
ap.add_argument("--iters", type=int, default=3)
args = ap.parse_args()

heads = 2048 // args.d
batch = max(1, 16384 // args.n)
q, k, v = (
    torch.randn(batch, args.n, heads, args.d, device="cuda", dtype=torch.bfloat16, requires_grad=args.bwd)
    for _ in range(3)
)
dout = torch.randn_like(q)


def step():
    out = flashattn_ext.flash_attn_func(q, k, v, causal=args.causal)
    if args.bwd:
        torch.autograd.grad(out, (q, k, v), dout)


step()
torch.cuda.synchronize()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(args.iters):
    step()
end.record()
torch.cuda.synchronize()
print(f"d{args.d} n{args.n} causal={args.causal} bwd={args.bwd}: {start.elapsed_time(end) / args.iters:.3f} ms a call")
