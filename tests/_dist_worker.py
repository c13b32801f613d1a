"""The body of tests/test_ring.py's processes (torch.multiprocessing spawn, gloo).

Four processes: the world group runs every case with 4 ranks, and the two
groups {0, 1} and {2, 3} (the "cp" dimension of a (2, 2) device mesh) run
every case with 2 ranks, at the same time. Each case's full inputs are made
from the test's seed on every rank alike; the distributed results, gathered
back (ring.unshard), are held on each group's first rank to the tolerance
rule against the oracle and against the single-process call (their
difference within the rule's bound and one ulp). The findings go to a JSON file per
checking rank.
"""

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

# One case: (name, dtype, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, balanced)
RING_CASES = [
    ("causal-gqa-bf16", torch.bfloat16, 2, 4, 2, 64, 64, 32, True, True),
    ("full-unequal-fp32", torch.float32, 1, 2, 2, 48, 80, 24, False, False),
    ("causal-prefill-bf16", torch.bfloat16, 1, 4, 1, 16, 64, 32, True, True),  # q: the last 16 of 64 positions
    ("causal-q-longer-fp32", torch.float32, 2, 2, 2, 64, 32, 16, True, True),  # first 32 rows see no key
    ("causal-contiguous-fp16", torch.float16, 1, 2, 2, 32, 32, 40, True, False),
    ("causal-fp64", torch.float64, 1, 2, 2, 32, 32, 16, True, True),
]

# What the scores get beyond causal: torch SDPA's attn_mask (each rank passing
# its own query rows, every key column) or flash-attn's softcap. A ring case
# plus: "bool" (B, 1, Lq, Lk, one row of batch 0 that sees no key), "keypad"
# (B, 1, 1, Lk bool: key padding, broadcast over the queries), "bias" (1, H,
# Lq, Lk float32, requires grad: its gradient is checked), "keybias" (B, 1, 1,
# Lk float32 with its gradient: each rank's is its rows' share, summed over
# the ranks as a replicated parameter's gradient is), "softcap" (30/8).
SCORE_CASES = [
    ("mask-bool-causal-bf16", torch.bfloat16, 2, 4, 2, 64, 64, 32, True, True, "bool"),
    ("mask-keypad-causal-fp32", torch.float32, 2, 2, 2, 64, 64, 16, True, True, "keypad"),
    ("bias-grad-unequal-fp32", torch.float32, 1, 2, 2, 48, 80, 24, False, False, "bias"),
    ("bias-grad-prefill-bf16", torch.bfloat16, 1, 4, 1, 32, 64, 32, True, True, "bias"),
    ("keybias-grad-causal-fp32", torch.float32, 2, 2, 2, 32, 32, 16, True, True, "keybias"),
    ("softcap-causal-gqa-bf16", torch.bfloat16, 2, 4, 2, 64, 64, 32, True, True, "softcap"),
]

# Packed documents, each balanced on its own: (name, dtype, lengths, heads_q, heads_kv, head_dim, causal)
VARLEN_CASES = [
    ("varlen-causal-bf16", torch.bfloat16, [16, 40, 8], 4, 2, 32, True),
    ("varlen-full-fp32", torch.float32, [24, 8, 32], 2, 2, 16, False),
]

# ring_attention_forward / ring_attention_backward, the gradients written into
# the caller's buffers: (name, ring or varlen case it reuses).
BUFFER_CASES = [
    ("buffers-causal-gqa-bf16", RING_CASES[0]),
    ("buffers-varlen-causal-bf16", VARLEN_CASES[0]),
]

# torch's context parallelism (DTensor, its ring, its head-tail balancing) on
# our SDPA flash op: (name, dtype, causal, rotate method).
TORCH_CP_CASES = [
    ("torch-cp-causal-allgather-bf16", torch.bfloat16, True, "allgather"),
    ("torch-cp-causal-alltoall-fp32", torch.float32, True, "alltoall"),
    ("torch-cp-full-allgather-fp32", torch.float32, False, "allgather"),
]


def _inputs(seed, shapes, dtype):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype) for s in shapes]


def _verdict(name, world, parts, extra=None):
    """parts: [(comparisons, single, distributed)]: the rule against the oracle for
    the distributed result, and {quantity: tensor} of the single-process call and
    of the distributed one, which must differ by at most the rule's bound plus
    one ulp of the dtype (tolerance.ulp_at)."""
    from flashattn_ext.tolerance import max_err, ulp_at

    problems, diffs = [], {}
    for comparisons, single, ring_vals in parts:
        bounds = {c.name: c for c in comparisons}
        problems += [c.message() for c in comparisons if not c.ok]
        for key, ref in single.items():
            got = ring_vals[key]
            if key == "lse":
                if not torch.equal(torch.isneginf(got), torch.isneginf(ref)):
                    problems.append("lse: -inf on other rows than the single-process call's")
                live = ~torch.isneginf(ref)
                got, ref = got[live], ref[live]
            diff = max_err(got, ref)
            diffs[key] = max(diffs.get(key, 0.0), diff)
            # Both sides are rounded to the dtype last, from float32 sums in
            # different orders: one ulp apart at a rounding boundary.
            limit = bounds[key].bound + ulp_at(got.dtype, ref.detach().abs().max().item() if ref.numel() else 0.0)
            if diff > limit:
                problems.append(f"{key}: differs from the single-process call by {diff:.3e} > {limit:.3e}")
    return dict(name=name, world=world, ok=not problems, problems=problems, diff_vs_single=diffs, **(extra or {}))


def _ring_case(case, seed, group, world, check):
    import flashattn_ext
    from flashattn_ext import ring
    from flashattn_ext.tolerance import check_attention

    name, dtype, b, hq, hk, lq, lk, d, causal, balanced = case
    q, k, v, dout = _inputs(seed, [(b, lq, hq, d), (b, lk, hk, d), (b, lk, hk, d), (b, lq, hq, d)], dtype)
    local = [ring.shard(x, group, balanced=balanced).requires_grad_(i < 3) for i, x in enumerate((q, k, v, dout))]
    out, lse = ring.ring_attention(*local[:3], causal=causal, group=group, balanced=balanced, return_lse=True)
    grads = torch.autograd.grad(out, local[:3], local[3])
    full = {"out": ring.unshard(out.detach(), group, balanced=balanced)}
    full["lse"] = ring.unshard(lse, group, balanced=balanced, dim=2)
    for key, g in zip(("dq", "dk", "dv"), grads):
        full[key] = ring.unshard(g, group, balanced=balanced)
    if not check:
        return None
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    s_out, s_lse = flashattn_ext.flash_attn_func(*leaves, causal=causal, return_lse=True)
    single = {"out": s_out.detach(), "lse": s_lse}
    single.update(zip(("dq", "dk", "dv"), torch.autograd.grad(s_out, leaves, dout)))
    comparisons = check_attention(
        q, k, v, full["out"], full["lse"], dout, [full["dq"], full["dk"], full["dv"]], causal=causal
    )
    return _verdict(name, world, [(comparisons, single, full)])


def _score_inputs(score, seed, b, hq, lq, lk):
    """(the full attn_mask or None, softcap) of a SCORE_CASES kind."""
    gen = torch.Generator().manual_seed(seed + 7)
    if score == "bool":
        mask = torch.rand((b, 1, lq, lk), generator=gen) < 0.8
        mask[0, 0, 3] = False  # a row that sees no key: out 0, lse -inf, as one call gives
        return mask, 0.0
    if score == "keypad":
        mask = torch.ones((b, 1, 1, lk), dtype=torch.bool)
        mask[1, ..., lk - lk // 4 :] = False  # batch 1's last quarter is padding
        return mask, 0.0
    if score == "bias":
        return torch.randn((1, hq, lq, lk), generator=gen), 0.0
    if score == "keybias":
        return torch.randn((b, 1, 1, lk), generator=gen), 0.0
    return None, 30.0 / 8


def _score_case(case, seed, group, world, check):
    import flashattn_ext._ops as ops
    from flashattn_ext import ring
    from flashattn_ext.tolerance import check_attention

    name, dtype, b, hq, hk, lq, lk, d, causal, balanced, score = case
    q, k, v, dout = _inputs(seed, [(b, lq, hq, d), (b, lk, hk, d), (b, lk, hk, d), (b, lq, hq, d)], dtype)
    mask, softcap = _score_inputs(score, seed, b, hq, lq, lk)
    mask_grad = score in ("bias", "keybias")
    local = [ring.shard(x, group, balanced=balanced).requires_grad_(i < 3) for i, x in enumerate((q, k, v, dout))]
    leaves = local[:3]
    local_mask = None
    if mask is not None:  # this rank's query rows; a mask that broadcasts over them as it is
        rows = mask.shape[-2] != 1
        local_mask = ring.shard(mask, group, balanced=balanced, dim=-2) if rows else mask.clone()
        if mask_grad:
            leaves = leaves + [local_mask.requires_grad_()]
    out, lse = ring.ring_attention(
        *local[:3], causal=causal, group=group, balanced=balanced, return_lse=True, attn_mask=local_mask,
        softcap=softcap,
    )  # fmt: skip
    grads = torch.autograd.grad(out, leaves, local[3])
    full = {"out": ring.unshard(out.detach(), group, balanced=balanced)}
    full["lse"] = ring.unshard(lse, group, balanced=balanced, dim=2)
    for key, g in zip(("dq", "dk", "dv"), grads):
        full[key] = ring.unshard(g, group, balanced=balanced)
    if mask_grad and local_mask.shape[-2] != 1:
        full["dmask"] = ring.unshard(grads[3], group, balanced=balanced, dim=-2)
    elif mask_grad:  # a mask every rank holds whole: the ranks' shares summed
        full["dmask"] = grads[3].clone()
        dist.all_reduce(full["dmask"], group=group)
    if not check:
        return None
    # The single-process call: the differentiable op with the full mask.
    s_leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    s_mask = mask
    if mask_grad:
        s_mask = mask.detach().requires_grad_()
        s_leaves.append(s_mask)
    scale = d**-0.5
    s_out, s_lse = ops.attention(
        *s_leaves[:3], scale, -1, 0 if causal else -1, True, False, False, softcap, None, s_mask
    )  # fmt: skip
    single = {"out": s_out.detach(), "lse": s_lse}
    single.update(zip(("dq", "dk", "dv", "dmask"), torch.autograd.grad(s_out, s_leaves, dout)))
    comparisons = check_attention(
        q, k, v, full["out"], full["lse"], dout, [full["dq"], full["dk"], full["dv"]], causal=causal,
        softcap=softcap, attn_mask=mask, dmask=full.get("dmask"),
    )  # fmt: skip
    return _verdict(name, world, [(comparisons, single, full)])


def _varlen_case(case, seed, group, world, check):
    import flashattn_ext
    from flashattn_ext import ring
    from flashattn_ext.tolerance import check_attention

    name, dtype, lengths, hq, hk, d, causal = case
    total = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v, dout = _inputs(seed, [(total, hq, d), (total, hk, d), (total, hk, d), (total, hq, d)], dtype)
    local = [
        ring.shard_varlen(x, cu, group, balanced=causal).requires_grad_(i < 3) for i, x in enumerate((q, k, v, dout))
    ]
    out, lse = ring.ring_attention_varlen(*local[:3], cu, causal=causal, group=group, return_lse=True)
    grads = torch.autograd.grad(out, local[:3], local[3])
    full = {"out": ring.unshard_varlen(out.detach(), cu, group, balanced=causal)}
    full["lse"] = ring.unshard_varlen(lse, cu, group, balanced=causal, dim=1)
    for key, g in zip(("dq", "dk", "dv"), grads):
        full[key] = ring.unshard_varlen(g, cu, group, balanced=causal)
    if not check:
        return None
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    m = max(lengths)
    s_out, s_lse = flashattn_ext.flash_attn_varlen_func(*leaves, cu, cu, m, m, causal=causal, return_lse=True)
    single = {"out": s_out.detach(), "lse": s_lse}
    single.update(zip(("dq", "dk", "dv"), torch.autograd.grad(s_out, leaves, dout)))
    # The rule per document: its oracle sees that document alone.
    parts = []
    for b in range(len(lengths)):
        rows = slice(int(cu[b]), int(cu[b + 1]))

        def one(x, rows=rows):
            return x[rows].unsqueeze(0)

        doc = {key: (x[:, rows].unsqueeze(0) if key == "lse" else one(x)) for key, x in full.items()}
        comparisons = check_attention(
            one(q), one(k), one(v), doc["out"], doc["lse"], one(dout), [doc[g] for g in ("dq", "dk", "dv")],
            causal=causal,
        )  # fmt: skip
        doc_single = {key: (x[:, rows].unsqueeze(0) if key == "lse" else one(x)) for key, x in single.items()}
        parts.append((comparisons, doc_single, doc))
    return _verdict(name, world, parts)


def _buffers_case(case, seed, group, world, check):
    """The two passes apart against ring_attention's autograd on the same local
    parts: out and lse bitwise; the gradients written into strided buffers (dk,
    dv: views into one packed (..., 2, heads_kv, head_dim) tensor; dq: a float32
    buffer with q's head and sequence dimensions swapped in memory) bitwise the
    autograd gradients (dq after rounding to q's dtype), poisoned elements gone."""
    from flashattn_ext import ring

    name, base = case
    varlen = base in VARLEN_CASES
    if varlen:
        _, dtype, lengths, hq, hk, d, causal = base
        total = sum(lengths)
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
        shapes = [(total, hq, d), (total, hk, d), (total, hk, d), (total, hq, d)]
        full = _inputs(seed, shapes, dtype)
        local = [ring.shard_varlen(x, cu, group, balanced=causal) for x in full]
        kw = dict(cu_seqlens=cu, causal=causal, group=group)
    else:
        _, dtype, b, hq, hk, lq, lk, d, causal, balanced = base
        full = _inputs(seed, [(b, lq, hq, d), (b, lk, hk, d), (b, lk, hk, d), (b, lq, hq, d)], dtype)
        local = [ring.shard(x, group, balanced=balanced) for x in full]
        kw = dict(causal=causal, group=group, balanced=balanced)
    leaves = [x.detach().requires_grad_() for x in local[:3]]
    if varlen:
        out_ag, lse_ag = ring.ring_attention_varlen(*leaves, cu, causal=causal, group=group, return_lse=True)
    else:
        out_ag, lse_ag = ring.ring_attention(*leaves, **kw, return_lse=True)
    grads_ag = torch.autograd.grad(out_ag, leaves, local[3])

    q, k, v, dout = local
    out, lse = ring.ring_attention_forward(q, k, v, **kw)
    kv_grad = torch.full((*k.shape[:-2], 2, *k.shape[-2:]), float("nan"), dtype=dtype)  # (..., 2, heads_kv, head_dim)
    dk_buf, dv_buf = kv_grad.select(-3, 0), kv_grad.select(-3, 1)
    dq_buf = torch.full((*q.shape[:-3], q.shape[-2], q.shape[-3], q.shape[-1]), float("nan")).transpose(-3, -2)
    dq, dk, dv = ring.ring_attention_backward(dout, q, k, v, out, lse, **kw, dq=dq_buf, dk=dk_buf, dv=dv_buf)
    problems = []
    if not (dq is dq_buf and dk is dk_buf and dv is dv_buf):
        problems.append("the buffers were not the ones returned")
    if not (torch.equal(out, out_ag.detach()) and torch.equal(lse, lse_ag)):
        problems.append("forward: out / lse differ from ring_attention's")
    for gname, got, want in (
        ("dq", dq_buf.to(dtype), grads_ag[0]),
        ("dk", dk_buf, grads_ag[1]),
        ("dv", dv_buf, grads_ag[2]),
    ):
        if got.isnan().any() or not torch.equal(got, want):
            problems.append(f"{gname}: not ring_attention's gradient bitwise")
    if dq_buf.dtype != torch.float32 or dq_buf.is_contiguous():
        problems.append("dq buffer lost its dtype / strides")
    if not check:
        return None
    return dict(name=name, world=world, ok=not problems, problems=problems)


def _serial_transfers_case(seed, group, world, check):
    """ring._Ring.overlap = False (each transfer completed before the next compute,
    what examples/context_parallel.py --overlap-report times against): the very same
    bits as the overlapped ring, forward, lse and gradients, dense and varlen."""
    from flashattn_ext import ring

    problems = []
    for case in (RING_CASES[0], VARLEN_CASES[0]):
        runs = []
        for overlap in (True, False):
            ring._Ring.overlap = overlap
            try:
                if case in VARLEN_CASES:
                    _, dtype, lengths, hq, hk, d, causal = case
                    total = sum(lengths)
                    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
                    xs = _inputs(seed, [(total, hq, d), (total, hk, d), (total, hk, d), (total, hq, d)], dtype)
                    local = [ring.shard_varlen(x, cu, group, balanced=causal) for x in xs]
                    leaves = [x.requires_grad_() for x in local[:3]]
                    out, lse = ring.ring_attention_varlen(*leaves, cu, causal=causal, group=group, return_lse=True)
                else:
                    _, dtype, b, hq, hk, lq, lk, d, causal, balanced = case
                    shapes = [(b, lq, hq, d), (b, lk, hk, d), (b, lk, hk, d), (b, lq, hq, d)]
                    local = [ring.shard(x, group, balanced=balanced) for x in _inputs(seed, shapes, dtype)]
                    leaves = [x.requires_grad_() for x in local[:3]]
                    out, lse = ring.ring_attention(*leaves, causal=causal, group=group, return_lse=True)
                runs.append((out.detach(), lse, *torch.autograd.grad(out, leaves, local[3])))
            finally:
                ring._Ring.overlap = True
        if not all(torch.equal(a, b) for a, b in zip(*runs)):
            problems.append(f"{case[0]}: serial transfers give other bits than the overlapped ring")
    if not check:
        return None
    return dict(name="serial-transfers", world=world, ok=not problems, problems=problems)


def _torch_cp_case(case, seed, mesh, group, world, check):
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._attention import (
        _cp_options,
        _disable_context_parallel_dispatcher,
        _enable_context_parallel_dispatcher,
        set_rotate_method,
    )

    from flashattn_ext import backend, ring
    from flashattn_ext.tolerance import check_attention

    name, dtype, causal, rotate = case
    b, h, n, d = 2, 4, 64, 32
    q, k, v, dout = _inputs(seed, [(b, h, n, d)] * 4, dtype)
    local = [ring.shard(x, group, balanced=causal, dim=2).requires_grad_(i < 3) for i, x in enumerate((q, k, v, dout))]
    # torch's head-tail balancing is ring.shard's layout (chunks r and 2 * world - 1 - r).
    _cp_options.enable_load_balance = causal
    set_rotate_method(rotate)
    backend.reset_calls()
    _enable_context_parallel_dispatcher()
    try:
        qd, kd, vd = (DTensor.from_local(x, mesh, [Shard(2)], run_check=False) for x in local[:3])
        # What CUDA SDPA's FLASH backend calls; torch's CP handler runs its ring with it block by block.
        res = torch.ops.aten._scaled_dot_product_flash_attention(qd, kd, vd, 0.0, causal)
        out, lse = res[0], res[1]
        out.backward(DTensor.from_local(local[3], mesh, [Shard(2)], run_check=False))
    finally:
        _disable_context_parallel_dispatcher()
    calls = {f"{op}/{route}": count for (op, route), count in backend.calls().items()}
    full = {"out": ring.unshard(out.to_local().detach(), group, balanced=causal, dim=2)}
    full["lse"] = ring.unshard(lse.to_local(), group, balanced=causal, dim=2)
    for key, x in zip(("dq", "dk", "dv"), local[:3]):
        full[key] = ring.unshard(x.grad, group, balanced=causal, dim=2)
    if not check:
        return None
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        s_out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    single = {"out": s_out.detach()}
    single.update(zip(("dq", "dk", "dv"), torch.autograd.grad(s_out, leaves, dout)))
    t = lambda x: x.transpose(1, 2)  # noqa: E731  (SDPA's layout -> the rule's (B, L, H, E))
    comparisons = check_attention(
        t(q), t(k), t(v), t(full["out"]), full["lse"], t(dout), [t(full[g]) for g in ("dq", "dk", "dv")], causal=causal
    )
    single = {key: t(x) for key, x in single.items()}
    ring_vals = {key: (x if key == "lse" else t(x)) for key, x in full.items()}
    return _verdict(name, world, [(comparisons, single, ring_vals)], extra={"calls": calls})


def main(rank, world, init_file, seed, out_dir, repo):
    sys.path.insert(0, repo)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = []
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from flashattn_ext import backend

        mesh2d = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "cp"))
        mesh1d = init_device_mesh("cpu", (world,))
        groups = [(mesh1d, mesh1d.get_group(), world), (mesh2d["cp"], mesh2d["cp"].get_group(), world // 2)]
        for i, case in enumerate(RING_CASES):
            for _, group, w in groups:
                r = _ring_case(case, seed + i, group, w, dist.get_rank(group) == 0)
                if r is not None:
                    results.append(r)
        for i, case in enumerate(SCORE_CASES):
            for _, group, w in groups:
                r = _score_case(case, seed + 30 + i, group, w, dist.get_rank(group) == 0)
                if r is not None:
                    results.append(r)
        for i, case in enumerate(VARLEN_CASES):
            for _, group, w in groups:
                r = _varlen_case(case, seed + 50 + i, group, w, dist.get_rank(group) == 0)
                if r is not None:
                    results.append(r)
        for i, case in enumerate(BUFFER_CASES):
            for _, group, w in groups:
                r = _buffers_case(case, seed + 80 + i, group, w, dist.get_rank(group) == 0)
                if r is not None:
                    results.append(r)
        for _, group, w in groups:
            r = _serial_transfers_case(seed + 90, group, w, dist.get_rank(group) == 0)
            if r is not None:
                results.append(r)
        handle = backend._register_flash_ops("CPU")  # the CUDA path's overrides, on the CPU key
        try:
            for i, case in enumerate(TORCH_CP_CASES):
                for mesh, group, w in groups:
                    r = _torch_cp_case(case, seed + 100 + i, mesh, group, w, dist.get_rank(group) == 0)
                    if r is not None:
                        results.append(r)
        finally:
            handle.remove()
    except Exception:
        results.append(dict(name="worker", world=world, ok=False, problems=[traceback.format_exc()]))
        raise
    finally:
        if results:
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                json.dump(results, f)
        dist.destroy_process_group()
