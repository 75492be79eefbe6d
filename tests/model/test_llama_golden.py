"""Golden check: our model over the paged pool against transformers' LlamaForCausalLM."""

from __future__ import annotations

import pytest
import torch
from helpers import our_model

from minimemserve.attention.base import SeqSlice
from minimemserve.attention.torch_backend import TorchAttention
from minimemserve.blocks.layout import KVLayout
from minimemserve.model.llama import LlamaModel

ATOL = 1e-4  # fp32, max abs difference of logits
DECODE_STEPS = 64

CASES = [  # (kv heads, block size, rope scaling); 4 heads in all, so kv=4 is MHA
    pytest.param(4, 16, None, id="mha-bs16"),
    pytest.param(2, 1, None, id="gqa-bs1"),
    pytest.param(1, 32, None, id="gqa4-bs32"),
    pytest.param(2, 16, {"rope_type": "linear", "factor": 2.0}, id="gqa-bs16-linear"),
    pytest.param(4, 32, {"rope_type": "linear", "factor": 4.0}, id="mha-bs32-linear"),
]


@pytest.mark.parametrize("kv_heads,block_size,rope", CASES)
def test_prefill_and_paged_decode_logits_match_hf(
    tiny_llama_factory, hf_model_from_dir, kv_heads, block_size, rope
):
    model_dir = tiny_llama_factory(num_key_value_heads=kv_heads, rope_scaling=rope)
    hf = hf_model_from_dir(model_dir)
    cfg, model = our_model(model_dir)
    assert isinstance(model, LlamaModel)
    g = torch.Generator().manual_seed(kv_heads * 100 + block_size)
    prompt = torch.randint(3, cfg.vocab_size, (37,), generator=g)
    with torch.no_grad():
        full = hf.generate(
            prompt[None], max_new_tokens=DECODE_STEPS, min_new_tokens=DECODE_STEPS, do_sample=False
        )[0]
        ref = hf(full[None]).logits[0]  # [S, V]

    layout = KVLayout(cfg.num_hidden_layers, block_size, cfg.num_key_value_heads, cfg.head_dim)
    nblocks = layout.num_blocks_for(len(full))
    pool = torch.zeros(layout.pool_shape(nblocks + 7))
    table = torch.randperm(nblocks + 7, generator=g)[:nblocks].tolist()  # non-contiguous blocks
    backend = TorchAttention(pool, layout, cfg.num_attention_heads, cfg.head_dim**-0.5)
    got = []
    with torch.no_grad():
        md = backend.prepare([SeqSlice(table, 0, len(prompt))])
        got.append(model.compute_logits(model(prompt, backend, md)))
        for pos in range(len(prompt), len(full) - 1):
            md = backend.prepare([SeqSlice(table, pos, 1)])
            got.append(model.compute_logits(model(full[pos : pos + 1], backend, md)))
    got = torch.cat(got)  # [S-1, V]
    err = (got - ref[:-1]).abs().max().item()
    assert err < ATOL, f"max abs logit error {err:.2e}"
    assert torch.equal(got[len(prompt) - 1 :].argmax(-1), full[len(prompt) :])
