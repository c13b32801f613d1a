#!/usr/bin/env python3
"""Attention over a sequence split across GPUs (context parallelism) on flashattn_ext's kernels.

    torchrun --nproc-per-node 2 examples/context_parallel.py                  # torch's context_parallel, our kernels
    torchrun --nproc-per-node 2 examples/context_parallel.py --impl ring      # flashattn_ext.ring
    torchrun --nproc-per-node 2 examples/context_parallel.py --impl ring --seqlen-q 8192   # causal prefill, q < k
    torchrun --nproc-per-node 1 examples/context_parallel.py                  # the single-GPU baseline
    torchrun --nproc-per-node 4 examples/context_parallel.py --device cpu --impl ring --seqlen 2048 --heads 4 --head-dim 64 --check
    torchrun --nproc-per-node 2 examples/context_parallel.py --impl ring --overlap-report   # how much comm the overlap hides
    python examples/context_parallel.py --threads 4 --overlap-report   # 4 ranks as threads on one GPU

Two ways, one set of kernels:

* ``--impl torch``: an unmodified call of torch.nn.functional.scaled_dot_product_attention
  inside torch's ``context_parallel`` (torch.distributed.tensor.experimental, a
  prototype). ``flashattn_ext.activate(first=True)`` puts our kernels behind SDPA's
  FLASH backend, and torch's ring calls that backend block by block: our forward
  and backward run on every block. CUDA only (on the CPU, SDPA runs torch's CPU
  flash op, which torch's context parallelism does not handle). Causal uses
  torch's head-tail load balancing; ``--rotate`` picks its all-gather or
  all-to-all rotation of the keys / values.
* ``--impl ring``: ``flashattn_ext.ring.ring_attention`` on torch.distributed's
  point-to-point operations, which also takes what torch's refuses: causal with
  q shorter than k (``--seqlen-q``), for a prefill against keys already spread
  over the GPUs. CUDA (NCCL) or CPU (gloo).

Each rank makes its own part of q, k, v (the same global tensors on every run
of the same seed), times ``--iters`` forward+backward steps and prints the
per-rank TFLOP/s; ``--check`` (small sizes) also gathers the result and holds
it to flashattn_ext.tolerance's rule against the oracle and compares it with
the single-device call.

``--threads N`` (no torchrun) runs the ring's N ranks as threads of one
process on one device (``ring.ThreadGroup``): each rank computes on its own
CUDA stream and issues its transfers, copies into the next rank's buffers, on a
side stream. With ``--overlap-report`` it measures on one GPU how much of the
transfer time the ring's schedule hides; the ranks share the GPU's SMs and the
copies run at the GPU's memory bandwidth, not a link's, so it tests the
schedule, not a multi-GPU run's scaling.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "flashattn_ext")):
    sys.path.append(_ROOT)

import flashattn_ext  # noqa: E402
from flashattn_ext import ring  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=("torch", "ring"), default="torch")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seqlen", type=int, default=131072, help="keys (and queries) over all ranks")
    p.add_argument("--seqlen-q", type=int, default=None, help="queries over all ranks (ring only; default --seqlen)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None, help="GQA (ring only; default --heads)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--rotate", choices=("allgather", "alltoall"), default="allgather", help="torch's K/V rotation")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--check", action="store_true", help="gather and check against the oracle (small sizes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="rank 0 writes its numbers here")
    p.add_argument("--threads", type=int, default=0, help="the ring's N ranks as threads of this process, one device")
    p.add_argument(
        "--overlap-report",
        action="store_true",
        help="ring: also time the step with every transfer completed before the compute after it, and the "
        "transfers alone: how much of the communication the overlap hides",
    )
    return p.parse_args()


def global_inputs(args, device):
    """The full q, k, v, dout (B, S, H, D), the same on every rank (one seed)."""
    gen = torch.Generator(device=device).manual_seed(args.seed)
    lq = args.seqlen_q or args.seqlen
    hk = args.kv_heads or args.heads
    shapes = [(args.batch, lq, args.heads, args.head_dim), (args.batch, args.seqlen, hk, args.head_dim)]
    shapes = [shapes[0], shapes[1], shapes[1], shapes[0]]
    dtype = DTYPES[args.dtype]
    return [torch.randn(s, generator=gen, device=device, dtype=torch.float32).to(dtype) for s in shapes]


def local_inputs(args, device, rank, world, balanced):
    """This rank's parts only: what a long run can afford (no full tensors anywhere)."""
    if args.check:
        return [ring.shard(x, balanced=balanced) for x in global_inputs(args, device)]
    gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + rank)
    lq, lk = (args.seqlen_q or args.seqlen) // world, args.seqlen // world
    hk = args.kv_heads or args.heads
    shapes = [(args.batch, lq, args.heads, args.head_dim), (args.batch, lk, hk, args.head_dim)]
    shapes = [shapes[0], shapes[1], shapes[1], shapes[0]]
    return [torch.randn(s, generator=gen, device=device, dtype=torch.float32).to(DTYPES[args.dtype]) for s in shapes]


def step_ring(args, q, k, v, dout, causal):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = ring.ring_attention(*leaves, causal=causal)
    out.backward(dout)
    return out.detach(), [x.grad for x in leaves]


def step_torch(args, mesh, q, k, v, dout, causal):
    """torch's context_parallel around an unmodified SDPA call. Its buffers are the
    full (B, H, S, D) tensors, sharded in place on entry (head-tail when causal)."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

    _cp_options.enable_load_balance = causal  # torch balances causal calls only
    set_rotate_method(args.rotate)
    bufs = [x.transpose(1, 2).contiguous() for x in (q, k, v, dout)]  # SDPA's layout
    qb, kb, vb, db = bufs
    for x in (qb, kb, vb):
        x.requires_grad_()
    with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs)):
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal)
        out.backward(db)
    # Back to (B, S, H, D), this rank's part in ring.shard's layout (the same head-tail chunks).
    return out.detach().transpose(1, 2), [x.grad.transpose(1, 2) for x in (qb, kb, vb)]


def ring_transfers(group, q, k, v, causal):
    """A rank's transfers of one ring step, alone: the forward's and the backward's
    K/V parts, the backward's float32 dK/dV accumulators."""
    r = ring._Ring(group, q.shape[1], k.shape[1], causal, causal)
    k, v = k.contiguous(), v.contiguous()
    dk, dv = torch.zeros(k.shape, dtype=torch.float32, device=k.device), torch.zeros_like(k, dtype=torch.float32)
    for tensors, tag, count in (([k, v], 0, r.world - 1), ([k, v], 1, r.world - 1), ([dk, dv], 2, r.world)):
        for _ in range(count):
            reqs, _ = r.exchange(tensors, tag)
            ring._wait(reqs)


def overlap_report(median_time, run, overlapped_s, overlapped_result, transfers):
    """How much of the ring's communication the overlap hides: the step with each
    transfer completed before the compute after it (ring._Ring.overlap = False), and
    the same transfers alone (transfers(): ring_transfers on every rank).
    hidden = (serial - overlapped) / comm. A result is a rank's (out, grads) or a
    list of them; the two schedules must give the same forward output, bit for
    bit (the same calls and merges, only the waits move), and finite gradients:
    a schedule that reads a buffer before its transfer lands is not timed as one."""
    ring._Ring.overlap = False
    try:
        serial_s, serial_result = median_time(run)
    finally:
        ring._Ring.overlap = True
    comm_s, _ = median_time(transfers)
    hidden = (serial_s - overlapped_s) / comm_s if comm_s > 0 else float("nan")
    per_rank = lambda r: r if isinstance(r, list) else [r]  # noqa: E731
    pairs = list(zip(per_rank(overlapped_result), per_rank(serial_result)))
    same = all(torch.equal(a[0], b[0]) for a, b in pairs)
    finite = all(bool(torch.isfinite(x).all()) for a, b in pairs for x in (a[0], *a[1], b[0], *b[1]))
    return dict(
        overlapped_ms=overlapped_s * 1e3, serial_ms=serial_s * 1e3, comm_alone_ms=comm_s * 1e3,
        hidden_fraction=hidden, same_output=same, finite=finite,
    )  # fmt: skip


def overlap_failed(overlap):
    """Exit non-zero when the two schedules of --overlap-report disagree."""
    if overlap is not None and not (overlap["same_output"] and overlap["finite"]):
        sys.exit("--overlap-report: the overlapped and the serial schedule disagree (or a result is not finite)")


def flops(args, causal):
    lq = args.seqlen_q or args.seqlen
    f = 4 * args.batch * args.heads * lq * args.seqlen * args.head_dim
    if causal:
        f -= 2 * args.batch * args.heads * lq * lq * args.head_dim  # bottom-right: the q x q triangle is half
    return f * 3.5  # forward + backward (2.5x)


def median_time_of(fn, args, device, barrier):
    """(median seconds of --iters calls of fn after --warmup, the last result); barrier()
    lines the ranks up before the timed calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        fn()
    sync()
    barrier()
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        result = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], result


def main_threads(args):
    """--threads N: the ring's ranks as threads of this process, on one device."""
    causal = not args.no_causal
    device = torch.device(args.device)
    world = args.threads
    tg = ring.ThreadGroup(world)
    parts = [local_inputs(args, device, r, world, balanced=causal) for r in range(world)] if not args.check else None
    if args.check:  # shard() needs the rank's thread: cut the full tensors there
        full = global_inputs(args, device)
        parts = tg.run(lambda r: [ring.shard(x, tg, balanced=causal) for x in full])

    def step(rank):  # the two passes apart: autograd would run every rank's CUDA backward on one thread
        q, k, v, dout = parts[rank]
        out, lse = ring.ring_attention_forward(q, k, v, causal=causal, group=tg)
        return out, ring.ring_attention_backward(dout, q, k, v, out, lse, causal=causal, group=tg)

    def median_time(fn):
        return median_time_of(fn, args, device, barrier=lambda: None)

    med, results = median_time(lambda: tg.run(step, device=device))
    res = dict(
        impl="ring-threads", world=world, device=str(device), seqlen=args.seqlen, seqlen_q=args.seqlen_q or args.seqlen,
        heads=args.heads, kv_heads=args.kv_heads or args.heads, head_dim=args.head_dim, dtype=args.dtype,
        causal=causal, median_s=med, tflops_all_ranks=flops(args, causal) / med / 1e12,
    )  # fmt: skip
    if args.overlap_report:
        res["overlap"] = overlap_report(
            median_time, lambda: tg.run(step, device=device), med, results,
            lambda: tg.run(lambda r: ring_transfers(tg, *parts[r][:3], causal), device=device),
        )  # fmt: skip
    if args.check:
        from flashattn_ext.tolerance import check_attention

        outs = tg.run(lambda r: [ring.unshard(x, tg, balanced=causal) for x in (results[r][0], *results[r][1])])
        qf, kf, vf, df = full
        comps = check_attention(qf, kf, vf, outs[0][0], None, df, outs[0][1:], causal=causal)
        res["check"] = {c.name: c.message() for c in comps}
        res["check_ok"] = all(c.ok for c in comps)
    print(
        f"ring x{world} threads {device.type} {args.dtype} b{args.batch} h{args.heads} d{args.head_dim} "
        f"q{res['seqlen_q']} k{args.seqlen} {'causal' if causal else 'full'}: fwd+bwd {med * 1e3:.2f} ms, "
        f"{res['tflops_all_ranks']:.3g} TFLOP/s all ranks"
    )
    for key in ("check", "overlap"):
        if key in res:
            print(f"  {key}: {res[key]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if args.check and not res["check_ok"]:
        sys.exit(1)
    overlap_failed(res.get("overlap"))


def main():
    args = parse()
    if args.threads:
        return main_threads(args)
    causal = not args.no_causal
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.impl == "torch":
        if device.type != "cuda":
            sys.exit("--impl torch needs CUDA (torch's context parallelism handles its CUDA SDPA ops only)")
        if args.seqlen_q not in (None, args.seqlen) or args.kv_heads not in (None, args.heads):
            sys.exit("--impl torch: torch's context_parallel takes equal q / k lengths and no GQA; use --impl ring")
        flashattn_ext.activate(first=True)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world,))
        full = global_inputs(args, device)  # context_parallel shards full buffers itself, on entry
        run = lambda: step_torch(args, mesh, *full, causal)  # noqa: E731
    else:
        q, k, v, dout = local_inputs(args, device, rank, world, balanced=causal)
        run = lambda: step_ring(args, q, k, v, dout, causal)  # noqa: E731
    balanced = causal

    def median_time(fn):
        return median_time_of(fn, args, device, barrier=dist.barrier)

    med, (out, grads) = median_time(run)
    overlap = None
    if args.overlap_report:
        if args.impl != "ring" or world == 1:
            sys.exit("--overlap-report: --impl ring on 2 or more ranks")
        overlap = overlap_report(median_time, run, med, (out, grads), lambda: ring_transfers(None, q, k, v, causal))
    tflops = flops(args, causal) / world / med / 1e12
    res = dict(
        impl=args.impl, world=world, device=str(device), seqlen=args.seqlen, seqlen_q=args.seqlen_q or args.seqlen,
        heads=args.heads, kv_heads=args.kv_heads or args.heads, head_dim=args.head_dim, dtype=args.dtype,
        causal=causal, rotate=args.rotate if args.impl == "torch" else None, median_s=med,
        tflops_per_rank=tflops, tokens_per_rank=(args.seqlen_q or args.seqlen) // world,
    )  # fmt: skip
    if overlap is not None:
        res["overlap"] = overlap

    if args.check:
        full = [ring.unshard(x, balanced=balanced) for x in (out, *grads)]
        if rank == 0:
            from flashattn_ext.tolerance import check_attention

            qf, kf, vf, df = global_inputs(args, device)
            comps = check_attention(qf, kf, vf, full[0], None, df, full[1:], causal=causal)
            res["check"] = {c.name: c.message() for c in comps}
            res["check_ok"] = all(c.ok for c in comps)
            leaves = [x.detach().requires_grad_() for x in (qf, kf, vf)]
            single = flashattn_ext.flash_attn_func(*leaves, causal=causal)
            single_grads = torch.autograd.grad(single, leaves, df)
            res["max_diff_vs_single"] = {
                name: (a.float() - b.float()).abs().max().item()
                for name, a, b in zip(("out", "dq", "dk", "dv"), full, (single, *single_grads))
            }
    if rank == 0:
        print(
            f"{args.impl} x{world} {device.type} {args.dtype} b{args.batch} h{args.heads} d{args.head_dim} "
            f"q{res['seqlen_q']} k{args.seqlen} {'causal' if causal else 'full'}: fwd+bwd {med * 1e3:.2f} ms, "
            f"{tflops:.3g} TFLOP/s per rank"
        )
        for key in ("check", "max_diff_vs_single", "overlap"):
            if key in res:
                print(f"  {key}: {res[key]}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    if args.impl == "torch":
        flashattn_ext.deactivate()
    dist.destroy_process_group()
    if args.check and rank == 0 and not res["check_ok"]:
        sys.exit(1)
    overlap_failed(overlap)


if __name__ == "__main__":
    main()
