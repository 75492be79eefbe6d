"""Triton attention backend: the kernels of ``triton_kernels`` over the pool, in place.

Per layer and step: ``store_kv`` writes the new tokens' K/V into their slots, then
``prefix_prefill`` attends the prefill slices' tokens (cached prefix from the pool, new
tokens from ``k``/``v``) and ``paged_decode`` the single-token decodes. Every kernel reads
``pool[:, layer_id, 0|1]`` (or the per-layer layout's views) through strides.

On the CPU the kernels run in Triton's interpreter, which needs ``TRITON_INTERPRET=1``
set before ``triton`` is first imported (see ``triton_kernels``); the interpreter has no
bf16. It is a correctness path, the ``torch`` backend is the fast one there.
"""

from __future__ import annotations

import torch

from ..blocks.layout import KVLayout, layer_views
from .base import AttentionMetadata, SeqSlice, build_metadata


def is_available() -> bool:
    """Whether triton imports (the kernels then run on CUDA, or interpreted on the CPU)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class TritonAttention:
    """Attention with the Triton kernels over one pool tensor (see ``AttentionBackend``)."""

    name = "triton"

    def __init__(self, kv_pool: torch.Tensor, layout: KVLayout, num_heads: int, scale: float):
        if tuple(kv_pool.shape) != layout.pool_shape(_num_blocks(kv_pool, layout)):
            raise ValueError(f"pool shape {tuple(kv_pool.shape)} does not match {layout}")
        if num_heads <= 0 or num_heads % layout.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a positive multiple of "
                f"num_kv_heads ({layout.num_kv_heads})"
            )
        if scale <= 0:
            raise ValueError(f"scale must be positive, got {scale}")
        from triton_kernels import paged_decode, prefix_prefill, store_kv

        self._store_kv = store_kv
        self._prefix_prefill = prefix_prefill
        self._paged_decode = paged_decode
        self.kv_pool = kv_pool
        self.layout = layout
        self.num_heads = num_heads
        self.scale = scale

    def prepare(self, slices: list[SeqSlice]) -> AttentionMetadata:
        """Build the step's metadata on the pool's device."""
        return build_metadata(slices, self.layout.block_size, self.kv_pool.device)

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KV, D]
        v: torch.Tensor,  # [T, KV, D]
        layer_id: int,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        """Store the new K/V of ``layer_id``, then attend; returns ``[T, H, D]``."""
        if not 0 <= layer_id < self.layout.num_layers:
            raise ValueError(f"layer_id {layer_id} out of range [0, {self.layout.num_layers})")
        k_cache, v_cache = layer_views(self.kv_pool, self.layout, layer_id)  # [N, bs, KV, D]
        dtype = k_cache.dtype
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        self._store_kv(k_cache, v_cache, k, v, md.slot_mapping)

        out = torch.empty_like(q)  # [T, H, D]
        p_tok, p_seq = md.num_prefill_tokens, md.num_prefills
        if p_seq:
            out[:p_tok] = self._prefix_prefill(
                q[:p_tok],
                k[:p_tok],
                v[:p_tok],
                k_cache,
                v_cache,
                md.block_tables[:p_seq],
                md.query_start_loc[: p_seq + 1],
                md.context_lens[:p_seq],
                self.scale,
                max_query_len=max(md.query_lens_host[:p_seq]),
            )
        if md.num_decodes:
            out[p_tok:] = self._paged_decode(
                q[p_tok:],
                k_cache,
                v_cache,
                md.block_tables[p_seq:],
                md.seq_lens[p_seq:],
                self.scale,
                max_seq_len=max(md.seq_lens_host[p_seq:]),
            )
        return out


def _num_blocks(pool: torch.Tensor, layout: KVLayout) -> int:
    """The block count a pool tensor of ``layout`` holds (its block dimension)."""
    if pool.dim() != 6:
        return -1
    return pool.shape[0] if layout.kind == "aggregated" else pool.shape[2]
