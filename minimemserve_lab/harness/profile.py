"""Measurements the prefill cost model is fitted from.

:func:`profile` runs real prefills with a really cached prefix on an ``Engine`` and times
each operator class with hooks; :func:`load_transfer_samples` reads the transfer benchmark's
results. ``bench/cost_model.py`` feeds both to :meth:`CostModel.fit` and reports the
prediction error.
"""

from __future__ import annotations

import functools
import json
import operator
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from minimemserve.engine import Engine
from minimemserve.request import RequestOutput
from minimemserve.sampling import SamplingParams
from minimemserve.scheduler.cost_model import OpSample

# Lowest token id of the random profiling prompts: 0-2 are <unk>, <s> and </s> in the presets.
FIRST_PROMPT_TOKEN = 3
# The transfer benchmark's row whose time stands for one request's KV move: shared memory,
# one send per aggregated block, one transfer at a time.
TRANSFER_ROW = ("shm", "by_request_aggregated", 1)


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
def _timed_operators(engine: Engine, clock: _OpClock) -> Iterator[None]:
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


def _run_to_end(engine: Engine, ids: list[int], params: SamplingParams) -> RequestOutput:
    """Run one request alone until it finishes; returns its output."""
    rid = engine.add_request(ids, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                if out.finish_reason == "error":
                    raise RuntimeError(f"profiling request failed: {out.error}")
                return out
    raise RuntimeError("profiling request vanished without finishing")


def _check_engine(engine: Engine, lengths: list[int], fractions: list[float], repeats: int) -> None:
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not lengths or not fractions:
        raise ValueError("profile needs at least one length and one fraction")
    if not all(0.0 <= f <= 1.0 for f in fractions):
        raise ValueError(f"cached fractions must be in [0, 1], got {fractions}")
    if engine.has_unfinished():
        raise ValueError("profile needs an idle engine (it has unfinished requests)")
    if any(f > 0 for f in fractions) and not engine.recipe.caches:
        raise ValueError(
            "the engine caches nothing: build it with config='PD-CC' to profile cached "
            "fractions > 0"
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


def _measure_prefill(engine: Engine, clock: _OpClock, gen, x: int, f: float) -> OpSample:
    """Time one prefill of ``x`` random tokens with a cached fraction ``f`` (whole blocks)."""
    ids = torch.randint(FIRST_PROMPT_TOKEN, engine.model_config.vocab_size, (x,), generator=gen)
    ids = ids.tolist()
    prefix = round(x * f) // engine.pool.block_size * engine.pool.block_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
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
        engine.pool.delete(ids)
    linear, attention = clock.linear, clock.attention
    return OpSample(x, cached / x, linear, attention, total - linear - attention, total)


def profile(
    engine: Engine,
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
    lengths = [operator.index(x) for x in lengths]
    fractions = [float(f) for f in fractions]
    _check_engine(engine, lengths, fractions, repeats)
    vocab = engine.model_config.vocab_size
    if vocab <= FIRST_PROMPT_TOKEN:
        raise ValueError(f"vocabulary of {vocab} tokens is too small for random prompts")
    gen = torch.Generator().manual_seed(seed)
    clock = _OpClock(engine.device)
    measure = functools.partial(_measure_prefill, engine, clock, gen)

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
