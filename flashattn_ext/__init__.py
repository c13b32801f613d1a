"""flashattn_ext: exact attention computed the FlashAttention way (tiles,
online softmax, recomputation backward) in C++/CUDA kernels."""

from . import _ops  # noqa: F401  (registers fake kernels and autograd)

__version__ = "0.1.0"
