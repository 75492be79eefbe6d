"""Command-line options shared by ``minimemserve bench``, ``sim``, ``serve`` and ``generate``:
each group is added by one function, so the commands spell an option one way.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from minimemserve.config import HANDOFF_MODES, LOAD_FORMATS, EngineConfig
from minimemserve.deployment import (
    DTYPES,
    KV_LOAD_FAILURE_POLICIES,
    PLACEMENTS,
    RUNTIMES,
    DeploymentSpec,
)
from minimemserve.links import transport_names
from minimemserve.memory import DEFAULT_GPU_MEMORY_UTILIZATION
from minimemserve.scheduler.cost_model import CostModel
from minimemserve.scheduler.global_scheduler import ROUTING_POLICIES
from minimemserve.scheduler.local import STEP_POLICIES
from minimemserve.workloads.results import (
    DEFAULT_CONFIGS,
    DEFAULT_RATE,
    DEFAULT_SESSIONS,
    DEFAULT_WORKLOAD,
)
from minimemserve.workloads.sessions import WORKLOADS
from minimemserve.workloads.trace import parse_window

# Where the commands write their JSON and plots unless ``--out`` says otherwise (relative to
# the working directory).
DEFAULT_OUT_DIR = "bench/results"
# EngineConfig field -> (its option, help, choices): the commands take these from it.
ENGINE_FLAGS = {
    "block_size": ("--block-size", "tokens per KV block", None),
    "num_blocks": ("--num-blocks", "KV blocks per instance (default: as memory allows)", None),
    "dram_blocks": ("--dram-blocks", "host-memory KV blocks per instance, below hbm", None),
    "disk_blocks": (
        "--disk-blocks",
        "local-disk KV blocks per instance, below dram (with --disk-dir)",
        None,
    ),
    "disk_dir": (
        "--disk-dir",
        "directory of the disk tier's block files (a subdirectory per instance, kept across "
        "restarts)",
        None,
    ),
    "gpu_memory_utilization": (
        "--gpu-memory-utilization",
        "share of its GPU's memory each instance holds (weights, activations, KV); default: "
        f"{DEFAULT_GPU_MEMORY_UTILIZATION} split evenly among the instances on a GPU",
        None,
    ),
    "load_format": (
        "--load-format",
        "dummy: random weights of config.json's shapes, nothing read (a *-dummy preset sets it)",
        list(LOAD_FORMATS),
    ),
    "max_num_seqs": ("--max-num-seqs", "requests running at once per instance", None),
    "max_model_len": ("--max-model-len", "prompt plus output cap (default: the model's)", None),
    "attention": ("--attention", "attention backend", ["torch", "triton", "flash-attn"]),
    "tensor_parallel_size": ("--tensor-parallel-size", "ranks per instance", None),
    "decode_tensor_parallel_size": (
        "--decode-tensor-parallel-size",
        "ranks per decode instance (default: --tensor-parallel-size)",
        None,
    ),
    "handoff": (
        "--handoff",
        "when a prefill instance hands a request off: while its next step computes "
        "(overlap), or inside the step that prefilled it (inline)",
        list(HANDOFF_MODES),
    ),
    "collective_timeout_s": (
        "--collective-timeout",
        "seconds rank 0 waits for the other ranks in one collective before the instance "
        "fails (tensor parallelism)",
        None,
    ),
}
# DeploymentSpec field -> (its option, help, choices): the commands take these from it,
# typed and defaulted from the field (a command may give its own default).
DEPLOYMENT_FLAGS = {
    "model": (
        "--model",
        "HF Llama checkpoint dir or a preset's name, e.g. llama-2-7b-dummy (default: tiny)",
        None,
    ),
    "config": ("--config", "PD, PD-CC, 1P1D, 1P1D-CC, xPyD[-CC...]", None),
    "device": ("--device", "torch device of every instance", None),
    "dtype": ("--dtype", "weights and KV dtype", DTYPES),
    "runtime": (
        "--runtime",
        "one process per instance, every instance in this one, or one Ray actor per instance",
        RUNTIMES,
    ),
    "policy": ("--policy", "global scheduler policy", ROUTING_POLICIES),
    "cost_model": (
        "--cost-model",
        "JSON of a fitted cost model (bench/cost_model.py writes one) for the global "
        "scheduler (default: cost counted in new tokens)",
        None,
    ),
    "num_colocated": ("--num-colocated", "instances of a PD/PD-CC config", None),
    "cores_per_instance": (
        "--cores-per-instance",
        "CPU cores each instance process may use (process runtime; default: one)",
        None,
    ),
    "transport": (
        "--transport",
        "KV transport between instances of the process runtime (auto: shared memory within "
        "a host; between hosts NIXL when both sides have an agent, else gloo, NCCL on CUDA)",
        transport_names(),
    ),
    "cluster_host": (
        "--cluster-host",
        "address the control plane binds; instances on other hosts must reach it",
        None,
    ),
    "instances": (
        "--instances",
        "HOST:PORT,... of `minimemserve instance` processes to join instead of spawning "
        "(their roles make the deployment; needs --key)",
        None,
    ),
    "key": ("--key", "cluster key file (minimemserve keygen)", None),
    "ray_address": (
        "--ray-address",
        "Ray cluster of the ray runtime (empty: RAY_ADDRESS, else a local one started here)",
        None,
    ),
    "placement": (
        "--placement",
        "ray runtime: instances on as few nodes as possible (pack) or on as many (spread)",
        PLACEMENTS,
    ),
    "max_restarts": (
        "--max-restarts",
        "ray runtime: times Ray restarts a dead instance's actor, which then rejoins",
        None,
    ),
    "kv_load_failure_policy": (
        "--kv-load-failure-policy",
        "process and ray runtimes: a request whose instance died before its KV reached the "
        "next one is computed again elsewhere (recompute) or ends with an error (fail)",
        KV_LOAD_FAILURE_POLICIES,
    ),
}
# Tensor parallelism (instances in one process: ``bench --runtime inline``, ``serve --runtime
# inprocess``, ``generate``).
PARALLEL_FLAGS = ("tensor_parallel_size", "decode_tensor_parallel_size")


def add_workload_arguments(
    p: argparse.ArgumentParser, rate: float | None = DEFAULT_RATE
) -> argparse.ArgumentParser:
    """The options ``minimemserve bench`` and ``minimemserve sim`` share: configs, workload,
    sessions, rate, turns and lengths, seed, output folder, routing policy, progress.
    ``rate`` is ``--rate``'s default; None: the command probes what the machine sustains."""
    p.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help="comma-separated configurations (default: %(default)s)",
    )
    p.add_argument("--workload", choices=WORKLOADS, default=DEFAULT_WORKLOAD)
    p.add_argument(
        "--sessions",
        type=int,
        default=None,
        help="sessions (ShareGPT conversations, LooGLE documents, ReAct questions; default "
        f"{DEFAULT_SESSIONS}; sim --paper sizes its own runs)",
    )
    probed = "a share of what the slowest configuration sustains, probed first"
    p.add_argument(
        "--rate",
        type=float,
        default=rate,
        help=f"session arrivals per second (default: {probed if rate is None else rate})",
    )
    p.add_argument(
        "--max-turns",
        type=int,
        default=None,
        help="turns per ShareGPT session (default 6), questions per LooGLE "
        "document (8) or steps per ReAct question (7)",
    )
    p.add_argument(
        "--max-output-tokens",
        type=int,
        default=None,
        help="cap on output tokens per turn (defaults: sharegpt 48, loogle 32, react 100)",
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="cap on prompt + output per request (default: the model's context)",
    )
    p.add_argument("--out", default=DEFAULT_OUT_DIR, help="where JSON and plots go")
    p.add_argument("--seed", type=int, default=0)
    add_deployment_arguments(p, ("policy",))
    p.add_argument(
        "--scheduler",
        choices=STEP_POLICIES,
        default=None,
        help="local step policy: chunked prefill beside decodes (the default), or "
        "prefill_first (whole prompts in steps of their own, vLLM 0.4.0's; the default of "
        "sim --paper)",
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_trace_arguments(p)
    return p


def add_trace_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of a production trace (Mooncake's JSONL format) as the workload."""
    p.add_argument(
        "--trace",
        default=None,
        help="replay this trace file (Mooncake's JSONL: timestamp, input_length, "
        "output_length, hash_ids) instead of --workload; 'mooncake' is the shared "
        "conversation trace",
    )
    p.add_argument(
        "--trace-window",
        type=parse_window,
        default=(0, None),
        help="--trace: its requests START:STOP (or the first N; default: all)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="--trace: arrival times are multiplied by this (0.5 replays twice as fast)",
    )
    p.add_argument(
        "--length-scale",
        type=int,
        default=1,
        help="--trace: every length is divided by this (a divisor of 512, e.g. 32 for the "
        "tiny model on a CPU)",
    )
    return p


def trace_path(args: argparse.Namespace) -> str | None:
    """The trace file ``--trace`` names (None: the shared conversation trace)."""
    return None if args.trace == "mooncake" else args.trace


def add_engine_arguments(
    p: argparse.ArgumentParser, names: Sequence[str]
) -> argparse.ArgumentParser:
    """One option per named :class:`EngineConfig` field, typed and defaulted from the field:
    ``block_size`` is ``--block-size`` (see :data:`ENGINE_FLAGS`); :func:`engine_options`
    reads them back."""
    defaults = EngineConfig()
    kinds = {f.name: f.type for f in dataclasses.fields(EngineConfig)}
    for name in names:
        flag, help_text, choices = ENGINE_FLAGS[name]
        kind = int if "int" in kinds[name] else float if "float" in kinds[name] else str
        default = getattr(defaults, name)
        p.add_argument(flag, dest=name, type=kind, default=default, help=help_text, choices=choices)
    return p


def engine_options(args: argparse.Namespace, names: Sequence[str]) -> dict:
    """The :class:`EngineConfig` fields ``names`` as parsed (``add_engine_arguments``)."""
    return {name: getattr(args, name) for name in names}


def add_deployment_arguments(
    p: argparse.ArgumentParser, names: Sequence[str], **defaults: object
) -> argparse.ArgumentParser:
    """One option per named :class:`DeploymentSpec` field (see :data:`DEPLOYMENT_FLAGS`),
    typed and defaulted from the field unless ``defaults`` names another default;
    :func:`deployment_options` reads them back."""
    spec = DeploymentSpec()
    kinds = {f.name: f.type for f in dataclasses.fields(DeploymentSpec)}
    for name in names:
        flag, help_text, choices = DEPLOYMENT_FLAGS[name]
        default = defaults.get(name, getattr(spec, name))
        kind = int if kinds[name].startswith("int") else str
        if name == "instances":  # a tuple of addresses, given comma-separated
            default = ",".join(default) or None
        p.add_argument(
            flag,
            dest=name,
            type=kind,
            default=default,
            choices=choices,
            help=f"{help_text} (default: %(default)s)",
        )
    return p


def deployment_options(
    args: argparse.Namespace, names: Sequence[str], engine: EngineConfig, **fixed: object
) -> DeploymentSpec:
    """The :class:`DeploymentSpec` of the fields ``names`` as parsed
    (:func:`add_deployment_arguments`), every instance with ``engine``, and ``fixed``."""
    values = {name: getattr(args, name) for name in names}
    if "instances" in values:
        values["instances"] = tuple(a for a in (values["instances"] or "").split(",") if a)
    if values.get("cost_model") is not None:
        values["cost_model"] = CostModel.load(values["cost_model"])
    return DeploymentSpec(engine=engine, **values | fixed)


# ``minimemserve bench``'s DeploymentSpec fields (policy is a workload option, shared with
# ``sim``) and EngineConfig fields (seed and scheduler are workload options too). Its options
# are here, not beside the harness, so the command line builds ``bench -h`` without importing
# the lab (``minimemserve_lab.harness.driver`` runs it).
BENCH_FIELDS = ("model", "device", "dtype", "policy", "transport", "cost_model")
BENCH_ENGINE_FLAGS = (
    "num_blocks",
    "dram_blocks",
    "disk_blocks",
    "disk_dir",
    "gpu_memory_utilization",
    "load_format",
    "handoff",
    *PARALLEL_FLAGS,
)
BENCH_DESCRIPTION = (
    "Replay a multi-turn workload under several configurations and compare TTFT, JCT and "
    "TPOT (mean and P99)."
)


def add_bench_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the options of ``minimemserve bench`` to ``p``; returns ``p``."""
    add_workload_arguments(p, rate=None)
    add_deployment_arguments(p, ("model", "device", "dtype"))
    add_engine_arguments(p, BENCH_ENGINE_FLAGS)
    p.add_argument(
        "--runtime",
        choices=("process", "hosts", "ray", "inline"),
        default="process",
        help="process: every instance its own process on one core (colocated configs run "
        "two instances, xPyD ones x+y), the equal-resources comparison; hosts: the same, as "
        "`minimemserve instance` processes a frontend joins (the multi-host runtime on this "
        "machine); ray: the same instances as Ray actors on the cluster at --ray-address (else a "
        "local one); inline: one process, instances stepped in turn (default: %(default)s)",
    )
    add_deployment_arguments(p, ("transport", "cost_model", "ray_address", "placement"))
    p.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="replay over the OpenAI API of a running `minimemserve serve` at URL (streaming; "
        "TTFT is the first chunk), shown as NAME (default: its URL); repeat to compare "
        "servers of different configs; replaces --configs",
    )
    return p
