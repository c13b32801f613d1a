"""Ring attention (context parallelism) on torch.distributed's own
point-to-point operations, for what torch's ``context_parallel`` refuses.

    from flashattn_ext import ring
    q_loc, k_loc, v_loc = (ring.shard(x, group) for x in (q, k, v))   # (B, S, H, D) -> this rank's part
    out_loc = ring.ring_attention(q_loc, k_loc, v_loc, causal=True, group=group)
    out = ring.unshard(out_loc, group)                                # every rank's parts, in order

Every rank holds a part of the sequence of q and of k / v, in flash_attn_func's
layout (batch, seqlen, heads, head_dim). The key / value parts travel around
the ring (rank r sends to r + 1 and receives from r - 1, ``batch_isend_irecv``),
the next part's transfer in flight while the current one is computed; each
part's attention is merged into a float32 (float64 for float64 inputs)
accumulator through the log-sum-exp. The backward sends the key / value parts
around once more, with their float32 dK / dV accumulators one step behind,
and takes the merged output and the global log-sum-exp, as a single call's
backward does.

Masks follow flash_attn_func: ``causal`` is aligned bottom-right, so q may be
shorter than k (the last seqlen_q positions of a prefill against a KV cache) or
longer (its first seqlen_q - seqlen_k rows see no key: output 0, lse -inf),
which torch's context_parallel refuses. Which keys a row sees is computed
from the global positions of each rank's parts, so every (query part, key
part) pair costs at most one kernel call: a full block, a causal diagonal, or
nothing at all.

``balanced=True`` (the default for causal) is head-tail load balancing: the
sequence is cut into 2 * world chunks and rank r holds chunks r and
2 * world - 1 - r, so every rank has the same causal work. ``shard`` /
``unshard`` apply that layout; the lengths must be multiples of 2 * world
(world when not balanced).

``ring_attention_varlen`` does the same for packed documents (flash-attn's
varlen layout, self-attention, one cu_seqlens for q and k): each document is
balanced on its own (``shard_varlen`` / ``unshard_varlen``; every length a
multiple of 2 * world), and each step makes one varlen kernel call per
(query chunk, key chunk) pair for all documents at once.

``ring_attention_forward`` / ``ring_attention_backward`` are the two passes
apart, outside autograd, for a caller with its own autograd Function: the
backward takes the merged output and the global log-sum-exp, and writes the
gradients into buffers the caller provides (any strides, e.g. views into a
packed qkv gradient; a float32 buffer receives the float32 accumulator).

``attn_mask`` (ring_attention and its two passes) is torch SDPA's: bool (True
takes part) or float added to the scaled scores, with its gradient when it
requires grad. Each rank passes its own query rows of the full mask
(``shard(mask, dim=-2)``; a mask that broadcasts over the queries as it is)
and every key column in the global order: the mask never travels, and each
step reads the columns of the key part the rank holds, as a view. It applies
on top of ``causal``. A float mask's gradient is this rank's: its rows of the
mask's gradient, or, for a mask that broadcasts over the queries, the share of
its query rows (summed over the ranks, as a replicated parameter's gradient is,
it is the whole gradient). ``softcap`` is flash-attn's (Gemma 2's); the kernels
take no softcap together with a mask.

Not here: ALiBi (the kernels compute its distances within one call, and a
block of the ring sits at an offset they do not know; a float attn_mask of
the ALiBi bias does it), causal varlen with different q and k lengths per
document, and accumulation inside the kernels (each block's gradients come
back from the kernels in the input dtype and are added in float32, as torch's
context parallelism does).
"""

from __future__ import annotations

import collections
import math
import threading

import torch
import torch.distributed as dist

from . import _ops

__all__ = ["ring_attention", "ring_attention_varlen", "ring_attention_forward", "ring_attention_backward"]
__all__ += ["shard", "unshard", "shard_varlen", "unshard_varlen", "chunk_ids", "ThreadGroup"]


# ----------------------------------------------------------------------------- layout


def chunk_ids(rank: int, world: int, balanced: bool) -> tuple[int, ...]:
    """The chunks of the sequence rank holds, in memory order: (rank, 2 * world
    - 1 - rank) of 2 * world chunks (balanced), else (rank,) of world."""
    return (rank, 2 * world - 1 - rank) if balanced else (rank,)


def _n_chunks(world, balanced):
    return 2 * world if balanced else world


def _group_info(group):
    if isinstance(group, ThreadGroup):
        return group, group.rank, group.world
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


class ThreadGroup:
    """Ranks of one process, a thread each, in place of a torch.distributed group
    (pass it as ``group``): the ring's transfers become copies into the next
    rank's buffers, issued on the sending rank's side stream on CUDA, so that one
    GPU shows how much of the transfer time the ring's overlap hides (examples/
    context_parallel.py --threads), and a test runs the ring without processes.
    Every rank's thread runs on its own CUDA stream.

        tg = ring.ThreadGroup(4)
        outs = tg.run(lambda rank: ring.ring_attention(q[rank], k[rank], v[rank], group=tg))

    shard / unshard / the ring functions take it; nothing else of
    torch.distributed does. On CUDA, use ring_attention_forward / _backward:
    autograd runs a CUDA backward on a thread of its own for the device, one
    for every caller, where the ranks would wait for each other (it raises)."""

    def __init__(self, world: int):
        if world < 1:
            raise ValueError(f"flashattn_ext.ring.ThreadGroup: world must be >= 1, got {world}")
        self.world = world
        self._local = threading.local()
        self._cond = threading.Condition()
        self._posted = {}
        self._arrived = 0
        self._generation = 0
        self._side = None  # per rank, the CUDA stream its transfers are issued on (this run's)
        self._streams = {}  # (device) -> (compute streams, side streams), one of each per rank

    @property
    def rank(self) -> int:
        rank = getattr(self._local, "rank", None)
        if rank is None:
            raise RuntimeError("flashattn_ext.ring.ThreadGroup: called outside the threads of its run()")
        return rank

    def run(self, fn, *, device=None) -> list:
        """fn(rank) on a thread per rank (each with its own CUDA stream when
        device is a CUDA device); returns the results in rank order, or raises
        the first rank's exception."""
        results, errors = [None] * self.world, [None] * self.world
        streams = None
        if device is not None and torch.device(device).type == "cuda":
            streams, self._side = self._cuda_streams(torch.device(device))
        else:
            self._side = None

        def body(rank):
            self._local.rank = rank
            try:
                if streams:  # (after what the caller queued on the device's current stream: the inputs)
                    streams[rank].wait_stream(torch.cuda.current_stream(device))
                    with torch.cuda.stream(streams[rank]):
                        results[rank] = fn(rank)
                    torch.cuda.current_stream(device).wait_stream(streams[rank])
                else:
                    results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001  (re-raised in the caller's thread)
                errors[rank] = exc
                with self._cond:
                    self._posted["failed"] = exc
                    self._cond.notify_all()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._posted.clear()
        for exc in errors:
            if exc is not None:
                raise exc
        return results

    def _cuda_streams(self, device):
        """Per rank, its compute stream and its transfer (side) stream on device:
        the same ones on every run. (The caching allocator keeps a freed block for
        the stream it was allocated on: fresh streams each run would make every
        run allocate anew, and fill the device with blocks no stream reuses.)"""
        key = (device.type, device.index if device.index is not None else torch.cuda.current_device())
        if key not in self._streams:
            self._streams[key] = tuple(
                [torch.cuda.Stream(device=device) for _ in range(self.world)] for _ in range(2)
            )  # fmt: skip
        return self._streams[key]

    def _post(self, key, value):
        with self._cond:
            self._posted[key] = value
            self._cond.notify_all()

    def _take(self, key, pop=True):
        with self._cond:
            self._cond.wait_for(lambda: key in self._posted or "failed" in self._posted)
            if key not in self._posted:
                raise RuntimeError("flashattn_ext.ring.ThreadGroup: another rank failed") from self._posted["failed"]
            return self._posted.pop(key) if pop else self._posted[key]

    def _barrier(self):
        with self._cond:
            generation = self._generation
            self._arrived += 1
            if self._arrived == self.world:
                self._arrived, self._generation = 0, generation + 1
                self._cond.notify_all()
            else:
                self._cond.wait_for(lambda: self._generation != generation or "failed" in self._posted)

    def exchange(self, ring, tensors, tag, seq):
        """The ring's send to ring.next and receive from ring.prev: returns
        (requests, buffers) as _Ring.exchange does."""
        if getattr(self._local, "rank", None) != ring.rank:
            raise RuntimeError(
                "flashattn_ext.ring.ThreadGroup: a transfer outside its rank's thread (on CUDA, autograd runs the "
                "backward on a thread of its own): call ring_attention_forward / ring_attention_backward"
            )
        side = self._side[ring.rank] if self._side else None
        bufs = [torch.empty_like(t) for t in tensors]
        # Where the previous rank's copies land. On CUDA the buffers come from
        # this rank's stream's pool: their memory may still be in use by this
        # stream's queued kernels (a tensor freed here a moment ago), so the
        # copies into them wait for this stream to get here (`ready`).
        ready = None
        if side is not None:
            ready = torch.cuda.Event()
            ready.record()
        self._post(("bufs", ring.rank, tag, seq), (bufs, ready))
        dest, dest_ready = self._take(("bufs", ring.next, tag, seq))
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(side.device))
            side.wait_event(dest_ready)
            with torch.cuda.stream(side):
                for d, t in zip(dest, tensors):
                    d.copy_(t, non_blocking=True)
                    d.record_stream(side)
                    t.record_stream(side)
            done = torch.cuda.Event()
            done.record(side)
        else:
            for d, t in zip(dest, tensors):
                d.copy_(t)
            done = None
        self._post(("done", ring.next, tag, seq), done)
        return [_ThreadRequest(self, ("done", ring.rank, tag, seq))], bufs

    def all_gather(self, x):
        """Every rank's x, in rank order (unshard's gather). On CUDA another rank's
        x is written on that rank's stream: this rank's stream waits for it there,
        and the tensor is marked in use on this stream (its owner may free it
        before this stream has read it)."""
        seq = self._local.gathers = getattr(self._local, "gathers", 0) + 1
        written = None
        if x.is_cuda and self._side is not None:
            written = torch.cuda.Event()
            written.record()
        self._post(("gather", self.rank, seq), (x, written))
        parts = []
        for r in range(self.world):
            part, part_written = self._take(("gather", r, seq), pop=False)
            if r != self.rank and part_written is not None:
                stream = torch.cuda.current_stream(part.device)
                stream.wait_event(part_written)
                part.record_stream(stream)
            parts.append(part)
        self._barrier()  # every rank has read every part
        self._posted.pop(("gather", self.rank, seq), None)
        return parts


class _ThreadRequest:
    def __init__(self, group, key):
        self.group, self.key = group, key

    def wait(self):
        done = self.group._take(self.key)
        if done is not None:  # the receiving rank's stream waits for the copy
            torch.cuda.current_stream().wait_event(done)


def shard(x: torch.Tensor, group=None, *, balanced: bool = True, dim: int = 1) -> torch.Tensor:
    """This rank's part of the full tensor x along dim (the sequence), contiguous."""
    _, rank, world = _group_info(group)
    n = _n_chunks(world, balanced)
    if x.shape[dim] % n != 0:
        raise ValueError(
            f"flashattn_ext.ring.shard: length {x.shape[dim]} is not a multiple of {n} "
            f"({'2 x ' if balanced else ''}world size {world}); pad the sequence"
        )
    chunks = x.chunk(n, dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(rank, world, balanced)], dim=dim).contiguous()


def unshard(x: torch.Tensor, group=None, *, balanced: bool = True, dim: int = 1) -> torch.Tensor:
    """The full tensor from every rank's part (all_gather, then the chunks put back in order)."""
    group, _, world = _group_info(group)
    parts = _all_gather(x.contiguous(), group, world)
    per = len(chunk_ids(0, world, balanced))
    chunks = [None] * _n_chunks(world, balanced)
    for r, part in enumerate(parts):
        for c, piece in zip(chunk_ids(r, world, balanced), part.chunk(per, dim=dim)):
            chunks[c] = piece
    return torch.cat(chunks, dim=dim)


def _all_gather(x, group, world):
    if isinstance(group, ThreadGroup):
        return group.all_gather(x)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return parts


def _positions(rank, world, balanced, local_len, offset):
    """Global positions (in key coordinates) of the rows of a rank's part: int64 (local_len,)."""
    ids = chunk_ids(rank, world, balanced)
    size = local_len // len(ids)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in ids]) + offset


def _plan(q_pos, k_pos, causal, chunk_q, chunk_k, by_chunk=False):
    """The kernel calls of one (query part, key part) pair, as (q rows a:b, k rows
    c:d, window_right) with top-left alignment (window_right -1: no mask).

    Row i sees the keys with position <= q_pos[i] (causal); positions grow in
    memory order, so that is a prefix of the key rows, of length n[i]. One call
    takes rows a:b against keys c:d when n rises by one per row (a causal
    diagonal: window_right = n[a] - 1) or is all of c:d (a full block); rows
    that see no key are left out. Otherwise the query part, then the key part,
    is split into its chunks (a pair of chunks always fits one call).
    by_chunk: one call per pair of chunks at most (so that the keys of a call
    are one run of global positions, and an attn_mask's columns for it a view)."""
    nq, nk = len(q_pos), len(k_pos)
    if not causal and not by_chunk:
        return [(0, nq, 0, nk, -1)]

    def fits(a, b, c, d):
        if not causal:
            return [(a, b, c, d, -1)]
        n = torch.searchsorted(k_pos[c:d], q_pos[a:b], right=True)  # keys of c:d each row sees
        live = torch.nonzero(n > 0)
        if live.numel() == 0:
            return []
        a0 = int(live[0])
        n = n[a0:]
        if bool((n == d - c).all()):
            return [(a + a0, b, c, d, -1)]
        first = int(n[0])
        if torch.equal(n, (torch.arange(len(n)) + first).clamp(max=d - c)):
            return [(a + a0, b, c, d, first - 1)]
        return None

    whole = None if by_chunk else fits(0, nq, 0, nk)
    if whole is not None:
        return whole
    calls = []
    for a in range(0, nq, chunk_q):
        part = None if by_chunk else fits(a, a + chunk_q, 0, nk)
        if part is None:
            part = []
            for c in range(0, nk, chunk_k):
                pair = fits(a, a + chunk_q, c, c + chunk_k)
                assert pair is not None, "a pair of chunks always fits one call"
                part += pair
        calls += part
    return calls


class _Ring:
    """Everything a rank needs to run its part: group, peers, the plan of every
    step, and the kernel calls on (batch, seqlen, heads, head_dim) parts."""

    seq_dim = 1  # the sequence dimension of q, k, v, out; lse's is its last
    # The transfers in flight while the current part is computed. False (for
    # measurements only: examples/context_parallel.py --overlap-report): each
    # transfer completes before the compute that follows it is started.
    overlap = True

    def __init__(self, group, seqlen_q, seqlen_k, causal, balanced, softcap=0.0, masked=False):
        self._peers(group)
        w, r = self.world, self.rank
        per = len(chunk_ids(0, w, balanced))
        # bottom-right: query row i of the full sequence sits at key position i + Lk - Lq.
        offset = seqlen_k * w - seqlen_q * w
        q_pos = _positions(r, w, balanced, seqlen_q, offset)
        # Step i: rank r holds the key part of rank (r - i) % w; k_pos[i], its global positions.
        self.k_pos = [_positions((r - i) % w, w, balanced, seqlen_k, 0) for i in range(w)]
        self.plans = [_plan(q_pos, kp, causal, seqlen_q // per, seqlen_k // per, masked) for kp in self.k_pos]
        self.softcap = softcap

    def _peers(self, group):
        self.group, self.rank, self.world = _group_info(group)
        if isinstance(self.group, ThreadGroup):
            self.next, self.prev = (self.rank + 1) % self.world, (self.rank - 1) % self.world
            self._sent = collections.Counter()  # transfers per tag: a ThreadGroup matches them by number
            return
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world)

    def exchange(self, tensors, tag):
        """Send tensors to the next rank, receive the same shapes from the previous
        one; returns (requests, received buffers)."""
        if isinstance(self.group, ThreadGroup):
            self._sent[tag] += 1
            reqs, bufs = self.group.exchange(self, tensors, tag, self._sent[tag])
        else:
            bufs = [torch.empty_like(t) for t in tensors]
            ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in tensors]
            ops += [dist.P2POp(dist.irecv, b, self.prev, self.group, tag) for b in bufs]
            reqs = dist.batch_isend_irecv(ops)
        if not self.overlap:
            _wait(reqs)
            reqs = []  # done (a second wait on a finished gloo request does not return)
        return reqs, bufs

    def rows(self, x, a, e):
        return x.narrow(self.seq_dim, a, e - a)

    def lse_rows(self, lse, a, e):
        return lse.narrow(lse.dim() - 1, a, e - a)

    def lse_shape(self, q):
        return (q.shape[0], q.shape[2], q.shape[1])

    def mask_block(self, mask, step, a, e, c, f):
        """The part of an attn_mask-shaped tensor (this rank's query rows, the
        global key columns) that the call (q rows a:e, k rows c:f) of a step
        reads: a view (the plan keeps c:f inside one chunk). None without a mask."""
        if mask is None:
            return None
        if mask.shape[-2] != 1:
            mask = mask.narrow(-2, a, e - a)
        if mask.shape[-1] != 1:
            mask = mask.narrow(-1, int(self.k_pos[step][c]), f - c)
        return mask

    def fwd(self, q, k, v, scale, wr, mask):
        return _ops.fwd_op(q, k, v, scale, -1, wr, False, self.softcap, None, mask)

    def bwd(self, dout, q, k, v, out, lse, scale, wr, deterministic, mask, mask_grad):
        args = (dout, q, k, v, out, lse, scale, -1, wr, False, deterministic)
        if mask_grad:
            return _ops.bwd_mask_grad(*args, mask)
        return (*_ops.bwd(*args, self.softcap, None, mask), None)

    def merge(self, acc_out, acc_lse, out, lse):
        _merge(acc_out, acc_lse, out, lse)


class _VarlenRing(_Ring):
    """Packed sequences (total, heads, head_dim), each split into chunks of its
    own (per-sequence head-tail balancing): a rank's part is its first chunk of
    every sequence, packed, then its second. With equal lengths per sequence
    for q and k, which keys a chunk sees depends on the chunk ids alone: one
    varlen call per (query chunk, key chunk) pair, for all sequences at once."""

    seq_dim = 0

    def __init__(self, group, lengths, causal, balanced, device, softcap=0.0):
        self._peers(group)
        self.softcap = softcap
        w, r = self.world, self.rank
        n = _n_chunks(w, balanced)
        sizes = [length // n for length in lengths]
        self.max_chunk = max(sizes)
        self.cu = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32, device=device)
        t = sum(sizes)  # rows of one chunk slot
        self.plans = []
        for i in range(w):
            calls = []
            for slot_q, cq in enumerate(chunk_ids(r, w, balanced)):
                for slot_k, ck in enumerate(chunk_ids((r - i) % w, w, balanced)):
                    if causal and cq < ck:
                        continue  # every key of chunk ck comes after every query of chunk cq
                    wr = 0 if causal and cq == ck else -1
                    calls.append((slot_q * t, (slot_q + 1) * t, slot_k * t, (slot_k + 1) * t, wr))
            self.plans.append(calls)

    def lse_shape(self, q):
        return (q.shape[1], q.shape[0])

    def mask_block(self, mask, step, a, e, c, f):
        return None  # (no attn_mask for packed sequences)

    def fwd(self, q, k, v, scale, wr, mask):
        m = self.max_chunk
        return _ops.varlen_fwd(q, k, v, self.cu, self.cu, m, m, scale, -1, wr, False, self.softcap)

    def bwd(self, dout, q, k, v, out, lse, scale, wr, deterministic, mask, mask_grad):
        m, cu = self.max_chunk, self.cu
        dq, dk, dv = _ops.varlen_bwd(
            dout, q, k, v, out, lse, cu, cu, m, m, scale, -1, wr, False, deterministic, self.softcap
        )
        return dq, dk, dv, None

    def merge(self, acc_out, acc_lse, out, lse):
        _merge(acc_out.unsqueeze(0), acc_lse.unsqueeze(0), out.unsqueeze(0), lse.unsqueeze(0))


def _wait(reqs):
    for req in reqs:
        req.wait()


def _merge(acc_out, acc_lse, out, lse):
    """acc_out (B, n, H, D), acc_lse (B, H, n) float32 views updated in place with
    one block's out (B, n, H, D) and lse (B, H, n): softmax over the union of their keys."""
    new = torch.logaddexp(acc_lse, lse)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)  # rows that see no key yet
    w_old = torch.exp(acc_lse - safe).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(lse.to(new.dtype) - safe).transpose(1, 2).unsqueeze(-1)
    acc_out.mul_(w_old).add_(out.to(acc_out.dtype) * w_new)
    acc_lse.copy_(new)


def _ring_forward(ring, q, k, v, scale, mask=None):
    acc_dtype = _ops._lse_dtype(q.dtype)
    acc_out = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    acc_lse = torch.full(ring.lse_shape(q), float("-inf"), dtype=acc_dtype, device=q.device)
    rows = ring.rows
    k_cur, v_cur = k, v
    for i in range(ring.world):
        if i + 1 < ring.world:  # the next part in flight while this one is computed
            reqs, (k_next, v_next) = ring.exchange([k_cur, v_cur], tag=0)
        for a, e, c, f, wr in ring.plans[i]:
            m = ring.mask_block(mask, i, a, e, c, f)
            out, lse = ring.fwd(rows(q, a, e), rows(k_cur, c, f), rows(v_cur, c, f), scale, wr, m)
            ring.merge(rows(acc_out, a, e), ring.lse_rows(acc_lse, a, e), out, lse)
        if i + 1 < ring.world:
            _wait(reqs)
            k_cur, v_cur = k_next, v_next
    return acc_out.to(q.dtype), acc_lse


def _ring_backward(ring, dout, q, k, v, out, lse, scale, deterministic, dest=None, mask=None, mask_grad=False):
    """(dq, dk, dv), and with mask_grad the gradient of the float attn_mask
    (its shape and dtype; this rank's rows, summed in float32 as the gradients are)."""
    acc_dtype = _ops._lse_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    dmask = torch.zeros(mask.shape, dtype=acc_dtype, device=mask.device) if mask_grad else None
    dout = _ops.unit_last_stride(dout)
    rows = ring.rows
    k_cur, v_cur = k, v
    dkv_reqs = dk_acc = dv_acc = None
    for i in range(ring.world):
        if i + 1 < ring.world:
            kv_reqs, (k_next, v_next) = ring.exchange([k_cur, v_cur], tag=1)
        dk_blk = torch.zeros(k.shape, dtype=acc_dtype, device=k.device)
        dv_blk = torch.zeros(v.shape, dtype=acc_dtype, device=v.device)
        for a, e, c, f, wr in ring.plans[i]:
            dq_p, dk_p, dv_p, dm_p = ring.bwd(
                rows(dout, a, e), rows(q, a, e), rows(k_cur, c, f), rows(v_cur, c, f), rows(out, a, e),
                ring.lse_rows(lse, a, e).contiguous(), scale, wr, deterministic, ring.mask_block(mask, i, a, e, c, f),
                mask_grad,
            )  # fmt: skip
            if mask_grad:
                ring.mask_block(dmask, i, a, e, c, f).add_(dm_p)
            rows(dq, a, e).add_(dq_p)
            rows(dk_blk, c, f).add_(dk_p)
            rows(dv_blk, c, f).add_(dv_p)
        if dkv_reqs is not None:  # this part's dK / dV so far, from the ranks it visited before
            _wait(dkv_reqs)
            dk_blk += dk_acc
            dv_blk += dv_acc
        if ring.world == 1:
            return (*_finish((dq, dk_blk, dv_blk), (q, k, v), dest), _mask_grad(dmask, mask))
        dkv_reqs, (dk_acc, dv_acc) = ring.exchange([dk_blk, dv_blk], tag=2)
        if i + 1 < ring.world:
            _wait(kv_reqs)
            k_cur, v_cur = k_next, v_next
    _wait(dkv_reqs)  # after the last step, each part's accumulator has come home
    return (*_finish((dq, dk_acc, dv_acc), (q, k, v), dest), _mask_grad(dmask, mask))


def _mask_grad(acc, mask):
    return None if acc is None else acc.to(mask.dtype)


def _finish(accs, inputs, dest):
    """The float32 accumulators in the inputs' dtype, or copied into the caller's
    buffers (dest: (dq, dk, dv), each None or a tensor of its input's shape, any
    strides and floating dtype): one rounding, no intermediate tensor."""
    out = []
    for acc, x, buf in zip(accs, inputs, dest or (None, None, None)):
        out.append(acc.to(x.dtype) if buf is None else buf.copy_(acc))
    return tuple(out)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, scale, ring, deterministic):
        q, k, v = (x.contiguous() for x in (q, k, v))
        out, lse = _ring_forward(ring, q, k, v, scale, attn_mask)
        ctx.save_for_backward(q, k, v, out, lse, attn_mask)
        ctx.ring, ctx.scale, ctx.deterministic = ring, scale, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, mask = ctx.saved_tensors
        mask_grad = ctx.needs_input_grad[3]
        grads = _ring_backward(
            ctx.ring, dout, q, k, v, out, lse, ctx.scale, ctx.deterministic, mask=mask, mask_grad=mask_grad
        )
        return (*grads, None, None, None)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    group=None,
    balanced: bool | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
    attn_mask: torch.Tensor | None = None,
    softcap: float = 0.0,
):
    """Attention over the whole sequence, each rank of ``group`` holding a part.

    q (batch, seqlen_q / world, heads_q, head_dim), k, v (batch, seqlen_k /
    world, heads_kv, head_dim): this rank's parts (``shard``), the same sizes
    on every rank. causal: flash_attn_func's bottom-right causal mask over the
    full sequences. balanced: the head-tail layout of ``shard`` (default: when
    causal). attn_mask: torch SDPA's (bool, or float added to the scores,
    differentiable), broadcastable to (batch, heads_q, seqlen_q / world,
    seqlen_k): this rank's query rows (``shard(mask, dim=-2)``), every key
    column; on top of causal. softcap: flash-attn's (not with attn_mask).
    Returns this rank's part of the output (and, with return_lse, of the
    log-sum-exp (batch, heads_q, seqlen_q / world), float32), differentiable in
    q, k, v (and a float attn_mask). Every rank of the group must call it, with
    the same arguments."""
    ring, scale = _dense_ring("ring_attention", q, k, v, causal, softmax_scale, group, balanced, attn_mask, softcap)
    out, lse = _RingAttention.apply(q, k, v, attn_mask, scale, ring, bool(deterministic))
    return (out, lse) if return_lse else out


def _dense_ring(fn, q, k, v, causal, softmax_scale, group, balanced, attn_mask=None, softcap=0.0):
    """The checks of ring_attention's arguments; returns (its _Ring, the scale)."""
    if balanced is None:
        balanced = causal
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"flashattn_ext.{fn}: {name} must be a (batch, seqlen, heads, head_dim) tensor")
    per = len(chunk_ids(0, 1, balanced))
    if q.shape[1] % per or k.shape[1] % per:
        raise ValueError(
            f"flashattn_ext.{fn}: with balanced=True each rank's part holds two chunks, so its "
            f"lengths must be even (got seqlen_q {q.shape[1]}, seqlen_k {k.shape[1]})"
        )
    _ops.check_qkv(q, k, v, unit_stride=False)
    softcap = float(softcap)
    _ops.check_score_mod(q, softcap, None, q.shape[0], q.shape[2])
    _, _, world = _group_info(group)
    if attn_mask is not None:
        _check_ring_mask(fn, attn_mask, q, k.shape[1] * world, softcap)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    ring = _Ring(group, q.shape[1], k.shape[1], bool(causal), bool(balanced), softcap, attn_mask is not None)
    return ring, float(scale)


def _check_ring_mask(fn, m, q, seqlen_k, softcap):
    """A rank's attn_mask: its own query rows, every key column (the kernels'
    checks for the rest: dtype, device, no softcap)."""
    if not isinstance(m, torch.Tensor):
        raise TypeError(f"flashattn_ext.{fn}: attn_mask must be a tensor or None, got {type(m).__name__}")
    full = (q.shape[0], q.shape[2], q.shape[1], seqlen_k)
    if not 2 <= m.dim() <= 4 or any(size not in (want, 1) for size, want in zip(m.shape, full[4 - m.dim() :])):
        raise ValueError(
            f"flashattn_ext.{fn}: attn_mask of shape {list(m.shape)} does not broadcast to (batch, heads_q, "
            f"seqlen_q / world, seqlen_k) = {full}: each rank passes its own query rows of the full mask "
            "(ring.shard(mask, group, dim=-2)) and every key column"
        )
    _ops.check_attn_mask(q, q.new_empty((0, seqlen_k), device="meta"), m, softcap, None)


# ----------------------------------------------------------------------------- packed sequences


def _lengths_of(cu_seqlens):
    cu = [int(x) for x in cu_seqlens.tolist()]
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


def _varlen_layout(cu_seqlens, world, balanced, name):
    lengths = _lengths_of(cu_seqlens)
    n = _n_chunks(world, balanced)
    bad = [length for length in lengths if length % n or length == 0]
    if bad:
        raise ValueError(
            f"flashattn_ext.ring.{name}: every sequence length must be a positive multiple of {n} "
            f"({'2 x ' if balanced else ''}world size {world}), got {bad[:4]}; pad each sequence"
        )
    return lengths, n


def shard_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, group=None, *, balanced: bool = True) -> torch.Tensor:
    """This rank's part of packed sequences x (total, ...) with cumulative lengths
    cu_seqlens (batch + 1,): its chunks of every sequence, the first chunk of each
    sequence packed, then the second (balanced). Contiguous."""
    _, rank, world = _group_info(group)
    lengths, n = _varlen_layout(cu_seqlens, world, balanced, "shard_varlen")
    pieces = list(x.split(lengths, dim=0))
    chunks = [p.chunk(n, dim=0) for p in pieces]
    return torch.cat([c[j] for j in chunk_ids(rank, world, balanced) for c in chunks], dim=0).contiguous()


def unshard_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, group=None, *, balanced: bool = True, dim: int = 0):
    """The packed sequences from every rank's part (shard_varlen's inverse); dim:
    the packed dimension of x (1 for a (heads, total) log-sum-exp)."""
    group, _, world = _group_info(group)
    lengths, n = _varlen_layout(cu_seqlens, world, balanced, "unshard_varlen")
    parts = _all_gather(x.contiguous(), group, world)
    sizes = [length // n for length in lengths]
    chunks = {}  # (sequence, chunk id) -> rows
    for r, part in enumerate(parts):
        slots = part.split([sum(sizes)] * len(chunk_ids(r, world, balanced)), dim=dim)
        for c, slot in zip(chunk_ids(r, world, balanced), slots):
            for b, piece in enumerate(slot.split(sizes, dim=dim)):
                chunks[(b, c)] = piece
    return torch.cat([chunks[(b, c)] for b in range(len(lengths)) for c in range(n)], dim=dim)


def ring_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    group=None,
    balanced: bool | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
    softcap: float = 0.0,
):
    """ring_attention for packed sequences (documents), self-attention: q, k, v
    (total / world, heads, head_dim) parts made by ``shard_varlen`` with the
    global cu_seqlens (batch + 1,) int32 of the full sequences (the same tensor
    on every rank; read on the host once). Every sequence is balanced on its own
    (its length must be a multiple of 2 * world). lse: (heads_q, total / world).
    softcap: flash-attn's."""
    ring, scale = _varlen_ring(
        "ring_attention_varlen", q, k, v, cu_seqlens, causal, softmax_scale, group, balanced, None, softcap
    )
    out, lse = _RingAttention.apply(q, k, v, None, scale, ring, bool(deterministic))
    return (out, lse) if return_lse else out


def _varlen_ring(fn, q, k, v, cu_seqlens, causal, softmax_scale, group, balanced, attn_mask=None, softcap=0.0):
    """The checks of ring_attention_varlen's arguments; returns (its _VarlenRing, the scale)."""
    if balanced is None:
        balanced = causal
    _, _, world = _group_info(group)
    lengths, _ = _varlen_layout(cu_seqlens, world, bool(balanced), fn)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"flashattn_ext.{fn}: {name} must be a (total, heads, head_dim) tensor")
    if q.shape[0] != sum(lengths) // world or k.shape[0] != q.shape[0]:
        raise ValueError(
            f"flashattn_ext.{fn}: q, k hold {q.shape[0]}, {k.shape[0]} rows, but this rank's part of "
            f"cu_seqlens' sequences is {sum(lengths) // world} rows (use shard_varlen)"
        )
    softcap = float(softcap)
    _ops.check_score_mod(q, softcap, None, 1, q.shape[1])
    if attn_mask is not None:
        raise ValueError(f"flashattn_ext.{fn}: packed sequences take no attn_mask (cu_seqlens is their mask)")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _VarlenRing(group, lengths, bool(causal), bool(balanced), q.device, softcap), float(scale)


# ----------------------------------------------------------------------------- forward and backward apart


def _make_ring(fn, q, k, v, cu_seqlens, *args):
    """args: causal, softmax_scale, group, balanced, attn_mask, softcap."""
    if cu_seqlens is None:
        return _dense_ring(fn, q, k, v, *args)
    return _varlen_ring(fn, q, k, v, cu_seqlens, *args)


def ring_attention_forward(
    q, k, v, *, cu_seqlens=None, causal=False, softmax_scale=None, group=None, balanced=None, attn_mask=None,
    softcap=0.0,
):  # fmt: skip
    """The forward of ring_attention (cu_seqlens given: of ring_attention_varlen)
    alone, outside autograd: returns (out, lse) of this rank's part, which
    ring_attention_backward takes, for a caller that runs its own autograd
    Function or recomputation. Same arguments and rules as ring_attention."""
    args = (causal, softmax_scale, group, balanced, attn_mask, softcap)
    ring, scale = _make_ring("ring_attention_forward", q, k, v, cu_seqlens, *args)
    with torch.no_grad():
        return _ring_forward(ring, *(x.contiguous() for x in (q, k, v)), scale, attn_mask)


def ring_attention_backward(
    dout, q, k, v, out, lse, *, cu_seqlens=None, causal=False, softmax_scale=None, group=None, balanced=None,
    attn_mask=None, softcap=0.0, deterministic=False, dq=None, dk=None, dv=None,
):  # fmt: skip
    """The backward of ring_attention from this rank's dout, q, k, v, the merged
    out and the global lse that ring_attention_forward returned (the same
    arguments as that call). Returns (dq, dk, dv) of this rank's parts. dq, dk,
    dv: optional buffers of q's, k's, v's shapes on their device, any strides
    (views into a packed (batch, seqlen, 3, heads, head_dim) gradient, say) and
    any floating dtype (a float32 buffer gets the float32 accumulator as it is):
    the gradient is written into them, with one rounding and no intermediate
    tensor, and they are returned. (A float attn_mask's gradient comes from
    ring_attention's autograd only.)"""
    args = (causal, softmax_scale, group, balanced, attn_mask, softcap)
    ring, scale = _make_ring("ring_attention_backward", q, k, v, cu_seqlens, *args)
    dest = (dq, dk, dv)
    for name, buf, x in zip(("dq", "dk", "dv"), dest, (q, k, v)):
        if buf is None:
            continue
        if not isinstance(buf, torch.Tensor) or buf.shape != x.shape or buf.device != x.device:
            raise ValueError(
                f"flashattn_ext.ring_attention_backward: {name} must be a tensor of shape {tuple(x.shape)} on "
                f"{x.device}, got {tuple(buf.shape) if isinstance(buf, torch.Tensor) else type(buf).__name__}"
            )
        if not buf.dtype.is_floating_point:
            raise TypeError(f"flashattn_ext.ring_attention_backward: {name} has dtype {buf.dtype}, not a floating one")
    if tuple(lse.shape) != tuple(ring.lse_shape(q)):
        raise ValueError(
            f"flashattn_ext.ring_attention_backward: lse has shape {tuple(lse.shape)}, not {tuple(ring.lse_shape(q))} "
            "(the global log-sum-exp ring_attention_forward returned)"
        )
    with torch.no_grad():
        q, k, v, out = (x.contiguous() for x in (q, k, v, out))
        return _ring_backward(ring, dout, q, k, v, out, lse, scale, bool(deterministic), dest, attn_mask)[:3]
