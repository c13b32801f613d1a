#!/usr/bin/env python3
"""An unmodified Hugging Face model's training step behind torch's own SDPA, with
and without ``flashattn_ext.activate()`` (issue #24's bar, one GPU).

    python benchmarks/backend_train_step.py [--device cuda] [--json out.json]

For a randomly initialised Llama (GQA) and GPT-2 (attn_implementation="sdpa", built in
code, nothing downloaded), in bf16 on CUDA (float32 on the CPU):
  * one forward + backward with torch's kernels and one with ``activate(first=True)``,
    from the same weights and tokens;
  * the attention kernels each ran (torch.profiler's CUDA kernel names; on the CPU,
    ``flashattn_ext.backend.calls()``): activated, ours and no cuDNN / FA2 attention kernel;
  * the loss and every parameter gradient of the activated run against a float64 copy of
    the model run with torch's math attention (the oracle), the yardstick being torch's
    run in the same dtype: flashattn_ext.tolerance.compare, the project's one rule;
  * the same step with the drop-in: torch.nn.functional.scaled_dot_product_attention
    replaced by flashattn_ext.scaled_dot_product_attention for the step (the model's code
    unchanged; the bar's "speed of our drop-in"), its loss and gradients held to the rule too;
  * the step time of each (median of --reps, CUDA events; the three variants interleaved
    rep by rep) and its host time (time.perf_counter around the step, which returns before
    the GPU is done: a host time close to the step time means a host-bound step, where the
    overrides' Python shows up in full).
Exit status 0 when every check passes.
"""

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time
import warnings

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "flashattn_ext")):
    sys.path.append(_ROOT)

import flashattn_ext  # noqa: E402
from flashattn_ext import backend, tolerance  # noqa: E402

ATTN_KERNEL_WORDS = ("flash", "fmha", "cudnn", "attention", "sdpa", "mha")


def models():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    llama = LlamaConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
    )  # fmt: skip
    gpt2 = GPT2Config(
        vocab_size=1024, n_embd=512, n_layer=2, n_head=8, n_positions=2048, bos_token_id=0, eos_token_id=0
    )
    return {"llama": (LlamaForCausalLM, llama), "gpt2": (GPT2LMHeadModel, gpt2)}


def step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def kernel_names(fn, device):
    if device.type != "cuda":
        fn()
        return []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages() if e.device_type.name == "CUDA"}
    return sorted(n for n in names if any(w in n.lower() for w in ATTN_KERNEL_WORDS))


@contextlib.contextmanager
def drop_in():
    """F.scaled_dot_product_attention is flashattn_ext's drop-in while inside; the
    original is back for the duration of each call (the drop-in hands the calls its
    kernels refuse to torch's function, which must not be itself)."""
    F = torch.nn.functional
    original = F.scaled_dot_product_attention

    def patched(*args, **kwargs):
        F.scaled_dot_product_attention = original
        try:
            return flashattn_ext.scaled_dot_product_attention(*args, **kwargs)
        finally:
            F.scaled_dot_product_attention = patched

    F.scaled_dot_product_attention = patched
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def timed(variants, device, reps):
    """{name: (step ms median, host ms median)} for {name: (context factory, fn)},
    interleaved: each rep runs every variant once."""
    if device.type != "cuda":
        return {name: (None, None) for name in variants}
    times = {name: ([], []) for name in variants}
    for _ in range(reps):
        for name, (ctx, fn) in variants.items():
            with ctx():
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                t0 = time.perf_counter()
                fn()
                host = (time.perf_counter() - t0) * 1e3
                b.record()
                torch.cuda.synchronize()
            times[name][0].append(a.elapsed_time(b))
            times[name][1].append(host)
    return {name: (statistics.median(d), statistics.median(h)) for name, (d, h) in times.items()}


def run_case(name, cls, config, device, dtype, seqlen, batch, reps):
    torch.manual_seed(0)
    config._attn_implementation = "sdpa"
    base = cls(config).to(device=device, dtype=dtype).train()
    for m in base.modules():  # no dropout: the two runs must see the same function
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    oracle_model = copy.deepcopy(base).to(torch.float64)
    ids = torch.randint(0, config.vocab_size, (batch, seqlen), device=device)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        o_loss, o_grads = step(oracle_model, ids)
    t_loss, t_grads = step(base, ids)
    torch_kernels = kernel_names(lambda: step(base, ids), device)

    backend.reset_calls()
    with backend.activated(first=True):
        a_loss, a_grads = step(base, ids)
        ours_kernels = kernel_names(lambda: step(base, ids), device)
        routes = {f"{op} -> {route}": n for (op, route), n in backend.calls().items()}
    with drop_in(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", flashattn_ext.FlashAttnFallbackWarning)
        d_loss, d_grads = step(base, ids)
    fell_back = sorted(
        {str(w.message) for w in caught if issubclass(w.category, flashattn_ext.FlashAttnFallbackWarning)}
    )

    run = lambda: step(base, ids)  # noqa: E731
    ms = timed(
        {
            "torch": (contextlib.nullcontext, run),
            "activated": (lambda: backend.activated(first=True), run),
            "drop_in": (drop_in, run),
        },
        device,
        reps,
    )

    checks = [tolerance.compare("loss", a_loss.reshape(1), o_loss.reshape(1), t_loss.reshape(1))]
    for pname in o_grads:
        checks.append(tolerance.compare(f"grad {pname}", a_grads[pname], o_grads[pname], t_grads[pname]))
    checks.append(tolerance.compare("drop-in loss", d_loss.reshape(1), o_loss.reshape(1), t_loss.reshape(1)))
    for pname in o_grads:
        checks.append(tolerance.compare(f"drop-in grad {pname}", d_grads[pname], o_grads[pname], t_grads[pname]))
    bad = [c.message() for c in checks if not c.ok]
    refused = {k: v for k, v in routes.items() if "-> torch" in k}
    ours_ran = any("flashattn_ext" in k for k in routes)
    foreign = [
        n
        for n in ours_kernels
        if "flashattn" not in n and ("cudnn" in n.lower() or "flash_fwd" in n or "fmha" in n.lower())
    ]
    ok = not bad and ours_ran and not refused and not foreign and not fell_back
    return {
        "model": name, "device": device.type, "dtype": str(dtype).replace("torch.", ""), "batch": batch,
        "seqlen": seqlen, "ok": ok, "failed_checks": bad[:10], "checks": len(checks), "routes": routes,
        "torch_kernels": torch_kernels, "activated_kernels": ours_kernels, "foreign_attention_kernels": foreign,
        "drop_in_fell_back": fell_back,
        "torch_step_ms": ms["torch"][0], "activated_step_ms": ms["activated"][0], "drop_in_step_ms": ms["drop_in"][0],
        "torch_host_ms": ms["torch"][1], "activated_host_ms": ms["activated"][1], "drop_in_host_ms": ms["drop_in"][1],
        "loss": {"torch": float(t_loss), "activated": float(a_loss), "drop_in": float(d_loss), "oracle": float(o_loss)},
    }  # fmt: skip


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seqlen", type=int, default=None, help="default 1024 on CUDA, 128 on the CPU")
    ap.add_argument("--batch", type=int, default=None, help="default 8 on CUDA, 2 on the CPU")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    seqlen = args.seqlen or (1024 if cuda else 128)
    batch = args.batch or (8 if cuda else 2)
    print(f"flashattn_ext {flashattn_ext.build_info()}, torch {torch.__version__}, {device}")
    rows = []
    for name, (cls, config) in models().items():
        r = run_case(name, cls, config, device, dtype, seqlen, batch, args.reps)
        rows.append(r)
        t = (
            f"step {r['torch_step_ms']:.2f} ms torch / {r['activated_step_ms']:.2f} ms activated / "
            f"{r['drop_in_step_ms']:.2f} ms drop-in (host {r['torch_host_ms']:.2f} / {r['activated_host_ms']:.2f} / "
            f"{r['drop_in_host_ms']:.2f} ms)"
            if cuda
            else ""
        )
        print(f"{name}: {'ok' if r['ok'] else 'FAILED'}, {r['checks']} checks (loss + gradients) {t}")
        print(f"  routes: {r['routes']}")
        print(f"  torch's attention kernels: {r['torch_kernels']}")
        print(f"  activated: {r['activated_kernels']}")
        for m in r["failed_checks"]:
            print("  ", m)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"build": flashattn_ext.build_info(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
