"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``): the Llama decoder with a bias on the q, k and v
projections (none on o or the MLP)."""

from __future__ import annotations

from .family import Family
from .layers import CausalLM


class Qwen2Model(CausalLM):
    """Qwen2 causal LM: Llama's layers plus q/k/v biases."""

    qkv_bias = True


FAMILY = Family("qwen2", ("Qwen2ForCausalLM",), Qwen2Model, model_type="qwen2")
