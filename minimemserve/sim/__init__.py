"""A cluster simulator that runs the engine's own scheduling, MemPool and recipes in virtual
time, replacing only the model forward and the data movement by modelled durations."""

from .cluster import Contention, SimCluster, SimEngine, SimPool, Topology
from .profiles import (
    FittedStepModel,
    HardwareProfile,
    Link,
    RooflineStepModel,
    StepShape,
    fit_cpu_steps,
    load_model_shape,
)
from .runner import cpu_setup, gpu_setup, simulate

__all__ = [
    "Contention",
    "FittedStepModel",
    "HardwareProfile",
    "Link",
    "RooflineStepModel",
    "SimCluster",
    "SimEngine",
    "SimPool",
    "StepShape",
    "Topology",
    "cpu_setup",
    "fit_cpu_steps",
    "gpu_setup",
    "load_model_shape",
    "simulate",
]
