#!/usr/bin/env python3
"""Paged KV against contiguous KV, the serving issue's bars (issue 25), each
ratio paged / contiguous measured in the same run:

prefill  flash_attn_with_kvcache: q 512 appended to (attending) an 8k cache,
         batch 4, 32 / 8 heads, d128, bf16, causal bottom-right; the contiguous
         cache against pages of 256 and of 16 keys in a random order (bar: at
         most 1.1x; also 128, 64, 32; and 32, 16 in the cache's order, -inorder:
         what the random order itself costs), and cache_batch_idx /
         cache_leftpad on the contiguous one.
varlen   flash_attn_varlen_func: 8 sequences of 1k..4k keys (queries as many),
         32 / 8 heads, d128, bf16, causal; packed contiguous k / v against the same
         keys in pages of 256 and of 16 (bar: paged at 0.9x or better of the
         contiguous call's speed, i.e. time ratio at most 1/0.9).

    python benchmarks/bench_paged.py --json paged.json     # H200, ~20 s
    python benchmarks/bench_paged.py --smoke               # tiny, on the CPU: the code path

Timing: bench_gpu.make_timer (triton do_bench medians, L2 flushed). The kernel
each call ran is recorded (profiler) so that a ratio is never between two
different routes by accident.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import make_timer  # noqa: E402

from flashattn_ext import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: E402


def paged(cache, page, gen, shuffled=True):
    """(b, n, h, d) -> pages (b * n / page + 3, page, h, d) in a random order (else in the
    cache's order) and the block table."""
    b, n, h, d = cache.shape
    per = n // page
    blocks = b * per + 3
    perm = torch.randperm(blocks, generator=gen)[: b * per] if shuffled else torch.arange(b * per)
    pages = torch.randn((blocks, page, h, d), generator=gen).to(cache.dtype).to(cache.device)
    pages[perm.to(cache.device)] = cache.reshape(b * per, page, h, d)
    return pages, perm.view(b, per).to(device=cache.device, dtype=torch.int32)


def kernels_of(fn, device):
    if device.type != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.name.split("<")[0].split("(")[0] for e in prof.events() if e.device_type.name == "CUDA"}
    return sorted(n for n in names if "flash" in n)


# 256 and 16: the bar's; 128 .. 32: the cost of a box per page between them.
PREFILL_PAGES = (256, 128, 64, 32, 16)


def prefill_points(device, dtype, bench, gen, smoke):
    b, hq, hkv, d = (2, 4, 2, 64) if smoke else (4, 32, 8, 128)
    n_q, n_cache = (64, 512) if smoke else (512, 8192)
    q = torch.randn((b, n_q, hq, d), generator=gen).to(dtype).to(device)
    kc = torch.randn((b, n_cache, hkv, d), generator=gen).to(dtype).to(device)
    vc = torch.randn((b, n_cache, hkv, d), generator=gen).to(dtype).to(device)
    seqlens = torch.full((b,), n_cache, dtype=torch.int32, device=device)
    calls = {"contiguous": lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True)}
    # (inorder: the pages in the cache's order, the table an identity: what the
    # random order itself costs, apart from the page size.)
    for page, shuffled in [(p, True) for p in PREFILL_PAGES] + [(32, False), (16, False)]:
        kp, table = paged(kc, page, gen, shuffled)
        vp = torch.empty_like(kp)
        vp[table.long().flatten()] = vc.reshape(-1, page, hkv, d)
        calls[f"paged{page}" + ("" if shuffled else "-inorder")] = lambda kp=kp, vp=vp, t=table: (
            flash_attn_with_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=t, causal=True)
        )
    rows_big = torch.randn((b + 2, n_cache, hkv, d), generator=gen).to(dtype).to(device)
    idx = torch.randperm(b + 2, generator=gen)[:b].to(torch.int32).to(device)
    kb, vb = rows_big.clone(), rows_big.clone()
    kb[idx.long()], vb[idx.long()] = kc, vc
    calls["batch_idx"] = lambda: flash_attn_with_kvcache(
        q, kb, vb, cache_seqlens=seqlens, cache_batch_idx=idx, causal=True
    )
    pad = torch.full((b,), 64, dtype=torch.int32, device=device)
    calls["leftpad64"] = lambda: flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=seqlens, cache_leftpad=pad, causal=True
    )
    ref = calls["contiguous"]()
    out = []
    for name, fn in calls.items():
        if name in ("batch_idx",) or name.startswith("paged"):
            assert torch.equal(fn(), ref) or device.type == "cpu", f"prefill {name}: not the contiguous call's output"
        out.append({"section": "prefill", "case": name, "ms": bench(fn), "kernels": kernels_of(fn, device)})
    return out


def varlen_points(device, dtype, bench, gen, smoke):
    hq, hkv, d = (4, 2, 64) if smoke else (32, 8, 128)
    lens = [64, 128, 96] if smoke else [1024, 4096, 2048, 3072, 1536, 4096, 2560, 1024]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q = torch.randn((sum(lens), hq, d), generator=gen).to(dtype).to(device)
    k = torch.randn((sum(lens), hkv, d), generator=gen).to(dtype).to(device)
    v = torch.randn((sum(lens), hkv, d), generator=gen).to(dtype).to(device)
    mx = max(lens)
    calls = {"contiguous": lambda: flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=True)}
    for page in (256, 16):
        per = -(-mx // page)
        blocks = len(lens) * per + 3
        perm = torch.randperm(blocks, generator=gen)
        kp = torch.zeros((blocks, page, hkv, d), dtype=dtype, device=device)
        vp = torch.zeros_like(kp)
        table = torch.zeros((len(lens), per), dtype=torch.int32)
        it = iter(perm.tolist())
        for s, n in enumerate(lens):
            start = int(cu[s])
            for j in range(-(-n // page)):
                blk = next(it)
                table[s, j] = blk
                rows = slice(start + j * page, start + min(n, (j + 1) * page))
                kp[blk, : rows.stop - rows.start] = k[rows]
                vp[blk, : rows.stop - rows.start] = v[rows]
        table = table.to(device)
        calls[f"paged{page}"] = lambda kp=kp, vp=vp, t=table: flash_attn_varlen_func(
            q, kp, vp, cu, cu, mx, mx, causal=True, block_table=t
        )
    ref = calls["contiguous"]()
    out = []
    for name, fn in calls.items():
        if name != "contiguous" and device.type == "cuda":
            assert torch.equal(fn(), ref), f"varlen {name}: not the contiguous call's output"
        out.append({"section": "varlen", "case": name, "ms": bench(fn), "kernels": kernels_of(fn, device)})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    a = ap.parse_args(argv)
    device = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    bench, how = make_timer(device)
    gen = torch.Generator().manual_seed(0)
    rows = prefill_points(device, torch.bfloat16, bench, gen, a.smoke)
    rows += varlen_points(device, torch.bfloat16, bench, gen, a.smoke)
    for sec in ("prefill", "varlen"):
        base = next(r["ms"] for r in rows if r["section"] == sec and r["case"] == "contiguous")
        for r in rows:
            if r["section"] == sec:
                r["ratio_to_contiguous"] = r["ms"] / base
    meta = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "timer": how,
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(
        f"{meta['device']}, torch {meta['torch']}; time ratio paged / contiguous (bars: prefill <= 1.1, varlen <= 1.11)"
    )
    for r in rows:
        print(
            f"{r['section']:8s} {r['case']:20s} {r['ms']:8.3f} ms  x{r['ratio_to_contiguous']:.3f}  {','.join(r['kernels'])}"
        )


if __name__ == "__main__":
    main()
