"""prefix_prefill against a naive gather-and-softmax reference.

The case matrix runs on the device under test (``DEVICE``); pool slots outside each cached
prefix hold NaN (the new tokens' slots included: their K/V come from the inputs), and so do
the head-dimension gaps after each head of the new tokens' K/V inputs.
"""

from __future__ import annotations

import pytest
import torch
from kernel_reference import DEVICE, GPU, assert_close_per_row, attend, gather, make_pool

from minimemserve.blocks.layout import AGGREGATED, PER_LAYER
from triton_kernels import prefix_prefill
from triton_kernels.common import SMEM_BUDGET, block_d
from triton_kernels.prefix_prefill import prefill_tiles

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
AGG, PL = AGGREGATED, PER_LAYER

# Prefix lengths cover 0, partial-block and multi-block; new-token runs cover one query
# tile, several tiles (the CPU tiles are 32 queries x 16 keys) and a two-token run.
# (block_size, context_lens, new_lens, n_kv_heads, group, head_dim, layout, dtype)
CASES = [
    (1, [0], [9], 1, 1, 64, AGG, F32),
    (1, [3, 0, 40], [40, 5, 2], 2, 2, 128, PL, F16),
    (1, [17, 2], [31, 16], 1, 8, 64, AGG, F16),
    (1, [5, 0], [36, 3], 1, 2, 96, PL, F32),
    (16, [0, 7, 35, 16], [33, 2, 20, 70], 1, 4, 64, PL, F32),
    (16, [21], [65], 2, 8, 128, AGG, F16),
    (16, [48, 0, 9], [17, 64, 2], 4, 1, 128, PL, F16),
    (16, [19, 33], [34, 5], 1, 4, 80, AGG, F16),
    (32, [0, 0], [3, 34], 2, 1, 64, AGG, F16),
    (32, [70, 5, 0, 33, 1, 64, 2, 10], [2, 3, 4, 5, 6, 7, 8, 40], 1, 2, 64, PL, F32),
    (32, [40], [12], 2, 4, 128, AGG, F32),
    (32, [40, 1], [35, 2], 1, 1, 80, PL, F32),
]
# On CUDA: every dtype, head size, block size and group, pairwise.
# (block_size, head_dim, group, layout, dtype)
GPU_CASES = [
    (1, 64, 2, PL, BF16),
    (1, 80, 1, AGG, F16),
    (1, 96, 8, PL, F32),
    (1, 128, 4, AGG, F16),
    (1, 256, 4, AGG, BF16),
    (16, 64, 8, AGG, F32),
    (16, 80, 4, PL, F32),
    (16, 80, 2, PL, F32),
    (16, 96, 1, AGG, F16),
    (16, 128, 1, PL, BF16),
    (16, 256, 2, AGG, F16),
    (32, 64, 4, PL, F16),
    (32, 64, 1, AGG, F32),
    (32, 80, 8, AGG, BF16),
    (32, 96, 4, PL, BF16),
    (32, 96, 2, AGG, BF16),
    (32, 128, 2, AGG, F32),
    (32, 128, 8, AGG, F16),
    (32, 256, 8, PL, F16),
    (32, 256, 1, AGG, F32),
]


def _new_kv(num_tokens, n_kv, head_dim, dtype, gen):
    """K or V of the new tokens: a view whose head rows are followed by NaN up to the tile
    width (what a padded head-dim tile reads past a head that is not a power of two)."""
    full = torch.randn(num_tokens, n_kv, block_d(head_dim), generator=gen, device=DEVICE)
    full = full.to(dtype)
    full[..., head_dim:] = float("nan")
    return full[..., :head_dim]


def check_prefill(block_size, ctx, new, n_kv, group, head_dim, kind, dtype):
    """prefix_prefill over a NaN-padded pool against the reference, sequence by sequence."""
    seed = block_size + sum(ctx) + 7 * sum(new) + head_dim
    gen = torch.Generator(DEVICE).manual_seed(seed)
    p = make_pool(
        [c + n for c, n in zip(ctx, new)],
        block_size,
        n_kv,
        head_dim,
        dtype,
        kind,
        seed,
        valid_lens=ctx,
    )
    num_tokens, heads = sum(new), n_kv * group
    q = torch.randn(num_tokens, heads, head_dim, generator=gen, device=DEVICE).to(dtype)
    k = _new_kv(num_tokens, n_kv, head_dim, dtype, gen)
    v = _new_kv(num_tokens, n_kv, head_dim, dtype, gen)
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    qsl = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = prefix_prefill(q, k, v, p.k_cache, p.v_cache, p.block_tables, qsl, ctx_t, scale)
    assert out.shape == q.shape and out.dtype == dtype
    for b, c in enumerate(ctx):
        s, e = starts[b], starts[b + 1]
        keys = torch.cat([gather(p.k_cache, p.tables[b], c), k[s:e]])
        vals = torch.cat([gather(p.v_cache, p.tables[b], c), v[s:e]])
        ref = attend(q[s:e], keys, vals, scale, causal_from=c)
        assert_close_per_row(out[s:e], ref, dtype)


@pytest.mark.parametrize("block_size,ctx,new,n_kv,group,head_dim,kind,dtype", CASES)
def test_prefix_prefill_matches_reference(block_size, ctx, new, n_kv, group, head_dim, kind, dtype):
    check_prefill(block_size, ctx, new, n_kv, group, head_dim, kind, dtype)


@pytest.mark.parametrize(
    "block_size,head_dim,group,kind,dtype", [pytest.param(*c, marks=GPU) for c in GPU_CASES]
)
def test_prefix_prefill_cuda_matrix(block_size, head_dim, group, kind, dtype):
    check_prefill(block_size, [0, 300, 17], [257, 64, 130], 2, group, head_dim, kind, dtype)


@pytest.mark.parametrize("num_seqs", [pytest.param(3, marks=GPU)])
def test_prefix_prefill_long_prefix(num_seqs):
    """8k cached tokens plus 2k new ones per sequence, several sequences in one launch."""
    ctx, new = [8192] * num_seqs, [2048] * num_seqs
    ctx[-1] += 5  # a partial last prefix block
    check_prefill(16, ctx, new, 8, 4, 128, AGGREGATED, BF16)


def test_prefix_prefill_ignores_cache_past_the_prefix():
    """Only the first context_lens positions come from the cache; the rest from k/v."""
    p = make_pool([5 + 6], 16, 1, 64, F32, AGGREGATED, seed=9)
    q, k, v = (torch.randn(6, 1, 64, device=DEVICE) for _ in range(3))
    qsl = torch.tensor([0, 6], dtype=torch.int32, device=DEVICE)
    args = (p.block_tables, qsl, torch.tensor([5], device=DEVICE), 0.125)
    a = prefix_prefill(q, k, v, p.k_cache, p.v_cache, *args)
    blk = p.tables[0][0]
    p.k_cache[blk, 5:] = 1e4  # garbage where the new tokens would later be stored
    b = prefix_prefill(q, k, v, p.k_cache, p.v_cache, *args)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_prefix_prefill_rejects_bad_input():
    p = make_pool([8], 16, 2, 64, F32, AGGREGATED, seed=0)
    q, k = torch.randn(4, 4, 64, device=DEVICE), torch.randn(4, 2, 64, device=DEVICE)
    qsl = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    kc, vc, bt = p.k_cache, p.v_cache, p.block_tables
    with pytest.raises(ValueError, match="k and v must be"):
        prefix_prefill(q, k[:3], k[:3], kc, vc, bt, qsl, ctx, 0.1)
    with pytest.raises(ValueError, match="disagree on the batch"):
        prefix_prefill(q, k, k, kc, vc, bt, qsl[:1], ctx, 0.1)
    with pytest.raises(ValueError, match="context_lens must be int32 or int64"):
        prefix_prefill(q, k, k, kc, vc, bt, qsl, ctx.float(), 0.1)
    if DEVICE.type == "cpu":
        with pytest.raises(TypeError, match="bfloat16 needs a CUDA device"):
            kb = kc.bfloat16()
            prefix_prefill(q.bfloat16(), k.bfloat16(), k.bfloat16(), kb, kb, bt, qsl, ctx, 0.1)


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_prefill_tiles_fit_the_shared_memory_budget(head_dim, dtype):
    """The Q tile plus every pipelined K+V stage fits SMEM_BUDGET; wide heads get 8 warps."""
    t = prefill_tiles(head_dim, dtype, torch.device("cuda"))
    bd, elem = block_d(head_dim), dtype.itemsize
    assert t.block_m * bd * elem + t.num_stages * 2 * t.block_n * bd * elem <= SMEM_BUDGET
    assert t.num_stages >= 2 and min(t.block_m, t.block_n) >= 16
    assert t.num_warps == (4 if bd <= 64 else 8)
