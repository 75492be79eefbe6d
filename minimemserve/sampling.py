"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seed."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from .errors import InvalidRequest, SamplingError, shown

_SEED_STRIDE = 1_000_003  # spreads the per-token seeds of one request apart
_U64_MASK = 2**64 - 1  # per-token seeds wrap to 64 bits, the range of torch.Generator seeds
INT64_LIMIT = 2**63  # counts, seeds and token ids fit a signed 64-bit int (numpy, msgpack, JSON)
# Below this temperature sampling is greedy: softmax(logits / T) is one-hot for all purposes.
GREEDY_TEMPERATURE = 1e-5


_INVALID: Any = object()  # what a converter returns for a value of the wrong type


def _as_int(value: Any) -> int:
    """An integer (Python or numpy, not bool) as ``int``."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return _INVALID


def _as_float(value: Any) -> float:
    """A real number (Python or numpy, not bool) as ``float``."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an int beyond the float range
            pass
    return _INVALID


def _as_bool(value: Any) -> bool:
    return bool(value) if isinstance(value, (bool, np.bool_)) else _INVALID


def _as_seed(value: Any) -> int | None:
    return None if value is None else _as_int(value)


def _stop_ids(value: Any) -> tuple[int, ...]:
    """``stop_token_ids`` as a tuple of ints."""
    if not isinstance(value, (list, tuple, set, frozenset)):
        return _INVALID
    ids = tuple(_as_int(t) for t in value)
    return ids if all(t is not _INVALID for t in ids) else _INVALID


# field -> (converter, accepts the converted value, what a valid value is)
_FIELDS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], bool], str]] = {
    "max_tokens": (_as_int, lambda v: 1 <= v < INT64_LIMIT, "an integer in [1, 2**63)"),
    "temperature": (_as_float, lambda v: 0 <= v < math.inf, "a finite number >= 0"),
    "top_k": (
        _as_int,
        lambda v: v == -1 or 0 <= v < INT64_LIMIT,
        "0 or -1 (off), or an integer in [1, 2**63)",
    ),
    "top_p": (_as_float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "seed": (
        _as_seed,
        lambda v: v is None or 0 <= v < INT64_LIMIT,
        "None or an integer in [0, 2**63)",
    ),
    "stop_token_ids": (
        _stop_ids,
        lambda v: all(0 <= t < INT64_LIMIT for t in v),
        "a list, tuple or set of integers in [0, 2**63)",
    ),
    "ignore_eos": (_as_bool, lambda v: True, "a bool"),
}


def token_seed(seed: int, n: int) -> int:
    """Seed of the generator that draws token ``n`` of a request seeded with ``seed``.

    A function of ``(seed, n)`` alone, always within torch's 64-bit seed range. The CPU
    generator keeps only the low 32 bits of its seed, so the high half is folded into them:
    seeds that differ only above bit 32 still draw different tokens.
    """
    x = (seed * _SEED_STRIDE + n) & _U64_MASK
    return x ^ (x >> 32)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request.

    ``temperature=0`` is greedy (deterministic), and so is any temperature below
    ``GREEDY_TEMPERATURE`` (1e-5): at such temperatures the distribution is the argmax, and
    dividing logits by them only risks overflow. ``top_k=0`` (or -1) and ``top_p=1`` disable
    those filters. With ``seed`` set (any integer in [0, 2**63), e.g. ``time.time_ns()``), the
    n-th token is drawn from a generator seeded by :func:`token_seed` of ``(seed, n)`` alone,
    so the result does not depend on batching, preemption or on which instance computes it.

    Every field is checked on construction: a value of the wrong type or out of range raises
    ``InvalidRequest`` naming the field. Numpy scalars are accepted and stored as the Python
    value; bools are not counts and are rejected for ``max_tokens``, ``top_k`` and ``seed``.
    ``stop_token_ids`` is stored as a tuple; an id outside the vocabulary never matches.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        for name, (convert, valid, rule) in _FIELDS.items():
            raw = getattr(self, name)
            value = convert(raw)
            if value is _INVALID or not valid(value):
                raise InvalidRequest(f"SamplingParams.{name} must be {rule}, got {shown(raw)}")
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        """True when the argmax is taken."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _draw(
    logits: torch.Tensor, row_max: torch.Tensor, p: SamplingParams, gen: torch.Generator
) -> int | None:
    """One token from a row of finite-maximum logits ``[V]``; None if no distribution results."""
    row = logits / p.temperature  # [V]
    if not torch.isfinite(row).all():  # the division overflowed: shift first (same softmax)
        row = (logits - row_max) / p.temperature
    if p.top_k > 0 and p.top_k < row.shape[0]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = (sorted_p.cumsum(0) - sorted_p) >= p.top_p
        drop[0] = False  # also when top_p is below the smallest fp32 and compares as 0
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    total = float(probs.sum())  # NaN if a probability is
    if not 0 < total < math.inf:
        return None
    return int(torch.multinomial(probs.cpu(), 1, generator=gen).item())


def sample(
    logits: torch.Tensor,  # [B, V] fp32
    params: list[SamplingParams],
    num_generated: list[int],
    generator: torch.Generator,
) -> list[int]:
    """One token per row. Rows without a seed draw from the engine's CPU ``generator``.

    A row whose logits hold NaN or +inf, or only -inf, has no distribution to draw from:
    the other rows are still sampled, then ``SamplingError`` names the bad rows and carries
    the tokens of the good ones, so the caller can fail those requests alone.
    """
    row_max = logits.max(dim=-1).values  # [B]; NaN if the row holds a NaN
    finite = torch.isfinite(row_max).tolist()
    out: list[int | None] = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not finite[i]:
            out[i] = None
        elif not p.greedy:
            gen = generator
            if p.seed is not None:
                gen = torch.Generator().manual_seed(token_seed(p.seed, num_generated[i]))
            out[i] = _draw(logits[i], row_max[i], p, gen)
    bad = [i for i, token in enumerate(out) if token is None]
    if bad:
        raise SamplingError(
            f"logits of batch row(s) {bad} are not finite (NaN, +inf or all -inf): "
            "no token can be sampled for them",
            rows=bad,
            tokens=out,
        )
    return cast(list[int], out)
