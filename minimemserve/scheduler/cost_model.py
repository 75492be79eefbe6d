"""The operator-level prefill cost model the global scheduler routes with.

``exec(x, y)`` predicts the time of one prefill step for a prompt of ``x`` tokens whose
first ``x*y`` tokens are already cached; it is the sum of three fitted parts:

- linear layers (qkv, o, gate_up, down, lm_head): ``a*n + b``, ``n = x - round(x*y)`` new
  tokens (their FLOPs are proportional to the rows they multiply);
- prefix attention: ``a*x²*y + b*x² + c*x + d`` (the new queries attend to the cached
  prefix and causally to each other);
- everything else (embedding, norms, rotary, activations, batch metadata, scheduling and
  the step's own overhead): ``a*n + b``.

``transfer(n)`` predicts moving ``n`` tokens' KV between instances: ``a*bytes + b``.

The coefficients are fitted by least squares from real measurements of this engine on this
device: :func:`profile` runs prefills with a really cached prefix on an ``Engine`` and times
each operator class with hooks, and :func:`load_transfer_samples` reads the transfer
benchmark's results. ``bench/cost_model.py`` does both and reports the prediction error.
"""

from __future__ import annotations

import json
import math
import numbers
import operator
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Lowest token id of the random profiling prompts: 0-2 are <unk>, <s> and </s> in the presets.
FIRST_PROMPT_TOKEN = 3
# The transfer benchmark's row whose time stands for one request's KV move: shared memory,
# one send per aggregated block, one transfer at a time.
TRANSFER_ROW = ("shm", "by_request_aggregated", 1)
_PART_NAMES = ("linear", "attention", "other")
_FORMAT = "minimemserve.cost_model/1"


def _check_count(what: str, x: Any) -> int:
    """``x`` as a non-negative int, or a ValueError naming ``what``."""
    if isinstance(x, bool):
        raise ValueError(f"{what} must be an int, got {x!r}")
    try:
        x = operator.index(x)
    except TypeError:
        raise ValueError(f"{what} must be an int, got {x!r}") from None
    if x < 0:
        raise ValueError(f"{what} must be >= 0, got {x}")
    return x


def _check_x(x: Any) -> int:
    return _check_count("prompt length x", x)


def _check_y(y: Any) -> float:
    if isinstance(y, bool) or not isinstance(y, numbers.Real):
        raise ValueError(f"cached fraction y must be a number in [0, 1], got {y!r}")
    y = float(y)
    if not 0.0 <= y <= 1.0:  # also rejects NaN
        raise ValueError(f"cached fraction y must be in [0, 1], got {y}")
    return y


def _new_tokens(x: int, y: float) -> int:
    """Tokens computed by the prefill: the prompt minus its cached prefix."""
    return x - round(x * y)


@dataclass(frozen=True)
class OpSample:
    """One measured prefill step: ``x`` prompt tokens, a fraction ``y`` of them cached, and
    seconds spent in linear layers, attention, everything else, and the whole step
    (``total_s = linear_s + attention_s + other_s``)."""

    x: int
    y: float
    linear_s: float
    attention_s: float
    other_s: float
    total_s: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "x", _check_x(self.x))
        object.__setattr__(self, "y", _check_y(self.y))
        for name in ("linear_s", "attention_s", "other_s", "total_s"):
            v = getattr(self, name)
            if not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise ValueError(f"OpSample.{name} must be a finite number, got {v!r}")

    @property
    def new_tokens(self) -> int:
        """Tokens the step computed (``x`` less the cached prefix)."""
        return _new_tokens(self.x, self.y)


def _coefs(name: str, value: Any, size: int) -> tuple[float, ...]:
    try:
        out = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"CostModel.{name} must be {size} numbers, got {value!r}") from None
    if len(out) != size or not all(math.isfinite(v) for v in out):
        raise ValueError(f"CostModel.{name} must be {size} finite numbers, got {value!r}")
    return out


def _lstsq(rows: list[list[float]], targets: list[float]) -> tuple[float, ...]:
    """Least-squares coefficients of ``rows @ c ≈ targets`` (minimum norm when the rows do
    not determine every coefficient). Columns are scaled to unit norm first, because
    ``x²`` and ``1`` differ by six orders of magnitude."""
    a = torch.tensor(rows, dtype=torch.float64)  # [S, K]
    b = torch.tensor(targets, dtype=torch.float64)[:, None]  # [S, 1]
    norms = a.norm(dim=0)  # [K]
    norms = torch.where(norms > 0, norms, torch.ones_like(norms))  # an all-zero column stays 0
    sol = torch.linalg.lstsq(a / norms, b, driver="gelsd").solution[:, 0]  # [K]
    return tuple((sol / norms).tolist())


@dataclass(frozen=True)
class CostModel:
    """Predicted prefill time ``exec(x, y)`` for a prompt of ``x`` tokens with a fraction
    ``y`` already cached, built per operator; and ``transfer(n)`` for moving ``n`` tokens' KV.

    Coefficients are in seconds. Each part is clamped at zero, so a fit with a negative
    intercept never predicts negative time.
    """

    linear: tuple[float, float]  # all linear layers: a*n + b, n = new tokens
    attention: tuple[float, float, float, float]  # prefix attention: a*x²*y + b*x² + c*x + d
    other: tuple[float, float]  # norms, rotary, activations, embedding, step overhead: a*n + b
    transfer_coef: tuple[float, float] = (0.0, 0.0)  # seconds = a*bytes + b
    kv_bytes_per_token: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        object.__setattr__(self, "linear", _coefs("linear", self.linear, 2))
        object.__setattr__(self, "attention", _coefs("attention", self.attention, 4))
        object.__setattr__(self, "other", _coefs("other", self.other, 2))
        object.__setattr__(self, "transfer_coef", _coefs("transfer_coef", self.transfer_coef, 2))
        kv = self.kv_bytes_per_token
        if isinstance(kv, bool) or not isinstance(kv, numbers.Integral) or kv < 0:
            raise ValueError(f"CostModel.kv_bytes_per_token must be an int >= 0, got {kv!r}")
        object.__setattr__(self, "kv_bytes_per_token", int(kv))
        if not isinstance(self.device, str):
            raise ValueError(f"CostModel.device must be a string, got {self.device!r}")

    # ---- predictions ----------------------------------------------------------------------
    def parts(self, x: int, y: float) -> dict[str, float]:
        """Predicted seconds per operator class: ``{"linear", "attention", "other"}``.

        ``x = 0`` (nothing to compute) is zero for every part.
        """
        x, y = _check_x(x), _check_y(y)
        if x == 0:
            return dict.fromkeys(_PART_NAMES, 0.0)
        n = _new_tokens(x, y)
        la, lb = self.linear
        aa, ab, ac, ad = self.attention
        oa, ob = self.other
        return {
            "linear": max(0.0, la * n + lb),
            "attention": max(0.0, aa * x * x * y + ab * x * x + ac * x + ad),
            "other": max(0.0, oa * n + ob),
        }

    def exec(self, x: int, y: float) -> float:
        """Predicted seconds of the prefill step of ``x`` tokens with a fraction ``y`` cached."""
        return sum(self.parts(x, y).values())

    def transfer(self, num_tokens: int) -> float:
        """Predicted seconds to move ``num_tokens`` tokens' KV to another instance."""
        n = _check_count("num_tokens", num_tokens)
        if n == 0:
            return 0.0
        a, b = self.transfer_coef
        return max(0.0, a * n * self.kv_bytes_per_token + b)

    # ---- fitting --------------------------------------------------------------------------
    @classmethod
    def fit(
        cls,
        samples: Sequence[OpSample],
        transfer_samples: Sequence[tuple[int, float]] = (),
        kv_bytes_per_token: int = 0,
        device: str = "cpu",
    ) -> CostModel:
        """Least-squares fit of each operator's formula to measured ``samples``.

        ``transfer_samples`` are ``(bytes, seconds)`` pairs; with a single message size
        among them the line goes through the origin (a bandwidth), since one size cannot
        separate a fixed cost from a per-byte one. With none, ``transfer`` predicts 0.
        """
        samples = list(samples)
        if not samples:
            raise ValueError("CostModel.fit needs at least one OpSample")
        for i, s in enumerate(samples):
            if not isinstance(s, OpSample):
                raise ValueError(f"sample {i} is a {type(s).__name__}, not an OpSample")
        n_rows = [[float(s.new_tokens), 1.0] for s in samples]
        attn_rows = [[s.x * s.x * s.y, float(s.x * s.x), float(s.x), 1.0] for s in samples]
        linear = _lstsq(n_rows, [s.linear_s for s in samples])
        attention = _lstsq(attn_rows, [s.attention_s for s in samples])
        other = _lstsq(n_rows, [s.other_s for s in samples])
        return cls(
            linear=linear,
            attention=attention,
            other=other,
            transfer_coef=_fit_transfer(transfer_samples),
            kv_bytes_per_token=kv_bytes_per_token,
            device=device,
        )

    # ---- JSON -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (coefficients as lists)."""
        return {
            "format": _FORMAT,
            "linear": list(self.linear),
            "attention": list(self.attention),
            "other": list(self.other),
            "transfer_coef": list(self.transfer_coef),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "device": self.device,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        """Inverse of :meth:`to_dict`."""
        if not isinstance(d, dict):
            raise ValueError(f"a cost model dict is needed, got {type(d).__name__}")
        if d.get("format", _FORMAT) != _FORMAT:
            raise ValueError(f"unknown cost model format {d['format']!r}; expected {_FORMAT!r}")
        missing = [k for k in ("linear", "attention", "other") if k not in d]
        if missing:
            raise ValueError(f"cost model dict lacks {', '.join(missing)}")
        return cls(
            linear=d["linear"],
            attention=d["attention"],
            other=d["other"],
            transfer_coef=d.get("transfer_coef", (0.0, 0.0)),
            kv_bytes_per_token=d.get("kv_bytes_per_token", 0),
            device=d.get("device", "cpu"),
        )

    def save(self, path: str | Path) -> Path:
        """Write the model as JSON to ``path``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Read a model written by :meth:`save`, or the ``"model"`` entry of a JSON object
        that holds one (``bench/results/cost_model.json`` does)."""
        d = json.loads(Path(path).read_text())
        if isinstance(d, dict) and isinstance(d.get("model"), dict):
            d = d["model"]
        return cls.from_dict(d)


def _fit_transfer(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    pairs = [(float(b), float(s)) for b, s in samples]
    if not pairs:
        return (0.0, 0.0)
    if any(b < 0 or s < 0 or not math.isfinite(b + s) for b, s in pairs):
        raise ValueError(f"transfer samples must be (bytes >= 0, seconds >= 0), got {pairs}")
    if len({b for b, _ in pairs}) == 1:  # one size: a bandwidth through the origin
        bb = sum(b * b for b, _ in pairs)
        return (sum(b * s for b, s in pairs) / bb if bb else 0.0, 0.0)
    a, b = _lstsq([[b, 1.0] for b, _ in pairs], [s for _, s in pairs])
    return (a, b)


def load_transfer_samples(
    json_path: str | Path,
    transport: str = TRANSFER_ROW[0],
    mode: str = TRANSFER_ROW[1],
    concurrency: int = TRANSFER_ROW[2],
) -> list[tuple[int, float]]:
    """``(bytes, seconds)`` samples from ``bench/transfer.py``'s JSON results.

    Takes the rows of ``transport``/``mode``/``concurrency`` (by default shared memory, one
    send per aggregated block, one transfer at a time): ``bytes_per_round`` and
    ``ms_median``. A run of the benchmark holds one such row (one request size); pass
    several files' samples to :meth:`CostModel.fit` to separate the fixed cost. Returns an
    empty list when the file has no such row.
    """
    data = json.loads(Path(json_path).read_text())
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"{json_path}: no 'rows' list (not a bench/transfer.py result)")
    want = (transport, mode, concurrency)
    return [
        (int(r["bytes_per_round"]), float(r["ms_median"]) * 1e-3)
        for r in rows
        if (r.get("transport"), r.get("mode"), r.get("concurrency")) == want
    ]


# ---- profiling ----------------------------------------------------------------------------
class _OpClock:
    """Accumulates wall time spent in linear layers and in the attention backend."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.linear = 0.0
        self.attention = 0.0
        self._t0 = 0.0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def reset(self) -> None:
        self.linear = self.attention = 0.0

    def start(self) -> None:
        self.sync()
        self._t0 = time.perf_counter()

    def elapsed(self) -> float:
        self.sync()
        return time.perf_counter() - self._t0


@contextmanager
def _timed_operators(engine, clock: _OpClock) -> Iterator[None]:
    """Hooks on every ``nn.Linear`` and a wrapper around the backend's ``forward``, for the
    duration of the block; everything is removed afterwards."""
    handles = []

    def pre(module, args):
        clock.start()

    def post(module, args, output):
        clock.linear += clock.elapsed()

    for module in engine.model.modules():
        if isinstance(module, nn.Linear):
            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post))
    backends = {id(b): b for b in (engine.backend, engine.runner.backend)}.values()
    saved = []
    for backend in backends:
        inner = backend.forward
        own = vars(backend).get("forward")  # an instance attribute to put back, if any

        def timed(*args, _inner=inner, **kwargs):
            clock.start()
            out = _inner(*args, **kwargs)
            clock.attention += clock.elapsed()
            return out

        backend.forward = timed
        saved.append((backend, own))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for backend, own in saved:
            if own is None:
                del backend.forward
            else:
                backend.forward = own


def _run_to_end(engine, ids: list[int], params) -> Any:
    """Run one request alone until it finishes; returns its RequestOutput."""
    rid = engine.add_request(ids, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                if out.finish_reason == "error":
                    raise RuntimeError(f"profiling request failed: {out.error}")
                return out
    raise RuntimeError("profiling request vanished without finishing")


def _check_engine(engine, lengths: list[int], fractions: list[float], repeats: int) -> None:
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not lengths or not fractions:
        raise ValueError("profile needs at least one length and one fraction")
    if engine.has_unfinished():
        raise ValueError("profile needs an idle engine (it has unfinished requests)")
    if any(f > 0 for f in fractions) and not engine.recipe.caching:
        raise ValueError(
            f"engine recipe {engine.recipe.name!r} caches nothing: build it with "
            "config='PD-CC' to profile cached fractions > 0"
        )
    budget = engine.scheduler.max_num_batched_tokens
    for x in lengths:
        if x < 1:
            raise ValueError(f"lengths must be >= 1, got {x}")
        if x >= engine.max_model_len:
            raise ValueError(
                f"length {x} does not fit the context of {engine.max_model_len} tokens "
                "(prompt plus one generated token)"
            )
        if x > budget:
            raise ValueError(
                f"length {x} exceeds the engine's token budget max_num_batched_tokens={budget}, "
                "so its prefill would take several steps; build the engine with a larger budget"
            )


def profile(
    engine,
    lengths: Sequence[int] = (64, 128, 256, 512, 1024),
    fractions: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 0.9),
    repeats: int = 3,
    progress: bool = True,
    seed: int = 0,
    warmup: bool = True,
) -> list[OpSample]:
    """Measure real prefill steps of ``engine`` for every (length, cached fraction).

    ``engine`` is an idle :class:`minimemserve.engine.Engine` with a caching config
    (``"PD-CC"``) whose ``max_num_batched_tokens`` covers the longest length. For each
    point a random prompt of ``x`` tokens is drawn; a first request over its first
    ``round(x*f)`` tokens, cut to whole blocks, puts that prefix in the pool's cache; then
    the full prompt runs with ``max_tokens=1`` and its single step (the prefill) is timed.
    Linear layers and the attention backend are timed by hooks; ``other`` is the rest of
    the step. The sample's ``y`` is the fraction the engine really found cached.

    Each point is run ``repeats`` times with fresh prompts and the repeat with the median
    total is returned (its parts sum to its total). With ``warmup`` one unrecorded prefill
    per length runs first. Every prompt is deleted from the cache afterwards, so the pool
    ends as it began. Returns one sample per point, lengths outer, fractions inner.
    """
    from tqdm.auto import tqdm

    from ..sampling import SamplingParams

    lengths = [_check_x(x) for x in lengths]
    fractions = [_check_y(f) for f in fractions]
    _check_engine(engine, lengths, fractions, repeats)
    pool = engine.pool
    bs = pool.block_size
    vocab = engine.model_config.vocab_size
    if vocab <= FIRST_PROMPT_TOKEN:
        raise ValueError(f"vocabulary of {vocab} tokens is too small for random prompts")
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    clock = _OpClock(engine.device)

    def measure(x: int, f: float) -> OpSample:
        ids = torch.randint(FIRST_PROMPT_TOKEN, vocab, (x,), generator=gen).tolist()
        prefix = round(x * f) // bs * bs
        try:
            if prefix:
                _run_to_end(engine, ids[:prefix], params)
            rid = engine.add_request(ids, params)
            clock.reset()
            clock.sync()
            t0 = time.perf_counter()
            outs = engine.step()
            clock.sync()
            total = time.perf_counter() - t0
            if [o.request_id for o in outs] != [rid] or engine.has_unfinished():
                raise RuntimeError(f"the prefill of {x} tokens did not finish in one step")
            cached = outs[0].metrics.cached_tokens
        finally:
            pool.delete(ids)
        linear, attention = clock.linear, clock.attention
        return OpSample(x, cached / x, linear, attention, total - linear - attention, total)

    samples = []
    with _timed_operators(engine, clock):
        if warmup:
            for x in tqdm(lengths, desc="warm-up", disable=not progress, leave=False):
                measure(x, fractions[len(fractions) // 2])
        bar = tqdm(
            total=len(lengths) * len(fractions) * repeats, desc="profile", disable=not progress
        )
        with bar:
            for x in lengths:
                for f in fractions:
                    runs = []
                    for _ in range(repeats):
                        runs.append(measure(x, f))
                        bar.update()
                    med = statistics.median_low([r.total_s for r in runs])
                    samples.append(next(r for r in runs if r.total_s == med))
    return samples
