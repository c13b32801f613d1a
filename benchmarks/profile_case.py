#!/usr/bin/env python3
"""One attention case, run a few times, for a profiler to capture (the grid's
shapes: bf16, 16k tokens, heads = 2048 / head_dim). Under Nsight Compute:

    ncu --clock-control none -k regex:flash_bwd_sm90 -c 1 --section WarpStateStats \\
        --section SourceCounters python3 benchmarks/profile_case.py --d 128 --n 4096 --bwd

Without a profiler it prints the case's time per call (CUDA events); with
--kernels, torch.profiler's per-kernel GPU times of the same calls (ours, then
cuDNN's through torch's SDPA), to see what besides the main kernel a call runs. --documents K: the SDPA
drop-in with a block-diagonal bool attn_mask of K packed documents instead, and
with --kernels flash_attn_varlen_func on the same documents as the peer (what
the mask's tile skipping is measured against, issue 21)."""

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
ap.add_argument("--documents", type=int, default=0, help="an attn_mask of this many packed documents (0: none)")
args = ap.parse_args()

heads = 2048 // args.d
batch = max(1, 16384 // args.n)
q, k, v = (
    torch.randn(batch, args.n, heads, args.d, device="cuda", dtype=torch.bfloat16, requires_grad=args.bwd)
    for _ in range(3)
)
dout = torch.randn_like(q)


doc_mask = None
if args.documents:
    doc = torch.arange(args.n, device="cuda") * args.documents // args.n
    doc_mask = (doc[:, None] == doc[None, :])[None, None]


def step():
    if doc_mask is not None:
        out = flashattn_ext.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), attn_mask=doc_mask)
        out = out.transpose(1, 2)
    else:
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

    def varlen_step():  # the same documents as packed sequences
        cu = torch.arange(0, batch * args.n + 1, args.n // args.documents, device="cuda", dtype=torch.int32)
        flat = [x.reshape(batch * args.n, heads, args.d) for x in (q, k, v)]
        out = flashattn_ext.flash_attn_varlen_func(*flat, cu, cu, args.n // args.documents, args.n // args.documents)
        if args.bwd:
            torch.autograd.grad(out, flat, dout.reshape(out.shape))

    peer = ("varlen", varlen_step) if args.documents else ("cudnn", cudnn_step)
    for name, fn in (("ours", step), peer):
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                fn()
            torch.cuda.synchronize()
        print(f"--- {name}: GPU time per kernel, summed over {args.iters} calls")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
