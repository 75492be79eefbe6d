"""Schedulers: local (batching inside an instance) and global (routing between instances)."""

import warnings

from .cost_model import CostModel, OpSample
from .global_scheduler import (
    ROUTING,
    ROUTING_POLICIES,
    GlobalScheduler,
    PromptTrees,
    Route,
    RoutingPolicy,
    TokenCost,
)
from .local import STEP_POLICIES, LocalScheduler

__all__ = [
    "ROUTING",
    "ROUTING_POLICIES",
    "STEP_POLICIES",
    "RoutingPolicy",
    "CostModel",
    "GlobalScheduler",
    "LocalScheduler",
    "OpSample",
    "PromptTrees",
    "Route",
    "TokenCost",
]


def __getattr__(name: str):
    """``POLICIES``: the deprecated name of :data:`ROUTING_POLICIES` (the step policies are
    :data:`STEP_POLICIES`)."""
    if name == "POLICIES":
        warnings.warn(
            "minimemserve.scheduler.POLICIES is deprecated; use ROUTING_POLICIES",
            DeprecationWarning,
            stacklevel=2,
        )
        return ROUTING_POLICIES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
