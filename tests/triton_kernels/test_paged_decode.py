"""paged_decode against a naive gather-and-softmax reference, and its split heuristic.

The case matrix runs on the device under test (``DEVICE``): compiled on CUDA, with the pool
in GPU memory read through its layer views, interpreted on the CPU. Slots outside the
sequences hold NaN, so a kernel that reads one (or lets a padded head dimension through)
fails. Cases marked ``GPU`` need bf16 or sizes the interpreter would take minutes on.
"""

from __future__ import annotations

import random

import pytest
import torch
from kernel_reference import (
    DEVICE,
    GPU,
    assert_close_per_row,
    attend,
    gather,
    make_pool,
)

from minimemserve.blocks.layout import AGGREGATED, PER_LAYER
from triton_kernels import launch_decode, paged_decode, plan_decode
from triton_kernels.common import SMEM_BUDGET, block_d
from triton_kernels.paged_decode import (
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    choose_num_splits,
    decode_tiles,
)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
AGG, PL = AGGREGATED, PER_LAYER

# A pairwise-covering set: every block size meets every group size, batch range, head dim,
# layout, dtype and split choice at least once, without the full cross product.
# (block_size, batch, n_kv_heads, group, head_dim, layout, dtype, num_splits)
CASES = [
    (1, 1, 1, 4, 64, AGG, F32, None),
    (1, 4, 2, 2, 128, PL, F16, 3),
    (1, 8, 1, 8, 64, AGG, F16, 2),
    (1, 2, 2, 1, 128, PL, F32, 1),
    (1, 3, 1, 2, 80, AGG, F32, 2),
    (16, 1, 2, 4, 128, AGG, F32, 4),
    (16, 3, 1, 8, 128, PL, F32, None),
    (16, 8, 2, 1, 64, PL, F16, 1),
    (16, 5, 1, 2, 64, AGG, F16, 7),
    (16, 2, 2, 4, 64, PL, F32, 16),  # more splits than tiles: empty splits merge
    (16, 3, 2, 2, 96, AGG, F16, 3),
    (32, 2, 2, 8, 64, AGG, F32, 2),
    (32, 6, 1, 4, 64, PL, F16, None),
    (32, 8, 4, 1, 128, AGG, F16, 3),
    (32, 1, 1, 2, 128, PL, F32, 1),
    (32, 2, 1, 1, 80, PL, F16, 1),
]
# On CUDA: every dtype, head size, block size, group and forced split count (1, 2, 7, 16,
# or the heuristic's choice), pairwise. (block_size, head_dim, group, splits, layout, dtype)
GPU_CASES = [
    (1, 64, 1, 2, AGG, BF16),
    (1, 64, 2, 16, PL, F16),
    (1, 64, 8, 1, PL, BF16),
    (1, 80, 4, 16, AGG, BF16),
    (1, 80, 4, None, PL, BF16),
    (1, 80, 8, 2, PL, BF16),
    (1, 96, 8, None, PL, F32),
    (1, 96, 1, 16, AGG, F32),
    (1, 128, 4, 1, PL, F16),
    (1, 256, 2, 7, AGG, F16),
    (1, 256, 8, 2, AGG, F32),
    (16, 64, 8, 7, PL, BF16),
    (16, 64, 1, None, AGG, F16),
    (16, 80, 2, 1, AGG, F32),
    (16, 96, 2, 2, PL, F16),
    (16, 96, 4, 7, AGG, F32),
    (16, 96, 8, 1, AGG, BF16),
    (16, 128, 1, 7, PL, F32),
    (16, 128, 2, 2, AGG, BF16),
    (16, 128, 4, None, AGG, F16),
    (16, 256, 4, 16, PL, BF16),
    (32, 64, 4, 2, PL, F32),
    (32, 80, 1, 7, PL, F16),
    (32, 96, 2, None, AGG, BF16),
    (32, 128, 8, 16, AGG, F16),
    (32, 256, 1, 1, PL, BF16),
    (32, 256, 8, None, PL, F16),
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


def check_decode(lens, block_size, n_kv, group, head_dim, kind, dtype, splits, seed):
    """paged_decode over a NaN-padded pool against the reference, sequence by sequence."""
    p = make_pool(lens, block_size, n_kv, head_dim, dtype, kind, seed, valid_lens=lens)
    gen = torch.Generator(DEVICE).manual_seed(seed)
    q = torch.randn(len(lens), n_kv * group, head_dim, generator=gen, device=DEVICE).to(dtype)
    scale = head_dim**-0.5
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode(q, p.k_cache, p.v_cache, p.block_tables, seq_lens, scale, splits)
    assert out.shape == q.shape and out.dtype == dtype
    for b, n in enumerate(lens):
        k = gather(p.k_cache, p.tables[b], n)
        v = gather(p.v_cache, p.tables[b], n)
        ref = attend(q[b : b + 1], k, v, scale, causal_from=n - 1)[0]
        assert_close_per_row(out[b], ref, dtype)


@pytest.mark.parametrize("block_size,batch,n_kv,group,head_dim,kind,dtype,splits", CASES)
def test_paged_decode_matches_reference(
    block_size, batch, n_kv, group, head_dim, kind, dtype, splits
):
    seed = block_size * 100 + batch * 10 + group
    lens = _seq_lens(batch, block_size, seed)
    check_decode(lens, block_size, n_kv, group, head_dim, kind, dtype, splits, seed)


@pytest.mark.parametrize(
    "block_size,head_dim,group,splits,kind,dtype",
    [pytest.param(*c, marks=GPU) for c in GPU_CASES],
)
def test_paged_decode_cuda_matrix(block_size, head_dim, group, splits, kind, dtype):
    lens = [1, 700, 4100, 33, 2 * block_size + block_size // 2 + 1]
    seed = block_size + head_dim + group
    check_decode(lens, block_size, 2, group, head_dim, kind, dtype, splits, seed)


def test_paged_decode_reads_strided_queries():
    """q may be a slice of a fused projection; the output is the same as for a copy."""
    p = make_pool([20, 37], 16, 2, 64, F32, AGGREGATED, seed=3)
    fused = torch.randn(2, 8, 64, device=DEVICE)
    q = fused[:, 2:6]  # [B, 4, D], token stride 8*64
    seq_lens = torch.tensor([20, 37], dtype=torch.int32, device=DEVICE)
    a = paged_decode(q, p.k_cache, p.v_cache, p.block_tables, seq_lens, 0.125, 2)
    b = paged_decode(q.contiguous(), p.k_cache, p.v_cache, p.block_tables, seq_lens, 0.125, 2)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("splits", [1, 3])
def test_paged_decode_padding_rows_give_zeros(splits):
    """A row of length 0 (a padded batch slot) reads nothing and gets zeros, not NaN."""
    lens = [0, 19, 0, 40]
    p = make_pool([max(n, 1) for n in lens], 16, 2, 64, F32, AGGREGATED, seed=5, valid_lens=lens)
    q = torch.randn(4, 4, 64, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode(q, p.k_cache, p.v_cache, p.block_tables, seq_lens, 0.125, splits)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], out[0])
    for b in (1, 3):
        k, v = gather(p.k_cache, p.tables[b], lens[b]), gather(p.v_cache, p.tables[b], lens[b])
        assert_close_per_row(out[b], attend(q[b : b + 1], k, v, 0.125, lens[b] - 1)[0], F32)


def test_launch_decode_reads_rows_from_an_offset():
    """A planned launch reads its batch from a later row of shared tables, as in a mixed step
    whose prefills come first."""
    lens = [30, 5, 17, 50]
    p = make_pool(lens, 16, 2, 64, F32, AGGREGATED, seed=8)
    q = torch.randn(2, 4, 64, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    plan = plan_decode(p.k_cache, 2, 4, max_seq_len=50, num_splits=2)
    out = torch.empty_like(q)
    launch_decode(plan, q, p.k_cache, p.v_cache, p.block_tables, seq_lens, out, 0.1, 2)
    ref = paged_decode(q, p.k_cache, p.v_cache, p.block_tables[2:], seq_lens[2:], 0.1, 2)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_paged_decode_rejects_bad_input():
    p = make_pool([4], 16, 2, 64, F32, AGGREGATED, seed=0)
    q = torch.randn(1, 4, 64, device=DEVICE)
    lens = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    bt = p.block_tables
    with pytest.raises(ValueError, match="not a multiple"):
        paged_decode(torch.randn(1, 3, 64, device=DEVICE), p.k_cache, p.v_cache, bt, lens, 0.1)
    with pytest.raises(ValueError, match=r"q must be \[B, H, 64\]"):
        paged_decode(torch.randn(1, 4, 32, device=DEVICE), p.k_cache, p.v_cache, bt, lens, 0.1)
    with pytest.raises(ValueError, match="one row per query"):
        paged_decode(q, p.k_cache, p.v_cache, bt, lens.repeat(2), 0.1)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode(q, p.k_cache, p.v_cache, bt, lens, 0.1, MAX_SPLITS + 1)
    with pytest.raises(ValueError, match="scale"):
        paged_decode(q, p.k_cache, p.v_cache, bt, lens, float("nan"))
    with pytest.raises(ValueError, match="contiguous head_dim"):
        kt = p.k_cache.transpose(2, 3)
        paged_decode(q, kt, kt, bt, lens, 0.1)
    with pytest.raises(TypeError, match="unsupported dtype"):
        k64 = p.k_cache.double()
        paged_decode(q.double(), k64, k64, bt, lens, 0.1)


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_decode_tiles_fit_the_shared_memory_budget(head_dim, dtype):
    """Two or more K+V stages of the chosen tile fit SMEM_BUDGET for every head size."""
    t = decode_tiles(head_dim, dtype, torch.device("cuda"))
    stage = 2 * t.block_n * block_d(head_dim) * dtype.itemsize
    assert t.num_stages >= 2 and t.num_stages * stage <= SMEM_BUDGET
    assert t.block_n >= 16


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


@pytest.mark.parametrize("contexts", [pytest.param([32768, 131072, 7], marks=GPU)])
def test_paged_decode_long_contexts(contexts):
    """32k and 128k tokens, with the heuristic's split count and with the most splits."""
    p = make_pool(contexts, 16, 8, 128, BF16, AGGREGATED, seed=11, valid_lens=contexts)
    q = torch.randn(len(contexts), 32, 128, device=DEVICE, dtype=BF16)
    seq_lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    refs = []
    for b, n in enumerate(contexts):
        k, v = gather(p.k_cache, p.tables[b], n), gather(p.v_cache, p.tables[b], n)
        refs.append(attend(q[b : b + 1], k, v, 128**-0.5, causal_from=n - 1)[0])
    for splits in (None, MAX_SPLITS):
        out = paged_decode(q, p.k_cache, p.v_cache, p.block_tables, seq_lens, 128**-0.5, splits)
        for b in range(len(contexts)):
            assert_close_per_row(out[b], refs[b], BF16)


@pytest.mark.parametrize("batch", [pytest.param(300, marks=GPU)])
def test_paged_decode_many_sequences(batch):
    """More decodes than a wave of programs: 300 sequences of random length up to 3k."""
    rng = random.Random(batch)
    lens = [rng.randint(1, 3000) for _ in range(batch)]
    p = make_pool(lens, 16, 8, 128, BF16, AGGREGATED, seed=12, valid_lens=lens)
    q = torch.randn(batch, 32, 128, device=DEVICE, dtype=BF16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode(q, p.k_cache, p.v_cache, p.block_tables, seq_lens, 128**-0.5)
    for b, n in enumerate(lens):
        k, v = gather(p.k_cache, p.tables[b], n), gather(p.v_cache, p.tables[b], n)
        assert_close_per_row(out[b], attend(q[b : b + 1], k, v, 128**-0.5, n - 1)[0], BF16)
