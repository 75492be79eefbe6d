"""Schedulers: local (batching inside an instance) and global (routing between instances)."""

from .cost_model import CostModel, OpSample
from .global_scheduler import POLICIES, GlobalScheduler, PromptTrees, Route, TokenCost
from .local import LocalScheduler

__all__ = [
    "POLICIES",
    "CostModel",
    "GlobalScheduler",
    "LocalScheduler",
    "OpSample",
    "PromptTrees",
    "Route",
    "TokenCost",
]
