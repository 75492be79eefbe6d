"""minimemserve: a compact Llama-2 serving engine built on one elastic KV memory pool.

Context caching and prefill/decode disaggregation are compositions of MemPool calls (the
table in ``minimemserve.disagg.recipes``). Importing this package touches no device."""

from .config import EngineConfig, parse_config_name
from .disagg.runtime import ProcessCluster
from .engine import Engine
from .errors import (
    CheckpointError,
    ConfigError,
    InvalidRequest,
    MiniMemServeError,
    PoolExhausted,
    TransferError,
)
from .llm import LLM
from .mempool import MemPool
from .request import RequestMetrics, RequestOutput
from .sampling import SamplingParams
from .scheduler.cost_model import CostModel
from .scheduler.global_scheduler import GlobalScheduler
from .serving import Serving

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
