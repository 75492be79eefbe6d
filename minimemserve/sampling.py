"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seed;
and the logit adjustments applied before it, batched over the rows that ask for them:
frequency and presence penalties, a logit bias, and ``min_tokens`` (stop tokens masked)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
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
# OpenAI's ranges: penalties in [-2, 2], a logit bias in [-100, 100] per token.
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
# Most tokens one request may bias (OpenAI documents no limit; this bounds the work per row).
MAX_BIASED_TOKENS = 1024


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


def _as_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """A ``{token id: bias}`` mapping, or ``(id, bias)`` pairs, as sorted pairs."""
    pairs = value.items() if isinstance(value, Mapping) else value
    if not isinstance(pairs, (list, tuple)) and not isinstance(value, Mapping):
        raise TypeError
    out = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise TypeError
        out[_as_int(pair[0])] = _as_float(pair[1])
    return tuple(sorted(out.items()))


def _bias_ok(pairs: tuple[tuple[int, float], ...]) -> bool:
    return len(pairs) <= MAX_BIASED_TOKENS and all(
        t in _IDS and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for t, b in pairs
    )


_as_int, _as_float = _scalar(numbers.Integral, int), _scalar(numbers.Real, float)
_as_seed = lambda v: None if v is None else _as_int(v)
_IDS = range(INT64_LIMIT)  # seeds and token ids
_PENALTY = (
    _as_float,
    lambda v: -MAX_PENALTY <= v <= MAX_PENALTY,
    f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
)
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
    "frequency_penalty": _PENALTY,
    "presence_penalty": _PENALTY,
    "logit_bias": (
        _as_bias,
        _bias_ok,
        f"a mapping of up to {MAX_BIASED_TOKENS} token ids in [0, 2**63) to numbers in "
        f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
    ),
    "min_tokens": (_as_int, lambda v: 0 <= v < INT64_LIMIT, "an integer in [0, 2**63)"),
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
    each output token carries its log-probability and the ``k`` most likely alternatives (of
    the raw logits, before the adjustments below).

    As OpenAI defines them, before sampling the logit of each token ``j`` becomes
    ``logit[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty + logit_bias[j]``,
    where ``c[j]`` counts ``j`` among the tokens generated so far (not the prompt's).
    ``logit_bias`` maps token ids to numbers in [-100, 100] (stored as sorted ``(id, bias)``
    pairs). Until ``min_tokens`` tokens were generated, the stop tokens (``stop_token_ids``
    and, unless ``ignore_eos``, the model's EOS) cannot be sampled."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_tokens: int = 0

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
        if self.min_tokens > self.max_tokens:
            raise InvalidRequest(
                f"SamplingParams.min_tokens must be at most max_tokens ({self.max_tokens}), "
                f"got {self.min_tokens}"
            )

    @property
    def greedy(self) -> bool:
        """True when the argmax is taken."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """True when a frequency or presence penalty applies."""
        return bool(self.frequency_penalty or self.presence_penalty)

    @property
    def adjusts_logits(self) -> bool:
        """True when a penalty, a logit bias or ``min_tokens`` changes the logits."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0


def _output_counts(outputs: list[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """``[R, vocab]`` fp32: how often each token occurs in each row's generated tokens."""
    width = max(map(len, outputs), default=0)
    ids = np.full((len(outputs), width + 1), vocab, dtype=np.int64)  # vocab: a padding column
    for r, out in enumerate(outputs):
        ids[r, : len(out)] = np.asarray(out, dtype=np.int64)
    ids_t = torch.from_numpy(ids).to(device).clamp_(0, vocab)  # [R, width + 1]
    counts = torch.zeros(len(outputs), vocab + 1, device=device)
    counts.scatter_add_(1, ids_t, torch.ones_like(ids_t, dtype=counts.dtype))
    return counts[:, :vocab]


def _scatter(logits: torch.Tensor, cells: list[tuple[int, int, float]], accumulate: bool) -> None:
    """Add (``accumulate``) or write ``value`` at each ``(row, token, value)`` of ``logits``;
    tokens outside the vocabulary are skipped."""
    cells = [c for c in cells if c[1] < logits.shape[1]]
    if cells:
        rows, toks, vals = zip(*cells)
        index = (torch.tensor(rows, device=logits.device), torch.tensor(toks, device=logits.device))
        values = torch.tensor(vals, dtype=logits.dtype, device=logits.device)
        logits.index_put_(index, values, accumulate=accumulate)


def adjust_logits(
    logits: torch.Tensor,  # [B, V] fp32
    params: list[SamplingParams],
    outputs: Callable[[int], Sequence[int]],
    eos_ids: Sequence[int],
) -> torch.Tensor:
    """``logits`` with each row's penalties, logit bias and ``min_tokens`` mask applied (see
    :class:`SamplingParams`), as a few tensor operations over the rows that ask for any; the
    same tensor, untouched, when none does. ``outputs(i)`` is row ``i``'s generated tokens."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    logits = logits.clone()
    if pen := [i for i in rows if params[i].penalized]:
        counts = _output_counts([outputs(i) for i in pen], logits.shape[1], logits.device)
        freq = [params[i].frequency_penalty for i in pen]
        pres = [params[i].presence_penalty for i in pen]
        col = lambda xs: torch.tensor(xs, device=logits.device)[:, None]  # [R, 1]
        logits[pen] -= counts * col(freq) + (counts > 0).float() * col(pres)
    _scatter(logits, [(i, t, b) for i in rows for t, b in params[i].logit_bias], True)
    masked = [
        (i, t, -math.inf)
        for i in rows
        if len(outputs(i)) < params[i].min_tokens
        for t in (*params[i].stop_token_ids, *(() if params[i].ignore_eos else eos_ids))
    ]
    _scatter(logits, masked, False)
    return logits


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
