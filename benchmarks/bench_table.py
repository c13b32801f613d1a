#!/usr/bin/env python3
"""Turns the JSON of bench_gpu.py into tables: markdown for the README, or the
short text summary bench_gpu.py prints last.

    python benchmarks/bench_table.py results.json            # markdown on stdout
    python benchmarks/bench_table.py results.json -o RESULTS.md
    python benchmarks/bench_table.py results.json --text     # the short text summary

Each cell holds the TFLOP/s at each seqlen of the grid, joined by "/" ("-"
where a point was skipped or failed); ratio columns are ours / peer at each seqlen.
"""

import argparse
import json
import math
import sys

OURS = "flashattn_ext"
PEERS = (("cudnn", "cuDNN (SDPA)"), ("fa2", "FA2 (SDPA flash)"), ("mem_efficient", "mem-efficient"),
         ("naive", "naive"))


def _fmt(x, nd=None):
    """nd=None: TFLOP/s style, integers from 10 up, two significant digits below."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if nd is None:
        return f"{x:.0f}" if abs(x) >= 10 else f"{x:.2g}"
    return f"{x:.{nd}f}"


def _seqlen_label(n):
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def index_rows(data):
    """{(dtype, mode, d, causal): {impl: {n: tflops or None}}} and the sorted seqlens."""
    table, seqlens = {}, set()
    for r in data.get("rows", []):
        key = (r["dtype"], r["mode"], r["d"], bool(r["causal"]))
        table.setdefault(key, {}).setdefault(r["impl"], {})[r["n"]] = r.get("tflops")
        seqlens.add(r["n"])
    return table, sorted(seqlens)


def _case_order(key):
    dtype, mode, d, causal = key
    return (dtype, {"fwd": 0, "bwd": 1}.get(mode, 2), {128: 0, 64: 1, 256: 2}.get(d, 3 + d), causal)


def _case_label(key, with_dtype):
    dtype, mode, d, causal = key
    s = f"d{d} {'causal ' if causal else ''}{mode}"
    return f"{dtype} {s}" if with_dtype else s


def _ratios(ours, peer, seqlens):
    out = []
    for n in seqlens:
        a, b = ours.get(n), peer.get(n)
        out.append(a / b if a and b else None)
    return out


def _summary_of_ratios(rs):
    vals = [r for r in rs if r]
    if not vals:
        return "-"
    gm = math.exp(sum(math.log(v) for v in vals) / len(vals))
    return f"{gm:.2f} ({min(vals):.2f}-{max(vals):.2f})"


def header_line(data):
    where = data.get("gpu") or f"CPU ({data.get('threads', '?')} threads)"
    c = data.get("ceilings") or {}
    ceil = []
    if c.get("matmul_tflops"):
        ceil.append(f"{c.get('matmul_dtype', 'bf16')} matmul {_fmt(c['matmul_tflops'])} TFLOP/s")
    if c.get("copy_tbs"):
        ceil.append(f"copy {c['copy_tbs']:.2f} TB/s")
    s = f"{where}, torch {data.get('torch')}, CUDA {data.get('cuda')}, cuDNN {data.get('cudnn')}, {data.get('date')}"
    if ceil:
        s += "; ceilings in the same run: " + ", ".join(ceil)
    return s


def markdown_report(data):
    table, seqlens = index_rows(data)
    dtypes = {k[0] for k in table}
    lines = [f"Measured by `benchmarks/bench_gpu.py` on {header_line(data)}.", ""]
    if data.get("synthetic"):
        lines = ["**SYNTHETIC TEST DATA, not a measurement.**", ""] + lines
    fa = data.get("flashattn_ext")
    if fa or data.get("build_info"):
        lines += [f"flashattn_ext {fa} (build: `{data.get('build_info')}`).", ""]
    if table:
        impls_present = {i for v in table.values() for i in v}
        peers = [(k, name) for k, name in PEERS if k in impls_present]
        lines.append("TFLOP/s at seqlen " + " / ".join(_seqlen_label(n) for n in seqlens)
                     + f" (batch x seqlen = {data.get('grid', {}).get('tokens', 16384)} tokens, heads = "
                     f"{data.get('grid', {}).get('head_total', 2048)} / head_dim); ratios are ours / peer.")
        lines.append("")
        hdr = ["case", "ours"] + [name for _, name in peers]
        hdr += [f"ours / {name}" for k, name in peers if k in ("cudnn", "fa2")]
        lines.append("| " + " | ".join(hdr) + " |")
        lines.append("|" + "---|" * len(hdr))
        for key in sorted(table, key=_case_order):
            impls = table[key]
            ours = impls.get(OURS, {})
            cells = [_case_label(key, len(dtypes) > 1), "/".join(_fmt(ours.get(n)) for n in seqlens)]
            for k, _ in peers:
                cells.append("/".join(_fmt(impls.get(k, {}).get(n)) for n in seqlens))
            for k, _ in peers:
                if k in ("cudnn", "fa2"):
                    cells.append("/".join(_fmt(r, 2) for r in _ratios(ours, impls.get(k, {}), seqlens)))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    g = data.get("gpt2") or {}
    if g.get("impls"):
        lines.append(f"GPT-2 attention (b{g['b']} h{g['h']} n{g['n']} d{g['d']} {g['dtype']}"
                     f"{' causal' if g.get('causal') else ''}), forward + backward:")
        lines.append("")
        lines.append("| impl | ms | speedup over naive |")
        lines.append("|---|---|---|")
        for impl, r in g["impls"].items():
            ms = _fmt(r.get("ms"), 3) if r.get("ms") else (r.get("error") or r.get("skipped") or "-")
            lines.append(f"| {impl} | {ms} | {_fmt(r.get('speedup_vs_naive'), 2)} |")
        lines.append("")
    mem = [m for m in data.get("memory", []) if not m.get("skipped")]
    if mem:
        ns = sorted({m["n"] for m in mem})
        m0 = mem[0]
        lines.append(f"Peak extra memory of forward + backward (b{m0['b']} h{m0['h']} d{m0['d']} {m0['dtype']}), "
                     "beyond the inputs:")
        lines.append("")
        lines.append("| impl | " + " | ".join(_seqlen_label(n) for n in ns) + " |")
        lines.append("|---|" + "---|" * len(ns))
        for impl in dict.fromkeys(m["impl"] for m in mem):
            cells = []
            for n in ns:
                e = next((m for m in mem if m["impl"] == impl and m["n"] == n), None)
                cells.append("-" if e is None else (e.get("error") or fmt_bytes(e.get("peak_extra_bytes"))))
            lines.append(f"| {impl} | " + " | ".join(cells) + " |")
        lines.append("")
    if data.get("budget_exceeded"):
        be = data["budget_exceeded"]
        lines.append(f"Time budget exceeded after {be['after_s']} s: {be['points_not_run']} grid points not run.")
        lines.append("")
    return "\n".join(lines)


def fmt_bytes(b):
    if b is None:
        return "-"
    if b >= 1024**3:
        return f"{b / 1024**3:.1f} GiB"
    return f"{b / 1024**2:.0f} MiB"


def text_summary(data):
    """The short table bench_gpu.py prints last: ours' TFLOP/s across seqlens per
    (mode, d, causal), and the ratios ours / fa2 and ours / cudnn (geometric mean,
    min-max over seqlens)."""
    table, seqlens = index_rows(data)
    out = [f"flashattn_ext: {header_line(data)}"]
    if not table:
        out.append("(no grid rows)")
    else:
        dtypes = {k[0] for k in table}
        labels = [_seqlen_label(n) for n in seqlens]
        head = f"{'case':<22}" + "".join(f"{x:>7}" for x in labels) + f"  {'ours/fa2':<18}{'ours/cudnn':<18}"
        out.append("TFLOP/s of ours at each seqlen; ratios: geometric mean (min-max) over seqlens")
        out.append(head)
        for key in sorted(table, key=_case_order):
            impls = table[key]
            ours = impls.get(OURS, {})
            line = f"{_case_label(key, len(dtypes) > 1):<22}" + "".join(f"{_fmt(ours.get(n)):>7}" for n in seqlens)
            line += f"  {_summary_of_ratios(_ratios(ours, impls.get('fa2', {}), seqlens)):<18}"
            line += f"{_summary_of_ratios(_ratios(ours, impls.get('cudnn', {}), seqlens)):<18}"
            out.append(line.rstrip())
        errs = {}
        for r in data.get("rows", []):
            if r.get("error"):
                errs.setdefault((r["impl"], r["error"]), 0)
                errs[(r["impl"], r["error"])] += 1
        for (impl, e), cnt in list(errs.items())[:4]:
            out.append(f"  error x{cnt} {impl}: {e[:120]}")
    g = data.get("gpt2") or {}
    if g.get("impls"):
        parts = []
        for impl, r in g["impls"].items():
            if r.get("ms"):
                sp = r.get("speedup_vs_naive")
                parts.append(f"{impl} {r['ms']:.3f} ms" + (f" ({sp:.1f}x)" if sp else ""))
            else:
                parts.append(f"{impl} {'error' if r.get('error') else 'skipped'}")
        out.append(f"GPT-2 b{g['b']} h{g['h']} n{g['n']} d{g['d']} {g['dtype']} fwd+bwd: " + ", ".join(parts))
    mem = [m for m in data.get("memory", []) if not m.get("skipped")]
    if mem:
        ns = sorted({m["n"] for m in mem})
        parts = []
        for impl in dict.fromkeys(m["impl"] for m in mem):
            cells = []
            for n in ns:
                e = next((m for m in mem if m["impl"] == impl and m["n"] == n), None)
                cells.append("-" if e is None else (("OOM" if e.get("error") == "OOM" else "error")
                                                    if e.get("error") else fmt_bytes(e.get("peak_extra_bytes"))))
            parts.append(f"{impl} {'/'.join(cells)}")
        out.append(f"peak extra memory fwd+bwd at {'/'.join(_seqlen_label(n) for n in ns)}: " + "; ".join(parts))
    if data.get("budget_exceeded"):
        be = data["budget_exceeded"]
        out.append(f"TIME BUDGET EXCEEDED after {be['after_s']} s: {be['points_not_run']} grid points not run")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description="bench_gpu.py JSON -> markdown results table (or the text summary)")
    p.add_argument("json", help="results JSON written by bench_gpu.py --json")
    p.add_argument("-o", "--out", help="write the markdown here instead of stdout")
    p.add_argument("--text", action="store_true", help="print the short text summary instead")
    args = p.parse_args(argv)
    with open(args.json) as fh:
        data = json.load(fh)
    text = text_summary(data) if args.text else markdown_report(data)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
