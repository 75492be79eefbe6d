"""Instances sharing a device: each sizes its KV pool from its own share of the device's total
memory, after its weights and the peak of its largest step, on a faked device (the CPU with
a :class:`~minimemserve.memory.DeviceMemory` that reports a small GPU's numbers)."""

from __future__ import annotations

import pytest
import torch

from minimemserve import memory
from minimemserve.config import EngineConfig, parse_config_name
from minimemserve.engine import Engine, model_bytes, pool_blocks
from minimemserve.errors import ConfigError
from minimemserve.inprocess import InProcessCluster
from minimemserve.model.config import ModelConfig
from minimemserve.parallel import TPShard

MiB = 1 << 20
TINY_STEP_MAX_NUM_BATCHED_TOKENS = 64  # keeps the profiled forward short on the CPU


class FakeGPU:
    """A device of ``total`` bytes whose free memory shrinks as instances take theirs (what
    ``mem_get_info`` would say), and whose profiled step peaks at ``activations`` bytes."""

    def __init__(self, total: int, activations: int = MiB, context: int = 2 * MiB):
        self.total_bytes = total
        self.activations = activations
        self.context_bytes = context
        self.held = 0  # what the instances started so far hold
        self.profiled = 0

    def total(self, device) -> int:
        return self.total_bytes

    def peak_during(self, device, run) -> int:
        run()  # the real forward runs (on the CPU); the device reports its peak
        self.profiled += 1
        return self.activations

    def free(self) -> int:
        return self.total_bytes - self.held


def _start(tiny_llama_dir, gpu: FakeGPU, name: str, instances: int = 2) -> Engine:
    """One instance of ``instances`` placed on the fake device; the device then holds its
    weights, activations, context and pool."""
    cfg = EngineConfig(max_num_batched_tokens=TINY_STEP_MAX_NUM_BATCHED_TOKENS).placed(instances)
    eng = Engine(tiny_llama_dir, engine_config=cfg, instance_id=name)
    kv = eng.pool.kv("hbm")
    weights = model_bytes(eng.model_config, eng.dtype)
    gpu.held += weights + gpu.activations + gpu.context_bytes + kv.numel() * kv.element_size()
    return eng


@pytest.mark.parametrize("order", [("A", "B"), ("B", "A")])
def test_two_instances_on_one_device_get_disjoint_budgets_summing_to_the_share(
    tiny_llama_dir, monkeypatch, order
):
    gpu = FakeGPU(total=64 * MiB)
    monkeypatch.setitem(memory.PROVIDERS, "cpu", gpu)
    free_at_start, engines = {}, {}
    for name in order:
        free_at_start[name] = gpu.free()
        engines[name] = _start(tiny_llama_dir, gpu, name)
    assert gpu.profiled == 2  # each measured its own largest step
    assert free_at_start[order[0]] > free_at_start[order[1]]  # the second saw less free ...
    blocks = {n: e.pool.capacity("hbm") for n, e in engines.items()}
    assert blocks["A"] == blocks["B"]  # ... and got the same pool: its share, not what is free
    eng = engines["A"]
    block_bytes = eng.pool.layout.block_bytes(eng.dtype.itemsize)
    share = memory.DEFAULT_GPU_MEMORY_UTILIZATION / 2
    budget = int(share * gpu.total_bytes)
    weights = model_bytes(eng.model_config, eng.dtype)
    expected = (budget - weights - gpu.activations - gpu.context_bytes) // block_bytes
    assert blocks["A"] == expected > 0
    # each holds at most its budget, within one block of it; the budgets add up to the share
    held = gpu.held / 2
    assert budget - block_bytes < held <= budget
    assert gpu.held <= memory.DEFAULT_GPU_MEMORY_UTILIZATION * gpu.total_bytes
    for e in engines.values():
        e.check_pools()


def test_a_model_that_does_not_fit_names_the_numbers(tiny_llama_dir, monkeypatch):
    weights = model_bytes(ModelConfig.from_hf(tiny_llama_dir), torch.float32)
    gpu = FakeGPU(total=2 * weights)  # 0.45 of it holds less than the weights
    monkeypatch.setitem(memory.PROVIDERS, "cpu", gpu)
    with pytest.raises(ConfigError) as err:
        _start(tiny_llama_dir, gpu, "C0", instances=2)
    text = str(err.value)
    assert f"does not fit: {weights} bytes" in text
    assert f"a share of 0.450 of cpu's {2 * weights} bytes" in text
    assert "one of 2 instance(s) on the device" in text
    assert "leave room for 0 KV blocks" in text


def test_num_blocks_and_kv_memory_bytes_override_the_share(tiny_llama_dir, monkeypatch):
    gpu = FakeGPU(total=MiB // 4)  # too small for the weights: the share is never asked
    monkeypatch.setitem(memory.PROVIDERS, "cpu", gpu)
    eng = Engine(tiny_llama_dir, engine_config=EngineConfig(num_blocks=7).placed(2))
    assert eng.pool.capacity("hbm") == 7
    block_bytes = eng.pool.layout.block_bytes(eng.dtype.itemsize)
    eng = Engine(tiny_llama_dir, engine_config=EngineConfig(kv_memory_bytes=5 * block_bytes))
    assert eng.pool.capacity("hbm") == 5
    assert gpu.profiled == 0


def test_an_explicit_share_is_per_instance(tiny_llama_dir, monkeypatch):
    gpu = FakeGPU(total=64 * MiB)
    monkeypatch.setitem(memory.PROVIDERS, "cpu", gpu)
    cfg = EngineConfig(
        gpu_memory_utilization=0.3, max_num_batched_tokens=TINY_STEP_MAX_NUM_BATCHED_TOKENS
    )
    eng = Engine(tiny_llama_dir, engine_config=cfg.placed(3))
    block_bytes = eng.pool.layout.block_bytes(eng.dtype.itemsize)
    weights = model_bytes(eng.model_config, eng.dtype)
    rest = int(0.3 * gpu.total_bytes) - weights - gpu.activations - gpu.context_bytes
    assert eng.pool.capacity("hbm") == rest // block_bytes


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"gpu_memory_utilization": 0}, "must be in (0, 1]"),
        ({"gpu_memory_utilization": 1.5}, "must be in (0, 1]"),
        ({"gpu_memory_utilization": True}, "must be in (0, 1]"),
        ({"gpu_memory_utilization": 0.6, "instances_on_device": 2}, "adds up to 1.20"),
        ({"instances_on_device": 0}, "instances_on_device must be >= 1"),
        ({"load_format": "pt"}, "load_format must be one of"),
    ],
)
def test_bad_memory_settings_are_named(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("]", r"\]")):
        EngineConfig(**kwargs)


def test_the_default_share_is_split_among_the_instances_placed():
    assert EngineConfig().device_share == memory.DEFAULT_GPU_MEMORY_UTILIZATION
    assert EngineConfig().placed(3).device_share == pytest.approx(0.3)
    assert EngineConfig(gpu_memory_utilization=0.25).placed(2).device_share == 0.25


def test_in_one_process_the_weights_count_once(tiny_llama_dir, monkeypatch):
    gpu = FakeGPU(total=64 * MiB)
    monkeypatch.setitem(memory.PROVIDERS, "cpu", gpu)
    cluster = InProcessCluster(
        tiny_llama_dir,
        parse_config_name("1P1D"),
        engine_config=EngineConfig(max_num_batched_tokens=TINY_STEP_MAX_NUM_BATCHED_TOKENS),
    )
    p0, d0 = (i.engine for i in cluster.instances)
    assert d0.model is p0.model  # one copy of the weights, loaded by the first instance
    block_bytes = p0.pool.layout.block_bytes(p0.dtype.itemsize)
    weights = model_bytes(p0.model_config, p0.dtype)
    extra = d0.pool.capacity("hbm") - p0.pool.capacity("hbm")
    assert extra == pytest.approx(weights / block_bytes, abs=1)
    cluster.check_pools()


def test_a_tensor_parallel_instance_counts_its_shard_of_the_weights(tiny_llama_dir, monkeypatch):
    gpu = FakeGPU(total=64 * MiB)
    monkeypatch.setitem(memory.PROVIDERS, "cpu", gpu)
    cfg = ModelConfig.from_hf(tiny_llama_dir)
    engine = EngineConfig().placed(2)
    cpu = torch.device("cpu")
    whole = pool_blocks(engine, TPShard(0, 1, cfg), cpu, torch.float32)
    half = pool_blocks(engine, TPShard(0, 2, cfg), cpu, torch.float32)
    block_bytes = TPShard(0, 1, cfg).kv_layout(16).block_bytes(4)
    budget = int(0.45 * gpu.total_bytes) - gpu.context_bytes  # no step profiled: no model here
    assert whole == (budget - model_bytes(cfg, torch.float32)) // block_bytes
    assert half == (budget - model_bytes(cfg, torch.float32) // 2) // (block_bytes // 2)
    assert gpu.profiled == 0
