"""Qwen3 (``Qwen3ForCausalLM``): the Llama decoder with an RMSNorm on each head of q and k
before rotary, and a ``head_dim`` its config gives (not ``hidden_size / heads``)."""

from __future__ import annotations

from .family import Family
from .layers import CausalLM


class Qwen3Model(CausalLM):
    """Qwen3 causal LM: Llama's layers plus per-head q/k RMSNorm."""

    qk_norm = True


FAMILY = Family("qwen3", ("Qwen3ForCausalLM",), Qwen3Model, model_type="qwen3")
