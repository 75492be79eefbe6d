"""paged_decode against a naive gather-and-softmax reference, and its split heuristic."""

from __future__ import annotations

import random

import pytest
import torch
from kernel_reference import TOLERANCES, attend, gather, make_pool

from minimemserve.blocks.layout import AGGREGATED, PER_LAYER
from triton_kernels import paged_decode
from triton_kernels.paged_decode import MAX_SPLITS, MIN_TOKENS_PER_SPLIT, choose_num_splits

F32, F16 = torch.float32, torch.float16

# A pairwise-covering set: every block size meets every group size, batch range, head dim,
# layout, dtype and split choice at least once, without the full cross product.
# (block_size, batch, n_kv_heads, group, head_dim, layout, dtype, num_splits)
CASES = [
    (1, 1, 1, 4, 64, AGGREGATED, F32, None),
    (1, 4, 2, 2, 128, PER_LAYER, F16, 3),
    (1, 8, 1, 8, 64, AGGREGATED, F16, 2),
    (1, 2, 2, 1, 128, PER_LAYER, F32, 1),
    (16, 1, 2, 4, 128, AGGREGATED, F32, 4),
    (16, 3, 1, 8, 128, PER_LAYER, F32, None),
    (16, 8, 2, 1, 64, PER_LAYER, F16, 1),
    (16, 5, 1, 2, 64, AGGREGATED, F16, 7),
    (16, 2, 2, 4, 64, PER_LAYER, F32, 16),  # more splits than tiles: empty splits merge
    (32, 2, 2, 8, 64, AGGREGATED, F32, 2),
    (32, 6, 1, 4, 64, PER_LAYER, F16, None),
    (32, 8, 4, 1, 128, AGGREGATED, F16, 3),
    (32, 1, 1, 2, 128, PER_LAYER, F32, 1),
]


def _seq_lens(batch: int, block_size: int, seed: int) -> list[int]:
    """A mix of one-token, partial-block and multi-block sequences."""
    rng = random.Random(seed)
    top = 3 * max(block_size, 16) + 7
    lens = [rng.randint(1, top) for _ in range(batch)]
    lens[0] = 1
    if batch > 1:
        lens[1] = 2 * block_size + block_size // 2 + 1  # several blocks, the last partial
    return lens


@pytest.mark.parametrize("block_size,batch,n_kv,group,head_dim,kind,dtype,splits", CASES)
def test_paged_decode_matches_reference(
    block_size, batch, n_kv, group, head_dim, kind, dtype, splits
):
    seed = block_size * 100 + batch * 10 + group
    lens = _seq_lens(batch, block_size, seed)
    p = make_pool(lens, block_size, n_kv, head_dim, dtype, kind, seed)
    q = torch.randn(batch, n_kv * group, head_dim, generator=torch.Generator().manual_seed(seed))
    q = q.to(dtype)
    scale = head_dim**-0.5
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = paged_decode(q, p.k_cache, p.v_cache, p.block_tables, seq_lens, scale, splits)
    assert out.shape == q.shape and out.dtype == dtype
    atol, rtol = TOLERANCES[dtype]
    for b, n in enumerate(lens):
        k = gather(p.k_cache, p.tables[b], n)
        v = gather(p.v_cache, p.tables[b], n)
        ref = attend(q[b : b + 1], k, v, scale, causal_from=n - 1)[0]
        torch.testing.assert_close(out[b].float(), ref, atol=atol, rtol=rtol)


def test_paged_decode_reads_strided_queries():
    """q may be a slice of a fused projection; the output is the same as for a copy."""
    p = make_pool([20, 37], 16, 2, 64, F32, AGGREGATED, seed=3)
    fused = torch.randn(2, 8, 64)
    q = fused[:, 2:6]  # [B, 4, D], token stride 8*64
    seq_lens = torch.tensor([20, 37], dtype=torch.int32)
    a = paged_decode(q, p.k_cache, p.v_cache, p.block_tables, seq_lens, 0.125, 2)
    b = paged_decode(q.contiguous(), p.k_cache, p.v_cache, p.block_tables, seq_lens, 0.125, 2)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_paged_decode_rejects_bad_input():
    p = make_pool([4], 16, 2, 64, F32, AGGREGATED, seed=0)
    q = torch.randn(1, 4, 64)
    lens = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_decode(torch.randn(1, 3, 64), p.k_cache, p.v_cache, p.block_tables, lens, 0.1)
    with pytest.raises(ValueError, match=r"q must be \[B, H, 64\]"):
        paged_decode(torch.randn(1, 4, 32), p.k_cache, p.v_cache, p.block_tables, lens, 0.1)
    with pytest.raises(ValueError, match="one row per query"):
        paged_decode(q, p.k_cache, p.v_cache, p.block_tables, lens.repeat(2), 0.1)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode(q, p.k_cache, p.v_cache, p.block_tables, lens, 0.1, MAX_SPLITS + 1)
    with pytest.raises(ValueError, match="scale"):
        paged_decode(q, p.k_cache, p.v_cache, p.block_tables, lens, float("nan"))
    with pytest.raises(ValueError, match="contiguous head_dim"):
        kt = p.k_cache.transpose(2, 3)
        paged_decode(q, kt, kt, p.block_tables, lens, 0.1)
    with pytest.raises(TypeError, match="unsupported dtype"):
        k64 = p.k_cache.double()
        paged_decode(q.double(), k64, k64, p.block_tables, lens, 0.1)


H200_SMS = 132


def test_num_splits_short_contexts_are_not_split():
    assert choose_num_splits(1, 8, MIN_TOKENS_PER_SPLIT, H200_SMS) == 1
    assert choose_num_splits(1, 8, 100, H200_SMS) == 1


def test_num_splits_big_batches_are_not_split():
    assert choose_num_splits(64, 32, 4096, H200_SMS) == 1
    assert choose_num_splits(256, 8, 32768, H200_SMS) == 1


def test_num_splits_fill_the_gpu_for_few_long_sequences():
    s = choose_num_splits(1, 8, 32768, H200_SMS)
    assert s == MAX_SPLITS
    s = choose_num_splits(4, 8, 4096, H200_SMS)
    assert 4 * 8 * s >= 2 * H200_SMS  # two waves of programs
    assert 4 * 8 * (s - 1) < 2 * H200_SMS  # and not more splits than that needs


@pytest.mark.parametrize("seq_len", [300, 2048, 32768])
def test_num_splits_monotone(seq_len):
    by_batch = [choose_num_splits(b, 8, seq_len, H200_SMS) for b in (1, 2, 4, 8, 16, 64)]
    assert by_batch == sorted(by_batch, reverse=True)
    by_len = [choose_num_splits(2, 8, n, H200_SMS) for n in sorted({16, 512, 4096, seq_len})]
    assert by_len == sorted(by_len)


def test_num_splits_rejects_nonpositive():
    with pytest.raises(ValueError, match="positive"):
        choose_num_splits(0, 8, 100, H200_SMS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size,group", [(1, 8), (16, 1), (32, 4)])
def test_paged_decode_cuda(dtype, block_size, group):
    lens = [1, 700, 4100, 33]
    p = make_pool(lens, block_size, 2, 128, torch.float32, AGGREGATED, seed=group)
    k_cache, v_cache = p.k_cache.to(dtype).cuda(), p.v_cache.to(dtype).cuda()
    q = torch.randn(len(lens), 2 * group, 128).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = paged_decode(q.cuda(), k_cache, v_cache, p.block_tables.cuda(), seq_lens, 128**-0.5)
    atol, rtol = TOLERANCES[dtype]
    for b, n in enumerate(lens):
        k = gather(k_cache.cpu(), p.tables[b], n)
        v = gather(v_cache.cpu(), p.tables[b], n)
        ref = attend(q[b : b + 1], k, v, 128**-0.5, causal_from=n - 1)[0]
        torch.testing.assert_close(out[b].float().cpu(), ref, atol=atol, rtol=rtol)
