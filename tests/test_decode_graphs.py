"""Decode graphs: buckets, the static buffers and padding, and the same greedy tokens with
and without them.

Off CUDA nothing is captured: ``DecodeGraphs(..., capture=False)`` runs the eager forward on
the static buffers in place of a replay, so the padding rows, the packed upload and the
per-bucket launch plans are checked here (Triton's interpreter); the ``gpu`` tests replay
real graphs."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_pool_clean, hf_greedy

from minimemserve.attention.base import SeqSlice
from minimemserve.config import EngineConfig
from minimemserve.decode_graphs import (
    GRAPH_BATCHES,
    DecodeGraphs,
    StaticInputs,
    graph_buckets,
    graph_memory_bytes,
)
from minimemserve.engine import Engine
from minimemserve.model.config import ModelConfig
from minimemserve.sampling import SamplingParams

CUDA = torch.cuda.is_available()
GREEDY = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
PROMPT_LENGTHS = [3, 17, 9, 30, 1]  # five requests: decode batches of 5, then fewer


def test_buckets_grow_by_8_then_16_and_stop_at_the_cap():
    assert GRAPH_BATCHES[:11] == (1, 2, 4, *range(8, 65, 8))
    assert GRAPH_BATCHES[11:] == tuple(range(80, 257, 16))
    assert graph_buckets(6) == (1, 2, 4, 6)
    assert graph_buckets(64)[-2:] == (56, 64)
    assert graph_buckets(1000) == GRAPH_BATCHES
    with pytest.raises(ValueError, match="max_batch"):
        graph_buckets(0)


def test_static_inputs_pack_every_field_and_upload_a_prefix():
    h = StaticInputs.allocate(6, 5, "cpu", pin=False)
    assert h.slots.tolist() == [-1] * 6  # padding until a step fills a row
    assert h.query_start_loc.tolist() == list(range(7))
    h.block_tables[:] = torch.arange(30, dtype=torch.int32).view(6, 5)
    for rows in (1, 4, 6):
        size = h.upload_size(rows)
        copy = torch.zeros_like(h.packed)
        copy[:size] = h.packed[:size]
        table = copy[3 * 6 :].view(torch.int32)[h.table_end :][: 6 * 5].view(6, 5)
        assert torch.equal(table[:rows], h.block_tables[:rows])  # every row the step reads
    assert h.upload_size(6) <= h.packed.numel()
    for t in (h.seq_lens, h.block_tables):  # 16-byte aligned int32 fields
        assert (t.data_ptr() - h.packed.data_ptr()) % 16 == 0


def test_graph_memory_estimate_grows_with_the_batch():
    cfg = ModelConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
    )
    small = graph_memory_bytes(cfg, 1, 4096, 16, 2)
    big = graph_memory_bytes(cfg, 256, 4096, 16, 2)
    assert small < big < 2 << 30  # a few hundred MiB at batch 256 for 7B


def _engine(model_dir, **overrides) -> Engine:
    cfg = EngineConfig(**(dict(num_blocks=64, max_num_seqs=6, attention="triton") | overrides))
    return Engine(model_dir, engine_config=cfg)


def _generate(engine: Engine, prompts) -> list[list[int]]:
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    assert_pool_clean(engine.pool)
    return [outs[i].token_ids for i in ids]


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _stand_in(engine: Engine) -> list[int]:
    """Give ``engine`` decode graphs run eagerly (no capture); returns the list of buckets
    the steps it served ran at."""
    runner = engine.runner
    graphs = DecodeGraphs(runner.model, runner.backend, 6, engine.max_model_len, capture=False)
    used, run = [], graphs.run

    def counted(slices, ids):
        logits = run(slices, ids)
        if logits is not None:
            used.append(graphs.bucket(len(slices)))
        return logits

    graphs.run = counted
    runner.graphs = graphs
    return used


@pytest.mark.skipif(CUDA, reason="the CPU form; the gpu tests replay real graphs")
def test_padded_buckets_give_the_eager_tokens_and_hf_s(tiny_llama_factory, hf_model_from_dir):
    """Five requests decoding through buckets 1-6 (3 rows padded to 4, 5 to 6): the same
    greedy tokens as the eager Triton path, the torch path and HF."""
    model_dir = tiny_llama_factory()
    prompts = _prompts(512)
    eager = _generate(_engine(model_dir), prompts)
    torch_path = _generate(_engine(model_dir, attention="torch"), prompts)
    graphed = _engine(model_dir)
    used = _stand_in(graphed)
    tokens = _generate(graphed, prompts)
    assert tokens == eager == torch_path
    assert tokens == hf_greedy(hf_model_from_dir(model_dir), prompts, GREEDY.max_tokens)
    assert 6 in used and any(b not in PROMPT_LENGTHS for b in used), used


@pytest.mark.skipif(CUDA, reason="the CPU form")
def test_padding_rows_write_no_kv(tiny_llama_factory):
    """A step of 3 decodes in bucket 4: only the 3 new tokens' slots change in the pool."""
    engine = _engine(tiny_llama_factory())
    runner = engine.runner
    graphs = DecodeGraphs(runner.model, runner.backend, 6, engine.max_model_len, capture=False)
    pool = engine.pool.kv("hbm")  # [N, L, 2, bs, KV, D]
    before = pool.clone()
    slices = [SeqSlice([5], 3, 1), SeqSlice([9, 2], 16, 1), SeqSlice([7], 0, 1)]
    logits = graphs.run(slices, [11, 12, 13])
    assert logits.shape == (3, 512) and torch.isfinite(logits).all()
    diff = (pool != before).permute(0, 3, 1, 2, 4, 5).flatten(2)  # [N, bs, everything else]
    changed = diff.any(-1).nonzero().tolist()  # (block, slot) pairs
    assert sorted(map(tuple, changed)) == [(2, 0), (5, 3), (7, 0)]
    assert graphs.run([SeqSlice([1], 0, 2)], [1, 2]) is None  # a prefill runs eagerly
    assert graphs.run([SeqSlice([1], 0, 1)] * 7, [1] * 7) is None  # beyond the largest bucket


def test_eager_is_the_only_mode_off_cuda_and_enforce_eager_is_checked(tiny_llama_factory):
    engine = _engine(tiny_llama_factory())
    assert engine.runner.graphs is None  # nothing to capture on the CPU
    with pytest.raises(Exception, match="enforce_eager must be a bool"):
        EngineConfig(enforce_eager="yes")


GPU = (pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_graphs_give_the_eager_tokens_on_cuda(tiny_llama_factory, dtype):
    """Captured graphs against ``enforce_eager``: identical greedy tokens, and the graphs
    served the decode steps (buckets 1-6)."""
    model_dir = tiny_llama_factory()
    prompts = _prompts(512)
    cfg = dict(num_blocks=64, max_num_seqs=6, attention="triton")
    eager = Engine(
        model_dir, device="cuda", dtype=dtype, engine_config=EngineConfig(enforce_eager=True, **cfg)
    )
    assert eager.runner.graphs is None
    graphed = Engine(model_dir, device="cuda", dtype=dtype, engine_config=EngineConfig(**cfg))
    graphs = graphed.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 6]
    replays, run = [], graphs.run
    graphs.run = lambda s, i: (replays.append(len(s)), run(s, i))[1]
    assert _generate(graphed, prompts) == _generate(eager, prompts)
    assert replays and graphs.memory_bytes >= 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_a_replayed_graph_equals_its_eager_forward(tiny_llama_factory):
    """The captured graph of bucket 4 and the same padded step run eagerly over the same
    buffers: bit-identical logits (same kernels, same launch plans)."""
    cfg = EngineConfig(num_blocks=64, max_num_seqs=6, attention="triton")
    engine = Engine(tiny_llama_factory(), device="cuda", dtype="bfloat16", engine_config=cfg)
    runner = engine.runner
    eager = DecodeGraphs(runner.model, runner.backend, 6, engine.max_model_len, capture=False)
    slices = [SeqSlice([5], 3, 1), SeqSlice([9, 2], 16, 1), SeqSlice([7], 0, 1)]
    with torch.inference_mode():
        replayed = runner.graphs.run(slices, [11, 12, 13]).clone()
        assert torch.equal(replayed, eager.run(slices, [11, 12, 13]))
