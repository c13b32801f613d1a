"""python -m flashattn_ext: what this build holds, whether its kernels are right
on this machine, and how fast they are next to torch's attention.

    python -m flashattn_ext                   # the device torch sees (CUDA if any)
    python -m flashattn_ext --device cpu --quick
    python -m flashattn_ext --shapes "4,16,2048,128;8,12,1024,64,causal" --json report.json

Steps: (1) the build: package, torch, CUDA, archs and head dims compiled in;
(2) the device; (3) a short correctness check, kernel family by kernel family,
of flash_attn_func (forward and backward), scaled_dot_product_attention and
flash_attn_with_kvcache against the float32/float64 oracle
flashattn_ext.reference.attention_ref, with the project's one tolerance rule
(flashattn_ext.tolerance, FlashAttention's): the error of ours must be at most
2x (3x for gradients) the error of the same naive computation done in the low
precision, plus a small floor; lse within the float32 accumulation's precision.
The families are the CPU kernels on the CPU; on a GPU the kernels that device
runs by default and those its switches select (on sm90: the warp-specialized
TMA kernels, FLASHATTN_DISABLE_TMA=1's cp.async wgmma kernels and
FLASHATTN_DISABLE_SM90=1's mma.sync kernels), and the split-KV decoding
kernel. The report ends by naming the families it checked and those it could
not (e.g. no GPU: the CUDA kernels were built but not checked);
(4) timings of ours, torch's SDPA (per backend on CUDA) and the naive
3-kernel path. Exits 1 when the check fails, 2 on a usage error.
"""

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

import flashattn_ext
from flashattn_ext.reference import attention_flops, visible_mask
from flashattn_ext.tolerance import check_attention

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
DTYPE_ALIASES = {
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "float": "fp32",
    "float64": "fp64",
    "double": "fp64",
}

# Correctness cases: (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal).
# Odd lengths, seqlen_q != seqlen_k both ways (causal aligned bottom-right), GQA and MQA.
CUDA_CASES = [
    (2, 256, 256, 8, 8, 64, False),
    (2, 256, 256, 8, 8, 128, True),
    (1, 113, 203, 8, 2, 128, True),  # GQA 4:1, odd lengths, seqlen_k > seqlen_q
    (2, 257, 97, 6, 1, 64, True),  # MQA, seqlen_q > seqlen_k: the first rows see no key
    (1, 1023, 1025, 4, 4, 96, False),
    (3, 1, 129, 4, 2, 256, False),  # one query token (decoding)
]
CUDA_QUICK_CASES = [CUDA_CASES[1], CUDA_CASES[2], CUDA_CASES[3]]
CPU_CASES = [
    (1, 64, 64, 2, 2, 32, False),
    (2, 37, 53, 4, 2, 64, True),  # GQA, odd lengths
    (1, 41, 17, 3, 1, 16, True),  # MQA, seqlen_q > seqlen_k
    (2, 1, 33, 2, 2, 40, False),  # one query token, head dim not a power of two
]
CPU_QUICK_CASES = CPU_CASES[:3]

# flash_attn_with_kvcache cases: (batch, cache capacity, heads_q, heads_kv, head_dim, cache_seqlens),
# one query token a row against its first cache_seqlens[b] keys (a decoding step).
CUDA_DECODE_CASES = [(3, 1000, 8, 2, 128, (1000, 517, 1)), (2, 256, 4, 4, 64, (256, 100))]
CPU_DECODE_CASES = [(2, 67, 4, 2, 64, (67, 30))]


class Family:
    """A kernel family the check runs: `env` is the switch (set to "1" while its
    cases run) that routes calls to it; `cases` go through flash_attn_func (and
    one square case through scaled_dot_product_attention), `decode` through
    flash_attn_with_kvcache."""

    def __init__(self, key, label, env=None, cases=(), decode=(), sdpa=False):
        self.key, self.label, self.env = key, label, env
        self.cases, self.decode, self.sdpa = list(cases), list(decode), sdpa


def _archs_of(build):
    return [a for a in (build.get("archs") or "").split(";") if a.strip()]


def plan_families(device, build, quick):
    """(families to check on `device`, [(family, why it is not checked)])."""
    cuda_built = build.get("cuda_kernels")
    archs = _archs_of(build)
    arch_str = ", ".join("sm_90a" if a == "90" else f"sm_{a}" for a in archs)
    if device.type == "cpu":
        checked = [
            Family(
                "cpu",
                "CPU kernels (forward, backward, KV-cache decoding)",
                cases=CPU_QUICK_CASES if quick else CPU_CASES,
                decode=CPU_DECODE_CASES,
                sdpa=True,
            )
        ]
        if cuda_built:
            why = (
                "--device cpu was asked for"
                if torch.cuda.is_available()
                else "no CUDA device here (torch.cuda.is_available() is False); run this on a machine with a GPU"
            )
            unchecked = [(f"CUDA kernels (built for {arch_str}; head dims {build.get('head_dims') or '-'})", why)]
        elif cuda_built is False:
            unchecked = [("CUDA kernels", "not in this build (built with FLASHATTN_CPU_ONLY=1, or without nvcc)")]
        else:
            unchecked = [("CUDA kernels", "the build could not be read")]
        return checked, unchecked

    major, minor = torch.cuda.get_device_capability(device)
    cap = 10 * major + minor
    cases = CUDA_QUICK_CASES if quick else CUDA_CASES
    checked, unchecked = [], []
    if cap == 90 and "90" in archs:
        checked.append(
            Family(
                "sm90_tma",
                "sm_90a warp-specialized TMA kernels (this device's default; head dim 32 runs mma.sync)",
                cases=cases,
                sdpa=True,
            )
        )
        checked.append(
            Family(
                "sm90_cp_async",
                "sm_90a cp.async wgmma kernels (FLASHATTN_DISABLE_TMA=1; the head dims without them run mma.sync)",
                env="FLASHATTN_DISABLE_TMA",
                cases=[CUDA_CASES[0], CUDA_CASES[2]] if not quick else [CUDA_CASES[2]],
            )
        )
        checked.append(
            Family(
                "mma_sync",
                "mma.sync kernels, sm80's family (FLASHATTN_DISABLE_SM90=1)",
                env="FLASHATTN_DISABLE_SM90",
                cases=[CUDA_CASES[1], CUDA_CASES[3], CUDA_CASES[5]] if not quick else [CUDA_CASES[3]],
            )
        )
    else:
        checked.append(Family("mma_sync", f"mma.sync kernels (sm_{cap} runs them)", cases=cases, sdpa=True))
        if "90" in archs:
            unchecked.append(
                ("sm_90a kernels (warp-specialized TMA, cp.async wgmma)", f"need an sm90 GPU; this is sm_{cap}")
            )
    checked.append(
        Family(
            "decode",
            "split-KV decoding kernel (flash_attn_with_kvcache)",
            decode=CUDA_DECODE_CASES[:1] if quick else CUDA_DECODE_CASES,
        )
    )
    unchecked.append(("CPU kernels", "python -m flashattn_ext --device cpu checks them"))
    return checked, unchecked


@contextlib.contextmanager
def env_switch(name):
    """Sets the environment switch `name` to "1" for the block (the binding layer
    reads these on every call)."""
    if name is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


# ----------------------------------------------------------------------------- build and device


def parse_build_info(s):
    """ "cuda=1;archs=80;90;head_dims=64,128" -> {"cuda": "1", "archs": "80;90", "head_dims": "64,128"}.
    A field without '=' continues the previous value (archs are ';'-separated)."""
    out, key = {}, None
    for tok in s.split(";"):
        if "=" in tok:
            key, val = tok.split("=", 1)
            out[key.strip()] = val.strip()
        elif key is not None and tok.strip():
            out[key] = (out[key] + ";" + tok.strip()) if out[key] else tok.strip()
    return out


def build_report():
    info = {
        "flashattn_ext": getattr(flashattn_ext, "__version__", "?"),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "location": os.path.dirname(os.path.abspath(flashattn_ext.__file__)),
    }
    try:
        raw = torch.ops.flashattn_ext.build_info()
        info["build_info"] = raw
        bi = parse_build_info(raw)
        info["cuda_kernels"] = bi.get("cuda") == "1"
        info["archs"] = bi.get("archs", "")
        info["head_dims"] = bi.get("head_dims", "")
    except Exception as e:  # noqa: BLE001
        info["build_info"] = f"unavailable ({type(e).__name__}: {e})"
        info["cuda_kernels"] = None
    if torch.backends.cudnn.is_available():
        info["cudnn"] = torch.backends.cudnn.version()
    return info


def cpu_name():
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_report(device):
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return {
            "type": "cuda",
            "name": p.name,
            "capability": f"sm_{p.major}{p.minor}",
            "sms": p.multi_processor_count,
            "memory_gib": round(p.total_memory / 1024**3, 1),
        }
    return {"type": "cpu", "name": cpu_name(), "threads": torch.get_num_threads()}


def choose_device(requested, build):
    if requested == "cpu":
        return torch.device("cpu"), None
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("flashattn_ext: --device cuda, but torch sees no CUDA device")
        return torch.device("cuda"), None
    if torch.cuda.is_available():
        if build.get("cuda_kernels") is False:
            return torch.device("cpu"), (
                "a GPU is present but this build has no CUDA kernels (built with "
                "FLASHATTN_CPU_ONLY=1 or without nvcc): running on the CPU; rebuild to "
                "use the GPU, or pass --device cuda to see the failure"
            )
        return torch.device("cuda"), None
    return torch.device("cpu"), None


# ----------------------------------------------------------------------------- correctness


def case_record(case, dtype, api, **fields):
    """The JSON record of one check case: its shape and dtype, plus `fields`."""
    b, nq, nk, hq, hkv, d, causal = case
    return dict(
        api=api,
        dtype=str(dtype).replace("torch.", ""),
        b=b,
        seqlen_q=nq,
        seqlen_k=nk,
        heads_q=hq,
        heads_kv=hkv,
        head_dim=d,
        causal=causal,
        **fields,
    )


def check_case(case, dtype, device, api="flash_attn_func"):
    """One case: forward and backward of ours against the oracle with the rule
    of flashattn_ext.tolerance. Returns a dict with ok."""
    b, nq, nk, hq, hkv, d, causal = case
    res = case_record(case, dtype, api, ok=False)
    try:
        q = torch.randn(b, nq, hq, d, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(b, nk, hkv, d, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(b, nk, hkv, d, device=device, dtype=dtype, requires_grad=True)
        lse = None
        if api == "flash_attn_func":
            out, lse = flashattn_ext.flash_attn_func(q, k, v, causal=causal, return_lse=True)
        else:  # torch's layout (B, H, L, E); is_causal is top-left, the same as bottom-right when nq == nk
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            why = getattr(flashattn_ext, "sdpa_fallback_reason", None)
            why = why(qt, kt, vt, is_causal=causal, enable_gqa=hq != hkv) if why else None
            if why:  # torch would compute it, not our kernels: nothing of ours to check
                res["error"] = f"falls back to torch ({why})"
                return res
            out = flashattn_ext.scaled_dot_product_attention(
                qt, kt, vt, is_causal=causal, enable_gqa=hq != hkv
            ).transpose(1, 2)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        comps = check_attention(
            q.detach(),
            k.detach(),
            v.detach(),
            out.detach(),
            None if lse is None else lse.detach(),
            dout,
            grads,
            causal=causal,
            bottom_right=api == "flash_attn_func",
        )
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]
        return res
    return record_comparisons(res, comps)


def record_comparisons(res, comps):
    """res with each comparison's error, bound and verdict, and ok = all passed."""
    res["errors"] = {
        c.name: dict(
            err=c.err,
            naive_low_precision_err=c.naive_err,
            bound=c.bound,
            finite=c.problem is None,
            ok=c.ok,
            problem=c.problem,
        )
        for c in comps
    }
    res["ok"] = all(c.ok for c in comps)
    return res


def check_decode(case, dtype, device):
    """One decoding step (flash_attn_with_kvcache, a query token a row against the
    first cache_seqlens[b] keys of its cache row) against the oracle, row by row."""
    b, n, hq, hkv, d, seqlens = case
    res = case_record((b, 1, n, hq, hkv, d, True), dtype, "flash_attn_with_kvcache", ok=False)
    res["cache_seqlens"] = list(seqlens)
    try:
        q = torch.randn(b, 1, hq, d, device=device, dtype=dtype)
        k_cache = torch.randn(b, n, hkv, d, device=device, dtype=dtype)
        v_cache = torch.randn(b, n, hkv, d, device=device, dtype=dtype)
        lens = torch.tensor(seqlens, dtype=torch.int32, device=device)
        out, lse = flashattn_ext.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lens, causal=True, return_softmax_lse=True
        )
        comps = []
        for i, length in enumerate(seqlens):
            row = check_attention(
                q[i : i + 1], k_cache[i : i + 1, :length], v_cache[i : i + 1, :length], out[i : i + 1], lse[i : i + 1]
            )
            for c in row:
                c.name = f"{c.name}[row {i}]"
            comps += row
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]
        return res
    return record_comparisons(res, comps)


def compiled_head_dims(build):
    try:
        return [int(x) for x in build.get("head_dims", "").split(",") if x.strip()]
    except ValueError:
        return []


def run_checks(device, dtypes, families, progress, build):
    todo = []
    for fam in families:
        todo += [(fam, c, dt, "flash_attn_func") for dt in dtypes for c in fam.cases]
        if fam.sdpa:  # the SDPA entry point once per dtype, on a square causal case
            todo += [(fam, (2, 64, 64, 4, 2, 64, True), dt, "scaled_dot_product_attention") for dt in dtypes]
        todo += [(fam, c, dt, "flash_attn_with_kvcache") for dt in dtypes for c in fam.decode]
    # A CUDA build may hold only some head dims (FLASHATTN_HEAD_DIMS); a head dim runs
    # on the next larger compiled one, so only those above the largest are out of reach.
    largest = max(compiled_head_dims(build), default=None) if device.type == "cuda" else None
    results = []
    torch.manual_seed(0)
    for i, (fam, case, dt, api) in enumerate(todo):
        shown = case_str(case if api != "flash_attn_with_kvcache" else (case[0], 1, case[1], *case[2:5], True))
        progress.update(f"check {i + 1}/{len(todo)}: {fam.key} {api} {str(dt).replace('torch.', '')} {shown}")
        head_dim = case[5] if api != "flash_attn_with_kvcache" else case[4]
        if largest is not None and head_dim > largest:
            rec = case if api != "flash_attn_with_kvcache" else (case[0], 1, case[1], *case[2:5], True)
            res = case_record(
                rec, dt, api, ok=None, skipped=f"head dim {head_dim} not compiled (build has up to {largest})"
            )
        else:
            with env_switch(fam.env):
                res = (
                    check_decode(case, dt, device)
                    if api == "flash_attn_with_kvcache"
                    else check_case(case, dt, device, api)
                )
        res["family"] = fam.key
        results.append(res)
    progress.done()
    return results


def case_str(case):
    b, nq, nk, hq, hkv, d, causal = case
    return f"b{b} q{nq} k{nk} h{hq}" + (f"/kv{hkv}" if hkv != hq else "") + f" d{d}" + (" causal" if causal else "")


# ----------------------------------------------------------------------------- timing


def make_timer(device, quick):
    if device.type == "cuda":
        warmup, rep = (10, 40) if quick else (25, 100)
        try:
            from triton.testing import do_bench

            return lambda fn: float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
        except ImportError:
            pass

        def cuda_bench(fn):
            fn()
            torch.cuda.synchronize()
            times = []
            t_end = time.perf_counter() + rep / 1e3
            while len(times) < 5 or (time.perf_counter() < t_end and len(times) < 1000):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e))
            return statistics.median(times)

        return cuda_bench
    budget = 0.15 if quick else 0.4

    def cpu_bench(fn):
        fn()
        times = []
        t_end = time.perf_counter() + budget
        while len(times) < 3 or (time.perf_counter() < t_end and len(times) < 200):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return cpu_bench


def naive_attention(q, k, v, causal):
    """matmul -> mask -> softmax -> matmul in the input dtype; (B, H, L, E); causal top-left."""
    s = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        n_q, n_k = s.shape[-2:]
        s = s.masked_fill(~visible_mask(n_q, n_k, -1, 0, 0, q.device), float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)


def timing_impls(device):
    """(name, layout, context factory or None, f(q, k, v, causal))."""
    impls = [
        ("flashattn_ext", "bnhd", None, lambda q, k, v, c: flashattn_ext.flash_attn_func(q, k, v, causal=c)),
        ("torch sdpa", "bhnd", None, lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c)),
    ]
    if device.type == "cuda":
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            for name, be in (
                ("sdpa cudnn", "CUDNN_ATTENTION"),
                ("sdpa flash", "FLASH_ATTENTION"),
                ("sdpa mem-eff", "EFFICIENT_ATTENTION"),
            ):
                backend = getattr(SDPBackend, be, None)
                if backend is not None:
                    impls.append(
                        (
                            name,
                            "bhnd",
                            (lambda b=backend: sdpa_kernel(b)),
                            lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c),
                        )
                    )
        except ImportError:
            pass
    impls.append(("naive", "bhnd", None, naive_attention))
    return impls


def parse_shapes(s):
    shapes = []
    for part in s.replace(" ", ";").split(";"):
        part = part.strip()
        if not part:
            continue
        fields = [x.strip() for x in part.split(",") if x.strip()]
        causal = False
        if fields and fields[-1].lower() in ("c", "causal"):
            causal, fields = True, fields[:-1]
        if len(fields) != 4 or not all(x.isdigit() and int(x) > 0 for x in fields):
            raise argparse.ArgumentTypeError(
                f"shape {part!r}: expected b,h,n,d with positive integers, optionally followed by ',causal'"
            )
        shapes.append((*(int(x) for x in fields), causal))
    if not shapes:
        raise argparse.ArgumentTypeError("--shapes: no shape given")
    return shapes


def run_timings(device, dtype, shapes, quick, progress):
    import contextlib

    bench = make_timer(device, quick)
    impls = timing_impls(device)
    modes = ["fwd"] if quick and device.type == "cpu" else ["fwd", "fwd+bwd"]
    rows = []
    todo = [(s, m, impl) for s in shapes for m in modes for impl in impls]
    for i, ((b, h, n, d, causal), mode, (name, layout, ctx, f)) in enumerate(todo):
        progress.update(f"timing {i + 1}/{len(todo)}: {name} {mode} b{b} h{h} n{n} d{d}{' causal' if causal else ''}")
        shape = (b, n, h, d) if layout == "bnhd" else (b, h, n, d)
        flops = attention_flops(b, h, n, n, d, causal, mode)
        row = dict(impl=name, mode=mode, b=b, h=h, n=n, d=d, causal=causal, ms=None, tflops=None)
        try:
            q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=mode != "fwd") for _ in range(3))
            with ctx() if ctx else contextlib.nullcontext(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if mode == "fwd":
                    with torch.no_grad():
                        ms = bench(lambda: f(q, k, v, causal))
                else:
                    dout = torch.randn(shape, device=device, dtype=dtype)
                    ms = bench(lambda: torch.autograd.grad(f(q, k, v, causal), (q, k, v), dout))
            row["ms"], row["tflops"] = ms, flops / (ms * 1e-3) / 1e12
        except Exception as e:  # noqa: BLE001  (a backend refusing a shape is not fatal)
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            row["error"] = f"{type(e).__name__}: {msg}"[:200]
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
    progress.done()
    return rows


# ----------------------------------------------------------------------------- output


class Progress:
    """One status line on stderr, rewritten in place on a terminal (silent otherwise)."""

    def __init__(self, enabled=True):
        self.enabled = enabled and sys.stderr.isatty()
        self.width = 0

    def update(self, msg):
        if self.enabled:
            sys.stderr.write("\r" + msg[:110].ljust(self.width))
            self.width = min(max(self.width, len(msg)), 110)
            sys.stderr.flush()

    def done(self):
        if self.enabled and self.width:
            sys.stderr.write("\r" + " " * self.width + "\r")
            sys.stderr.flush()
            self.width = 0


def print_checks(results, families):
    labels = {f.key: f.label for f in families}
    family = None
    for r in results:
        if r.get("family") != family:
            family = r.get("family")
            print(f"  [{labels.get(family, family)}]")
        case = case_str((r["b"], r["seqlen_q"], r["seqlen_k"], r["heads_q"], r["heads_kv"], r["head_dim"], r["causal"]))
        if "cache_seqlens" in r:
            case += " lens " + ",".join(str(n) for n in r["cache_seqlens"])
        tag = "skip" if r.get("skipped") else "ok  " if r["ok"] else "FAIL"
        if r.get("skipped"):
            print(f"  {tag} {r['api']:<28} {r['dtype']:<9} {case:<32} {r['skipped']}")
            continue
        if "error" in r:
            print(f"  {tag} {r['api']:<28} {r['dtype']:<9} {case:<32} {r['error']}")
            continue
        worst = max(r["errors"].items(), key=lambda kv: kv[1]["err"] / kv[1]["bound"] if kv[1]["bound"] else 0)
        name, e = worst
        detail = (
            f"worst {name}: err {e['err']:.2e} <= bound {e['bound']:.2e}"
            if r["ok"]
            else ", ".join(
                f"{n}: " + (x["problem"] or f"err {x['err']:.2e} bound {x['bound']:.2e}")
                for n, x in r["errors"].items()
                if not x["ok"]
            )
        )
        print(f"  {tag} {r['api']:<28} {r['dtype']:<9} {case:<32} {detail}")


def print_timings(rows):
    print(f"  {'shape':<28} {'mode':<8} {'impl':<14} {'ms':>9} {'TFLOP/s':>9} {'ours speedup':>13}")
    ours = {
        (r["b"], r["h"], r["n"], r["d"], r["causal"], r["mode"]): r["ms"] for r in rows if r["impl"] == "flashattn_ext"
    }
    for r in rows:
        key = (r["b"], r["h"], r["n"], r["d"], r["causal"], r["mode"])
        shape = f"b{r['b']} h{r['h']} n{r['n']} d{r['d']}" + (" causal" if r["causal"] else "")
        if r["ms"] is None:
            print(
                f"  {shape:<28} {r['mode']:<8} {r['impl']:<14} {'-':>9} {'-':>9} {'-':>13}  {r.get('error', '')[:60]}"
            )
            continue
        tf = r["tflops"]
        tf_s = f"{tf:.1f}" if tf >= 1 else f"{tf:.3f}"
        o = ours.get(key)
        ratio = f"{r['ms'] / o:.2f}x" if o else "-"  # this row's time / ours: above 1, ours is faster
        print(f"  {shape:<28} {r['mode']:<8} {r['impl']:<14} {r['ms']:>9.3f} {tf_s:>9} {ratio:>13}")


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m flashattn_ext",
        description="Report the flashattn_ext build, check its kernels against the naive oracle on this machine, "
        "and time them next to torch's scaled_dot_product_attention and the naive path.",
        epilog="Exit status: 0 when every check passes, 1 when one fails, 2 on a usage error. "
        "'ours speedup' in the timing table is this row's time over ours (above 1: ours is faster).",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where to run (default auto: CUDA when torch sees a GPU and the build has CUDA kernels)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="dtype(s) to check and time, comma-separated among fp16, bf16, fp32, fp64 (default: check "
        "fp16,bf16 and time bf16 on CUDA; check fp32,bf16 and time fp32 on the CPU); timing uses the first",
    )
    p.add_argument(
        "--shapes",
        type=parse_shapes,
        default=None,
        metavar="B,H,N,D[,causal];...",
        help="timing shapes, ';'-separated, each b,h,n,d with an optional ',causal' (default on CUDA: "
        "'4,16,2048,128;8,12,1024,64,causal', on the CPU: '1,4,512,64;1,4,512,64,causal')",
    )
    p.add_argument("--json", metavar="PATH", help="also write the full report as JSON to PATH")
    p.add_argument("--quick", action="store_true", help="fewer cases, one small timing shape, shorter timings")
    p.add_argument("--no-bench", action="store_true", help="skip the timings (build, device and check only)")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    build = build_report()
    device, note = choose_device(args.device, build)
    dev = device_report(device)
    cuda = device.type == "cuda"

    if args.dtype:
        names = [DTYPE_ALIASES.get(x.strip().lower(), x.strip().lower()) for x in args.dtype.split(",") if x.strip()]
        bad = [x for x in names if x not in DTYPES]
        if bad or not names:
            print(
                f"flashattn_ext: --dtype: unknown {bad or args.dtype!r}; choose among {', '.join(DTYPES)}",
                file=sys.stderr,
            )
            return 2
        check_dtypes = [DTYPES[x] for x in names]
        time_dtype = check_dtypes[0]
    else:
        check_dtypes = [torch.float16, torch.bfloat16] if cuda else [torch.float32, torch.bfloat16]
        time_dtype = torch.bfloat16 if cuda else torch.float32
    if args.shapes:
        shapes = args.shapes
    elif args.quick:
        shapes = [(2, 16, 1024, 128, False)] if cuda else [(1, 4, 256, 64, False)]
    else:
        shapes = (
            [(4, 16, 2048, 128, False), (8, 12, 1024, 64, True)]
            if cuda
            else [(1, 4, 512, 64, False), (1, 4, 512, 64, True)]
        )

    print("flashattn_ext self-test")
    print(f"  build:  flashattn_ext {build['flashattn_ext']} ({build['location']})")
    print(
        f"          torch {build['torch']}, CUDA {build['torch_cuda'] or 'none'}"
        + (f", cuDNN {build['cudnn']}" if build.get("cudnn") else "")
    )
    if build.get("cuda_kernels") is None:
        print(f"          build_info {build['build_info']}")
    else:
        kern = (
            f"CUDA kernels for sm {build['archs'].replace(';', ', ')}" if build["cuda_kernels"] else "no CUDA kernels"
        )
        print(f"          {kern}; head dims {build['head_dims'] or '-'}")
    if cuda:
        print(f"  device: {dev['name']} ({dev['capability']}, {dev['sms']} SMs, {dev['memory_gib']} GiB)")
    else:
        print(f"  device: CPU {dev['name']}, {dev['threads']} threads")
    if note:
        print(f"  note:   {note}")
    sys.stdout.flush()

    progress = Progress(enabled=not args.no_progress)
    families, unchecked = plan_families(device, build, args.quick)
    checks = run_checks(device, check_dtypes, families, progress, build)
    n_skip = sum(1 for r in checks if r.get("skipped"))
    n_run = len(checks) - n_skip
    n_ok = sum(1 for r in checks if r["ok"])
    print(
        f"check: {n_ok}/{n_run} passed"
        + (f", {n_skip} skipped" if n_skip else "")
        + " (ours vs the float32/float64 oracle; bound = 2x the naive low-precision error for out, 3x for "
        "gradients, + a small floor: flashattn_ext.tolerance)"
    )
    print_checks(checks, families)
    family_ok = {f.key: all(r["ok"] for r in checks if r["family"] == f.key and not r.get("skipped")) for f in families}
    print("kernel families:")
    for f in families:
        print(f"  checked{'' if family_ok[f.key] else ' (FAILED)'}: {f.label}")
    for label, why in unchecked:
        print(f"  not checked: {label}: {why}")
    sys.stdout.flush()

    rows = []
    if not args.no_bench:
        rows = run_timings(device, time_dtype, shapes, args.quick, progress)
        print(
            f"timing ({str(time_dtype).replace('torch.', '')}, median; ours takes (b, n, h, d), "
            "the others (b, h, n, d)):"
        )
        print_timings(rows)
    ok = n_run > 0 and n_ok == n_run
    elapsed = time.time() - t0
    not_checked = "; not checked: " + ", ".join(label.split(" (")[0] for label, _ in unchecked) if unchecked else ""
    print(
        f"{'PASS' if ok else 'FAIL'}: {n_ok}/{n_run} checks passed on {device.type} in {elapsed:.1f} s "
        f"({len(families)} kernel famil{'y' if len(families) == 1 else 'ies'} checked{not_checked})"
    )
    if args.json:
        report = dict(
            build=build,
            device=dev,
            note=note,
            ok=ok,
            families=dict(
                checked=[dict(family=f.key, label=f.label, env=f.env, ok=family_ok[f.key]) for f in families],
                unchecked=[dict(family=label, why=why) for label, why in unchecked],
            ),
            checks=checks,
            timings=rows,
            elapsed_s=round(elapsed, 2),
        )
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
