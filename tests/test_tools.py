"""Fast CPU tests of the user-facing tools: `python -m flashattn_ext`, the
benchmark scripts (bench_gpu.py, bench_table.py, plot.py) and examples/train_gpt.py.
They check that the tools run and write what they promise, not kernel speed."""

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from flashattn_ext.reference import attention_flops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
ROW_FIELDS = ("impl", "mode", "dtype", "d", "n", "b", "h", "causal", "ms", "tflops")


def _env():
    env = dict(os.environ)
    # An installed flashattn_ext or one on PYTHONPATH wins; else the checkout (built in place).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), ROOT) if p)
    env.setdefault("OMP_NUM_THREADS", "1")  # spinning OpenMP threads crawl on a shared, busy machine
    return env


def _run(args, timeout=120):
    return subprocess.run([sys.executable] + args, env=_env(), capture_output=True, text=True, timeout=timeout)


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    sys.path.insert(0, BENCH)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path[:] = saved  # the scripts extend sys.path on import; keep it as it was
    return mod


# Synthetic grid: each implementation's TFLOP/s is its own function of seqlen, so
# a ratio against the wrong peer, at the wrong seqlen or inverted gives other numbers.
SYN_BASE = {
    "ours_sdpa": 300.0,
    "ours_native": 310.0,
    "sdpa_default": 500.0,
    "sdpa_cudnn": 550.0,
    "sdpa_flash": 320.0,
    "sdpa_mem_efficient": 160.0,
    "naive": 100.0,
}
SYN_SLOPE = {
    "ours_sdpa": 0.90,
    "ours_native": 0.60,
    "sdpa_default": 0.30,
    "sdpa_cudnn": 0.10,
    "sdpa_flash": 0.80,
    "sdpa_mem_efficient": 0.2,
    "naive": 0.1,
}
SYN_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
SYN_MISSING = {("ours_sdpa", "bwd", 128, True, 2048)}  # an error row: its ratios must read "-"


def syn_tflops(impl, mode, d, causal, n):
    if impl == "naive" and n == 16384 or (impl, mode, d, causal, n) in SYN_MISSING:
        return None
    return (
        SYN_BASE[impl]
        * (1 - SYN_SLOPE[impl] * 512 / n)
        * (0.8 if causal else 1.0)
        * (0.7 if mode == "bwd" else 1.0)
        * (1.1 if d == 128 else 1.0)
    )


def synthetic_results(legacy=False):
    """A JSON shaped like bench_gpu.py's, with made-up numbers (legacy: the old impl names)."""
    rows = []
    for mode in ("fwd", "bwd"):
        for d in (64, 128):
            for causal in (False, True):
                for n in SYN_SEQLENS:
                    for impl in SYN_BASE:
                        tf = syn_tflops(impl, mode, d, causal, n)
                        row = dict(
                            impl=impl,
                            mode=mode,
                            dtype="bf16",
                            d=d,
                            n=n,
                            b=16384 // n,
                            h=2048 // d,
                            causal=causal,
                            ms=None,
                            tflops=None,
                        )
                        if impl == "sdpa_default":
                            row["backend"] = "cudnn" if d == 128 else "flash"
                        if tf is None:
                            row["error" if impl != "naive" else "skipped"] = "made up"
                        else:
                            flops = attention_flops(16384 // n, 2048 // d, n, n, d, causal, mode)
                            row.update(ms=flops / (tf * 1e12) * 1e3, tflops=tf, frac_matmul=tf / 700.0)
                        rows.append(row)
    memory = []
    for n in (4096, 16384, 32768):
        for impl, per in (
            ("ours_sdpa", 2**15),
            ("ours_native", 2**15),
            ("naive", 16 * n * 2 * 4),
            ("sdpa_flash", 2**15),
        ):
            e = dict(impl=impl, b=1, h=16, n=n, d=128, dtype="bf16", causal=False)
            if impl == "naive" and n == 32768:
                e.update(peak_extra_bytes=None, peak_extra_gib=None, error="OOM")
            else:
                b = per * n
                e.update(peak_extra_bytes=b, peak_extra_gib=b / 2**30)
            memory.append(e)
    gpt2 = dict(
        b=8,
        h=12,
        n=1024,
        d=64,
        dtype="fp16",
        causal=True,
        mode="fwd+bwd",
        impls={
            "ours_sdpa": dict(ms=0.26),
            "ours_native": dict(ms=0.25),
            "sdpa_default": dict(ms=0.21, backend="cudnn"),
            "sdpa_cudnn": dict(ms=0.20),
            "sdpa_flash": dict(ms=0.33),
            "naive": dict(ms=1.9),
            "sdpa_mem_efficient": dict(ms=None, error="RuntimeError: made up"),
        },
    )
    for r in gpt2["impls"].values():
        if r.get("ms"):
            r["speedup_vs_naive"] = 1.9 / r["ms"]
    host = dict(
        b=1,
        h=2,
        n=128,
        d=64,
        dtype="bf16",
        causal=True,
        method="made up",
        impls={
            impl: {
                mode: dict(us=us * k, gpu_busy=True) for mode, k in (("fwd", 1.0), ("fwd_grad", 1.5), ("fwd+bwd", 4.0))
            }
            for impl, us in (("sdpa_default", 11.0), ("ours_sdpa", 9.0), ("ours_native", 8.0))
        },
    )
    host["impls"]["sdpa_default"]["backend"] = "flash"
    data = dict(
        synthetic=True,
        gpu="SYNTHETIC TEST DATA",
        device="cuda",
        torch="0.0.0",
        cuda="0.0",
        cudnn=0,
        date="2000-01-01T00:00:00+00:00",
        ceilings=dict(matmul_tflops=700.0, matmul_dtype="bf16", copy_tbs=4.2),
        grid=dict(tokens=16384, head_total=2048),
        rows=rows,
        memory=memory,
        gpt2=gpt2,
        host_overhead=host,
        skipped_impls={"fa4": "import flash_attn.cute failed: made up"},
    )
    if legacy:  # the JSON of runs before the rename: no ours_sdpa / sdpa_default, old names
        old = {
            "ours_native": "flashattn_ext",
            "sdpa_cudnn": "cudnn",
            "sdpa_flash": "fa2",
            "sdpa_mem_efficient": "mem_efficient",
        }
        data["rows"] = [dict(r, impl=old[r["impl"]]) for r in rows if r["impl"] in old]
        data["memory"] = [dict(m, impl=old.get(m["impl"], m["impl"])) for m in memory if m["impl"] != "ours_sdpa"]
        data["gpt2"]["impls"] = {
            old.get(k, k): v for k, v in gpt2["impls"].items() if k not in ("ours_sdpa", "sdpa_default")
        }
        for k in ("host_overhead", "skipped_impls"):
            del data[k]
    return data


def _api_present():
    try:
        import flashattn_ext  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return all(hasattr(flashattn_ext, n) for n in ("flash_attn_func", "scaled_dot_product_attention"))


@pytest.mark.skipif(not _api_present(), reason="flashattn_ext (with its Python API) is not importable")
def test_main_cpu_quick(tmp_path):
    out = tmp_path / "report.json"
    r = _run(["-m", "flashattn_ext", "--device", "cpu", "--quick", "--no-progress", "--json", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout
    report = json.loads(out.read_text())
    assert report["ok"] and report["checks"] and report["timings"]
    assert report["device"]["type"] == "cpu"


def test_main_help(capsys):
    main = pytest.importorskip("flashattn_ext.__main__", reason="flashattn_ext is not importable")
    with pytest.raises(SystemExit) as exc:
        main.parse_args(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--device", "--dtype", "--shapes", "--json", "--quick"):
        assert opt in out


def test_parse_build_info():
    main = pytest.importorskip("flashattn_ext.__main__", reason="flashattn_ext is not importable")
    bi = main.parse_build_info("cuda=1;archs=80;90;head_dims=32,64,96,128,192,256")
    assert bi == {"cuda": "1", "archs": "80;90", "head_dims": "32,64,96,128,192,256"}
    assert main.parse_build_info("cuda=0;archs=;head_dims=") == {"cuda": "0", "archs": "", "head_dims": ""}


NEW_IMPLS = {"ours_sdpa", "ours_native", "sdpa_default", "sdpa_cudnn", "sdpa_flash", "sdpa_mem_efficient", "naive"}
RATIO_HEADERS = [
    "ours_sdpa / sdpa_cudnn",
    "ours_sdpa / sdpa_default",
    "ours_sdpa / sdpa_flash",
    "ours_native / sdpa_cudnn",
]


def test_bench_gpu_cpu_quick(tmp_path):
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    r = _run([os.path.join(BENCH, "bench_gpu.py"), "--device", "cpu", "--quick", "--json", str(out), "--md", str(md)])
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    for key in (
        "gpu",
        "torch",
        "cuda",
        "cudnn",
        "date",
        "ceilings",
        "rows",
        "memory",
        "gpt2",
        "host_overhead",
        "skipped_impls",
    ):
        assert key in data
    assert {"matmul_tflops", "copy_tbs"} <= set(data["ceilings"])
    peak = data["ceilings"]["matmul_tflops"]
    assert data["rows"]
    for row in data["rows"]:
        for f in ROW_FIELDS:
            assert f in row, (f, row)
        assert row["mode"] in ("fwd", "bwd")
        assert row["ms"] is not None or row.get("skipped") or row.get("error"), row
        if row["tflops"]:
            assert math.isclose(row["frac_matmul"], row["tflops"] / peak), row
    # Every implementation has its rows; the CUDA-only ones are skipped, not errors; fa4 runs or is
    # recorded as skipped once.
    impls = {r["impl"] for r in data["rows"]}
    assert impls - {"fa4"} == NEW_IMPLS
    if "fa4" not in impls:
        assert "fa4" in data["skipped_impls"]
    assert all(r.get("skipped") for r in data["rows"] if r["impl"] in ("sdpa_cudnn", "sdpa_mem_efficient"))
    # Ours through both APIs (no fallback to torch), torch's default and flash, naive: all measured.
    for impl in ("ours_sdpa", "ours_native", "sdpa_default", "sdpa_flash", "naive"):
        assert all(r["tflops"] and r["tflops"] > 0 for r in data["rows"] if r["impl"] == impl), impl
    assert all(r.get("backend") for r in data["rows"] if r["impl"] == "sdpa_default")
    g = data["gpt2"]["impls"]
    for impl in ("ours_sdpa", "ours_native", "sdpa_default", "sdpa_flash", "naive"):
        assert g[impl]["ms"] > 0 and g[impl]["speedup_vs_naive"] > 0, impl
    assert g["sdpa_cudnn"].get("skipped")
    h = data["host_overhead"]
    assert (h["b"], h["h"], h["n"], h["d"]) == (1, 2, 128, 64)
    for impl in ("sdpa_default", "ours_sdpa", "ours_native"):
        for mode in ("fwd", "fwd_grad", "fwd+bwd"):
            assert h["impls"][impl][mode]["us"] > 0, (impl, mode)
    assert h["impls"]["sdpa_cudnn"]["fwd"].get("skipped")
    text = md.read_text()
    assert text.startswith("Measured by") and "Host (CPU) time per call" in text
    for hdr in RATIO_HEADERS:
        assert hdr in text
    # The short table is printed last: its header and the four ratios.
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("flashattn_ext:")
    assert "sdpa/cudnn" in r.stdout and "native/cudnn" in r.stdout and "host us/call" in r.stdout


def test_bench_gpu_time_budget(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bg = _load("bench_gpu")
    rc = bg.main(
        [
            "--device",
            "cpu",
            "--quick",
            "--no-memory",
            "--no-gpt2",
            "--no-ceilings",
            "--no-host",
            "--impls",
            "naive",
            "--modes",
            "fwd",
            "--budget-s",
            "1e-9",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["budget_exceeded"]["points_not_run"] == 4 and data["rows"] == []
    assert "TIME BUDGET EXCEEDED" in capsys.readouterr().out


def test_bench_gpu_old_impl_names_and_flops():
    bg = _load("bench_gpu")
    args = bg.parse_args(["--impls", "flashattn_ext,cudnn,fa2,mem_efficient", "--time-budget", "5"])
    assert bg._names(args.impls, bg.ALL_IMPLS, "impls", _load("bench_table").LEGACY_NAMES) == [
        "ours_native",
        "sdpa_cudnn",
        "sdpa_flash",
        "sdpa_mem_efficient",
    ]
    assert args.budget_s == 5
    # The one FLOP formula: flashattn_ext.reference.attention_flops (no copy in bench_gpu).
    assert not hasattr(bg, "attn_flops")
    assert bg.attention_flops(1, 1, 1024, 1024, 64, False, "fwd") == 4 * 1024 * 1024 * 64
    assert bg.attention_flops(1, 1, 1024, 1024, 64, True, "bwd") == 2.5 * 2 * 1024 * 1024 * 64
    if _api_present():
        from flashattn_ext.reference import attention_flops

        assert bg.attention_flops is attention_flops
    assert math.isclose(bg.tflops(1e12, 1000.0), 1.0)


def _md_table(md, first_header):
    """The markdown table whose header row starts with `| first_header |`: (headers, {case: cells})."""
    lines = md.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {first_header} |") and "---" in lines[i + 1])
    headers = [c.strip() for c in lines[start].strip("|").split("|")]
    body = {}
    for ln in lines[start + 2 :]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip("|").split("|")]
        body[cells[0]] = dict(zip(headers, cells))
    return headers, body


def _cases():
    for mode in ("fwd", "bwd"):
        for d in (64, 128):
            for causal in (False, True):
                yield f"d{d} {'causal ' if causal else ''}{mode}", mode, d, causal


def test_bench_table_ratios_are_right():
    """Every TFLOP/s, ratio and fraction cell of the markdown, and every geometric
    mean (min-max) of the text summary, recomputed here from the made-up functions."""
    bt = _load("bench_table")
    data = synthetic_results()
    md = bt.markdown_report(data)
    headers, body = _md_table(md, "case")
    assert headers[-4:] == RATIO_HEADERS  # exactly the four ratios, in this order
    assert sum(" / " in h for h in headers) == 4
    names = {
        "ours_sdpa": "ours (SDPA API)",
        "ours_native": "ours (flash_attn_func)",
        "sdpa_default": "SDPA default",
        "sdpa_cudnn": "cuDNN (SDPA)",
        "sdpa_flash": "FA2 (SDPA flash)",
        "naive": "naive",
    }
    assert len(body) == 8
    for label, mode, d, causal in _cases():
        row = body[label]
        for impl, col in names.items():
            want = [syn_tflops(impl, mode, d, causal, n) for n in SYN_SEQLENS]
            assert row[col] == "/".join("-" if x is None else f"{x:.0f}" for x in want), (label, impl)
        for hdr in RATIO_HEADERS:
            num, den = hdr.split(" / ")
            want = []
            for n in SYN_SEQLENS:
                a, b = syn_tflops(num, mode, d, causal, n), syn_tflops(den, mode, d, causal, n)
                want.append("-" if a is None or b is None else f"{a / b:.2f}")
            assert row[hdr] == "/".join(want), (label, hdr)
    assert body["d128 causal bwd"]["ours_sdpa / sdpa_cudnn"].split("/")[2] == "-"  # the error row
    # Fractions of the matmul ceiling (700 TFLOP/s).
    _, frac = _md_table(md[md.index("Fraction of the") :], "case")
    for label, mode, d, causal in _cases():
        for impl in ("ours_sdpa", "sdpa_cudnn"):
            want = [syn_tflops(impl, mode, d, causal, n) for n in SYN_SEQLENS]
            assert frac[label][names[impl]] == "/".join("-" if x is None else f"{x / 700.0:.2f}" for x in want)
    assert "cudnn (24 cells)" in md and "flash (24 cells)" in md
    # GPT-2, host time and memory tables.
    _, gpt2 = _md_table(md, "impl")
    assert gpt2["ours_sdpa"]["speedup over naive"] == f"{1.9 / 0.26:.2f}"
    assert gpt2["sdpa_default (cudnn)"]["ms"] == "0.210"
    assert "| ours_sdpa | 9.0 | 13.5 | 36.0 |" in md and "| sdpa_default (flash) | 11.0 | 16.5 | 44.0 |" in md
    assert "| naive | 2.0 GiB | 32.0 GiB | OOM |" in md
    assert "fa4: not run" in md

    text = bt.text_summary(data)
    lines = text.splitlines()
    hdr = next(ln for ln in lines if ln.startswith("case"))
    assert hdr.split()[-4:] == ["sdpa/cudnn", "sdpa/default", "sdpa/flash", "native/cudnn"]
    assert "fa2" not in text and "ours/" not in text
    for label, mode, d, causal in _cases():
        line = next(ln for ln in lines if ln.startswith(label + " ") and ln[len(label) : len(label) + 2] == "  ")
        want = [f"{syn_tflops('ours_sdpa', mode, d, causal, n) or 0:.0f}" for n in SYN_SEQLENS]
        want = ["-" if w == "0" else w for w in want]
        for hdr_ in RATIO_HEADERS:
            num, den = hdr_.split(" / ")
            rs = [
                syn_tflops(num, mode, d, causal, n)
                and syn_tflops(den, mode, d, causal, n)
                and syn_tflops(num, mode, d, causal, n) / syn_tflops(den, mode, d, causal, n)
                for n in SYN_SEQLENS
            ]
            rs = [x for x in rs if x]
            gm = math.exp(sum(map(math.log, rs)) / len(rs))
            want += [f"{gm:.2f}", f"({min(rs):.2f}-{max(rs):.2f})"]
        assert line[len(label) :].split() == want, (label, line)
    assert "GPT-2" in text and "ours_sdpa 0.260 (7.3x)" in text and "host us/call" in text
    assert "best fraction of the matmul ceiling (700 TFLOP/s)" in text
    assert lines[-1].startswith("fa4 not run") or "TIME BUDGET" in lines[-1] or lines[-1].startswith("elapsed")


def test_bench_table_vs_best_names_the_fastest_peer(tmp_path):
    """--vs-best: at each point ours / the fastest of cuDNN, FA4 and the default,
    with that peer's letter, and the geomean; a grid split over two JSON files
    (one visit's calls) reads as the whole."""
    bt = _load("bench_table")
    data = synthetic_results()

    def fa4(n):  # slower than cuDNN at short seqlens, faster at long ones
        return 400.0 + 0.02 * n

    for row in list(data["rows"]):
        if row["impl"] == "sdpa_cudnn":
            data["rows"].append(dict(row, impl="fa4", tflops=fa4(row["n"])))
    headers, body = _md_table(bt.vs_best_table(data), "case")
    assert headers[1:-1] == ["512", "1k", "2k", "4k", "8k", "16k"] and headers[-1] == "geomean"
    letters = set()
    for label, mode, d, causal in _cases():
        ratios = []
        for n, hdr in zip(SYN_SEQLENS, headers[1:-1]):
            mine = syn_tflops("ours_sdpa", mode, d, causal, n)
            peers = {"c": syn_tflops("sdpa_cudnn", mode, d, causal, n), "f": fa4(n)}
            peers["d"] = syn_tflops("sdpa_default", mode, d, causal, n)
            letter, best = max(peers.items(), key=lambda kv: kv[1])
            if mine is None:
                assert body[label][hdr] == "-", (label, hdr)
                continue
            letters.add(letter)
            ratios.append(mine / best)
            assert body[label][hdr] == f"{mine:.0f}/{best:.0f}{letter} {mine / best:.2f}", (label, hdr)
        geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        assert body[label]["geomean"] == f"{geo:.2f}", label
    assert letters == {"c", "f"}  # the table does switch peers along the seqlens
    # Two files, each with half of the cases, merged.
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(dict(data, rows=[r for r in data["rows"] if r["d"] == 64])))
    b.write_text(json.dumps(dict(data, rows=[r for r in data["rows"] if r["d"] == 128])))
    out = tmp_path / "vs_best.md"
    assert bt.main([str(a), str(b), "--vs-best", "-o", str(out)]) == 0
    assert out.read_text().strip() == bt.vs_best_table(data).strip()


def test_bench_table_reads_old_json():
    """JSON of the old impl names (flashattn_ext, cudnn, fa2, mem_efficient) reads as the new ones."""
    bt = _load("bench_table")
    data = synthetic_results(legacy=True)
    md = bt.markdown_report(data)
    headers, body = _md_table(md, "case")
    assert headers[-1] == "ours_native / sdpa_cudnn" and "ours (flash_attn_func)" in headers
    want = [
        syn_tflops("ours_native", "fwd", 64, False, n) / syn_tflops("sdpa_cudnn", "fwd", 64, False, n)
        for n in SYN_SEQLENS
    ]
    assert body["d64 fwd"]["ours_native / sdpa_cudnn"] == "/".join(f"{x:.2f}" for x in want)
    text = bt.text_summary(data)
    assert "TFLOP/s of ours_native" in text and "sdpa_flash" in text
    assert bt.normalize(data)["rows"][0]["impl"] in NEW_IMPLS and data["rows"][0]["impl"] == "flashattn_ext"


def test_host_us_per_call_cpu():
    import time as _time

    import torch

    ho = _load("host_overhead")
    r = ho.host_us_per_call(lambda: _time.sleep(0.0005), torch.device("cpu"), calls=4, reps=3, warmup=1)
    assert 450 < r["us"] < 50_000 and r["calls"] == 4 and r["reps"] == 3


def test_activated_host_times_cpu():
    """host_overhead.py --activated's measurement on the CPU (a few calls): every
    implementation and mode timed, none left as an error, our override calls counted."""
    import torch

    from flashattn_ext import backend

    ho = _load("host_overhead")
    backend.reset_calls()
    res = ho.activated_host_times(torch.device("cpu"), rounds=2, calls=3)
    want = (*ho.ACTIVATED_IMPLS, "flash_op_override", "kernels_direct")
    assert sorted(res["impls"]) == sorted(want)
    for impl in want:
        for mode in ho.ACTIVATED_MODES:
            assert res["impls"][impl][mode]["us"] > 0 and res["impls"][impl][mode]["rounds"] == 2, (impl, mode)
    calls = backend.calls()
    assert calls.get(("_scaled_dot_product_flash_attention_for_cpu", backend.IMPL_NAME), 0) > 0, calls
    assert calls.get(("_scaled_dot_product_flash_attention", backend.IMPL_NAME), 0) > 0, calls
    assert not backend.is_active()
    assert "activated" in ho.activated_text(res)


def test_plot_synthetic(tmp_path):
    pytest.importorskip("matplotlib")
    for legacy in (False, True):
        src = tmp_path / f"synthetic{legacy}.json"
        src.write_text(json.dumps(synthetic_results(legacy)))
        outdir = tmp_path / f"plots{legacy}"
        r = _run([os.path.join(BENCH, "plot.py"), str(src), "--out", str(outdir)])
        assert r.returncode == 0, r.stdout + r.stderr
        names = sorted(os.listdir(outdir))
        want = [
            "gpt2.png",
            "host_overhead.png",
            "memory.png",
            "peak_fraction.png",
            "ratio_cudnn.png",
            "tflops_bwd.png",
            "tflops_fwd.png",
        ]
        assert names == (want if not legacy else [n for n in want if n != "host_overhead.png"])
        for n in names:
            assert (outdir / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


GPU_VISIT_TESTS = {
    "test_a_pass.py": "import pytest\n\n@pytest.mark.cuda\ndef test_one():\n    pass\n\n"
    "@pytest.mark.cuda\ndef test_skip():\n    pytest.skip('made up')\n\ndef test_cpu():\n    pass\n",
    "test_b_fail.py": "import pytest\n\n@pytest.mark.cuda\ndef test_ok():\n    pass\n\n"
    "@pytest.mark.cuda\ndef test_bad():\n    assert 0\n",
    "test_c_crash.py": "import ctypes, pytest\n\n@pytest.mark.cuda\ndef test_segfault():\n    ctypes.string_at(0)\n",
    "test_d_cpu.py": "def test_cpu():\n    pass\n",
}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_visit_reports_every_test_file(tmp_path):
    """The test stage runs each test file alone and reports its counts and exit
    code; a segfault is a CRASH that fails the stage, and later files still run."""
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(os.path.join(BENCH, "gpu_visit.sh"), tmp_path / "benchmarks")
    (tmp_path / "tests").mkdir()
    for name, text in GPU_VISIT_TESTS.items():
        (tmp_path / "tests" / name).write_text(text)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    cuda: needs a GPU\n")
    env = _env()
    env.update(
        STAGES="test",
        OUT=str(tmp_path / "out"),
        PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
    )
    r = subprocess.run(
        ["bash", str(tmp_path / "benchmarks" / "gpu_visit.sh")], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 1, r.stdout + r.stderr
    rows = [ln.split("\t") for ln in (tmp_path / "out" / "pytest_summary.tsv").read_text().splitlines()]
    assert rows[0] == ["file", "rc", "passed", "failed", "skipped", "errors", "deselected", "verdict"]
    got = {r_[0]: r_[1:] for r_ in rows[1:]}
    assert got["test_a_pass"] == ["0", "1", "0", "1", "0", "1", "ok"]
    assert got["test_b_fail"] == ["1", "1", "1", "0", "0", "0", "FAILED"]
    assert got["test_c_crash"][0] == "139" and got["test_c_crash"][-1] == "CRASH (signal 11)"
    assert got["test_d_cpu"] == ["5", "0", "0", "0", "0", "1", "ok (no cuda tests)"]
    assert "CRASH (signal 11)" in r.stdout and "visit done, status 1" in r.stdout


@pytest.mark.skipif(not _api_present(), reason="flashattn_ext (with its Python API) is not importable")
def test_train_gpt_compare_smoke(tmp_path):
    out = tmp_path / "train.json"
    r = _run(
        [
            os.path.join(ROOT, "examples", "train_gpt.py"),
            "--compare",
            "--steps",
            "6",
            "--log-every",
            "3",
            "--json",
            str(out),
        ]
    )
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    assert set(data["runs"]) == {"ours", "torch"}
    assert len(data["runs"]["ours"]["losses"]) == 6
    assert data["max_loss_diff_early"] < 1e-3


def _run_generator(script, tmp_path):
    """Runs a code generator on a copy of its folder; returns that copy."""
    src = os.path.dirname(script)
    dst = tmp_path / "gen"
    shutil.copytree(src, dst)
    subprocess.run([sys.executable, str(dst / os.path.basename(script))], check=True)
    return dst


def test_generated_sources_are_current(tmp_path):
    """The committed generated sources equal what their generators write now
    (an edit to a generator without re-running it would fail here)."""
    root = os.path.join(ROOT, "csrc", "cuda")
    gen = _run_generator(os.path.join(root, "hopper", "generate_wgmma.py"), tmp_path)
    with open(os.path.join(root, "hopper", "wgmma_ops.cuh")) as f:
        assert (gen / "wgmma_ops.cuh").read_text() == f.read()
    gen = _run_generator(os.path.join(root, "generate_instantiations.py"), tmp_path / "inst")
    for name in os.listdir(gen / "instantiations"):
        with open(os.path.join(root, "instantiations", name)) as f:
            assert (gen / "instantiations" / name).read_text() == f.read(), name


def test_bench_decode_smoke(tmp_path):
    """bench_decode.py end to end on the CPU (--smoke): every section, every implementation
    measured or recorded as skipped with a reason, the markdown and the figure."""
    out, md = tmp_path / "decode.json", tmp_path / "decode.md"
    r = _run([os.path.join(BENCH, "bench_decode.py"), "--smoke", "--json", str(out), "--md", str(md)])
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    for key in ("torch", "timer", "config", "conventions", "decode", "prefill", "varlen"):
        assert key in data, key
    points = {(row["batch"], row["cache_len"]) for row in data["decode"]}
    assert points == {(1, 64), (1, 128), (2, 64), (2, 128)}
    for row in data["decode"]:
        b, n, c = row["batch"], row["cache_len"], data["config"]
        assert row["kv_bytes"] == 2 * b * n * c["heads_kv"] * c["d"] * 4  # float32 in the smoke run
        if row["impl"] == "copy":
            assert math.isclose(row["copy_tbs"], 2 * row["kv_bytes"] / (row["ms"] * 1e-3) / 1e12)
        elif row["impl"] in ("ours", "ours_paged", "ours_sdpa", "sdpa_flash", "sdpa_default"):
            assert math.isclose(row["useful_tbs"], row["kv_bytes"] / (row["ms"] * 1e-3) / 1e12), row
        else:
            assert row.get("skipped"), row  # cuDNN and the flash-attn package need CUDA
    assert {row["impl"] for row in data["decode"]} >= {
        "ours",
        "ours_paged",
        "ours_sdpa",
        "sdpa_flash",
        "sdpa_default",
        "copy",
    }
    assert all(row["tflops"] > 0 for row in data["prefill"] if row["impl"] != "sdpa_cudnn")
    assert {(row["section"], row["impl"]) for row in data["varlen"]} == {
        (s, i) for s in ("equal", "mixed") for i in ("varlen", "padded")
    }
    assert all(row["useful_tflops"] > 0 and row["tokens"] == 256 for row in data["varlen"])
    text = md.read_text()
    assert "## Decode" in text and "## Prefill" in text and "## Varlen" in text
    assert "(decode: useful K/V TB/s; copy: read + written TB/s)" in r.stdout
    if importlib.util.find_spec("matplotlib"):
        r = _run([os.path.join(BENCH, "plot.py"), str(out), "--out", str(tmp_path / "plots")])
        assert r.returncode == 0, r.stdout + r.stderr
        assert (tmp_path / "plots" / "decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_cpu_decode_mode(tmp_path):
    """bench_cpu.py's decode mode: one row per (dtype, cache, batch, impl), each timed."""
    out = tmp_path / "cpu.json"
    r = _run(
        [
            os.path.join(BENCH, "bench_cpu.py"),
            *("--modes", "decode", "--dtypes", "float32,bfloat16", "--decode-caches", "64,96"),
            *("--decode-batches", "1,2", "--decode-heads", "4,2", "--decode-dim", "32"),
            *("--impls", "ours,sdpa,naive,ours_paged", "--decode-page", "16"),
            *("--reps", "1", "--warmup", "0", "--min-rep-ms", "1"),
            *("--json", str(out), "--markdown", str(tmp_path / "cpu.md")),
        ]
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    assert all(row["calls"] >= 1 for row in rows)
    # The machine and the code measured in every row (cpu_src: csrc/cpu's hash, also without git).
    assert all({"cpu", "isa", "threads", "commit", "cpu_src", "cuda_build"} <= row.keys() for row in rows)
    assert len({row["cpu_src"] for row in rows}) == 1 and len(rows[0]["cpu_src"]) == 12
    table = (tmp_path / "cpu.md").read_text().splitlines()
    assert table[2].startswith("| threads | mode |") and table[2].endswith(
        "| ours / sdpa | ours / naive | ours / ours_paged |"
    )
    assert len(table) == 4 + 2 * 2 * 2  # header lines, then one line per (dtype, cache, batch)
    assert {(row["dtype"], row["n"], row["b"], row["impl"]) for row in rows} == {
        (dt, n, b, impl)
        for dt in ("float32", "bfloat16")
        for n in (64, 96)
        for b in (1, 2)
        for impl in ("ours", "sdpa", "naive", "ours_paged")
    }
    assert all(row["mode"] == "decode" and row["h"] == 4 and row["h_kv"] == 2 and row["ms"] > 0 for row in rows)


def test_bench_cpu_times_enough_calls_a_repetition():
    """bench_cpu.py's repetitions: as many calls in a row as fill --min-rep-ms
    for the slowest implementation, the same count for all."""
    import time as _time

    mod = _load("bench_cpu")
    steps = {"fast": lambda: _time.sleep(0.0005), "slow": lambda: _time.sleep(0.004)}
    calls = mod.calls_per_rep(steps, min_rep_ms=40.0)
    assert 2 <= calls <= 10  # 40 ms over a 4 ms call (sleep overshoots, never undershoots)
    assert mod.calls_per_rep({"one": lambda: _time.sleep(0.004)}, min_rep_ms=1.0) == 1


def test_bench_cpu_knob_adds_an_implementation(tmp_path):
    """bench_cpu.py --knob NAME=VALUE: ours_knob, ours with that CPU test switch,
    timed beside ours in the same run (its rows, its ratio column); an unknown
    switch fails before anything is timed, naming the ones there are."""
    out, md = tmp_path / "cpu.json", tmp_path / "cpu.md"
    common = ("--modes", "fwd", "--dtypes", "float32", "--seqlens", "64", "--reps", "1", "--warmup", "0")
    r = _run(
        [os.path.join(BENCH, "bench_cpu.py"), *common, "--impls", "ours,sdpa", "--knob", "claim_one_item=1"]
        + ["--json", str(out), "--markdown", str(md)]
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    assert {(row["causal"], row["impl"]) for row in rows} == {
        (c, i) for c in (False, True) for i in ("ours", "sdpa", "ours_knob")
    }
    assert all(row["ms"] > 0 and row["fused_softmax"] in ("avx512bf16", "avx2", "none") for row in rows)
    assert md.read_text().splitlines()[2].endswith("| ours / sdpa | ours / ours_knob |")
    r = _run([os.path.join(BENCH, "bench_cpu.py"), *common, "--impls", "ours", "--knob", "no_such_knob=1"])
    assert r.returncode != 0 and "no CPU test knob named 'no_such_knob'" in r.stdout + r.stderr


def test_bench_decode_order_and_budget():
    """The important decode points (batch 8/32, cache 8k-32k) run first; batch 128 last."""
    mod = _load("bench_decode")
    cfg = mod.shapes(smoke=False)
    pts = mod.decode_points(cfg, quick=False)
    assert len(pts) == len(set(pts)) == 4 * 8
    assert set(pts[:6]) == {(b, n) for b in (8, 32) for n in (8192, 16384, 32768)}
    assert all(b == 128 for b, _ in pts[-8:])
    assert sum(cfg["varlen"]["mixed"]) == cfg["varlen"]["tokens"]
