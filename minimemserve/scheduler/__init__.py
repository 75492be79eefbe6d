"""Schedulers: local (batching inside an instance) and global (routing between instances)."""

from ..errors import renamed
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


# The old name of the routing policies (the step policies are STEP_POLICIES), served with a
# warning for one release.
__getattr__ = renamed(__name__, {"POLICIES": ("ROUTING_POLICIES", ROUTING_POLICIES)})
