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
    if name == "torch":
        return TorchAttention(kv_pool, layout, num_heads, scale)
    # triton (and flash_attn) are optional, heavy imports, and importing triton fixes
    # whether its CPU interpreter is on: load them only when their backend is built
    if name == "triton":
        from .triton_backend import TritonAttention

        return TritonAttention(kv_pool, layout, num_heads, scale)
    if name == "flash-attn":
        from .flash_attn_backend import FlashAttnAttention

        return FlashAttnAttention(kv_pool, layout, num_heads, scale)
    raise ConfigError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "BACKENDS",
    "SeqSlice",
    "build_metadata",
    "default_backend",
    "make_backend",
]
