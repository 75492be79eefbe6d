"""Write the new tokens' K and V of one layer into their pool slots.

``store_kv`` checks its inputs; ``launch_store_kv`` is the unchecked per-layer launch for a
caller that checked them once per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels.common import (
    block_d,
    check_cache_views,
    check_index,
    check_same,
    kernel_for,
    next_pow2,
)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)  # token offsets in int64: T * stride passes 2**31
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:  # a negative slot marks a padding token
        block = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
        k_src = k_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd
        v_src = v_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd
        k = tl.load(k_src, mask=mask, other=0.0)  # [BLOCK_H, BLOCK_D]
        v = tl.load(v_src, mask=mask, other=0.0)
        k_dst = k_cache_ptr + block * stride_cb + off * stride_cs
        v_dst = v_cache_ptr + block * stride_vcb + off * stride_vcs
        tl.store(k_dst + h[:, None] * stride_ch + d[None, :], k, mask=mask)
        tl.store(v_dst + h[:, None] * stride_vch + d[None, :], v, mask=mask)


def launch_store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``store_kv`` without the checks (one launch per layer of a checked step)."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    _, block_size, n_kv, head_dim = k_cache.shape
    kernel = kernel_for(_store_kv_kernel, k_cache.device)
    kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        *k.stride(),
        *v.stride(),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        NUM_KV_HEADS=n_kv,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=next_pow2(n_kv),
        BLOCK_D=block_d(head_dim),
    )


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``k``/``v`` ``[T, n_kv_heads, head_dim]`` into one layer's cache views.

    ``k_cache``/``v_cache`` are ``[num_blocks, block_size, n_kv_heads, head_dim]`` views of
    the pool (any strides with a contiguous head_dim). ``slot_mapping`` (int64 ``[T]``) holds
    ``block_id * block_size + offset`` per token; a negative slot skips the token.
    """
    check_cache_views(k_cache, v_cache)
    check_same(k_cache, k=k, v=v)
    check_index("slot_mapping", slot_mapping, 1, k_cache.device)
    n_kv, head_dim = k_cache.shape[2:]
    if k.dim() != 3 or k.shape[1:] != (n_kv, head_dim):
        raise ValueError(
            f"k must be [T, {n_kv}, {head_dim}] to match the cache, got {tuple(k.shape)}"
        )
    if v.shape != k.shape:
        raise ValueError(f"v {tuple(v.shape)} must have k's shape {tuple(k.shape)}")
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {k.shape[0]} tokens")
    launch_store_kv(k_cache, v_cache, k, v, slot_mapping)
