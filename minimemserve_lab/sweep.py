"""Load sweeps that a researcher can trust: steady states, seeds, stability and knees.

A *point* is one configuration (and routing policy) of one workload at one session rate. It is
simulated once per seed (:data:`SEEDS`), each time with ``2N`` sessions (:meth:`Plan.sessions`),
and measured over a steady window: the requests of the sessions that started after the first
``N / 4`` (the warm-up). The same statistics over the sessions ``N / 4 .. N`` show how much the
numbers still move between ``N`` and ``2N`` sessions (``drift``; a point is ``converged`` when
every one moves less than :data:`STEADY_TOLERANCE`). Each seed's run also carries the stability
record of the whole run (``workloads.results.stability``); a point is stable when every seed's
run is. Numbers are the mean over seeds with a 95 % interval (Student's t).

:func:`knee_chain` walks one configuration's rates: a coarse ladder, then bisection between the
highest stable and the lowest unstable rate, so rates are densest at the knee; the knee (the
configuration's capacity) is its highest stable rate. Goodput is the highest stable rate at which
:data:`SLO_ATTAINMENT` of the window's requests meet both :data:`SLO_TTFT_S` and
:data:`SLO_TPOT_S` (DistServe's measure)."""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

import numpy as np

from minimemserve.sim.runner import SimSetup, simulate, workload_sessions
from minimemserve.workloads.results import summarize

from .report import OVERLOADED

SEEDS = (0, 1, 2)
# Sessions per run: 2N, with N at least N_MIN and enough for a window of T_MIN seconds at the
# rate, at most N_MAX. ShareGPT's sessions last 16 s on average at light load (LooGLE's and
# ReAct's 2-3 s), so its window must be longer; a LooGLE session holds 8 requests. Sized so the
# whole evaluation, with every cost change's knees swept again, runs in half an hour on two
# CPU cores at SCALE; the drift between N and 2N sessions says where that is too few, and a
# comparison that still moves is run again with N doubled.
N_MIN = {"sharegpt": 100, "loogle": 60, "react": 90}
T_MIN_S = {"sharegpt": 60.0, "loogle": 30.0, "react": 22.5}
N_MAX = {"sharegpt": 500, "loogle": 180, "react": 270}
# The whole evaluation replays this share of those sessions (``Plan.scale``).
SCALE = 0.5
WARMUP = 0.25  # of the first N sessions, by start
STEADY_TOLERANCE = 0.05
# A point is stable only if its time in system (Little's law: mean in system over arrivals,
# summed over the seeds) grows by at most this much from the window's second quarter to its
# fourth, besides every seed's run passing ``workloads.results.stability``'s test.
TIME_GROWTH = 0.10
# A comparison that still moves by STEADY_TOLERANCE between N and 2N sessions is run again with
# N doubled, at most this many times (the sweep's own points are not).
DOUBLINGS = 1
METRICS = ("jct_mean", "jct_p99", "ttft_mean", "ttft_p99", "tpot_mean")
DRIFT_METRICS = ("jct_mean", "jct_p99", "ttft_mean", "ttft_p99")
# The goodput SLO, one pair for every workload.
SLO_TTFT_S, SLO_TPOT_S, SLO_ATTAINMENT = 1.0, 0.1, 0.9
# The first rates of each workload's ladder (sessions/s), then BISECTIONS between the knee's
# neighbours; at most EXTEND more rates beyond either end when no knee lies inside it.
LADDER = {
    "sharegpt": (1.0, 2.0, 4.0, 8.0),
    "loogle": (0.5, 1.0, 2.0, 4.0),
    "react": (1.0, 2.0, 4.0, 8.0),
}
BISECTIONS = 2
EXTEND = 2
# The fractions of a comparison's weaker side's knee it is measured at.
MATCHED_LOADS = (0.5, 0.7, 0.9)
# Finite runs (not steady state) at these multiples of a comparison's weaker side's knee.
FINITE_LOADS = (1.0, 1.5, 2.0, 3.0)
# Student's t at 97.5 % by degrees of freedom (seeds - 1).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}


@dataclass(frozen=True)
class Plan:
    """How much a sweep simulates: seeds (and those that find the knees, None: the same),
    the ladders and bisections of :func:`knee_chain`,
    the sessions per run (``scale`` times :meth:`sessions`'s; tests shrink it), how many
    times a comparison that has not converged is run again with twice the sessions, the
    fractions of a knee comparisons are made at, the finite runs' multiples of a knee, and
    the changes to the cost profile verdicts are derived again under (names of
    ``paper.VARIANTS``; None: every one)."""

    seeds: tuple[int, ...] = SEEDS
    sweep_seeds: tuple[int, ...] | None = None
    ladders: dict = field(default_factory=lambda: dict(LADDER))
    bisections: int = BISECTIONS
    extend: int = EXTEND
    scale: float = SCALE
    doublings: int = DOUBLINGS
    loads: tuple[float, ...] = MATCHED_LOADS
    finite_loads: tuple[float, ...] = FINITE_LOADS
    variants: tuple[str, ...] | None = None

    def sessions(self, workload: str, rate: float, doubled: int = 0) -> int:
        """N for ``workload`` at ``rate``, times 2 ** ``doubled``: each run replays twice as
        many sessions."""
        n = min(N_MAX[workload], max(N_MIN[workload], math.ceil(rate * T_MIN_S[workload])))
        return max(4, round(n * self.scale)) * 2**doubled


_SESSIONS: dict[tuple, list] = {}  # a worker's workloads, built once (tokenizing is slow)


def _sessions(setup: SimSetup, workload: str, n: int, seed: int, cap: int | None) -> list:
    """The first ``n`` of the most sessions a sweep replays of ``workload`` (a build of more
    sessions begins with those of a build of fewer)."""
    key = (str(setup.tokenizer_dir), setup.model_config.max_position_embeddings, workload)
    key += (seed, cap)
    if key not in _SESSIONS:
        most = max(n, 2 * N_MAX[workload])
        _SESSIONS[key] = workload_sessions(setup, workload, most, seed, None, cap, None)
    if len(_SESSIONS[key]) < n:
        _SESSIONS[key] = workload_sessions(setup, workload, n, seed, None, cap, None)
    return _SESSIONS[key][:n]


def _measure(records: list[dict]) -> dict:
    s = summarize(records)
    ok = [r for r in records if r.get("error") is None and r.get("ttft") is not None]
    met = sum(1 for r in ok if r["ttft"] <= SLO_TTFT_S and (r["tpot"] or 0.0) <= SLO_TPOT_S)
    return {
        **{m: s[m] for m in METRICS},
        "cached_ratio": s["cached_ratio"],
        "slo_attainment": met / len(records) if records else None,
        "requests": len(records),
    }


def _load(stats: dict) -> dict:
    """What the estimate of a gain needs of a run (``bound.py``): over the whole run and
    over its steady window (``window``, closed runs), the share of busy time in prefill
    steps, each role's busy seconds and decode batches, and the seconds."""
    return {k: stats[k] for k in ("prefill_share", "roles", "simulated_s", "window")}


def run_point(
    setup: SimSetup,
    workload: str,
    config: str,
    rate: float,
    seed: int,
    n: int,
    cap: int | None,
    arrivals: str = "closed",
) -> dict:
    """One seed of one point (a worker process runs it). Closed: ``2 n`` sessions, the steady
    window's statistics at ``n`` (``half``) and ``2 n`` sessions (``steady``), the whole
    run's stability, and the work done from the first steady session's start to the last
    session's (``load["window"]``); a run certainly unstable by its window's end stops there
    (``stopped``). Open or paced (a finite run, not steady state): ``n`` sessions, every
    request counted (``steady`` and ``half`` alike), and the preemptions."""
    if arrivals != "closed":
        sessions = _sessions(setup, workload, n, seed, cap)
        records, stats = simulate(setup, [config], sessions, rate, seed, False, arrivals)
        whole = summarize(records[config])
        measured = _measure(records[config])
        return {
            "sessions": n,
            "arrivals": arrivals,
            "stability": whole["stability"],
            "steady": measured,
            "half": measured,
            "preemptions": sum(r["preemptions"] for r in records[config]),
            "wall_s": stats[config]["wall_s"],
            "dispatches": stats[config]["dispatches"],
            "load": _load(stats[config]),
        }
    sessions = _sessions(setup, workload, 2 * n, seed, cap)
    warm = int(WARMUP * n)
    records, stats = simulate(
        setup, [config], sessions, rate, seed, False, "closed", True, (warm, 2 * n - 1)
    )
    recs = records[config]
    index = {s.id: i for i, s in enumerate(sessions)}  # sessions start in list order
    steady = [r for r in recs if index[r["session"]] >= warm]
    half = [r for r in steady if index[r["session"]] < n]
    return {
        "sessions": n,
        "stability": summarize(recs)["stability"],
        "steady": _measure(steady),
        "half": _measure(half),
        "stopped": stats[config]["stopped"],
        "wall_s": stats[config]["wall_s"],
        "dispatches": stats[config]["dispatches"],
        "load": _load(stats[config]),
    }


def interval(values: Sequence[float]) -> dict:
    """Mean and 95 % interval half-width (Student's t) of ``values`` (None ignored)."""
    xs = [v for v in values if v is not None]
    if not xs:
        return {"mean": None, "ci95": None}
    half = _T975[len(xs) - 1] * float(np.std(xs, ddof=1)) / math.sqrt(len(xs)) if len(xs) > 1 else 0
    return {"mean": float(np.mean(xs)), "ci95": half}


def time_growth(stabilities: Sequence[dict]) -> float | None:
    """How much the time in system grows from the window's second quarter to its fourth,
    over seeds' stability records together (Little's law: the mean number in system over a
    quarter divided by the requests arriving in it); None without both quarters."""
    q = [sum(s["mean_in_system"][k] for s in stabilities if s["mean_in_system"]) for k in (1, 3)]
    a = [sum(s["arrivals"][k] for s in stabilities if s["arrivals"]) for k in (1, 3)]
    if not (a[0] and a[1] and q[0]):
        return None
    return (q[1] / a[1]) / (q[0] / a[0]) - 1


def aggregate(runs: Sequence[dict]) -> dict:
    """A point's seeds together: each metric's mean and interval and its value per seed
    (``per_seed``), the drift between N and 2N sessions, ``converged``, the time in
    system's growth (:func:`time_growth`), ``stable`` (every seed's run, and a growth of at
    most :data:`TIME_GROWTH`) and each seed's stability record."""
    metrics = (*METRICS, "slo_attainment")
    out = {m: interval([r["steady"][m] for r in runs]) for m in metrics}
    stabilities = [r["stability"] for r in runs]
    growth = time_growth(stabilities)
    drift = {}
    for m in DRIFT_METRICS:
        a = np.mean([r["half"][m] for r in runs])
        b = np.mean([r["steady"][m] for r in runs])
        drift[m] = float(b / a - 1) if a else None
    return {
        **out,
        "cached_ratio": float(np.mean([r["steady"]["cached_ratio"] or 0.0 for r in runs])),
        "sessions": runs[0]["sessions"],
        "seeds": len(runs),
        "drift": drift,
        "converged": all(d is not None and abs(d) < STEADY_TOLERANCE for d in drift.values()),
        "growth": growth,
        "stable": all(s["stable"] for s in stabilities)
        and (growth is None or growth <= TIME_GROWTH),
        "stability": stabilities,
        "per_seed": {m: [r["steady"][m] for r in runs] for m in metrics},
    }


def ratio(
    new: Sequence[dict], base: Sequence[dict], metric: str, finite: bool = False
) -> dict | str:
    """``new``'s ``metric`` over ``base``'s, paired by seed: the mean ratio (1 + gain), its
    95 % interval and how much it moves between ``N`` and ``2N`` sessions (``drift``,
    ``converged``), or :data:`OVERLOADED` when any run of either side is unstable. A
    ``finite`` run's ratio is over the whole run, stable or not (no drift: it has one N)."""
    if not finite and not all(r["stability"]["stable"] for r in (*new, *base)):
        return OVERLOADED
    out = interval([a["steady"][metric] / b["steady"][metric] for a, b in zip(new, base)])
    half = np.mean([a["half"][metric] / b["half"][metric] for a, b in zip(new, base)])
    drift = float(out["mean"] / half - 1)
    return {**out, "drift": drift, "converged": abs(drift) < STEADY_TOLERANCE}


def knee_chain(
    ladder: Sequence[float], extend: int = EXTEND, bisections: int = BISECTIONS
) -> Generator[list[float], dict[float, bool], None]:
    """The rates one configuration is simulated at, batch by batch: it yields rates and is
    sent back ``{rate: stable}`` for every rate so far. A coarse ``ladder``, at most
    ``extend`` rates beyond whichever end holds no knee, then ``bisections`` geometric
    midpoints between the highest stable and the lowest unstable rate."""
    verdicts = yield list(ladder)
    for _ in range(extend):
        rates = sorted(verdicts)
        if all(verdicts.values()):
            verdicts = yield [rates[-1] * 2]
        elif not any(verdicts.values()):
            verdicts = yield [rates[0] / 2]
    for _ in range(bisections):
        lo, hi = bracket(verdicts)
        if lo is None or hi is None:
            return
        verdicts = yield [round(math.sqrt(lo * hi), 3)]


def bracket(verdicts: dict[float, bool]) -> tuple[float | None, float | None]:
    """The lowest unstable rate and the highest stable rate below it (None: none)."""
    unstable = [r for r, ok in verdicts.items() if not ok]
    hi = min(unstable, default=None)
    stable = [r for r, ok in verdicts.items() if ok and (hi is None or r < hi)]
    return max(stable, default=None), hi


@dataclass
class Curve:
    """One configuration's sweep: its aggregated points by rate."""

    points: dict[float, dict]

    @property
    def knee(self) -> float | None:
        """The capacity: the highest stable rate below the lowest unstable one."""
        return bracket({r: p["stable"] for r, p in self.points.items()})[0]

    @property
    def goodput(self) -> float | None:
        """The highest stable rate whose mean SLO attainment reaches :data:`SLO_ATTAINMENT`
        (an unstable run's attainment falls the longer it runs)."""
        good = [
            r
            for r, p in self.points.items()
            if p["stable"] and (p["slo_attainment"]["mean"] or 0.0) >= SLO_ATTAINMENT
        ]
        return max(good, default=None)


def plot_sweep(curves: dict[str, Curve], png, title: str) -> None:
    """JCT and TTFT (mean, P99) against the rate, one line per configuration with its 95 %
    interval and its knee circled; unstable points hollow."""
    from matplotlib.figure import Figure  # slow to import: only plots need it

    fig = Figure(figsize=(12, 8), layout="tight")
    axes = fig.subplots(2, 2)
    for ax, key in zip(axes.flat, ("jct_mean", "jct_p99", "ttft_mean", "ttft_p99")):
        for k, (name, curve) in enumerate(curves.items()):
            rates = sorted(curve.points)
            ys = [curve.points[r][key]["mean"] for r in rates]
            err = [curve.points[r][key]["ci95"] for r in rates]
            line = ax.errorbar(rates, ys, yerr=err, label=name, capsize=2, color=f"C{k}")
            for r, y in zip(rates, ys):
                if not curve.points[r]["stable"]:
                    ax.plot(r, y, "o", mfc="white", color=line[0].get_color())
            if curve.knee is not None:
                y = curve.points[curve.knee][key]["mean"]
                ax.plot(curve.knee, y, "o", ms=12, mfc="none", mew=2, color=line[0].get_color())
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("session arrival rate (1/s)")
        ax.set_ylabel(f"{key.replace('_', ' ')} (s)")
        ax.legend(fontsize=7)
    fig.suptitle(f"{title}; big circle: knee (highest stable rate); hollow: unstable", fontsize=9)
    fig.savefig(png, dpi=100)
