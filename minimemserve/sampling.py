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
# Most alternatives a request may ask logprobs for (OpenAI's limit for top_logprobs).
MAX_LOGPROBS = 20
# A log-probability of -inf is reported as this (JSON has no infinity).
LOGPROB_FLOOR = -9999.0


def _scalar(kinds: type | tuple[type, ...], to: type) -> Callable[[Any], Any]:
    """Converter of a Python or numpy scalar of ``kinds`` (a bool is no number) to ``to``."""

    def convert(value: Any) -> Any:
        if isinstance(value, kinds) and (to is bool or not isinstance(value, bool)):
            return to(value)
        raise TypeError

    return convert


def _as_ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, (list, tuple, set, frozenset)):
        return tuple(map(_as_int, value))
    raise TypeError


_as_int, _as_float = _scalar(numbers.Integral, int), _scalar(numbers.Real, float)
_as_seed = lambda v: None if v is None else _as_int(v)
_IDS = range(INT64_LIMIT)  # seeds and token ids
# field -> (converter, raising TypeError or OverflowError; accepts the value; what is valid)
_FIELDS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], bool], str]] = {
    "max_tokens": (_as_int, lambda v: 1 <= v < INT64_LIMIT, "an integer in [1, 2**63)"),
    "temperature": (_as_float, lambda v: 0 <= v < math.inf, "a finite number >= 0"),
    "top_k": (_as_int, lambda v: -1 <= v < INT64_LIMIT, "-1 or 0 (off), or in [1, 2**63)"),
    "top_p": (_as_float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "seed": (_as_seed, lambda v: v is None or v in _IDS, "None or an integer in [0, 2**63)"),
    "stop_token_ids": (_as_ids, lambda v: all(t in _IDS for t in v), "integers in [0, 2**63)"),
    "ignore_eos": (_scalar((bool, np.bool_), bool), lambda v: True, "a bool"),
    "logprobs": (
        lambda v: None if v is None else _as_int(v),
        lambda v: v is None or 0 <= v <= MAX_LOGPROBS,
        f"None or an integer in [0, {MAX_LOGPROBS}]",
    ),
}


def token_seed(seed: int, n: int) -> int:
    """Seed of the generator drawing token ``n`` of a request seeded with ``seed``, 64-bit. The
    CPU generator keeps only its low 32 bits, so the high half is folded into them."""
    x = (seed * _SEED_STRIDE + n) & _U64_MASK
    return x ^ (x >> 32)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request. A temperature below ``GREEDY_TEMPERATURE`` is
    greedy; ``top_k=0`` (or -1) and ``top_p=1`` disable those filters. With a ``seed``, token n
    depends only on ``token_seed(seed, n)``. A bad value raises ``InvalidRequest`` naming the
    field; numpy scalars become Python values, ``stop_token_ids`` a tuple. With ``logprobs=k``
    each output token carries its log-probability and the ``k`` most likely alternatives."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        for name, (convert, valid, rule) in _FIELDS.items():
            raw = getattr(self, name)
            try:
                ok = valid(value := convert(raw))
            except (TypeError, OverflowError):
                ok = False
            if not ok:
                raise InvalidRequest(f"SamplingParams.{name} must be {rule}, got {shown(raw)}")
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        """True when the argmax is taken."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _draw(logits: torch.Tensor, row_max: torch.Tensor, p: SamplingParams, gen) -> int | None:
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
        drop = (sorted_p.cumsum(0) - sorted_p) >= p.top_p  # the mass before it reaches top_p
        drop[0] = False  # also when top_p is below the smallest fp32 and compares as 0
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p.masked_fill(drop, 0.0))
    if not 0 < float(probs.sum()) < math.inf:  # NaN if a probability is
        return None
    return int(torch.multinomial(probs.cpu(), 1, generator=gen).item())


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list:
    """For each row of ``logits`` ``[B, V]``: the log-probability of ``tokens[i]`` under the raw
    logits and the ``ks[i]`` most likely tokens with theirs (``TokenLogprob``)."""
    lp = torch.log_softmax(logits.float(), dim=-1).clamp_min(LOGPROB_FLOOR)  # [B, V]
    top = torch.topk(lp, max(ks), dim=-1) if max(ks) else None
    out = []
    for i, (tok, k) in enumerate(zip(tokens, ks)):
        alts = (
            []
            if top is None
            else list(zip(top.indices[i, :k].tolist(), top.values[i, :k].tolist()))
        )
        out.append((float(lp[i, tok]), alts))
    return out


def sample(
    logits: torch.Tensor,  # [B, V] fp32
    params: list[SamplingParams],
    num_generated: list[int],
    generator: torch.Generator,
) -> list[int]:
    """One token per row; rows without a seed draw from the engine's CPU ``generator``. Rows
    with NaN, +inf or only -inf raise ``SamplingError``, which carries the others' tokens."""
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
    if bad := [i for i, token in enumerate(out) if token is None]:
        message = f"logits of batch row(s) {bad} are not finite (NaN, +inf or all -inf)"
        raise SamplingError(message, rows=bad, tokens=out)
    return cast(list[int], out)
