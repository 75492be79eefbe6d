"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import InvalidRequest

_SEED_STRIDE = 1_000_003  # seeds of successive tokens of one request never collide across requests


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request.

    ``temperature=0`` is greedy (deterministic). ``top_k=0`` and ``top_p=1`` disable those
    filters. With ``seed`` set, the n-th token is drawn from a generator seeded by
    ``(seed, n)`` alone, so the result does not depend on batching, preemption or on which
    instance computes the token.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequest(
                f"top_k must be 0 or -1 (off) or a positive integer, got {self.top_k!r}"
            )
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequest(f"seed must be an integer or None, got {self.seed!r}")
        stops = tuple(self.stop_token_ids)
        if not all(isinstance(t, int) and t >= 0 for t in stops):
            raise InvalidRequest(f"stop_token_ids must be non-negative integers, got {stops!r}")
        object.__setattr__(self, "stop_token_ids", stops)

    @property
    def greedy(self) -> bool:
        """True when the argmax is taken."""
        return self.temperature == 0.0 or self.top_k == 1


def sample(
    logits: torch.Tensor,  # [B, V] fp32
    params: list[SamplingParams],
    num_generated: list[int],
    generator: torch.Generator,
) -> list[int]:
    """One token per row. Rows without a seed draw from the engine's CPU ``generator``."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature  # [V]
        if p.top_k > 0 and p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            # drop a token when the mass before it already reaches top_p (the first always stays)
            drop = (sorted_p.cumsum(0) - sorted_p) >= p.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        gen = generator
        if p.seed is not None:
            gen = torch.Generator().manual_seed(p.seed * _SEED_STRIDE + num_generated[i])
        out[i] = int(torch.multinomial(probs.cpu(), 1, generator=gen).item())
    return out
