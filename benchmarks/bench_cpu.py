"""CPU timing of flashattn_ext against torch's own CPU attention.

    PYTHONPATH=. python benchmarks/bench_cpu.py [--json out.json] [--reps 7] [--quick] [--threads 1,4,16]

Three implementations, each fed its natural layout and timed in the same run
so that the ratios survive a noisy (shared) machine:
  ours   flashattn_ext fwd op, q/k/v (batch, seqlen, heads, head_dim)
  sdpa   torch.nn.functional.scaled_dot_product_attention, (batch, heads, seqlen, head_dim);
         on the CPU torch picks its blocked flash kernel for these inputs
  naive  matmul, softmax, matmul in plain PyTorch (materializes the N x N scores)

Modes: fwd (forward only, no autograd) and fwd+bwd (forward and backward of a
random output gradient); decode (a decoding step: one query against a KV
cache of n keys, --decode-heads query / kv heads (default 32/8, GQA),
--decode-dim, batches --decode-batches, as transformers calls SDPA at a
decode step): ours is flash_attn_with_kvcache on the (b, n, h_kv, d) cache,
ours_paged the same on the cache in pages of --decode-page keys in a random
order (block_table; decode mode only), sdpa torch's SDPA on (b, h_kv, n, d)
caches with enable_gqa=True, naive the three steps on K/V expanded to the
query heads. Figures are medians over
--reps repetitions after warm-up, per call: a repetition times enough calls in
a row to last about --min-rep-ms (the same count for every implementation,
from the slowest one's call; the JSON's `calls`), so that a one-millisecond
decoding step is not one descheduled thread away from a doubled median; the
implementations take turns within each repetition; torch's default thread
count is used, or each of --threads in turn (torch.set_num_threads, for
every implementation). --knob NAME=VALUE adds
ours_knob: ours with that test switch of csrc/cpu/cpu_knobs.h set during its
calls (flashattn_ext::_cpu_test_knob), for an A/B in one run (ours / ours_knob
in the ratio columns).

Every JSON row also names the machine: the CPU model and its ISA flags that
matter here (avx2, avx512f, avx512_bf16, avx512_fp16, amx_bf16, amx_fp16,
amx_tile: /proc/cpuinfo), the thread count, and what our CPU kernels run
bfloat16 / float16 products on (flashattn_ext::cpu_runtime_info: brgemm on
the matrix units, or our float32 path); and the code measured: the git
commit where there is one ("-dirty" with local changes), a hash of the CPU
kernels' sources (csrc/cpu, the same with or without git) and whether the
extension was built with its CUDA kernels. --markdown writes the table, ours
over each peer, ratios above 1 in bold.
"""

import argparse
import glob
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import flashattn_ext
from flashattn_ext.reference import visible_mask

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")


def cpu_description():
    """The CPU model and the ISA flags of ISA_FLAGS it has (Linux /proc/cpuinfo;
    elsewhere the platform's processor string and no flags)."""
    model, flags = None, None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:  # the first processor's lines
                key, _, value = (x.strip() for x in line.partition(":"))
                if key == "model name" and model is None:
                    model = value
                elif key in ("flags", "Features") and flags is None:
                    flags = set(value.split())
    except OSError:
        pass
    model, flags = model or platform.processor() or platform.machine(), flags or set()
    return {"cpu": model, "isa": [f for f in ISA_FLAGS if f in flags], "cores": os.cpu_count()}


def ours_runtime():
    """flashattn_ext::cpu_runtime_info: the bf16 / fp16 product paths, the fused softmax step and how the
    backward reads its float32 tiles (absent on an older build)."""
    try:
        raw = torch.ops.flashattn_ext.cpu_runtime_info(False)
    except (AttributeError, RuntimeError):
        return {}
    info = dict(kv.split("=", 1) for kv in raw.split(";"))
    return {k: v for k, v in info.items() if k.endswith("_gemm") or k in ("fused_softmax", "bwd_tiles")}


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def code_description():
    """The code measured: git commit (None without git), csrc/cpu's hash, the build."""
    commit = None
    try:
        commit = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout.strip()
        commit += "-dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        pass
    digest = hashlib.sha1()
    for path in sorted(glob.glob(os.path.join(ROOT, "csrc", "cpu", "*"))):
        with open(path, "rb") as f:
            digest.update(os.path.basename(path).encode() + b"\0" + f.read())
    return {
        "commit": commit,
        "cpu_src": digest.hexdigest()[:12],
        "cuda_build": bool(flashattn_ext.build_info().get("cuda")),
    }


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


# --dropout P: every implementation applies dropout with probability P to the
# probabilities (each call drawing its own mask, as training does).
DROPOUT = 0.0


def ours_fn(q, k, v, causal):
    # q, k, v: (b, n, h, d). Causal, top-left aligned like SDPA's is_causal (equal lengths here anyway).
    if DROPOUT > 0:
        return flashattn_ext.flash_attn_func(q, k, v, dropout_p=DROPOUT, causal=causal)
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, _ = flashattn_ext._ops.fwd(q, k, v, scale, -1, 0 if causal else -1, False, False)
    return out


def sdpa_fn(q, k, v, causal):
    # q, k, v: (b, h, n, d)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=DROPOUT)


def naive_fn(q, k, v, causal):
    # q, k, v: (b, h, n, d)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        n_q, n_k = scores.shape[-2:]
        scores = scores.masked_fill(~visible_mask(n_q, n_k, -1, 0, 0), float("-inf"))
    return F.dropout(torch.softmax(scores, dim=-1), DROPOUT) @ v


IMPLS = {
    "ours": (ours_fn, "bnhd"),
    "ours_knob": (ours_fn, "bnhd"),
    "sdpa": (sdpa_fn, "bhnd"),
    "naive": (naive_fn, "bhnd"),
}

# --knob NAME=VALUE: the test switch ours_knob's calls run with.
KNOB = None


def with_knob(step):
    """step run with KNOB's switch set, restored after each call."""
    name, value = KNOB

    def run():
        before = torch.ops.flashattn_ext._cpu_test_knob(name, value)
        try:
            step()
        finally:
            torch.ops.flashattn_ext._cpu_test_knob(name, before)

    return run


def make_decode_step(impl, dtype, b, heads, heads_kv, n, d):
    """One decoding step of impl: a query token per batch row against a full cache of n keys."""
    if impl in ("ours", "ours_knob", "ours_paged"):
        q = torch.randn(b, 1, heads, d, dtype=dtype)
        k_cache, v_cache = (torch.randn(b, n, heads_kv, d, dtype=dtype) for _ in range(2))
        seqlens = torch.full((b,), n, dtype=torch.int32)
        if impl != "ours_paged":
            return lambda: flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
        blocks = b * n // DECODE_PAGE
        table = torch.randperm(blocks).view(b, -1).to(torch.int32)
        k_pages, v_pages = (torch.empty(blocks, DECODE_PAGE, heads_kv, d, dtype=dtype) for _ in range(2))
        k_pages[table.long().flatten()] = k_cache.reshape(blocks, DECODE_PAGE, heads_kv, d)
        v_pages[table.long().flatten()] = v_cache.reshape(blocks, DECODE_PAGE, heads_kv, d)
        return lambda: flashattn_ext.flash_attn_with_kvcache(
            q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table
        )
    q = torch.randn(b, 1, heads, d, dtype=dtype).transpose(1, 2)  # (b, h, 1, d), a view of the projection
    k, v = (torch.randn(b, heads_kv, n, d, dtype=dtype) for _ in range(2))
    if impl == "sdpa":
        return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    ratio = heads // heads_kv
    return lambda: naive_fn(q, k.repeat_interleave(ratio, 1), v.repeat_interleave(ratio, 1), False)


def make_inputs(layout, b, h, n, d, dtype, requires_grad):
    shape = (b, n, h, d) if layout == "bnhd" else (b, h, n, d)
    return [torch.randn(shape, dtype=dtype).requires_grad_(requires_grad) for _ in range(3)]


def make_step(impl, mode, dtype, b, h, n, d, causal):
    fn, layout = IMPLS[impl]
    training = mode == "fwd+bwd"
    q, k, v = make_inputs(layout, b, h, n, d, dtype, training)
    if training:
        dout = torch.randn_like(q)

        def step():
            out = fn(q, k, v, causal)
            q.grad = k.grad = v.grad = None
            out.backward(dout)

    else:

        def step():
            with torch.no_grad():
                fn(q, k, v, causal)

    return step


def calls_per_rep(steps, min_rep_ms):
    """How many back-to-back calls one repetition times: enough for the
    slowest implementation's call (timed once, after the warm-up) to fill
    min_rep_ms, the same count for every implementation. A decoding step is
    0.1-1 ms at 16 threads; timed one call at a time, one descheduled thread
    moved a median of 5 by 2-4x on the Xeon (benchmarks/cpu_perf_log.md)."""
    slowest = 0.0
    for step in steps.values():
        t0 = time.perf_counter()
        step()
        slowest = max(slowest, (time.perf_counter() - t0) * 1e3)
    return max(1, min(1000, math.ceil(min_rep_ms / max(slowest, 1e-3))))


def bench_config(impls, mode, dtype, b, h, n, d, causal, warmup, reps, heads_kv=None, min_rep_ms=0.0):
    """Median ms per call per implementation. The implementations take turns
    within each repetition, so that a change of load on a shared machine hits
    all; a repetition times `calls` calls in a row (calls_per_rep).
    Returns the medians, the minima (the JSON keeps both: on a shared
    machine the minimum shows what a repetition costs undisturbed) and calls."""
    if mode == "decode":
        steps = {impl: make_decode_step(impl, dtype, b, h, heads_kv, n, d) for impl in impls}
    else:
        steps = {impl: make_step(impl, mode, dtype, b, h, n, d, causal) for impl in impls}
    if "ours_knob" in steps:
        steps["ours_knob"] = with_knob(steps["ours_knob"])
    for step in steps.values():
        for _ in range(warmup):
            step()
    calls = calls_per_rep(steps, min_rep_ms) if min_rep_ms > 0 else 1
    times = {impl: [] for impl in impls}
    for _ in range(reps):
        for impl, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                step()
            times[impl].append((time.perf_counter() - t0) * 1e3 / calls)
    return {impl: statistics.median(t) for impl, t in times.items()}, {impl: min(t) for impl, t in times.items()}, calls


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--min-rep-ms",
        type=float,
        default=20.0,
        help="a repetition times enough calls in a row to last about this long (0: one call)",
    )
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--seqlens", default="512,1024,2048")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default="fwd,fwd+bwd")
    ap.add_argument("--impls", default="ours,sdpa,naive")
    ap.add_argument("--decode-caches", default="1024,4096", help="decode mode: cache lengths")
    ap.add_argument("--decode-batches", default="1,4", help="decode mode: batch sizes")
    ap.add_argument("--decode-heads", default="32,8", help="decode mode: query heads, kv heads")
    ap.add_argument("--decode-dim", type=int, default=128, help="decode mode: head dim")
    ap.add_argument("--decode-page", type=int, default=16, help="decode mode: ours_paged's page size")
    ap.add_argument("--threads", help="thread counts to time in turn, e.g. 1,4,16 (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="one seqlen (1024), fewer reps")
    ap.add_argument("--dropout", type=float, default=0.0, help="dropout_p of every implementation (fwd, fwd+bwd)")
    ap.add_argument("--knob", help="NAME=VALUE: the CPU test switch of the ours_knob implementation (added)")
    ap.add_argument("--markdown", help="write the table (ours over each peer) to this file")
    args = ap.parse_args(argv)
    if args.quick:
        args.seqlens, args.reps, args.warmup = "1024", 3, 1
    if args.knob:
        global KNOB
        name, _, value = args.knob.partition("=")
        KNOB = (name, int(value))
        torch.ops.flashattn_ext._cpu_test_knob(name, 0)  # an unknown name raises here, not mid-run
        if "ours_knob" not in args.impls.split(","):
            args.impls += ",ours_knob"

    machine = dict(cpu_description(), **code_description())
    print(f"{machine['cpu']} ({machine['cores']} cores; {' '.join(machine['isa']) or 'no AVX2'})")
    print(f"code: commit {machine['commit']}, csrc/cpu {machine['cpu_src']}, cuda build {machine['cuda_build']}")
    rows = []
    default_threads = torch.get_num_threads()
    for threads in [int(t) for t in args.threads.split(",")] if args.threads else [default_threads]:
        torch.set_num_threads(threads)
        try:
            machine_row = dict(machine, threads=threads, **ours_runtime())
            rows += [dict(row, **machine_row) for row in bench_grid(args)]
        finally:
            torch.set_num_threads(default_threads)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {len(rows)} rows to {args.json}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown_table(rows, args))
        print(f"wrote the table to {args.markdown}")
    return 0


def markdown_table(rows, args):
    """One line per (threads, mode, dtype, case, n): the times, ours over each peer (bold above 1)."""
    impls = args.impls.split(",")
    peers = [i for i in impls if i != "ours"] if "ours" in impls else []
    first = rows[0] if rows else {}
    lines = [
        f"{first.get('cpu')} ({first.get('cores')} cores; {' '.join(first.get('isa', []))}), torch "
        f"{torch.__version__}, commit {first.get('commit')}, csrc/cpu {first.get('cpu_src')}, bf16 products "
        f"{first.get('bf16_gemm')}; b{args.batch} h{args.heads} d{args.head_dim} (decode: "
        f"{args.decode_heads.replace(',', '/')} heads d{args.decode_dim}), median of {args.reps} repetitions of about {args.min_rep_ms:g} ms",
        "",
        "| threads | mode | dtype | causal / batch | n | "
        + " | ".join(f"{i} ms" for i in impls)
        + "".join(f" | ours / {i}" for i in peers)
        + " |",
        "|---" * (5 + len(impls) + len(peers)) + "|",
    ]
    keyed = {}
    for r in rows:
        case = f"b{r['b']}" if r["mode"] == "decode" else ("causal" if r["causal"] else "no")
        keyed.setdefault((r["threads"], r["mode"], r["dtype"], case, r["n"]), {})[r["impl"]] = r["ms"]
    for (threads, mode, dtype, case, n), ms in keyed.items():
        cells = [str(threads), mode, dtype, case, str(n)] + [f"{ms[i]:.2f}" if i in ms else "-" for i in impls]
        for peer in peers:
            ratio = ms["ours"] / ms[peer] if "ours" in ms and ms.get(peer) else None
            cells.append("-" if ratio is None else (f"**{ratio:.2f}**" if ratio > 1.0 else f"{ratio:.2f}"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def bench_grid(args):
    """Every configuration of args at the current thread count: the JSON rows."""
    seqlens = [int(x) for x in args.seqlens.split(",")]
    impls = args.impls.split(",")
    b, h, d = args.batch, args.heads, args.head_dim
    global DROPOUT, DECODE_PAGE
    DROPOUT, DECODE_PAGE = args.dropout, args.decode_page
    drop = f", dropout_p {DROPOUT:g}" if DROPOUT > 0 else ""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, b{b} h{h} d{d}{drop}, median of {args.reps}")
    print(f"ours: {ours_runtime()}")

    rows = []
    header = f"{'mode':8} {'dtype':9} {'causal':6} {'n':>5} " + " ".join(f"{i + ' ms':>10}" for i in impls)
    ratio_cols = [i for i in ("sdpa", "naive", "ours_knob") if i in impls and "ours" in impls]
    header += "".join(f" {'ours/' + i:>11}" for i in ratio_cols)
    print(header)
    for mode in args.modes.split(","):
        if mode == "decode":
            rows += bench_decode(args, impls, ratio_cols)
            continue
        grid_impls = [i for i in impls if i in IMPLS]  # (ours_paged: decode only)
        for dtype_name in args.dtypes.split(","):
            for causal in (False, True):
                for n in seqlens:
                    ms, ms_min, calls = bench_config(
                        grid_impls,
                        mode,
                        DTYPES[dtype_name],
                        b,
                        h,
                        n,
                        d,
                        causal,
                        args.warmup,
                        args.reps,
                        min_rep_ms=args.min_rep_ms,
                    )
                    for impl in grid_impls:
                        rows.append(
                            dict(
                                impl=impl,
                                mode=mode,
                                dtype=dtype_name,
                                d=d,
                                n=n,
                                b=b,
                                h=h,
                                causal=causal,
                                ms=ms[impl],
                                ms_min=ms_min[impl],
                                calls=calls,
                                dropout=DROPOUT,
                            )
                        )
                    print_row(mode, dtype_name, str(causal), n, ms, grid_impls, ratio_cols)
    return rows


def print_row(mode, dtype_name, case, n, ms, impls, ratio_cols):
    """One line of the table: times, then ours over each peer."""
    line = f"{mode:8} {dtype_name:9} {case:6} {n:5d} " + " ".join(f"{ms[i]:10.2f}" for i in impls)
    print(line + "".join(f" {ms['ours'] / ms[i]:11.2f}" for i in ratio_cols), flush=True)


def bench_decode(args, impls, ratio_cols):
    heads, heads_kv = (int(x) for x in args.decode_heads.split(","))
    d = args.decode_dim
    print(f"decode: {heads}/{heads_kv} heads, d{d}, one query token a batch row; n = cache length, b = batch")
    rows = []
    for dtype_name in args.dtypes.split(","):
        for n in (int(x) for x in args.decode_caches.split(",")):
            for b in (int(x) for x in args.decode_batches.split(",")):
                ms, ms_min, calls = bench_config(
                    impls,
                    "decode",
                    DTYPES[dtype_name],
                    b,
                    heads,
                    n,
                    d,
                    False,
                    args.warmup,
                    args.reps,
                    heads_kv,
                    args.min_rep_ms,
                )
                for impl in impls:
                    rows.append(
                        dict(
                            impl=impl,
                            mode="decode",
                            dtype=dtype_name,
                            d=d,
                            n=n,
                            b=b,
                            h=heads,
                            h_kv=heads_kv,
                            causal=False,
                            ms=ms[impl],
                            ms_min=ms_min[impl],
                            calls=calls,
                        )
                    )
                print_row("decode", dtype_name, f"b{b}", n, ms, impls, ratio_cols)
    return rows


if __name__ == "__main__":
    sys.exit(main())
