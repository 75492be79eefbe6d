"""Shard math: the part of a model one tensor-parallel rank holds (:class:`TPShard`) and the
HF weights cut to it (:func:`shard_weights`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from ..blocks.layout import KVLayout
from ..errors import ConfigError
from ..model.config import ModelConfig
from ..model.loader import EMBED_NAME, LM_HEAD_NAME

# HF projection name -> the slice of its rows (column-parallel) or its columns (row-parallel)
_ROW_SPLIT = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp"}
_COL_SPLIT = {"o_proj": "q", "down_proj": "mlp"}


@dataclasses.dataclass(frozen=True)
class TPShard:
    """The part of ``cfg``'s model that rank ``rank`` of ``size`` holds (size 1: all of it).
    Raises ``ConfigError`` when ``size`` does not divide the attention heads or the
    intermediate size, or neither divides the other with the KV heads."""

    rank: int
    size: int
    cfg: ModelConfig

    def __post_init__(self) -> None:
        cfg = self.cfg
        n = self.size
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"tensor_parallel_size must be an int >= 1, got {n!r}")
        if not 0 <= self.rank < n:
            raise ConfigError(f"rank {self.rank} is outside [0, {n})")
        heads = cfg.num_attention_heads
        kv = cfg.num_key_value_heads
        if heads % n or cfg.intermediate_size % n:
            raise ConfigError(
                f"tensor_parallel_size {n} must divide the attention heads ({heads}) and the "
                f"intermediate size ({cfg.intermediate_size})"
            )
        if kv % n and n % kv:
            raise ConfigError(
                f"tensor_parallel_size {n} and the {kv} KV heads must divide one another "
                "(KV heads are split, or replicated when there are fewer than ranks)"
            )

    @property
    def heads(self) -> int:
        """Query heads on this rank."""
        return self.cfg.num_attention_heads // self.size

    @property
    def kv_heads(self) -> int:
        """KV heads on this rank (1 when they are replicated)."""
        return max(1, self.cfg.num_key_value_heads // self.size)

    @property
    def kv_start(self) -> int:
        """The first KV head on this rank: the one its query heads read."""
        return self.rank * self.heads // self.cfg.num_queries_per_kv

    @property
    def vocab_rows(self) -> int:
        """Embedding and LM-head rows per rank (the last rank's are zero-padded)."""
        return -(-self.cfg.vocab_size // self.size)

    def spans(self) -> dict[str, tuple[int, int]]:
        """Feature ranges of this rank: ``q`` (its heads), ``kv``, ``mlp`` and ``vocab``."""
        d, inter, r = self.cfg.head_dim, self.cfg.intermediate_size // self.size, self.rank
        return {
            "q": (r * self.heads * d, (r + 1) * self.heads * d),
            "kv": (self.kv_start * d, (self.kv_start + self.kv_heads) * d),
            "mlp": (r * inter, (r + 1) * inter),
            "vocab": (r * self.vocab_rows, (r + 1) * self.vocab_rows),
        }

    def local_config(self) -> ModelConfig:
        """The config of this rank's model (its heads, intermediate and vocabulary slices)."""
        return dataclasses.replace(
            self.cfg,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            intermediate_size=self.cfg.intermediate_size // self.size,
            vocab_size=self.vocab_rows,
            head_dim=self.cfg.head_dim,
            bos_token_id=None,  # special ids index the whole vocabulary, not a slice of it
            eos_token_id=None,
            eos_token_ids=(),
        )

    def kv_layout(self, block_size: int) -> KVLayout:
        """The layout of this rank's KV shard (same block ids and sizes on every rank)."""
        cfg = self.cfg
        return KVLayout(cfg.num_hidden_layers, block_size, self.kv_heads, cfg.head_dim)


def shard_weights(weights: Mapping[str, torch.Tensor], shard: TPShard) -> dict[str, torch.Tensor]:
    """HF-named weights cut to ``shard``: projection rows or columns (a q/k/v bias by the rows
    of its projection), vocabulary rows (the last shard zero-padded); norms whole (a q/k norm
    acts on one head's ``head_dim`` features, the same on every rank)."""
    spans, out = shard.spans(), {}
    for name, w in weights.items():
        proj = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if proj in _ROW_SPLIT:
            lo, hi = spans[_ROW_SPLIT[proj]]
            w = w[lo:hi]
        elif proj in _COL_SPLIT:
            lo, hi = spans[_COL_SPLIT[proj]]
            w = w[:, lo:hi]
        elif name in (EMBED_NAME, LM_HEAD_NAME):
            lo, hi = spans["vocab"]
            w = F.pad(w[lo:hi], (0, 0, 0, hi - lo - w[lo:hi].shape[0]))
        out[name] = w.contiguous()
    return out
