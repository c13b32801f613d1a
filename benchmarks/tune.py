"""Times the candidate tile configurations of a tuning build
(FLASHATTN_TUNING=1, see csrc/cuda/kernel_configs.h) side by side with torch's
FlashAttention-2 and cuDNN backends, and checks each candidate's output
against the default one and, up to --check-max-seqlen, against the oracle
(flashattn_ext.tolerance). The forward's candidates and the peers are timed in
rounds, each once a round (kernel_check.bench_side_by_side: the first of
several entries timed one after the other reads up to 12% low). Prints one
line per (head dim, mask, seqlen).

    python benchmarks/tune.py --json out.json [--dims 64,128] [--seqlens 512,2048,8192] [--passes fwd]
        [--variants 0,1] [--grids default,static,dynamic,single,tiles] [--bwd-switches default,NAME=1]

--grids times the persistent forward's tile orders beside each other
(FLASHATTN_FWD_GRID, flash_launch.cuh; csrc/cuda/hopper/tile_scheduler.cuh):
`default` (the dynamic order for masked calls that are not paired, pairs where
the rule says so), `static` (the static striding where the default is
dynamic), `unbalanced` (that with the L2 groups before they were made equal),
`dynamic` (the dynamic order where the default pairs), `single` (static, no
pairs), `tiles` (one CTA a tile, heaviest first: the hardware's dispatch as a
longest-first schedule). Each is checked bitwise against the default (the
`_err` fields: the order does not change a tile's arithmetic).

--fwd-switches times the forward under each environment setting beside the
default and the peers, in rounds (e.g. FLASHATTN_FWD_MASK_STEPS=any: the
mainloop that tests the mask at every key block, against the default's,
whose loop holds no mask code where only a tile's first block can need it).
Checked bitwise against the default.
FlashAttention-4 (flash_attn.cute) is timed with the forward's peers when it
is importable.

--bwd-switches times the backward under each environment setting beside the
default and the peers, in rounds: FLASHATTN_BWD_DQ_FIRST=0 is the TMA
backward's step in the order before FlashAttention-3's (BwdSm90WsTraits::kDqFirst).
"""

import argparse
import contextlib
import functools
import json
import math
import os

import torch
import torch.nn.functional as F
from kernel_check import bench_side_by_side  # noqa: E402  (benchmarks/ is the script's directory)
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn_ext  # noqa: F401
from flashattn_ext import _ops
from flashattn_ext.reference import attention_flops
from flashattn_ext.tolerance import check_attention

# Entries of TuneVariants (csrc/cuda/kernel_configs.h) per pass and head dim:
# the wgmma lists (FwdSm90 / BwdSm90) on an sm90 device, the mma.sync ones elsewhere.
# (the forward runs the TMA kernels' list, FwdSm90Ws, unless FLASHATTN_DISABLE_TMA=1).
VARIANTS_SM90 = {"fwd": {64: 6, 128: 4, 192: 2, 256: 2}, "bwd": {64: 3, 128: 1}}
VARIANTS_SM80 = {"fwd": {64: 2, 128: 2}, "bwd": {64: 2, 128: 2}}


@contextlib.contextmanager
def env_value(name, value):
    """Runs the block with the environment variable `name` = value (the C++ side reads it on every call)."""
    old = os.environ.get(name)
    os.environ[name] = str(value)
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


@contextlib.contextmanager
def env_values(values):
    """Runs the block with the environment variables of `values` set (the value
    "default" leaves a variable unset)."""
    with contextlib.ExitStack() as stack:
        for name, value in values.items():
            if value != "default":
                stack.enter_context(env_value(name, value))
        yield


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--seqlens", default="512,2048,8192")
    ap.add_argument("--passes", default="fwd,bwd")
    ap.add_argument("--check-max-seqlen", type=int, default=2048, help="oracle checks up to this seqlen")
    ap.add_argument("--variants", default="", help="variants to time (default: all of the head dim's)")
    ap.add_argument("--grids", default="default", help="forward tile schedules to time with each variant")
    ap.add_argument(
        "--fwd-switches",
        default="default",
        help="forward switches to time side by side, e.g. default,FLASHATTN_FWD_MASK_STEPS=any",
    )
    ap.add_argument(
        "--bwd-switches",
        default="default",
        help="backward switches to time side by side, e.g. default,FLASHATTN_BWD_DQ_FIRST=0",
    )
    args = ap.parse_args()
    assert "tuning=1" in torch.ops.flashattn_ext.build_info(), "needs a FLASHATTN_TUNING=1 build"
    sm90 = torch.cuda.get_device_capability() == (9, 0) and os.environ.get("FLASHATTN_DISABLE_SM90") != "1"
    VARIANTS = VARIANTS_SM90 if sm90 else VARIANTS_SM80
    rows = []
    grids = args.grids.split(",")
    fwd_switches = args.fwd_switches.split(",")
    bwd_switches = args.bwd_switches.split(",")
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except Exception as e:  # noqa: BLE001  (any import failure: not installed, no CUDA DSL)
        fa4 = None
        print(f"FlashAttention-4 not timed: {type(e).__name__}: {e}")

    def switch_env(switch):
        name, _, value = switch.partition("=")
        return {} if switch == "default" else {name: value}

    def variants(pass_, d):
        every = range(VARIANTS[pass_].get(d, 1 if pass_ == "fwd" else 0))
        return [int(v) for v in args.variants.split(",") if int(v) in every] if args.variants else list(every)

    for d in (int(x) for x in args.dims.split(",")):
        for causal in (False, True):
            for n in (int(x) for x in args.seqlens.split(",")):
                b, h = max(1, 16384 // n), 2048 // d
                scale = 1 / math.sqrt(d)
                wr = 0 if causal else -1
                q = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
                k, v = torch.randn_like(q), torch.randn_like(q)
                flops = attention_flops(b, h, n, n, d, causal)
                bwd_flops = attention_flops(b, h, n, n, d, causal, "bwd")
                row = {"d": d, "n": n, "causal": causal}
                os.environ["FLASHATTN_FWD_VARIANT"] = "0"
                os.environ["FLASHATTN_BWD_VARIANT"] = "0"
                out0, lse0 = _ops.fwd(q, k, v, scale, -1, wr, True, False)
                dout = torch.randn_like(out0)
                grads0 = _ops.bwd(dout, q, k, v, out0, lse0, scale, -1, wr, True, False)
                passes = args.passes.split(",")
                qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v))
                peers = (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION))
                entries = {}
                fwd_names = []
                fwd_runs = [(var, grid, sw) for var in variants("fwd", d) for grid in grids for sw in fwd_switches]
                for var, grid, switch in fwd_runs if "fwd" in passes else ():
                    name = f"v{var}" if grid == "default" else f"v{var}_{grid}"
                    if switch != "default":
                        name += "_" + switch.split("=")[0].lower().removeprefix("flashattn_fwd_")
                    fwd_names.append(name)
                    env = {"FLASHATTN_FWD_VARIANT": var, "FLASHATTN_FWD_GRID": grid, **switch_env(switch)}
                    with env_values(env):
                        out, lse = _ops.fwd(q, k, v, scale, -1, wr, True, False)
                        row[f"fwd_{name}_err"] = (out.float() - out0.float()).abs().max().item()
                        if n <= args.check_max_seqlen:
                            comps = check_attention(q, k, v, out, lse, softmax_scale=scale, causal=causal)
                            row[f"fwd_{name}_oracle_ok"] = all(c.ok for c in comps)
                            if not row[f"fwd_{name}_oracle_ok"]:
                                print(f"  FAIL {name} against the oracle:", [c.message() for c in comps])
                    entries[f"fwd_{name}"] = (
                        functools.partial(env_values, env),
                        lambda: _ops.fwd(q, k, v, scale, -1, wr, True, False),
                    )
                for name, be in peers:
                    entries[f"fwd_{name}"] = (
                        functools.partial(sdpa_kernel, be),
                        lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal),
                    )
                if fa4 is not None and "fwd" in passes:
                    entries["fwd_fa4"] = (contextlib.nullcontext, lambda: fa4(q, k, v, causal=causal))
                for key, ms in bench_side_by_side(entries).items():
                    row[key] = flops / ms / 1e9
                os.environ["FLASHATTN_FWD_VARIANT"] = "0"
                # The backward's variants (the cp.async kernels' list, FLASHATTN_BWD_VARIANT, where the TMA
                # kernel declines) and switches (--bwd-switches: the TMA kernel's), with the peers, in rounds.
                bwd_entries, bwd_names = {}, []
                for var in variants("bwd", d) if "bwd" in passes else ():
                    for switch in bwd_switches:
                        name = f"v{var}" if switch == "default" else f"v{var}_{switch.split('=')[0].lower()}"
                        env = {"FLASHATTN_BWD_VARIANT": var, **switch_env(switch)}
                        with env_values(env):
                            grads = _ops.bwd(dout, q, k, v, out0, lse0, scale, -1, wr, True, False)
                        row[f"bwd_{name}_err"] = max(
                            (a.float() - b_.float()).abs().max().item() for a, b_ in zip(grads, grads0)
                        )
                        bwd_names.append(name)
                        bwd_entries[f"bwd_{name}"] = (
                            functools.partial(env_values, env),
                            lambda: _ops.bwd(dout, q, k, v, out0, lse0, scale, -1, wr, True, False),
                        )
                for name, be in peers if "bwd" in passes else ():
                    with sdpa_kernel(be):
                        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    do = torch.randn_like(o)
                    bwd_entries[f"bwd_{name}"] = (
                        functools.partial(sdpa_kernel, be),
                        functools.partial(torch.autograd.grad, o, (qt, kt, vt), do, retain_graph=True),
                    )
                for key, ms in bench_side_by_side(bwd_entries).items():
                    row[key] = bwd_flops / ms / 1e9
                os.environ["FLASHATTN_BWD_VARIANT"] = "0"
                rows.append(row)
                fv = " ".join(f"{nm}={row[f'fwd_{nm}']:.0f}" for nm in fwd_names)
                bv = " ".join(f"{nm}={row[f'bwd_{nm}']:.0f}" for nm in bwd_names)
                peer = {
                    f"{pa}_{name}": f"{row[f'{pa}_{name}']:.0f}" if f"{pa}_{name}" in row else "-"
                    for pa in ("fwd", "bwd")
                    for name, _ in peers
                }
                fa4_fwd = f" fa4={row['fwd_fa4']:.0f}" if "fwd_fa4" in row else ""
                print(
                    f"d{d} n{n} {'causal' if causal else 'full  '} | fwd {fv} fa2={peer['fwd_fa2']} "
                    f"cudnn={peer['fwd_cudnn']}{fa4_fwd} | bwd {bv} fa2={peer['bwd_fa2']} cudnn={peer['bwd_cudnn']}",
                    flush=True,
                )
                errs = [row[k] for k in row if k.endswith("_err")]
                if errs and max(errs) > 0.05:
                    print("  WARNING variant mismatch:", {k: row[k] for k in row if k.endswith("_err")})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
