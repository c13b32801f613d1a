"""Naive attention in plain PyTorch: the oracle every test compares against.

Three separate, readable steps, nothing fused and nothing clever:

    scores = softmax_scale * q @ k^T      masked positions set to -inf
    p      = softmax(scores)              rows that see no key: p = 0
    out    = p @ v

Two entry points share one core:

* ``attention_ref(q, k, v, ...)`` takes the FlashAttention layout
  (batch, seqlen, heads, head_dim) (or ``layout="bhsd"``) and the mask
  arguments of ``flash_attn_func`` plus ``bottom_right``.
* ``sdpa_ref(query, key, value, ...)`` takes torch's layout (..., heads, L, E)
  and the arguments of ``torch.nn.functional.scaled_dot_product_attention``.

Precision (``upcast``):

* ``upcast=True`` (default) computes in the accumulation dtype: float32 for
  float16/bfloat16 inputs, float64 for float32/float64 inputs (a float32 oracle
  could not judge a float32 kernel). The result is returned **in that upcast
  dtype**, not rounded back to the input dtype, so that errors measured against
  it are not hidden by a final rounding. Cast it yourself if you need the input
  dtype.
* ``upcast=False`` computes every step in the input dtype: the "naive
  low-precision" computation whose error is the yardstick of the tolerance rule
  (a kernel may err at most a small multiple of it).
* ``upcast=<torch.dtype>`` computes (and returns) in that dtype.

Semantics shared with the kernels (csrc/flash_params.h): key j is visible from
query i iff ``j <= i + diag_offset + window_right`` (when window_right >= 0) and
``j >= i + diag_offset - window_left`` (when window_left >= 0); causal is
window_right = 0; ``diag_offset = seqlen_k - seqlen_q`` when ``bottom_right``
(FlashAttention's alignment), 0 otherwise (torch SDPA's ``is_causal``). A row
that sees no key outputs zeros, has lse = -inf and receives zero gradients
(never NaN). GQA/MQA: query head h reads key/value head h // (heads_q // heads_kv)
(repeat_interleave of the key/value heads).

Non-finite inputs: an output row depends only on the keys it can see. A NaN in
q, or in k or v at a visible key, makes the row's output NaN (k: the whole row;
v: the columns where v has it; an infinity in v gives an infinity or NaN there);
a NaN or infinity in k or v at a key the row cannot see (outside its causal
diagonal or window) never reaches it, and a row that sees no key is 0. (torch's
math backend lets masked value rows through as 0 * NaN = NaN, and its CPU flash
backend does so for every row of a tile the key lies in.) The kernels apply the
same rule to the gradients: dq of a row depends only on the keys it sees, dk/dv
of a key only on the queries that see it.

lse is the natural-log log-sum-exp of the scaled, masked scores, shaped
(batch, heads, seqlen_q) for ``attention_ref`` and (..., heads, L) for
``sdpa_ref``, in the compute dtype.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "attention_ref",
    "sdpa_ref",
    "visible_mask",
    "alibi_bias",
    "compute_dtype",
    "attention_flops",
    "philox4x32_10",
    "dropout_keep_threshold",
    "dropout_offset_increment",
    "dropout_keep_mask",
    "rotary_ref",
    "kvcache_append_rotary_ref",
]


def compute_dtype(dtype: torch.dtype, upcast=True) -> torch.dtype:
    """The dtype the oracle computes in for inputs of ``dtype``."""
    if isinstance(upcast, torch.dtype):
        return upcast
    if not upcast:
        return dtype
    if dtype in (torch.float32, torch.float64):
        return torch.float64
    return torch.float32


def attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal=False, mode="fwd") -> float:
    """The FLOP count every figure of this project uses (FlashAttention's
    convention): forward 4 * b * h * n_q * n_k * d, halved when causal;
    backward 2.5x the forward; "fwd+bwd" 3.5x."""
    f = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    if causal:
        f /= 2
    return f * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode]


def visible_mask(seqlen_q, seqlen_k, window_left=-1, window_right=-1, diag_offset=0, device=None):
    """Bool (seqlen_q, seqlen_k): True where query i may see key j."""
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if window_right >= 0:
        mask &= j <= i + diag_offset + window_right
    if window_left >= 0:
        mask &= j >= i + diag_offset - window_left
    return mask


def alibi_bias(alibi_slopes, seqlen_q, seqlen_k, device=None):
    """flash-attn's ALiBi bias, -slope * |i + seqlen_k - seqlen_q - j| for query
    i and key j: (heads, L, S) for (heads,) slopes, (batch, heads, L, S) for
    (batch, heads) ones; float64 (exact for the float64 oracle), no gradient to the slopes."""
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    dist = (i + seqlen_k - seqlen_q - j).abs().to(torch.float64)  # (L, S)
    return -alibi_slopes.detach().to(device=device, dtype=torch.float64)[..., None, None] * dist


# ---------------------------------------------------------------------------
# Dropout: the keep mask of csrc/philox.h (its header documents the layout),
# in plain int64 torch ops. Every value is a uint32 held in an int64 tensor;
# products of two uint32 are split in 16-bit halves so that no intermediate
# exceeds 2^49 (an int64 product of two uint32 would overflow).

_MASK32 = 0xFFFFFFFF
_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85


def _mulhilo32(a: int, b: torch.Tensor):
    """(low, high) 32 bits of the 64-bit product of the constant a and the uint32s b."""
    p_lo = (a & 0xFFFF) * b  # < 2^48
    p_hi = (a >> 16) * b  # < 2^48
    t = p_lo + ((p_hi & 0xFFFF) << 16)  # < 2^49
    return t & _MASK32, (p_hi >> 16) + (t >> 32)


def philox4x32_10(c0, c1, c2, c3, k0: int, k1: int):
    """Philox4x32-10 of the counters (int64 tensors of uint32 values, broadcast
    together) under the key (k0, k1): four int64 tensors of uint32 values."""
    c0, c1, c2, c3 = torch.broadcast_tensors(c0, c1, c2, c3)
    for _ in range(10):
        lo0, hi0 = _mulhilo32(_PHILOX_M0, c0)
        lo1, hi1 = _mulhilo32(_PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_W0) & _MASK32, (k1 + _PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def dropout_keep_threshold(p: float) -> int:
    """Keep iff the element's 16-bit slice is below this: floor((1 - p) * 65536 + 0.5)."""
    return min(max(int(math.floor((1.0 - p) * 65536.0 + 0.5)), 0), 65536)


def dropout_offset_increment(batch: int, heads_q: int) -> int:
    """The planes one call consumes: batch * heads_q rounded up to a multiple of 4."""
    return (batch * heads_q + 3) // 4 * 4


def _as_seed_offset(rng_state):
    if isinstance(rng_state, torch.Tensor):
        rng_state = [int(x) for x in rng_state.detach().cpu().tolist()]
    seed, offset = (int(x) & 0xFFFFFFFFFFFFFFFF for x in rng_state)
    return seed, offset


def dropout_keep_mask(rng_state, batch, heads_q, seqlen_q, seqlen_k, dropout_p, device=None):
    """Bool (batch, heads_q, seqlen_q, seqlen_k): True where element (b, h, i, j)
    is kept, for rng_state = (seed, offset) (ints, or the int64 (2,) tensor the
    ops take; uint64 values read modulo 2^64) and probability dropout_p: the
    mask every kernel draws (csrc/philox.h)."""
    seed, offset = _as_seed_offset(rng_state)
    threshold = dropout_keep_threshold(dropout_p)
    groups = (seqlen_k + 31) // 32 * 4
    i64 = dict(dtype=torch.int64, device=device)
    # plane = offset + b * heads_q + h as a uint64 (wrapping), in 32-bit halves.
    c2 = (offset & _MASK32) + torch.arange(batch * heads_q, **i64).view(batch, heads_q, 1, 1)
    c3 = ((offset >> 32) + (c2 >> 32)) & _MASK32
    c2 = c2 & _MASK32
    c0 = torch.arange(groups, **i64).view(1, 1, 1, groups)  # u = 4 g + t
    c1 = torch.arange(seqlen_q, **i64).view(1, 1, seqlen_q, 1)
    x = torch.stack(philox4x32_10(c0, c1, c2, c3, seed & _MASK32, seed >> 32), dim=-1)  # (B, H, L, groups, 4)
    halves = torch.stack((x & 0xFFFF, x >> 16), dim=-1)  # (..., groups, n, e): key 32 g + 8 n + 2 t + e
    keep = halves < threshold
    keep = keep.view(batch, heads_q, seqlen_q, groups // 4, 4, 4, 2)  # (g, t, n, e)
    keep = keep.permute(0, 1, 2, 3, 5, 4, 6).reshape(batch, heads_q, seqlen_q, groups * 8)  # (g, n, t, e)
    return keep[..., :seqlen_k]


def _attention_core(
    q, k, v, scale, keep=None, bias=None, dtype=None, return_lse=False, softcap=0.0, dropout_p=0.0, dropout_keep=None
):
    """q (..., H, L, E), k (..., H, S, E), v (..., H, S, Ev), heads already matched.

    keep: bool mask broadcastable to (..., H, L, S), True = attend.
    bias: float mask broadcastable to (..., H, L, S), added to the scaled scores
    (after the softcap).
    softcap > 0: the scaled scores s become softcap * tanh(s / softcap) (flash-attn's).
    dropout_keep: bool (..., H, L, S), the dropout's keep mask: the probabilities
    it keeps are scaled by 1 / (1 - dropout_p), the others are 0; lse stays that
    of the softmax without dropout (as the kernels return it)."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    # Step 1: scores, masked with -inf.
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias.to(dtype)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1) if return_lse else None
    # Rows that see no key: give them finite scores so that softmax (and its
    # backward) stays NaN-free, then zero their probabilities.
    dead = (scores == float("-inf")).all(dim=-1, keepdim=True)
    scores = scores.masked_fill(dead, 0.0)
    # Step 2: softmax.
    p = torch.softmax(scores, dim=-1)
    p = p.masked_fill(dead, 0.0)
    if dropout_keep is not None:
        p = torch.where(dropout_keep, p * (1.0 / (1.0 - dropout_p) if dropout_p < 1.0 else 0.0), 0.0)
    # Step 3: weighted sum of the values. A key a row cannot see contributes
    # nothing to it, not even a NaN or an infinity of its value row (the
    # product 0 * NaN of a plain matmul would be NaN): the rule of the kernels.
    if keep is not None and not bool(torch.isfinite(v).all()):
        out = torch.where(keep.unsqueeze(-1), p.unsqueeze(-1) * v.unsqueeze(-3), 0.0).sum(-2)
    else:
        out = torch.matmul(p, v)
    return (out, lse) if return_lse else out


def _repeat_kv(x, heads_q, dim):
    heads_kv = x.shape[dim]
    if heads_kv == heads_q:
        return x
    if heads_q % heads_kv != 0:
        raise ValueError(f"reference: {heads_q} query heads are not a multiple of {heads_kv} key/value heads")
    return x.repeat_interleave(heads_q // heads_kv, dim=dim)


def attention_ref(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    bottom_right=True,
    upcast=True,
    layout="bshd",
    return_lse=False,
    softcap=0.0,
    alibi_slopes=None,
    attn_mask=None,
    dropout_p=0.0,
    rng_state=None,
    dropout_keep=None,
):
    """Naive attention with flash_attn_func's arguments (softcap and
    alibi_slopes included: softcap first, then the ALiBi bias, alibi_bias),
    and torch SDPA's attn_mask (bool: True = attend, or float: added to the
    scaled scores; broadcastable to (batch, heads_q, seqlen_q, seqlen_k)
    whatever the layout), which combines with the window (both must allow a key).

    dropout_p > 0 needs rng_state = (seed, offset): the exact keep mask of the
    kernels (dropout_keep_mask), applied to the probabilities; or dropout_keep,
    that mask given as a bool (batch, heads_q, seqlen_q, seqlen_k) tensor (one
    sequence of a varlen batch: its corner of its plane).

    layout "bshd": q (batch, seqlen_q, heads_q, d), k/v (batch, seqlen_k, heads_kv, d);
    layout "bhsd": q (batch, heads_q, seqlen_q, d), k/v (batch, heads_kv, seqlen_k, d).
    The output has q's layout; lse is (batch, heads_q, seqlen_q).
    causal=True sets window_right to 0 (window_left is kept), as flash_attn_func does.
    """
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    elif layout != "bhsd":
        raise ValueError(f"reference: layout must be 'bshd' or 'bhsd', got {layout!r}")
    seqlen_q, seqlen_k = q.shape[-2], k.shape[-2]
    window_left, window_right = window_size
    if causal:
        window_right = 0
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    keep = None
    if window_left >= 0 or window_right >= 0:
        keep = visible_mask(
            seqlen_q, seqlen_k, window_left, window_right, seqlen_k - seqlen_q if bottom_right else 0, q.device
        )
    k, v = _repeat_kv(k, q.shape[1], 1), _repeat_kv(v, q.shape[1], 1)
    bias = None if alibi_slopes is None else alibi_bias(alibi_slopes, seqlen_q, seqlen_k, q.device)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = attn_mask if keep is None else keep & attn_mask
    elif attn_mask is not None:
        bias = attn_mask if bias is None else bias + attn_mask  # (a mask that requires grad gets one)
    res = _attention_core(
        q,
        k,
        v,
        scale,
        keep=keep,
        bias=bias,
        dtype=compute_dtype(q.dtype, upcast),
        return_lse=return_lse,
        softcap=softcap or 0.0,
        dropout_p=dropout_p,
        dropout_keep=dropout_keep if dropout_keep is not None else _dropout_keep_for(q, seqlen_k, dropout_p, rng_state),
    )
    out, lse = res if return_lse else (res, None)
    if layout == "bshd":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def _dropout_keep_for(q, seqlen_k, dropout_p, rng_state):
    """The keep mask for q (batch, heads, L, E), or None without dropout."""
    if not dropout_p:
        return None
    if rng_state is None:
        raise ValueError(
            "reference: dropout_p > 0 needs rng_state = (seed, offset) (the mask is that of csrc/philox.h)"
        )
    batch, heads, seqlen_q = q.shape[0], q.shape[1], q.shape[2]
    return dropout_keep_mask(rng_state, batch, heads, seqlen_q, seqlen_k, dropout_p, q.device)


def sdpa_ref(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    upcast=True,
    return_lse=False,
    rng_state=None,
):
    """Naive attention with torch.nn.functional.scaled_dot_product_attention's
    arguments and layout (..., heads, L, E); value may have another last dim Ev.

    attn_mask: bool (True = attend) or float (added to the scaled scores),
    broadcastable to (..., heads, L, S). is_causal is aligned top-left.
    dropout_p > 0 needs rng_state = (seed, offset): the kernels' exact keep
    mask (dropout_keep_mask) for (batch, heads) = the leading dimensions of
    query flattened, and heads (batch 1) for a 3-D query."""
    if dropout_p != 0.0 and rng_state is None:
        raise NotImplementedError("sdpa_ref: dropout_p > 0 needs rng_state = (seed, offset) (the kernels' mask)")
    if is_causal and attn_mask is not None:
        raise ValueError("sdpa_ref: attn_mask and is_causal=True are exclusive (as in torch's math backend)")
    L, S = query.shape[-2], key.shape[-2]
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    keep, bias = None, None
    if is_causal:
        keep = visible_mask(L, S, -1, 0, 0, query.device)
    elif attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = attn_mask
        else:
            bias = attn_mask
    if enable_gqa and query.dim() >= 3:
        key, value = _repeat_kv(key, query.shape[-3], -3), _repeat_kv(value, query.shape[-3], -3)
    dropout_keep = None
    if dropout_p != 0.0:
        lead = query.shape[:-2]
        batch = math.prod(lead[:-1]) if len(lead) >= 2 else 1
        heads = lead[-1] if lead else 1
        dropout_keep = dropout_keep_mask(rng_state, batch, heads, L, S, dropout_p, query.device).view(*lead, L, S)
    return _attention_core(
        query,
        key,
        value,
        scale,
        keep=keep,
        bias=bias,
        dtype=compute_dtype(query.dtype, upcast),
        return_lse=return_lse,
        dropout_p=dropout_p,
        dropout_keep=dropout_keep,
    )


def rotary_ref(x, cos, sin, positions, interleaved):
    """x (..., heads, d) rotated on its first rotary_dim = 2 * cos.shape[1] dims,
    the entry at x[idx] by the angle of position positions[idx] (a LongTensor of
    x's leading shape): x1 * c - x2 * s, x1 * s + x2 * c in the accumulation
    dtype (compute_dtype), then rounded to x's dtype. interleaved: GPT-J pairs
    (2i, 2i + 1); else GPT-NeoX halves (i, i + rotary_dim / 2)."""
    ro = 2 * cos.shape[1]
    dt = compute_dtype(x.dtype)
    c = cos[positions].to(dt).unsqueeze(-2)  # (..., 1, ro / 2)
    s = sin[positions].to(dt).unsqueeze(-2)
    xr = x[..., :ro].to(dt)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : ro // 2], xr[..., ro // 2 :]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., ro:]), dim=-1)


def kvcache_append_rotary_ref(
    q, k, v, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table, cos, sin, interleaved, q_per_token
):
    """flashattn_ext::kvcache_append_rotary in plain torch ops (the op's oracle;
    its rules: csrc/append_rotary_params.h). Writes k (rotated) and v into
    k_cache / v_cache in place at positions cache_seqlens[b] + i, of cache row
    cache_batch_idx[b] (default b) or through block_table; returns q rotated
    (q_per_token: row i at cache_seqlens[b] + i, else every row at
    cache_seqlens[b]; a copy without cos / sin), None when q is None.
    Out-of-range values are clamped to the tensors, as the op does."""
    batch = cache_seqlens.shape[0]
    n_cache, page = k_cache.shape[0], k_cache.shape[1]
    capacity = page * block_table.shape[1] if block_table is not None else page
    base = cache_seqlens.long().unsqueeze(1)  # (batch, 1)
    q_out = None
    if q is not None:
        q_out = q.clone(memory_format=torch.contiguous_format)
        if cos is not None:
            steps = torch.arange(q.shape[1], device=q.device)
            pos_q = base + steps if q_per_token else base.expand(batch, q.shape[1])
            q_out = rotary_ref(q, cos, sin, pos_q.clamp(0, cos.shape[0] - 1), interleaved)
    if k is not None and k.shape[1]:
        pos = (base + torch.arange(k.shape[1], device=k.device)).clamp(0, max(capacity - 1, 0))  # (batch, seqlen_new)
        if cos is not None:
            k = rotary_ref(k, cos, sin, pos.clamp(max=cos.shape[0] - 1), interleaved)
        if block_table is not None:
            rows = torch.gather(block_table, 1, pos // page).long().clamp(0, max(n_cache - 1, 0))
            index = (rows, pos % page)
        elif cache_batch_idx is not None:
            index = (cache_batch_idx.long().clamp(0, max(n_cache - 1, 0)).unsqueeze(1), pos)
        else:
            index = (torch.arange(batch, device=k.device).unsqueeze(1), pos)
        k_cache.index_put_(index, k)
        v_cache.index_put_(index, v)
    return q_out
