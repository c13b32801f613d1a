#!/usr/bin/env python3
"""One attention case, run a few times, for a profiler to capture (the grid's
shapes: bf16, 16k tokens, heads = 2048 / head_dim). Under Nsight Compute:

    ncu --clock-control none -k regex:flash_bwd_sm90 -c 1 --section WarpStateStats \\
        --section SourceCounters python3 benchmarks/profile_case.py --d 128 --n 4096 --bwd

Without a profiler it prints the case's time per call (CUDA events); with
--kernels, torch.profiler's per-kernel GPU times of the same calls (ours, then
cuDNN's through torch's SDPA), to see what besides the main kernel a call runs."""

import argparse

import torch

import flashattn_ext

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--d", type=int, default=128)
ap.add_argument("--n", type=int, default=4096)
ap.add_argument("--causal", action="store_true")
ap.add_argument("--bwd", action="store_true", help="run forward and backward")
ap.add_argument("--deterministic", action="store_true", help="the deterministic backward")
ap.add_argument("--iters", type=int, default=3)
ap.add_argument("--kernels", action="store_true", help="per-kernel GPU times (torch.profiler), ours and cuDNN's")
args = ap.parse_args()

heads = 2048 // args.d
batch = max(1, 16384 // args.n)
q, k, v = (
    torch.randn(batch, args.n, heads, args.d, device="cuda", dtype=torch.bfloat16, requires_grad=args.bwd)
    for _ in range(3)
)
dout = torch.randn_like(q)


def step():
    out = flashattn_ext.flash_attn_func(q, k, v, causal=args.causal, deterministic=args.deterministic)
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
print(
    f"d{args.d} n{args.n} causal={args.causal} bwd={args.bwd} deterministic={args.deterministic}: "
    f"{start.elapsed_time(end) / args.iters:.3f} ms a call"
)

if args.kernels:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_(args.bwd) for x in (q, k, v))
    dout_t = dout.transpose(1, 2)

    def cudnn_step():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)
            if args.bwd:
                torch.autograd.grad(out, (qt, kt, vt), dout_t)

    for name, fn in (("ours", step), ("cudnn", cudnn_step)):
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                fn()
            torch.cuda.synchronize()
        print(f"--- {name}: GPU time per kernel, summed over {args.iters} calls")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
