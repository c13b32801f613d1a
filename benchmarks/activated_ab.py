#!/usr/bin/env python3
"""Host time of the activated path, old overrides against new, in one process.

    git show 4e89bbc:flashattn_ext/backend.py > /tmp/backend_s13.py
    python benchmarks/activated_ab.py /tmp/backend_s13.py [--device cpu|cuda] [--json PATH]

The backend module given (session 13's Python overrides, flashattn_ext/backend.py
before session 14; it runs on this build's ops) is loaded beside this tree's
(session 14: the SDPA-layout overrides in C++, csrc/backend.cpp), and the same tiny
call (b1 h1 n16 d64 causal; fp32 on the CPU, bf16 on CUDA) is timed as torch's own
SDPA, as the drop-in flashattn_ext.scaled_dot_product_attention, as torch's SDPA
activated with either module, and as aten._scaled_dot_product_flash_attention with
either module's CUDA-key overrides registered (on the CPU only: the tests' way of
running the CUDA path there), forward and forward+backward. Interleaved rounds:
every round times each implementation once (host_overhead.host_us_per_call: on
CUDA the GPU is kept busy, so that only host time is timed); the fastest and the
median round are reported, in us per call. CPU: torch.set_num_threads(1).
"""

import argparse
import contextlib
import importlib.util
import json
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import host_overhead  # noqa: E402

import flashattn_ext  # noqa: E402
from flashattn_ext import backend as new  # noqa: E402


def load_old(path):
    spec = importlib.util.spec_from_file_location("flashattn_ext._old_backend", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def activated(mod):
    mod.activate(first=True)
    try:
        yield
    finally:
        mod.deactivate()


@contextlib.contextmanager
def flash_ops(mod, key):
    handle = mod._register_flash_ops(key)
    try:
        yield
    finally:
        handle.remove()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old_backend", help="path of the old flashattn_ext/backend.py")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int)
    ap.add_argument("--json")
    args = ap.parse_args()
    old = load_old(args.old_backend)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    calls = args.calls or (200 if device.type == "cpu" else 40)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    b, h, n, d = 1, 1, 16, 64
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (
        torch.randn(b, n, h, d, generator=gen, device=device, dtype=dtype).transpose(1, 2) for _ in range(4)
    )
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    op = torch.ops.aten._scaled_dot_product_flash_attention

    def grad(out):
        return torch.autograd.grad(out, (qg, kg, vg), dout)

    fns = {
        "sdpa": (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                 lambda: grad(F.scaled_dot_product_attention(qg, kg, vg, is_causal=True))),
        "drop_in": (lambda: flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=True),
                    lambda: grad(flashattn_ext.scaled_dot_product_attention(qg, kg, vg, is_causal=True))),
        "flash_op": (lambda: op(q, k, v, 0.0, True, scale=0.125),
                     lambda: grad(op(qg, kg, vg, 0.0, True, scale=0.125)[0])),
    }  # fmt: skip
    null = contextlib.nullcontext
    impls = {
        "torch_sdpa": (null, "sdpa"),
        "drop_in": (null, "drop_in"),
        "activated_old": (lambda: activated(old), "sdpa"),
        "activated_new": (lambda: activated(new), "sdpa"),
    }
    if device.type == "cpu":
        impls["flash_op_override_old"] = (lambda: flash_ops(old, "CPU"), "flash_op")
        impls["flash_op_override_new"] = (lambda: flash_ops(new, "CPU"), "flash_op")
    res = dict(device=str(device), torch=torch.__version__, dtype=str(dtype), shape=[b, h, n, d], causal=True)
    res.update(rounds=args.rounds, calls=calls, method=__doc__.split("\n\n")[-1].strip(), impls={})
    for mode, which in (("fwd", 0), ("fwd+bwd", 1)):
        samples = {name: [] for name in impls}
        for _ in range(args.rounds):
            for name, (ctx, fn_name) in impls.items():
                with ctx():
                    r = host_overhead.host_us_per_call(fns[fn_name][which], device, calls=calls, reps=1, warmup=3)
                samples[name].append(r["us"])
        for name, xs in samples.items():
            xs.sort()
            res["impls"].setdefault(name, {})[mode] = dict(us_min=round(xs[0], 2), us_median=round(xs[len(xs) // 2], 2))
    # The routes the activated calls took (that the A/B timed what it says).
    for name, mod in (("old", old), ("new", new)):
        mod.reset_calls()
        with activated(mod):
            fns["sdpa"][1]()
        res[f"routes_{name}"] = {f"{o}: {r}": c for (o, r), c in mod.calls().items()}
    text = json.dumps(res, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
