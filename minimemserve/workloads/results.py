"""What a replayed workload measured: one record per turn, its summary and whether the run
reached a steady state. Shared by ``minimemserve bench`` (real runs) and ``minimemserve sim``
(simulated ones), so both measure the same numbers the same way; the lab reports them
(``minimemserve_lab.report``: gains, the comparison table and its plots).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from minimemserve.request import RequestMetrics, RequestOutput
from minimemserve.sampling import SamplingParams

from .sessions import Session, Turn

# The configurations and workload ``minimemserve bench`` and ``sim`` compare by default, sized
# so the real runs finish in a few minutes on a 2-core CPU with the tiny preset model.
DEFAULT_CONFIGS = ("PD", "PD-CC", "1P1D", "1P1D-CC")
DEFAULT_WORKLOAD = "sharegpt"
DEFAULT_SESSIONS = 16
DEFAULT_RATE = 1.0  # sessions per second
# Percentile reported beside the mean.
TAIL_PERCENTILE = 99.0
_METRICS = ("ttft", "jct", "tpot")
# The stability rule (docs/simulator.md, "Stability"): a run is stable when the mean number of
# requests in system over the last quarter of its arrival window, q4, is at most
# STABLE_GROWTH * e + STABLE_NOISE * sqrt(e) + STABLE_SLACK, where e = q2 * a4 / a2 is the
# second quarter's mean q2 scaled by the requests arriving in each quarter (a4 over a2). A queue
# that grows for the whole run fails it; time averages, not counts at one instant, scaling by
# the arrivals (a Poisson process's busy and quiet quarters) and the square-root term (a
# Poisson count's spread) keep chance from failing it.
STABLE_GROWTH = 1.25
STABLE_NOISE = 2.0
STABLE_SLACK = 2.0


def greedy_params(turn: Turn) -> SamplingParams:
    """Sampling parameters of a benchmark turn: greedy, exactly ``turn.max_tokens`` tokens."""
    return _greedy(turn.max_tokens)


@functools.lru_cache(maxsize=4096)
def _greedy(max_tokens: int) -> SamplingParams:
    """One (immutable) ``SamplingParams`` per answer length."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def record(
    config: str,
    session: Session,
    turn: int,
    arrival: float,
    out: RequestOutput | None,
    prompt_tokens: int = 0,
    error: str | None = None,
) -> dict:
    """One row of the results: a finished turn, or (``out`` None) one the engine rejected."""
    m = out.metrics if out else RequestMetrics(arrival_time=arrival)  # rejected: nothing measured
    if out is not None:
        prompt_tokens = len(out.prompt_token_ids)
        if out.finish_reason == "error":
            error = out.error or "failed"
    return {
        "config": config,
        "session": session.id,
        "turn": turn,
        "arrival": arrival,
        "prompt_tokens": prompt_tokens,
        "output_tokens": len(out.token_ids) if out else 0,
        "cached_tokens": m.cached_tokens,
        "ttft": m.ttft,
        "jct": m.latency,
        "tpot": m.tpot,
        "transferred_bytes": m.transferred_bytes,
        "handoff_bytes": m.handoff_bytes,
        "handoff_seconds": m.handoff_seconds,
        "preemptions": m.preemptions,
        "finish_reason": out.finish_reason if out else "error",
        "error": error,
    }


def stopped_record(
    config: str,
    session: Session,
    turn: int,
    arrival: float,
    prompt_tokens: int,
    metrics: RequestMetrics | None = None,
) -> dict:
    """The row of a turn a run stopped before it finished (``"stopped": True``): what it
    measured by then (``metrics``; None when it never reached an engine), its TTFT if its first
    token came, no end (``jct`` and ``tpot`` None). :func:`stability` counts it as in system
    for ever."""
    m = metrics or RequestMetrics(arrival_time=arrival)
    return record(config, session, turn, arrival, None, prompt_tokens) | {
        "output_tokens": m.output_tokens,
        "cached_tokens": m.cached_tokens,
        "ttft": m.ttft,
        "transferred_bytes": m.transferred_bytes,
        "handoff_bytes": m.handoff_bytes,
        "handoff_seconds": m.handoff_seconds,
        "preemptions": m.preemptions,
        "finish_reason": None,
        "stopped": True,
    }


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _tail(values: Sequence[float]) -> float | None:
    return float(np.percentile(values, TAIL_PERCENTILE)) if values else None


def summarize(records: Iterable[dict]) -> dict[str, Any]:
    """Mean and P99 of TTFT, JCT and TPOT, overall and for turns after the first.

    Keys: ``requests``, ``errors``, ``{ttft,jct,tpot}_{mean,p99}`` and the same with a
    ``_later`` suffix (turn > 0), ``cached_ratio`` (cached / prompt tokens, also
    ``cached_ratio_later``), ``prompt_tokens``, ``output_tokens``, ``cached_tokens``,
    ``transferred_bytes``. Failed requests count only in ``errors``, those a stopped run left
    unfinished only in ``stopped``; a statistic over no values is None.
    """
    records = list(records)
    ok = [r for r in records if r.get("error") is None and not r.get("stopped")]
    later = [r for r in ok if r["turn"] > 0]
    out: dict[str, Any] = {
        "requests": len(records),
        "errors": sum(1 for r in records if r.get("error") is not None),
        "stopped": sum(1 for r in records if r.get("stopped")),
    }
    for suffix, group in (("", ok), ("_later", later)):
        for metric in _METRICS:
            values = [r[metric] for r in group if r.get(metric) is not None]
            out[f"{metric}_mean{suffix}"] = _mean(values)
            out[f"{metric}_p99{suffix}"] = _tail(values)
        prompt = sum(r["prompt_tokens"] for r in group)
        cached = sum(r["cached_tokens"] for r in group)
        out[f"cached_ratio{suffix}"] = cached / prompt if prompt else None
    out["prompt_tokens"] = sum(r["prompt_tokens"] for r in ok)
    out["output_tokens"] = sum(r["output_tokens"] for r in ok)
    out["cached_tokens"] = sum(r["cached_tokens"] for r in ok)
    out["transferred_bytes"] = sum(r["transferred_bytes"] for r in ok)
    out["stability"] = stability(records)
    return out


def _end(r: dict) -> float:
    """When a request left the system: its end, its arrival when it failed, never when its run
    stopped before it finished."""
    if r.get("error") is not None:
        return r["arrival"]
    return math.inf if r.get("stopped") else r["arrival"] + r["jct"]


def stability(records: Iterable[dict]) -> dict[str, Any]:
    """Whether a replay reached a steady state: the arrival window (first to last session
    start, ``window_s``), ``makespan_ratio`` (first start to last end, over the window), the
    requests in system (arrived, not finished) at the end of each quarter of the window and
    their mean over each quarter, the requests arriving in each quarter (``arrivals``) and their
    mean TTFT (``ttft_trend``), and ``stable`` by the one rule (:data:`STABLE_GROWTH`,
    :data:`STABLE_NOISE`, :data:`STABLE_SLACK`); a window of zero is stable.

    Every number the verdict is made of involves times up to the window's end alone, so a run
    stopped there (its unfinished requests' rows marked ``"stopped"``: in system for ever) gets
    the verdict, ``in_system``, ``mean_in_system`` and ``arrivals`` the whole run gets (the sums
    are exact, in any order); its ``makespan_ratio`` is None and its ``ttft_trend`` counts the
    first tokens before the stop."""
    records = [
        r
        for r in records
        if r.get("jct") is not None or r.get("error") is not None or r.get("stopped")
    ]
    starts = [r["arrival"] for r in records if r["turn"] == 0]
    if not starts:
        return {
            "window_s": 0.0,
            "makespan_ratio": None,
            "in_system": [],
            "mean_in_system": [],
            "ttft_trend": [],
            "arrivals": [],
            "stable": True,
        }
    t0, window = min(starts), max(starts) - min(starts)
    ends = [_end(r) for r in records]
    marks = [t0 + window * q / 4 for q in (0, 1, 2, 3, 4)]
    in_system = [sum(1 for r, e in zip(records, ends) if r["arrival"] <= m < e) for m in marks[1:]]
    mean_in_system = [
        math.fsum(max(0.0, min(e, hi) - max(r["arrival"], lo)) for r, e in zip(records, ends))
        / (hi - lo)
        if hi > lo
        else 0.0
        for lo, hi in zip(marks, marks[1:])
    ]
    quarters: list[list[float]] = [[], [], [], []]  # TTFTs by the quarter they arrived in
    arrivals = [0, 0, 0, 0]
    for r in records:
        if r["arrival"] <= marks[-1]:
            q = min(int(4 * (r["arrival"] - t0) / window), 3) if window > 0 else 3
            arrivals[q] += 1
            if r.get("ttft") is not None:
                quarters[q].append(r["ttft"])
    trend = [_mean(q) for q in quarters]
    expected = mean_in_system[1] * (arrivals[3] / arrivals[1] if arrivals[1] else 1.0)
    limit = STABLE_GROWTH * expected + STABLE_NOISE * expected**0.5 + STABLE_SLACK
    stable = window <= 0 or mean_in_system[3] <= limit
    last = max(ends)
    return {
        "window_s": window,
        "makespan_ratio": (last - t0) / window if window > 0 and last < math.inf else None,
        "in_system": in_system,
        "mean_in_system": mean_in_system,
        "ttft_trend": trend,
        "arrivals": arrivals,
        "stable": bool(stable),
    }
