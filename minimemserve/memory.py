"""How much of its device one instance may hold, and how many KV blocks that leaves.

An instance on an accelerator holds ``gpu_memory_utilization`` of the device's total memory
(vLLM's meaning): its weights, the activations of its largest step, memory held beside them
(CUDA graphs, the CUDA context) and its KV pool together. The pool gets what is left of that
share once the rest is counted, so an instance's pool never depends on what other instances
on the device hold at the moment it starts: two instances started together get the same
pools in either order. The plan is pure arithmetic over numbers a :class:`DeviceMemory`
reports (:data:`PROVIDERS`, by device type; tests put a fake device there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from .errors import ConfigError

# The share of a GPU that the instances a deployment places on it hold together, split evenly
# when no instance is given its own (vLLM's default utilisation).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# Host RAM given to the hbm tier of an instance on a device without memory accounting (the
# CPU, the meta device): 64k tokens of the tiny fp32 preset.
DEFAULT_CPU_KV_BYTES = 1 << 30
# Per process, what torch's allocator does not count: the CUDA context, cuBLAS and NCCL
# workspaces (about 0.5 GiB on a Hopper GPU with torch 2.x).
CUDA_CONTEXT_BYTES = 1 << 29
GiB = 1 << 30


class DeviceMemory(Protocol):
    """What pool sizing asks of a device: its total bytes, and the peak bytes a call
    allocates above what was allocated before it (this process's allocations only)."""

    def total(self, device: torch.device) -> int: ...

    def peak_during(self, device: torch.device, run: Callable[[], object]) -> int: ...


class CudaMemory:
    """:class:`DeviceMemory` of a CUDA device, from torch's caching allocator."""

    context_bytes = CUDA_CONTEXT_BYTES

    def total(self, device: torch.device) -> int:
        """The device's memory in bytes."""
        return torch.cuda.get_device_properties(device).total_memory

    def peak_during(self, device: torch.device, run: Callable[[], object]) -> int:
        """Bytes ``run()`` allocates at its peak beyond what stood before; the cache it
        leaves is returned to the device after."""
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        torch.cuda.empty_cache()
        return max(0, peak)


# device type -> its memory accounting; a type without one sizes by DEFAULT_CPU_KV_BYTES
PROVIDERS: dict[str, DeviceMemory] = {"cuda": CudaMemory()}


def device_share(utilization: float | None, instances: int) -> float:
    """The share of its device one instance holds: its own ``utilization``, else the default
    split evenly among the ``instances`` placed on the device."""
    return DEFAULT_GPU_MEMORY_UTILIZATION / instances if utilization is None else utilization


@dataclass(frozen=True)
class MemoryPlan:
    """One instance's bytes on its device: ``share`` of ``device_bytes`` (it is one of
    ``instances`` there) minus ``weights``, ``activations`` (the peak of its largest step),
    ``graphs`` (CUDA graphs captured before the pool is sized) and ``context`` (see
    :data:`CUDA_CONTEXT_BYTES`) is its KV pool, in blocks of ``block_bytes``."""

    device: str
    device_bytes: int
    share: float
    instances: int
    weights: int
    activations: int
    block_bytes: int
    graphs: int = 0
    context: int = 0

    @property
    def budget(self) -> int:
        """The bytes this instance may hold on the device."""
        return int(self.share * self.device_bytes)

    @property
    def kv_bytes(self) -> int:
        """The bytes left to the KV pool (negative when the rest does not fit)."""
        return self.budget - self.weights - self.activations - self.graphs - self.context

    def blocks(self, least: int) -> int:
        """KV blocks in the pool; ``ConfigError`` naming every number when fewer than
        ``least`` (the smallest useful pool) fit."""
        n = max(0, self.kv_bytes) // self.block_bytes
        if n < least:
            raise ConfigError(
                f"the model does not fit: {_size(self.weights)} of weights, "
                f"{_size(self.activations)} of activations at the largest step, "
                f"{_size(self.graphs)} of CUDA graphs and {_size(self.context)} of context, in "
                f"a share of {self.share:.3f} of {self.device}'s {_size(self.device_bytes)} "
                f"({_size(self.budget)}; one of {self.instances} instance(s) on the device), "
                f"leave room for {n} KV blocks of {self.block_bytes} bytes; the smallest useful "
                f"pool is {least} (one request of the full context). Raise "
                "gpu_memory_utilization, place fewer instances on the device, lower "
                "max_model_len, or give num_blocks"
            )
        return n


def _size(nbytes: int) -> str:
    return f"{nbytes} bytes ({nbytes / GiB:.2f} GiB)"
