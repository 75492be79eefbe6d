"""Schedulers: the local one batches requests inside an instance; the global one routes
requests between instances, weighing cached prefixes against queued work with a cost model."""

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
