"""Hugging Face transformers integration: flashattn_ext as an ``attn_implementation``.

    import flashattn_ext.hf
    flashattn_ext.hf.register()            # once, before the model is built
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fa_ext")

The name is ``"fa_ext"``, not "flashattn_ext": transformers treats every
implementation whose name contains "flash" as a flash-attn package or Hub kernel
and tries to load one.

:func:`register` adds :func:`attention_forward` to transformers' ``AttentionInterface``
and :func:`padding_mask` to its ``AttentionMaskInterface``: the model then hands the
attention a 2-D padding mask (batch, kv_len) or None -- never a dense 4-D mask -- as
it does for ``attn_implementation="flash_attention_2"``. (Without a mask function
registered, transformers passes no mask at all to a custom attention, so padded
batches would silently attend to the padding.)

:func:`attention_forward` follows transformers' own flash-attention integration
(``integrations/flash_attention.py`` and ``modeling_flash_attention_utils.py``), with
flashattn_ext's functions in place of flash-attn's:

* layout: transformers passes (batch, heads, seqlen, head_dim); the flash functions
  take (batch, seqlen, heads, head_dim) views (no copy); the output is returned as
  (batch, seqlen_q, heads, head_dim), which the model reshapes;
* causal is aligned bottom-right (flash-attn's rule), which is what a query chunk
  appended to a KV cache needs; ``is_causal`` from the call, else ``module.is_causal``;
* a padding mask: the padded tokens are removed and :func:`flashattn_ext.flash_attn_varlen_func`
  runs on the packed sequences (the query rows are the last ``q_len`` columns of the
  mask, i.e. left padding, as transformers assumes); padded query rows come back as zeros;
* packed sequences in one row (``position_ids`` restarting, or ``cu_seq_lens_q/k`` and
  ``max_length_q/k`` given): the varlen function on those boundaries;
* otherwise :func:`flashattn_ext.flash_attn_func`;
* GQA/MQA natively (no repeat of k/v), ``scaling`` as softmax_scale, ``dropout`` as
  dropout_p, ``sliding_window`` as window_size ``(w - 1, w - 1)`` when the keys are
  longer than the window, ``deterministic`` (or FLASH_ATTENTION_DETERMINISTIC=1);
* a value head dim different from the query's (MLA) is zero-padded and the output cropped;
* a dense 4-D mask (a model that builds its own): flashattn_ext.scaled_dot_product_attention
  with ``attn_mask``, which our kernels read in place (bool or additive, as the model built it);
* ``softcap`` (Gemma 2's attention logit softcapping) as flash_attn_func's softcap (not
  with a dense 4-D mask: the kernels take a mask or a softcap, not both; that raises);
* attention sinks (``s_aux``) and paged caches (``block_table``) raise, naming the
  argument: the kernels do not have them.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from . import interface

__all__ = ["IMPLEMENTATION", "register", "attention_forward", "padding_mask"]

IMPLEMENTATION = "fa_ext"  # no "flash" in it: see the module docstring


def register(name: str = IMPLEMENTATION) -> str:
    """Registers :func:`attention_forward` and :func:`padding_mask` with transformers
    under ``name``; returns ``name`` (pass it as ``attn_implementation``)."""
    if "flash" in name:
        raise ValueError(
            f"flashattn_ext.hf.register: name={name!r} contains 'flash', which makes transformers "
            "look for a flash-attn package or Hub kernel of that name; choose another (default 'fa_ext')"
        )
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError(
            f"flashattn_ext.hf.register needs transformers with AttentionInterface and "
            f"AttentionMaskInterface (4.53 or later): pip install transformers ({e})"
        ) from e
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    return name


def padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None, **kwargs):
    """The mask function registered with transformers: flash-attention's
    (``masking_utils.flash_attention_mask``: the 2-D padding mask (batch, kv_len), or
    None when no token is padding), plus the one case where transformers relies on the
    name containing "flash": a static cache. Its keys are ``max_cache_len`` slots of
    which only the first ``q_offset + q_length`` are written, and generate() drops an
    all-ones mask for every implementation but flash ones; so when no mask comes, an
    all-ones mask over the written slots is returned (the attention then reads only those)."""
    from transformers.masking_utils import flash_attention_mask

    mask = flash_attention_mask(
        batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset, attention_mask=attention_mask
    )
    if mask is not None or kv_offset != 0:
        return mask
    # A static cache passes its length as a tensor; reading it is a device sync per
    # forward (flash-attn's integration reads the mask's lengths on the host too).
    written = int(q_offset) + q_length
    if written >= kv_length:
        return None  # a dynamic cache: every key is written
    # The convention of a user's mask: one column per token seen so far, the last
    # q_length columns being the queries; the attention reads only those keys.
    device = kwargs.get("device", q_offset.device if isinstance(q_offset, torch.Tensor) else "cpu")
    return torch.ones(batch_size, written, dtype=torch.bool, device=device)


def _unpad(x, mask):
    """x (batch, seqlen, ...) -> (tokens, ...) rows where mask (batch, seqlen) is true,
    with their flat indices, the int32 cumulative lengths and the longest length."""
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return x.reshape(-1, *x.shape[2:])[indices], indices, cu, int(seqlens.max())


def _pad(x, indices, batch, seqlen):
    """The inverse of _unpad: rows scattered back, zeros elsewhere."""
    out = x.new_zeros(batch * seqlen, *x.shape[1:])
    out[indices] = x
    return out.view(batch, seqlen, *x.shape[1:])


def _packed_boundaries(position_ids, batch):
    """cu_seqlens of sequences packed in one row (position_ids restart), or None.
    The same test as transformers' _is_packed_sequence (it reads the ids: a sync)."""
    if position_ids is None or batch != 1 or position_ids.shape[-1] == 1:
        return None
    pos = position_ids.reshape(-1)
    if bool((pos[1:] - pos[:-1] == 1).all()):
        return None
    starts = (pos == pos.min()).nonzero().view(-1).to(torch.int32)
    cu = torch.cat((starts, torch.tensor([pos.numel()], dtype=torch.int32, device=pos.device)))
    return cu, int(cu.diff().max())


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (batch, heads_q, q_len, head_dim),
    key/value (batch, heads_kv, kv_len, head_dim); returns ((batch, q_len, heads_q,
    head_dim_v), None) -- no attention weights, as every flash integration."""
    fn = "flashattn_ext.hf.attention_forward"
    if s_aux is not None:
        raise NotImplementedError(
            f"{fn}: s_aux (attention sinks) is not supported by flashattn_ext's kernels; "
            "use attn_implementation='eager' for this model"
        )
    if kwargs.get("block_table") is not None:
        raise NotImplementedError(
            f"{fn}: block_table (continuous batching's paged cache) is not supported through this "
            "integration; generate with the default (dynamic) cache"
        )
    if kwargs.get("output_attentions", False):
        interface._warn_once(
            "hf_output_attentions",
            f"{fn}: output_attentions=True is not supported (the kernels never form the "
            "attention weights); None is returned for them",
            stacklevel=3,
        )
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    deterministic = kwargs.get("deterministic")
    if deterministic is None:
        deterministic = os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"

    batch, _, q_len, head_dim = query.shape
    v_head_dim = value.shape[-1]

    if attention_mask is not None and attention_mask.dim() == 4:
        # A dense mask the model built itself: the SDPA drop-in's attn_mask (no softcap with it).
        if softcap:
            raise NotImplementedError(
                f"{fn}: softcap={softcap} with a dense 4-D attention mask is not supported "
                "(the kernels take an attn_mask or a softcap, not both); use attn_implementation='eager'"
            )
        out = interface.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )
        return out.transpose(1, 2).contiguous(), None

    # (batch, heads, seqlen, head_dim) -> flash's (batch, seqlen, heads, head_dim): views.
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if v_head_dim != head_dim:
        v = F.pad(v, [0, head_dim - v_head_dim])
    window = (-1, -1)
    if sliding_window is not None and k.shape[1] > sliding_window:
        # transformers' convention: a window of w tokens including the current one.
        window = (sliding_window - 1, sliding_window - 1)
    common = dict(
        dropout_p=dropout,
        softmax_scale=scaling,
        causal=bool(is_causal),
        window_size=window,
        deterministic=deterministic,
        softcap=float(softcap) if softcap else 0.0,
    )

    if attention_mask is not None:
        # A 2-D padding mask (batch, kv_len), true = token. A static cache may hold
        # more slots than the mask covers: those are not keys.
        mask = attention_mask.bool()
        kv_len = mask.shape[-1]
        k, v = k[:, :kv_len], v[:, :kv_len]
        k_un, indices_k, cu_k, max_k = _unpad(k, mask)
        v_un = v.reshape(-1, *v.shape[2:])[indices_k]
        if q_len == kv_len:
            q_un, indices_q, cu_q, max_q = q.reshape(-1, *q.shape[2:])[indices_k], indices_k, cu_k, max_k
        else:
            # The queries are the last q_len positions of each row (left padding).
            q_un, indices_q, cu_q, max_q = _unpad(q, mask[:, -q_len:])
        out = interface.flash_attn_varlen_func(q_un, k_un, v_un, cu_q, cu_k, max_q, max_k, **common)
        out = _pad(out, indices_q, batch, q_len)
    elif all(kwargs.get(x) is not None for x in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")):
        # Padding-free batches: the boundaries come with the call.
        out = interface.flash_attn_varlen_func(
            q.reshape(-1, *q.shape[2:]),
            k.reshape(-1, *k.shape[2:]),
            v.reshape(-1, *v.shape[2:]),
            kwargs["cu_seq_lens_q"].to(torch.int32),
            kwargs["cu_seq_lens_k"].to(torch.int32),
            int(kwargs["max_length_q"]),
            int(kwargs["max_length_k"]),
            **common,
        ).view(batch, q_len, *q.shape[2:])
    elif (packed := _packed_boundaries(kwargs.get("position_ids"), batch)) is not None:
        cu, max_len = packed
        out = interface.flash_attn_varlen_func(
            q.reshape(-1, *q.shape[2:]),
            k.reshape(-1, *k.shape[2:]),
            v.reshape(-1, *v.shape[2:]),
            cu,
            cu,
            max_len,
            max_len,
            **common,
        ).view(batch, q_len, *q.shape[2:])
    else:
        out = interface.flash_attn_func(q, k, v, **common)
    if v_head_dim != head_dim:
        out = out[..., :v_head_dim]
    return out, None
