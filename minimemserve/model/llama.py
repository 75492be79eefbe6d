"""Llama, Llama-2 and Llama-3 (``LlamaForCausalLM``): the shared decoder as it is, without
biases or q/k norm; Llama-3's ``llama3`` RoPE scaling and GQA come from its config."""

from __future__ import annotations

from .family import Family
from .layers import CausalLM


class LlamaModel(CausalLM):
    """Llama causal LM: RMSNorm, RoPE (plain, linear or llama3 scaling), GQA, SwiGLU."""


FAMILY = Family("llama", ("LlamaForCausalLM",), LlamaModel, model_type="llama")
