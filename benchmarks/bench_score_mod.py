#!/usr/bin/env python3
"""flash-attn's score modifications (softcap, ALiBi) against our plain kernels and
the peers that have them, measured side by side in one run (issue 21's bar:
softcap and ALiBi at least 0.9x our plain kernel at the same shape).

    python benchmarks/bench_score_mod.py --json out.json [--md out.md]
    python benchmarks/bench_score_mod.py --device cpu --shape 2,8,1024,64 --dtype float32 --impls ours --json out.json

Cases: bf16, (b, n, h, d) inputs, causal and not, forward and forward + backward
(one forward with requires_grad then torch.autograd.grad; dense-equivalent FLOPs,
flashattn_ext.reference.attention_flops, halved when causal). Shapes: b4 h16 n4096
d128 (the issue's), b2 h8 n4096 d256 (Gemma 2's head dim), b4 h16 n4096 d64.
Variants: plain, softcap=30 (Gemma 2's attention softcap is 50; the value only
matters for the numbers, not the work), ALiBi (slopes (h,), float32), both.
Implementations:
  ours   flashattn_ext.flash_attn_func
  fa4    flash_attn.cute.flash_attn_func (softcap only: it has no ALiBi), when importable
  flex   torch.nn.attention.flex_attention.flex_attention compiled, with the
         equivalent score_mod (and a causal block mask); skipped if it fails
--shape B,H,N,D times that shape only, --dtype another input type.
Timing: bench_gpu.make_timer (triton's do_bench, median; on the CPU
time.perf_counter, median of a second of calls). The last thing printed
is the table of TFLOP/s and each variant's ratio to our plain kernel.
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_cpu  # noqa: E402
import bench_gpu  # noqa: E402
import torch  # noqa: E402

SOFTCAP = 30.0
SHAPES = [(4, 16, 4096, 128), (2, 8, 4096, 256), (4, 16, 4096, 64)]
VARIANTS = ["plain", "softcap", "alibi", "softcap+alibi"]
DTYPE = torch.bfloat16  # --dtype


def alibi_slopes(h, device):
    # The ALiBi paper's geometric slopes (the values do not change the work).
    return torch.tensor([2 ** (-8 * (i + 1) / h) for i in range(h)], dtype=torch.float32, device=device)


def make_ours(variant, h, device):
    fa = bench_gpu.OURS.flash_attn_func
    softcap = SOFTCAP if "softcap" in variant else 0.0
    slopes = alibi_slopes(h, device) if "alibi" in variant else None
    return lambda q, k, v, causal: fa(q, k, v, causal=causal, softcap=softcap, alibi_slopes=slopes)


def make_fa4(variant):
    fn, why = bench_gpu._load_fa4()
    if fn is None:
        return None, why
    if "alibi" in variant:
        return None, "FA4 has no ALiBi"
    softcap = SOFTCAP if "softcap" in variant else 0.0

    def call(q, k, v, causal):
        out = fn(q, k, v, causal=causal, softcap=softcap)
        return out[0] if isinstance(out, tuple) else out

    return call, None


_FLEX = {}


def make_flex(variant, h, n, device):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as e:  # noqa: BLE001
        return None, f"flex_attention: {type(e).__name__}: {e}"
    if "compiled" not in _FLEX:
        # One compiled kernel per (score_mod, mask, shape, mode): the default cache of 8
        # overflows in this sweep and flex then runs unfused (a 50x slower number).
        torch._dynamo.config.cache_size_limit = 256
        torch._dynamo.config.accumulated_cache_size_limit = 4096
        _FLEX["compiled"] = torch.compile(flex_attention, dynamic=False)
    flex = _FLEX["compiled"]
    slopes = alibi_slopes(h, device)

    def score_mod(score, b, hh, i, j):
        if "softcap" in variant:
            score = SOFTCAP * torch.tanh(score / SOFTCAP)
        if "alibi" in variant:
            score = score - slopes[hh] * (i - j).abs()
        return score

    masks = {}

    def call(q, k, v, causal):
        if causal not in masks:
            masks[causal] = (
                create_block_mask(lambda b, hh, i, j: i >= j, None, None, n, n, device=device) if causal else None
            )
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        mod = None if variant == "plain" else score_mod
        return flex(qt, kt, vt, score_mod=mod, block_mask=masks[causal]).transpose(1, 2)

    return call, None


def time_case(call, mode, b, h, n, d, causal, bench, gen, device):
    q, k, v = (
        torch.randn(b, n, h, d, dtype=DTYPE, device=device, generator=gen).requires_grad_(mode == "fwd_bwd")
        for _ in range(3)
    )
    if mode == "fwd":

        def fn():
            with torch.no_grad():
                call(q, k, v, causal)

    else:
        dout = torch.randn(b, n, h, d, dtype=DTYPE, device=device, generator=gen)

        def fn():
            out = call(q, k, v, causal)
            torch.autograd.grad(out, (q, k, v), dout)

    fn()  # compile / first-call costs outside the timing
    ms = bench(fn)
    flops = bench_gpu.attention_flops(b, h, n, n, d, causal=causal, mode="fwd")
    if mode == "fwd_bwd":
        flops *= 3.5  # forward + backward (2.5x)
    return ms, bench_gpu.tflops(flops, ms)


def main():
    global DTYPE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--md")
    ap.add_argument("--impls", default="ours,fa4,flex")
    ap.add_argument("--quick", action="store_true", help="d128 only")
    ap.add_argument("--head-dims", help="only these shapes' head dims, e.g. 128,64 (default: every shape)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="a subset of " + ",".join(VARIANTS))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--shape", help="B,H,N,D: this shape only")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    DTYPE = getattr(torch, args.dtype)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    bench, how = bench_gpu.make_timer(device) if cuda else bench_gpu.make_timer(device, 50, 1000)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    shapes = SHAPES[:1] if args.quick else SHAPES
    if args.shape:
        shapes = [tuple(int(x) for x in args.shape.split(","))]
    if args.head_dims:
        keep = [int(d) for d in args.head_dims.split(",")]
        shapes = sorted((s for s in shapes if s[3] in keep), key=lambda s: keep.index(s[3]))
    if not cuda and "ours" in args.impls:  # the first case timed paid for the process's first large allocations
        b, h, n, d = shapes[0]
        time_case(make_ours("plain", h, device), "fwd_bwd", b, h, n, d, False, bench, gen, device)
    for b, h, n, d in shapes:
        for causal in (False, True):
            for mode in ("fwd", "fwd_bwd"):
                for variant in args.variants.split(","):
                    for impl in args.impls.split(","):
                        row = dict(impl=impl, variant=variant, mode=mode, b=b, h=h, n=n, d=d, causal=causal)
                        try:
                            if impl == "ours":
                                call, why = make_ours(variant, h, device), None
                            elif impl == "fa4":
                                call, why = make_fa4(variant)
                            else:
                                call, why = make_flex(variant, h, n, device)
                            if call is None:
                                row["skipped"] = why
                            else:
                                row["ms"], row["tflops"] = time_case(call, mode, b, h, n, d, causal, bench, gen, device)
                        except Exception as e:  # noqa: BLE001  one failure never stops the run
                            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                        rows.append(row)
                        if cuda:
                            torch.cuda.empty_cache()
    meta = {
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "cpu": None if cuda else dict(bench_cpu.cpu_description(), threads=torch.get_num_threads()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": args.dtype,
        "timer": how,
        "softcap": SOFTCAP,
        "build": torch.ops.flashattn_ext.build_info() if "ours" in args.impls else None,
        "env": {k: v for k, v in os.environ.items() if k.startswith("FLASHATTN_")},
    }
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    # The table: TFLOP/s, and ours' ratio to our plain kernel at the same case.
    plain = {
        (r["mode"], r["b"], r["h"], r["n"], r["d"], r["causal"]): r.get("tflops")
        for r in rows
        if r["impl"] == "ours" and r["variant"] == "plain"
    }
    lines = [
        (f"{meta['gpu']}, CUDA {meta['cuda']}" if cuda else f"{meta['cpu']['cpu']} ({meta['cpu']['threads']} threads)")
        + f", torch {meta['torch']}, {args.dtype}; TFLOP/s (ratio to ours plain); softcap {SOFTCAP}"
        + (f"; build {meta['build']}" if meta["build"] else ""),
        "",
        "| case | variant | " + " | ".join(args.impls.split(",")) + " |",
        "|---|---|" + "---|" * len(args.impls.split(",")),
    ]
    for key in dict.fromkeys((r["mode"], r["b"], r["h"], r["n"], r["d"], r["causal"]) for r in rows):
        mode, b, h, n, d, causal = key
        for variant in args.variants.split(","):
            cells = []
            for impl in args.impls.split(","):
                r = next(
                    (
                        x
                        for x in rows
                        if x["impl"] == impl
                        and x["variant"] == variant
                        and (x["mode"], x["b"], x["h"], x["n"], x["d"], x["causal"]) == key
                    ),
                    None,
                )
                if r is None or r.get("tflops") is None:
                    cells.append("-" if r is None or "skipped" in r else "err")
                else:
                    base = plain.get(key)
                    ratio = f" ({r['tflops'] / base:.2f})" if base and not math.isnan(base) else ""
                    cells.append(f"{r['tflops']:{'.0f' if cuda else '.3g'}}{ratio}")
            name = f"{mode} b{b} h{h} n{n} d{d}{' causal' if causal else ''}"
            lines.append(f"| {name} | {variant} | " + " | ".join(cells) + " |")
    errors = [r for r in rows if "error" in r]
    for r in errors:
        lines.append(f"- error {r['impl']} {r['variant']} {r['mode']} d{r['d']} causal={r['causal']}: {r['error']}")
    text = "\n".join(lines)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
