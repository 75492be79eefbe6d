"""Llama-2 architecture over the paged KV pool: RMSNorm, rotary embeddings (with linear
rope scaling), grouped-query attention, SwiGLU MLP; weights under HF names.

The model owns no KV memory: each attention layer is given its ``layer_id`` and asks the
attention backend (built over MemPool's tensor) to store and read that layer's K/V.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.base import AttentionBackend, AttentionMetadata


def _rope_factor(rope_scaling) -> float:
    """Linear rope-scaling factor of a config (1.0 when unscaled)."""
    if rope_scaling is None:
        return 1.0
    if hasattr(rope_scaling, "factor"):
        return float(rope_scaling.factor)
    params = dict(rope_scaling) if not isinstance(rope_scaling, Mapping) else rope_scaling
    return float(params.get("factor", 1.0))


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 as HF does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden] -> [T, hidden]``: x / rms(x) in fp32, cast back, times the weight."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """cos/sin tables for every position up to the context length (rotate-half form)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, factor: float):
        super().__init__()
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        inv_freq = inv_freq / factor  # linear scaling stretches positions by `factor`
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, q, k, positions):  # q [T, H, D], k [T, KV, D], positions [T]
        """Rotate ``q [T, H, D]`` and ``k [T, KV, D]`` by ``positions [T]``; same shapes out."""
        cos = self.cos[positions].to(q.dtype)[:, None, :]  # [T, 1, D]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """GQA self-attention for one layer; q, k and v projections fused into one matmul."""

    def __init__(self, cfg, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(self, x, positions, rotary: Rotary, backend: AttentionBackend, md):
        """``[T, hidden] -> [T, hidden]``: project q/k/v, rotate, let the backend store this
        layer's K/V and attend, then project the heads back out."""
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.n_heads, self.head_dim)  # [T, H, D]
        k = k.view(T, self.n_kv, self.head_dim)  # [T, KV, D]
        v = v.view(T, self.n_kv, self.head_dim)
        q, k = rotary(q, k, positions)
        o = backend.forward(q, k, v, self.layer_id, md)  # [T, H, D]
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused."""

    def __init__(self, cfg):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=False)

    def forward(self, x):
        """``[T, hidden] -> [T, hidden]``: ``down(silu(gate(x)) * up(x))``."""
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, rotary, backend, md):
        """``[T, hidden] -> [T, hidden]``: attention then MLP, each on the normed input and
        added back to the residual stream."""
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, backend, md)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Llama-2 causal LM over flattened new tokens ``[T]`` of a batch of sequences."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(
            cfg.head_dim,
            cfg.max_position_embeddings,
            cfg.rope_theta,
            _rope_factor(cfg.rope_scaling),
        )

    def forward(
        self, input_ids: torch.Tensor, backend: AttentionBackend, md: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm for ``input_ids [T]``."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        for layer in self.layers:
            x = layer(x, md.positions, self.rotary, backend, md)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[B, vocab]`` for selected hidden rows ``[B, hidden]``."""
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_hf_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up projections."""
        cfg = self.cfg
        self.embed_tokens.weight.copy_(weights["model.embed_tokens.weight"])
        self.norm.weight.copy_(weights["model.norm.weight"])
        head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
        self.lm_head.weight.copy_(head)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.self_attn.qkv_proj.weight.copy_(
                torch.cat([weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], dim=0)
            )
            layer.self_attn.o_proj.weight.copy_(weights[p + "self_attn.o_proj.weight"])
            layer.mlp.gate_up_proj.weight.copy_(
                torch.cat([weights[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up")], dim=0)
            )
            layer.mlp.down_proj.weight.copy_(weights[p + "mlp.down_proj.weight"])
            layer.input_layernorm.weight.copy_(weights[p + "input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(
                weights[p + "post_attention_layernorm.weight"]
            )
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
