"""A naive torch reference for the kernels, and random paged pools to test them on.

Tests run on ``DEVICE``: the CUDA device when there is one (compiled kernels, the pool in
GPU memory, read through its layer views), else the CPU (Triton's interpreter, no bf16).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
import triton

from minimemserve.blocks.layout import AGGREGATED, KVLayout, layer_views

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# marks of a case that needs a CUDA device
GPU = (pytest.mark.gpu, pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA"))

# (atol, rtol) per dtype: fp32 is exact up to summation order; fp16 rounds P and the output
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_from: int):
    """Softmax attention in fp32 of ``q [M, H, D]`` over ``k/v [N, n_kv, D]``, on q's device.

    Query ``i`` sees keys ``[0, causal_from + i]``.
    """
    group = q.shape[1] // k.shape[1]
    dev = q.device
    kf = k.to(dev).float().repeat_interleave(group, dim=1)  # [N, H, D]
    vf = v.to(dev).float().repeat_interleave(group, dim=1)
    s = torch.einsum("mhd,nhd->hmn", q.float(), kf) * scale  # [H, M, N]
    m, n = q.shape[0], k.shape[0]
    visible = (
        torch.arange(n, device=dev)[None, :] <= (causal_from + torch.arange(m, device=dev))[:, None]
    )
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hmn,nhd->mhd", s.softmax(-1), vf)  # [M, H, D]


def gather(cache: torch.Tensor, table: list[int], length: int) -> torch.Tensor:
    """Tokens ``[0, length)`` of one sequence from a ``[nb, bs, n_kv, D]`` cache view."""
    bs = cache.shape[1]
    blocks = torch.tensor(table[: triton.cdiv(length, bs)], dtype=torch.long, device=cache.device)
    return cache[blocks].flatten(0, 1)[:length]  # [length, n_kv, D]


def assert_close_per_row(out, ref, dtype) -> None:
    """``out`` (any device) against an fp32 reference, with ``dtype``'s tolerance."""
    atol, rtol = TOLERANCES[dtype]
    assert torch.isfinite(out).all(), "non-finite values in the kernel output"
    torch.testing.assert_close(out.float(), ref.to(out.device), atol=atol, rtol=rtol)


@dataclass
class PagedPool:
    """A random pool, one layer's views and random non-contiguous block tables."""

    pool: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: list[list[int]]
    block_tables: torch.Tensor  # int32 [B, max_blocks], padded with 0, on the pool's device


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
    device: torch.device = DEVICE,
    valid_lens: list[int] | None = None,
) -> PagedPool:
    """Random K/V in a pool of ``kind`` on ``device`` with shuffled, gapped block tables.

    With ``valid_lens``, only the first ``valid_lens[b]`` slots of sequence ``b`` hold
    numbers; every other slot of the pool (the rest of each sequence's last block, blocks
    that belong to nobody, the padding block 0) holds NaN, in every layer.
    """
    rng = random.Random(seed)
    need = [triton.cdiv(n, block_size) for n in seq_lens]
    num_blocks = 2 * sum(need) + 3  # gaps: half the blocks belong to nobody
    layout = KVLayout(num_layers, block_size, num_kv_heads, head_dim, kind)
    gen = torch.Generator(device).manual_seed(seed)
    pool = torch.randn(layout.pool_shape(num_blocks), generator=gen, device=device).to(dtype)
    ids = list(range(1, num_blocks))  # block 0 is the padding id; keep it unused
    rng.shuffle(ids)
    tables, i = [], 0
    for n in need:
        tables.append(ids[i : i + n])
        i += n
    if valid_lens is not None:
        _poison_outside(pool, kind, tables, valid_lens, block_size)
    width = max(max(need), 1)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    k_cache, v_cache = layer_views(pool, layout, layer)
    return PagedPool(pool, k_cache, v_cache, tables, bt.to(device))


def _poison_outside(pool, kind, tables, valid_lens, block_size) -> None:
    """NaN into every slot that is not one of the first ``valid_lens[b]`` of a sequence."""
    num_blocks = pool.shape[0] if kind == AGGREGATED else pool.shape[2]
    valid = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for table, n in zip(tables, valid_lens):
        slots = [table[p // block_size] * block_size + p % block_size for p in range(n)]
        valid[slots] = True
    bad = ~valid.view(num_blocks, block_size).to(pool.device)
    if kind == AGGREGATED:  # [N, L, 2, bs, KV, D]
        pool.masked_fill_(bad[:, None, None, :, None, None], float("nan"))
    else:  # [L, 2, N, bs, KV, D]
        pool.masked_fill_(bad[None, None, :, :, None, None], float("nan"))
