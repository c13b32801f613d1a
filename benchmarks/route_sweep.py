#!/usr/bin/env python3
"""The forward's decode route against its main kernels, over query lengths: the
data behind the thresholds of `decode_route` (csrc/cuda/decode_launch.h). A
decode-step call as Hugging Face models make it ((B, 32, q, 128) queries against
(B, 8, k, 128) keys and values, enable_gqa, bf16, no mask, not causal) timed
three ways:

  route   flashattn_ext.scaled_dot_product_attention (the forward picks the decoding
          kernels when decode_route says so; `routed` records whether it did, profiler)
  main    the same call with FLASHATTN_DISABLE_DECODE_ROUTE=1 (the main forward kernels)
  cudnn   torch SDPA forced to cuDNN

    python3 benchmarks/route_sweep.py --json out.json
"""

import argparse
import contextlib
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flashattn_ext


@contextlib.contextmanager
def main_forward():
    os.environ["FLASHATTN_DISABLE_DECODE_ROUTE"] = "1"
    try:
        yield
    finally:
        del os.environ["FLASHATTN_DISABLE_DECODE_ROUTE"]


def ran_decode_kernels(fn):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return any("flash_decode" in e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--json")
ap.add_argument("--qlens", default="1,2,4,8,16,32")
ap.add_argument("--klens", default="1024,4096,16384")
ap.add_argument("--batches", default="1,8")
args = ap.parse_args()

rows = []
for b in (int(x) for x in args.batches.split(",")):
    for k_len in (int(x) for x in args.klens.split(",")):
        for q_len in (int(x) for x in args.qlens.split(",")):
            q = torch.randn(b, 32, q_len, 128, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(b, 8, k_len, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))

            def routed_call(q=q, k=k, v=v):
                return flashattn_ext.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            routed = ran_decode_kernels(routed_call)
            t = {
                "route": do_bench(routed_call),
            }
            with main_forward():
                t["main"] = do_bench(routed_call)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                try:
                    t["cudnn"] = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
                except RuntimeError:
                    t["cudnn"] = float("nan")
            row = {
                "batch": b,
                "k_len": k_len,
                "q_len": q_len,
                "routed": routed,
                **{n + "_us": x * 1e3 for n, x in t.items()},
            }
            rows.append(row)
            print(
                f"b{b} k{k_len} q{q_len}: route {t['route'] * 1e3:7.1f} us (routed={routed}), "
                f"main {t['main'] * 1e3:7.1f} us, cudnn {t['cudnn'] * 1e3:7.1f} us",
                flush=True,
            )
if args.json:
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
