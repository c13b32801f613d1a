#!/usr/bin/env python3
"""A first look at the forward kernels on a GPU: a few shapes per head dim
against the oracle, printed one line each (a hang or a crash shows which)."""

import sys

import torch

import flashattn_ext
from flashattn_ext import reference

torch.manual_seed(0)
bad = 0
for d in (64, 128, 192, 256):
    for b, nq, nk, hq, hk, causal in (
        (1, 128, 128, 2, 2, False),
        (2, 1000, 777, 4, 2, True),
        (1, 300, 4100, 2, 1, False),
    ):
        q = torch.randn(b, nq, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, nk, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, nk, hk, d, device="cuda", dtype=torch.bfloat16)
        out, lse = flashattn_ext.flash_attn_func(q, k, v, causal=causal, return_lse=True)
        torch.cuda.synchronize()
        ref, ref_lse = reference.attention_ref(q, k, v, causal=causal, return_lse=True)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        lse_err = (lse - ref_lse).abs().nan_to_num(0).max().item()
        ok = err < 2e-2 and lse_err < 1e-2 and torch.isfinite(out).all().item()
        bad += not ok
        print(
            f"{'ok ' if ok else 'BAD'} d{d} b{b} nq{nq} nk{nk} hq{hq} hk{hk} causal={causal}: rel err {err:.2e}, lse err {lse_err:.2e}",
            flush=True,
        )
sys.exit(1 if bad else 0)
