#!/usr/bin/env python3
"""The SDPA drop-in's decode route against the main path, over query lengths: the
data behind `interface.decode_route`'s thresholds. A decode-step call as Hugging
Face models make it ((B, 32, q, 128) queries against (B, 8, k, 128) keys and
values, enable_gqa, bf16, no mask, not causal) timed three ways:

  route   flashattn_ext.scaled_dot_product_attention (routed when decode_route says so)
  main    flashattn_ext.flash_attn_func on (B, L, H, D) views of the same tensors
          (the main forward kernels, the path the drop-in takes when not routed)
  cudnn   torch SDPA forced to cuDNN

    python3 benchmarks/route_sweep.py --json out.json
"""

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flashattn_ext
from flashattn_ext import interface

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
            routed = interface.decode_route(
                "cuda",
                q.dtype,
                b,
                32,
                8,
                q_len,
                k_len,
                128,
                is_causal=False,
                has_mask=False,
                dropout_p=0.0,
                needs_grad=False,
                autocast=False,
                transformed=False,
                strides=(q.stride(), k.stride(), v.stride()),
                offsets=(0, 0, 0),
            )
            t = {
                "route": do_bench(lambda: flashattn_ext.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
                "main": do_bench(
                    lambda: flashattn_ext.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
                ),
            }
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
