"""Llama-2 checkpoints: configuration, weight loading and tokenizer.

The model's forward pass lives in :mod:`minimemserve.model.llama`; the tiny random presets
the tests and benchmarks use are in :mod:`minimemserve.bench.presets`.
"""

from minimemserve.model.config import ModelConfig, RopeScaling
from minimemserve.model.loader import expected_shapes, load_weights
from minimemserve.model.tokenizer import Tokenizer

__all__ = [
    "ModelConfig",
    "RopeScaling",
    "Tokenizer",
    "expected_shapes",
    "load_weights",
]
