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
    return subprocess.run([sys.executable] + args, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


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


def synthetic_results():
    """A JSON shaped like bench_gpu.py's, with made-up numbers (for plotting tests only)."""
    peaks = {"flashattn_ext": 300.0, "cudnn": 550.0, "fa2": 320.0, "mem_efficient": 160.0, "naive": 100.0}
    rows = []
    for mode in ("fwd", "bwd"):
        for d in (64, 128):
            for causal in (False, True):
                for n in (512, 1024, 2048, 4096, 8192, 16384):
                    for impl, peak in peaks.items():
                        if impl == "naive" and n == 16384:
                            rows.append(dict(impl=impl, mode=mode, dtype="bf16", d=d, n=n, b=16384 // n,
                                             h=2048 // d, causal=causal, ms=None, tflops=None,
                                             skipped="would need ~64 GiB (> 40 GiB)"))
                            continue
                        tf = peak * (1 - 0.4 * 512 / n) * (0.8 if causal else 1.0) * (0.8 if mode == "bwd" else 1.0)
                        flops = attention_flops(16384 // n, 2048 // d, n, n, d, causal, mode)
                        rows.append(dict(impl=impl, mode=mode, dtype="bf16", d=d, n=n, b=16384 // n, h=2048 // d,
                                         causal=causal, ms=flops / (tf * 1e12) * 1e3, tflops=tf))
    memory = []
    for n in (4096, 16384, 32768):
        for impl, per in (("flashattn_ext", 2**15), ("naive", 16 * n * 2 * 4), ("fa2", 2**15)):
            e = dict(impl=impl, b=1, h=16, n=n, d=128, dtype="bf16", causal=False)
            if impl == "naive" and n == 32768:
                e.update(peak_extra_bytes=None, peak_extra_gib=None, error="OOM")
            else:
                b = per * n
                e.update(peak_extra_bytes=b, peak_extra_gib=b / 2**30)
            memory.append(e)
    gpt2 = dict(b=8, h=12, n=1024, d=64, dtype="fp16", causal=True, mode="fwd+bwd", impls={
        "flashattn_ext": dict(ms=0.30), "naive": dict(ms=1.9), "fa2": dict(ms=0.33), "cudnn": dict(ms=0.40),
        "mem_efficient": dict(ms=None, error="RuntimeError: made up")})
    for r in gpt2["impls"].values():
        if r.get("ms"):
            r["speedup_vs_naive"] = 1.9 / r["ms"]
    return dict(synthetic=True, gpu="SYNTHETIC TEST DATA", device="cuda", torch="0.0.0", cuda="0.0", cudnn=0,
                date="2000-01-01T00:00:00+00:00", ceilings=dict(matmul_tflops=700.0, matmul_dtype="bf16",
                                                                copy_tbs=4.2),
                grid=dict(tokens=16384, head_total=2048), rows=rows, memory=memory, gpt2=gpt2)


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


def test_bench_gpu_cpu_quick(tmp_path):
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    r = _run([os.path.join(BENCH, "bench_gpu.py"), "--device", "cpu", "--quick", "--json", str(out), "--md", str(md)])
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    for key in ("gpu", "torch", "cuda", "cudnn", "date", "ceilings", "rows", "memory", "gpt2"):
        assert key in data
    assert {"matmul_tflops", "copy_tbs"} <= set(data["ceilings"])
    assert data["rows"]
    for row in data["rows"]:
        for f in ROW_FIELDS:
            assert f in row, (f, row)
        assert row["mode"] in ("fwd", "bwd")
        assert row["ms"] is not None or row.get("skipped") or row.get("error"), row
    # torch's CPU flash kernel and the naive path always run; CUDA-only backends are skipped, not errors.
    for impl in ("fa2", "naive"):
        assert all(r["tflops"] and r["tflops"] > 0 for r in data["rows"] if r["impl"] == impl)
    assert all(r.get("skipped") for r in data["rows"] if r["impl"] in ("cudnn", "mem_efficient"))
    # TFLOP/s from the one FLOP formula (flashattn_ext.reference.attention_flops).
    for row in data["rows"]:
        if row["ms"]:
            flops = attention_flops(row["b"], row["h"], row["n"], row["n"], row["d"], row["causal"], row["mode"])
            assert math.isclose(row["tflops"], flops / (row["ms"] * 1e-3) / 1e12, rel_tol=1e-6), row
    assert {"flashattn_ext", "cudnn", "fa2", "mem_efficient", "naive"} == {r["impl"] for r in data["rows"]}
    assert "naive" in data["gpt2"]["impls"]
    assert md.read_text().startswith("Measured by")
    # The short table is printed last.
    assert r.stdout.strip().splitlines()[0].startswith("flashattn_ext:")


def test_bench_gpu_time_budget(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bg = _load("bench_gpu")
    rc = bg.main(["--device", "cpu", "--quick", "--no-memory", "--no-gpt2", "--no-ceilings", "--impls", "naive",
                  "--modes", "fwd", "--time-budget", "1e-9", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["budget_exceeded"]["points_not_run"] == 4 and data["rows"] == []
    assert "TIME BUDGET EXCEEDED" in capsys.readouterr().out


def test_bench_table_and_flops():
    bt = _load("bench_table")
    data = synthetic_results()
    md = bt.markdown_report(data)
    assert "| d128 fwd |" in md and "ours / FA2 (SDPA flash)" in md and "OOM" in md
    text = bt.text_summary(data)
    assert "ours/fa2" in text and "GPT-2" in text
    assert attention_flops(1, 1, 1024, 1024, 64, False, "fwd") == 4 * 1024 * 1024 * 64
    assert attention_flops(1, 1, 1024, 1024, 64, True, "bwd") == 2.5 * 2 * 1024 * 1024 * 64
    assert attention_flops(2, 3, 100, 200, 32, False, "fwd+bwd") == 3.5 * 4 * 2 * 3 * 100 * 200 * 32
    bg = _load("bench_gpu")
    assert math.isclose(bg.tflops(1e12, 1000.0), 1.0)


def test_kernel_check_case_on_cpu():
    """kernel_check.py's correctness case (the package's oracle and tolerance
    rule), run on the CPU kernels: it passes, and a broken output fails it."""
    pytest.importorskip("flashattn_ext.tolerance")
    import torch

    kc = _load("kernel_check")
    for dtype in (torch.bfloat16, torch.float32):
        ok, errs, lse_ok, comps = kc.check_case(b=1, nq=37, nk=53, hq=4, hk=2, d=32, dtype=dtype, causal=True,
                                                bottom_right=True, window=(-1, -1), device="cpu")
        assert ok and lse_ok, comps
        assert set(errs) == {"out", "lse", "dq", "dk", "dv"}
    real_fwd = kc._ops.fwd

    def broken_fwd(*args):
        out, lse = real_fwd(*args)
        return out * 1.01, lse  # a 1% error: far above the rule's bound

    kc._ops = type("Ops", (), {"fwd": staticmethod(broken_fwd)})
    ok, errs, lse_ok, comps = kc.check_case(b=1, nq=37, nk=53, hq=4, hk=2, d=32, dtype=torch.float32, causal=True,
                                            bottom_right=True, device="cpu")
    assert not ok and lse_ok
    assert [c["name"] for c in comps if not c["ok"]][0] == "out"


def test_plot_synthetic(tmp_path):
    pytest.importorskip("matplotlib")
    src = tmp_path / "synthetic.json"
    src.write_text(json.dumps(synthetic_results()))
    outdir = tmp_path / "plots"
    r = _run([os.path.join(BENCH, "plot.py"), str(src), "--out", str(outdir)])
    assert r.returncode == 0, r.stdout + r.stderr
    names = sorted(os.listdir(outdir))
    assert names == ["gpt2.png", "memory.png", "peak_fraction.png", "tflops_bwd.png", "tflops_fwd.png"]
    for n in names:
        assert (outdir / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not _api_present(), reason="flashattn_ext (with its Python API) is not importable")
def test_train_gpt_compare_smoke(tmp_path):
    out = tmp_path / "train.json"
    r = _run([os.path.join(ROOT, "examples", "train_gpt.py"), "--compare", "--steps", "6", "--log-every", "3",
              "--json", str(out)])
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
