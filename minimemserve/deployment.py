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
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from .config import LOOPBACK, Deployment, EngineConfig, parse_config_name
from .disagg.links import AUTO, transport_names
from .disagg.placement import PLACEMENTS
from .errors import ConfigError
from .inprocess import InProcessCluster
from .presets import PRESETS, preset_dir, preset_model
from .scheduler.global_scheduler import ROUTING_POLICIES, Cost
from .serving import Serving

# How a deployment's instances run: all in this process, one process each, or one Ray actor each.
RUNTIMES = ("inprocess", "process", "ray")
# The dtypes the commands offer (the engine takes any torch floating dtype).
DTYPES = ("float32", "float16", "bfloat16")
# What happens to a request whose instance died before its KV reached the next one (vLLM's
# ``kv_load_failure_policy``): computed again on another instance, or ended with an error.
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class DeploymentSpec:
    """A deployment: configuration ``config`` (``PD``, ``PD-CC``, ``1P1D``, ``1P1D-CC1/2/3``,
    ``xPyD``...) of the checkpoint ``model`` (a directory or a preset's name, such as
    ``llama-2-7b-dummy``, whose load format it sets; None: the tiny preset) on ``device`` in
    ``dtype``, every instance with ``engine``; run by ``runtime`` (see :data:`RUNTIMES`). Both
    runtimes route by the global scheduler's ``policy`` (and ``cost_model``: None counts
    prompt tokens). The process runtime also takes: ``num_colocated`` instances of a colocated
    configuration, ``cores_per_instance`` (None: the runtime's default), the KV
    ``transport`` between instances, the address ``cluster_host`` its control plane binds,
    and ``instances``, the ``HOST:PORT`` of standalone instances to join instead of spawning
    (with the cluster ``key`` file). The Ray runtime takes the same (but ``instances`` and
    ``key``), the cluster's ``ray_address`` ("": ``RAY_ADDRESS`` or a local cluster), the
    ``placement`` of instances over its nodes (``pack`` or ``spread``) and ``max_restarts``,
    how many times Ray restarts a dead instance's actor (which then rejoins). Both take
    ``kv_load_failure_policy`` (see :data:`KV_LOAD_FAILURE_POLICIES`)."""

    config: str = "PD"
    model: str | Path | None = None
    device: str | torch.device = "cpu"
    dtype: str | torch.dtype = "float32"
    engine: EngineConfig = field(default_factory=EngineConfig)
    runtime: str = "inprocess"
    policy: str = "prompt_tree"
    cost_model: Cost | None = None
    num_colocated: int = 2
    cores_per_instance: int | None = None
    transport: str = AUTO
    cluster_host: str = LOOPBACK
    instances: tuple[str, ...] = ()
    key: str | None = None
    ray_address: str = ""
    placement: str = "pack"
    max_restarts: int = 0
    kv_load_failure_policy: str = "recompute"

    def __post_init__(self) -> None:
        for name, allowed in (
            ("runtime", RUNTIMES),
            ("policy", ROUTING_POLICIES),
            ("transport", transport_names()),
            ("placement", PLACEMENTS),
            ("kv_load_failure_policy", KV_LOAD_FAILURE_POLICIES),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not isinstance(self.engine, EngineConfig):
            raise ConfigError(f"engine must be an EngineConfig, got {type(self.engine).__name__}")
        object.__setattr__(self, "instances", tuple(self.instances))
        if isinstance(self.model, str) and self.model in PRESETS:  # a preset by name
            model, load_format = preset_model(self.model)
            object.__setattr__(self, "model", model)
            if load_format != "auto":
                engine = dataclasses.replace(self.engine, load_format=load_format)
                object.__setattr__(self, "engine", engine)

    @functools.cached_property
    def deployment(self) -> Deployment:
        """``config`` parsed, once per spec (a ``ConfigError`` names an unknown one)."""
        return parse_config_name(self.config)

    @property
    def model_dir(self) -> Path:
        """The checkpoint directory (the tiny preset's when ``model`` is None)."""
        return Path(preset_dir("tiny") if self.model is None else self.model)

    def build(self, cluster: type | None = None, **process_kw: Any) -> Serving:
        """Start the deployment: an ``InProcessCluster`` or a ``ProcessCluster`` (``cluster``
        may be a subclass, such as the benchmark's multi-host one; ``process_kw`` are its
        further arguments: timeouts, start method...). An unknown configuration name raises
        ``ConfigError`` here, naming it."""
        if cluster is None and self.runtime == "process":
            from .disagg.runtime import ProcessCluster as cluster  # lazy: msgspec and ZeroMQ
        if cluster is None and self.runtime == "ray":
            from .disagg.ray_runtime import RayCluster as cluster  # lazy: msgspec and ZeroMQ

            ray_options = {
                "ray_address": self.ray_address or None,
                "placement": self.placement,
                "max_restarts": self.max_restarts,
            }
            process_kw = ray_options | process_kw

        deployment = self.deployment  # an unknown name fails here
        if self.runtime == "inprocess" and (cluster is not None or process_kw):
            raise ConfigError("cluster and its arguments are for the process runtime only")
        if self.runtime == "inprocess":
            return InProcessCluster(
                self.model_dir,
                deployment,
                device=self.device,
                dtype=self.dtype,
                engine_config=self.engine,
                policy=self.policy,
                cost_model=self.cost_model,
            )
        cores = self.cores_per_instance
        extra = {} if cores is None else {"cores_per_instance": cores}
        policy = {"rerun_on_failure": self.kv_load_failure_policy == "recompute"}
        return cluster(
            self.model_dir,
            deployment,
            engine_config=self.engine,
            device=self.device,
            dtype=self.dtype,
            policy=self.policy,
            cost_model=self.cost_model,
            num_colocated=self.num_colocated,
            host=self.cluster_host,
            instances=list(self.instances) or None,
            key=self.key,
            transport=self.transport,
            **extra | policy | process_kw,
        )

    def describe(self) -> dict:
        """The spec as JSON-ready data (a cost model by its class name)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        cost = self.cost_model
        return d | {
            "model": str(self.model_dir),
            "device": str(self.device),
            "dtype": str(self.dtype),
            "engine": asdict(self.engine),
            "cost_model": "prompt tokens" if cost is None else type(cost).__name__,
            "instances": list(self.instances),
        }
