"""Triton attention backend: the kernels of ``triton_kernels`` over the pool, in place.

Per layer and step: ``store_kv`` writes the new tokens' K/V into their slots, then
``prefix_prefill`` attends the prefill slices' tokens (cached prefix from the pool, new
tokens from ``k``/``v``) and ``paged_decode`` the single-token decodes. Every kernel reads
``pool[:, layer_id, 0|1]`` (or the per-layer layout's views) through strides.

Host work happens once per step, in ``prepare``: the index tensors reach the device in one
copy of a packed buffer, the split count and tiles are chosen, the output and split buffers
are allocated, and the inputs are checked on the first layer. ``forward`` then only
launches kernels, so a layer costs its launches and nothing else on the host.

On the CPU the kernels run in Triton's interpreter, which needs ``TRITON_INTERPRET=1``
set before ``triton`` is first imported (see ``triton_kernels.common``); the interpreter has
no bf16. It is a correctness path, the ``torch`` backend is the fast one there.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass

import torch
import triton

from triton_kernels import (
    DecodePlan,
    PrefillPlan,
    launch_decode,
    launch_prefill,
    launch_store_kv,
    plan_decode,
    plan_prefill,
)
from triton_kernels.common import check_cache_views, num_sms

from ..blocks.layout import KVLayout, layer_views
from .base import AttentionMetadata, SeqSlice, build_metadata

# index tensors of a step, packed into one buffer for a single host-to-device copy
PACKED_FIELDS = (
    "positions",
    "slot_mapping",
    "query_start_loc",
    "context_lens",
    "seq_lens",
    "block_tables",
)
# each packed field starts at a multiple of this many bytes: the pointer alignment Triton
# specialises kernels on then never changes between steps
PACK_ALIGN = 16


def is_available() -> bool:
    """Whether triton is installed (the kernels then run on CUDA, or interpreted on the CPU)."""
    return importlib.util.find_spec("triton") is not None


@dataclass
class TritonStep:
    """The per-step part of the work, shared by every layer of the step.

    ``out`` is the attention output of the layer being run: each ``forward`` overwrites and
    returns it, so a caller consumes it before the next layer (the model's output projection
    does).
    """

    out: torch.Tensor  # [T, H, D] in the pool's dtype
    prefill: PrefillPlan | None
    decode: DecodePlan | None
    checked: bool = False  # the inputs of the first layer passed the checks


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
        self.kv_pool = kv_pool
        self.layout = layout
        self.num_heads = num_heads
        self.scale = scale
        self.device = kv_pool.device
        # per-layer K/V views, built and checked once
        self.views = [layer_views(kv_pool, layout, i) for i in range(layout.num_layers)]
        check_cache_views(*self.views[0])
        # SMs the decode split heuristic fills; the device's count (1 in the interpreter)
        self.num_sms = num_sms(self.device)

    def prepare(self, slices: list[SeqSlice]) -> AttentionMetadata:
        """Build the step's metadata on the pool's device and plan every launch of the step."""
        on_cuda = self.device.type == "cuda"
        md = build_metadata(slices, self.layout.block_size, "cpu" if on_cuda else self.device)
        if on_cuda:
            md = upload_metadata(md, self.device)
        p_seq, p_tok = md.num_prefills, md.num_prefill_tokens
        k_cache = self.views[0][0]
        num_tokens = p_tok + md.num_decodes
        prefill = decode = None
        if p_seq:
            prefill = plan_prefill(k_cache, p_seq, self.num_heads, max(md.query_lens_host[:p_seq]))
        if md.num_decodes:
            decode = plan_decode(
                k_cache,
                md.num_decodes,
                self.num_heads,
                max(md.seq_lens_host[p_seq:]),
                sms=self.num_sms,
            )
        out = torch.empty(
            (num_tokens, self.num_heads, self.layout.head_dim),
            dtype=self.kv_pool.dtype,
            device=self.device,
        )
        md.backend_data["triton"] = TritonStep(out, prefill, decode)
        return md

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KV, D]
        v: torch.Tensor,  # [T, KV, D]
        layer_id: int,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        """Store the new K/V of ``layer_id``, then attend; returns ``[T, H, D]`` (the step's
        output buffer, see ``TritonStep``)."""
        k_cache, v_cache = self.layer(layer_id)  # [N, bs, KV, D]
        step: TritonStep = md.backend_data["triton"]
        if not step.checked:
            self._check_inputs(q, k, v, step)
        dtype = k_cache.dtype
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        launch_store_kv(k_cache, v_cache, k, v, md.slot_mapping)
        out, p_tok = step.out, md.num_prefill_tokens
        if step.prefill is not None:
            launch_prefill(
                step.prefill,
                q,
                k,
                v,
                k_cache,
                v_cache,
                md.block_tables,
                md.query_start_loc,
                md.context_lens,
                out,
                self.scale,
            )
        if step.decode is not None:
            launch_decode(
                step.decode,
                q[p_tok:],
                k_cache,
                v_cache,
                md.block_tables,
                md.seq_lens,
                out[p_tok:],
                self.scale,
                row_offset=md.num_prefills,
            )
        return out

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V views of ``layer_id``."""
        if not 0 <= layer_id < self.layout.num_layers:
            raise ValueError(f"layer_id {layer_id} out of range [0, {self.layout.num_layers})")
        return self.views[layer_id]

    def store(self, k: torch.Tensor, v: torch.Tensor, layer_id: int, md: AttentionMetadata):
        """Only store the new K/V of ``layer_id`` (for backends that attend elsewhere)."""
        k_cache, v_cache = self.layer(layer_id)
        launch_store_kv(k_cache, v_cache, k.to(k_cache.dtype), v.to(v_cache.dtype), md.slot_mapping)

    def _check_inputs(self, q, k, v, step: TritonStep) -> None:
        """Shapes and devices of a step's inputs, checked on its first layer."""
        num_tokens, heads, head_dim = step.out.shape
        kv_shape = (num_tokens, self.layout.num_kv_heads, head_dim)
        if tuple(q.shape) != (num_tokens, heads, head_dim):
            raise ValueError(f"q must be {tuple(step.out.shape)}, got {tuple(q.shape)}")
        if tuple(k.shape) != kv_shape or tuple(v.shape) != kv_shape:
            raise ValueError(f"k and v must be {kv_shape}, got {tuple(k.shape)}, {tuple(v.shape)}")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, expected {self.device} like the pool")
        step.checked = True


def upload_metadata(md: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """``md`` with its index tensors moved to ``device`` in one copy of a packed buffer.

    Each field is laid out at a ``PACK_ALIGN``-byte boundary of one host buffer (pinned for CUDA); the
    device copy is sliced back into views of each field's dtype and shape.
    """
    spans, size = [], 0
    for name in PACKED_FIELDS:
        t = getattr(md, name)
        nbytes = t.numel() * t.element_size()
        spans.append((name, t, size, nbytes))
        size += triton.cdiv(nbytes, PACK_ALIGN) * PACK_ALIGN
    host = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
    for _, t, start, nbytes in spans:
        host[start : start + nbytes].copy_(t.reshape(-1).view(torch.uint8))
    packed = host.to(device, non_blocking=True)
    fields = {
        name: packed[start : start + nbytes].view(t.dtype).view(t.shape)
        for name, t, start, nbytes in spans
    }
    return dataclasses.replace(md, **fields)


def _num_blocks(pool: torch.Tensor, layout: KVLayout) -> int:
    """The block count a pool tensor of ``layout`` holds (its block dimension)."""
    if pool.dim() != 6:
        return -1
    return pool.shape[0] if layout.kind == "aggregated" else pool.shape[2]
