"""How much of a small attention call is host (CPU) time.

--device cuda (default): the GPT-2 case of the benchmark (b8 h12 n1024 d64 fp16
causal) fwd+bwd timed three ways per implementation:
  do_bench   : triton.testing.do_bench, L2 flushed, median (what bench_gpu.py reports)
  eager loop : 200 calls back to back, no sync in between (host-bound if the host is slower)
  graph      : the same call captured in a CUDA graph and replayed (device time only)
  The flashattn_ext drop-in (scaled_dot_product_attention) is timed beside flash_attn_func.

--device cpu: host time per call on a tiny CPU problem (b1 h2 n8 d16 float32,
causal), where the kernels take a few microseconds and the rest is Python,
dispatch and autograd bookkeeping: torch's SDPA, our drop-in and our
flash_attn_func, forward alone (no grad) and forward + backward
(torch.autograd.grad); --repeats batches of --calls calls each, the
implementations interleaved batch by batch; min and median per call.

Usage: python benchmarks/host_overhead.py [--device cpu|cuda] [--json PATH]"""

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# An installed flashattn_ext or one on PYTHONPATH first, else this checkout's (built in place).
if os.path.isdir(os.path.join(ROOT, "flashattn_ext")):
    sys.path.append(ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import flashattn_ext  # noqa: E402
from flashattn_ext import flash_attn_func  # noqa: E402


def per_call_ms(fn, n=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / n


def graph_ms(fn, n=200):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return per_call_ms(g.replay, n)


def cuda_main(args):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    b, h, n, d = 8, 12, 1024, 64
    dt = torch.float16
    rows = []
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
    do = torch.randn(b, n, h, d, device="cuda", dtype=dt)
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))
    dot = do.transpose(1, 2).contiguous()

    def ours():
        torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), do)

    def ours_sdpa():
        torch.autograd.grad(flashattn_ext.scaled_dot_product_attention(qt, kt, vt, is_causal=True), (qt, kt, vt), dot)

    def torch_backend(be):
        def fn():
            with sdpa_kernel(be):
                torch.autograd.grad(F.scaled_dot_product_attention(qt, kt, vt, is_causal=True), (qt, kt, vt), dot)
        return fn

    for name, fn in (("flashattn_ext", ours), ("flashattn_ext_sdpa", ours_sdpa),
                     ("fa2", torch_backend(SDPBackend.FLASH_ATTENTION)),
                     ("cudnn", torch_backend(SDPBackend.CUDNN_ATTENTION))):
        row = {"impl": name, "do_bench_ms": do_bench(fn, warmup=25, rep=100, return_mode="median"),
               "eager_loop_ms": per_call_ms(fn)}
        try:
            row["graph_ms"] = graph_ms(fn)
        except Exception as exc:  # a backend that cannot be captured
            row["graph_error"] = str(exc)[:120]
        rows.append(row)
        print(f"{name:18s} do_bench {row['do_bench_ms']:.3f} ms | eager loop {row['eager_loop_ms']:.3f} ms | "
              f"graph {row.get('graph_ms', float('nan')):.3f} ms", flush=True)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "case": [b, h, n, d, "fp16", "causal"], "rows": rows}


def cpu_main(args):
    b, h, n, d = 1, 2, 8, 16
    torch.set_num_threads(1)
    q, k, v = (torch.randn(b, n, h, d, requires_grad=True) for _ in range(3))
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))
    do = torch.randn(b, n, h, d)
    dot = do.transpose(1, 2).contiguous()
    sdpa, ours_sdpa = F.scaled_dot_product_attention, flashattn_ext.scaled_dot_product_attention

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    cases = {
        ("torch_sdpa", "fwd"): no_grad(lambda: sdpa(qt, kt, vt, is_causal=True)),
        ("flashattn_ext_sdpa", "fwd"): no_grad(lambda: ours_sdpa(qt, kt, vt, is_causal=True)),
        ("flash_attn_func", "fwd"): no_grad(lambda: flash_attn_func(q, k, v, causal=True)),
        ("torch_sdpa", "fwd+bwd"): lambda: torch.autograd.grad(sdpa(qt, kt, vt, is_causal=True), (qt, kt, vt), dot),
        ("flashattn_ext_sdpa", "fwd+bwd"):
            lambda: torch.autograd.grad(ours_sdpa(qt, kt, vt, is_causal=True), (qt, kt, vt), dot),
        ("flash_attn_func", "fwd+bwd"):
            lambda: torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), do),
    }
    # The machine may be shared: the implementations are interleaved batch by
    # batch, and the minimum over batches is the figure to compare.
    times = {key: [] for key in cases}
    for fn in cases.values():
        for _ in range(max(50, args.calls // 10)):
            fn()
    for _ in range(args.repeats):
        for key, fn in cases.items():
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            times[key].append((time.perf_counter() - t0) / args.calls * 1e6)
    rows = []
    for (impl, mode), ts in times.items():
        med, best = statistics.median(ts), min(ts)
        rows.append({"impl": impl, "mode": mode, "median_us": med, "min_us": best})
        print(f"{impl:20s} {mode:8s} min {best:7.1f} us   median {med:7.1f} us", flush=True)
    return {"device": "cpu", "torch": torch.__version__, "case": [b, h, n, d, "float32", "causal"],
            "threads": torch.get_num_threads(), "calls": args.calls, "repeats": args.repeats, "rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--calls", type=int, default=500, help="calls per timed batch (cpu)")
    ap.add_argument("--repeats", type=int, default=15, help="timed batches per implementation (cpu)")
    ap.add_argument("--json")
    args = ap.parse_args()
    report = cpu_main(args) if args.device == "cpu" else cuda_main(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
