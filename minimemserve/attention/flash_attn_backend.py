"""flash-attn backend: FlashAttention for fresh prefills, the Triton kernels for the rest.

Used only where ``flash_attn`` imports (the ``gpu`` extra, CUDA only). A prefill without a
cached prefix is plain causal attention, which ``flash_attn_varlen_func`` runs on the
contiguous ``[T, H, D]`` batch. Prefixes and decodes go through ``prefix_prefill`` and
``paged_decode``: flash-attn's paged API wants a cache with a contiguous block stride (and
block sizes that are multiples of 256), which the aggregated layout's layer views are not."""

from __future__ import annotations

import importlib.util

import torch

from ..blocks.layout import KVLayout
from .base import AttentionMetadata
from .triton_backend import TritonAttention

FLASH_DTYPES = (torch.float16, torch.bfloat16)  # flash-attn has no fp32 kernels


def is_available() -> bool:
    """Whether ``flash_attn`` is installed and a CUDA device is present."""
    return importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()


class FlashAttnAttention(TritonAttention):
    """Like ``TritonAttention``, with flash-attn for prefill slices that have no prefix."""

    name = "flash-attn"

    def __init__(self, kv_pool: torch.Tensor, layout: KVLayout, num_heads: int, scale: float):
        try:
            from flash_attn import flash_attn_varlen_func
        except ImportError as e:
            raise ImportError(
                "the flash-attn backend needs the flash_attn package: install minimemserve's "
                "`gpu` extra (pip install 'minimemserve[gpu]') on a CUDA machine, or use the "
                "'triton' or 'torch' backend"
            ) from e
        if kv_pool.device.type != "cuda":
            raise ValueError(f"the flash-attn backend needs a CUDA pool, got {kv_pool.device}")
        super().__init__(kv_pool, layout, num_heads, scale)
        self._varlen = flash_attn_varlen_func

    def _attend(self, q, k, v, kv, md: AttentionMetadata) -> torch.Tensor:
        """Attention after the K/V store: one varlen call when every slice is a fresh
        prefill, else the Triton kernels."""
        no_prefix = md.num_prefills > 0 and not any(md.context_lens_host[: md.num_prefills])
        if not no_prefix or q.dtype not in FLASH_DTYPES or md.num_decodes:
            return super()._attend(q, k, v, kv, md)
        qsl, n = md.query_start_loc, md.max_query_len
        return self._varlen(q, k, v, qsl, qsl, n, n, softmax_scale=self.scale, causal=True)
