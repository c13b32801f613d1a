"""How much of a small fwd+bwd is host (CPU) time: the GPT-2 case of the
benchmark (b8 h12 n1024 d64 fp16 causal) timed three ways per implementation:
  do_bench   : triton.testing.do_bench, L2 flushed, median (what bench_gpu.py reports)
  eager loop : 200 calls back to back, no sync in between (host-bound if the host is slower)
  graph      : the same call captured in a CUDA graph and replayed (device time only)
Usage: python benchmarks/host_overhead.py [--json PATH]"""

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from flashattn_ext import flash_attn_func


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


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json")
    args = ap.parse_args()
    b, h, n, d = 8, 12, 1024, 64
    dt = torch.float16
    rows = []
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
    do = torch.randn(b, n, h, d, device="cuda", dtype=dt)
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))
    dot = do.transpose(1, 2).contiguous()

    def ours():
        torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), do)

    def torch_backend(be):
        def fn():
            with sdpa_kernel(be):
                torch.autograd.grad(F.scaled_dot_product_attention(qt, kt, vt, is_causal=True), (qt, kt, vt), dot)
        return fn

    for name, fn in (("flashattn_ext", ours), ("fa2", torch_backend(SDPBackend.FLASH_ATTENTION)),
                     ("cudnn", torch_backend(SDPBackend.CUDNN_ATTENTION))):
        row = {"impl": name, "do_bench_ms": do_bench(fn, warmup=25, rep=100, return_mode="median"),
               "eager_loop_ms": per_call_ms(fn)}
        try:
            row["graph_ms"] = graph_ms(fn)
        except Exception as exc:  # a backend that cannot be captured
            row["graph_error"] = str(exc)[:120]
        rows.append(row)
        print(f"{name:14s} do_bench {row['do_bench_ms']:.3f} ms | eager loop {row['eager_loop_ms']:.3f} ms | "
              f"graph {row.get('graph_ms', float('nan')):.3f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "case": [b, h, n, d, "fp16",
                       "causal"], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
