"""The Triton backend against a naive reference and against the torch backend.

Everything runs on the device under test: CUDA when present (the pool in GPU memory), else
the CPU with Triton's interpreter.
"""

from __future__ import annotations

import os
import random

import torch

if not torch.cuda.is_available():  # must precede the first import of triton in the process
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import triton
from helpers import attention_reference, attention_step

from minimemserve.attention import flash_attn_backend
from minimemserve.attention.base import SeqSlice
from minimemserve.attention.torch_backend import TorchAttention
from minimemserve.attention.triton_backend import TritonAttention, is_available
from minimemserve.blocks.layout import AGGREGATED, PER_LAYER, KVLayout

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GPU = (pytest.mark.gpu, pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA"))
_READY = DEVICE.type == "cuda" or (
    is_available() and __import__("triton_kernels").interpreter_ready()
)
pytestmark = pytest.mark.skipif(
    not _READY, reason="triton was imported before TRITON_INTERPRET=1 was set in this process"
)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOL = {F32: (2e-5, 2e-5), F16: (2e-3, 2e-3), BF16: (2e-2, 2e-2)}


# (layout kind, block_size, n_kv, group, head_dim, dtype, contexts, new tokens)
CASES = [
    (AGGREGATED, 16, 2, 2, 64, F32, [0, 19, 3, 40], [21, 5, 1, 1]),
    (PER_LAYER, 1, 1, 4, 64, F16, [7, 0, 12], [3, 1, 1]),
    (AGGREGATED, 32, 2, 1, 128, F16, [33, 0], [1, 1]),
    (PER_LAYER, 16, 4, 2, 64, F32, [0, 16], [40, 9]),
    (AGGREGATED, 16, 1, 2, 80, F32, [5, 17], [12, 1]),
    pytest.param(AGGREGATED, 16, 2, 4, 128, BF16, [0, 45, 7, 300], [70, 33, 1, 1], marks=GPU),
    pytest.param(AGGREGATED, 32, 2, 8, 96, BF16, [130, 0, 64], [2, 129, 1], marks=GPU),
    pytest.param(AGGREGATED, 1, 1, 2, 256, F16, [20, 9, 0], [17, 1, 1], marks=GPU),
]


def _random_qkv(tokens, heads, n_kv, head_dim, dtype, gen):
    q = torch.randn(tokens, heads, head_dim, generator=gen, device=DEVICE).to(dtype)
    k = torch.randn(tokens, n_kv, head_dim, generator=gen, device=DEVICE).to(dtype)
    v = torch.randn(tokens, n_kv, head_dim, generator=gen, device=DEVICE).to(dtype)
    return q, k, v


@pytest.mark.parametrize("kind,bs,n_kv,group,head_dim,dtype,contexts,news", CASES)
def test_triton_backend_mixed_step(kind, bs, n_kv, group, head_dim, dtype, contexts, news):
    layout = KVLayout(3, bs, n_kv, head_dim, kind)
    slices, num_blocks = attention_step(layout, contexts, news, seed=bs + n_kv)
    gen = torch.Generator(DEVICE).manual_seed(bs)
    pool = torch.randn(layout.pool_shape(num_blocks), generator=gen, device=DEVICE).to(dtype)
    heads, tokens, scale = n_kv * group, sum(news), head_dim**-0.5
    q, k, v = _random_qkv(tokens, heads, n_kv, head_dim, dtype, gen)
    ref, ref_pool = attention_reference(pool, layout, 1, slices, q, k, v, scale)

    backend = TritonAttention(pool, layout, heads, scale)
    md = backend.prepare(slices)
    out = backend.forward(q, k, v, 1, md)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(pool, ref_pool, atol=0, rtol=0)  # K/V stored, nothing else


def test_triton_backend_agrees_with_torch_backend():
    layout = KVLayout(2, 16, 2, 64)
    slices, num_blocks = attention_step(layout, [0, 21, 5, 33, 1], [17, 12, 1, 1, 1], seed=4)
    gen = torch.Generator(DEVICE).manual_seed(4)
    pool = torch.randn(layout.pool_shape(num_blocks), generator=gen, device=DEVICE)
    q, k, v = _random_qkv(32, 8, 2, 64, F32, gen)
    pools = [pool.clone(), pool.clone()]
    outs = []
    for cls, p in zip((TorchAttention, TritonAttention), pools):
        backend = cls(p, layout, 8, 0.125)
        md = backend.prepare(slices)
        outs.append(backend.forward(q, k, v, 0, md))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(pools[1], pools[0], atol=0, rtol=0)


def test_one_prepare_serves_every_layer():
    """The step's buffers are reused layer after layer; each layer's result is its own."""
    layout = KVLayout(3, 16, 2, 64)
    slices, num_blocks = attention_step(layout, [0, 30, 12], [20, 1, 1], seed=6)
    gen = torch.Generator(DEVICE).manual_seed(6)
    pool = torch.randn(layout.pool_shape(num_blocks), generator=gen, device=DEVICE)
    shared = TritonAttention(pool.clone(), layout, 4, 0.125)
    md = shared.prepare(slices)
    buffers = set()
    for layer in range(3):
        q, k, v = _random_qkv(22, 4, 2, 64, F32, gen)
        out = shared.forward(q, k, v, layer, md)
        buffers.add(out.data_ptr())
        fresh = TritonAttention(pool.clone(), layout, 4, 0.125)  # a layer reads only itself
        ref = fresh.forward(q, k, v, layer, fresh.prepare(slices))
        torch.testing.assert_close(out, ref, atol=0, rtol=0)
    assert len(buffers) == 1


def test_triton_backend_rejects_bad_construction():
    layout = KVLayout(2, 16, 2, 64)
    pool = torch.zeros(layout.pool_shape(4), device=DEVICE)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        TritonAttention(pool, layout, 3, 0.125)
    with pytest.raises(ValueError, match="does not match"):
        TritonAttention(pool[:, :1], layout, 4, 0.125)
    backend = TritonAttention(pool, layout, 4, 0.125)
    md = backend.prepare([SeqSlice([1], 0, 1)])
    zeros = lambda *shape: torch.zeros(*shape, device=DEVICE)
    with pytest.raises(ValueError, match="layer_id"):
        backend.forward(zeros(1, 4, 64), zeros(1, 2, 64), zeros(1, 2, 64), 2, md)
    with pytest.raises(ValueError, match="q must be"):
        backend.forward(zeros(2, 4, 64), zeros(1, 2, 64), zeros(1, 2, 64), 0, md)


def test_flash_attn_backend_is_detected_at_run_time():
    layout = KVLayout(2, 16, 2, 64)
    pool = torch.zeros(layout.pool_shape(4))
    if flash_attn_backend.is_available():
        pytest.skip("flash_attn is installed here; the CUDA test covers it")
    with pytest.raises((ImportError, ValueError), match="gpu|CUDA"):
        flash_attn_backend.FlashAttnAttention(pool, layout, 4, 0.125)


def _serving_steps(seed: int, block_size: int, rounds: int):
    """Slices of a small serving run: fresh and cached prefills, chunks, growing decodes."""
    rng = random.Random(seed)
    next_block = iter(range(1, 1 << 20))
    live = []  # [blocks, tokens computed]
    steps = []
    for _ in range(rounds):
        slices = []
        for _ in range(rng.randint(0, 2)):
            ctx, new = rng.choice([0, 0, rng.randint(1, 600)]), rng.randint(2, 300)
            blocks = [next(next_block) for _ in range(triton.cdiv(ctx + new, block_size) + 4)]
            slices.append(SeqSlice(blocks, ctx, new))
            live.append([blocks, ctx + new])
        for seq in live[: len(live) - len(slices)]:
            if seq[1] + 1 <= len(seq[0]) * block_size:
                slices.append(SeqSlice(seq[0], seq[1], 1))
                seq[1] += 1
        if slices:
            steps.append(slices)
    return steps, next(next_block)


@pytest.mark.parametrize("dtype", [pytest.param(BF16, marks=GPU), pytest.param(F16, marks=GPU)])
def test_serving_steps_match_the_torch_backend_on_cuda(dtype):
    """Several layers over a run of mixed steps, against the torch backend (and flash-attn
    where it imports), each backend on its own copy of the pool."""
    layout = KVLayout(4, 16, 4, 128)
    steps, num_blocks = _serving_steps(seed=1, block_size=16, rounds=12)
    gen = torch.Generator(DEVICE).manual_seed(1)
    pool = torch.randn(layout.pool_shape(num_blocks), generator=gen, device=DEVICE).to(dtype)
    classes = [TorchAttention, TritonAttention]
    if flash_attn_backend.is_available():
        classes.append(flash_attn_backend.FlashAttnAttention)
    backends = [cls(pool.clone(), layout, 16, 128**-0.5) for cls in classes]
    for slices in steps:
        tokens = sum(s.num_new for s in slices)
        mds = [b.prepare(slices) for b in backends]
        for layer in range(layout.num_layers):
            q, k, v = _random_qkv(tokens, 16, 4, 128, dtype, gen)
            outs = [b.forward(q, k, v, layer, md).float() for b, md in zip(backends, mds)]
            for out in outs[1:]:
                torch.testing.assert_close(out, outs[0], atol=2e-2, rtol=2e-2)
    for b in backends[1:]:
        torch.testing.assert_close(b.kv_pool, backends[0].kv_pool, atol=0, rtol=0)


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
