"""Llama-2 checkpoints: configuration, weight loading, tokenizer and tiny presets.

The model's forward pass lives in :mod:`minimemserve.model.llama`.
"""

from minimemserve.model.config import ModelConfig, RopeScaling
from minimemserve.model.loader import expected_shapes, load_weights
from minimemserve.model.presets import PRESETS, Preset, preset_dir, write_random_llama
from minimemserve.model.tokenizer import Tokenizer

__all__ = [
    "PRESETS",
    "ModelConfig",
    "Preset",
    "RopeScaling",
    "Tokenizer",
    "expected_shapes",
    "load_weights",
    "preset_dir",
    "write_random_llama",
]
