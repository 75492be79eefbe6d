"""The parallel layers a rank's model uses in place of the embedding, the LM head and the
``o``/``down`` projections, over its compute group's collectives; :func:`build_model` puts them
in a family's flat model after construction."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..model import registry
from ..model.layers import CausalLM
from .shard import TPShard, shard_weights


class Collectives:
    """The compute-group collectives of one rank (what the parallel layers call)."""

    def __init__(self, group, size: int):
        self.group = group
        self.size = size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        self.group.allreduce(x).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, in rank order: one
        gather into one buffer (the form a CUDA graph captures), then one copy."""
        x = x.contiguous()
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        self.group._allgather_base(out, x).wait()  # [size * rows, ...], rank-major
        return out.view(self.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], -1)


class RowParallelLinear(nn.Linear):
    """A bias-free linear layer over this rank's slice of the input features; the partial
    outputs of all ranks are summed by one all-reduce."""

    def __init__(self, in_features: int, out_features: int, comm: Collectives):
        super().__init__(in_features, out_features, bias=False)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / n] -> [T, out]
        return self.comm.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Embedding):
    """Embedding rows ``[first, first + rows)`` of the vocabulary; other ids give zeros here
    and their rows on the rank holding them, summed by one all-reduce."""

    def __init__(self, rows: int, dim: int, first: int, comm: Collectives):
        super().__init__(rows, dim)
        self.first = first
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        local = ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.comm.all_reduce(x.masked_fill_(outside[:, None], 0.0))


class VocabParallelHead(nn.Linear):
    """LM head over this rank's vocabulary rows; the logits of all ranks are gathered and the
    padding cut off, so every rank returns the whole ``[B, vocab]``."""

    def __init__(self, dim: int, rows: int, vocab: int, comm: Collectives):
        super().__init__(dim, rows, bias=False)
        self.vocab = vocab
        self.comm = comm

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [B, hidden] -> [B, vocab]
        return self.comm.all_gather(super().forward(h))[:, : self.vocab]


def build_model(weights: Mapping[str, torch.Tensor], shard: TPShard, comm: Collectives) -> CausalLM:
    """This rank's model: the family's flat model at the shard's sizes, with the parallel
    layers in place of the embedding, the LM head and every ``o``/``down`` projection."""
    local, hidden = shard.local_config(), shard.cfg.hidden_size
    model = registry.build_model(local)
    model.embed_tokens = VocabParallelEmbedding(
        local.vocab_size, hidden, shard.spans()["vocab"][0], comm
    )
    model.lm_head = VocabParallelHead(hidden, local.vocab_size, shard.cfg.vocab_size, comm)
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.q_size, hidden, comm)
        layer.mlp.down_proj = RowParallelLinear(local.intermediate_size, hidden, comm)
    model.load_hf_weights(shard_weights(weights, shard))
    return model
