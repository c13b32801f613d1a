#!/usr/bin/env python3
"""Turns the JSON of bench_gpu.py into tables: markdown for the README, or the
short text summary bench_gpu.py prints last.

    python benchmarks/bench_table.py results.json            # markdown on stdout
    python benchmarks/bench_table.py results.json -o RESULTS.md
    python benchmarks/bench_table.py results.json --text     # the short text summary
    python benchmarks/bench_table.py a.json b.json --vs-best # the README's table: ours / the best peer

--vs-best merges the rows of the given runs (one visit's grid split over calls)
and gives, at each point, ours_sdpa / the fastest of BEST_PEERS there (its letter
names it) and the geometric mean of those ratios over the seqlens.

Cells: TFLOP/s at each seqlen, joined by "/" ("-" where a point was skipped, failed
or not run). The ratios, at each seqlen in the markdown and as geometric mean
(min-max) over seqlens in the text summary, are exactly these four (RATIOS):
ours_sdpa / sdpa_cudnn, ours_sdpa / sdpa_default, ours_sdpa / sdpa_flash and
ours_native / sdpa_cudnn, each a ratio of TFLOP/s (= inverse ratio of times) of
one case. JSON written before the impl names changed (flashattn_ext, cudnn, fa2,
mem_efficient) is read with the new names (normalize).
"""

import argparse
import copy
import json
import math
import sys

# The columns of the grid tables, in order: JSON name -> header.
IMPL_NAMES = {
    "ours_sdpa": "ours (SDPA API)",
    "ours_native": "ours (flash_attn_func)",
    "sdpa_default": "SDPA default",
    "sdpa_cudnn": "cuDNN (SDPA)",
    "sdpa_flash": "FA2 (SDPA flash)",
    "fa4": "FA4",
    "sdpa_mem_efficient": "mem-efficient (SDPA)",
    "naive": "naive",
}
SHORT_NAMES = {
    "ours_sdpa": "sdpa",
    "ours_native": "native",
    "sdpa_default": "default",
    "sdpa_cudnn": "cudnn",
    "sdpa_flash": "flash",
}
# Every ratio any table prints: (numerator impl, denominator impl).
RATIOS = (
    ("ours_sdpa", "sdpa_cudnn"),
    ("ours_sdpa", "sdpa_default"),
    ("ours_sdpa", "sdpa_flash"),
    ("ours_native", "sdpa_cudnn"),
)
# --vs-best: the peers ours is held against, and the letter that names each.
BEST_PEERS = {"sdpa_cudnn": "c", "fa4": "f", "sdpa_default": "d"}
# The implementations whose fraction of the matmul ceiling the tables show.
FRACTION_IMPLS = ("ours_sdpa", "ours_native", "sdpa_default", "sdpa_cudnn", "sdpa_flash", "fa4")
LEGACY_NAMES = {
    "flashattn_ext": "ours_native",
    "cudnn": "sdpa_cudnn",
    "fa2": "sdpa_flash",
    "mem_efficient": "sdpa_mem_efficient",
}
HOST_MODES = (("fwd", "fwd"), ("fwd_grad", "fwd (grad)"), ("fwd+bwd", "fwd+bwd"))


def normalize(data):
    """A copy of data with the implementations under their current names."""
    data = copy.deepcopy(data)

    def rn(x):
        return LEGACY_NAMES.get(x, x)

    for r in data.get("rows", []):
        r["impl"] = rn(r["impl"])
    for m in data.get("memory", []):
        m["impl"] = rn(m["impl"])
    g = data.get("gpt2") or {}
    if g.get("impls"):
        g["impls"] = {rn(k): v for k, v in g["impls"].items()}
    return data


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


def ratios(num, den, seqlens):
    """num / den of TFLOP/s at each seqlen (None where either is missing)."""
    out = []
    for n in seqlens:
        a, b = num.get(n), den.get(n)
        out.append(a / b if a and b else None)
    return out


def geomean_range(rs):
    """(geometric mean, min, max) of the ratios that exist, or None."""
    vals = [r for r in rs if r]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals)), min(vals), max(vals)


def _summary_of_ratios(rs):
    s = geomean_range(rs)
    return "-" if s is None else f"{s[0]:.2f} ({s[1]:.2f}-{s[2]:.2f})"


def ratio_label(num, den, short=False):
    if short:
        return f"{SHORT_NAMES.get(num, num)}/{SHORT_NAMES.get(den, den)}"
    return f"{num} / {den}"


def matmul_ceiling(data):
    return (data.get("ceilings") or {}).get("matmul_tflops")


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


def default_backends(data):
    """{backend: number of grid rows} that torch's default SDPA picked."""
    out = {}
    for r in data.get("rows", []):
        if r["impl"] == "sdpa_default" and r.get("backend"):
            out[r["backend"]] = out.get(r["backend"], 0) + 1
    return out


def _gpt2_case(g):
    return f"b{g['b']} h{g['h']} n{g['n']} d{g['d']} {g['dtype']}{' causal' if g.get('causal') else ''}"


def _host_cell(r):
    if not r:
        return "-"
    if r.get("us") is not None:
        return f"{r['us']:.1f}" + ("" if r.get("gpu_busy", True) else "*")
    return "error" if r.get("error") else "skipped"


def host_overhead_text(h):
    """One line per implementation: host microseconds per call in each mode."""
    if not h or not h.get("impls"):
        return ""
    out = [f"host us/call ({_gpt2_case(h)}), " + " | ".join(lab for _, lab in HOST_MODES) + ":"]
    for impl, e in h["impls"].items():
        cells = " | ".join(f"{_host_cell(e.get(m)):>7}" for m, _ in HOST_MODES)
        out.append(f"  {impl:<13} {cells}" + (f"   (torch picked {e['backend']})" if e.get("backend") else ""))
    if any(not r.get("gpu_busy", True) for e in h["impls"].values() for r in e.values() if isinstance(r, dict)):
        out.append("  * the GPU went idle during the timed loop: that figure may include waiting")
    return "\n".join(out)


def markdown_report(data):
    data = normalize(data)
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
        cols = [i for i in IMPL_NAMES if i in impls_present] + sorted(impls_present - set(IMPL_NAMES))
        rats = [(a, b) for a, b in RATIOS if a in impls_present and b in impls_present]
        lines.append(
            "TFLOP/s at seqlen "
            + " / ".join(_seqlen_label(n) for n in seqlens)
            + f" (batch x seqlen = {data.get('grid', {}).get('tokens', 16384)} tokens, heads = "
            f"{data.get('grid', {}).get('head_total', 2048)} / head_dim); ratios of TFLOP/s at each seqlen."
        )
        lines.append("")
        hdr = ["case"] + [IMPL_NAMES.get(i, i) for i in cols] + [ratio_label(a, b) for a, b in rats]
        lines.append("| " + " | ".join(hdr) + " |")
        lines.append("|" + "---|" * len(hdr))
        for key in sorted(table, key=_case_order):
            impls = table[key]
            cells = [_case_label(key, len(dtypes) > 1)]
            for i in cols:
                cells.append("/".join(_fmt(impls.get(i, {}).get(n)) for n in seqlens))
            for a, b in rats:
                cells.append("/".join(_fmt(r, 2) for r in ratios(impls.get(a, {}), impls.get(b, {}), seqlens)))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        be = default_backends(data)
        if be:
            lines.append(
                "torch's default SDPA picked: "
                + ", ".join(f"{k} ({v} cells)" for k, v in sorted(be.items(), key=lambda kv: -kv[1]))
                + "."
            )
            lines.append("")
        peak = matmul_ceiling(data)
        fcols = [i for i in FRACTION_IMPLS if i in impls_present]
        if peak and fcols:
            lines.append(
                f"Fraction of the {(data.get('ceilings') or {}).get('matmul_dtype', 'bf16')} matmul ceiling "
                f"measured in the same run ({_fmt(peak)} TFLOP/s), at each seqlen:"
            )
            lines.append("")
            hdr = ["case"] + [IMPL_NAMES[i] for i in fcols]
            lines.append("| " + " | ".join(hdr) + " |")
            lines.append("|" + "---|" * len(hdr))
            for key in sorted(table, key=_case_order):
                impls = table[key]
                cells = [_case_label(key, len(dtypes) > 1)]
                for i in fcols:
                    vals = [impls.get(i, {}).get(n) for n in seqlens]
                    cells.append("/".join(_fmt(v / peak if v else None, 2) for v in vals))
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
    g = data.get("gpt2") or {}
    if g.get("impls"):
        lines.append(f"GPT-2 attention ({_gpt2_case(g)}), forward + backward through autograd:")
        lines.append("")
        lines.append("| impl | ms | TFLOP/s | speedup over naive |")
        lines.append("|---|---|---|---|")
        for impl, r in g["impls"].items():
            ms = _fmt(r.get("ms"), 3) if r.get("ms") else (r.get("error") or r.get("skipped") or "-")
            name = impl + (f" ({r['backend']})" if r.get("backend") else "")
            lines.append(f"| {name} | {ms} | {_fmt(r.get('tflops'))} | {_fmt(r.get('speedup_vs_naive'), 2)} |")
        lines.append("")
    h = data.get("host_overhead") or {}
    if h.get("impls"):
        lines.append(f"Host (CPU) time per call, microseconds ({_gpt2_case(h)}; {h.get('method', '')}):")
        lines.append("")
        lines.append("| impl | " + " | ".join(lab for _, lab in HOST_MODES) + " |")
        lines.append("|---|" + "---|" * len(HOST_MODES))
        for impl, e in h["impls"].items():
            name = impl + (f" ({e['backend']})" if e.get("backend") else "")
            lines.append(f"| {name} | " + " | ".join(_host_cell(e.get(m)) for m, _ in HOST_MODES) + " |")
        lines.append("")
    mem = [m for m in data.get("memory", []) if not m.get("skipped")]
    if mem:
        ns = sorted({m["n"] for m in mem})
        m0 = mem[0]
        lines.append(
            f"Peak extra memory of forward + backward (b{m0['b']} h{m0['h']} d{m0['d']} {m0['dtype']}), "
            "beyond the inputs:"
        )
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
    for impl, why in (data.get("skipped_impls") or {}).items():
        lines.append(f"{impl}: not run ({why}).")
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
    """The short table bench_gpu.py prints last: ours_sdpa's TFLOP/s across seqlens
    per (mode, d, causal) and the four RATIOS (geometric mean, min-max over seqlens);
    then the matmul-ceiling fractions, GPT-2, host time, memory and errors."""
    data = normalize(data)
    table, seqlens = index_rows(data)
    out = [f"flashattn_ext: {header_line(data)}"]
    if not table:
        out.append("(no grid rows)")
    else:
        dtypes = {k[0] for k in table}
        labels = [_seqlen_label(n) for n in seqlens]
        w = 18
        head = (
            f"{'case':<20}"
            + "".join(f"{x:>6}" for x in labels)
            + "  "
            + "".join(f"{ratio_label(a, b, short=True):<{w}}" for a, b in RATIOS)
        )
        # ours_sdpa's TFLOP/s; ours_native's in JSON that has no ours_sdpa (older runs).
        main_impl = "ours_sdpa" if any(r["impl"] == "ours_sdpa" for r in data.get("rows", [])) else "ours_native"
        out.append(f"TFLOP/s of {main_impl} at each seqlen; ratios of TFLOP/s: geometric mean (min-max) over seqlens")
        out.append(head.rstrip())
        for key in sorted(table, key=_case_order):
            impls = table[key]
            ours = impls.get(main_impl, {})
            line = f"{_case_label(key, len(dtypes) > 1):<20}" + "".join(f"{_fmt(ours.get(n)):>6}" for n in seqlens)
            line += "  " + "".join(
                f"{_summary_of_ratios(ratios(impls.get(a, {}), impls.get(b, {}), seqlens)):<{w}}" for a, b in RATIOS
            )
            out.append(line.rstrip())
        peak = matmul_ceiling(data)
        if peak:
            parts = []
            for impl in FRACTION_IMPLS:
                best = {}
                for r in data.get("rows", []):
                    if r["impl"] == impl and r.get("tflops"):
                        best[r["mode"]] = max(best.get(r["mode"], 0.0), r["tflops"] / peak)
                if best:
                    parts.append(f"{impl} " + "/".join(f"{best[m]:.2f}" for m in ("fwd", "bwd") if m in best))
            if parts:
                out.append(f"best fraction of the matmul ceiling ({_fmt(peak)} TFLOP/s), fwd/bwd: " + ", ".join(parts))
        be = default_backends(data)
        if be:
            out.append(
                "sdpa_default ran: " + ", ".join(f"{k} x{v}" for k, v in sorted(be.items(), key=lambda kv: -kv[1]))
            )
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
                parts.append(f"{impl} {r['ms']:.3f}" + (f" ({sp:.1f}x)" if sp else ""))
            else:
                parts.append(f"{impl} {'error' if r.get('error') else 'skipped'}")
        out.append(f"GPT-2 {_gpt2_case(g)} fwd+bwd ms (x over naive): " + ", ".join(parts))
    host = host_overhead_text(data.get("host_overhead"))
    if host:
        out.append(host)
    mem = [m for m in data.get("memory", []) if not m.get("skipped")]
    if mem:
        ns = sorted({m["n"] for m in mem})
        parts = []
        for impl in dict.fromkeys(m["impl"] for m in mem):
            cells = []
            for n in ns:
                e = next((m for m in mem if m["impl"] == impl and m["n"] == n), None)
                cells.append(
                    "-"
                    if e is None
                    else (
                        ("OOM" if e.get("error") == "OOM" else "error")
                        if e.get("error")
                        else fmt_bytes(e.get("peak_extra_bytes"))
                    )
                )
            parts.append(f"{impl} {'/'.join(cells)}")
        out.append(f"peak extra memory fwd+bwd at {'/'.join(_seqlen_label(n) for n in ns)}: " + "; ".join(parts))
    for impl, why in (data.get("skipped_impls") or {}).items():
        out.append(f"{impl} not run: {why[:150]}")
    if data.get("budget_exceeded"):
        be = data["budget_exceeded"]
        out.append(f"TIME BUDGET EXCEEDED after {be['after_s']} s: {be['points_not_run']} grid points not run")
    if data.get("elapsed_s") is not None:
        out.append(f"elapsed {data['elapsed_s']} s")
    return "\n".join(out)


def vs_best_table(data, ours="ours_sdpa", peers=BEST_PEERS):
    """Markdown: per case, at each seqlen, "ours/best<letter> ratio" and the geomean."""
    table, seqlens = index_rows(data)
    head = "| case | " + " | ".join(_seqlen_label(n) for n in seqlens) + " | geomean |"
    lines = [head, "|---" * (len(seqlens) + 2) + "|"]
    with_dtype = len({k[0] for k in table}) > 1
    for key in sorted(table, key=_case_order):
        impls = table[key]
        cells, rs = [], []
        for n in seqlens:
            mine = impls.get(ours, {}).get(n)
            best = max(((impls.get(i, {}).get(n) or 0.0, i) for i in peers), default=(0.0, None))
            if not mine or not best[0]:
                cells.append("-")
                continue
            rs.append(mine / best[0])
            cells.append(f"{mine:.0f}/{best[0]:.0f}{peers[best[1]]} {mine / best[0]:.2f}")
        g = geomean_range(rs)
        lines.append(
            f"| {_case_label(key, with_dtype)} | " + " | ".join(cells) + f" | {'-' if g is None else f'{g[0]:.2f}'} |"
        )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description="bench_gpu.py JSON -> markdown results table (or the text summary)")
    p.add_argument("json", nargs="+", help="results JSON written by bench_gpu.py --json (--vs-best: several, merged)")
    p.add_argument("-o", "--out", help="write the markdown here instead of stdout")
    p.add_argument("--text", action="store_true", help="print the short text summary instead")
    p.add_argument("--vs-best", action="store_true", help="ours / the best of cuDNN, FA4 and the default, per point")
    args = p.parse_args(argv)
    runs = []
    for path in args.json:
        with open(path) as fh:
            runs.append(normalize(json.load(fh)))
    if len(runs) > 1 and not args.vs_best:
        p.error("several JSON files only with --vs-best")
    data = runs[0]
    if args.vs_best:
        data = dict(runs[0], rows=[r for run in runs for r in run.get("rows", [])])
        text = vs_best_table(data)
    else:
        text = text_summary(data) if args.text else markdown_report(data)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
