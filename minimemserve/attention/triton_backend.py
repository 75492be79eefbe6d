"""Triton attention backend: the kernels of ``triton_kernels`` over the pool, in place.

Per layer, ``store_kv`` writes the new K/V into their slots, ``prefix_prefill`` attends the
prefill slices and ``paged_decode`` the decodes, each reading ``pool[:, layer_id, 0|1]``
through strides. ``prepare`` does the step's host work once (one packed index upload, split
counts and tiles, output buffers), so ``forward`` only launches kernels. On the CPU the
kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` before triton is first imported;
no bf16), a correctness path: the ``torch`` backend is the fast one there."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass

import torch
import triton

from triton_kernels import (
    DecodePlan,
    PrefillPlan,
    launch_add_rmsnorm,
    launch_decode,
    launch_prefill,
    launch_rope_store_kv,
    launch_silu_mul,
    launch_store_kv,
    plan_decode,
    plan_prefill,
)
from triton_kernels.common import check_cache_views, num_sms

from ..blocks.layout import KVLayout, layer_views
from .base import AttentionMetadata, SeqSlice, build_metadata

# index tensors of a step, packed into one buffer for a single host-to-device copy
PACKED_FIELDS = "positions slot_mapping query_start_loc context_lens seq_lens block_tables".split()
# each packed field starts at a multiple of this many bytes: the pointer alignment Triton
# specialises kernels on then never changes between steps
PACK_ALIGN = 16


def is_available() -> bool:
    """Whether triton is installed (the kernels then run on CUDA, or interpreted on the CPU)."""
    return importlib.util.find_spec("triton") is not None


@dataclass
class TritonStep:
    """The per-step part of the work, shared by every layer of the step."""

    out: torch.Tensor  # [T, H, D] in the pool's dtype, overwritten by each layer's forward
    prefill: PrefillPlan | None
    decode: DecodePlan | None
    checked: bool = False  # the inputs of the first layer passed the checks


class TritonElementwise:
    """The layer's elementwise work as one fused kernel each (see ``TorchElementwise``): the
    residual add with RMSNorm, rotary with the K/V store, SiLU x up. Inputs come from the
    model's own projections (contiguous rows), so the launches are unchecked."""

    def add_rmsnorm(self, x, residual, norm) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; the sum is written over ``residual``."""
        return launch_add_rmsnorm(x, residual, norm.weight, norm.eps)

    def rope_attend(self, backend, q, k, v, rotary, positions, layer_id: int, md):
        """Rotate, store and attend through ``backend.forward_rotary``."""
        return backend.forward_rotary(q, k, v, rotary.cos, rotary.sin, positions, layer_id, md)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up`` ``[T, 2 * inter]``."""
        return launch_silu_mul(gate_up)


class TritonAttention:
    """Attention with the Triton kernels over one pool tensor (see ``AttentionBackend``)."""

    name = "triton"
    elementwise = TritonElementwise()

    def __init__(self, kv_pool: torch.Tensor, layout: KVLayout, num_heads: int, scale: float):
        num_blocks = kv_pool.shape[layout.block_dim] if kv_pool.dim() == 6 else -1
        if tuple(kv_pool.shape) != layout.pool_shape(num_blocks):
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
        self.views = [layer_views(kv_pool, layout, i) for i in range(layout.num_layers)]
        check_cache_views(*self.views[0])
        self.num_sms = num_sms(self.device)  # the decode split heuristic fills these (1 on CPU)

    def prepare(self, slices: list[SeqSlice]) -> AttentionMetadata:
        """Build the step's metadata on the pool's device and plan every launch of the step."""
        on_cuda = self.device.type == "cuda"
        md = build_metadata(slices, self.layout.block_size, "cpu" if on_cuda else self.device)
        if on_cuda:
            md = upload_metadata(md, self.device)
        longest = max(md.seq_lens_host[md.num_prefills :], default=1)
        md.backend_data["triton"] = self._plan(md, longest)
        return md

    def plan_graph(self, md: AttentionMetadata) -> AttentionMetadata:
        """Plan ``md`` (decode rows only, over a graph's static buffers) for sequences up to
        ``md.max_seq_len``: the split count, grid and buffers stay fixed, so one capture
        serves every context up to that length."""
        if md.num_prefills:
            raise ValueError("a graph's step holds decodes only")
        md.backend_data["triton"] = self._plan(md, md.max_seq_len)
        return md

    def _plan(self, md: AttentionMetadata, longest_decode: int) -> TritonStep:
        """The step's launches and output buffer; decode splits sized for ``longest_decode``."""
        k_cache, p, H = self.views[0][0], md.num_prefills, self.num_heads
        prefill = decode = None
        if p:
            prefill = plan_prefill(k_cache, p, H, max(md.query_lens_host[:p]))
        if md.num_decodes:
            decode = plan_decode(k_cache, md.num_decodes, H, longest_decode, sms=self.num_sms)
        shape = (md.num_prefill_tokens + md.num_decodes, H, self.layout.head_dim)
        out = torch.empty(shape, dtype=self.kv_pool.dtype, device=self.device)
        return TritonStep(out, prefill, decode)

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KV, D]
        v: torch.Tensor,  # [T, KV, D]
        layer_id: int,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        """Store the new K/V of ``layer_id``, then attend; returns the step's ``[T, H, D]``
        output buffer, which the next layer overwrites."""
        kv = self.layer(layer_id)  # K and V, each [N, bs, KV, D]
        q, k, v = self._inputs(q, k, v, md)
        launch_store_kv(*kv, k, v, md.slot_mapping)
        return self._attend(q, k, v, kv, md)

    def forward_rotary(self, q, k, v, cos, sin, positions, layer_id: int, md) -> torch.Tensor:
        """``forward`` of ``q``/``k`` not yet rotated: one kernel rotates them in place at
        ``positions`` (``cos``/``sin``: ``[max_positions, D]`` tables) and stores K/V."""
        kv = self.layer(layer_id)
        q, k, v = self._inputs(q, k, v, md)
        launch_rope_store_kv(q, k, v, cos, sin, positions, md.slot_mapping, *kv)
        return self._attend(q, k, v, kv, md)

    def _inputs(self, q, k, v, md: AttentionMetadata):
        """``q``, ``k``, ``v`` in the pool's dtype, checked on a step's first layer."""
        step: TritonStep = md.backend_data["triton"]
        if not step.checked:
            self._check_inputs(q, k, v, step)
        dtype = self.kv_pool.dtype
        return q.to(dtype), k.to(dtype), v.to(dtype)

    def _attend(self, q, k, v, kv, md: AttentionMetadata) -> torch.Tensor:
        """Attention of the step's queries over the stored K/V (prefills, then decodes)."""
        step: TritonStep = md.backend_data["triton"]
        out, tables, p = step.out, md.block_tables, md.num_prefill_tokens
        if (plan := step.prefill) is not None:
            args = (md.query_start_loc, md.context_lens, out, self.scale)
            launch_prefill(plan, q, k, v, *kv, tables, *args)
        if (plan := step.decode) is not None:
            args = (md.seq_lens, out[p:], self.scale)
            launch_decode(plan, q[p:], *kv, tables, *args, row_offset=md.num_prefills)
        return out

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V views of ``layer_id``."""
        if not 0 <= layer_id < self.layout.num_layers:
            raise ValueError(f"layer_id {layer_id} out of range [0, {self.layout.num_layers})")
        return self.views[layer_id]

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
    """``md`` with its index tensors moved to ``device`` in one copy of a packed host buffer
    (pinned for CUDA), each field at a ``PACK_ALIGN``-byte boundary, sliced back into views."""
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
    fields = {n: packed[a : a + b].view(t.dtype).view(t.shape) for n, t, a, b in spans}
    return dataclasses.replace(md, **fields)
