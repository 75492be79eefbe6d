"""Llama-2 checkpoints: configuration, weights and tokenizer; the model is in ``llama``."""

from minimemserve.model.config import ModelConfig, RopeScaling
from minimemserve.model.loader import expected_shapes, load_weights
from minimemserve.model.tokenizer import Tokenizer

__all__ = ["ModelConfig", "RopeScaling", "Tokenizer", "expected_shapes", "load_weights"]
