"""Copying whole KV blocks between pool tensors in as few passes over memory as possible:
destination ids in one ascending run (``alloc(contiguous=True)``) take one gather straight
into that slice; scattered ids take one copy per block on the CPU (one pass, not a gather
and a scatter) and a gather and a scatter on a GPU (two kernels, not one per block)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minimemserve.blocks.layout import KVLayout


def is_run(ids: Sequence[int]) -> bool:
    """True when ``ids`` is one ascending run ``b, b + 1, ...`` (empty and single count)."""
    return all(b == a + 1 for a, b in zip(ids, ids[1:]))


def check_pool_tensor(layout: KVLayout, dtype: torch.dtype, t: torch.Tensor, what: str) -> None:
    """Raise ValueError naming ``what`` unless ``t`` is a ``layout`` pool tensor of ``dtype``."""
    num_blocks = t.shape[layout.block_dim] if t.dim() == len(layout.pool_shape(0)) else -1
    if tuple(t.shape) != layout.pool_shape(num_blocks):
        raise ValueError(f"{what} expects a pool tensor of layout {layout}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{what} expects {dtype}, got {t.dtype}")


def move_blocks(
    dst: torch.Tensor,
    dst_ids: Sequence[int],
    src: torch.Tensor,
    src_ids: Sequence[int],
    dim: int = 0,
) -> None:
    """``dst[dst_ids] = src[src_ids]`` along the block dimension ``dim`` (0 aggregated, 2
    per-layer) of two pool tensors of one dtype and block shape, on any devices."""
    dst_ids, src_ids = [int(b) for b in dst_ids], [int(b) for b in src_ids]
    if len(dst_ids) != len(src_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
    if dst.dtype != src.dtype:
        raise ValueError(f"block copy between dtypes {src.dtype} -> {dst.dtype}")
    if not src_ids or src.is_meta or dst.is_meta:  # meta tensors hold no data to move
        return
    same_device = dst.device == src.device
    if dim == 0 and same_device and is_run(dst_ids):
        s_idx = torch.tensor(src_ids, device=src.device)
        start = dst_ids[0]
        torch.index_select(src, 0, s_idx, out=dst[start : start + len(dst_ids)])
    elif dim == 0 and same_device and not dst.is_cuda:
        for s, d in zip(src_ids, dst_ids):
            dst[d].copy_(src[s])
    else:
        data = src.index_select(dim, torch.tensor(src_ids, device=src.device))
        dst.index_copy_(dim, torch.tensor(dst_ids, device=dst.device), data.to(dst.device))
