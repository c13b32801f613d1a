#!/usr/bin/env python3
"""The inference benchmark: decoding against a KV cache, prefill against a cache,
and varlen against padded batches, flashattn_ext next to torch's SDPA backends.

    python benchmarks/bench_decode.py --json decode.json --md decode.md --budget-s 120   # H200
    python benchmarks/bench_decode.py --quick --json /tmp/d.json     # a few points (~30 s)
    python benchmarks/bench_decode.py --smoke --json /tmp/d.json     # tiny, on the CPU: the code path

Sections, in this order (the most important decode points first, so that --budget-s
cuts the least important; the JSON is rewritten after every point):

decode   q length 1, 32 query heads / 8 key-value heads, head dim 128, bf16, batch
         1/8/32/128, cache 1k..128k (batch 8/32 at 8k-32k first). Measured as the K/V
         bytes a decode step must read, per second: useful_tbs = 2 (K and V) * batch *
         cache_len * heads_kv * head_dim * 2 bytes / time. Implementations:
           ours          flashattn_ext.flash_attn_with_kvcache, contiguous (b, n, h_kv, d)
                         cache, cache_seqlens = cache_len (no append)
           ours_paged    the same with a paged cache: pages of 256 tokens in a random
                         order, an int32 block_table
           ours_sdpa     our SDPA drop-in exactly as transformers calls it at a decode
                         step: (b, h, 1, d) (a transposed view of the projection) against
                         the (b, h_kv, n, d) cache, no mask, scale given, enable_gqa=True;
                         it runs the split-KV decode kernel (the row's `route` says so)
           sdpa_cudnn / sdpa_flash / sdpa_default
                         torch SDPA (a backend forced, or none), (b, h, n, d) tensors with
                         enable_gqa=True; a backend that refuses GQA gets K/V expanded to
                         32 heads before the timed region (the row says kv_expanded: it
                         then reads 4x the bytes; `read_tbs` is what it actually read,
                         `useful_tbs` the K/V bytes a GQA kernel needs, as for the others)
           fa2_package   flash_attn.flash_attn_with_kvcache, when the flash-attn package imports
           copy          the ceiling: a device-to-device copy of the same K/V bytes;
                         `copy_tbs` counts bytes read + bytes written / time (a decode kernel
                         only reads, so useful_tbs / copy_tbs is the fraction of the copy's
                         bandwidth it reaches)
prefill  q length 512 appended to a cache of 8k (causal bottom-right: the chunk's queries
         are the last 512 positions), batch 4, same heads: ms and TFLOP/s
         (flashattn_ext.reference.attention_flops with the keys each query sees). The SDPA
         peers get torch.nn.attention.bias.causal_lower_right (their is_causal is top-left).
         `ours` is the routed call (q >= 64 on a contiguous cache: the TMA forward on sm90,
         csrc/cuda/kvcache_cuda.cpp); `ours_decode_kernel` the same call kept on the split-KV
         decoding kernel (FLASHATTN_KVCACHE_PREFILL_MIN_Q); `kernel` names what ran (profiler).
         `prefill_sweep`: both kernels at q 16 .. 256 (same cache, batch), to place the
         route's threshold.
append   (--append-rotary, alone) a decode step with the append and rotary
         (flash_attn_with_kvcache with k, v of one token and rotary_cos / rotary_sin, NeoX
         halves, causal: one kvcache_append_rotary launch, then the attention) against the
         plain step (no append, no rotary), batch 8, 8k cache (both attend 8192 keys),
         32/8 heads, d128, bf16, eager and as a replayed CUDA graph; `ratio` =
         append_rotary_ms / plain_ms (issue 25's bar: <= 1.2).
varlen   flash_attn_varlen_func vs flash_attn_func at the same token count (16k tokens,
         16 heads, d128, bf16, causal), forward + backward: `equal` has every sequence 2k
         long (the same FLOPs both ways: the cost of the varlen path itself); `mixed` has
         lengths 256..3840 against the same batch padded to the longest (useful TFLOP/s
         counts only the real sequences' FLOPs for both).

Timing: bench_gpu.make_timer (triton.testing.do_bench medians, L2 flushed; CUDA events
with the same protocol without triton; perf_counter medians on the CPU). A point whose
tensors would not fit in the free GPU memory is recorded as skipped. The last thing
printed is a short table.
"""

import argparse
import contextlib
import json
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_gpu  # noqa: E402  (also puts the checkout's flashattn_ext on the path)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_gpu import OURS, OURS_IMPORT_ERROR, Progress, Skip, _free, _short, attention_flops, make_timer  # noqa: E402

DECODE_IMPLS = ("ours", "ours_paged", "ours_sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_default", "fa2_package", "copy")
PREFILL_IMPLS = ("ours", "ours_decode_kernel", "ours_paged", "sdpa_cudnn", "sdpa_flash", "sdpa_default", "fa2_package")
# The query length from which flash_attn_with_kvcache leaves the decoding kernel (read on every call).
PREFILL_MIN_Q_ENV = "FLASHATTN_KVCACHE_PREFILL_MIN_Q"
PREFILL_SWEEP_Q = (16, 32, 64, 128, 256)
TORCH_BACKENDS = {"sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_flash": "FLASH_ATTENTION"}
PAGE = 256
# torch's SDPA has no bottom-right is_causal; its CausalBias (causal_lower_right) runs
# its own dispatch, which is what these peers time.
PREFILL_NOTE = {
    "sdpa_flash": "causal_lower_right: flash kernel (lower right)",
    "sdpa_default": "causal_lower_right: flash kernel when eligible, else mem-efficient, else a materialized mask",
    "sdpa_cudnn": "causal_lower_right with only cuDNN enabled: the mask is materialized and given to cuDNN",
}
GIB = 1024**3


def shapes(smoke):
    """The benchmark's sizes; --smoke scales everything down to a CPU run of seconds."""
    if smoke:
        return dict(
            heads_q=8,
            heads_kv=2,
            d=32,
            dtype=torch.float32,
            page=16,
            batches=(1, 2),
            caches=(64, 128),
            first=((2, 128),),
            prefill=dict(batch=2, q=16, cache=128),
            prefill_sweep_q=(8, 16),
            varlen=dict(tokens=256, heads=2, d=32, equal_len=64, mixed=(16, 112, 48, 80)),
        )
    return dict(
        heads_q=32,
        heads_kv=8,
        d=128,
        dtype=torch.bfloat16,
        page=PAGE,
        batches=(1, 8, 32, 128),
        caches=tuple(1024 * 2**i for i in range(8)),  # 1k .. 128k
        first=tuple((b, n) for n in (8192, 16384, 32768) for b in (8, 32)),
        prefill=dict(batch=4, q=512, cache=8192),
        prefill_sweep_q=PREFILL_SWEEP_Q,
        # 16 sequences of 256..3840 tokens, 16384 in all (a fixed list: runs compare).
        varlen=dict(
            tokens=16384,
            heads=16,
            d=128,
            equal_len=2048,
            mixed=(256, 3840, 512, 1792, 768, 1280, 2304, 1024, 512, 1536, 256, 768, 512, 640, 256, 128),
        ),
    )


def decode_points(cfg, quick):
    """(batch, cache_len) in the order they run: the important ones first."""
    if quick:
        return list(cfg["first"])[:4] if len(cfg["first"]) > 1 else list(cfg["first"])
    rest = [(b, n) for b in cfg["batches"] for n in cfg["caches"] if (b, n) not in cfg["first"]]
    # Batch 8/32 at the other cache lengths next, then batch 1, then 128 (the largest).
    rank = {8: 0, 32: 0, 1: 1, 128: 2}
    rest.sort(key=lambda p: (rank.get(p[0], 3), p[1]))
    return list(cfg["first"]) + rest


# ----------------------------------------------------------------------------- helpers


def _load_fa2():
    try:
        import flash_attn

        return flash_attn, None
    except Exception as e:  # noqa: BLE001
        return None, f"import flash_attn failed: {type(e).__name__}: {str(e)[:200]}"


def _fits(device, nbytes, what):
    """Raises Skip when nbytes (plus a margin) would not fit in the free device memory."""
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if nbytes > 0.9 * free:
        raise Skip(f"{what} needs {nbytes / GIB:.1f} GiB, {free / GIB:.1f} GiB free")


def _rand(shape, dtype, device, gen):
    return torch.randn(shape, dtype=dtype, device=device, generator=gen)


def _sdpa_ctx(impl):
    if impl in TORCH_BACKENDS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, TORCH_BACKENDS[impl]))
    return contextlib.nullcontext()


def _default_backend(q, k, v, enable_gqa):
    """The backend torch's SDPA picks when none is forced (bench_gpu's helper, with enable_gqa)."""
    try:
        from torch.nn.attention import SDPBackend

        choice = torch._fused_sdp_choice(q, k, v, None, 0.0, False, scale=None, enable_gqa=enable_gqa)
        return SDPBackend(choice).name.lower()
    except Exception:  # noqa: BLE001  (a private helper: record nothing rather than fail)
        return None


def _paged(cache, page, gen):
    """(b, n, h, d) -> (b * n / page, page, h, d) pages in a random order, and the block table."""
    b, n, h, d = cache.shape
    per_seq = n // page
    perm = torch.randperm(b * per_seq, generator=torch.Generator().manual_seed(int(gen.initial_seed())))
    pages = torch.empty((b * per_seq, page, h, d), dtype=cache.dtype, device=cache.device)
    pages[perm.to(cache.device)] = cache.reshape(b * per_seq, page, h, d)
    table = perm.view(b, per_seq).to(device=cache.device, dtype=torch.int32)
    return pages, table


def _sdpa_call(impl, q, k, v, mask, heads_q):
    """Sets up one SDPA peer: (fn, info). GQA first; a backend that refuses it gets K/V
    expanded to heads_q heads (outside the timed region)."""
    info = {}
    with warnings.catch_warnings(), _sdpa_ctx(impl):
        warnings.simplefilter("ignore")
        try:
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            info["kv_expanded"] = False
            if impl == "sdpa_default":
                info["backend"] = _default_backend(q, k, v, True)
            return (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)), info
        except RuntimeError as e:
            info["gqa_refused"] = _short(e)
        rep = heads_q // k.shape[1]
        _fits(q.device, 2 * k.numel() * k.element_size() * rep, "K/V expanded to the query heads")
        ke = k.repeat_interleave(rep, dim=1)
        ve = v.repeat_interleave(rep, dim=1)
        F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask)  # a refusal surfaces here
        info["kv_expanded"] = True
        if impl == "sdpa_default":
            info["backend"] = _default_backend(q, ke, ve, False)
        return (lambda: F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask)), info


def _kvcache_impl(impl):
    """flash_attn_with_kvcache of the flash-attn package (fa2_package) or ours (ours, ours_paged)."""
    if impl == "fa2_package":
        fa2, why = _load_fa2()
        if fa2 is None:
            raise Skip(why)
        return fa2.flash_attn_with_kvcache
    if OURS is None:
        raise RuntimeError(OURS_IMPORT_ERROR)
    return OURS.flash_attn_with_kvcache


def _kvcache_call(kvcache, impl, cfg, batch, n_q, n_cache, device, gen):
    """The call to time: n_q new queries per row against a full cache of n_cache random keys
    (paged for ours_paged), causal."""
    hq, hk, d, dtype = cfg["heads_q"], cfg["heads_kv"], cfg["d"], cfg["dtype"]
    q = _rand((batch, n_q, hq, d), dtype, device, gen)
    k, v = _rand((batch, n_cache, hk, d), dtype, device, gen), _rand((batch, n_cache, hk, d), dtype, device, gen)
    seqlens = torch.full((batch,), n_cache, dtype=torch.int32, device=device)
    extra = {}
    if impl == "ours_paged":
        k, table = _paged(k, cfg["page"], gen)
        v, _ = _paged(v, cfg["page"], gen)  # the same seed: the same page order as k
        extra["block_table"] = table
    return lambda: kvcache(q, k, v, cache_seqlens=seqlens, causal=True, **extra)


def _cuda_kernel_names(fn):
    """The CUDA kernels fn() ran (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _sdpa_route(fn, device):
    """Runs fn once and names the kernels it reached: "decode" (the split-KV
    decoding kernel: the forward's own decode route, csrc/cuda/decode_launch.h),
    "main" (the forward kernels) or "torch fallback" (none of ours). On the CPU
    there is no route: "main"."""
    if device.type != "cuda":
        fn()
        return "main"
    names = _cuda_kernel_names(fn)
    if any("flash_decode_kernel" in n for n in names):
        return "decode"
    return "main" if any("flashattn" in n for n in names) else "torch fallback"


def _record(row, e):
    if isinstance(e, Skip):
        row["skipped"] = str(e)
    elif isinstance(e, torch.cuda.OutOfMemoryError):
        row["error"] = "OOM"
    elif "No available kernel" in str(e) or "No viable backend" in str(e):
        row["skipped"] = "backend refused: " + _short(e)
    else:
        row["error"] = _short(e)


# ----------------------------------------------------------------------------- decode


def decode_case(impl, batch, n, cfg, device, bench, gen):
    """Times one implementation at one decode point. Returns a row; never raises."""
    hq, hk, d, dtype = cfg["heads_q"], cfg["heads_kv"], cfg["d"], cfg["dtype"]
    elt = torch.finfo(dtype).bits // 8
    kv_bytes = 2 * batch * n * hk * d * elt
    row = dict(impl=impl, batch=batch, cache_len=n, kv_bytes=kv_bytes, ms=None, useful_tbs=None)
    fn = None
    try:
        if impl in ("sdpa_cudnn", "fa2_package") and device.type != "cuda":
            raise Skip("needs CUDA")
        if impl == "copy":
            _fits(device, 2 * kv_bytes, "the copy")
            src = torch.empty(kv_bytes, dtype=torch.uint8, device=device)
            src.random_(generator=gen)
            dst = torch.empty_like(src)
            fn = lambda: dst.copy_(src)  # noqa: E731
            ms = bench(fn)
            row.update(ms=ms, copy_tbs=2 * kv_bytes / (ms * 1e-3) / 1e12, note="read + written bytes / time")
            return row
        if impl in ("ours", "ours_paged", "fa2_package"):
            kvcache = _kvcache_impl(impl)
            _fits(device, kv_bytes * (2 if impl == "ours_paged" else 1), "the cache")
            fn = _kvcache_call(kvcache, impl, cfg, batch, 1, n, device, gen)
            if impl == "ours_paged":
                row["page"] = cfg["page"]
            fn()
        elif impl == "ours_sdpa":
            # Our drop-in exactly as transformers' sdpa_attention_forward calls it at a
            # decode step with a dynamic cache and no padding: query (B, H, 1, D) a
            # transposed view of the (B, 1, H, D) projection, key/value the contiguous
            # (B, H_kv, n, D) cache, attn_mask=None, dropout_p=0.0, scale=module.scaling,
            # is_causal=False (q_len 1), enable_gqa=True. The forward runs it on the
            # split-KV decoding kernel (decode_route); `route` records that it did.
            if OURS is None:
                raise RuntimeError(OURS_IMPORT_ERROR)
            _fits(device, kv_bytes, "the cache")
            q = _rand((batch, 1, hq, d), dtype, device, gen).transpose(1, 2)
            k, v = _rand((batch, hk, n, d), dtype, device, gen), _rand((batch, hk, n, d), dtype, device, gen)
            scaling = d**-0.5

            def fn():
                return OURS.scaled_dot_product_attention(
                    q, k, v, attn_mask=None, dropout_p=0.0, scale=scaling, is_causal=False, enable_gqa=True
                )

            row["route"] = _sdpa_route(fn, device)
        else:
            _fits(device, kv_bytes, "the cache")
            q = _rand((batch, hq, 1, d), dtype, device, gen)
            k, v = _rand((batch, hk, n, d), dtype, device, gen), _rand((batch, hk, n, d), dtype, device, gen)
            fn, info = _sdpa_call(impl, q, k, v, None, hq)
            row.update(info)
            q = k = v = None
        with _sdpa_ctx(impl) if impl.startswith("sdpa") else contextlib.nullcontext():
            ms = bench(fn)
        row["ms"] = ms
        row["useful_tbs"] = kv_bytes / (ms * 1e-3) / 1e12
        if row.get("kv_expanded"):
            row["read_tbs"] = row["useful_tbs"] * (hq / hk)
    except Exception as e:  # noqa: BLE001  (recorded, never fatal)
        _record(row, e)
    finally:
        fn = None  # noqa: F841
        _free(device)
    return row


# ----------------------------------------------------------------------------- prefill


@contextlib.contextmanager
def _prefill_min_q(value):
    """FLASHATTN_KVCACHE_PREFILL_MIN_Q = value inside (None: as it is)."""
    old = os.environ.get(PREFILL_MIN_Q_ENV)
    if value is not None:
        os.environ[PREFILL_MIN_Q_ENV] = str(value)
    try:
        yield
    finally:
        if value is not None:
            if old is None:
                os.environ.pop(PREFILL_MIN_Q_ENV, None)
            else:
                os.environ[PREFILL_MIN_Q_ENV] = old


def _kernel_of(fn, device):
    """Which of our kernels fn() ran (torch.profiler): "tma_forward", "decode" or the names."""
    if device.type != "cuda":
        return None
    names = _cuda_kernel_names(fn)
    if any("flash_fwd_sm90_ws_kernel" in n for n in names):
        return "tma_forward"
    if any("flash_decode_kernel" in n for n in names):
        return "decode"
    return ",".join(sorted({n.split("(")[0][:60] for n in names}))[:200]


def prefill_case(impl, cfg, device, bench, gen, q_len=None):
    p = cfg["prefill"]
    b, nq, nk = p["batch"], (q_len or p["q"]), p["cache"]
    hq, hk, d, dtype = cfg["heads_q"], cfg["heads_kv"], cfg["d"], cfg["dtype"]
    # Query i (of nq, the last positions) sees keys 0 .. nk - nq + i.
    flops = 4.0 * b * hq * d * sum(nk - nq + i + 1 for i in range(nq))
    row = dict(impl=impl, batch=b, q_len=nq, cache_len=nk, causal="bottom-right", ms=None, tflops=None)
    fn = None
    # ours_decode_kernel: the decoding kernel at any length; ours in the sweep: the route at any length.
    min_q = 1 << 30 if impl == "ours_decode_kernel" else (1 if q_len is not None and impl == "ours" else None)
    try:
        if impl in ("sdpa_cudnn", "fa2_package") and device.type != "cuda":
            raise Skip("needs CUDA")
        if impl in ("ours", "ours_decode_kernel", "ours_paged", "fa2_package"):
            kv_impl = "ours" if impl == "ours_decode_kernel" else impl
            call = _kvcache_call(_kvcache_impl(kv_impl), kv_impl, cfg, b, nq, nk, device, gen)

            def fn(call=call, min_q=min_q):
                with _prefill_min_q(min_q):
                    return call()

            fn()
            if impl != "fa2_package":
                row["kernel"] = _kernel_of(fn, device)
        else:
            from torch.nn.attention.bias import causal_lower_right

            q = _rand((b, hq, nq, d), dtype, device, gen)
            k, v = _rand((b, hk, nk, d), dtype, device, gen), _rand((b, hk, nk, d), dtype, device, gen)
            fn, info = _sdpa_call(impl, q, k, v, causal_lower_right(nq, nk), hq)
            info.pop("backend", None)  # chosen without the mask: not what the CausalBias dispatch runs
            row.update(info, note=PREFILL_NOTE[impl])
        with _sdpa_ctx(impl) if impl.startswith("sdpa") else contextlib.nullcontext():
            ms = bench(fn)
        row.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
    except Exception as e:  # noqa: BLE001
        _record(row, e)
    finally:
        fn = None  # noqa: F841
        _free(device)
    return row


# ----------------------------------------------------------------------------- varlen


def varlen_cases(cfg, device, bench, gen):
    """flash_attn_varlen_func vs flash_attn_func at the same token count, fwd + bwd."""
    v = cfg["varlen"]
    h, d, dtype = v["heads"], v["d"], cfg["dtype"]
    rows = []
    equal = [v["equal_len"]] * (v["tokens"] // v["equal_len"])
    for layout, lens in (("equal", equal), ("mixed", list(v["mixed"]))):
        assert sum(lens) == v["tokens"], (layout, lens)
        useful = sum(attention_flops(1, h, n, n, d, True, "fwd+bwd") for n in lens)
        for impl in ("varlen", "padded"):
            row = dict(section=layout, impl=impl, seqlens=lens, tokens=sum(lens), heads=h, d=d, causal=True)
            row.update(mode="fwd+bwd", ms=None, useful_tflops=None)
            fn = None
            try:
                if OURS is None:
                    raise RuntimeError(OURS_IMPORT_ERROR)
                if impl == "varlen":
                    total = sum(lens)
                    q, k, vv = (_rand((total, h, d), dtype, device, gen).requires_grad_() for _ in range(3))
                    cu = torch.tensor([0] + list(_cumsum(lens)), dtype=torch.int32, device=device)
                    m = max(lens)

                    def f(q=q, k=k, vv=vv, cu=cu, m=m):
                        return OURS.flash_attn_varlen_func(q, k, vv, cu, cu, m, m, causal=True)

                else:
                    n = max(lens)
                    row["padded_shape"] = [len(lens), n, h, d]
                    row["computed_tflop"] = attention_flops(len(lens), h, n, n, d, True, "fwd+bwd") / 1e12
                    q, k, vv = (_rand((len(lens), n, h, d), dtype, device, gen).requires_grad_() for _ in range(3))

                    def f(q=q, k=k, vv=vv):
                        return OURS.flash_attn_func(q, k, vv, causal=True)

                dout = torch.randn_like(q)
                fn = lambda: torch.autograd.grad(f(), (q, k, vv), dout)  # noqa: E731
                fn()
                ms = bench(fn)
                row.update(ms=ms, useful_tflops=useful / (ms * 1e-3) / 1e12)
            except Exception as e:  # noqa: BLE001
                _record(row, e)
            finally:
                fn = q = k = vv = None  # noqa: F841
                _free(device)
            rows.append(row)
    return rows


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


# ----------------------------------------------------------------------------- report


def _fmt(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def _tb(x):
    return "-" if x is None else f"{x:.3g}"


def _len_label(n):
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _cell(row, key):
    if row is None:
        return "-"
    if row.get(key) is not None:
        return _tb(row[key]) + ("*" if row.get("kv_expanded") else "")
    return "skip" if row.get("skipped") else ("err" if row.get("error") else "-")


def markdown_report(data):
    out = [
        f"Measured by benchmarks/bench_decode.py on {data.get('gpu') or 'CPU'}, torch {data['torch']}, "
        f"{data['date']}; {data['timer']}.",
        "",
    ]
    c = data["config"]
    impls = [i for i in DECODE_IMPLS if i != "copy" and any(r["impl"] == i for r in data["decode"])]
    out += [
        f"## Decode: useful K/V TB/s (q len 1, {c['heads_q']} q heads / {c['heads_kv']} kv heads, "
        f"d{c['d']}, {c['dtype']}); copy: read + written TB/s",
        "",
        "`*`: the backend refused GQA, K/V expanded to the query heads before timing (it reads 4x the bytes; "
        "the figure counts the useful bytes only).",
        "",
        "| batch | cache | " + " | ".join(impls) + " | copy | ours / copy |",
        "|---|---|" + "---|" * (len(impls) + 2),
    ]
    by = {(r["impl"], r["batch"], r["cache_len"]): r for r in data["decode"]}
    points = sorted({(r["batch"], r["cache_len"]) for r in data["decode"]})
    for b, n in points:
        cells = [_cell(by.get((i, b, n)), "useful_tbs") for i in impls]
        cp = by.get(("copy", b, n))
        ours = by.get(("ours", b, n))
        frac = (
            ours["useful_tbs"] / cp["copy_tbs"]
            if ours and cp and ours.get("useful_tbs") and cp.get("copy_tbs")
            else None
        )
        out.append(f"| {b} | {_len_label(n)} | " + " | ".join(cells) + f" | {_cell(cp, 'copy_tbs')} | {_fmt(frac)} |")
    if data.get("prefill"):
        p = data["prefill"][0]
        out += [
            "",
            f"## Prefill: q {p['q_len']} appended to a {p['cache_len']} cache, batch {p['batch']}, causal bottom-right",
            "",
            "| impl | ms | TFLOP/s | note |",
            "|---|---|---|---|",
        ]
        for r in data["prefill"]:
            note = r.get("skipped") or r.get("error") or ("K/V expanded; " if r.get("kv_expanded") else "")
            note = (note + (r.get("note") or "") + (f"kernel: {r['kernel']}" if r.get("kernel") else "")).strip()
            out.append(f"| {r['impl']} | {_fmt(r.get('ms'), 3)} | {_fmt(r.get('tflops'), 1)} | {note} |")
    if data.get("prefill_sweep"):
        out += [
            "",
            "## Prefill by query length (the route's threshold)",
            "",
            "| q | impl | ms | kernel |",
            "|---|---|---|---|",
        ]
        for r in data["prefill_sweep"]:
            out.append(
                f"| {r['q_len']} | {r['impl']} | {_fmt(r.get('ms'), 3)} | {r.get('kernel') or r.get('error') or ''} |"
            )
    if data.get("varlen"):
        out += [
            "",
            "## Varlen vs padded (flashattn_ext, fwd + bwd, causal; useful TFLOP/s = the real sequences' FLOPs / time)",
            "",
            "| lengths | impl | ms | useful TFLOP/s | note |",
            "|---|---|---|---|---|",
        ]
        for r in data["varlen"]:
            note = (
                r.get("skipped")
                or r.get("error")
                or (f"padded to {r['padded_shape']}" if r.get("padded_shape") else "")
            )
            out.append(
                f"| {r['section']} | {r['impl']} | {_fmt(r.get('ms'), 3)} | {_fmt(r.get('useful_tflops'), 1)} | {note} |"
            )
    if data.get("budget_exceeded"):
        out += ["", f"Time budget exceeded: {data['budget_exceeded']['points_not_run']} decode points not run."]
    return "\n".join(out) + "\n"


def text_summary(data):
    lines = [
        "batch cache  "
        + "  ".join(f"{i:>12}" for i in ("ours", "ours_paged", "ours_sdpa", "sdpa_cudnn", "sdpa_flash", "copy"))
    ]
    by = {(r["impl"], r["batch"], r["cache_len"]): r for r in data["decode"]}
    for b, n in sorted({(r["batch"], r["cache_len"]) for r in data["decode"]}):
        cells = []
        for i in ("ours", "ours_paged", "ours_sdpa", "sdpa_cudnn", "sdpa_flash", "copy"):
            cells.append(f"{_cell(by.get((i, b, n)), 'copy_tbs' if i == 'copy' else 'useful_tbs'):>12}")
        lines.append(f"{b:>5} {_len_label(n):>5}  " + "  ".join(cells))
    lines.append("(decode: useful K/V TB/s; copy: read + written TB/s)")
    for r in data.get("prefill", []):
        lines.append(
            f"prefill {r['impl']:>18}: {_fmt(r.get('ms'), 3)} ms {_fmt(r.get('tflops'), 1)} TFLOP/s"
            + (f" ({r['kernel']})" if r.get("kernel") else "")
        )
    for r in data.get("prefill_sweep", []):
        lines.append(
            f"prefill q {r['q_len']:>4} {r['impl']:>18}: {_fmt(r.get('ms'), 3)} ms ({r.get('kernel') or r.get('error') or '-'})"
        )
    for r in data.get("varlen", []):
        lines.append(
            f"varlen {r['section']:>5} {r['impl']:>7}: {_fmt(r.get('ms'), 3)} ms {_fmt(r.get('useful_tflops'), 1)} useful TFLOP/s"
        )
    return "\n".join(lines)


def _graphed(fn):
    """fn captured in a CUDA graph (warmed on a side stream first): its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def append_rotary_cases(cfg, device, bench, gen, smoke):
    """The decode step with append + rotary against the plain one (module docstring)."""
    batch, n = (2, 128) if smoke else (8, 8192)
    hq, hkv, d, dt = cfg["heads_q"], cfg["heads_kv"], cfg["d"], cfg["dtype"]
    q = _rand((batch, 1, hq, d), dt, device, gen)
    k, v = _rand((batch, 1, hkv, d), dt, device, gen), _rand((batch, 1, hkv, d), dt, device, gen)
    kc, vc = _rand((batch, n, hkv, d), dt, device, gen), _rand((batch, n, hkv, d), dt, device, gen)
    angles = torch.arange(n, dtype=torch.float64)[:, None] / 10000.0 ** (torch.arange(0, d, 2) / d)
    cos, sin = angles.cos().to(dt).to(device), angles.sin().to(dt).to(device)
    full = torch.full((batch,), n, dtype=torch.int32, device=device)
    before = full - 1  # the appended token is key n - 1: both steps attend n keys
    kvcache = OURS.flash_attn_with_kvcache

    def plain():
        return kvcache(q, kc, vc, cache_seqlens=full, causal=True)

    def appended():
        return kvcache(q, kc, vc, k, v, cos, sin, before, causal=True, rotary_interleaved=False)

    rows = []
    for mode in ("eager", "graph") if device.type == "cuda" else ("eager",):
        fns = (plain, appended) if mode == "eager" else (_graphed(plain), _graphed(appended))
        plain_ms, append_ms = (bench(f) for f in fns)
        rows.append(
            dict(
                mode=mode,
                batch=batch,
                cache_len=n,
                heads_q=hq,
                heads_kv=hkv,
                d=d,
                dtype=str(dt).replace("torch.", ""),
                plain_ms=round(plain_ms, 5),
                append_rotary_ms=round(append_ms, 5),
                ratio=round(append_ms / plain_ms, 3),
            )
        )
    return rows


# ----------------------------------------------------------------------------- driver


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Decode / prefill / varlen benchmark (see the module docstring)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON here (rewritten after each point)")
    p.add_argument("--md", metavar="PATH", help="write a markdown report here")
    p.add_argument(
        "--budget-s", type=float, default=120.0, help="stop adding decode points after this many seconds (0: no limit)"
    )
    p.add_argument("--quick", action="store_true", help="the first decode points only, prefill and varlen")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: proves the script runs end to end")
    p.add_argument("--impls", default=",".join(DECODE_IMPLS), help="decode/prefill implementations (default all)")
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument("--no-varlen", action="store_true")
    p.add_argument(
        "--append-rotary",
        action="store_true",
        help="only the decode step with append + rotary against the plain step (eager and CUDA graph)",
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    if args.smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        raise SystemExit("bench_decode.py: no CUDA device; --smoke runs the tiny CPU version")
    cfg = shapes(args.smoke)
    impls = [x.strip() for x in args.impls.split(",") if x.strip()]
    bad = [x for x in impls if x not in DECODE_IMPLS]
    if bad:
        raise SystemExit(f"--impls: unknown {bad}; choose from {', '.join(DECODE_IMPLS)}")
    warmup, rep = (2.0, 5.0) if args.smoke else ((10.0, 40.0) if args.quick else (25.0, 100.0))
    bench, timer_desc = make_timer(device, warmup, rep)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)

    data = bench_gpu.environment(device, timer_desc)
    data.pop("layouts", None)
    data.pop("flops", None)
    data.update(
        config=dict(
            heads_q=cfg["heads_q"],
            heads_kv=cfg["heads_kv"],
            d=cfg["d"],
            dtype=str(cfg["dtype"]).replace("torch.", ""),
            q_len=1,
            page=cfg["page"],
            smoke=args.smoke,
            quick=args.quick,
            budget_s=args.budget_s,
        ),
        conventions=dict(
            useful_tbs="2 * batch * cache_len * heads_kv * head_dim * bytes per element / time (the K/V a GQA decode step must read)",
            read_tbs="rows with kv_expanded: the bytes actually read (K/V expanded to the query heads: 4x)",
            copy_tbs="device-to-device copy of the same K/V bytes: (bytes read + bytes written) / time",
            prefill_flops="4 * b * h_q * d * (keys seen, summed over the queries): causal bottom-right",
            varlen_useful_tflops="flashattn_ext.reference.attention_flops(fwd+bwd, causal) summed over the real sequences / time",
        ),
        decode=[],
        prefill=[],
        prefill_sweep=[],
        varlen=[],
    )
    fa2, why = _load_fa2()
    if fa2 is None:
        data["skipped_impls"] = {"fa2_package": why}
        impls = [i for i in impls if i != "fa2_package"]

    def save():
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json + ".tmp", "w") as fh:
                json.dump(data, fh, indent=1)
            os.replace(args.json + ".tmp", args.json)

    progress = Progress()
    print(f"bench_decode: {data.get('gpu') or 'CPU'}, torch {data['torch']}", file=sys.stderr)
    if args.append_rotary:
        progress.update("decode with append + rotary")
        data["append_rotary"] = append_rotary_cases(cfg, device, bench, gen, args.smoke)
        progress.done()
        save()
        for r in data["append_rotary"]:
            print(
                f"append+rotary {r['mode']:5s} b{r['batch']} cache {r['cache_len']}: plain {r['plain_ms']:.4f} ms, "
                f"with append + rotary {r['append_rotary_ms']:.4f} ms, ratio {r['ratio']:.3f} (bar 1.2)"
            )
        return 0
    points = decode_points(cfg, args.quick)
    # The three most important decode points, then prefill and varlen (cheap), then the rest.
    head, tail = points[:3], points[3:]
    for b, n in head:
        progress.update(f"decode b{b} cache {n}")
        data["decode"] += [decode_case(i, b, n, cfg, device, bench, gen) for i in impls]
        save()
    if not args.no_prefill:
        progress.update("prefill")
        # (ours_decode_kernel comes with ours)
        data["prefill"] = [
            prefill_case(i, cfg, device, bench, gen)
            for i in PREFILL_IMPLS
            if i in impls or (i == "ours_decode_kernel" and "ours" in impls)
        ]
        save()
        if "ours" in impls:
            progress.update("prefill sweep")
            data["prefill_sweep"] = [
                prefill_case(i, cfg, device, bench, gen, q_len=n)
                for n in cfg["prefill_sweep_q"]
                for i in ("ours", "ours_decode_kernel")
            ]
            save()
    if not args.no_varlen:
        progress.update("varlen vs padded")
        data["varlen"] = varlen_cases(cfg, device, bench, gen)
        save()
    for j, (b, n) in enumerate(tail):
        elapsed = time.time() - t0
        if args.budget_s and elapsed > args.budget_s:
            left = tail[j:]
            data["budget_exceeded"] = dict(
                after_s=round(elapsed, 1),
                points_not_run=len(left),
                not_run=[dict(batch=x, cache_len=y) for x, y in left],
            )
            break
        progress.update(f"decode b{b} cache {n} [{j + 4}/{len(points)}]")
        data["decode"] += [decode_case(i, b, n, cfg, device, bench, gen) for i in impls]
        save()
    progress.done()
    data["elapsed_s"] = round(time.time() - t0, 1)
    save()
    if args.md:
        os.makedirs(os.path.dirname(os.path.abspath(args.md)), exist_ok=True)
        with open(args.md, "w") as fh:
            fh.write(markdown_report(data))
    sys.stderr.flush()
    print(text_summary(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
