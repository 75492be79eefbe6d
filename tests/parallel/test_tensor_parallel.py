"""Tensor parallelism: the sharding arithmetic, and greedy tokens at TP 2 equal to TP 1 (fp32,
CPU, gloo) on multi-turn sessions, with the pool audited; a dead rank fails its requests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import listening

from minimemserve import LLM, SamplingParams
from minimemserve.attention.base import SeqSlice
from minimemserve.config import EngineConfig
from minimemserve.disagg.runtime import ProcessCluster
from minimemserve.engine import Engine
from minimemserve.errors import ConfigError, InstanceDied
from minimemserve.model.config import ModelConfig
from minimemserve.model.loader import load_weights
from minimemserve.parallel import TPShard, decode_step, encode_step, shard_weights

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6)
# 4-token blocks and a 24-token step budget: prompts are prefilled in chunks over a cached
# prefix, beside running decodes, so every attention path of the backend runs sharded
ENGINE = dict(num_blocks=96, block_size=4, max_num_batched_tokens=24)
DEATH_BUDGET_S = 30.0  # a request on an instance whose rank died must end well before this
STOPPED_DEADLINE_S = 4.0  # the collective timeout of the stopped-rank test (60 s by default)


def _multi_turn(llm: LLM, turns: int = 2) -> list[list[int]]:
    """Greedy tokens of three sessions; each turn's prompt is the previous prompt, its output
    and a few new tokens."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (7 + 9 * i,), generator=g).tolist() for i in range(3)]
    out = []
    for t in range(turns):
        res = llm.generate(prompts, GREEDY)
        out += [r.token_ids for r in res]
        prompts = [p + r.token_ids + [5 + t, 7, 11] for p, r in zip(prompts, res)]
    return out


def _cfg(**overrides) -> ModelConfig:
    base = dict(vocab_size=10, hidden_size=16, intermediate_size=12, num_hidden_layers=1)
    return ModelConfig(**(base | dict(num_attention_heads=4, num_key_value_heads=2) | overrides))


@pytest.mark.parametrize(
    "size,kv,expect",
    [
        (2, 2, [(0, 1), (1, 1)]),  # one KV head each
        (4, 2, [(0, 1), (0, 1), (1, 1), (1, 1)]),  # fewer KV heads than ranks: replicated
        (2, 4, [(0, 2), (2, 2)]),  # MHA
    ],
)
def test_kv_heads_split_or_replicated(size, kv, expect):
    cfg = _cfg(num_key_value_heads=kv)
    shards = [TPShard(r, size, cfg) for r in range(size)]
    assert [(s.kv_start, s.kv_heads) for s in shards] == expect
    for s in shards:  # the query heads of a rank all read one of its KV heads
        group = cfg.num_queries_per_kv
        first, last = s.rank * s.heads, (s.rank + 1) * s.heads - 1
        assert s.kv_start <= first // group <= last // group < s.kv_start + s.kv_heads


@pytest.mark.parametrize(
    "size,overrides,match",
    [
        (3, {}, "must divide the attention heads"),
        (2, dict(num_attention_heads=6, num_key_value_heads=3, head_dim=4), "divide one another"),
        (0, {}, ">= 1"),
    ],
)
def test_bad_tensor_parallel_size_is_a_config_error(size, overrides, match):
    with pytest.raises(ConfigError, match=match):
        TPShard(0, size, _cfg(**overrides))


def test_engine_config_validates_tensor_parallel_size():
    with pytest.raises(ConfigError, match=">= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="must be an int"):
        EngineConfig(tensor_parallel_size="2")
    assert EngineConfig(tensor_parallel_size=2).tensor_parallel_size == 2


def test_engine_refuses_tensor_parallel_heads_it_cannot_split(tiny_llama_dir):
    with pytest.raises(ConfigError, match="must divide the attention heads"):
        Engine(tiny_llama_dir, engine_config=EngineConfig(tensor_parallel_size=3, num_blocks=8))
    cfg = EngineConfig(tensor_parallel_size=2, decode_tensor_parallel_size=1)
    assert (cfg.tp_size("prefill"), cfg.tp_size("decode"), cfg.tp_size("colocated")) == (2, 1, 2)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_shards_reassemble_the_weights(tiny_llama_factory, kv_heads):
    path = tiny_llama_factory(num_key_value_heads=kv_heads, vocab_size=515)  # padded vocab
    cfg = ModelConfig.from_hf(path)
    full = load_weights(path, cfg)
    parts = [shard_weights(full, TPShard(r, 2, cfg)) for r in range(2)]
    p = "model.layers.1."
    for name, dim in [
        ("self_attn.q_proj", 0),
        ("mlp.gate_proj", 0),
        ("self_attn.o_proj", 1),
        ("mlp.down_proj", 1),
    ]:
        key = f"{p}{name}.weight"
        assert torch.equal(torch.cat([s[key] for s in parts], dim), full[key])
    k = f"{p}self_attn.k_proj.weight"
    if kv_heads == 1:  # replicated: every rank holds the one head
        assert all(torch.equal(s[k], full[k]) for s in parts)
    else:
        assert torch.equal(torch.cat([s[k] for s in parts]), full[k])
    emb = torch.cat([s["model.embed_tokens.weight"] for s in parts])
    assert emb.shape[0] == 516 and torch.equal(emb[:515], full["model.embed_tokens.weight"])
    assert not emb[515:].any()
    assert torch.equal(parts[1]["model.norm.weight"], full["model.norm.weight"])


def test_step_message_round_trips():
    slices = [SeqSlice([4, 9, 2], 5, 6), SeqSlice([7], 2, 1), SeqSlice([1, 3], 4, 1)]
    ids, rows = list(range(100, 108)), [5, 6, 7]
    assert decode_step(encode_step(slices, ids, rows)) == (slices, ids, rows)


@pytest.mark.parametrize("config", ["PD", "PD-CC"])
@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv2-split", "kv1-replicated"])
def test_tp2_greedy_tokens_equal_tp1(tiny_llama_factory, config, kv_heads):
    path = tiny_llama_factory(num_key_value_heads=kv_heads)
    expected = _multi_turn(LLM(path, config=config, **ENGINE))
    with LLM(path, config=config, tensor_parallel_size=2, **ENGINE) as llm:
        assert _multi_turn(llm) == expected
        llm.engine.check_pools()  # rank 0's pool decides for every rank: balanced, idle
        counters = llm.pool.stats()["counters"]
        if config == "PD-CC":  # the second turn reuses the first turn's KV on every rank
            assert counters["hit_tokens"] > 0
        procs = llm.engine.instances[0].engine.tp.procs
        assert all(p.is_alive() for p in procs)
    assert not any(p.is_alive() for p in procs)  # close() stopped the workers


def test_dead_rank_fails_requests_without_hanging(tiny_llama_dir):
    with LLM(tiny_llama_dir, config="PD-CC", tensor_parallel_size=2, **ENGINE) as llm:
        llm.generate([[5, 6, 7, 8, 9]], GREEDY)
        (worker,) = llm.engine.instances[0].engine.tp.procs
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(DEATH_BUDGET_S)
        start = time.monotonic()
        outs = llm.generate([[5, 6, 7, 8, 9, 10], [3, 4]], GREEDY)
        assert time.monotonic() - start < DEATH_BUDGET_S
        assert [o.finish_reason for o in outs] == ["error", "error"]
        assert all("tensor-parallel rank 1" in o.error for o in outs)
        llm.engine.check_pools()  # nothing leaked on the surviving rank
        with pytest.raises(InstanceDied, match="rank 1"):
            llm.engine.instances[0].engine.runner.group.step([], [], []).__enter__()


def test_stopped_rank_fails_requests_within_the_deadline(tiny_llama_dir):
    """A rank that stops answering (SIGSTOP: as a slow or cut-off one) is killed once it
    misses a collective's deadline, and its instance fails as when the rank dies."""
    with LLM(
        tiny_llama_dir,
        config="PD-CC",
        tensor_parallel_size=2,
        collective_timeout_s=STOPPED_DEADLINE_S,
        **ENGINE,
    ) as llm:
        llm.generate([[5, 6, 7, 8, 9]], GREEDY)
        (worker,) = llm.engine.instances[0].engine.tp.procs
        os.kill(worker.pid, signal.SIGSTOP)
        start = time.monotonic()
        outs = llm.generate([[5, 6, 7, 8, 9, 10], [3, 4]], GREEDY)
        assert time.monotonic() - start < 2 * STOPPED_DEADLINE_S
        assert [o.finish_reason for o in outs] == ["error", "error"]
        assert all("InstanceDied" in o.error and "Timed out" in o.error for o in outs)
        assert worker.exitcode == -signal.SIGKILL  # killed and reaped, not left stopped
        llm.engine.check_pools()  # nothing leaked on rank 0
        with pytest.raises(InstanceDied):
            llm.engine.instances[0].engine.runner.group.step([], [], []).__enter__()


def test_collective_timeout_is_validated():
    for bad in (0, -1.0, float("nan"), float("inf"), True, "60"):
        with pytest.raises(ConfigError, match="collective_timeout_s"):
            EngineConfig(collective_timeout_s=bad)


@pytest.mark.parametrize("config", ["1P1D", "1P1D-CC"])
@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2), (2, 2)], ids=["P2-D1", "P1-D2", "P2-D2"])
def test_heterogeneous_disaggregation_keeps_greedy_tokens(tiny_llama_dir, config, p_tp, d_tp):
    expected = _multi_turn(LLM(tiny_llama_dir, config="PD", **ENGINE))
    with LLM(
        tiny_llama_dir,
        config=config,
        tensor_parallel_size=p_tp,
        decode_tensor_parallel_size=d_tp,
        **ENGINE,
    ) as llm:
        assert _multi_turn(llm) == expected
        llm.engine.check_pools()
        if p_tp > 1:  # P's second rank sent its heads
            assert llm.pools[0].moved[("sent", 1, "pieces")] > 0
        if d_tp > 1:  # D's second rank received its heads
            assert llm.pools[1].moved[("received", 1, "pieces")] > 0


def _piece_bytes(cfg: ModelConfig, blocks: int, heads: int) -> int:
    """Bytes of ``blocks`` pieces of ``heads`` KV heads (fp32, every layer, K and V)."""
    return blocks * cfg.num_hidden_layers * 2 * ENGINE["block_size"] * heads * cfg.head_dim * 4


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv2-split", "kv1-replicated"])
def test_transfer_moves_each_head_slice_between_its_ranks(tiny_llama_factory, kv_heads):
    path = tiny_llama_factory(num_key_value_heads=kv_heads)
    cfg = ModelConfig.from_hf(path)
    prompt = list(range(10, 31))  # 21 tokens: 6 blocks of 4
    two = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2)  # decoded on D
    with (
        LLM(
            path, config="1P1D", tensor_parallel_size=2, decode_tensor_parallel_size=1, **ENGINE
        ) as p2,
        LLM(
            path, config="1P1D", tensor_parallel_size=1, decode_tensor_parallel_size=2, **ENGINE
        ) as d2,
    ):
        for llm in (p2, d2):
            llm.generate([prompt], two)
        per_rank = _piece_bytes(cfg, 6, 1)  # one KV head per rank (split or replicated)
        sent, received = p2.pools[0].moved, d2.pools[1].moved
        if kv_heads == 2:  # each rank sends its own head
            assert dict(sent) == {
                ("sent", r, k): v for r in (0, 1) for k, v in (("pieces", 6), ("bytes", per_rank))
            }
        else:  # the one head is sent once, by the first rank holding it
            assert dict(sent) == {("sent", 0, "pieces"): 6, ("sent", 0, "bytes"): per_rank}
        # every rank receives the heads it holds (a replicated head goes to both)
        assert dict(received) == {
            ("received", r, k): v for r in (0, 1) for k, v in (("pieces", 6), ("bytes", per_rank))
        }
        whole = _piece_bytes(cfg, 6, kv_heads)
        assert p2.pools[0].stats()["counters"]["sent_bytes"] == whole
        assert d2.pools[1].stats()["counters"]["recv_bytes"] == whole


def test_caching_transfer_sends_only_missing_blocks_across_sizes(tiny_llama_dir):
    prompt = list(range(10, 31))  # 21 tokens: 6 blocks of 4
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)
    with LLM(
        tiny_llama_dir,
        config="1P1D-CC",
        tensor_parallel_size=2,
        decode_tensor_parallel_size=1,
        **ENGINE,
    ) as llm:
        out = llm.generate([prompt], params)[0].token_ids
        sent = llm.pools[0].moved[("sent", 1, "pieces")]
        assert sent == 6
        back = llm.pools[0].moved[("received", 1, "pieces")]
        assert back > 0  # CC3 sent decode-phase KV back into both of P's ranks
        turn2 = prompt + out + [3, 4, 5, 6, 7]  # 30 tokens: 8 blocks, D caches the first 6
        llm.generate([turn2], params)
        assert 0 < llm.pools[0].moved[("sent", 1, "pieces")] - sent < 8


_RANK0 = """
import sys, time
from minimemserve.config import EngineConfig
from minimemserve.disagg.runtime import ProcessCluster
from minimemserve.engine import Engine
engine = Engine(sys.argv[1], engine_config=EngineConfig(tensor_parallel_size=2, num_blocks=8))
print(engine.tp.procs[0].pid, flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_workers_exit_when_rank_0_is_killed(tiny_llama_dir):
    rank0 = subprocess.Popen(
        [sys.executable, "-c", _RANK0, str(tiny_llama_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        worker = int(rank0.stdout.readline())
        assert _running(worker)
    finally:
        rank0.kill()
        rank0.wait()
    deadline = time.monotonic() + DEATH_BUDGET_S
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(worker)


def test_every_socket_of_the_group_listens_on_loopback_only(tiny_llama_dir):
    before = listening(os.getpid())
    engine = Engine(
        tiny_llama_dir, engine_config=EngineConfig(tensor_parallel_size=2, num_blocks=8)
    )
    try:
        rank0 = listening(os.getpid()) - before
        (worker,) = engine.tp.procs
        assert ("127.0.0.1", engine.tp.store.port) in rank0  # the store
        assert {addr for addr, _ in rank0 | listening(worker.pid)} == {"127.0.0.1"}
    finally:
        engine.tp.close()


def test_process_cluster_refuses_tensor_parallel_instances(tiny_llama_dir):
    with pytest.raises(ConfigError, match="in-process"):
        ProcessCluster.of(
            tiny_llama_dir, "1P1D", engine=EngineConfig(decode_tensor_parallel_size=2)
        )


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["PD-CC", "1P1D-CC"])
def test_nccl_ranks_on_one_gpu_equal_tp1(tiny_llama_dir, config):
    """Two ranks on one CUDA device (NCCL compute group): the same greedy tokens as TP 1."""
    kw = dict(ENGINE, device="cuda")
    expected = _multi_turn(LLM(tiny_llama_dir, config=config, **kw))
    with LLM(tiny_llama_dir, config=config, tensor_parallel_size=2, **kw) as llm:
        assert _multi_turn(llm) == expected
        llm.engine.check_pools()


def _offload_and_return(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt in turn, the first again last: by then its cached KV sits in dram."""
    return [llm.generate([p], GREEDY)[0].token_ids for p in [*prompts, prompts[0]]]


def test_dram_tier_offloads_and_onloads_every_rank(tiny_llama_dir):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (30,), generator=g).tolist() for _ in range(4)]
    tiers = dict(num_blocks=16, dram_blocks=64, block_size=4, max_num_batched_tokens=24)
    expected = _offload_and_return(LLM(tiny_llama_dir, config="PD-CC", **tiers), prompts)
    with LLM(tiny_llama_dir, config="PD-CC", tensor_parallel_size=2, **tiers) as llm:
        assert _offload_and_return(llm, prompts) == expected
        c = llm.pool.stats()["counters"]
        assert c["offloaded_blocks"] > 0 and c["onloaded_blocks"] > 0  # every rank moved its shard
        llm.engine.check_pools()


def test_cached_kv_in_dram_is_sent_from_every_rank_in_one_copy(tiny_llama_dir):
    """A TP 2 pool sends a prefix cached in its dram tier to a TP 1 pool: each rank reads its
    heads from its own dram shard, nothing is onloaded first, and the receiver's next request
    over that prefix gives the tokens it would have computed itself."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (30,), generator=g).tolist() for _ in range(4)]
    tiers = dict(num_blocks=16, dram_blocks=64, block_size=4, max_num_batched_tokens=24)
    reference = LLM(tiny_llama_dir, config="PD-CC", **tiers)
    expected = reference.generate([prompts[0]], GREEDY)[0].token_ids
    receiver = LLM(tiny_llama_dir, config="PD-CC", **tiers)
    with LLM(tiny_llama_dir, config="PD-CC", tensor_parallel_size=2, **tiers) as sender:
        for p in prompts:
            sender.generate([p], GREEDY)  # the first prompt's KV ends up in dram
        before = sender.pool.stats()["counters"]
        got = sender.pool.send_cached(receiver.pool, prompts[0])
        after = sender.pool.stats()["counters"]
        assert got and after["dram_sent_blocks"] - before["dram_sent_blocks"] > 0
        assert after["onloaded_blocks"] == before["onloaded_blocks"]
        assert sender.pool.moved[("sent", 1, "pieces")] > 0  # rank 1's heads, from rank 1
        receiver.pool.free_mem(got)
        sender.engine.check_pools()
    out = receiver.generate([prompts[0]], GREEDY)[0]
    assert out.metrics.cached_tokens > 0 and out.token_ids == expected
    receiver.engine.check_pools()
