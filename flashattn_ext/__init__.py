"""flashattn_ext: exact attention computed the FlashAttention way (tiles,
online softmax, recomputation backward) in C++/CUDA kernels.

    from flashattn_ext import flash_attn_func               # flash-attn's API, (B, S, H, D)
    from flashattn_ext import flash_attn_varlen_func        # its packed variable-length form, (total, H, D)
    from flashattn_ext import flash_attn_with_kvcache       # inference against a KV cache (updated in place)
    from flashattn_ext import scaled_dot_product_attention  # torch's API, (B, H, L, E)
    from flashattn_ext import reference                     # the naive oracle (and the FLOP count)
    from flashattn_ext import tolerance                     # the tolerance rule of every check
    flashattn_ext.activate() / deactivate()                 # our kernels behind torch's own SDPA (torch >= 2.11)
    from flashattn_ext import ring                          # context parallelism on torch.distributed's p2p ops
"""

from . import (
    _ops,  # noqa: F401  (registers fake kernels and autograd)
    backend,  # noqa: F401
    reference,  # noqa: F401
    tolerance,  # noqa: F401
)
from .backend import activate, deactivate  # noqa: F401
from .interface import (  # noqa: F401
    FlashAttnFallbackWarning,
    build_info,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
    scaled_dot_product_attention,
    sdpa_fallback_reason,
)

__version__ = "0.1.0"

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
    "scaled_dot_product_attention",
    "sdpa_fallback_reason",
    "build_info",
    "FlashAttnFallbackWarning",
    "activate",
    "deactivate",
    "backend",
    "reference",
    "tolerance",
]
