"""One deployment, as data: what to serve (the model, the configuration, every instance's
engine settings) and how to run it (in this process, or one process per instance behind the
global scheduler), and the one way to build its :class:`~minimemserve.serving.Serving`
(:meth:`DeploymentSpec.build`). ``LLM``, the command line, the server and the benchmark build
deployments from it; the commands' options are generated from its fields
(``minimemserve.options``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from .config import DEFAULT_TIMEOUT_S, LOOPBACK, Deployment, EngineConfig, parse_config_name
from .errors import ConfigError
from .inprocess import InProcessCluster
from .links import AUTO, transport_names
from .presets import PRESETS, preset_dir, preset_model
from .recipes import Role
from .scheduler.global_scheduler import DEFAULT_TTL_S, MOVES_PREFIXES, ROUTING_POLICIES, Cost
from .serving import Serving

# How a deployment's instances run: all in this process, one process each, or one Ray actor each.
RUNTIMES = ("inprocess", "process", "ray")
# The dtypes the commands offer (the engine takes any torch floating dtype).
DTYPES = ("float32", "float16", "bfloat16")
# What happens to a request whose instance died before its KV reached the next one (vLLM's
# ``kv_load_failure_policy``): computed again on another instance, or ended with an error.
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
# How the Ray runtime spreads the deployment's instances over nodes: as few as possible, or as
# many (``disagg.placement`` plans it).
PLACEMENTS = ("pack", "spread")
# How long Ray gets to reserve an instance's bundles (resources counted free may be taken).
DEFAULT_PLACEMENT_TIMEOUT_S = 60.0
# How the process runtime starts its instance processes (multiprocessing's start methods).
START_METHODS = ("spawn", "forkserver")
# Loading a checkpoint and importing torch takes seconds per process; two minutes means stuck.
DEFAULT_STARTUP_TIMEOUT_S = 120.0
# An instance's heartbeat period, and the silence after which the frontend declares it dead:
# heartbeats come from a thread, so only a stopped, wedged or cut-off process is this quiet.
DEFAULT_HEARTBEAT_S = 0.5
DEFAULT_HEARTBEAT_TIMEOUT_S = 20.0
# Integer fields and their range [low, high).
BOUNDS = (
    ("num_colocated", 1, math.inf),
    ("cores_per_instance", 1, math.inf),
    ("base_port", 0, 65536),
    ("max_restarts", 0, math.inf),
)
# Durations, in seconds, that must be positive.
DURATIONS = (
    "timeout_s",
    "startup_timeout_s",
    "heartbeat_s",
    "heartbeat_timeout_s",
    "placement_timeout_s",
)


@dataclass(frozen=True)
class DeploymentSpec:
    """A deployment: configuration ``config`` (``PD``, ``PD-CC``, ``1P1D``, ``1P1D-CC1/2/3``,
    ``xPyD``...) of the checkpoint ``model`` (a directory or a preset's name, such as
    ``llama-2-7b-dummy``, whose load format it sets; None: the tiny preset) on ``device`` in
    ``dtype``, every instance with ``engine``; run by ``runtime`` (see :data:`RUNTIMES`). Every
    runtime routes by the global scheduler's ``policy`` (``cost_model``: None counts prompt
    tokens; ``ttl_s``: how long its prompt trees keep an idle prefix).

    The process runtime spawns the instances on this host: ``num_colocated`` of a colocated
    configuration, ``cores_per_instance`` torch threads each (one unless told, under every
    runtime), listening on free loopback ports
    (``base_port`` 0) or ``base_port + 1 + i``, started by ``start_method`` (``spawn`` or
    ``forkserver``). Or it joins ``instances``, the ``HOST:PORT`` of ``minimemserve instance``
    processes, with the cluster ``key`` (its file, or a ``ClusterKey``) they were started with.
    Its control plane (and the store pair groups meet in) binds ``cluster_host``; ``transport``
    forces the KV transport of every pair (``auto``: per pair, from the links table);
    ``timeout_s`` bounds every control call, ``startup_timeout_s`` the start-up,
    ``heartbeat_s`` and ``heartbeat_timeout_s`` set the beat and the silence that means dead.
    ``kv_load_failure_policy`` (see :data:`KV_LOAD_FAILURE_POLICIES`) is the one switch for
    the requests of an instance that died: ``recompute`` runs them again elsewhere, ``fail``
    ends them with an error.

    The Ray runtime takes the same, but ``instances`` and ``key``; and the cluster's
    ``ray_address`` ("": ``RAY_ADDRESS``, else a local cluster), the ``placement`` of instances
    over its nodes (:data:`PLACEMENTS`), ``pin`` (role -> a custom resource, or a
    ``key=value`` label, a node must have to hold that role), ``cores_per_instance`` CPUs per
    rank, each actor's ``max_restarts`` (a restarted one rejoins) and how long a placement may
    take (``placement_timeout_s``)."""

    config: str = "PD"
    model: str | Path | None = None
    device: str | torch.device = "cpu"
    dtype: str | torch.dtype = "float32"
    engine: EngineConfig = field(default_factory=EngineConfig)
    runtime: str = "inprocess"
    policy: str = "prompt_tree"
    cost_model: Cost | None = None
    ttl_s: float = DEFAULT_TTL_S
    num_colocated: int = 2
    cores_per_instance: int = 1
    base_port: int = 0
    start_method: str = "spawn"
    transport: str = AUTO
    cluster_host: str = LOOPBACK
    instances: tuple[str, ...] = ()
    key: Any = None  # the cluster key's file (str, Path), or an rpc.ClusterKey
    timeout_s: float = DEFAULT_TIMEOUT_S
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    kv_load_failure_policy: str = "recompute"
    ray_address: str = ""
    placement: str = "pack"
    pin: Mapping[str, str] = field(default_factory=dict)
    max_restarts: int = 0
    placement_timeout_s: float = DEFAULT_PLACEMENT_TIMEOUT_S

    def __post_init__(self) -> None:
        self._check()
        object.__setattr__(self, "instances", tuple(self.instances))
        if isinstance(self.model, str) and self.model in PRESETS:  # a preset by name
            model, load_format = preset_model(self.model)
            object.__setattr__(self, "model", model)
            if load_format != "auto":
                engine = dataclasses.replace(self.engine, load_format=load_format)
                object.__setattr__(self, "engine", engine)

    def _check(self) -> None:
        """Raise ConfigError naming the first field that is wrong."""
        for name, allowed in (
            ("runtime", RUNTIMES),
            ("policy", ROUTING_POLICIES),
            ("transport", transport_names()),
            ("placement", PLACEMENTS),
            ("start_method", START_METHODS),
            ("kv_load_failure_policy", KV_LOAD_FAILURE_POLICIES),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name, low, high in BOUNDS:
            if not low <= getattr(self, name) < high:
                raise ConfigError(f"{name} must be in [{low}, {high}), got {getattr(self, name)}")
        if bad := [name for name in DURATIONS if not getattr(self, name) > 0]:
            raise ConfigError(f"{bad} must be positive")
        if bad := [r for r in self.pin if r not in {r.value for r in Role}]:
            raise ConfigError(f"pin names no role: {bad}")
        if not isinstance(self.engine, EngineConfig):
            raise ConfigError(f"engine must be an EngineConfig, got {type(self.engine).__name__}")

    @functools.cached_property
    def deployment(self) -> Deployment:
        """``config`` parsed, once per spec (a ``ConfigError`` names an unknown one)."""
        return parse_config_name(self.config)

    @property
    def model_dir(self) -> Path:
        """The checkpoint directory (the tiny preset's when ``model`` is None)."""
        return Path(preset_dir("tiny") if self.model is None else self.model)

    @property
    def linked(self) -> bool:
        """Whether transfers (the recipes', or the scheduler's prefix pushes) need pools that
        peers reach."""
        m = self.deployment.milestone
        return m.moves_kv or (self.policy in MOVES_PREFIXES and m.entry_caches)

    def build(self, cluster: type | None = None) -> Serving:
        """Start the deployment: an ``InProcessCluster``, or the ``cluster`` class of its
        runtime (``ProcessCluster``, ``RayCluster``; or a subclass, such as the benchmark's
        multi-host one) given this spec. An unknown configuration name raises ``ConfigError``
        here, naming it."""
        if cluster is None and self.runtime == "process":
            from .disagg.runtime import ProcessCluster as cluster  # lazy: msgspec and ZeroMQ
        if cluster is None and self.runtime == "ray":
            from .disagg.ray_runtime import RayCluster as cluster  # lazy: msgspec and ZeroMQ

        deployment = self.deployment  # an unknown name fails here
        if self.runtime == "inprocess" and cluster is not None:
            raise ConfigError("a cluster class is for the process and ray runtimes only")
        if self.runtime == "inprocess":
            return InProcessCluster(
                self.model_dir,
                deployment,
                device=self.device,
                dtype=self.dtype,
                engine_config=self.engine,
                policy=self.policy,
                cost_model=self.cost_model,
                ttl_s=self.ttl_s,
            )
        return cluster(self)

    def describe(self) -> dict:
        """The spec as JSON-ready data (a cost model by its class name, a key by its file)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        cost = self.cost_model
        return d | {
            "model": str(self.model_dir),
            "device": str(self.device),
            "dtype": str(self.dtype),
            "engine": asdict(self.engine),
            "cost_model": "prompt tokens" if cost is None else type(cost).__name__,
            "instances": list(self.instances),
            "key": None if self.key is None else str(self.key),
            "pin": dict(self.pin),
        }
