"""minimemserve: a compact Llama-2 serving engine built on one elastic KV memory pool.

Context caching and prefill/decode disaggregation are compositions of MemPool calls
(see ``minimemserve.disagg.recipes``). Importing this package touches no device.
"""

from .config import EngineConfig, parse_config_name
from .errors import (
    CheckpointError,
    ConfigError,
    InvalidRequest,
    MiniMemServeError,
    PoolExhausted,
    TransferError,
)
from .llm import LLM
from .request import RequestMetrics, RequestOutput
from .sampling import SamplingParams

# heavy submodules load on first use, so `import minimemserve` stays light
_LAZY = {
    "MemPool": "minimemserve.mempool",
    "Engine": "minimemserve.engine",
    "ProcessCluster": "minimemserve.disagg.runtime",
    "GlobalScheduler": "minimemserve.scheduler.global_scheduler",
    "CostModel": "minimemserve.scheduler.cost_model",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'minimemserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "LLM",
    "CheckpointError",
    "ConfigError",
    "CostModel",
    "Engine",
    "EngineConfig",
    "GlobalScheduler",
    "InvalidRequest",
    "MemPool",
    "MiniMemServeError",
    "PoolExhausted",
    "ProcessCluster",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "TransferError",
    "parse_config_name",
]
__version__ = "0.1.0"
