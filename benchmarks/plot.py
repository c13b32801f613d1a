#!/usr/bin/env python3
"""Draws the results of bench_gpu.py (its --json output) into a folder of PNGs.

    python benchmarks/plot.py results.json --out plots/ [--all-impls]

Figures (one PNG each; the grid figures once per dtype in the JSON):
  tflops_fwd[_DTYPE].png, tflops_bwd[_DTYPE].png
      TFLOP/s vs seqlen for ours through both APIs (ours_sdpa, ours_native), cuDNN and
      FA2 (and FA4 when it ran; --all-impls adds SDPA default, mem-efficient and naive);
      one row of subplots per head dim, non-causal left, causal right; the dashed line
      is the matmul ceiling measured in the same run.
  ratio_cudnn.png     ours / cuDNN (TFLOP/s ratio) vs seqlen: rows fwd and bwd, columns
                      non-causal and causal, a line per head dim; solid ours_sdpa,
                      dashed ours_native; 1.0 is parity.
  memory.png          peak extra memory of forward + backward vs seqlen (log scale),
                      naive vs ours (and SDPA flash): the memory wall; x marks OOM.
  peak_fraction.png   the best TFLOP/s over seqlens of each implementation as a
                      fraction of the measured matmul peak, per (mode, head dim, causal).
  gpt2.png            the GPT-2 attention case: speedup over the naive path.
  host_overhead.png   host (CPU) microseconds per call on the tiny case, per mode.
  decode.png          (the JSON of bench_decode.py) useful K/V TB/s of a decode step vs
                      cache length, one subplot per batch, a line per implementation;
                      dashed: the device-to-device copy of the same bytes (read + written
                      / time); hollow markers: K/V expanded to the query heads.
Titles carry the GPU name, torch version and date from the JSON. JSON of the old
impl names (flashattn_ext, cudnn, fa2, mem_efficient) is read with the new ones.
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_table  # noqa: E402

IMPL_STYLE = {  # name in the JSON: (label, color, marker)
    "ours_sdpa": ("ours, SDPA API (b, h, n, d)", "#d62728", "o"),
    "ours_native": ("ours, flash_attn_func (b, n, h, d)", "#ff7f0e", "D"),
    "sdpa_default": ("SDPA default", "#8c564b", "P"),
    "sdpa_cudnn": ("cuDNN (SDPA)", "#1f77b4", "s"),
    "sdpa_flash": ("FA2 (SDPA flash)", "#2ca02c", "^"),
    "fa4": ("FA4 (flash_attn.cute)", "#17becf", "*"),
    "sdpa_mem_efficient": ("mem-efficient (SDPA)", "#9467bd", "v"),
    "naive": ("naive 3-kernel", "#7f7f7f", "x"),
}
IMPL_ORDER = list(IMPL_STYLE)
OURS = ("ours_sdpa", "ours_native")
# The implementations of the TFLOP/s and peak-fraction figures unless --all-impls.
MAIN_IMPLS = ("ours_sdpa", "ours_native", "sdpa_cudnn", "sdpa_flash", "fa4")


def _style(impl):
    return IMPL_STYLE.get(impl, (impl, None, "."))


def _seqlen_label(n):
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def subtitle(data):
    where = data.get("gpu") or f"CPU ({data.get('threads', '?')} threads)"
    date = (data.get("date") or "")[:10]
    return f"{where} · torch {data.get('torch')} · {date}"


def _impls_in(rows):
    present = {r["impl"] for r in rows}
    return [i for i in IMPL_ORDER if i in present] + sorted(present - set(IMPL_ORDER))


def _save(plt, fig, outdir, name, rect=None):
    """Lays the figure out (inside rect, when given), writes it as outdir/name and returns the path."""
    fig.tight_layout(rect=rect)  # None: the whole figure
    path = os.path.join(outdir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_tflops(plt, data, outdir, mode, dtype, head_dims=None, impls_shown=MAIN_IMPLS):
    rows = [
        r
        for r in data.get("rows", [])
        if r["mode"] == mode and r["dtype"] == dtype and (impls_shown is None or r["impl"] in impls_shown)
    ]
    if not rows:
        return None
    dims = sorted({r["d"] for r in rows})
    if head_dims:
        dims = [d for d in dims if d in head_dims]
    if not dims:
        return None
    causals = sorted({bool(r["causal"]) for r in rows})
    impls = _impls_in(rows)
    seqlens = sorted({r["n"] for r in rows})
    peak = (data.get("ceilings") or {}).get("matmul_tflops")
    fig, axes = plt.subplots(
        len(dims), len(causals), figsize=(5.2 * len(causals), 3.6 * len(dims)), squeeze=False, sharex=True
    )
    for i, d in enumerate(dims):
        for j, causal in enumerate(causals):
            ax = axes[i][j]
            for impl in impls:
                pts = sorted(
                    (r["n"], r["tflops"])
                    for r in rows
                    if r["impl"] == impl and r["d"] == d and bool(r["causal"]) == causal and r.get("tflops")
                )
                if not pts:
                    continue
                label, color, marker = _style(impl)
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker=marker,
                    color=color,
                    label=label,
                    linewidth=2.2 if impl in OURS else 1.4,
                )
            if peak:
                ax.axhline(
                    peak,
                    color="black",
                    linestyle="--",
                    linewidth=0.8,
                    label=f"{(data.get('ceilings') or {}).get('matmul_dtype', '')} matmul peak",
                )
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens)
            ax.set_xticklabels([_seqlen_label(n) for n in seqlens])
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            ax.set_title(f"{mode} d{d} {'causal' if causal else 'non-causal'}", fontsize=10)
            if j == 0:
                ax.set_ylabel("TFLOP/s")
            if i == len(dims) - 1:
                ax.set_xlabel(f"seqlen (batch x seqlen = {data.get('grid', {}).get('tokens', 16384)})")
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=9, frameon=False)
    fig.suptitle(f"Attention {'forward' if mode == 'fwd' else 'backward'} ({dtype}) — {subtitle(data)}", fontsize=11)
    multi = len({r["dtype"] for r in data.get("rows", [])}) > 1
    return _save(plt, fig, outdir, f"tflops_{mode}{'_' + dtype if multi else ''}.png", rect=(0, 0.06, 1, 0.96))


def plot_memory(plt, data, outdir):
    mem = [m for m in data.get("memory", []) if not m.get("skipped")]
    if not mem:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    seqlens = sorted({m["n"] for m in mem})
    measured = [m["peak_extra_gib"] for m in mem if m.get("peak_extra_gib")]
    top = max(measured) * 4 if measured else 1.0
    for impl in _impls_in(mem):
        pts = sorted((m["n"], m["peak_extra_gib"]) for m in mem if m["impl"] == impl and m.get("peak_extra_gib"))
        label, color, marker = _style(impl)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=label)
            for n, g in pts:
                ax.annotate(f"{g:.2g} GiB", (n, g), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color)
        failed = [m for m in mem if m["impl"] == impl and m.get("error")]
        for m in failed:
            what = "OOM" if m["error"] == "OOM" else "error"
            ax.scatter([m["n"]], [top], marker="X", s=80, color=color, zorder=5)
            ax.annotate(
                f"{label}: {what}",
                (m["n"], top),
                textcoords="offset points",
                xytext=(-30, -14),
                fontsize=8,
                color=color,
            )
    m0 = mem[0]
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(seqlens)
    ax.set_xticklabels([_seqlen_label(n) for n in seqlens])
    ax.set_xlabel("seqlen")
    ax.set_ylabel("peak extra memory, forward + backward (GiB)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=9)
    ax.set_title(f"The memory wall: b{m0['b']} h{m0['h']} d{m0['d']} {m0['dtype']}\n{subtitle(data)}", fontsize=10)
    return _save(plt, fig, outdir, "memory.png")


def plot_peak_fraction(plt, data, outdir, impls_shown=MAIN_IMPLS):
    peak = (data.get("ceilings") or {}).get("matmul_tflops")
    rows = [r for r in data.get("rows", []) if r.get("tflops") and (impls_shown is None or r["impl"] in impls_shown)]
    if not peak or not rows:
        return None
    dtypes = sorted({r["dtype"] for r in rows})
    cases = sorted(
        {(r["dtype"], r["mode"], r["d"], bool(r["causal"])) for r in rows},
        key=lambda c: (c[0], c[1] != "fwd", c[2], c[3]),
    )
    impls = _impls_in(rows)
    best = {}
    for r in rows:
        key = (r["impl"], r["dtype"], r["mode"], r["d"], bool(r["causal"]))
        best[key] = max(best.get(key, 0.0), r["tflops"])
    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(cases) * max(1, len(impls)) / 2.5), 4.6))
    width = 0.8 / max(1, len(impls))
    for k, impl in enumerate(impls):
        label, color, _ = _style(impl)
        xs, ys = [], []
        for x, c in enumerate(cases):
            v = best.get((impl,) + c)
            if v:
                xs.append(x - 0.4 + width * (k + 0.5))
                ys.append(v / peak)
        ax.bar(xs, ys, width=width, color=color, label=label)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(
        [(f"{c[0]}\n" if len(dtypes) > 1 else "") + f"{c[1]} d{c[2]}" + ("\ncausal" if c[3] else "") for c in cases],
        fontsize=8,
    )
    ax.set_ylabel(
        f"best TFLOP/s over seqlens / matmul peak ({peak:.0f})" if peak >= 10 else "best TFLOP/s / matmul peak"
    )
    ax.set_ylim(0, max(1.0, ax.get_ylim()[1]))
    ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=min(5, len(impls)))
    ax.set_title(f"Fraction of the measured matmul peak\n{subtitle(data)}", fontsize=10)
    return _save(plt, fig, outdir, "peak_fraction.png")


def plot_gpt2(plt, data, outdir):
    g = data.get("gpt2") or {}
    items = [(impl, r) for impl, r in (g.get("impls") or {}).items() if r.get("speedup_vs_naive")]
    if not items:
        return None
    items.sort(key=lambda kv: IMPL_ORDER.index(kv[0]) if kv[0] in IMPL_ORDER else 99)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = range(len(items))
    bars = ax.bar(xs, [r["speedup_vs_naive"] for _, r in items], color=[_style(i)[1] for i, _ in items])
    for bar, (_, r) in zip(bars, items):
        ax.annotate(
            f"{r['speedup_vs_naive']:.2f}x\n{r['ms']:.3f} ms",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(list(xs))
    ax.set_xticklabels([_style(i)[0] for i, _ in items], fontsize=8, rotation=10)
    ax.set_ylabel("speedup over naive (forward + backward)")
    ax.set_ylim(0, max(r["speedup_vs_naive"] for _, r in items) * 1.25)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_title(
        f"GPT-2 attention b{g['b']} h{g['h']} n{g['n']} d{g['d']} {g['dtype']}"
        f"{' causal' if g.get('causal') else ''}\n{subtitle(data)}",
        fontsize=10,
    )
    return _save(plt, fig, outdir, "gpt2.png")


def plot_ratio_cudnn(plt, data, outdir, dtype=None):
    """ours / cuDNN TFLOP/s ratio vs seqlen: ours_sdpa solid, ours_native dashed."""
    table, seqlens = bench_table.index_rows(data)
    if dtype is None:
        dtypes = sorted({k[0] for k in table})
        dtype = dtypes[0] if dtypes else None
    keys = [
        k
        for k in table
        if k[0] == dtype
        and any(
            r for o in OURS for r in bench_table.ratios(table[k].get(o, {}), table[k].get("sdpa_cudnn", {}), seqlens)
        )
    ]
    if not keys:
        return None
    modes = [m for m in ("fwd", "bwd") if any(k[1] == m for k in keys)]
    causals = sorted({k[3] for k in keys})
    dims = sorted({k[2] for k in keys})
    colors = dict(zip(dims, ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"] * 3))
    fig, axes = plt.subplots(
        len(modes), len(causals), figsize=(5.2 * len(causals), 3.6 * len(modes)), squeeze=False, sharex=True
    )
    for i, mode in enumerate(modes):
        for j, causal in enumerate(causals):
            ax = axes[i][j]
            for d in dims:
                impls = table.get((dtype, mode, d, causal))
                if not impls:
                    continue
                for impl, style, width in (("ours_sdpa", "-", 2.0), ("ours_native", "--", 1.2)):
                    rs = bench_table.ratios(impls.get(impl, {}), impls.get("sdpa_cudnn", {}), seqlens)
                    pts = [(n, r) for n, r in zip(seqlens, rs) if r]
                    if pts:
                        ax.plot(
                            [p[0] for p in pts],
                            [p[1] for p in pts],
                            linestyle=style,
                            linewidth=width,
                            marker="o" if impl == "ours_sdpa" else None,
                            color=colors[d],
                            label=f"d{d} {'SDPA API' if impl == 'ours_sdpa' else 'flash_attn_func'}",
                        )
            ax.axhline(1.0, color="black", linestyle=":", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens)
            ax.set_xticklabels([_seqlen_label(n) for n in seqlens])
            ax.grid(True, alpha=0.3)
            ax.set_title(f"{mode} {'causal' if causal else 'non-causal'}", fontsize=10)
            if j == 0:
                ax.set_ylabel("ours / cuDNN (TFLOP/s)")
            if i == len(modes) - 1:
                ax.set_xlabel("seqlen")
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=9, frameon=False)
    fig.suptitle(f"ours / cuDNN ({dtype}; > 1: ours faster) — {subtitle(data)}", fontsize=11)
    return _save(plt, fig, outdir, "ratio_cudnn.png", rect=(0, 0.08, 1, 0.95))


def plot_host_overhead(plt, data, outdir):
    h = data.get("host_overhead") or {}
    impls = [
        (i, e)
        for i, e in (h.get("impls") or {}).items()
        if any((e.get(m) or {}).get("us") is not None for m, _ in bench_table.HOST_MODES)
    ]
    if not impls:
        return None
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    modes = bench_table.HOST_MODES
    width = 0.8 / len(modes)
    shades = ("#9ecae1", "#4292c6", "#08519c")
    for k, (mode, label) in enumerate(modes):
        xs, ys = [], []
        for x, (_, e) in enumerate(impls):
            us = (e.get(mode) or {}).get("us")
            if us is not None:
                xs.append(x - 0.4 + width * (k + 0.5))
                ys.append(us)
        bars = ax.bar(xs, ys, width=width, color=shades[k % len(shades)], label=label)
        for bar, y in zip(bars, ys):
            ax.annotate(
                f"{y:.0f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7
            )
    ax.set_xticks(range(len(impls)))
    ax.set_xticklabels([i + (f"\n({e['backend']})" if e.get("backend") else "") for i, e in impls], fontsize=8)
    ax.set_ylabel("host time per call (µs)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(
        f"Host (CPU) time per call, b{h['b']} h{h['h']} n{h['n']} d{h['d']} {h['dtype']}"
        f"{' causal' if h.get('causal') else ''}\n{subtitle(data)}",
        fontsize=10,
    )
    return _save(plt, fig, outdir, "host_overhead.png")


DECODE_STYLE = {  # bench_decode.py's implementations: (label, color, marker)
    "ours": ("ours, flash_attn_with_kvcache", "#d62728", "o"),
    "ours_paged": ("ours, paged (block_table)", "#ff7f0e", "D"),
    "ours_sdpa": ("ours, SDPA drop-in", "#e377c2", "v"),
    "sdpa_cudnn": ("cuDNN (SDPA)", "#1f77b4", "s"),
    "sdpa_flash": ("FA2 (SDPA flash)", "#2ca02c", "^"),
    "sdpa_default": ("SDPA default", "#8c564b", "P"),
    "fa2_package": ("flash-attn package", "#17becf", "*"),
}


def plot_decode(plt, data, outdir):
    """bench_decode.py's decode section: TB/s vs cache length per batch."""
    rows = data.get("decode") or []
    batches = sorted({r["batch"] for r in rows})
    if not batches:
        return None
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.8), squeeze=False)
    for ax, b in zip(axes[0], batches):
        mine = [r for r in rows if r["batch"] == b]
        copy = sorted((r["cache_len"], r["copy_tbs"]) for r in mine if r["impl"] == "copy" and r.get("copy_tbs"))
        if copy:
            ax.plot(*zip(*copy), "k--", lw=1, label="copy ceiling (read + written)")
        for impl, (label, color, marker) in DECODE_STYLE.items():
            pts = sorted(
                (r["cache_len"], r["useful_tbs"], bool(r.get("kv_expanded")))
                for r in mine
                if r["impl"] == impl and r.get("useful_tbs")
            )
            if not pts:
                continue
            xs, ys, expanded = zip(*pts)
            ax.plot(xs, ys, color=color, lw=1.5, label=label)
            for x, y, e in pts:
                ax.plot([x], [y], marker=marker, color=color, mfc="none" if e else color, ls="none")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["cache_len"] for r in mine})
        ax.set_xticks(ticks)
        ax.set_xticklabels([_seqlen_label(n) for n in ticks], fontsize=8)
        ax.set_title(f"batch {b}")
        ax.set_xlabel("cache length")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("useful K/V TB/s")
    axes[0][-1].legend(fontsize=7, loc="best")
    c = data.get("config", {})
    fig.suptitle(
        f"Decode: q len 1, {c.get('heads_q')} q / {c.get('heads_kv')} kv heads, d{c.get('d')}, {c.get('dtype')} "
        f"(hollow: K/V expanded, reads 4x)\n{subtitle(data)}",
        fontsize=9,
    )
    return _save(plt, fig, outdir, "decode.png")


def plot_all(data, outdir, head_dims=None, all_impls=False):
    """Writes every figure the data allows; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "decode" in data:  # bench_decode.py's JSON
        os.makedirs(outdir, exist_ok=True)
        return [p for p in [plot_decode(plt, data, outdir)] if p]

    data = bench_table.normalize(data)
    shown = None if all_impls else MAIN_IMPLS
    os.makedirs(outdir, exist_ok=True)
    written = []
    dtypes = sorted({r["dtype"] for r in data.get("rows", [])})
    for dtype in dtypes:
        for mode in ("fwd", "bwd"):
            written.append(plot_tflops(plt, data, outdir, mode, dtype, head_dims, shown))
    written += [
        plot_ratio_cudnn(plt, data, outdir),
        plot_memory(plt, data, outdir),
        plot_peak_fraction(plt, data, outdir, shown),
        plot_gpt2(plt, data, outdir),
        plot_host_overhead(plt, data, outdir),
    ]
    return [p for p in written if p]


def main(argv=None):
    p = argparse.ArgumentParser(description="Plot the JSON of benchmarks/bench_gpu.py (or bench_decode.py) into PNGs")
    p.add_argument("json", help="results JSON written by bench_gpu.py --json or bench_decode.py --json")
    p.add_argument("--out", "-o", default="plots", help="output folder (created)")
    p.add_argument("--head-dims", default=None, help="head dims of the TFLOP/s figures (default: all in the JSON)")
    p.add_argument(
        "--all-impls",
        action="store_true",
        help="TFLOP/s and peak-fraction figures with every implementation (default: " + ", ".join(MAIN_IMPLS) + ")",
    )
    args = p.parse_args(argv)
    with open(args.json) as fh:
        data = json.load(fh)
    dims = [int(x) for x in args.head_dims.split(",")] if args.head_dims else None
    paths = plot_all(data, args.out, dims, args.all_impls)
    for path in paths:
        print(path)
    if not paths:
        print("plot.py: nothing to plot in " + args.json, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
