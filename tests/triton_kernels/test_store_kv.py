"""store_kv writes each new token's K/V into its slot of one layer and nowhere else."""

from __future__ import annotations

import pytest
import torch
from kernel_reference import DEVICE, GPU, make_pool

from minimemserve.blocks.layout import AGGREGATED, PER_LAYER
from triton_kernels import store_kv

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (block_size, tokens, n_kv_heads, head_dim, layout, dtype)
CASES = [
    (1, 5, 1, 64, AGGREGATED, F32),
    (1, 9, 4, 128, PER_LAYER, F16),
    (16, 1, 2, 128, AGGREGATED, F16),
    (16, 20, 8, 64, PER_LAYER, F32),
    (16, 6, 2, 80, AGGREGATED, F16),
    (32, 40, 2, 64, AGGREGATED, F32),
    (32, 3, 1, 128, PER_LAYER, F16),
    pytest.param(16, 33, 8, 128, AGGREGATED, BF16, marks=GPU),
    pytest.param(32, 17, 2, 256, AGGREGATED, BF16, marks=GPU),
    pytest.param(1, 7, 4, 96, PER_LAYER, BF16, marks=GPU),
]


@pytest.mark.parametrize("block_size,tokens,n_kv,head_dim,kind,dtype", CASES)
def test_store_kv_writes_only_its_slots(block_size, tokens, n_kv, head_dim, kind, dtype):
    p = make_pool([tokens + 3], block_size, n_kv, head_dim, dtype, kind, seed=tokens)
    before = p.pool.clone()
    table = p.tables[0]
    positions = list(range(3, 3 + tokens))  # a decode-like run after 3 cached tokens
    slots = [table[t // block_size] * block_size + t % block_size for t in positions]
    slots = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    k = torch.randn(tokens, n_kv, head_dim, device=DEVICE).to(dtype)
    v = torch.randn(tokens, n_kv, head_dim, device=DEVICE).to(dtype)
    store_kv(p.k_cache, p.v_cache, k, v, slots)

    expect_k = before.clone()
    expect_views = _views(expect_k, kind)
    for i, s in enumerate(slots.tolist()):
        expect_views[0][s // block_size, s % block_size] = k[i]
        expect_views[1][s // block_size, s % block_size] = v[i]
    torch.testing.assert_close(p.pool, expect_k, atol=0, rtol=0)


def _views(pool, kind):
    # the pool helper reads layer 1; rebuild those views on a copy
    if kind == AGGREGATED:
        return pool[:, 1, 0], pool[:, 1, 1]
    return pool[1, 0], pool[1, 1]


def test_store_kv_skips_negative_slots():
    """Padding tokens (slot -1) write nothing, wherever they sit in the batch."""
    p = make_pool([4], 16, 1, 64, F32, AGGREGATED, seed=0)
    before = p.pool.clone()
    k = torch.randn(3, 1, 64, device=DEVICE)
    slot = p.tables[0][0] * 16 + 2
    store_kv(p.k_cache, p.v_cache, k, k, torch.tensor([-1, slot, -1], device=DEVICE))
    before[:, 1, :, 2][p.tables[0][0]] = k[1]  # K and V of layer 1, offset 2
    assert torch.equal(p.pool, before)


def test_store_kv_reads_strided_inputs():
    """k/v may be views of a fused qkv tensor (non-contiguous token stride)."""
    p = make_pool([8], 16, 2, 64, F32, PER_LAYER, seed=1)
    qkv = torch.randn(8, 6, 64, device=DEVICE)  # [T, 2 q + 2 k + 2 v heads, D]
    k, v = qkv[:, 2:4], qkv[:, 4:6]
    slots = torch.tensor([p.tables[0][0] * 16 + i for i in range(8)], device=DEVICE)
    store_kv(p.k_cache, p.v_cache, k, v, slots)
    torch.testing.assert_close(p.k_cache[p.tables[0][0], :8], k, atol=0, rtol=0)
    torch.testing.assert_close(p.v_cache[p.tables[0][0], :8], v, atol=0, rtol=0)


def test_store_kv_rejects_bad_input():
    p = make_pool([4], 16, 2, 64, F32, AGGREGATED, seed=0)
    k = torch.randn(2, 2, 64, device=DEVICE)
    two = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="k must be"):
        store_kv(p.k_cache, p.v_cache, torch.randn(2, 3, 64, device=DEVICE), k, two)
    with pytest.raises(ValueError, match="expected torch.float32"):
        store_kv(p.k_cache, p.v_cache, k.half(), k.half(), two)
    with pytest.raises(ValueError, match="slot_mapping must be int32 or int64"):
        store_kv(p.k_cache, p.v_cache, k, k, two.float())
    with pytest.raises(ValueError, match="2 tokens"):
        store_kv(p.k_cache, p.v_cache, k, k, torch.tensor([0, 1, 2], device=DEVICE))
    with pytest.raises(ValueError, match="k_cache must be"):
        store_kv(p.k_cache[0], p.v_cache[0], k, k, two)
