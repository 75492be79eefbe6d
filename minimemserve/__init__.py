"""minimemserve: a compact Llama-2 serving engine built on one elastic KV memory pool.

Context caching and prefill/decode disaggregation are compositions of MemPool calls: one
table, ``minimemserve.disagg.recipes``. Importing this package touches no device.
"""

import importlib

from .config import EngineConfig, parse_config_name
from .errors import (
    CheckpointError,
    ConfigError,
    InvalidRequest,
    MiniMemServeError,
    PoolExhausted,
    TransferError,
)
from .engine import Engine
from .llm import LLM
from .mempool import MemPool
from .request import RequestMetrics, RequestOutput
from .sampling import SamplingParams
from .scheduler.cost_model import CostModel
from .scheduler.global_scheduler import GlobalScheduler
from .serving import Serving

# names from modules that need the optional ZeroMQ / msgspec stack load on first use
_LAZY = {"ProcessCluster": "minimemserve.disagg.runtime"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'minimemserve' has no attribute {name!r}")
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
    "Serving",
    "TransferError",
    "parse_config_name",
]
__version__ = "0.1.0"
