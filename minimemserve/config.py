"""Engine configuration and the deployment names (PD, PD-CC, 1P1D, 1P1D-CC1/2/3, xPyD...)."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import torch

from .errors import ConfigError
from .memory import device_share
from .recipes import MILESTONES, Milestone, Role
from .scheduler.local import STEP_POLICIES

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# config-name suffix -> caching milestone of a disaggregated deployment (xPyD[-CC...])
_DISAGG_MILESTONES = {"": "PD-Basic", "CC": "PD-Caching-3"} | {
    f"CC{i}": f"PD-Caching-{i}" for i in "123"
}
# How an instance gets its weights: the checkpoint's safetensors, or random ones of the
# shapes its config.json gives, made on the device (vLLM's names)
LOAD_FORMATS = ("auto", "dummy")
# When a prefill instance hands a request off: "overlap", while its next step computes (the
# step ends when both have); "inline", inside the step that prefilled it (the step waits)
HANDOFF_MODES = ("overlap", "inline")
_COLOCATED = ("PD", "PD-CC")  # config names that are their milestone's name
NAME_PREFIX = {Role.COLOCATED: "C", Role.PREFILL: "P", Role.DECODE: "D"}  # names: P0, D1, ...
# Where a process deployment's control plane binds unless told
LOOPBACK = "127.0.0.1"
# How long a control call waits for its reply: a loopback round trip takes < 1 ms, so a peer
# this late is dead or stuck
DEFAULT_TIMEOUT_S = 30.0
# EngineConfig size field -> its smallest valid value
_MINIMUM = {
    **dict.fromkeys(["num_blocks", "kv_memory_bytes", "max_num_seqs", "max_num_batched_tokens"], 1),
    "dram_blocks": 0,
    "disk_blocks": 0,
    "instances_on_device": 1,
    "max_model_len": 2,
    "tensor_parallel_size": 1,
    "decode_tensor_parallel_size": 1,
}


@dataclass(frozen=True)
class Deployment:
    """A config name's caching milestone and instance count per role (``milestone.roles``
    order); the runtime picks a colocated milestone's count."""

    name: str
    milestone: Milestone
    counts: tuple[int, ...]

    def instances(self, colocated: int = 1) -> list[tuple[str, str]]:
        """``(name, role)`` of every instance, entry role first."""
        roles = self.milestone.roles
        counts = [colocated if r == Role.COLOCATED else n for r, n in zip(roles, self.counts)]
        return [(f"{NAME_PREFIX[r]}{i}", r) for r, n in zip(roles, counts) for i in range(n)]


def parse_config_name(name: str | Deployment) -> Deployment:
    """Parse ``PD``, ``PD-CC``, ``1P1D``, ``1P1D-CC[1|2|3]``, ``xPyD[-CC...]``; a deployment
    parsed already is returned as it is (a build parses its name once and hands that on)."""
    if isinstance(name, Deployment):
        return name
    if not isinstance(name, str):
        raise ConfigError(f"config name must be a string, got {name!r}")
    if name in _COLOCATED:
        return Deployment(name, MILESTONES[name], (1,))
    m = re.fullmatch(r"(\d+)P(\d+)D(?:-(CC[123]?))?", name)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ConfigError(
            f"unknown config name {name!r}; expected PD, PD-CC, 1P1D, 1P1D-CC, 1P1D-CC1, "
            "1P1D-CC2, 1P1D-CC3 or xPyD forms such as 1P2D-CC"
        )
    milestone = MILESTONES[_DISAGG_MILESTONES[m.group(3) or ""]]
    return Deployment(name, milestone, (int(m.group(1)), int(m.group(2))))


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"`` / ``"float16"`` / ``"bfloat16"`` (or a torch dtype) to a torch dtype."""
    resolved = dtype if isinstance(dtype, torch.dtype) else _DTYPES.get(dtype)
    if resolved not in _DTYPES.values():
        raise ConfigError(f"unsupported dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    return resolved


@dataclass(frozen=True)
class EngineConfig:
    """Sizes and limits of one engine instance. The hbm tier holds ``num_blocks`` blocks, or
    as many as ``kv_memory_bytes`` allows; by default, on a GPU, what is left of the
    instance's share of the device (``gpu_memory_utilization``; unset: 0.9 split evenly among
    the ``instances_on_device`` a deployment places there) once its weights and the peak of
    its largest step are counted (``minimemserve.memory``), and 1 GiB on the CPU."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_bytes: int | None = None
    dram_blocks: int = 0  # the host-memory tier below hbm, in blocks
    disk_blocks: int = 0  # the local-disk tier below those, in blocks (needs disk_dir)
    # where the disk tier keeps its block files: one subdirectory per instance, by its id
    disk_dir: str | None = None
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 512  # token budget per step; bounds a prefill chunk
    max_model_len: int | None = None  # defaults to the model's context length
    attention: str | None = None  # None: triton on CUDA, torch elsewhere
    seed: int = 0
    gpu_memory_utilization: float | None = None  # share of the device's total memory
    instances_on_device: int = 1  # set by the deployment: instances sharing this one's device
    load_format: str = "auto"  # one of LOAD_FORMATS
    tensor_parallel_size: int = 1  # ranks (processes) the model is split over
    decode_tensor_parallel_size: int | None = None  # decode instances' size; None: the same
    scheduler: str = "chunked"  # the local step policy: "chunked" or "prefill_first"
    # how long rank 0 waits for the other ranks in one collective; one that misses it (stopped,
    # slow, cut off) is killed and its instance fails with InstanceDied, as a dead one does
    collective_timeout_s: float = 60.0
    # run every step eagerly: no CUDA graphs for decode steps (vLLM's name; graphs are CUDA-only)
    enforce_eager: bool = False
    handoff: str = "overlap"  # one of HANDOFF_MODES

    def __post_init__(self) -> None:
        if self.scheduler not in STEP_POLICIES:
            raise ConfigError(f"unknown scheduler {self.scheduler!r}; choose from {STEP_POLICIES}")
        if self.handoff not in HANDOFF_MODES:
            raise ConfigError(f"handoff must be one of {HANDOFF_MODES}, got {self.handoff!r}")
        self._check_memory()
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        self._check_kinds()
        if self.disk_dir is not None and not self.disk_blocks:  # (the simulator: no directory)
            raise ConfigError("disk_dir needs disk_blocks: the disk tier's capacity in blocks")
        t = self.collective_timeout_s
        if not isinstance(t, int | float) or isinstance(t, bool) or not 0 < t < math.inf:
            raise ConfigError(f"collective_timeout_s must be a positive number, got {t!r}")
        for name, low in _MINIMUM.items():
            value = getattr(self, name)
            if value is None and getattr(EngineConfig, name) is None:
                continue  # an optional size left unset (its default is None)
            if value < low:
                raise ConfigError(f"{name} must be >= {low}, got {value}")

    def _check_kinds(self) -> None:
        for name in ("tensor_parallel_size", "decode_tensor_parallel_size"):
            tp = getattr(self, name)
            if not isinstance(tp, int) or isinstance(tp, bool):
                if tp is not None or name == "tensor_parallel_size":
                    raise ConfigError(f"{name} must be an int, got {tp!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ConfigError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")

    def tp_size(self, role: str) -> int:
        """The tensor-parallel size of an instance of ``role``."""
        if role == Role.DECODE and self.decode_tensor_parallel_size is not None:
            return self.decode_tensor_parallel_size
        return self.tensor_parallel_size

    def model_len(self, model_config) -> int:
        """The longest sequence: ``max_model_len``, at most the model's context length."""
        context = model_config.max_position_embeddings
        return min(self.max_model_len or context, context)

    def decode_graph_batch(self, device: torch.device) -> int:
        """The largest decode batch CUDA graphs are captured for (``max_num_seqs``), or 0 for
        none: off CUDA, or with ``enforce_eager``."""
        return 0 if self.enforce_eager or device.type != "cuda" else self.max_num_seqs

    def _check_memory(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format must be one of {LOAD_FORMATS}: {self.load_format!r}")
        share = self.gpu_memory_utilization
        if share is None:
            return
        if not isinstance(share, int | float) or isinstance(share, bool) or not 0 < share <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {share!r}")
        n = self.instances_on_device
        if isinstance(n, int) and share * n > 1 + 1e-9:
            raise ConfigError(
                f"gpu_memory_utilization {share} for each of {n} instances on one device "
                f"adds up to {share * n:.2f} of it; give at most {1 / n:.3f}"
            )

    @property
    def device_share(self) -> float:
        """The share of its device this instance holds (see ``minimemserve.memory``)."""
        return device_share(self.gpu_memory_utilization, self.instances_on_device)

    def placed(self, instances: int) -> EngineConfig:
        """This config for one of ``instances`` instances a deployment places on one device."""
        return dataclasses.replace(self, instances_on_device=instances)
