"""The Triton backend against a naive reference and against the torch backend."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the first import of triton in the process
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from helpers import attention_reference, attention_step

from minimemserve.attention import flash_attn_backend
from minimemserve.attention.base import SeqSlice
from minimemserve.attention.triton_backend import TritonAttention, is_available
from minimemserve.blocks.layout import AGGREGATED, PER_LAYER, KVLayout

_CPU_READY = torch.cuda.is_available() or (
    is_available() and __import__("triton_kernels").interpreter_ready()
)
pytestmark = pytest.mark.skipif(
    not _CPU_READY,
    reason="triton was imported before TRITON_INTERPRET=1 was set in this process",
)

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3)}


# (layout kind, block_size, n_kv, group, head_dim, dtype, contexts, new tokens)
CASES = [
    (AGGREGATED, 16, 2, 2, 64, torch.float32, [0, 19, 3, 40], [21, 5, 1, 1]),
    (PER_LAYER, 1, 1, 4, 64, torch.float16, [7, 0, 12], [3, 1, 1]),
    (AGGREGATED, 32, 2, 1, 128, torch.float16, [33, 0], [1, 1]),
    (PER_LAYER, 16, 4, 2, 64, torch.float32, [0, 16], [40, 9]),
]


@pytest.mark.parametrize("kind,bs,n_kv,group,head_dim,dtype,contexts,news", CASES)
def test_triton_backend_mixed_step(kind, bs, n_kv, group, head_dim, dtype, contexts, news):
    layout = KVLayout(3, bs, n_kv, head_dim, kind)
    slices, num_blocks = attention_step(layout, contexts, news, seed=bs + n_kv)
    gen = torch.Generator().manual_seed(bs)
    pool = torch.randn(layout.pool_shape(num_blocks), generator=gen).to(dtype)
    heads, tokens, scale = n_kv * group, sum(news), head_dim**-0.5
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, n_kv, head_dim, generator=gen).to(dtype)
    v = torch.randn(tokens, n_kv, head_dim, generator=gen).to(dtype)
    ref, ref_pool = attention_reference(pool, layout, 1, slices, q, k, v, scale)

    backend = TritonAttention(pool, layout, heads, scale)
    md = backend.prepare(slices)
    out = backend.forward(q, k, v, 1, md)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(pool, ref_pool, atol=0, rtol=0)  # K/V stored, nothing else


def test_triton_backend_agrees_with_torch_backend():
    from minimemserve.attention.torch_backend import TorchAttention

    layout = KVLayout(2, 16, 2, 64)
    slices, num_blocks = attention_step(layout, [0, 21, 5, 33, 1], [17, 12, 1, 1, 1], seed=4)
    gen = torch.Generator().manual_seed(4)
    pool = torch.randn(layout.pool_shape(num_blocks), generator=gen)
    q = torch.randn(32, 8, 64, generator=gen)
    k, v = torch.randn(2, 32, 2, 64, generator=gen)
    pools = [pool.clone(), pool.clone()]
    outs = []
    for cls, p in zip((TorchAttention, TritonAttention), pools):
        backend = cls(p, layout, 8, 0.125)
        md = backend.prepare(slices)
        outs.append(backend.forward(q, k, v, 0, md))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(pools[1], pools[0], atol=0, rtol=0)


def test_triton_backend_rejects_bad_construction():
    layout = KVLayout(2, 16, 2, 64)
    pool = torch.zeros(layout.pool_shape(4))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        TritonAttention(pool, layout, 3, 0.125)
    with pytest.raises(ValueError, match="does not match"):
        TritonAttention(pool[:, :1], layout, 4, 0.125)
    backend = TritonAttention(pool, layout, 4, 0.125)
    md = backend.prepare([SeqSlice([1], 0, 1)])
    with pytest.raises(ValueError, match="layer_id"):
        backend.forward(torch.zeros(1, 4, 64), torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), 2, md)


def test_flash_attn_backend_is_detected_at_run_time():
    layout = KVLayout(2, 16, 2, 64)
    pool = torch.zeros(layout.pool_shape(4))
    if flash_attn_backend.is_available():
        pytest.skip("flash_attn is installed here; the CUDA test covers it")
    with pytest.raises((ImportError, ValueError), match="gpu|CUDA"):
        flash_attn_backend.FlashAttnAttention(pool, layout, 4, 0.125)


@pytest.mark.gpu
@pytest.mark.skipif(not flash_attn_backend.is_available(), reason="needs flash_attn and CUDA")
def test_flash_attn_backend_matches_triton_on_fresh_prefills():
    layout = KVLayout(2, 16, 2, 64)
    slices, num_blocks = attention_step(layout, [0, 0], [37, 20], seed=5)
    pool = torch.randn(layout.pool_shape(num_blocks), device="cuda", dtype=torch.bfloat16)
    q = torch.randn(57, 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, 57, 2, 64, device="cuda", dtype=torch.bfloat16)
    outs = []
    for cls in (TritonAttention, flash_attn_backend.FlashAttnAttention):
        backend = cls(pool.clone(), layout, 8, 0.125)
        outs.append(backend.forward(q, k, v, 1, backend.prepare(slices)))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)
