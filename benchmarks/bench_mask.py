#!/usr/bin/env python3
"""torch SDPA's attn_mask in our kernels against the peers that take it, side by
side in one run (issue 21's bar: a bool padding mask at least 0.9x our unmasked
speed and 1.3x cuDNN's with the same mask; an additive bias at least 1.5x
cuDNN's; a document mask at least 0.8x flash_attn_varlen_func on the same
sequences).

    python benchmarks/bench_mask.py --json out.json [--md out.md]
    python benchmarks/bench_mask.py --device cpu --shape 2,8,1024,64 --dtype float32 --impls ours,default --json out.json

Case: b4 h16 n4096 d128 bf16 (the issue's; --shape B,H,N,D and --dtype for
others), (B, H, N, D) views of (B, N, H, D)
tensors, forward (fwd), forward + backward (fwd_bwd, the mask gets no
gradient) and, for the float masks, forward + backward with the mask's gradient
too (fwd_bwd_grad: the mask requires grad; cuDNN has no such gradient); FLOPs
are the dense count (flashattn_ext.reference.attention_flops), whatever the
mask hides. Masks:
  none       no mask (the unmasked speed)
  padding    bool (B, 1, 1, N), each batch entry's last keys hidden (1, 3/4, 1, 7/8 kept, repeating)
  bias_b     (B, 1, N, N) additive bias of the inputs' dtype
  bias_h     (1, H, N, N) additive bias of the inputs' dtype (T5 / relative-position style)
  document   bool (1, 1, N, N) block-diagonal mask of 8 packed sequences of N/8
Implementations (torch.nn.functional.scaled_dot_product_attention under
torch.nn.attention.sdpa_kernel for the torch backends):
  ours       flashattn_ext.scaled_dot_product_attention
  cudnn      SDPBackend.CUDNN_ATTENTION
  efficient  SDPBackend.EFFICIENT_ATTENTION
  default    torch's own choice
  varlen     (document only) flashattn_ext.flash_attn_varlen_func on the 8 sequences
Timing: bench_gpu.make_timer (triton's do_bench, median; on the CPU
time.perf_counter, median). The table is printed last; its peer column is
cuDNN on the GPU and torch's default call (its CPU kernels) on the CPU.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_cpu  # noqa: E402
import bench_gpu  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

B, H, N, D = 4, 16, 4096, 128  # --shape
DTYPE = torch.bfloat16  # --dtype
MASKS = ["none", "padding", "bias_b", "bias_h", "document"]
IMPLS = ["ours", "cudnn", "efficient", "default", "varlen"]
DOCS = 8


def make_mask(kind, device, gen):
    if kind == "none":
        return None
    if kind == "padding":
        kept = torch.tensor([4, 3, 4, 3.5], device=device).repeat((B + 3) // 4)[:B] / 4
        keep = torch.arange(N, device=device) < (N * kept)[:, None]
        return keep[:, None, None, :]  # (B, 1, 1, N)
    if kind == "bias_b":
        return torch.randn(B, 1, N, N, device=device, dtype=DTYPE, generator=gen)
    if kind == "bias_h":
        return torch.randn(1, H, N, N, device=device, dtype=DTYPE, generator=gen)
    doc = torch.arange(N, device=device) // (N // DOCS)
    return (doc[:, None] == doc[None, :])[None, None]  # (1, 1, N, N)


def modes(kind):
    return ("fwd", "fwd_bwd", "fwd_bwd_grad") if kind.startswith("bias") else ("fwd", "fwd_bwd")


def make_call(impl, kind):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if impl == "ours":
        return lambda q, k, v, m: bench_gpu.OURS.scaled_dot_product_attention(q, k, v, attn_mask=m)
    if impl == "varlen":
        if kind != "document":
            return None
        fa = bench_gpu.OURS.flash_attn_varlen_func

        def call(q, k, v, m):
            qs, ks, vs = (x.transpose(1, 2).reshape(B * N, H, D) for x in (q, k, v))  # (B N, H, D): B * 8 sequences
            cu = torch.arange(0, B * N + 1, N // DOCS, device=q.device, dtype=torch.int32)
            return fa(qs, ks, vs, cu, cu, N // DOCS, N // DOCS)

        return call
    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}.get(impl)

    def call(q, k, v, m):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    return call


def time_case(call, mode, mask, bench, gen, device):
    q, k, v = (torch.randn(B, N, H, D, dtype=DTYPE, device=device, generator=gen).transpose(1, 2) for _ in range(3))
    if mode == "fwd":

        def fn():
            with torch.no_grad():
                call(q, k, v, mask)

    else:
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        dout = torch.randn(B, H, N, D, dtype=DTYPE, device=device, generator=gen)
        inputs = (q, k, v)
        if mode == "fwd_bwd_grad":
            mask = mask.detach().requires_grad_()
            inputs = (q, k, v, mask)

        def fn():
            out = call(q, k, v, mask)
            torch.autograd.grad(out, inputs, dout.reshape(out.shape) if out.dim() == 3 else dout)

    fn()
    ms = bench(fn)
    flops = bench_gpu.attention_flops(B, H, N, N, D, causal=False, mode="fwd") * (1.0 if mode == "fwd" else 3.5)
    return ms, bench_gpu.tflops(flops, ms)


def main():
    global B, H, N, D, DTYPE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--md")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--masks", default=",".join(MASKS), help="a subset of the masks (keep none: the ratios use it)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--shape", default=f"{B},{H},{N},{D}", help="B,H,N,D")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    B, H, N, D = (int(x) for x in args.shape.split(","))
    DTYPE = getattr(torch, args.dtype)
    impls = args.impls.split(",")
    masks = [m for m in MASKS if m in args.masks.split(",")]
    device = torch.device(args.device)
    peer = "cudnn" if device.type == "cuda" else "default"
    # (the CPU: a second of repetitions a case, the shared machines' noise)
    bench, how = bench_gpu.make_timer(device) if device.type == "cuda" else bench_gpu.make_timer(device, 50, 1000)
    gen = torch.Generator(device=device).manual_seed(0)
    if device.type == "cpu":  # the first case timed paid for the process's first large allocations (seen: 20%)
        for impl in impls:
            if make_call(impl, "none") is not None:
                time_case(make_call(impl, "none"), "fwd_bwd", None, bench, gen, device)
    rows = []
    for kind in masks:
        mask = make_mask(kind, device, gen)
        for mode in modes(kind):
            for impl in impls:
                row = dict(impl=impl, mask=kind, mode=mode)
                try:
                    call = make_call(impl, kind)
                    if call is None:
                        row["skipped"] = "varlen: the document mask only"
                    else:
                        row["ms"], row["tflops"] = time_case(call, mode, mask, bench, gen, device)
                except Exception as e:  # noqa: BLE001  one failure never stops the run
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    meta = {"torch": torch.__version__, "timer": how, "dtype": args.dtype, "peer": peer}
    if device.type == "cuda":
        meta.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
        machine = f"{meta['gpu']}, torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}"
    else:
        meta.update(bench_cpu.cpu_description(), threads=torch.get_num_threads(), code=bench_cpu.code_description())
        machine = f"{meta['cpu']} ({meta['threads']} threads), torch {meta['torch']}"
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "rows": rows, "shape": [B, H, N, D]}, f, indent=1)

    def tf(impl, kind, mode):
        r = next((x for x in rows if x["impl"] == impl and x["mask"] == kind and x["mode"] == mode), None)
        return None if r is None else r.get("tflops")

    lines = [
        f"{machine}; b{B} h{H} n{N} d{D} {args.dtype}; "
        f"TFLOP/s (dense FLOPs); ours / ours unmasked (fwd_bwd_grad: against unmasked fwd_bwd), ours / {peer}, "
        "ours / varlen",
        "",
        "| mask | mode | " + " | ".join(impls) + f" | ours/none | ours/{peer} | ours/varlen |",
        "|---|---|" + "---|" * (len(impls) + 3),
    ]
    for kind in masks:
        for mode in modes(kind):
            cells = []
            for impl in impls:
                r = next(x for x in rows if x["impl"] == impl and x["mask"] == kind and x["mode"] == mode)
                fmt = ".0f" if device.type == "cuda" else ".3g"  # a CPU's TFLOP/s are below 1
                cells.append(f"{r['tflops']:{fmt}}" if r.get("tflops") else ("-" if "skipped" in r else "err"))
            ours = tf("ours", kind, mode)

            def ratio(other, ours=ours):
                return f"{ours / other:.2f}" if ours and other else "-"

            unmasked = tf("ours", "none", "fwd_bwd" if mode == "fwd_bwd_grad" else mode)
            extra = [ratio(unmasked), ratio(tf(peer, kind, mode)), ratio(tf("varlen", kind, mode))]
            lines.append(f"| {kind} | {mode} | " + " | ".join(cells + extra) + " |")
    errors = [f"{r['impl']} {r['mask']} {r['mode']}: {r['error']}" for r in rows if "error" in r]
    text = "\n".join(lines + ([""] + errors if errors else []))
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
