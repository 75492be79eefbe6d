"""Attention backends behind one interface: ``torch`` (reference, CPU path), ``triton``
(our kernels, default on CUDA) and ``flash-attn`` (optional, detected at run time)."""

from __future__ import annotations

import torch

from ..blocks.layout import KVLayout
from ..errors import ConfigError
from .base import AttentionBackend, AttentionMetadata, SeqSlice, build_metadata
from .torch_backend import TorchAttention

BACKENDS = ("torch", "triton", "flash-attn")


def default_backend(device: torch.device | str) -> str:
    """The backend an engine uses when none is forced: triton on CUDA, torch elsewhere."""
    return "triton" if torch.device(device).type == "cuda" else "torch"


def make_backend(
    name: str | None, kv_pool: torch.Tensor, layout: KVLayout, num_heads: int, scale: float
) -> AttentionBackend:
    """Build the named backend (``None`` picks the device default) over ``kv_pool``."""
    name = name or default_backend(kv_pool.device)
    # importing triton fixes whether its CPU interpreter is on: only when the backend is built
    if name == "torch":
        cls = TorchAttention
    elif name == "triton":
        from .triton_backend import TritonAttention as cls  # lazy: triton is optional and heavy
    elif name == "flash-attn":
        from .flash_attn_backend import FlashAttnAttention as cls  # lazy: flash-attn, triton
    else:
        raise ConfigError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    return cls(kv_pool, layout, num_heads, scale)


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "BACKENDS",
    "SeqSlice",
    "build_metadata",
    "default_backend",
    "make_backend",
]
