"""Schedulers: local (batching inside an instance) and global (routing between instances)."""

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
