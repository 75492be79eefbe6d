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


def __getattr__(name: str):
    # heavy submodules load on first use, so `import minimemserve` stays light
    if name == "MemPool":
        from .mempool import MemPool

        return MemPool
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(f"module 'minimemserve' has no attribute {name!r}")


__all__ = [
    "LLM",
    "CheckpointError",
    "ConfigError",
    "Engine",
    "EngineConfig",
    "InvalidRequest",
    "MemPool",
    "MiniMemServeError",
    "PoolExhausted",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "TransferError",
    "parse_config_name",
]
__version__ = "0.1.0"
