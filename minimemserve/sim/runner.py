"""The simulated cluster's setups and runs (``minimemserve sim``).

:func:`cpu_setup` reproduces the default ``minimemserve bench`` layout on this CPU (tiny
preset, two instances, a fitted step model); :func:`gpu_setup` builds ``gpus / tp``
instances of a model on a hardware profile with the roofline step model. :func:`simulate`
replays sessions under each configuration and returns every turn's record. What compares
and reports them (``run_sim``, ``sweep``), and the roofline's checks, are the lab's
(``minimemserve_lab.compare``, ``minimemserve_lab.roofline``)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from minimemserve.config import EngineConfig
from minimemserve.deployment import DeploymentSpec
from minimemserve.errors import ConfigError
from minimemserve.memory import DEFAULT_CPU_KV_BYTES
from minimemserve.model.config import ModelConfig
from minimemserve.model.tokenizer import Tokenizer
from minimemserve.presets import preset_dir
from minimemserve.scheduler.global_scheduler import Cost
from minimemserve.workloads.sessions import make_workload

from .cluster import Contention, SimCluster, Topology
from .profiles import (
    FittedStepModel,
    HardwareProfile,
    Link,
    RooflineStepModel,
    StepCost,
    load_model_shape,
    with_overhead,
)

# The paper's setup: Llama-2-13B, 8 x H800, tensor parallelism 2.
DEFAULT_MODEL, DEFAULT_HARDWARE, DEFAULT_GPUS, DEFAULT_TP = "llama2-13b", "h800", 8, 2
# The bench's equal-resources layout on the CPU: two instances of one core each.
CPU_INSTANCES = 2
# CPU KV link: the receiver's pool in shared memory, written by the sender (blocking). 16 GB/s
# and the control round trips (probe, alloc, commit, hand-over: ~0.3 ms each on loopback)
# from bench/transfer.py's shared-memory by-request-aggregated row and the RPC tests here.
CPU_LINK = Link(gb_per_s=16.0, latency_us=0.0, sender_blocks=True, setup_us=600.0)
# A GPU instance's batch limits: vLLM's default sequence cap, and a token budget that holds
# a whole Llama-2 prompt in one step (no chunking, as MemServe's vLLM base).
GPU_MAX_NUM_SEQS, GPU_MAX_BATCHED_TOKENS = 256, 4096
GPU_DTYPE = torch.bfloat16


@dataclass
class SimSetup:
    """Everything but the config name that a :class:`SimCluster` is built from: the
    ``deployment`` simulated (its engines' config, its routing policy and cost model; its
    configuration name is each cluster's), the hardware (step model, topology, blocks, dtype,
    instances) and how KV moves."""

    model_config: ModelConfig
    step_model: Any  # FittedStepModel or RooflineStepModel
    topology: Topology
    deployment: DeploymentSpec
    num_blocks: int
    dtype: torch.dtype
    instances: int
    transfer_mode: str = "by_request_aggregated"
    tokenizer_dir: Path = field(default_factory=lambda: Path(preset_dir("tiny")))
    describe: dict = field(default_factory=dict)

    @property
    def engine_config(self) -> EngineConfig:
        """Every simulated instance's engine config."""
        return self.deployment.engine

    @property
    def cost(self) -> Cost | None:
        """The routing cost model (None: prompt tokens)."""
        return self.deployment.cost_model

    def with_deployment(self, **changes: Any) -> SimSetup:
        """This setup with the deployment's fields ``changes`` (``policy``, ``engine``...)."""
        return replace(self, deployment=replace(self.deployment, **changes))

    def cluster(self, config: str) -> SimCluster:
        """A fresh simulated cluster of ``config``."""
        d = self.deployment
        return SimCluster(
            config,
            model_config=self.model_config,
            step_time=self.step_model.step_time,
            decode_times=self.step_model.decode_times,
            topology=self.topology,
            spec=d,
            num_blocks=self.num_blocks,
            dtype=self.dtype,
            instances=self.instances,
            transfer_mode=self.transfer_mode,
        )


def with_costs(
    setup: SimSetup,
    step_ms: float | None = None,
    prefill_speed: float = 1.0,
    decode_speed: float = 1.0,
) -> SimSetup:
    """``setup`` (a GPU one) with its roofline's fixed cost per step set to ``step_ms``
    milliseconds (None: the hardware profile's ``step_overhead_ms``) and its prefill and
    decode work ``prefill_speed`` and ``decode_speed`` times as fast
    (:class:`~minimemserve.sim.profiles.RooflineStepModel`); the routing cost model prices
    steps by the same roofline, as one fitted on that hardware would."""
    roof = setup.step_model
    hw = roof.hw if step_ms is None else replace(roof.hw, step_overhead_ms=float(step_ms))
    step_model = RooflineStepModel(
        hw, roof.shape, roof.tp, roof.dtype_bytes, prefill_speed, decode_speed
    )
    costs = {"step_ms": hw.step_overhead_ms, "prefill_speed": prefill_speed}
    costs["decode_speed"] = decode_speed
    cost = setup.cost
    if isinstance(cost, StepCost):
        cost = StepCost(step_model, cost.link, cost.kv_bytes_per_token, cost.block_size)
    setup = setup.with_deployment(cost_model=cost)
    return replace(setup, step_model=step_model, describe={**setup.describe, **costs})


def cpu_setup(
    step_model: FittedStepModel,
    model_dir: str | Path | None = None,
    policy: str = "prompt_tree",
    runtime_overhead_s: tuple[float, float] = (0.0, 0.0),
    contention: Contention | float = 1.0,
    scheduler: str = "chunked",
    prefill_scale: float = 1.0,
    handoff: str = "overlap",
) -> SimSetup:
    """The default ``minimemserve bench`` layout: tiny preset (or ``model_dir``), fp32, the
    bench's engine options, two one-core instances, the token-count routing cost; each step
    costs ``runtime_overhead_s`` = (per step, per sequence) more than ``step_model`` says (the
    process runtime's alone on the machine, measured by ``bench/sim_validate.py``), a step that
    starts while the other instance computes longer by ``contention`` (a :class:`Contention`
    by the kinds of the two steps, or one factor), and every step with prefill work
    ``prefill_scale`` times as long as the fit says (all measured there too)."""
    mdir = Path(model_dir or preset_dir("tiny"))
    step_model = with_overhead(step_model, *runtime_overhead_s)
    step_model = replace(step_model, prefill_scale=prefill_scale)
    mc = ModelConfig.from_hf(mdir)
    cfg = EngineConfig(scheduler=scheduler, handoff=handoff)
    block_bytes = 2 * mc.num_hidden_layers * cfg.block_size * mc.num_key_value_heads * mc.head_dim
    blocks = DEFAULT_CPU_KV_BYTES // (block_bytes * torch.float32.itemsize)
    topo = Topology(
        CPU_LINK,
        CPU_LINK,
        calls_wait_for_steps=True,
        contention=contention,
    )
    describe = {
        "kind": "cpu",
        "model_dir": str(mdir),
        "step_model": asdict(step_model),
        "runtime_overhead_s": runtime_overhead_s,
        "contention": asdict(topo.contention),
        "prefill_scale": prefill_scale,
        "instances": CPU_INSTANCES,
        "scheduler": scheduler,
        "handoff": handoff,
    }
    return SimSetup(
        mc,
        step_model,
        topo,
        DeploymentSpec(model=mdir, engine=cfg, policy=policy),
        blocks,
        torch.float32,
        CPU_INSTANCES,
        tokenizer_dir=mdir,
        describe=describe,
    )


def gpu_setup(
    model: str,
    hardware: str,
    gpus: int,
    tp: int,
    policy: str = "prompt_tree",
    transfer_mode: str = "by_request_aggregated",
    max_num_seqs: int = GPU_MAX_NUM_SEQS,
    max_batched_tokens: int = GPU_MAX_BATCHED_TOKENS,
    scheduler: str = "chunked",
    handoff: str = "overlap",
) -> SimSetup:
    """``gpus // tp`` instances of ``model`` on ``hardware`` with the roofline step model."""
    if not isinstance(gpus, int) or gpus < 1 or gpus % tp:
        raise ConfigError(f"--gpus must be a positive multiple of --tp {tp}, got {gpus}")
    hw, mc = HardwareProfile.load(hardware), load_model_shape(model)
    roof = RooflineStepModel(hw, mc, tp, GPU_DTYPE.itemsize)
    cfg = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched_tokens,
        scheduler=scheduler,
        # layers streamed during the step that computes them need no later hand-off
        handoff="inline" if transfer_mode == "by_layer" else handoff,
    )
    blocks = roof.kv_blocks(cfg.block_size)
    nvlink = hw.links["nvlink"]
    topo = Topology(nvlink, hw.link(False), tp, int(hw.gpus_per_node))
    cost = StepCost(roof, nvlink, roof.kv_bytes_per_token // tp, cfg.block_size)
    describe = {
        "kind": "gpu",
        "model": model,
        "hardware": hw.name,
        "gpus": gpus,
        "tp": tp,
        "kv_blocks_per_instance": blocks,
        "weights_gb": roof.weight_bytes / 1e9,
        "scheduler": scheduler,
        "handoff": cfg.handoff,
    }
    return SimSetup(
        mc,
        roof,
        topo,
        DeploymentSpec(engine=cfg, policy=policy, cost_model=cost),
        blocks,
        GPU_DTYPE,
        gpus // tp,
        transfer_mode,
        describe=describe,
    )


def workload_sessions(
    setup: SimSetup, workload: str, n: int, seed: int, max_turns, max_out, max_context
) -> list:
    """``n`` sessions of ``workload`` in ``setup``'s tokens, within the model's context."""
    context = min(max_context or math.inf, setup.model_config.max_position_embeddings)
    tok = Tokenizer.from_dir(setup.tokenizer_dir)
    return make_workload(
        workload, tok, n, int(context), seed, max_turns=max_turns, max_output_tokens=max_out
    )


def role_stats(cluster: SimCluster, counters: dict[str, tuple] | None = None) -> dict[str, dict]:
    """Per role of ``cluster``'s instances: how many, their seconds in steps, and their
    decode rows with the row-weighted mean decode batch and KV length (what a bound on a
    layout's gain is computed from, ``minimemserve_lab.bound``); from ``counters`` by
    instance name (``SimInstance.counters``; default: each instance's own so far)."""
    out: dict[str, dict] = {}
    for inst in cluster.instances:
        busy, _, rows, b, c = counters[inst.name] if counters else inst.counters()
        r = out.setdefault(
            inst.role.value, dict.fromkeys(("instances", "busy_s", "rows", "b", "c"), 0)
        )
        r["instances"] += 1
        r["busy_s"] += busy
        r["rows"] += rows
        r["b"] += b
        r["c"] += c
    return {
        role: {
            "instances": r["instances"],
            "busy_s": r["busy_s"],
            "decode_rows": r["rows"],
            "decode_batch": r["b"] / r["rows"] if r["rows"] else 0.0,
            "decode_context": r["c"] / r["rows"] if r["rows"] else 0.0,
        }
        for role, r in out.items()
    }


def window_stats(cluster: SimCluster) -> dict | None:
    """The work between the two marks of a replay's ``window`` (``SimCluster.marks``): its
    seconds, the share of busy time in steps with prefill work, and :func:`role_stats` over
    it; None without two marks."""
    if len(cluster.marks) != 2:
        return None
    (t0, a), (t1, b) = cluster.marks
    diff = {name: tuple(y - x for x, y in zip(a[name], b[name])) for name in a}
    busy = sum(d[0] for d in diff.values())
    return {
        "seconds": t1 - t0,
        "prefill_share": sum(d[1] for d in diff.values()) / busy if busy else 0.0,
        "roles": role_stats(cluster, diff),
    }


def simulate(
    setup: SimSetup,
    configs: Sequence[str],
    sessions,
    rate: float,
    seed: int,
    progress: bool = True,
    arrivals: str = "closed",
    stop_unstable: bool = False,
    window: tuple[int, int] | None = None,
) -> tuple[dict, dict]:
    """Replay ``sessions`` under each config (``arrivals``, ``stop_unstable`` and ``window``:
    ``SimCluster.replay``'s); ``(records by config, run stats by config)``, the stats saying
    whether the run ``stopped`` at its window's end and, with a ``window``, the work within it
    (:func:`window_stats`). Every instance's pool is audited after each run."""
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ConfigError(f"rate must be a finite number > 0, got {rate!r}")
    records, stats = {}, {}
    for config in configs:
        cluster = setup.cluster(config)
        t0 = time.perf_counter()
        records[config] = cluster.replay(
            sessions,
            rate,
            seed,
            config,
            progress,
            arrivals=arrivals,
            stop_unstable=stop_unstable,
            window=window,
        )
        wall = time.perf_counter() - t0
        cluster.check_pools()
        ends = [r["arrival"] + (r["jct"] or 0.0) for r in records[config]]
        if cluster.stopped:
            ends.append(cluster.now)
        front = cluster.frontend
        stats[config] = {
            "wall_s": wall,
            "simulated_s": max(ends, default=0.0),
            "stopped": cluster.stopped,
            "steps": cluster.steps,
            "run_steps": cluster.run_steps,
            "steps_per_s": cluster.steps / wall if wall else None,
            "transfers": cluster.net.transfers,
            "prefix_pushes": cluster.scheduler.num_transfers,
            "prefill_share": cluster.prefill_busy_s / cluster.busy_s if cluster.busy_s else 0.0,
            "decode_stall_s": cluster.decode_stall_s / max(len(records[config]), 1),
            "instances": [f"{i.name}:{i.role}" for i in cluster.instances],
            "route_us_mean": 1e6 * front.route_wall_s / max(front.route_calls, 1),
            "dispatches": dict(cluster.scheduler.dispatches),
            "roles": role_stats(cluster),
            "window": window_stats(cluster),
        }
    return records, stats
