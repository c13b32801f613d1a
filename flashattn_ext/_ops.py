"""Python side of the ops declared in csrc/ops.cpp: fake (meta) kernels so that
torch.compile can trace them (the autograd formula linking fwd to bwd is in
csrc/autograd.cpp).

The ops take the FlashAttention layout, q (batch, seqlen_q, heads_q, head_dim),
k and v (batch, seqlen_k, heads_kv, head_dim), and return out with q's shape
plus lse (batch, heads_q, seqlen_q)."""

import torch

from . import _C  # noqa: F401  (loads the library, which registers the ops)

fwd = torch.ops.flashattn_ext.fwd.default
bwd = torch.ops.flashattn_ext.bwd.default


def unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """The kernels need stride 1 on head_dim; copy only when it is not already so."""
    if x.dim() > 0 and x.stride(-1) != 1:
        x = x.contiguous()
        if x.stride(-1) != 1:  # a size-1 head_dim keeps any stride through .contiguous()
            x = x.clone(memory_format=torch.contiguous_format)
    return x


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("flashattn_ext::fwd")
def _fwd_fake(q, k, v, softmax_scale, window_left, window_right, bottom_right, deterministic):
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=_lse_dtype(q.dtype), device=q.device)
    return out, lse


@torch.library.register_fake("flashattn_ext::bwd")
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, bottom_right, deterministic):
    return (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=k.dtype, device=k.device),
        torch.empty(v.shape, dtype=v.dtype, device=v.device),
    )


# The autograd formula (fwd saves q, k, v, out, lse; its backward calls bwd) is
# registered in C++ (csrc/autograd.cpp): a C++ autograd function costs a few
# microseconds of host time per call where register_autograd cost tens.
