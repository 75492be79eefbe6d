"""Checkpoints: configuration, weights and tokenizer; the shared decoder is in ``layers``, one
file per family (``llama``, ``qwen2``, ``qwen3``), and ``registry`` picks the family."""

from minimemserve.model.config import ModelConfig, RopeScaling
from minimemserve.model.family import Family
from minimemserve.model.loader import expected_shapes, load_weights
from minimemserve.model.registry import build_model, family_of, register
from minimemserve.model.tokenizer import Tokenizer

__all__ = [
    "Family",
    "ModelConfig",
    "RopeScaling",
    "Tokenizer",
    "build_model",
    "expected_shapes",
    "family_of",
    "load_weights",
    "register",
]
