#!/usr/bin/env python3
"""Host (CPU) time of attention calls: what a call costs before the GPU does
anything, and how much of a small fwd+bwd is host time.

Two measurements, both used by bench_gpu.py (its JSON's `host_overhead` section)
and runnable alone:

  host time per call  (host_us_per_call; bench_gpu.py's tiny case b1 h2 n128 d64 bf16)
      The GPU is first given a long torch.cuda._sleep kernel, then N calls are
      enqueued behind it and timed with time.perf_counter: the clock stops before
      any synchronization, and as the GPU is still busy when the loop ends (checked
      with an event, recorded as `gpu_busy`), the time is the host's alone: Python,
      dispatch, autograd, allocation, kernel launches. A call that synchronizes
      with the GPU (a hidden .item(), a blocking copy) waits for the sleep and shows
      up as a huge time. Median over repetitions. On a CPU the kernels run inside
      the call, so there it is the whole call's time.

  GPT-2 three ways (gpt2_three_ways; the seed's b8 h12 n1024 d64 fp16 causal fwd+bwd)
      do_bench   : triton.testing.do_bench, L2 flushed, median (what bench_gpu.py reports)
      eager loop : 200 calls back to back, no sync in between (host-bound if the host is slower)
      graph      : the same call captured in a CUDA graph and replayed (device time only)

    python benchmarks/host_overhead.py [--json PATH]              # both, on the GPU
    python benchmarks/host_overhead.py --device cpu --tiny-only   # the host-time code path on a CPU
    python benchmarks/host_overhead.py --decode [--cache N] [--profile] [--json PATH]   # a decode step (b1, 8k cache)
    python benchmarks/host_overhead.py --activated [--device cpu] [--json PATH]   # behind torch's SDPA

  behind torch's SDPA (activated_host_times; --activated): the same tiny call (b1 h1 n16 d64,
      causal) as torch's own SDPA runs it, as our drop-in flashattn_ext.scaled_dot_product_attention
      runs it, and as torch's SDPA runs it with flashattn_ext.activate(first=True) (our kernels
      behind torch's op: the C++ overrides of csrc/backend.cpp since session 14). On the CPU also the
      CUDA overrides themselves (registered for the CPU key, as tests/test_backend.py does, and
      called as aten._scaled_dot_product_flash_attention) against the kernels called directly,
      which isolates the overrides' own cost. The implementations are interleaved round by round
      (each round times every implementation once) and the median over rounds is reported,
      so that a machine whose load changes affects all of them alike.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

# ----------------------------------------------------------------------------- host time per call

_SLEEP_CYCLES_PER_MS = {}


def _sleep_cycles_per_ms(device):
    """Calibrates torch.cuda._sleep (a spin of N clock cycles) once per device."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SLEEP_CYCLES_PER_MS:
        cycles = 2_000_000
        torch.cuda._sleep(cycles)  # first launch loads the kernel
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(cycles)
        e.record()
        e.synchronize()
        _SLEEP_CYCLES_PER_MS[idx] = cycles / max(s.elapsed_time(e), 1e-3)
    return _SLEEP_CYCLES_PER_MS[idx]


def host_us_per_call(fn, device, calls=50, reps=7, warmup=5):
    """Median host microseconds of one call of fn (see the module docstring).

    Returns {"us": median, "us_min": min, "calls": calls, "reps": reps,
    "gpu_busy": True when the GPU was still busy at the end of every timed loop
    (so no call waited for it); CUDA only}. calls stays small so that the calls'
    kernels fit in the launch queue (about a thousand pending launches) and the
    host never waits for a free slot."""
    for _ in range(warmup):
        fn()
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        if device.type != "cuda":
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                times.append((time.perf_counter() - t0) / calls * 1e6)
            return dict(
                us=statistics.median(times),
                us_min=min(times),
                calls=calls,
                reps=reps,
                note="CPU: the kernels run inside the call, so this is the whole call",
            )
        torch.cuda.synchronize(device)
        # A first loop, synchronized, sizes the sleep: 4x the loop's host time, at least 5 ms.
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        est_s = time.perf_counter() - t0
        torch.cuda.synchronize(device)
        cycles_per_ms = _sleep_cycles_per_ms(device)
        sleep_ms = max(5.0, 4e3 * est_s)
        times, busy = [], []
        for _ in range(reps):
            torch.cuda._sleep(int(sleep_ms * cycles_per_ms))
            slept = torch.cuda.Event()
            slept.record()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            t1 = time.perf_counter()
            busy.append(not slept.query())  # the sleep still running: nothing above waited for the GPU
            torch.cuda.synchronize(device)
            times.append((t1 - t0) / calls * 1e6)
            if not busy[-1]:
                sleep_ms *= 4  # the loop outlasted the sleep: longer next time
        return dict(us=statistics.median(times), us_min=min(times), calls=calls, reps=reps, gpu_busy=all(busy))
    finally:
        if gc_was_enabled:
            gc.enable()


# ----------------------------------------------------------------------------- GPT-2 three ways


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


def gpt2_three_ways(impls=("ours_native", "ours_sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_default")):
    """The GPT-2 fwd+bwd per implementation: do_bench, eager loop, CUDA graph replay."""
    import bench_gpu
    from triton.testing import do_bench

    device = torch.device("cuda")
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    b, h, n, d = 8, 12, 1024, 64
    rows = []
    for impl in impls:
        row = {"impl": impl}
        try:
            ctx, fn, _ = bench_gpu.build_call(impl, "fwd+bwd", b, h, n, d, True, torch.float16, device, gen)
            with ctx():
                row["do_bench_ms"] = do_bench(fn, warmup=25, rep=100, return_mode="median")
                row["eager_loop_ms"] = per_call_ms(fn)
                try:
                    row["graph_ms"] = graph_ms(fn)
                except Exception as exc:  # noqa: BLE001  (a backend that cannot be captured)
                    row["graph_error"] = str(exc)[:120]
        except Exception as exc:  # noqa: BLE001
            row["error"] = bench_gpu._short(exc)
        rows.append(row)
        print(
            f"{impl:14s} do_bench {row.get('do_bench_ms', float('nan')):.3f} ms | eager loop "
            f"{row.get('eager_loop_ms', float('nan')):.3f} ms | graph {row.get('graph_ms', float('nan')):.3f} ms"
            + (f" | {row['error']}" if "error" in row else ""),
            flush=True,
        )
    return {"case": [b, h, n, d, "fp16", "causal"], "rows": rows}


# ----------------------------------------------------------------------------- decode step


def decode_host_times(device, batch=1, cache=8192, heads_q=32, heads_kv=8, d=128, dtype=None, profile=False):
    """Host microseconds per call of a decode step (q len 1 against a full cache, no
    append, no rotary; issue 19's case: b1, 8k cache, 32/8 heads, d128, bf16), as
    host_us_per_call measures them:
      ours_sdpa      our drop-in exactly as transformers calls it at a decode step
      torch_sdpa     torch.nn.functional.scaled_dot_product_attention, same (B, H, L, D) tensors
      kvcache        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=<int32 tensor>)
      kvcache_none   the same with cache_seqlens=None (the whole cache)
      op_attention   the op the drop-in's fast path calls (flashattn_ext::attention, bhsd), from Python
      op_fwd_kvcache flashattn_ext::fwd_kvcache on the same tensors (bhsd), from Python
      python_only    the drop-in with the ops replaced by a stub returning q: its Python alone
    The implementations are interleaved round by round, each first in one round
    (median over rounds). With
    profile, a torch.profiler CPU table of 50 calls of each (the ops' own host times).
    On a CPU the kernels run inside the call: there it is the whole call's time."""
    import torch.nn.functional as F

    import flashattn_ext
    from flashattn_ext import _ops, interface

    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device)
    gen.manual_seed(0)

    def rand(*shape):
        return torch.randn(shape, dtype=dtype, device=device, generator=gen)

    q = rand(batch, 1, heads_q, d)
    k_cache, v_cache = rand(batch, cache, heads_kv, d), rand(batch, cache, heads_kv, d)
    seqlens = torch.full((batch,), cache, dtype=torch.int32, device=device)
    qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    scaling = d**-0.5

    def sdpa_dropin():
        return flashattn_ext.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=None, dropout_p=0.0, scale=scaling, is_causal=False, enable_gqa=True
        )

    class _StubOps:  # every op returns (its first argument,): the drop-in's Python without the C++
        def __getattr__(self, name):
            return lambda *args: (args[0],)

    def python_only():
        real = interface._ops
        interface._ops = _StubOps()
        try:
            return sdpa_dropin()
        finally:
            interface._ops = real

    calls = {
        "ours_sdpa": sdpa_dropin,
        "torch_sdpa": lambda: F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=None, dropout_p=0.0, scale=scaling, is_causal=False, enable_gqa=True
        ),
        "kvcache": lambda: flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens),
        "kvcache_none": lambda: flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache),
        "op_attention": lambda: _ops.attention(qt, kt, vt, scaling, -1, -1, False, False, True),
        "op_fwd_kvcache": lambda: _ops.fwd_kvcache(qt, kt, vt, seqlens, None, None, None, scaling, -1, -1, 0, True),
        "python_only": python_only,
    }
    res = dict(batch=batch, cache=cache, heads_q=heads_q, heads_kv=heads_kv, d=d, dtype=str(dtype), impls={})
    rounds = {name: [] for name in calls}
    names = list(calls)
    for r in range(len(names)):  # each implementation first in one round: no position bias
        for name in names[r:] + names[:r]:
            fn = calls[name]
            try:
                rounds[name].append(host_us_per_call(fn, device))
            except Exception as exc:  # noqa: BLE001
                rounds[name].append({"error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    for name, rs in rounds.items():
        ok = [r for r in rs if "us" in r]
        if not ok:
            res["impls"][name] = rs[-1]
        else:
            res["impls"][name] = dict(
                us=statistics.median(r["us"] for r in ok),
                us_rounds=[r["us"] for r in ok],
                gpu_busy=all(r.get("gpu_busy", True) for r in ok),
            )
        r = res["impls"][name]
        print(f"decode b{batch} cache {cache}: {name:14s} " + (f"{r['us']:8.2f} us/call" if "us" in r else r["error"]))
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        res["profile"] = {}
        for name in ("ours_sdpa", "torch_sdpa", "op_attention", "op_fwd_kvcache"):
            fn = calls[name]
            for _ in range(10):
                fn()
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(50):
                    fn()
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)
            res["profile"][name] = table
            print(f"--- profile of 50 calls: {name}\n{table}", flush=True)
    return res


# ----------------------------------------------------------------------------- behind torch's SDPA

ACTIVATED_IMPLS = ("sdpa_default", "ours_sdpa", "activated")
ACTIVATED_MODES = ("fwd", "fwd+bwd")


def _flash_op_calls(mode, b, h, n, d, causal, dtype, device, gen):
    """(ctx, fn) pairs for the CPU: the CUDA path's overrides (backend._register_flash_ops, registered for
    the CPU key) called as aten._scaled_dot_product_flash_attention, and the same kernels called
    directly (flashattn_ext.fwd / bwd on (B, L, H, E) views): their difference is the overrides'
    own cost (C++ since session 14; before, Python and torch.library's call into it)."""
    import contextlib

    from flashattn_ext import _ops, backend

    def rnd():
        return torch.randn((b, n, h, d), dtype=dtype, device=device, generator=gen).transpose(1, 2)

    q, k, v, dout = rnd(), rnd(), rnd(), rnd()
    grad = mode != "fwd"
    q, k, v = (x.requires_grad_(grad) for x in (q, k, v))
    scale = d**-0.5
    wr = 0 if causal else -1

    @contextlib.contextmanager
    def registered():
        handle = backend._register_flash_ops(device.type.upper())
        try:
            yield
        finally:
            handle.remove()

    op = torch.ops.aten._scaled_dot_product_flash_attention
    if mode == "fwd":
        override = lambda: op(q, k, v, 0.0, causal, scale=scale)  # noqa: E731
    else:
        override = lambda: torch.autograd.grad(op(q, k, v, 0.0, causal, scale=scale)[0], (q, k, v), dout)  # noqa: E731
    qb, kb, vb, db = (x.detach().transpose(1, 2) for x in (q, k, v, dout))

    def kernels():
        out, lse = _ops.fwd_op(qb, kb, vb, scale, -1, wr, True)
        if mode != "fwd":
            return _ops.bwd(db, qb, kb, vb, out, lse, scale, -1, wr, True, False)
        return out, lse

    return {"flash_op_override": (registered, override), "kernels_direct": (contextlib.nullcontext, kernels)}


def activated_host_times(device, shape=(1, 1, 16, 64), dtype=None, causal=True, rounds=15, calls=40, seed=0):
    """Host microseconds per call behind torch's SDPA (see the module docstring), interleaved:
    every round times each implementation once (host_us_per_call with one repetition of
    `calls` calls); the figure is the median over the rounds."""
    import warnings

    if HERE not in sys.path:  # bench_gpu imports this module: imported here, from beside it
        sys.path.insert(0, HERE)
    import bench_gpu

    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b, h, n, d = shape
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    res = dict(b=b, h=h, n=n, d=d, dtype=str(dtype).replace("torch.", ""), causal=causal, rounds=rounds, calls=calls)
    res["method"] = "interleaved rounds, median over rounds of host_us_per_call(calls, reps=1)"
    res["impls"] = {}
    for mode in ACTIVATED_MODES:
        fns = {}
        for impl in ACTIVATED_IMPLS:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ctx, fn, info = bench_gpu.build_call(impl, mode, b, h, n, d, causal, dtype, device, gen)
                fns[impl] = (ctx, fn)
            except Exception as exc:  # noqa: BLE001
                res["impls"].setdefault(impl, {})[mode] = {"error": bench_gpu._short(exc)}
        if device.type == "cpu":
            fns.update(_flash_op_calls(mode, b, h, n, d, causal, dtype, device, gen))
        samples = {impl: [] for impl in fns}
        for _ in range(rounds):
            for impl, (ctx, fn) in fns.items():
                with ctx():
                    r = host_us_per_call(fn, device, calls=calls, reps=1, warmup=3)
                samples[impl].append(r["us"])
                if r.get("gpu_busy") is False:
                    res.setdefault("gpu_went_idle", []).append(f"{impl} {mode}")
        for impl, xs in samples.items():
            res["impls"].setdefault(impl, {})[mode] = dict(
                us=statistics.median(xs), us_min=min(xs), us_max=max(xs), rounds=len(xs)
            )
    return res


def activated_text(res):
    lines = [
        f"host us/call behind torch's SDPA (b{res['b']} h{res['h']} n{res['n']} d{res['d']} {res['dtype']}"
        f"{' causal' if res['causal'] else ''}; median of {res['rounds']} interleaved rounds [min-max]):"
    ]
    for impl, modes in res["impls"].items():
        cells = []
        for mode in ACTIVATED_MODES:
            r = modes.get(mode, {})
            cells.append(
                f"{mode} {r['us']:7.1f} [{r['us_min']:.1f}-{r['us_max']:.1f}]"
                if "us" in r
                else f"{mode} {r.get('error')}"
            )
        lines.append(f"  {impl:18s} " + " | ".join(cells))
    if res.get("gpu_went_idle"):
        lines.append("  * the GPU went idle during: " + ", ".join(res["gpu_went_idle"]))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--tiny-only", action="store_true", help="only the host time per call of the tiny case")
    ap.add_argument(
        "--decode", action="store_true", help="only the host time per call of a decode step (b1, 32/8 heads, d128)"
    )
    ap.add_argument("--cache", type=int, default=8192, help="--decode: the cache length (default %(default)s)")
    ap.add_argument("--profile", action="store_true", help="--decode: also a torch.profiler CPU table per call")
    ap.add_argument(
        "--activated", action="store_true", help="only the host time per call behind torch's SDPA (activate())"
    )
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (CPU: 1 keeps thread wake-ups out of it)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, HERE)
    import bench_gpu

    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__}
    if args.activated:
        out["activated_host"] = activated_host_times(device)
        print(activated_text(out["activated_host"]), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return 0
    if args.decode:
        out["decode_host"] = decode_host_times(device, cache=args.cache, profile=args.profile)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return 0
    out["host_overhead"] = bench_gpu.measure_host_overhead(device)
    print(bench_gpu.bench_table.host_overhead_text(out["host_overhead"]), flush=True)
    if device.type == "cuda" and not args.tiny_only:
        out["gpt2_three_ways"] = gpt2_three_ways()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
