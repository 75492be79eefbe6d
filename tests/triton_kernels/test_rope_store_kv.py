"""rope_store_kv: rotary on q and k in place plus the K/V store, against the model's Rotary
and the plain store, on random non-contiguous block tables."""

from __future__ import annotations

import pytest
import torch
from kernel_reference import DEVICE, GPU, make_pool

from minimemserve.blocks.layout import AGGREGATED, PER_LAYER
from minimemserve.model.layers import Rotary
from triton_kernels import rope_store_kv

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOL = {F32: (1e-5, 1e-5), F16: (2e-3, 2e-3), BF16: (1e-2, 1e-2)}
# compiled for a GPU, a product and the sum after it may fuse into one FMA: not bit-exact there
EXACT = (0, 0) if DEVICE.type == "cpu" else (1e-6, 1e-6)

# (block_size, tokens, heads, n_kv, head_dim, layout, dtype)
CASES = [
    (16, 5, 4, 2, 64, AGGREGATED, F32),
    (1, 3, 8, 8, 64, PER_LAYER, F32),
    (16, 9, 4, 1, 128, AGGREGATED, F16),
    (32, 4, 6, 2, 80, PER_LAYER, F16),
    pytest.param(16, 33, 32, 32, 128, AGGREGATED, BF16, marks=GPU),
    pytest.param(16, 7, 64, 8, 128, AGGREGATED, BF16, marks=GPU),
]


def _layer_views(pool, kind):
    return (pool[:, 1, 0], pool[:, 1, 1]) if kind == AGGREGATED else (pool[1, 0], pool[1, 1])


@pytest.mark.parametrize("block_size,tokens,heads,n_kv,head_dim,kind,dtype", CASES)
def test_rope_store_kv_matches_rotary_then_store(
    block_size, tokens, heads, n_kv, head_dim, kind, dtype
):
    p = make_pool([tokens + 40], block_size, n_kv, head_dim, dtype, kind, seed=tokens)
    rotary = Rotary(head_dim, 512, 10000.0, None).to(DEVICE)
    gen = torch.Generator(DEVICE).manual_seed(heads)
    width = (heads + 2 * n_kv) * head_dim
    qkv = torch.randn(tokens, width, generator=gen, device=DEVICE).to(dtype)  # a fused output
    q, k, v = (
        t.view(tokens, -1, head_dim)
        for t in qkv.split([heads * head_dim, n_kv * head_dim, n_kv * head_dim], dim=-1)
    )
    # distinct positions (so distinct slots: two writes to one slot would race on a GPU)
    positions = torch.randperm(tokens + 40, generator=gen, device=DEVICE)[:tokens]
    slots = [p.tables[0][t // block_size] * block_size + t % block_size for t in positions.tolist()]
    slots = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    ref_q, ref_k = rotary(q.clone(), k.clone(), positions)
    expect = p.pool.clone()
    ek, ev = _layer_views(expect, kind)
    for i, s in enumerate(slots.tolist()):
        ek[s // block_size, s % block_size] = ref_k[i]
        ev[s // block_size, s % block_size] = v[i]

    rope_store_kv(q, k, v, rotary.cos, rotary.sin, positions, slots, p.k_cache, p.v_cache)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(q, ref_q, atol=atol, rtol=rtol)  # rotated in place
    torch.testing.assert_close(k, ref_k, atol=atol, rtol=rtol)
    torch.testing.assert_close(p.pool, expect, atol=atol, rtol=rtol)
    if dtype == F32:  # the same fp32 products and sums as the unfused ops
        torch.testing.assert_close(q, ref_q, atol=EXACT[0], rtol=EXACT[1])


def test_rope_store_kv_skips_padding_slots():
    """A negative slot (padding row) writes no cache slot; its q and k are still rotated."""
    p = make_pool([4], 16, 1, 64, F32, AGGREGATED, seed=0)
    rotary = Rotary(64, 64, 10000.0, None).to(DEVICE)
    before = p.pool.clone()
    q = torch.randn(2, 2, 64, device=DEVICE)
    k, v = torch.randn(2, 2, 1, 64, device=DEVICE)
    slot = p.tables[0][0] * 16 + 3
    slots = torch.tensor([-1, slot], device=DEVICE)
    positions = torch.tensor([0, 3], device=DEVICE)
    ref_q, ref_k = rotary(q.clone(), k.clone(), positions)
    rope_store_kv(q, k, v, rotary.cos, rotary.sin, positions, slots, p.k_cache, p.v_cache)
    before[p.tables[0][0], 1, 0, 3] = ref_k[1]
    before[p.tables[0][0], 1, 1, 3] = v[1]
    torch.testing.assert_close(p.pool, before, atol=EXACT[0], rtol=EXACT[1])
    torch.testing.assert_close(q, ref_q, atol=EXACT[0], rtol=EXACT[1])


def test_rope_store_kv_rejects_bad_input():
    p = make_pool([4], 16, 2, 64, F32, AGGREGATED, seed=0)
    rotary = Rotary(64, 64, 10000.0, None).to(DEVICE)
    q = torch.randn(2, 4, 64, device=DEVICE)
    k = torch.randn(2, 2, 64, device=DEVICE)
    idx = torch.tensor([0, 1], device=DEVICE)
    args = (rotary.cos, rotary.sin, idx, idx, p.k_cache, p.v_cache)
    with pytest.raises(ValueError, match="k and v must be"):
        rope_store_kv(q, k[:, :1], k[:, :1], *args)
    with pytest.raises(ValueError, match="q must be"):
        rope_store_kv(q[..., :32], k, k, *args)
    with pytest.raises(ValueError, match="cos must be"):
        rope_store_kv(q, k, k, rotary.cos[:, :32], *args[1:])
    with pytest.raises(ValueError, match="positions has 1 entries"):
        rope_store_kv(q, k, k, rotary.cos, rotary.sin, idx[:1], idx, p.k_cache, p.v_cache)
    with pytest.raises(ValueError, match="slot_mapping must be int32 or int64"):
        rope_store_kv(q, k, k, rotary.cos, rotary.sin, idx, idx.float(), p.k_cache, p.v_cache)
    with pytest.raises(ValueError, match="expected torch.float32"):
        rope_store_kv(q.half(), k, k, *args)
