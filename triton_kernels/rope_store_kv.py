"""Rotary embedding of q and k fused with the store of k and v into the pool.

One program per token: it loads the token's cos/sin row once, rotates its query heads and
KV heads in place (rotate-half form: ``x * cos + rotate_half(x) * sin``), then writes the
rotated K and the V into the token's slot of one layer's cache views, which the attention
kernels read next. A negative slot (a padding token) is rotated but not stored. The
roundings are the unfused ops': the tables are cast to the model's dtype, each product and
the sum are rounded to it, all computed in fp32.

``rope_store_kv`` checks its inputs; ``launch_rope_store_kv`` is the unchecked per-layer
launch for a caller that checked them once per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels.common import (
    check_cache_views,
    check_index,
    check_same,
    kernel_for,
    next_pow2,
)

NUM_WARPS = 4  # a token's heads are at most [64, 128] elements: one small tile each


@triton.jit
def _rotate(ptrs, half, c1, s1, c2, s2, mask):
    """Rotate the rows at ``ptrs`` ``[heads, BLOCK_HALF]`` (first halves) in place; returns
    the rotated halves."""
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + half, mask=mask, other=0.0)
    dt = x1.dtype
    a1 = (x1.to(tl.float32) * c1).to(dt).to(tl.float32)
    b1 = (-x2.to(tl.float32) * s1).to(dt).to(tl.float32)
    a2 = (x2.to(tl.float32) * c2).to(dt).to(tl.float32)
    b2 = (x1.to(tl.float32) * s2).to(dt).to(tl.float32)
    o1 = (a1 + b1).to(dt)
    o2 = (a2 + b2).to(dt)
    tl.store(ptrs, o1, mask=mask)
    tl.store(ptrs + half, o2, mask=mask)
    return o1, o2


@triton.jit
def _rope_store_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_sin,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)  # token offsets in int64: T * stride passes 2**31
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    dt = q_ptr.dtype.element_ty
    # the tables cast to the model's dtype first, as the unfused ops do
    c1 = tl.load(cos_ptr + pos * stride_cos + d, mask=d_ok, other=0.0).to(dt).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * stride_cos + HALF + d, mask=d_ok, other=0.0).to(dt)
    s1 = tl.load(sin_ptr + pos * stride_sin + d, mask=d_ok, other=0.0).to(dt).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * stride_sin + HALF + d, mask=d_ok, other=0.0).to(dt)
    c2 = c2.to(tl.float32)[None, :]
    s2 = s2.to(tl.float32)[None, :]
    h = tl.arange(0, BLOCK_H)
    q_mask = (h < NUM_HEADS)[:, None] & d_ok[None, :]
    q_rows = q_ptr + tok * stride_qt + h[:, None] * stride_qh + d[None, :]
    _rotate(q_rows, HALF, c1[None, :], s1[None, :], c2, s2, q_mask)
    kv = tl.arange(0, BLOCK_KV)
    kv_mask = (kv < NUM_KV_HEADS)[:, None] & d_ok[None, :]
    k_rows = k_ptr + tok * stride_kt + kv[:, None] * stride_kh + d[None, :]
    k1, k2 = _rotate(k_rows, HALF, c1[None, :], s1[None, :], c2, s2, kv_mask)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:  # a negative slot marks a padding token
        block = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        k_dst = k_cache_ptr + block * stride_cb + off * stride_cs + kv[:, None] * stride_ch
        v_dst = v_cache_ptr + block * stride_vcb + off * stride_vcs + kv[:, None] * stride_vch
        v_rows = v_ptr + tok * stride_vt + kv[:, None] * stride_vh + d[None, :]
        v1 = tl.load(v_rows, mask=kv_mask, other=0.0)
        v2 = tl.load(v_rows + HALF, mask=kv_mask, other=0.0)
        cache_dt = k_cache_ptr.dtype.element_ty
        tl.store(k_dst + d[None, :], k1.to(cache_dt), mask=kv_mask)
        tl.store(k_dst + HALF + d[None, :], k2.to(cache_dt), mask=kv_mask)
        tl.store(v_dst + d[None, :], v1.to(cache_dt), mask=kv_mask)
        tl.store(v_dst + HALF + d[None, :], v2.to(cache_dt), mask=kv_mask)


def launch_rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """``rope_store_kv`` without the checks (one launch per layer of a checked step)."""
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    n_kv = k.shape[1]
    block_size = k_cache.shape[1]
    kernel_for(_rope_store_kv_kernel, q.device)[(num_tokens,)](
        q,
        k,
        v,
        cos,
        sin,
        positions,
        slot_mapping,
        k_cache,
        v_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        sin.stride(0),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=n_kv,
        HALF=head_dim // 2,
        BLOCK_SIZE=block_size,
        BLOCK_H=next_pow2(num_heads),
        BLOCK_KV=next_pow2(n_kv),
        BLOCK_HALF=next_pow2(head_dim // 2),
        num_warps=NUM_WARPS,
    )


def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """Rotate ``q`` ``[T, H, D]`` and ``k`` ``[T, KV, D]`` in place at ``positions``, then write
    ``k`` and ``v`` into their ``slot_mapping`` slots of one layer's cache views.

    ``q``/``k``/``v`` may be strided views (a fused projection's output) with a contiguous
    head_dim; ``cos``/``sin`` are ``[max_positions, D]`` tables (any float dtype, cast to
    ``q``'s); ``positions`` and ``slot_mapping`` are int64 ``[T]``; a negative slot skips the
    token's store.
    """
    check_cache_views(k_cache, v_cache)
    check_same(k_cache, q=q, k=k, v=v)
    n_kv, head_dim = k_cache.shape[2:]
    if q.dim() != 3 or q.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"q must be [T, H, {head_dim}] (even head_dim), got {tuple(q.shape)}")
    kv_shape = (q.shape[0], n_kv, head_dim)
    if k.shape != kv_shape or v.shape != kv_shape:
        raise ValueError(f"k and v must be {kv_shape}, got {tuple(k.shape)}, {tuple(v.shape)}")
    if any(t.stride(2) != 1 for t in (q, k, v)):
        raise ValueError("q, k and v must have a contiguous head_dim")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[1] != head_dim or t.stride(1) != 1:
            raise ValueError(f"{name} must be [positions, {head_dim}], got {tuple(t.shape)}")
        if t.device != q.device or not t.is_floating_point():
            raise ValueError(f"{name} must be a float table on {q.device}")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        check_index(name, t, 1, q.device)
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} has {t.shape[0]} entries for {q.shape[0]} tokens")
    launch_rope_store_kv(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache)
