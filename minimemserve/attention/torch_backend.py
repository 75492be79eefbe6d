"""Torch attention backend over the paged, aggregated KV pool.

The reference every other backend is tested against, and the fast path on the CPU:
decodes run as one batched SDPA over gathered blocks; each prefill chunk runs one SDPA
over its cached prefix plus its new tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..blocks.layout import KVLayout, layer_views
from .base import AttentionMetadata, SeqSlice, build_metadata


class TorchAttention:
    """Attention with PyTorch ops; reads ``pool[:, layer_id, 0|1]`` through views."""

    name = "torch"

    def __init__(self, kv_pool: torch.Tensor, layout: KVLayout, num_heads: int, scale: float):
        if kv_pool.shape[1:] != layout.pool_shape(1)[1:] and layout.kind == "aggregated":
            raise ValueError(f"pool shape {tuple(kv_pool.shape)} does not match {layout}")
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
        bs = self.layout.block_size
        k_cache, v_cache = layer_views(self.kv_pool, self.layout, layer_id)  # [N, bs, KV, D]
        blk = md.slot_mapping // bs
        off = md.slot_mapping % bs
        k_cache[blk, off] = k.to(k_cache.dtype)
        v_cache[blk, off] = v.to(v_cache.dtype)

        out = torch.empty_like(q)
        starts = md.query_start_loc.tolist() if md.num_prefills else None
        for i in range(md.num_prefills):
            s, e = starts[i], starts[i + 1]
            ctx, total = md.context_lens_host[i], md.seq_lens_host[i]
            qi = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            if ctx == 0:
                ki = k[s:e].transpose(0, 1).unsqueeze(0)  # [1, KV, q, D]
                vi = v[s:e].transpose(0, 1).unsqueeze(0)
                oi = F.scaled_dot_product_attention(
                    qi, ki, vi, is_causal=True, scale=self.scale, enable_gqa=True
                )
            else:
                nb = -(-total // bs)
                table = md.block_tables[i, :nb].long()
                ki = k_cache[table].flatten(0, 1)[:total]  # [total, KV, D]
                vi = v_cache[table].flatten(0, 1)[:total]
                ki = ki.transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, KV, total, D]
                vi = vi.transpose(0, 1).unsqueeze(0).to(q.dtype)
                qpos = torch.arange(ctx, total, device=q.device)
                mask = torch.arange(total, device=q.device)[None, :] <= qpos[:, None]  # [q, total]
                oi = F.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=mask, scale=self.scale, enable_gqa=True
                )
            out[s:e] = oi.squeeze(0).transpose(0, 1)

        if md.num_decodes:
            p0 = md.num_prefill_tokens
            rows = slice(md.num_prefills, md.num_prefills + md.num_decodes)
            lens = md.seq_lens[rows]  # [Bd]
            max_len = max(md.seq_lens_host[rows])
            nb = -(-max_len // bs)
            table = md.block_tables[rows, :nb].long()  # [Bd, nb]
            kd = k_cache[table].flatten(1, 2)[:, :max_len]  # [Bd, S, KV, D]
            vd = v_cache[table].flatten(1, 2)[:, :max_len]
            kd = kd.transpose(1, 2).to(q.dtype)  # [Bd, KV, S, D]
            vd = vd.transpose(1, 2).to(q.dtype)
            qd = q[p0:].unsqueeze(2)  # [Bd, H, 1, D]
            mask = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]  # [Bd, S]
            od = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=mask[:, None, None, :], scale=self.scale, enable_gqa=True
            )
            out[p0:] = od.squeeze(2)
        return out
