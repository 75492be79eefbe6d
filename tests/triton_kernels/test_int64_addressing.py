"""Block offsets past the int32 range must be computed in int64.

A 7B-model block is 8 MiB, so ``block_id * stride_block`` passes 2**31 elements after a
few hundred blocks. These views have a block stride just over 2**30 elements, so block 4
starts past 2**32 elements. The storage really spans that far, but only as reserved virtual
memory: ``torch.empty`` leaves untouched pages unmapped, and only block 0's and block 4's
pages get written. With int32 offsets ``4 * stride`` wraps to a small in-bounds offset
inside the zero-filled gap after block 0, so a kernel that overflowed would read zeros
(or, for ``store_kv``, write there) and the comparisons below would fail.
"""

from __future__ import annotations

import pytest
import torch
from kernel_reference import TOLERANCES, attend

from triton_kernels import paged_decode, prefix_prefill, rope_store_kv, store_kv

BLOCK_SIZE, N_KV, HEAD_DIM = 16, 1, 64
BLOCK_ELEMS = BLOCK_SIZE * N_KV * HEAD_DIM
STRIDE = 2**30 + 4 * BLOCK_ELEMS  # < 2**31, so Triton passes it as an int32 argument
FAR = 4  # FAR * STRIDE >= 2**32: wraps to 16 * BLOCK_ELEMS under int32
V_OFFSET = 2 * BLOCK_ELEMS  # V views start inside the same reserved storage


@pytest.fixture(scope="module")
def far_views():
    dtype = torch.float16
    numel = FAR * STRIDE + V_OFFSET + BLOCK_ELEMS
    assert FAR * STRIDE >= 2**32 and STRIDE < 2**31
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        storage = torch.empty(numel, dtype=dtype, device=device)  # ~8 GiB, mostly unmapped
    except (RuntimeError, MemoryError) as e:
        pytest.skip(f"cannot reserve {numel * 2 / 2**30:.1f} GiB of virtual memory: {e}")
    wrapped = (FAR * STRIDE) % 2**32
    storage[: wrapped + V_OFFSET + BLOCK_ELEMS].zero_()  # block 0 and the wrap target
    shape = (FAR + 1, BLOCK_SIZE, N_KV, HEAD_DIM)
    strides = (STRIDE, N_KV * HEAD_DIM, HEAD_DIM, 1)
    k_cache = storage.as_strided(shape, strides, 0)
    v_cache = storage.as_strided(shape, strides, V_OFFSET)
    gen = torch.Generator().manual_seed(0)
    k_cache[FAR].copy_(torch.randn(BLOCK_SIZE, N_KV, HEAD_DIM, generator=gen))
    v_cache[FAR].copy_(torch.randn(BLOCK_SIZE, N_KV, HEAD_DIM, generator=gen))
    yield k_cache, v_cache
    del storage


def test_decode_reads_a_block_past_int32(far_views):
    k_cache, v_cache = far_views
    dev = k_cache.device
    q = torch.randn(1, 2, HEAD_DIM, dtype=k_cache.dtype, device=dev)
    table = torch.tensor([[FAR]], dtype=torch.int32, device=dev)
    lens = torch.tensor([BLOCK_SIZE], dtype=torch.int32, device=dev)
    out = paged_decode(q, k_cache, v_cache, table, lens, HEAD_DIM**-0.5, num_splits=2)
    ref = attend(q.cpu(), k_cache[FAR].cpu(), v_cache[FAR].cpu(), HEAD_DIM**-0.5, BLOCK_SIZE)
    atol, rtol = TOLERANCES[k_cache.dtype]
    torch.testing.assert_close(out.float().cpu(), ref, atol=atol, rtol=rtol)


def test_prefill_reads_a_prefix_block_past_int32(far_views):
    k_cache, v_cache = far_views
    dev, dtype = k_cache.device, k_cache.dtype
    ctx, new = 10, 3
    q = torch.randn(new, 2, HEAD_DIM, dtype=dtype, device=dev)
    k = torch.randn(new, N_KV, HEAD_DIM, dtype=dtype, device=dev)
    v = torch.randn(new, N_KV, HEAD_DIM, dtype=dtype, device=dev)
    table = torch.tensor([[FAR]], dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, new], dtype=torch.int32, device=dev)
    ctx_t = torch.tensor([ctx], dtype=torch.int32, device=dev)
    out = prefix_prefill(q, k, v, k_cache, v_cache, table, qsl, ctx_t, HEAD_DIM**-0.5)
    keys = torch.cat([k_cache[FAR, :ctx], k]).cpu()
    vals = torch.cat([v_cache[FAR, :ctx], v]).cpu()
    ref = attend(q.cpu(), keys, vals, HEAD_DIM**-0.5, causal_from=ctx)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float().cpu(), ref, atol=atol, rtol=rtol)


def test_store_writes_a_block_past_int32(far_views):
    k_cache, v_cache = far_views
    dev, dtype = k_cache.device, k_cache.dtype
    k = torch.randn(2, N_KV, HEAD_DIM, dtype=dtype, device=dev)
    v = torch.randn(2, N_KV, HEAD_DIM, dtype=dtype, device=dev)
    keep_k, keep_v = k_cache[FAR, 12:14].clone(), v_cache[FAR, 12:14].clone()
    slots = torch.tensor([FAR * BLOCK_SIZE + 12, FAR * BLOCK_SIZE + 13], device=dev)
    store_kv(k_cache, v_cache, k, v, slots)
    try:
        torch.testing.assert_close(k_cache[FAR, 12:14], k, atol=0, rtol=0)
        torch.testing.assert_close(v_cache[FAR, 12:14], v, atol=0, rtol=0)
    finally:  # the module's other tests read block FAR
        k_cache[FAR, 12:14] = keep_k
        v_cache[FAR, 12:14] = keep_v


def test_rope_store_writes_a_block_past_int32(far_views):
    """The fused rotary + store addresses the cache like store_kv (zero angle: no rotation)."""
    k_cache, v_cache = far_views
    dev, dtype = k_cache.device, k_cache.dtype
    q = torch.randn(2, N_KV, HEAD_DIM, dtype=dtype, device=dev)
    k = torch.randn(2, N_KV, HEAD_DIM, dtype=dtype, device=dev)
    v = torch.randn(2, N_KV, HEAD_DIM, dtype=dtype, device=dev)
    cos, sin = torch.ones(1, HEAD_DIM, device=dev), torch.zeros(1, HEAD_DIM, device=dev)
    keep_k, keep_v = k_cache[FAR, 12:14].clone(), v_cache[FAR, 12:14].clone()
    slots = torch.tensor([FAR * BLOCK_SIZE + 12, FAR * BLOCK_SIZE + 13], device=dev)
    positions = torch.zeros(2, dtype=torch.int64, device=dev)
    rope_store_kv(q, k, v, cos, sin, positions, slots, k_cache, v_cache)
    try:
        torch.testing.assert_close(k_cache[FAR, 12:14], k, atol=0, rtol=0)
        torch.testing.assert_close(v_cache[FAR, 12:14], v, atol=0, rtol=0)
    finally:  # the module's other tests read block FAR
        k_cache[FAR, 12:14] = keep_k
        v_cache[FAR, 12:14] = keep_v
