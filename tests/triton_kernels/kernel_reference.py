"""A naive torch reference for the kernels, and random paged pools to test them on."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from minimemserve.blocks.layout import KVLayout, layer_views

# (atol, rtol) per dtype: fp32 is exact up to summation order; fp16 rounds P and the output
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_from: int):
    """Softmax attention in fp32 of ``q [M, H, D]`` over ``k/v [N, n_kv, D]``.

    Query ``i`` sees keys ``[0, causal_from + i]``.
    """
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [N, H, D]
    vf = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("mhd,nhd->hmn", q.float(), kf) * scale  # [H, M, N]
    m, n = q.shape[0], k.shape[0]
    visible = torch.arange(n)[None, :] <= (causal_from + torch.arange(m))[:, None]  # [M, N]
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hmn,nhd->mhd", s.softmax(-1), vf)  # [M, H, D]


def gather(cache: torch.Tensor, table: list[int], length: int) -> torch.Tensor:
    """Tokens ``[0, length)`` of one sequence from a ``[nb, bs, n_kv, D]`` cache view."""
    bs = cache.shape[1]
    rows = [cache[table[p // bs], p % bs] for p in range(length)]
    return torch.stack(rows) if rows else cache.new_zeros((0, *cache.shape[2:]))


@dataclass
class PagedPool:
    """A random pool, one layer's views and random non-contiguous block tables."""

    pool: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: list[list[int]]
    block_tables: torch.Tensor  # int32 [B, max_blocks], padded with 0


def make_pool(
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kind: str,
    seed: int,
    num_layers: int = 2,
    layer: int = 1,
) -> PagedPool:
    """Random K/V in a pool of ``kind`` with shuffled, gapped block tables per sequence."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = 2 * sum(need) + 3  # gaps: half the blocks belong to nobody
    layout = KVLayout(num_layers, block_size, num_kv_heads, head_dim, kind)
    pool = torch.randn(layout.pool_shape(num_blocks), generator=gen).to(dtype)
    ids = list(range(1, num_blocks))  # block 0 is the padding id; keep it unused
    rng.shuffle(ids)
    tables, i = [], 0
    for n in need:
        tables.append(ids[i : i + n])
        i += n
    width = max(max(need), 1)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    k_cache, v_cache = layer_views(pool, layout, layer)
    return PagedPool(pool, k_cache, v_cache, tables, bt)
