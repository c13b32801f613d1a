"""Times the candidate tile configurations of a tuning build
(FLASHATTN_TUNING=1, see csrc/cuda/kernel_configs.h) side by side with torch's
FlashAttention-2 and cuDNN backends, and checks each candidate's output
against the default one. Prints one table per (pass, head dim).

    python benchmarks/tune.py --json out.json [--dims 64,128] [--seqlens 512,2048,8192]
"""

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F
from kernel_check import bench  # noqa: E402  (benchmarks/ is the script's directory)
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn_ext  # noqa: F401
from flashattn_ext import _ops
from flashattn_ext.reference import attention_flops

# Entries of TuneVariants (csrc/cuda/kernel_configs.h) per pass and head dim:
# the wgmma lists (FwdSm90 / BwdSm90) on an sm90 device, the mma.sync ones elsewhere.
# (the forward runs the TMA kernels' list, FwdSm90Ws, unless FLASHATTN_DISABLE_TMA=1).
VARIANTS_SM90 = {"fwd": {64: 4, 128: 3}, "bwd": {64: 3, 128: 1}}
VARIANTS_SM80 = {"fwd": {64: 2, 128: 2}, "bwd": {64: 2, 128: 2}}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--seqlens", default="512,2048,8192")
    ap.add_argument("--passes", default="fwd,bwd")
    args = ap.parse_args()
    assert "tuning=1" in torch.ops.flashattn_ext.build_info(), "needs a FLASHATTN_TUNING=1 build"
    sm90 = torch.cuda.get_device_capability() == (9, 0) and os.environ.get("FLASHATTN_DISABLE_SM90") != "1"
    VARIANTS = VARIANTS_SM90 if sm90 else VARIANTS_SM80
    rows = []
    for d in (int(x) for x in args.dims.split(",")):
        for causal in (False, True):
            for n in (int(x) for x in args.seqlens.split(",")):
                b, h = max(1, 16384 // n), 2048 // d
                scale = 1 / math.sqrt(d)
                wr = 0 if causal else -1
                q = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
                k, v = torch.randn_like(q), torch.randn_like(q)
                flops = attention_flops(b, h, n, n, d, causal)
                bwd_flops = attention_flops(b, h, n, n, d, causal, "bwd")
                row = {"d": d, "n": n, "causal": causal}
                os.environ["FLASHATTN_FWD_VARIANT"] = "0"
                os.environ["FLASHATTN_BWD_VARIANT"] = "0"
                out0, lse0 = _ops.fwd(q, k, v, scale, -1, wr, True, False)
                dout = torch.randn_like(out0)
                grads0 = _ops.bwd(dout, q, k, v, out0, lse0, scale, -1, wr, True, False)
                passes = args.passes.split(",")
                for var in range(VARIANTS["fwd"][d] if "fwd" in passes else 0):
                    os.environ["FLASHATTN_FWD_VARIANT"] = str(var)
                    out, lse = _ops.fwd(q, k, v, scale, -1, wr, True, False)
                    err = (out.float() - out0.float()).abs().max().item()
                    ms = bench(lambda: _ops.fwd(q, k, v, scale, -1, wr, True, False))
                    row[f"fwd_v{var}"] = flops / ms / 1e9
                    row[f"fwd_v{var}_err"] = err
                os.environ["FLASHATTN_FWD_VARIANT"] = "0"
                for var in range(VARIANTS["bwd"][d] if "bwd" in passes else 0):
                    os.environ["FLASHATTN_BWD_VARIANT"] = str(var)
                    grads = _ops.bwd(dout, q, k, v, out0, lse0, scale, -1, wr, True, False)
                    err = max((a.float() - b_.float()).abs().max().item() for a, b_ in zip(grads, grads0))
                    ms = bench(lambda: _ops.bwd(dout, q, k, v, out0, lse0, scale, -1, wr, True, False))
                    row[f"bwd_v{var}"] = bwd_flops / ms / 1e9
                    row[f"bwd_v{var}_err"] = err
                os.environ["FLASHATTN_BWD_VARIANT"] = "0"
                qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v))
                for name, be in (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    with sdpa_kernel(be):
                        row[f"fwd_{name}"] = (
                            flops / bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)) / 1e9
                        )
                        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                        do = torch.randn_like(o)
                        row[f"bwd_{name}"] = (
                            bwd_flops / bench(lambda: torch.autograd.grad(o, (qt, kt, vt), do, retain_graph=True)) / 1e9
                        )
                rows.append(row)
                fv = " ".join(f"v{i}={row[f'fwd_v{i}']:.0f}" for i in range(VARIANTS["fwd"][d]) if f"fwd_v{i}" in row)
                bv = " ".join(f"v{i}={row[f'bwd_v{i}']:.0f}" for i in range(VARIANTS["bwd"][d]) if f"bwd_v{i}" in row)
                print(
                    f"d{d} n{n} {'causal' if causal else 'full  '} | fwd {fv} fa2={row['fwd_fa2']:.0f} "
                    f"cudnn={row['fwd_cudnn']:.0f} | bwd {bv} fa2={row['bwd_fa2']:.0f} cudnn={row['bwd_cudnn']:.0f}",
                    flush=True,
                )
                errs = [row[k] for k in row if k.endswith("_err")]
                if max(errs) > 0.05:
                    print("  WARNING variant mismatch:", {k: row[k] for k in row if k.endswith("_err")})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
