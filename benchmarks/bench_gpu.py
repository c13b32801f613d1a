#!/usr/bin/env python3
"""The standard attention benchmark grid: flashattn_ext through both of its APIs
against torch's SDPA (its default choice and each backend forced) and the naive
3-kernel path, measured side by side in one run.

    python benchmarks/bench_gpu.py --json results.json [--md results.md]   # the full run (~2-3 min on an H200)
    python benchmarks/bench_gpu.py --quick --json /tmp/smoke.json          # a small subset (~40 s)
    python benchmarks/bench_gpu.py --device cpu --quick --json /tmp/cpu.json  # the same code path on a CPU

Implementations (the JSON's `impl` field), each on contiguous inputs in its own layout:
  ours_sdpa           flashattn_ext.scaled_dot_product_attention, (b, h, n, d) inputs and
                      gradient, exactly as a model calls torch's SDPA
  ours_native         flashattn_ext.flash_attn_func, (b, n, h, d)
  sdpa_default        torch.nn.functional.scaled_dot_product_attention, no backend forced
                      (the row's `backend` says which one torch picked)
  sdpa_cudnn          torch SDPA forced to SDPBackend.CUDNN_ATTENTION
  sdpa_flash          torch SDPA forced to SDPBackend.FLASH_ATTENTION (FlashAttention-2)
  sdpa_mem_efficient  torch SDPA forced to SDPBackend.EFFICIENT_ATTENTION   } slow: grid points at
  naive               matmul -> (mask) -> softmax -> matmul, input dtype     } --slow-seqlens only
  fa4                 flash_attn.cute.flash_attn_func (flash-attn-4), (b, n, h, d), when
                      importable; else recorded under `skipped_impls`

What one run measures, in this order (the JSON is rewritten after every section):
  - ceilings: a bf16 8192^3 matmul (TFLOP/s) and a device-to-device copy (TB/s, read +
    write counted); every grid row also carries `frac_matmul`, its TFLOP/s over the
    matmul ceiling of the same run;
  - host_overhead: host (CPU) microseconds of one call on a tiny case (b1 h2 n128 d64
    bf16 causal): forward without grad, forward recording the graph, forward + backward;
    for sdpa_default, ours_sdpa, ours_native, sdpa_cudnn, sdpa_flash (host_overhead.py);
  - gpt2: the seed's case, b8 h12 n1024 d64 fp16 causal, forward + backward through
    autograd, and its speedup over naive;
  - memory: peak extra memory of one forward + backward (b1 h16 d128 bf16, 4k/16k/32k);
  - the grid: bf16, head dims 128/64/256/192 (in that order, so the time budget cuts d192
    and d256 first), causal and not, seqlens 512..16k with batch * seqlen = 16384 tokens and
    heads = 2048 / head_dim, forward and backward.

FLOPs: flashattn_ext.reference.attention_flops (forward 4 * b * h * n_q * n_k * d,
halved when causal; backward 2.5x). The backward is timed alone: one forward with
requires_grad, then torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
dout in the output's layout. Timing: triton.testing.do_bench(fn, warmup=25, rep=100,
return_mode="median") (CUDA events with the same protocol when triton is missing).

A backend that refuses a shape is recorded as skipped, an exception as an error
string, a call of flashattn_ext.scaled_dot_product_attention that would fall back to
torch as an error (it would time torch, not us): one failing implementation never
stops the run. The grid stops adding points after --budget-s seconds (the JSON's
`budget_exceeded` lists what was left out). The last thing printed is the ratio table.
"""

import argparse
import contextlib
import datetime
import gc
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# flashattn_ext comes from PYTHONPATH or an installed copy when there is one, else
# from the checkout this script lives in (built in place with
# `python setup.py build_ext --inplace`). The JSON records which one ran.
sys.path.insert(0, HERE)
if os.path.isdir(os.path.join(ROOT, "flashattn_ext")):
    sys.path.append(ROOT)

import bench_table  # noqa: E402
import host_overhead  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

CORE_IMPLS = ("ours_sdpa", "ours_native", "sdpa_default", "sdpa_cudnn", "sdpa_flash")
SLOW_IMPLS = ("sdpa_mem_efficient", "naive")
ALL_IMPLS = CORE_IMPLS + ("fa4",) + SLOW_IMPLS
TORCH_BACKENDS = {
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_mem_efficient": "EFFICIENT_ATTENTION",
}
CUDA_ONLY_IMPLS = ("sdpa_cudnn", "sdpa_mem_efficient", "fa4")
BNHD_IMPLS = ("ours_native", "fa4")  # the others take (b, h, n, d)
HOST_IMPLS = ("sdpa_default", "ours_sdpa", "ours_native", "activated", "sdpa_cudnn", "sdpa_flash")
HOST_MODES = ("fwd", "fwd_grad", "fwd+bwd")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GIB = 1024**3


class Skip(Exception):
    """An implementation that does not apply to a case (not an error)."""


class FellBack(Exception):
    """flashattn_ext.scaled_dot_product_attention would hand the call to torch."""


# ----------------------------------------------------------------------------- timing


def make_timer(device, warmup_ms=25, rep_ms=100):
    """Returns (bench(fn) -> median ms, description)."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench

            def bench(fn):
                return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))

            return bench, f"triton.testing.do_bench(warmup={warmup_ms}, rep={rep_ms}, return_mode='median')"
        except ImportError:
            return (lambda fn: _cuda_event_bench(fn, warmup_ms, rep_ms)), (
                f"CUDA events, do_bench protocol (warmup={warmup_ms} ms, rep={rep_ms} ms, L2 flushed, median)"
            )
    return (lambda fn: _cpu_bench(fn, warmup_ms, rep_ms)), (
        f"time.perf_counter (warmup {warmup_ms} ms, {rep_ms} ms of reps, median)"
    )


def _cuda_event_bench(fn, warmup_ms, rep_ms):
    # The protocol of triton.testing.do_bench: estimate, then time each call
    # between events with the L2 cache flushed before it; report the median.
    cache = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        cache.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = start.elapsed_time(end) / 5
    n_warmup = max(1, int(warmup_ms / max(estimate, 1e-3)))
    n_rep = max(1, int(rep_ms / max(estimate, 1e-3)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    for _ in range(n_warmup):
        fn()
    for i in range(n_rep):
        cache.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _cpu_bench(fn, warmup_ms, rep_ms):
    t_end = time.perf_counter() + warmup_ms / 1e3
    fn()
    while time.perf_counter() < t_end:
        fn()
    times = []
    t_end = time.perf_counter() + rep_ms / 1e3
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < 1000):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _load_reference():
    """flashattn_ext.reference (the project's one FLOP formula and one visibility
    rule); read from the checkout's file when the package does not import (a
    broken build must not stop the peers' measurements)."""
    try:
        from flashattn_ext import reference

        return reference
    except Exception:  # noqa: BLE001
        path = os.path.join(ROOT, "flashattn_ext", "reference.py")
        spec = importlib.util.spec_from_file_location("_flashattn_reference", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


_reference = _load_reference()
attention_flops = _reference.attention_flops


def tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12 if ms and ms > 0 else None


# ----------------------------------------------------------------------------- implementations


def _load_ours():
    try:
        import flashattn_ext

        return flashattn_ext, None
    except Exception as e:  # a broken build must not stop the peers' measurements
        return None, f"import flashattn_ext failed: {type(e).__name__}: {e}"


OURS, OURS_IMPORT_ERROR = _load_ours()


def _load_fa4():
    """flash-attn-4's flash_attn_func (flash_attn.cute), or the reason it is unavailable."""
    try:
        from flash_attn.cute import flash_attn_func

        return flash_attn_func, None
    except Exception as e:  # noqa: BLE001
        return None, f"import flash_attn.cute failed: {type(e).__name__}: {str(e)[:200]}"


def naive_attention(q, k, v, causal, mask=None):
    """The textbook 3-kernel path in the input dtype: S = QK^T / sqrt(d), softmax, PV.
    q, k, v: (b, h, n, d). `mask` (bool, True = masked) is precomputed by the caller."""
    s = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (b, h, n_q, n_k)
    if causal:
        s = s.masked_fill(mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)


def causal_mask(n_q, n_k, device):
    # True where masked: the complement of the one visibility rule (causal, top-left;
    # for n_q == n_k top-left and bottom-right alignment agree).
    return ~_reference.visible_mask(n_q, n_k, window_right=0, device=device)


def layout_of(impl):
    return "bnhd" if impl in BNHD_IMPLS else "bhnd"


def make_attention(impl, causal, n_q, n_k, device):
    """Returns (context manager factory, f(q, k, v) -> out) for one implementation.
    The context (a forced SDPA backend) is entered around a whole measurement so
    that its cost stays out of the timed calls."""
    if impl in CUDA_ONLY_IMPLS and device.type != "cuda":
        raise Skip("needs CUDA")
    if impl in ("ours_sdpa", "ours_native"):
        if OURS is None:
            raise RuntimeError(OURS_IMPORT_ERROR)
        if impl == "ours_native":
            fa = OURS.flash_attn_func
            return contextlib.nullcontext, (lambda q, k, v: fa(q, k, v, causal=causal))
        sdpa = OURS.scaled_dot_product_attention
        return contextlib.nullcontext, (lambda q, k, v: sdpa(q, k, v, is_causal=causal))
    if impl == "sdpa_default":
        return contextlib.nullcontext, (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    if impl == "activated":  # torch's own SDPA call with our kernels behind it (flashattn_ext.activate)
        if OURS is None:
            raise RuntimeError(OURS_IMPORT_ERROR)
        return (lambda: OURS.backend.activated(first=True)), (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        )
    if impl == "naive":
        mask = causal_mask(n_q, n_k, device) if causal else None
        return contextlib.nullcontext, (lambda q, k, v: naive_attention(q, k, v, causal, mask))
    if impl == "fa4":
        fa4, why = _load_fa4()
        if fa4 is None:
            raise Skip(why)

        def f(q, k, v):
            out = fa4(q, k, v, causal=causal)
            return out[0] if isinstance(out, (tuple, list)) else out

        return contextlib.nullcontext, f
    if impl in TORCH_BACKENDS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, TORCH_BACKENDS[impl])
        return (lambda: sdpa_kernel(backend)), (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        )
    raise ValueError(f"unknown implementation {impl!r}")


def make_inputs(impl, b, h, n_q, n_k, d, dtype, device, requires_grad, gen):
    def rnd(n):
        shape = (b, n, h, d) if layout_of(impl) == "bnhd" else (b, h, n, d)
        return torch.randn(shape, dtype=dtype, device=device, generator=gen).requires_grad_(requires_grad)

    return rnd(n_q), rnd(n_k), rnd(n_k)


def default_backend(q, k, v, causal):
    """The backend torch's SDPA picks for this call when none is forced (lower case, e.g. "cudnn")."""
    try:
        from torch.nn.attention import SDPBackend

        name = SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, causal)).name
    except Exception:  # noqa: BLE001  (a private helper: record nothing rather than fail)
        return None
    return {"FLASH_ATTENTION": "flash", "CUDNN_ATTENTION": "cudnn", "EFFICIENT_ATTENTION": "mem_efficient"}.get(
        name, name.lower()
    )


def build_call(impl, mode, b, h, n, d, causal, dtype, device, gen):
    """Sets one implementation up on one case and returns (ctx, fn, info): enter
    ctx() around calls of fn. mode: "fwd" (inputs without grad), "fwd_grad" (the
    forward of a training step: inputs require grad, the graph is recorded), "bwd"
    (the backward alone, after one forward) or "fwd+bwd" (through autograd). info:
    what was learnt on the way (sdpa_default: the backend torch picked). Raises Skip
    for a case that does not apply, FellBack when our SDPA would run torch's, and
    whatever a backend raises for a refusal (the first call runs here, untimed)."""
    if mode not in ("fwd", "fwd_grad", "bwd", "fwd+bwd"):
        raise ValueError(f"unknown mode {mode!r}")
    ctx, f = make_attention(impl, causal, n, n, device)
    q, k, v = make_inputs(impl, b, h, n, n, d, dtype, device, mode != "fwd", gen)
    info = {}
    if impl == "ours_sdpa":
        reason = OURS.sdpa_fallback_reason(q, k, v, is_causal=causal)
        if reason is not None:
            raise FellBack(reason)
    if impl == "sdpa_default":
        info["backend"] = default_backend(q, k, v, causal)
    with ctx():
        out = f(q, k, v)  # a refusal surfaces here, before timing
        if mode in ("fwd", "fwd_grad"):
            out = None
            return ctx, (lambda: f(q, k, v)), info
        # dout in the output's layout, contiguous: for ours_sdpa (b, h, n, d) as a model's
        # gradient arrives, though our output is a (b, h, n, d) view of a (b, n, h, d) buffer.
        dout = torch.randn(out.shape, dtype=dtype, device=device, generator=gen)
        if mode == "bwd":
            return ctx, (lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)), info
        out = None
        return ctx, (lambda: torch.autograd.grad(f(q, k, v), (q, k, v), dout)), info


def _is_refusal(e):
    msg = str(e)
    return (
        "No available kernel" in msg
        or "No viable backend" in msg
        or "not supported" in msg.lower()
        and "sdpa" in msg.lower()
    )


def _short(e):
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    return f"{type(e).__name__}: {first}"[:300]


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _record_failure(row, e):
    """Files an exception of a measurement under skipped or error."""
    if isinstance(e, Skip):
        row["skipped"] = str(e)
    elif isinstance(e, FellBack):
        row["error"] = "flashattn_ext.scaled_dot_product_attention would fall back to torch: " + str(e)
    elif isinstance(e, torch.cuda.OutOfMemoryError):
        row["error"] = "OOM"
    elif _is_refusal(e):
        row["skipped"] = "backend refused: " + _short(e)
    else:
        row["error"] = _short(e)


def run_case(impl, mode, b, h, n, d, causal, dtype, device, bench, gen, naive_max_gib, matmul_tflops=None):
    """Times one implementation on one case. Returns a row; never raises."""
    row = dict(impl=impl, mode=mode, dtype=_dtype_name(dtype), d=d, n=n, b=b, h=h, causal=causal, ms=None, tflops=None)
    if impl == "naive":
        elt = torch.finfo(dtype).bits // 8
        # fwd holds ~3 score-sized matrices (S, masked S, P); fwd+bwd ~5 (P saved, dP, dS, ...).
        need = b * h * n * n * elt * (3 if mode == "fwd" else 5) / GIB
        if need > naive_max_gib:
            row["skipped"] = f"would need ~{need:.0f} GiB (> {naive_max_gib:g} GiB)"
            return row
    fn = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SDPA's "backend not available" warnings: the refusal is recorded
            ctx, fn, info = build_call(impl, mode, b, h, n, d, causal, dtype, device, gen)
            row.update(info)
            with ctx():
                ms = bench(fn)
        row["ms"] = ms
        row["tflops"] = tflops(attention_flops(b, h, n, n, d, causal, mode), ms)
        if row["tflops"] and matmul_tflops:
            row["frac_matmul"] = row["tflops"] / matmul_tflops
    except Exception as e:  # noqa: BLE001  (recorded, never fatal)
        _record_failure(row, e)
    finally:
        fn = None  # noqa: F841  (drops the inputs the closure holds)
        if impl == "naive" or "error" in row:
            _free(device)
    return row


def _dtype_name(dtype):
    return {v: k for k, v in DTYPES.items()}[dtype]


# ----------------------------------------------------------------------------- sections


def measure_ceilings(device, bench, quick):
    res = {}
    if device.type == "cuda":
        m, dtype, copy_bytes = 8192, torch.bfloat16, GIB
    else:
        m, dtype, copy_bytes = (256 if quick else 1024), torch.float32, 64 * 1024**2
    try:
        a = torch.randn(m, m, dtype=dtype, device=device)
        bm = torch.randn(m, m, dtype=dtype, device=device)
        ms = bench(lambda: torch.matmul(a, bm))
        res.update(
            matmul_tflops=tflops(2.0 * m**3, ms), matmul_ms=ms, matmul_shape=[m, m, m], matmul_dtype=_dtype_name(dtype)
        )
        a = bm = None  # free before the copy test
    except Exception as e:  # noqa: BLE001
        res.update(matmul_tflops=None, matmul_error=_short(e))
    try:
        src = torch.empty(copy_bytes, dtype=torch.uint8, device=device).random_()
        dst = torch.empty_like(src)
        ms = bench(lambda: dst.copy_(src))
        res.update(
            copy_tbs=2.0 * copy_bytes / (ms * 1e-3) / 1e12,
            copy_ms=ms,
            copy_bytes=copy_bytes,
            copy_note="read + write bytes counted",
        )
        src = dst = None
    except Exception as e:  # noqa: BLE001
        res.update(copy_tbs=None, copy_error=_short(e))
    _free(device)
    return res


def measure_host_overhead(
    device, impls=HOST_IMPLS, modes=HOST_MODES, shape=(1, 2, 128, 64), dtype=None, causal=True, seed=0
):
    """Host microseconds of one call on a tiny case, per implementation and mode
    (host_overhead.host_us_per_call): the cost of the Python wrapper, checks,
    autograd and launches, which the GPU time of a tiny case cannot hide."""
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b, h, n, d = shape
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    res = dict(
        b=b,
        h=h,
        n=n,
        d=d,
        dtype=_dtype_name(dtype),
        causal=causal,
        unit="us per call",
        modes={
            "fwd": "forward, inputs without grad",
            "fwd_grad": "forward, inputs requiring grad (records the autograd graph)",
            "fwd+bwd": "forward + torch.autograd.grad(out, (q, k, v), dout)",
        },
        method=(
            "GPU kept busy by a torch.cuda._sleep kernel; calls enqueued behind it timed with "
            "time.perf_counter, no synchronization inside the timed loop; median of reps"
            if device.type == "cuda"
            else "CPU: wall time of the whole call (the kernels run inside it)"
        ),
        impls={},
    )
    for impl in impls:
        entry = {}
        for mode in modes:
            r = {}
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ctx, fn, info = build_call(impl, mode, b, h, n, d, causal, dtype, device, gen)
                    if info.get("backend"):
                        entry["backend"] = info["backend"]
                    with ctx():
                        r = host_overhead.host_us_per_call(fn, device)
            except Exception as e:  # noqa: BLE001
                _record_failure(r, e)
            fn = None
            entry[mode] = r
        res["impls"][impl] = entry
    _free(device)
    return res


def measure_memory(impl, n, b, h, d, dtype, device, gen):
    """Peak extra memory of one forward + backward, beyond the inputs and dout."""
    entry = dict(
        impl=impl,
        b=b,
        h=h,
        n=n,
        d=d,
        dtype=_dtype_name(dtype),
        causal=False,
        peak_extra_bytes=None,
        peak_extra_gib=None,
    )
    if device.type != "cuda":
        entry["skipped"] = "memory statistics need CUDA"
        return entry
    q = k = v = dout = out = grads = None
    try:
        _free(device)
        ctx, f = make_attention(impl, False, n, n, device)
        q, k, v = make_inputs(impl, b, h, n, n, d, dtype, device, True, gen)
        if impl == "ours_sdpa":
            reason = OURS.sdpa_fallback_reason(q, k, v)
            if reason is not None:
                raise FellBack(reason)
        dout = torch.randn(q.shape, dtype=dtype, device=device, generator=gen)  # out has q's shape
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with ctx(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = f(q, k, v)
            grads = torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base  # the gradients (input-sized) count as extra
        entry.update(peak_extra_bytes=int(extra), peak_extra_gib=extra / GIB)
    except Exception as e:  # noqa: BLE001
        _record_failure(entry, e)
    finally:
        q = k = v = dout = out = grads = None  # noqa: F841
        _free(device)
    return entry


def measure_gpt2(device, bench, gen, impls, quick):
    if device.type == "cuda":
        b, h, n, d, dtype = 8, 12, 1024, 64, torch.float16
    else:  # a CPU smoke run exercises the code path on a tiny case
        b, h, n, d, dtype = 1, 2, 128, 32, torch.float32
    res = dict(b=b, h=h, n=n, d=d, dtype=_dtype_name(dtype), causal=True, mode="fwd+bwd", impls={})
    for impl in impls:
        row = run_case(impl, "fwd+bwd", b, h, n, d, True, dtype, device, bench, gen, naive_max_gib=float("inf"))
        res["impls"][impl] = {k: row[k] for k in ("ms", "tflops", "backend", "skipped", "error") if k in row}
    naive_ms = res["impls"].get("naive", {}).get("ms")
    for impl, r in res["impls"].items():
        if naive_ms and r.get("ms"):
            r["speedup_vs_naive"] = naive_ms / r["ms"]
    return res


# ----------------------------------------------------------------------------- driver


def environment(device, timer_desc):
    env = dict(
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        device=device.type,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        python=platform.python_version(),
        timer=timer_desc,
        layouts={
            "ours_native": "(b, n, h, d) contiguous",
            "fa4": "(b, n, h, d) contiguous",
            "others": "(b, h, n, d) contiguous (ours_sdpa included, and its dout)",
        },
        flops="flashattn_ext.reference.attention_flops: fwd 4*b*h*n_q*n_k*d, halved when causal; bwd 2.5x fwd",
    )
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(
            capability=f"{p.major}.{p.minor}",
            sm_count=p.multi_processor_count,
            gpu_memory_gib=round(p.total_memory / GIB, 1),
        )
    else:
        env.update(gpu=None, cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if OURS is not None:
        env["flashattn_ext"] = getattr(OURS, "__version__", None)
        env["flashattn_ext_path"] = os.path.dirname(OURS.__file__)
        try:
            env["build_info"] = torch.ops.flashattn_ext.build_info()
        except Exception as e:  # noqa: BLE001
            env["build_info"] = f"unavailable: {_short(e)}"
    else:
        env["flashattn_ext"] = None
        env["flashattn_ext_error"] = OURS_IMPORT_ERROR
    if device.type == "cpu":
        env["note"] = (
            "CPU run: 'sdpa_flash' is torch's CPU flash kernel; sdpa_cudnn, sdpa_mem_efficient and fa4 need CUDA"
        )
    return env


def _ints(s):
    out = []
    for x in s.split(","):
        x = x.strip().lower()
        if not x:
            continue
        mult = 1024 if x.endswith("k") else 1
        out.append(int(x.rstrip("k")) * mult)
    return out


def _names(s, allowed, what, aliases=None):
    names = [(aliases or {}).get(x.strip(), x.strip()) for x in s.split(",") if x.strip()]
    bad = [x for x in names if x not in allowed]
    if bad:
        raise SystemExit(f"--{what}: unknown {bad}; choose from {', '.join(allowed)}")
    return list(dict.fromkeys(names))


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Attention benchmark grid: flashattn_ext (SDPA API and flash_attn_func) vs torch SDPA "
        "(default, cuDNN, FA2, mem-efficient), naive and FA4 when installed; plus ceilings, host time per "
        "call, peak memory and the GPT-2 case.",
    )
    p.add_argument("--json", metavar="PATH", help="write the results as JSON here (rewritten after each section)")
    p.add_argument("--md", metavar="PATH", help="write a markdown results table here")
    p.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="default auto: CUDA when torch sees a GPU; cpu runs the same code on small shapes "
        "(CUDA-only backends and the memory test are skipped)",
    )
    p.add_argument(
        "--heads-dims",
        "--head-dims",
        dest="head_dims",
        default=None,
        help="head dims, comma-separated (default 128,64,256,192; quick: 128,64)",
    )
    p.add_argument("--seqlens", default=None, help="seqlens, e.g. 512,1k,2k (default 512..16k; quick: 1k,4k)")
    p.add_argument("--modes", default="fwd,bwd", help="fwd, bwd or both (default fwd,bwd)")
    p.add_argument("--causal", choices=("both", "true", "false"), default="both", help="default both")
    p.add_argument(
        "--impls",
        default=",".join(ALL_IMPLS),
        help="implementations to time (default all: %(default)s; fa4 only when importable; "
        "the old names flashattn_ext, cudnn, fa2, mem_efficient are accepted)",
    )
    p.add_argument(
        "--slow-seqlens",
        default=None,
        help="grid seqlens at which the slow implementations (sdpa_mem_efficient, naive) run: "
        "a list, 'all' or 'none' (default 1k,4k; quick: 1k; CPU: all). The GPT-2 case always "
        "runs naive for its speedup",
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="grid dtypes, comma-separated among bf16,fp16,fp32 (default bf16 on CUDA, fp32 on CPU)",
    )
    p.add_argument("--fp16", action="store_true", help="also run the grid in fp16")
    p.add_argument("--tokens", type=int, default=None, help="batch * seqlen of the grid (default 16384)")
    p.add_argument("--head-total", type=int, default=None, help="heads * head_dim of the grid (default 2048)")
    p.add_argument("--memory-seqlens", default=None, help="seqlens of the memory test (default 4k,16k,32k)")
    p.add_argument(
        "--naive-max-gib",
        type=float,
        default=40.0,
        help="skip the naive path where its score matrices would need more than this (default %(default)g GiB)",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the memory test")
    p.add_argument("--no-gpt2", action="store_true", help="skip the GPT-2 case")
    p.add_argument("--no-ceilings", action="store_true", help="skip the matmul / copy ceilings")
    p.add_argument("--no-host", action="store_true", help="skip the host time per call")
    p.add_argument("--quick", action="store_true", help="a small subset (GPU: about 40 s; CPU: tiny shapes)")
    p.add_argument(
        "--budget-s",
        "--time-budget",
        dest="budget_s",
        type=float,
        default=200.0,
        metavar="SECONDS",
        help="stop adding grid points once the run has taken this long (default %(default)g, which "
        "keeps a full H200 run under 4 minutes; 0: no limit)",
    )
    p.add_argument("--warmup", type=float, default=25.0, help="do_bench warmup in ms (default %(default)g)")
    p.add_argument("--rep", type=float, default=100.0, help="do_bench repetition time in ms (default %(default)g)")
    p.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    t_start = time.time()
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device")
    cpu = device.type == "cpu"

    if args.dtype:
        dtypes = [DTYPES[x] for x in _names(args.dtype, tuple(DTYPES), "dtype")]
    else:
        dtypes = [torch.float32 if cpu else torch.bfloat16]
    if args.fp16 and torch.float16 not in dtypes:
        dtypes.append(torch.float16)
    impls = _names(args.impls, ALL_IMPLS, "impls", bench_table.LEGACY_NAMES)
    skipped_impls = {}
    if "fa4" in impls:
        fa4, why = _load_fa4()
        if fa4 is None or cpu:
            skipped_impls["fa4"] = why or "needs CUDA"
            impls.remove("fa4")
    modes = _names(args.modes, ("fwd", "bwd"), "modes")
    causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    # On the CPU the same code runs on shapes scaled down to fit a few seconds.
    tokens = args.tokens or ((256 if args.quick else 1024) if cpu else 16384)
    head_total = args.head_total or ((128 if args.quick else 256) if cpu else 2048)
    if args.quick:
        head_dims = _ints(args.head_dims) if args.head_dims else ([32] if cpu else [128, 64])
        seqlens = _ints(args.seqlens) if args.seqlens else ([64, 128] if cpu else [1024, 4096])
        mem_seqlens = _ints(args.memory_seqlens) if args.memory_seqlens else ([256] if cpu else [4096])
        slow_default = None if cpu else [1024]
        warmup, rep = (5.0, 20.0) if cpu else (10.0, 30.0)
    else:
        head_dims = _ints(args.head_dims) if args.head_dims else ([64, 32] if cpu else [128, 64, 256, 192])
        seqlens = (
            _ints(args.seqlens)
            if args.seqlens
            else ([128, 256, 512, 1024] if cpu else [512, 1024, 2048, 4096, 8192, 16384])
        )
        mem_seqlens = _ints(args.memory_seqlens) if args.memory_seqlens else [4096, 16384, 32768]
        slow_default = None if cpu else [1024, 4096]
        warmup, rep = args.warmup, args.rep
    if args.slow_seqlens is None:
        slow_seqlens = slow_default  # None: everywhere
    elif args.slow_seqlens.strip().lower() == "all":
        slow_seqlens = None
    elif args.slow_seqlens.strip().lower() == "none":
        slow_seqlens = []
    else:
        slow_seqlens = _ints(args.slow_seqlens)
    bench, timer_desc = make_timer(device, warmup, rep)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)

    data = environment(device, timer_desc)
    data.update(
        ceilings={},
        host_overhead={},
        gpt2={},
        memory=[],
        rows=[],
        skipped_impls=skipped_impls,
        grid=dict(
            dtypes=[_dtype_name(x) for x in dtypes],
            head_dims=head_dims,
            seqlens=seqlens,
            modes=modes,
            causal=causals,
            impls=impls,
            tokens=tokens,
            head_total=head_total,
            slow_impls=[i for i in SLOW_IMPLS if i in impls],
            slow_seqlens="all" if slow_seqlens is None else slow_seqlens,
            quick=args.quick,
            budget_s=args.budget_s,
        ),
    )

    def save():
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            tmp = args.json + ".tmp"
            with open(tmp, "w") as fh:
                json.dump(data, fh, indent=1)
            os.replace(tmp, args.json)

    progress = Progress()
    where = data["gpu"] or f"CPU ({data.get('threads')} threads)"
    print(
        f"bench_gpu: {where}, torch {data['torch']}, flashattn_ext {data.get('flashattn_ext')} "
        f"({data.get('build_info', data.get('flashattn_ext_error'))})",
        file=sys.stderr,
    )
    for impl, why in skipped_impls.items():
        print(f"bench_gpu: {impl} skipped: {why}", file=sys.stderr)

    if not args.no_ceilings:
        progress.update("ceilings: matmul and copy")
        data["ceilings"] = measure_ceilings(device, bench, args.quick)
        save()
    matmul_tflops = data["ceilings"].get("matmul_tflops")
    if not args.no_host:
        progress.update("host time per call (b1 h2 n128 d64, tiny)")
        data["host_overhead"] = measure_host_overhead(device, [i for i in HOST_IMPLS if i in impls], seed=args.seed)
        save()
    if not args.no_gpt2:
        progress.update(
            "GPT-2 case (b8 h12 n1024 d64 fp16 causal, fwd+bwd)" if not cpu else "GPT-2 code path on a tiny CPU case"
        )
        gpt2_impls = [i for i in impls if i != "naive"] + ["naive"]  # naive always: the speedups' base
        data["gpt2"] = measure_gpt2(device, bench, gen, gpt2_impls, args.quick)
        save()
    if not args.no_memory:
        mem_dtype = torch.bfloat16 if not cpu else torch.float32
        for n in mem_seqlens:
            for impl in [i for i in ("ours_sdpa", "ours_native", "sdpa_cudnn", "sdpa_flash", "naive") if i in impls]:
                progress.update(f"memory: {impl} b1 h16 n{n} d128")
                data["memory"].append(measure_memory(impl, n, 1, 16, 128, mem_dtype, device, gen))
        save()

    # The grid, most important points first; stop adding points past the budget.
    points = [(dt, d, causal, n) for dt in dtypes for d in head_dims for causal in causals for n in seqlens]
    for i, (dtype, d, causal, n) in enumerate(points):
        elapsed = time.time() - t_start
        if args.budget_s and elapsed > args.budget_s:
            left = points[i:]
            data["budget_exceeded"] = dict(
                after_s=round(elapsed, 1),
                points_not_run=len(left),
                not_run=[dict(dtype=_dtype_name(a), d=b_, causal=c, n=m) for a, b_, c, m in left],
            )
            progress.done()
            print(
                f"bench_gpu: time budget of {args.budget_s:g} s exceeded after {elapsed:.0f} s: "
                f"{len(left)} of {len(points)} grid points not run",
                file=sys.stderr,
            )
            break
        b, h = max(1, tokens // n), max(1, head_total // d)
        point_impls = [x for x in impls if x not in SLOW_IMPLS or slow_seqlens is None or n in slow_seqlens]
        for mode in modes:
            progress.update(
                f"[{i + 1}/{len(points)}] {mode} {_dtype_name(dtype)} d{d} "
                f"{'causal ' if causal else ''}n{n} (b{b} h{h})"
            )
            for impl in point_impls:
                data["rows"].append(
                    run_case(
                        impl, mode, b, h, n, d, causal, dtype, device, bench, gen, args.naive_max_gib, matmul_tflops
                    )
                )
        save()
    progress.done()
    data["elapsed_s"] = round(time.time() - t_start, 1)
    save()
    if args.md:
        os.makedirs(os.path.dirname(os.path.abspath(args.md)), exist_ok=True)
        with open(args.md, "w") as fh:
            fh.write(bench_table.markdown_report(data))
    if args.json:
        print(f"bench_gpu: wrote {args.json} ({len(data['rows'])} rows, {data['elapsed_s']} s)", file=sys.stderr)
    sys.stderr.flush()
    print(bench_table.text_summary(data))
    return 0


class Progress:
    """One status line on stderr: rewritten in place on a terminal, one line per step in a log."""

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self.tty = stream.isatty()
        self.width = 0
        self.t0 = time.time()

    def update(self, msg):
        line = f"[{time.time() - self.t0:6.1f}s] {msg}"
        if self.tty:
            self.stream.write("\r" + line.ljust(self.width))
            self.width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self):
        if self.tty and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0


if __name__ == "__main__":
    sys.exit(main())
