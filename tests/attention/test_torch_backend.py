"""The torch backend against a naive per-token softmax, prefixes and GQA included."""

from __future__ import annotations

import pytest
import torch
from helpers import attention_reference, attention_step

from minimemserve.attention.torch_backend import TorchAttention
from minimemserve.blocks.layout import AGGREGATED, PER_LAYER, KVLayout

# (layout kind, block_size, n_kv, group, dtype, cached contexts, new tokens)
CASES = [
    (AGGREGATED, 16, 2, 2, torch.float32, [0, 19, 3, 40], [21, 5, 1, 1]),
    (AGGREGATED, 4, 1, 4, torch.float32, [37, 8], [29, 64]),  # long prefix and long chunk
    (PER_LAYER, 16, 4, 2, torch.float32, [0, 16], [40, 9]),
    (AGGREGATED, 16, 2, 1, torch.float16, [21, 0], [13, 1]),
]


@pytest.mark.parametrize("kind,bs,n_kv,group,dtype,contexts,news", CASES)
def test_torch_backend_matches_the_reference(kind, bs, n_kv, group, dtype, contexts, news):
    layout = KVLayout(2, bs, n_kv, 32, kind)
    slices, num_blocks = attention_step(layout, contexts, news, seed=bs + group)
    gen = torch.Generator().manual_seed(group)
    pool = torch.randn(layout.pool_shape(num_blocks), generator=gen).to(dtype)
    heads, tokens, scale = n_kv * group, sum(news), 32**-0.5
    q = torch.randn(tokens, heads, 32, generator=gen).to(dtype)
    k = torch.randn(tokens, n_kv, 32, generator=gen).to(dtype)
    v = torch.randn(tokens, n_kv, 32, generator=gen).to(dtype)
    ref, ref_pool = attention_reference(pool, layout, 1, slices, q, k, v, scale)
    backend = TorchAttention(pool, layout, heads, scale)
    out = backend.forward(q, k, v, 1, backend.prepare(slices))
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(pool, ref_pool, atol=0, rtol=0)
