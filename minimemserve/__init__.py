"""minimemserve: a compact Llama and Qwen serving engine built on one elastic KV memory pool.

Context caching and prefill/decode disaggregation are compositions of MemPool calls (the
table in ``minimemserve.recipes``). Importing this package touches no device, and
needs neither ``msgspec`` nor ``pyzmq``: only the process runtime (``ProcessCluster``, loaded
on first use) does."""

from .config import EngineConfig, parse_config_name
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

# what the process runtime needs beyond the in-process engine: module -> PyPI name
PROCESS_RUNTIME_PACKAGES = {"msgspec": "msgspec", "zmq": "pyzmq"}


def __getattr__(name: str):
    """``ProcessCluster`` on first use, so the in-process engine imports without the process
    runtime's packages; a missing one is named."""
    if name != "ProcessCluster":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from .disagg.runtime import ProcessCluster  # lazy: needs msgspec and pyzmq
    except ImportError as e:
        missing = PROCESS_RUNTIME_PACKAGES.get((e.name or "").split(".")[0])
        if missing is None:
            raise
        raise ImportError(
            f"ProcessCluster (the process runtime) needs the package {missing!r}, which is "
            f"not installed (pip install {missing}); LLM and Engine in one process do not",
            name=e.name,
        ) from e
    globals()["ProcessCluster"] = ProcessCluster
    return ProcessCluster
