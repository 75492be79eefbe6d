"""The decoder pieces every supported family shares, under HF names, over the paged pool.

RMSNorm, rotary embeddings (plain, ``linear`` and ``llama3`` scaling, as HF computes them),
GQA attention with optional q/k/v bias and q/k RMSNorm, the SwiGLU MLP, the pre-norm block and
``CausalLM``, the model a family file subclasses. A family sets two class attributes
(``qkv_bias``, ``qk_norm``) and overrides what else differs.

The model owns no KV memory: each attention layer is given its ``layer_id`` and asks the
attention backend (built over MemPool's tensor) to store and read that layer's K/V."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import nn

from ..attention.base import AttentionBackend, AttentionMetadata
from ..attention.elementwise import TORCH_ELEMENTWISE
from .config import ModelConfig, RopeScaling

# Our fused projections and the HF tensors they stack, in order.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in fp32 as HF does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _linear_scaled(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    return inv_freq / scaling.factor  # stretches every position by the factor


def _llama3_scaled(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Low frequencies divided by the factor, high ones kept, the band between blended."""
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    span = scaling.high_freq_factor - scaling.low_freq_factor
    smooth = (old_len / wavelen - scaling.low_freq_factor) / span
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, blended, scaled)


# rope_type -> how it rescales the plain inverse frequencies
ROPE_SCALINGS: dict[str, Callable[[torch.Tensor, RopeScaling], torch.Tensor]] = {
    "linear": _linear_scaled,
    "llama3": _llama3_scaled,
}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary(nn.Module):
    """cos/sin tables for every position up to the context length (rotate-half form)."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None
    ):
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (theta**exponents)  # [D/2]
        if scaling is not None:
            inv_freq = ROPE_SCALINGS[scaling.rope_type](inv_freq, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, q, k, positions):  # q [T, H, D], k [T, KV, D], positions [T]
        cos = self.cos[positions].to(q.dtype)[:, None, :]  # [T, 1, D]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class Attention(nn.Module):
    """GQA self-attention for one layer; q, k and v projections fused into one matmul (with
    their biases when ``qkv_bias``); ``qk_norm`` RMS-normalises each head of q and k."""

    def __init__(self, cfg: ModelConfig, layer_id: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        self.kv_size = cfg.num_key_value_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else nn.Identity()

    def forward(self, x, positions, rotary: Rotary, backend: AttentionBackend, md):
        """Project q/k/v, rotate, let the backend store this layer's K/V and attend."""
        T = x.shape[0]  # x [T, hidden]
        qkv = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = (t.view(T, -1, self.head_dim) for t in qkv)  # [T, H, D], [T, KV, D] x2
        q, k = self.q_norm(q), self.k_norm(k)
        ops = backend.elementwise
        o = ops.rope_attend(backend, q, k, v, rotary, positions, self.layer_id, md)  # [T, H, D]
        return self.o_proj(o.reshape(T, self.q_size))  # [T, hidden]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=False)

    def forward(self, x, ops=TORCH_ELEMENTWISE):  # [T, hidden] -> [T, hidden]
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))  # gate_up [T, 2 * inter]


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: attention then MLP, each added to the residual stream."""

    def __init__(self, cfg: ModelConfig, layer_id: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id, qkv_bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, positions, rotary, backend, md):
        """``(mlp output, residual stream)``, each ``[T, hidden]``: the block's input is
        ``x + residual`` (``x`` alone in the first layer), added as the next norm runs."""
        ops = backend.elementwise
        h, residual = ops.add_rmsnorm(x, residual, self.input_layernorm)
        h = self.self_attn(h, positions, rotary, backend, md)
        h, residual = ops.add_rmsnorm(h, residual, self.post_attention_layernorm)
        return self.mlp(h, ops), residual

    @classmethod
    def hf_tensors(
        cls, cfg: ModelConfig, qkv_bias: bool, qk_norm: bool
    ) -> dict[str, tuple[int, ...]]:
        """The HF tensors of one layer (names after ``model.layers.<i>.``) and their shapes:
        what a checkpoint of a family with this layer holds per layer."""
        h, inter = cfg.hidden_size, cfg.intermediate_size
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        projections = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
        shapes = {f"self_attn.{p}.weight": (n, h) for p, n in projections.items()}
        if qkv_bias:
            shapes |= {f"self_attn.{p}.bias": (n,) for p, n in projections.items()}
        if qk_norm:
            shapes |= {f"self_attn.{p}.weight": (cfg.head_dim,) for p in ("q_norm", "k_norm")}
        return shapes | {
            "self_attn.o_proj.weight": (h, q_size),
            "mlp.gate_proj.weight": (inter, h),
            "mlp.up_proj.weight": (inter, h),
            "mlp.down_proj.weight": (h, inter),
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
        }


class CausalLM(nn.Module):
    """A pre-norm decoder causal LM over flattened new tokens ``[T]`` of a batch of sequences.
    A family subclasses it, setting ``qkv_bias`` and ``qk_norm`` (both off: Llama), and may
    bring its own ``layer`` class (the registry hands it over): built as
    ``layer(cfg, layer_id, qkv_bias, qk_norm)``, called as :class:`DecoderLayer` is, listing
    its checkpoint tensors in ``layer.hf_tensors``."""

    qkv_bias = False  # q, k and v projections carry a bias (Qwen2)
    qk_norm = False  # each head of q and k is RMS-normalised before rotary (Qwen3)

    def __init__(self, cfg: ModelConfig, layer: type[nn.Module] = DecoderLayer):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            layer(cfg, i, self.qkv_bias, self.qk_norm) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )

    def forward(
        self, input_ids: torch.Tensor, backend: AttentionBackend, md: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm for ``input_ids [T]``."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, md.positions, self.rotary, backend, md)
        return backend.elementwise.add_rmsnorm(x, residual, self.norm)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[B, vocab]`` for selected hidden rows ``[B, hidden]``."""
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_hf_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, fusing q/k/v (weights and biases) and gate/up."""
        embed = weights["model.embed_tokens.weight"]
        self.lm_head.weight.copy_(weights.get("lm_head.weight", embed))
        for name, param in self.named_parameters():
            if name != "lm_head.weight":
                parent, proj, leaf = f"model.{name}".rsplit(".", 2)  # ..., "qkv_proj", "weight"
                parts = _FUSED.get(proj, (proj,))
                param.copy_(torch.cat([weights[f"{parent}.{p}.{leaf}"] for p in parts]))
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
