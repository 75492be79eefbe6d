"""prefix_prefill against a naive gather-and-softmax reference."""

from __future__ import annotations

import pytest
import torch
from kernel_reference import TOLERANCES, attend, gather, make_pool

from minimemserve.blocks.layout import AGGREGATED, PER_LAYER
from triton_kernels import prefix_prefill

F32, F16 = torch.float32, torch.float16

# Prefix lengths cover 0, partial-block and multi-block; new-token runs cover one query
# tile, several tiles (the CPU tiles are 32 queries x 16 keys) and a two-token run.
# (block_size, context_lens, new_lens, n_kv_heads, group, head_dim, layout, dtype)
CASES = [
    (1, [0], [9], 1, 1, 64, AGGREGATED, F32),
    (1, [3, 0, 40], [40, 5, 2], 2, 2, 128, PER_LAYER, F16),
    (1, [17, 2], [31, 16], 1, 8, 64, AGGREGATED, F16),
    (16, [0, 7, 35, 16], [33, 2, 20, 70], 1, 4, 64, PER_LAYER, F32),
    (16, [21], [65], 2, 8, 128, AGGREGATED, F16),
    (16, [48, 0, 9], [17, 64, 2], 4, 1, 128, PER_LAYER, F16),
    (32, [0, 0], [3, 34], 2, 1, 64, AGGREGATED, F16),
    (32, [70, 5, 0, 33, 1, 64, 2, 10], [2, 3, 4, 5, 6, 7, 8, 40], 1, 2, 64, PER_LAYER, F32),
    (32, [40], [12], 2, 4, 128, AGGREGATED, F32),
]


@pytest.mark.parametrize("block_size,ctx,new,n_kv,group,head_dim,kind,dtype", CASES)
def test_prefix_prefill_matches_reference(block_size, ctx, new, n_kv, group, head_dim, kind, dtype):
    seed = block_size + sum(ctx) + 7 * sum(new)
    gen = torch.Generator().manual_seed(seed)
    p = make_pool([c + n for c, n in zip(ctx, new)], block_size, n_kv, head_dim, dtype, kind, seed)
    num_tokens, heads = sum(new), n_kv * group
    q = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, n_kv, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, n_kv, head_dim, generator=gen).to(dtype)
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    qsl = torch.tensor(starts, dtype=torch.int32)
    scale = head_dim**-0.5
    out = prefix_prefill(
        q, k, v, p.k_cache, p.v_cache, p.block_tables, qsl,
        torch.tensor(ctx, dtype=torch.int32), scale,
    )  # fmt: skip
    assert out.shape == q.shape and out.dtype == dtype
    atol, rtol = TOLERANCES[dtype]
    for b, c in enumerate(ctx):
        s, e = starts[b], starts[b + 1]
        keys = torch.cat([gather(p.k_cache, p.tables[b], c), k[s:e]])
        vals = torch.cat([gather(p.v_cache, p.tables[b], c), v[s:e]])
        ref = attend(q[s:e], keys, vals, scale, causal_from=c)
        torch.testing.assert_close(out[s:e].float(), ref, atol=atol, rtol=rtol)


def test_prefix_prefill_ignores_cache_past_the_prefix():
    """Only the first context_lens positions come from the cache; the rest from k/v."""
    p = make_pool([5 + 6], 16, 1, 64, F32, AGGREGATED, seed=9)
    q, k, v = (torch.randn(6, 1, 64) for _ in range(3))
    args = (p.block_tables, torch.tensor([0, 6], dtype=torch.int32), torch.tensor([5]), 0.125)
    a = prefix_prefill(q, k, v, p.k_cache, p.v_cache, *args)
    blk = p.tables[0][0]
    p.k_cache[blk, 5:] = 1e4  # garbage where the new tokens would later be stored
    b = prefix_prefill(q, k, v, p.k_cache, p.v_cache, *args)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_prefix_prefill_rejects_bad_input():
    p = make_pool([8], 16, 2, 64, F32, AGGREGATED, seed=0)
    q, k = torch.randn(4, 4, 64), torch.randn(4, 2, 64)
    qsl, ctx = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="k and v must be"):
        prefix_prefill(q, k[:3], k[:3], p.k_cache, p.v_cache, p.block_tables, qsl, ctx, 0.1)
    with pytest.raises(ValueError, match="disagree on the batch"):
        prefix_prefill(q, k, k, p.k_cache, p.v_cache, p.block_tables, qsl[:1], ctx, 0.1)
    with pytest.raises(ValueError, match="context_lens must be int32 or int64"):
        prefix_prefill(q, k, k, p.k_cache, p.v_cache, p.block_tables, qsl, ctx.float(), 0.1)
    with pytest.raises(TypeError, match="bfloat16 needs a CUDA device"):
        kb = p.k_cache.bfloat16()
        prefix_prefill(
            q.bfloat16(), k.bfloat16(), k.bfloat16(), kb, kb, p.block_tables, qsl, ctx, 0.1
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size,head_dim", [(1, 64), (16, 128), (32, 256)])
def test_prefix_prefill_cuda(dtype, block_size, head_dim):
    ctx, new, n_kv, group = [0, 300, 17], [257, 64, 130], 2, 4
    p = make_pool([c + n for c, n in zip(ctx, new)], block_size, n_kv, head_dim, dtype=dtype,
                  kind=AGGREGATED, seed=block_size)  # fmt: skip
    q = torch.randn(sum(new), n_kv * group, head_dim).to(dtype)
    k, v = (torch.randn(sum(new), n_kv, head_dim).to(dtype) for _ in range(2))
    starts = [0, new[0], new[0] + new[1], sum(new)]
    cuda = lambda t: t.cuda()
    out = prefix_prefill(
        *map(cuda, (q, k, v, p.k_cache, p.v_cache, p.block_tables)),
        torch.tensor(starts, dtype=torch.int32, device="cuda"),
        torch.tensor(ctx, dtype=torch.int32, device="cuda"),
        head_dim**-0.5,
    ).cpu()
    atol, rtol = TOLERANCES[dtype]
    for b, c in enumerate(ctx):
        s, e = starts[b], starts[b + 1]
        keys = torch.cat([gather(p.k_cache, p.tables[b], c), k[s:e]])
        vals = torch.cat([gather(p.v_cache, p.tables[b], c), v[s:e]])
        ref = attend(q[s:e], keys, vals, head_dim**-0.5, causal_from=c)
        torch.testing.assert_close(out[s:e].float(), ref, atol=atol, rtol=rtol)
