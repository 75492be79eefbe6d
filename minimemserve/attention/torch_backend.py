"""Torch attention backend: the reference every other backend is tested against, and the
fast path on the CPU.

The pool is addressed as rows of ``n_kv_heads * head_dim`` elements; the row of every token
slot is computed once per step and each layer adds its own offset, so storing is one
``index_copy_`` and gathering one ``index_select`` of whole blocks per K or V. Decodes run,
in length order, as batched SDPA in which the query heads sharing a KV head act as query
positions (no K/V repeat for GQA).
Each prefill chunk runs 4-D SDPA, the form PyTorch's fused CPU kernel takes: one causal call
without a cached prefix; with one, an unmasked call over the prefix and a causal call over
the new tokens, merged by their log-sum-exp."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..blocks.layout import AGGREGATED, KVLayout
from .base import AttentionMetadata, SeqSlice, build_metadata
from .elementwise import TORCH_ELEMENTWISE

# PyTorch's fused CPU attention also returns the log-sum-exp through this op.
_HAS_CPU_LSE = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
# Decodes are attended in groups whose gathered K+V take about this many bytes, so the copy
# is still in cache when SDPA reads it (3-4x faster than one big gather on a 2-core CPU at
# 64 sequences x 384 tokens).
DECODE_GROUP_BYTES = 6 << 20


class TorchAttention:
    """Attention with PyTorch ops over a contiguous pool tensor (either layout)."""

    name = "torch"
    elementwise = TORCH_ELEMENTWISE  # unfused: HF's arithmetic op by op

    def __init__(self, kv_pool: torch.Tensor, layout: KVLayout, num_heads: int, scale: float):
        if tuple(kv_pool.shape) != layout.pool_shape(kv_pool.shape[layout.block_dim]):
            raise ValueError(f"pool shape {tuple(kv_pool.shape)} does not match {layout}")
        if not kv_pool.is_contiguous():
            raise ValueError("the torch backend needs a contiguous pool tensor")
        if num_heads % layout.num_kv_heads:
            raise ValueError(f"{num_heads} heads are not a multiple of {layout.num_kv_heads}")
        self.kv_pool = kv_pool
        self.layout = layout
        self.num_heads = num_heads
        self.scale = scale
        row = layout.num_kv_heads * layout.head_dim
        self.rows = kv_pool.view(-1, row)  # [num_rows, n_kv * head_dim]
        s = kv_pool.stride()  # [N, L, 2, bs, ...] or [L, 2, N, bs, ...]
        st = s[:4] if layout.kind == AGGREGATED else (s[2], s[0], s[1], s[3])
        self.row_stride = tuple(x // row for x in st)  # (block, layer, k|v, offset) in rows
        # row r's window of block_size rows: a whole block of one layer's K or V when r starts
        # one (the offset stride is one row in both layouts), gathered as one copy
        bs = layout.block_size
        self.blocks = self.rows.as_strided((self.rows.shape[0] - bs + 1, bs * row), (row, 1))

    def prepare(self, slices: list[SeqSlice]) -> AttentionMetadata:
        """Build the step's metadata plus the row indices every layer reuses."""
        md = build_metadata(slices, self.layout.block_size, self.kv_pool.device)
        sb, _, _, so = self.row_stride
        bs = self.layout.block_size
        md.backend_data["slot_rows"] = (md.slot_mapping // bs) * sb + (md.slot_mapping % bs) * so
        if md.num_prefills:
            md.backend_data["starts"] = md.query_start_loc.tolist()
        # decodes in length order (little padding), in cache-sized groups: their block rows,
        # output rows and padding masks
        lens = md.seq_lens_host[md.num_prefills :]
        order = sorted(range(len(lens)), key=lens.__getitem__)
        row_bytes = self.rows.shape[1] * self.rows.element_size()
        groups = md.backend_data["decode"] = []
        i = 0
        while i < len(order):
            n = 1  # the group grows while its padded K+V stay under the byte budget
            while i + n < len(order) and 2 * (n + 1) * lens[order[i + n]] * row_bytes <= (
                DECODE_GROUP_BYTES
            ):
                n += 1
            rows = torch.tensor(order[i : i + n], device=self.kv_pool.device) + md.num_prefills
            nb = self.layout.num_blocks_for(lens[order[i + n - 1]])
            gather = md.block_tables[rows, :nb].reshape(-1).long() * sb  # [n * nb]
            pos = torch.arange(nb * bs, device=rows.device)
            valid = pos[None, :] < md.seq_lens[rows, None].long()  # [n, S]
            out_rows = rows + (md.num_prefill_tokens - md.num_prefills)  # rows in [T]
            groups.append((out_rows, n, nb * bs, gather, valid[:, None, None, :]))
            i += n
        return md

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KV, D]
        v: torch.Tensor,  # [T, KV, D]
        layer_id: int,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        """Store the new K/V of ``layer_id``, then attend; returns ``[T, H, D]``."""
        T, H, D = q.shape
        KV, G = self.layout.num_kv_heads, H // self.layout.num_kv_heads
        _, sl, st, _ = self.row_stride
        kb, vb = layer_id * sl, layer_id * sl + st  # first K and V rows of the layer
        slots = md.backend_data["slot_rows"]
        self.rows.index_copy_(0, slots + kb, k.reshape(T, KV * D).to(self.rows.dtype))
        self.rows.index_copy_(0, slots + vb, v.reshape(T, KV * D).to(self.rows.dtype))
        out = torch.empty_like(q)
        for i in range(md.num_prefills):
            s, e = md.backend_data["starts"][i : i + 2]
            ctx, total = md.context_lens_host[i], md.seq_lens_host[i]
            qi = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            if ctx == 0:
                ki, vi = _per_head(k[s:e], G), _per_head(v[s:e], G)  # [1, H, q, D]
                oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=self.scale)
                out[s:e] = oi[0].transpose(0, 1)
                continue
            fast = _HAS_CPU_LSE and q.device.type == "cpu"
            n_keys = ctx if fast else total  # fast: the new tokens' K/V are at hand
            kc, vc = (
                _per_head(self._gather(md, i, n_keys, b).view(n_keys, KV, D), G) for b in (kb, vb)
            )
            if fast:
                kn, vn = _per_head(k[s:e], G), _per_head(v[s:e], G)  # [1, H, q, D]
                oi = self._prefix_and_new(qi, kc.to(q.dtype), vc.to(q.dtype), kn, vn)
            else:
                qpos = torch.arange(ctx, total, device=q.device)
                mask = torch.arange(total, device=q.device)[None, :] <= qpos[:, None]  # [q, total]
                oi = F.scaled_dot_product_attention(
                    qi, kc.to(q.dtype), vc.to(q.dtype), attn_mask=mask, scale=self.scale
                )
            out[s:e] = oi[0].transpose(0, 1)
        for rows, n, S, gather, valid in md.backend_data["decode"]:
            kd = self.blocks.index_select(0, gather + kb).view(n, S, KV, D).transpose(1, 2)
            vd = self.blocks.index_select(0, gather + vb).view(n, S, KV, D).transpose(1, 2)
            qd = q.index_select(0, rows).view(n, KV, G, D)  # G query heads as positions
            od = F.scaled_dot_product_attention(
                qd, kd.to(q.dtype), vd.to(q.dtype), attn_mask=valid, scale=self.scale
            )  # [n, KV, G, D]
            out.index_copy_(0, rows, od.reshape(n, H, D))
        return out

    def _gather(self, md: AttentionMetadata, i: int, n: int, first_row: int) -> torch.Tensor:
        """Rows of slice ``i``'s first ``n`` tokens, one copy per block (``first_row``: the
        layer's first K or V row)."""
        idx = md.block_tables[i, : self.layout.num_blocks_for(n)].long() * self.row_stride[0]
        return self.blocks.index_select(0, idx + first_row).view(-1, self.rows.shape[1])[:n]

    def _prefix_and_new(self, q, kp, vp, kn, vn) -> torch.Tensor:
        """Attention over a cached prefix (unmasked) plus the new tokens (causal): both run in
        the fast fused kernel, unlike one dense masked call, and merge by their log-sum-exp."""
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        op, lp = flash(q, kp, vp, 0.0, False, attn_mask=None, scale=self.scale)[:2]
        on, ln = flash(q, kn, vn, 0.0, True, attn_mask=None, scale=self.scale)[:2]
        m = torch.maximum(lp, ln)  # [1, H, q] fp32
        wp, wn = (lp - m).exp(), (ln - m).exp()
        o = (op.float() * wp[..., None] + on.float() * wn[..., None]) / (wp + wn)[..., None]
        return o.to(q.dtype)


def _per_head(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[T, KV, D]`` → ``[1, KV * group, T, D]``: PyTorch's fused CPU kernel takes 4-D inputs
    with equal head counts (3-D or ``enable_gqa`` inputs run 3-5x slower on long prompts)."""
    x = x.transpose(0, 1)  # [KV, T, D]
    if group > 1:
        x = x.repeat_interleave(group, dim=0)  # [H, T, D]
    return x.unsqueeze(0)
