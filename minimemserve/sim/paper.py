"""``minimemserve sim --paper``: MemServe's evaluation (arXiv 2406.17565, Section 6) simulated.

The paper serves Llama-2-13B on 8 GPUs at tensor parallelism 2 and reports 19 relative
gains over three workloads (:data:`PAPER`): disaggregation against colocated PD, caching on
top of disaggregation, and prompt-tree against session routing. It states no request rates.
:func:`reproduce` sweeps every configuration's load to past its knee (``sim.sweep``: steady
windows, three seeds, a stability verdict per run), then measures each gain at 50, 70 and
90 % of the weaker side's capacity, as the ratio of (1 + gain) with its 95 % interval; a
comparison with an unstable side is reported as overloaded, never as a number."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait
from pathlib import Path

from minimemserve.workloads.results import OVERLOADED, STABLE_GROWTH, STABLE_NOISE, STABLE_SLACK

from . import bound
from .runner import (
    DEFAULT_HARDWARE,
    DEFAULT_MODEL,
    DEFAULT_TP,
    FINITE_LABEL,
    SimSetup,
    gpu_setup,
    with_step_overhead,
)
from .sweep import (
    DOUBLINGS,
    FINITE_LOADS,
    MATCHED_LOADS,
    SLO_ATTAINMENT,
    SLO_TPOT_S,
    SLO_TTFT_S,
    STEADY_TOLERANCE,
    Curve,
    Plan,
    aggregate,
    knee_chain,
    plot_sweep,
    ratio,
    run_point,
)

# (workload, comparison, metric) -> the paper's relative change (Figures 8-10, Section 6).
PAPER = {
    ("sharegpt", "disagg vs PD", "jct_mean"): -0.30,
    ("sharegpt", "disagg vs PD", "jct_p99"): -0.42,
    ("sharegpt", "disagg-CC vs disagg", "jct_mean"): -0.17,
    ("sharegpt", "disagg-CC vs disagg", "jct_p99"): -0.29,
    ("sharegpt", "disagg-CC vs disagg", "ttft_mean"): -0.58,
    ("sharegpt", "disagg-CC vs disagg", "ttft_p99"): -0.45,
    ("loogle", "disagg vs PD", "jct_mean"): -0.103,
    ("loogle", "disagg vs PD", "jct_p99"): -0.108,
    ("loogle", "disagg-CC vs disagg", "jct_mean"): -0.269,
    ("loogle", "disagg-CC vs disagg", "jct_p99"): -0.225,
    ("loogle", "disagg-CC vs disagg", "ttft_mean"): -0.562,
    ("loogle", "disagg-CC vs disagg", "ttft_p99"): -0.452,
    ("react", "disagg vs PD", "jct_mean"): -0.408,
    ("react", "disagg vs PD", "jct_p99"): -0.531,
    ("react", "disagg-CC vs disagg", "jct_mean"): -0.267,
    ("react", "disagg-CC vs disagg", "jct_p99"): -0.214,
    ("react", "disagg-CC vs disagg", "ttft_mean"): -0.785,
    ("react", "disagg-CC vs disagg", "ttft_p99"): -0.849,
    # The paper does not name this one's workload; ReAct's shared few-shot block is what
    # prompt trees exist for. Session routing hashes each request's session id.
    ("react", "prompt_tree vs session", "ttft_p99"): -0.59,
}
WORKLOADS = ("sharegpt", "loogle", "react")
GPUS = 8
# A side of a comparison: a configuration on the paper's 8 GPUs ("2P2D") or on fewer
# ("1P2D on 6": three instances at TP 2).
ON = " on "
# Every split of the paper's 8 GPUs at TP 2, and the paper's own ShareGPT layout, 1P2D on 6
# GPUs ("disaggregated inference (1P2D) improves mean and P99 JCT by 30 % and 42 %"); each
# against colocated PD on the same GPUs, and with and without caching.
LAYOUTS = ("1P3D", "2P2D", "3P1D", f"1P2D{ON}6")
# The layout the paper names for a workload; elsewhere the tables show the best one.
NAMED = {"sharegpt": f"1P2D{ON}6"}
# The paper does not say on how many GPUs its PD ran: 1P2D on 6 against PD on 4 and on 8.
UNEQUAL = ((f"1P2D{ON}6", f"PD{ON}4"), (f"1P2D{ON}6", "PD"))
UNEQUAL_NOTE = "unequal GPUs"
# ShareGPT's real answers, capped where the paper's 4k-token model leaves room anyway; the
# synthetic workloads keep their own answer lengths (LooGLE 8-32, ReAct 20-100 tokens).
MAX_OUTPUT_TOKENS = {"sharegpt": 1024}
# The loads each comparison is made at: these fractions of the weaker side's capacity.
LOADS = MATCHED_LOADS
# Routing compared on PD-CC at the same loads: the paper's prompt trees, session affinity and
# the shortest queue.
ROUTING = ("prompt_tree", "session", "least_load")
# A simulated (1 + gain) matches the paper's when its mean is within MATCH of it (relative).
MATCH = 0.10
# The fixed cost per step (ms) the matched-load points of the shown layouts are re-run with;
# the hardware profile's own is 4 ms.
STEP_MS = (10.0, 20.0)
# ``--quick``: every workload and configuration, on a plan sized for a shared two-core
# machine: a fifth of the sessions; knees found with one seed from three ladder rates a
# workload, one rate beyond the ladder and one bisection; comparisons (three seeds) at 70 % of
# the knee only, no re-runs with N doubled; finite runs at 1.5 and 3 times the knee. Its
# points are not the full run's.
QUICK_PLAN = Plan(
    ladders={"sharegpt": (2.0, 4.0, 8.0), "loogle": (1.0, 2.0, 4.0), "react": (2.0, 4.0, 8.0)},
    bisections=1,
    extend=1,
    scale=0.2,
    doublings=0,
    loads=(0.7,),
    finite_loads=(1.5, 3.0),
    step_loads=(0.7,),
    sweep_seeds=(0,),
)
POLICY = "prompt_tree"
# The mark of a ratio that moves by STEADY_TOLERANCE or more between N and 2N sessions.
MOVED = "†"
MOVED_NOTE = (
    f"A ratio that moves by {STEADY_TOLERANCE:.0%} or more between N and 2N sessions is "
    f"measured again with N doubled, up to {DOUBLINGS} times (each cell's N is in the JSON); "
    f"{MOVED}: it still moves that much at the largest N. A side found unstable at any N is "
    f"overloaded in every comparison at its rate."
)
LOAD_RULE = (
    "The paper states no request rates. Each configuration is swept from light load past its "
    "knee; its capacity is the highest rate at which every seed's run is stable. Each gain is "
    "measured at 50, 70 and 90 % of the capacity of the weaker of its two sides."
)


def side(label: str) -> tuple[str, int]:
    """A side's configuration and GPUs: ``"1P2D on 6"`` -> ``("1P2D", 6)``."""
    config, _, gpus = label.partition(ON)
    return config, int(gpus) if gpus else GPUS


def on(config: str, gpus: int) -> str:
    """The side of ``config`` on ``gpus`` GPUs (the paper's 8 unnamed)."""
    return config if gpus == GPUS else f"{config}{ON}{gpus}"


def cached(label: str) -> str:
    """The side with caching: ``"1P2D on 6"`` -> ``"1P2D-CC on 6"``."""
    config, gpus = side(label)
    return on(f"{config}-CC", gpus)


def colocated(label: str) -> str:
    """Colocated PD on the side's GPUs."""
    return on("PD", side(label)[1])


CONFIGS = tuple(
    dict.fromkeys(
        ("PD", "PD-CC", *LAYOUTS, *map(cached, LAYOUTS), *map(colocated, LAYOUTS))
        + tuple(base for _, base in UNEQUAL)
    )
)


class Points:
    """Every point of one reproduction: each seed's run submitted once to ``pool``, the seeds
    aggregated once (and printed as they complete, with ``progress``)."""

    def __init__(self, pool: Executor, setup: SimSetup, plan: Plan, progress: bool) -> None:
        self.pool = pool
        self.setup = setup
        self.plan = plan
        self.progress = progress
        # (workload, side, policy, rate, doubled, arrivals, step_ms): N is doubled ``doubled``
        # times; a finite run's arrivals are "open"; step_ms None: the profile's fixed cost
        self.futures: dict[tuple, list[Future]] = {}
        self._points: dict[tuple, dict] = {}
        self.t0 = time.perf_counter()

    def submit(
        self,
        workload: str,
        config: str,
        policy: str,
        rate: float,
        doubled: int = 0,
        arrivals: str = "closed",
        step_ms: float | None = None,
        seeds: tuple[int, ...] | None = None,
    ) -> tuple:
        """Simulate the point (once) of side ``config`` (:func:`side`), with N doubled
        ``doubled`` times, ``arrivals`` as ``SimCluster.replay`` takes them, each step's
        fixed cost ``step_ms`` (None: the profile's) and ``seeds`` (None: the plan's);
        returns its key."""
        seeds = tuple(seeds or self.plan.seeds)
        key = (workload, config, policy, float(rate), doubled, arrivals, step_ms, seeds)
        if key not in self.futures:
            name, gpus = side(config)
            setup = dataclasses.replace(
                self.setup.with_deployment(policy=policy), instances=gpus // DEFAULT_TP
            )
            if step_ms is not None:
                setup = with_step_overhead(setup, step_ms)
            n = self.plan.sessions(workload, rate, doubled)
            cap = MAX_OUTPUT_TOKENS.get(workload)
            self.futures[key] = [
                self.pool.submit(run_point, setup, workload, name, rate, seed, n, cap, arrivals)
                for seed in seeds
            ]
        return key

    def done(self, key: tuple) -> bool:
        """Whether every seed of ``key`` has finished."""
        return all(f.done() for f in self.futures[key])

    def runs(self, key: tuple) -> list[dict]:
        """Each seed's run of ``key`` (waits for them)."""
        return [f.result() for f in self.futures[key]]

    def point(self, key: tuple) -> dict:
        """``key``'s seeds aggregated (waits for them)."""
        if key not in self._points:
            self._points[key] = p = aggregate(self.runs(key))
            if self.progress:
                print(f"  {point_line(key, p)} [{time.perf_counter() - self.t0:.0f} s]", flush=True)
        return self._points[key]

    def unstable(self, workload: str, config: str, policy: str, rate: float) -> bool:
        """Whether the point is unstable at any N it was simulated with (waits for them)."""
        point = (workload, config, policy, float(rate))
        closed = [k for k in list(self.futures) if k[:4] == point and k[5:7] == ("closed", None)]
        return any(not self.point(k)["stable"] for k in closed)


def _fmt(value: dict | str | None, scale: float = 1.0, digits: int = 2) -> str:
    """``mean ±ci`` of an interval, or the string it is."""
    if not isinstance(value, dict):
        return str(value)
    if value["mean"] is None:
        return "-"
    return f"{scale * value['mean']:.{digits}f} ±{scale * value['ci95']:.{digits}f}"


def point_line(key: tuple, p: dict) -> str:
    """One point in a line: JCT and TTFT means, stability, in-system growth, drift."""
    workload, config, policy, rate, doubled, arrivals, step_ms, _ = key
    grow = " ".join("/".join(f"{x:.0f}" for x in s["mean_in_system"][1::2]) for s in p["stability"])
    drift = max((abs(d) for d in p["drift"].values() if d is not None), default=0.0)
    longer = f", N x{2**doubled}" if doubled else ""
    longer += f", {FINITE_LABEL}" if arrivals == "open" else ""
    longer += f", {step_ms:g} ms a step" if step_ms is not None else ""
    return (
        f"{workload} {config} ({policy}) {rate:g}/s{longer}: JCT {_fmt(p['jct_mean'])} s, TTFT "
        f"{_fmt(p['ttft_mean'], 1e3, 0)} ms, {'stable' if p['stable'] else 'UNSTABLE'} (in "
        f"system, 2nd / 4th quarter: {grow}), moves {drift:.1%} from N to 2N"
    )


def sweep(points: Points, workloads: Sequence[str], configs: Sequence[str]) -> dict:
    """Every configuration's :func:`knee_chain` walked on ``points`` at once:
    ``{workload: {config: Curve}}``."""
    chains, rates, pending = {}, {}, {}
    seeds = points.plan.sweep_seeds

    def submit(w: str, c: str, r: float) -> tuple:
        return points.submit(w, c, POLICY, r, seeds=seeds)

    for w in workloads:
        for c in configs:
            chains[w, c] = knee_chain(
                points.plan.ladders[w], points.plan.extend, points.plan.bisections
            )
            rates[w, c] = list(next(chains[w, c]))
            pending[w, c] = [submit(w, c, r) for r in rates[w, c]]
    while pending:
        # the runs still going (a finished one would end every wait at once: a busy loop)
        going = [f for ks in pending.values() for k in ks for f in points.futures[k]]
        going = [f for f in going if not f.done()]
        if going:
            wait(going, return_when=FIRST_COMPLETED)
        for (w, c), keys in list(pending.items()):
            if not all(points.done(k) for k in keys):
                continue
            verdicts = {r: points.point(submit(w, c, r))["stable"] for r in rates[w, c]}
            try:
                more = chains[w, c].send(verdicts)
            except StopIteration:
                del pending[w, c]
                continue
            rates[w, c] += more
            pending[w, c] = [submit(w, c, r) for r in more]
    return {
        w: {c: Curve({r: points.point(submit(w, c, r)) for r in rates[w, c]}) for c in configs}
        for w in workloads
    }


def _pairs(layout: str) -> dict[str, tuple[str, str]]:
    """The paper's comparisons for one layout: name -> (new, base), PD on the same GPUs."""
    return {
        "disagg vs PD": (layout, colocated(layout)),
        "disagg-CC vs disagg": (cached(layout), layout),
    }


def _columns(comparison: str) -> list[tuple[str, tuple[str, str]]]:
    """Each column of a row of ``comparison``: (its name, (new, base) sides): every layout,
    and for disaggregation 1P2D against PD on other GPU counts."""
    cols = [(layout, _pairs(layout)[comparison]) for layout in LAYOUTS]
    if comparison == "disagg vs PD":
        cols += [(f"{new} vs {base} ({UNEQUAL_NOTE})", (new, base)) for new, base in UNEQUAL]
    return cols


def _rate(curves: dict, new: str, base: str, load: float) -> float | None:
    """``load`` times the weaker side's capacity (None: either has no stable rate)."""
    knees = [curves[c].knee if c in curves else None for c in (new, base)]
    return None if None in knees else round(load * min(knees), 3)


Comparison = tuple  # (workload, (new, base) configs, (new, base) policies, rate, metric)


def _submit(points: Points, comparison: Comparison, doubled: int) -> tuple[tuple, tuple]:
    """Both sides of ``comparison`` with N doubled ``doubled`` times; their keys."""
    workload, (new, base), (pnew, pbase), rate, _ = comparison
    return (
        points.submit(workload, new, pnew, rate, doubled),
        points.submit(workload, base, pbase, rate, doubled),
    )


def _ratio(points: Points, comparison: Comparison, doubled: int) -> dict | str:
    """``comparison``'s (1 + gain) with N doubled ``doubled`` times (waits for its runs)."""
    new, base = _submit(points, comparison, doubled)
    return ratio(points.runs(new), points.runs(base), comparison[4])


def settle(points: Points, comparisons: Sequence[Comparison]) -> dict[Comparison, int]:
    """How many times each comparison's N is doubled: until its ratio moves less than
    :data:`STEADY_TOLERANCE` between N and 2N sessions, or either side is overloaded, at most
    ``plan.doublings`` times. Every comparison's runs are submitted before any is awaited, and
    each longer run as soon as it is known to be needed."""
    doubled = dict.fromkeys(comparisons, 0)
    for c in comparisons:
        _submit(points, c, 0)
    for k in range(points.plan.doublings):
        for c in comparisons:
            if doubled[c] == k and isinstance(r := _ratio(points, c, k), dict):
                if not r["converged"]:
                    doubled[c] = k + 1
                    _submit(points, c, k + 1)
                    if points.progress:
                        print(
                            f"  {_comparison_line(c)} moves {r['drift']:+.1%} from N to 2N: "
                            f"N doubled to {points.plan.sessions(c[0], c[3], k + 1)}",
                            flush=True,
                        )
    return doubled


def _comparison_line(c: Comparison) -> str:
    workload, (new, base), (pnew, pbase), rate, metric = c
    sides = f"{new} vs {base}" if new != base else f"{new} {pnew} vs {pbase}"
    return f"{workload} {sides} {metric} at {rate:g}/s"


def cell(points: Points, comparison: Comparison, doubled: int, paper: float) -> dict:
    """One comparison at one rate, its N doubled ``doubled`` times: the simulated (1 + gain)
    with its interval against the paper's, a verdict and the reason for a miss."""
    rate = comparison[3]
    if rate is None:
        return {"rate": None, "ratio": "no stable load", "verdict": "no stable load"}
    r = _ratio(points, comparison, doubled)
    workload, configs, policies = comparison[:3]
    if any(points.unstable(workload, c, p, rate) for c, p in zip(configs, policies)):
        r = OVERLOADED  # a side that turned unstable with more sessions is overloaded at any N
    sessions = points.plan.sessions(workload, rate, doubled)
    if isinstance(r, str):
        return {"rate": rate, "sessions": sessions, "ratio": r, "verdict": r}
    want = 1 + paper
    hit = abs(r["mean"] / want - 1) <= MATCH
    held = abs(r["mean"] - want) <= r["ci95"]  # the paper's value lies inside the interval
    return {
        "rate": rate,
        "sessions": sessions,
        "ratio": r,
        "verdict": "match" if hit else "miss" + (" (interval holds it)" if held else ""),
        "reason": None if hit else "not explained",
    }


def matched_rows(points: Points, curves: dict, workloads: Sequence[str]) -> list[dict]:
    """The paper's 18 disaggregation and caching numbers, each at :data:`LOADS` of the weaker
    side's capacity for every layout swept, each run as long as :func:`settle` finds it needs."""
    rows, plan = [], []  # plan: (row, cell name, comparison)
    for (w, comparison, metric), paper in PAPER.items():
        if w not in workloads or comparison not in _pairs("x"):
            continue
        row = {
            "workload": w,
            "comparison": comparison,
            "metric": metric,
            "paper": paper,
            "paper_ratio": 1 + paper,
            "cells": {},
        }
        rows.append(row)
        for column, pair in _columns(comparison):
            if set(pair) <= set(curves[w]):
                for load in points.plan.loads:
                    rate = _rate(curves[w], *pair, load)
                    plan.append(
                        (row, f"{column}@{load:.0%}", (w, pair, (POLICY,) * 2, rate, metric))
                    )
    doubled = settle(points, [c for _, _, c in plan if c[3] is not None])
    for row, name, c in plan:
        row["cells"][name] = x = cell(points, c, doubled.get(c, 0), row["paper"])
        if isinstance(x["ratio"], dict):
            _explain(points, x, row["comparison"], c, doubled.get(c, 0))
    return rows


def _explain(points: Points, x: dict, comparison: str, c: Comparison, doubled: int) -> None:
    """What a measured cell of ``comparison`` is made of: the TTFT share of its
    disaggregated side's JCT and, for disaggregation on equal GPUs, the bound
    (``sim.bound``) from both sides' runs."""
    new, base = (points.runs(k) for k in _submit(points, c, doubled))
    disagg = comparison == "disagg vs PD"
    x["ttft_share"] = bound.ttft_share(new if disagg else base)
    if disagg and side(c[1][0])[1] == side(c[1][1])[1]:
        x["bound"] = bound.bound(new, base, points.setup.step_model)


def routing_rows(points: Points, curves: dict, workloads: Sequence[str]) -> list[dict]:
    """PD-CC's routing policies at :data:`LOADS` of its capacity under prompt trees: prompt
    trees against session affinity (the paper's row 19 on ReAct) and against the shortest
    queue, P99 and mean TTFT, each run as long as :func:`settle` finds it needs, and how
    evenly ``session`` spread the requests."""
    rows, plan = [], []  # plan: (row, cell name, comparison)
    for w in workloads:
        if "PD-CC" not in curves[w]:
            continue
        for load in points.plan.loads:
            rate = _rate(curves[w], "PD-CC", "PD-CC", load)
            row = {"workload": w, "load": load, "rate": rate}
            rows.append(row)
            for base in ROUTING[1:]:
                for metric in ("ttft_p99", "ttft_mean"):
                    c = (w, ("PD-CC", "PD-CC"), (POLICY, base), rate, metric)
                    plan.append((row, f"vs {base} {metric}", c))
    doubled = settle(points, [c for _, _, c in plan if c[3] is not None])
    paper = PAPER["react", "prompt_tree vs session", "ttft_p99"]
    for row, name, c in plan:
        row[name] = cell(points, c, doubled.get(c, 0), paper)
    for row in rows:
        if row["rate"] is not None:
            runs = points.runs(points.submit(row["workload"], "PD-CC", "session", row["rate"]))
            n = points.setup.instances
            row["session_max_share"] = max(spread(r["dispatches"], n) for r in runs)
    return rows


def spread(dispatches: dict[str, int], instances: int) -> float:
    """The busiest of ``instances``' requests over an even share (1.0: perfectly even)."""
    total = sum(dispatches.values())
    return max(dispatches.values()) * instances / total if total else 0.0


def row19(routing: list[dict]) -> dict | None:
    """Row 19 (prompt trees against session routing, P99 TTFT on ReAct's PD-CC) as a row of
    the 19: its cells are the routing table's."""
    (w, comparison, metric), paper = next((k, v) for k, v in PAPER.items() if k[1] in ROUTE)
    cells = {
        f"PD-CC@{r['load']:.0%}": r[f"vs session {metric}"] for r in routing if r["workload"] == w
    }
    if not cells:
        return None
    return {
        "workload": w,
        "comparison": comparison,
        "metric": metric,
        "paper": paper,
        "paper_ratio": 1 + paper,
        "cells": cells,
    }


# Row 19's sides: PD-CC under prompt trees against PD-CC under session routing.
ROUTE = {"prompt_tree vs session": (("PD-CC", "PD-CC"), (POLICY, "session"))}


def _numeric(cells: dict) -> dict[str, dict]:
    return {k: c for k, c in cells.items() if isinstance(c.get("ratio"), dict)}


def shown_layouts(
    rows: list[dict],
    workloads: Sequence[str],
    loads: Sequence[float] = LOADS,
    named: dict[str, str] = NAMED,
) -> dict[str, str]:
    """The layout the tables show per workload: the paper's where it names one (``named``),
    else the best, the one whose mean JCT against PD on the same GPUs is lowest, averaged over
    the loads measured."""
    shown = {}
    for w in workloads:
        if w in named:
            shown[w] = named[w]
            continue
        row = next(
            r
            for r in rows
            if (r["workload"], r["comparison"], r["metric"]) == (w, "disagg vs PD", "jct_mean")
        )
        scores = {}
        for layout in LAYOUTS:
            got = [
                c["ratio"]["mean"]
                for k, c in _numeric(row["cells"]).items()
                if k.split("@")[0] == layout
            ]
            if got:
                scores[layout] = sum(got) / len(got) + (len(loads) - len(got))  # overloaded: worse
        shown[w] = min(scores, key=scores.get) if scores else LAYOUTS[0]
    return shown


def _sides(row: dict, layout: str) -> tuple[tuple[str, str], tuple[str, str]]:
    """A row's (new, base) sides and policies at the shown ``layout``."""
    if row["comparison"] in ROUTE:
        return ROUTE[row["comparison"]]
    return _pairs(layout)[row["comparison"]], (POLICY, POLICY)


def finite_rows(
    points: Points, curves: dict, rows: list[dict], shown: dict, loads: Sequence[float]
) -> None:
    """Every row's comparison at the shown layout as finite runs (``--arrivals open``, not
    steady state) at ``loads`` times its weaker side's knee; each row gets ``finite``: the
    ratio at each load, how far past each side's knee, and the lowest load at which the
    paper's number appears (within :data:`MATCH`), if any."""
    plan = []
    for row in rows:
        w = row["workload"]
        (new, base), policies = _sides(row, shown[w])
        knees = [curves[w][c].knee if c in curves[w] else None for c in (new, base)]
        row["finite"] = {"layout": shown[w], "label": FINITE_LABEL, "cells": {}, "appears": None}
        if None in knees:
            continue
        for k in loads:
            rate = round(k * min(knees), 3)
            keys = [points.submit(w, c, p, rate, 0, "open") for c, p in zip((new, base), policies)]
            plan.append((row, k, rate, knees, keys))
    for row, k, rate, knees, (a, b) in plan:
        r = ratio(points.runs(a), points.runs(b), row["metric"], finite=True)
        row["finite"]["cells"][f"{k:g}x"] = {
            "rate": rate,
            "past_new": rate / knees[0],
            "past_base": rate / knees[1],
            "ratio": r,
            "stable": points.point(a)["stable"] and points.point(b)["stable"],
        }
        if row["finite"]["appears"] is None and abs(r["mean"] / row["paper_ratio"] - 1) <= MATCH:
            row["finite"]["appears"] = {"load": k, "rate": rate, "past": rate / min(knees)}


def step_cost_rows(points: Points, rows: list[dict], shown: dict, loads: Sequence[float]) -> None:
    """The shown layout's disaggregation and caching cells at ``loads`` re-run with a fixed
    cost of each of :data:`STEP_MS` per step (the profile's is 4 ms), at the same rates; each
    such row gets ``step_cost``: the ratio by cost and load."""
    plan = []
    for row in rows:
        if row["comparison"] in ROUTE:
            continue
        layout = shown[row["workload"]]
        pair = _pairs(layout)[row["comparison"]]
        row["step_cost"] = {}
        for load in loads:
            rate = row["cells"].get(f"{layout}@{load:.0%}", {}).get("rate")
            if rate is None:
                continue
            for ms in STEP_MS:
                keys = [
                    points.submit(row["workload"], c, POLICY, rate, 0, "closed", ms) for c in pair
                ]
                plan.append((row, f"{ms:g} ms@{load:.0%}", rate, keys))
    for row, name, rate, (a, b) in plan:
        r = ratio(points.runs(a), points.runs(b), row["metric"])
        row["step_cost"][name] = {"rate": rate, "ratio": r}


def _implied_ttft_share(workload: str) -> float | None:
    """The TTFT share of the disaggregated JCT that the paper's caching numbers imply (caching
    changes TTFT only): its JCT gain over its TTFT gain."""
    jct = PAPER.get((workload, "disagg-CC vs disagg", "jct_mean"))
    ttft = PAPER.get((workload, "disagg-CC vs disagg", "ttft_mean"))
    return None if jct is None or ttft is None else jct / ttft


def knee_bound(name: str, b: dict) -> float:
    """A cell's bound with U_P grown in proportion to the load up to the knee (at most 1):
    about the lowest its layout can reach at any stable load. ``name`` ends in its load."""
    load = float(name.rsplit("@", 1)[1].rstrip("%")) / 100
    d, floor = b["d_ratio"]["mean"], b["floor"]["mean"]
    share = 1 - floor / d  # x / n
    return (1 - share * min(1.0, b["u_p"]["mean"] / load)) * d


def _reason(row: dict) -> str:
    """Why a number is not reproduced, in measured numbers: the nearest steady-state value,
    the bound's floor (disaggregation), the TTFT share of JCT (caching, JCT) and the range
    of the finite runs."""
    want, cells = row["paper_ratio"], _numeric(row["cells"])
    if not cells:
        return "every matched load overloaded"
    near = min(cells, key=lambda k: abs(cells[k]["ratio"]["mean"] / want - 1))
    parts = [f"nearest at steady state {cells[near]['ratio']['mean']:.2f} ({near})"]
    at_knee = {k: knee_bound(k, c["bound"]) for k, c in cells.items() if c.get("bound")}
    if at_knee:
        k = min(at_knee, key=at_knee.get)
        parts.append(f"bound at the knee no lower than {at_knee[k]:.2f} ({k})")
    implied = _implied_ttft_share(row["workload"])
    shares = [c["ttft_share"]["mean"] for c in cells.values() if c.get("ttft_share")]
    if row["comparison"] == "disagg-CC vs disagg" and row["metric"].startswith("jct") and shares:
        parts.append(
            f"TTFT {min(shares):.1%}-{max(shares):.1%} of JCT (the paper's numbers imply "
            f"{implied:.0%})"
        )
    finite = _numeric(row.get("finite", {}).get("cells", {}))
    if finite:
        got = [c["ratio"]["mean"] for c in finite.values()]
        parts.append(f"finite runs {min(got):.2f}-{max(got):.2f} up to {max(finite)} the knee")
    return "; ".join(parts)


def verdict(row: dict) -> str:
    """One of: reproduced at steady state (where), reproduced only with unequal GPUs,
    appears only in a finite run at load L (k x the knee), or not reproduced (why)."""
    cells = _numeric(row["cells"])
    hits = [k for k, c in cells.items() if c["verdict"] == "match"]
    equal = [k for k in hits if UNEQUAL_NOTE not in k]
    if equal:
        return f"reproduced at steady state ({', '.join(equal)})"
    if hits:
        return f"reproduced at steady state only with {UNEQUAL_NOTE} ({', '.join(hits)})"
    if appears := row.get("finite", {}).get("appears"):
        return (
            f"appears only in a finite run, at {appears['rate']:g}/s "
            f"({appears['past']:.1f} x the knee)"
        )
    return f"not reproduced: {_reason(row)}"


def reproduce(
    scheduler: str = "prefill_first",
    out_dir: str | Path | None = None,
    quick: bool = False,
    plan: Plan | None = None,
    progress: bool = True,
    jobs: int | None = None,
    workloads: Sequence[str] = WORKLOADS,
    configs: Sequence[str] = CONFIGS,
) -> dict:
    """The paper's evaluation under the local ``scheduler`` policy (its base, vLLM 0.4.0, is
    ``prefill_first``): every configuration swept (:func:`sweep`), the 18 gains at matched
    loads, routing; prints the tables; with ``out_dir`` writes ``sim_paper.json``, the table
    in markdown (``sim_paper.md``), a sweep plot per workload and the gains plot. Then each
    of the 19 numbers at the shown layout as finite runs past the knees, the shown layouts'
    matched-load points with a larger fixed cost per step, and a verdict per number.
    ``quick`` runs :data:`QUICK_PLAN` (every workload and configuration, fewer bisections
    and extra runs). Runs go ``jobs`` at a time (default: one per core), each in its own
    process."""
    t0 = time.perf_counter()
    plan = plan or (QUICK_PLAN if quick else Plan())
    base = gpu_setup(DEFAULT_MODEL, DEFAULT_HARDWARE, GPUS, DEFAULT_TP)
    setup = base.with_deployment(
        engine=dataclasses.replace(base.engine_config, scheduler=scheduler)
    )
    jobs = jobs or os.cpu_count() or 1
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=spawn) if jobs > 1 else _Inline() as pool:
        points = Points(pool, setup, plan, progress)
        curves = sweep(points, workloads, configs)
        if out_dir is not None:  # the sweep alone first: it is most of the time
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            done = {w: _curves_json(curves[w]) for w in workloads}
            (Path(out_dir) / "sim_paper_sweep.json").write_text(json.dumps(done, indent=1))
        rows = matched_rows(points, curves, workloads)
        routing = routing_rows(points, curves, workloads)
        numbers = rows + [r for r in [row19(routing)] if r is not None]
        shown = shown_layouts(rows, workloads, plan.loads)
        finite_rows(points, curves, numbers, shown, plan.finite_loads)
        step_cost_rows(points, rows, shown, plan.step_loads)
    for row in numbers:
        row["verdict"] = verdict(row)
    result = {
        "setup": {**setup.describe, "scheduler": scheduler, "quick": quick},
        "plan": dataclasses.asdict(plan),
        "load_rule": LOAD_RULE,
        "stability_rule": STABILITY_RULE,
        "finite_rule": FINITE_RULE,
        "slo": {"ttft_s": SLO_TTFT_S, "tpot_s": SLO_TPOT_S, "attainment": SLO_ATTAINMENT},
        "workloads": {w: _curves_json(curves[w]) for w in workloads},
        "shown": shown,
        "rows": numbers,
        "routing": routing,
        "wall_s": time.perf_counter() - t0,
        "files": [],
    }
    print(markdown(result))
    if out_dir is not None:
        write(result, curves, Path(out_dir))
    return result


FINITE_RULE = (
    f"{FINITE_LABEL}: the sessions a point replays (N), every turn sent at its own Poisson "
    f"arrival time whether or not its session's turns before it finished (its prompt built "
    f"from their answers), counted over the whole run; each comparison of the shown layout at "
    f"{', '.join(f'{k:g}' for k in FINITE_LOADS)} times its weaker side's knee (--quick: fewer)"
)
STABILITY_RULE = (
    f"stable: the mean number of requests in system over the last quarter of the arrival "
    f"window, q4, is at most {STABLE_GROWTH} e + {STABLE_NOISE} sqrt(e) + {STABLE_SLACK}, with "
    f"e = q2 a4 / a2, q2 being that mean over its second quarter and a2, a4 the requests "
    f"arriving in the second and last quarters; a point is stable when every seed's run is"
)


def _curves_json(curves: dict[str, Curve]) -> dict:
    return {
        c: {
            "knee": cv.knee,
            "goodput": cv.goodput,
            "points": {f"{r:g}": cv.points[r] for r in sorted(cv.points)},
        }
        for c, cv in curves.items()
    }


def write(result: dict, curves: dict, out: Path) -> None:
    """The JSON, the markdown tables and the plots into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "sim_paper.json", out / "sim_paper.md", out / "sim_paper.png"]
    for w, cv in curves.items():
        files.append(out / f"paper_sweep_{w}.png")
        plot_sweep(cv, files[-1], f"{w}, simulated ({result['setup']['scheduler']})")
    result["files"] = list(map(str, files))
    files[0].write_text(json.dumps(result, indent=1))
    files[1].write_text(markdown(result) + "\n")
    plot_gains(result, files[2])
    print(f"wrote {', '.join(result['files'])} ({result['wall_s']:.0f} s)")


def _cell_md(c: dict | None) -> str:
    if c is None:
        return ""
    text = _fmt(c["ratio"])
    text = f"**{text}**" if c.get("verdict") == "match" else text
    moved = isinstance(c["ratio"], dict) and not c["ratio"].get("converged", True)
    return f"{text} {MOVED}" if moved else text


def markdown(result: dict) -> str:
    """The reproduction's tables: knees and goodput, the 19 numbers with their verdicts, every
    layout's gains at matched load as ratios of (1 + gain) with 95 % intervals, the bound per
    comparison, the finite runs, the fixed cost per step, and routing (row 19)."""
    lines = [
        LOAD_RULE,
        "",
        knees_md(result),
        "",
        verdicts_md(result),
        "",
        rows_md(result["rows"]),
        "",
        bounds_md(result["rows"]),
        "",
        finite_md(result),
        "",
        step_cost_md(result),
        "",
        routing_md(result),
    ]
    return "\n".join(lines)


def knees_md(result: dict) -> str:
    """Per workload and configuration: capacity (knee), goodput, the rates swept."""
    slo = result["slo"]
    lines = [
        f"| workload | config | knee (sessions/s) | goodput (TTFT <= {slo['ttft_s']} s, TPOT <= "
        f"{1e3 * slo['tpot_s']:.0f} ms, {slo['attainment']:.0%}) | rates swept (unstable in "
        "italics) |",
        "|---|---|---|---|---|",
    ]
    for w, curves in result["workloads"].items():
        for c, cv in curves.items():
            rates = ", ".join(f"{r}" if p["stable"] else f"*{r}*" for r, p in cv["points"].items())
            lines.append(f"| {w} | {c} | {cv['knee']} | {cv['goodput']} | {rates} |")
    return "\n".join(lines)


def load_keys(rows: list[dict]) -> list[str]:
    """The matched loads the rows' cells were measured at (``"70%"``...), in order."""
    found = {k.rsplit("@", 1)[1] for r in rows for k in r["cells"]}
    return sorted(found, key=lambda k: float(k.rstrip("%")))


def _shown_cells(row: dict, shown: dict, keys: Sequence[str]) -> tuple[str, list[dict | None]]:
    """The shown layout of a row and its cells at the loads ``keys``."""
    layout = "PD-CC" if row["comparison"] in ROUTE else shown[row["workload"]]
    return layout, [row["cells"].get(f"{layout}@{k}") for k in keys]


def verdicts_md(result: dict) -> str:
    """The 19 numbers at the shown layout (the paper's where it names one, else the best at
    matched load), the best layout beside the paper's, and a verdict each."""
    keys = load_keys(result["rows"])
    best = shown_layouts(result["rows"], list(result["shown"]), keys, named={})
    lines = [
        f"| workload | comparison | metric | paper | layout | {' | '.join(keys)} | best layout | "
        "verdict |",
        "|---" * (7 + len(keys)) + "|",
    ]
    for r in result["rows"]:
        layout, cells = _shown_cells(r, result["shown"], keys)
        other = "-"
        if r["comparison"] not in ROUTE and best[r["workload"]] != layout:
            found = _shown_cells(r, best, keys)[1]
            other = f"{best[r['workload']]}: {' / '.join(map(_cell_md, found))}"
        lines.append(
            f"| {r['workload']} | {r['comparison']} | {r['metric']} | {r['paper_ratio']:.3f} | "
            f"{layout} | {' | '.join(map(_cell_md, cells))} | {other} | {r['verdict']} |"
        )
    return "\n".join(lines)


def rows_md(rows: list[dict]) -> str:
    """Every number at every layout and load: the paper's (1 + gain) against the simulated."""
    keys = load_keys(rows)
    lines = [
        f"| workload | comparison | metric | paper | sides | {' | '.join(keys)} | rates |",
        "|---" * (6 + len(keys)) + "|",
    ]
    for r in rows:
        columns = dict.fromkeys(k.rsplit("@", 1)[0] for k in r["cells"])
        for col in columns:
            cells = [r["cells"].get(f"{col}@{k}") for k in keys]
            rates = ", ".join(f"{c['rate']}" for c in cells if c is not None)
            lines.append(
                f"| {r['workload']} | {r['comparison']} | {r['metric']} | "
                f"{r['paper_ratio']:.3f} | {col} | {' | '.join(map(_cell_md, cells))} | {rates} |"
            )
    return "\n".join(lines) + f"\n\n{MOVED_NOTE}"


def bounds_md(rows: list[dict]) -> str:
    """Per disaggregation comparison on equal GPUs: ρ, U_P, both decode batches, their step
    time ratio, the bound, the stall estimate and the floor at U_P = 1, against the
    simulated mean and P99 JCT ratios and the TTFT share of the layout's JCT."""
    lines = [
        "| workload | sides | load | ρ (PD) | U_P | B_PD | B_D | d(B_D)/d(B_PD) | bound | "
        "(1 − ρ)·d ratio | floor (U_P = 1) | JCT mean ratio | holds | JCT P99 ratio | "
        "TTFT share |",
        "|---" * 15 + "|",
    ]
    p99 = {
        (r["workload"], k): c
        for r in rows
        if r["metric"] == "jct_p99"
        for k, c in r["cells"].items()
    }
    for r in rows:
        if (r["comparison"], r["metric"]) != ("disagg vs PD", "jct_mean"):
            continue
        for k, c in r["cells"].items():
            b = c.get("bound")
            if not b:
                continue
            col, load = k.rsplit("@", 1)
            terms = " | ".join(_fmt(b[t]) for t in bound.BOUND_TERMS)
            held = "yes" if bound.respects(c["ratio"], b) else "**no**"
            other = p99.get((r["workload"], k))
            lines.append(
                f"| {r['workload']} | {col} | {load} | {terms} | {_fmt(c['ratio'])} | {held} | "
                f"{_fmt(other['ratio']) if other else '-'} | {_fmt(c['ttft_share'])} |"
            )
    return "\n".join(lines) + "\n\n" + BOUND_NOTE


BOUND_NOTE = (
    "bound = (1 − (x/n)·U_P) × d(B_D)/d(B_PD): x of the layout's n instances prefill, U_P their "
    "utilisation over the run, B_PD and B_D the row-weighted mean decode batch of PD and of the "
    "layout's decode instances, d(B) a decode step's time at that batch and mean KV length "
    "(the roofline); ρ is the share of PD's busy time in prefill steps. holds: the simulated "
    "ratio's interval reaches the bound's."
)


def finite_md(result: dict) -> str:
    """Each number at the shown layout in finite runs past the knees (not steady state)."""
    rows = [r for r in result["rows"] if r.get("finite")]
    keys = list(dict.fromkeys(k for r in rows for k in r["finite"]["cells"]))
    lines = [
        f"{FINITE_LABEL}: {result.get('finite_rule', FINITE_RULE)}",
        "",
        f"| workload | comparison | metric | paper | layout | {' | '.join(keys)} | appears at |",
        "|---" * (6 + len(keys)) + "|",
    ]
    for r in rows:
        f = r["finite"]
        cells = []
        for k in keys:
            c = f["cells"].get(k)
            cells.append(
                ""
                if c is None
                else f"{_fmt(c['ratio'])} ({c['rate']:g}/s{'' if c['stable'] else ', unstable'})"
            )
        a = f["appears"]
        where = "-" if a is None else f"{a['rate']:g}/s ({a['past']:.1f} x knee)"
        lines.append(
            f"| {r['workload']} | {r['comparison']} | {r['metric']} | {r['paper_ratio']:.3f} | "
            f"{f['layout']} | {' | '.join(cells)} | {where} |"
        )
    return "\n".join(lines)


def step_cost_md(result: dict) -> str:
    """The shown layouts' matched-load ratios with each fixed cost per step, and how much of
    the gap to the paper the largest one closes."""
    lines = [
        "Fixed cost per step (the profile's 4 ms, then each of "
        f"{', '.join(f'{ms:g}' for ms in STEP_MS)} ms) at the shown layout's matched rates; "
        "moved: the share of the gap to the paper's ratio that the largest cost closes.",
        "",
        "| workload | comparison | metric | paper | layout | load | 4 ms | "
        + " | ".join(f"{ms:g} ms" for ms in STEP_MS)
        + " | moved |",
        "|---" * (8 + len(STEP_MS)) + "|",
    ]
    for r in result["rows"]:
        for load in load_keys(result["rows"]):
            got = [r.get("step_cost", {}).get(f"{ms:g} ms@{load}") for ms in STEP_MS]
            if not any(got):
                continue
            layout = result["shown"][r["workload"]]
            base = r["cells"].get(f"{layout}@{load}")
            lines.append(
                f"| {r['workload']} | {r['comparison']} | {r['metric']} | {r['paper_ratio']:.3f} | "
                f"{layout} | {load} | {_cell_md(base)} | "
                f"{' | '.join(_fmt(g['ratio']) if g else '' for g in got)} | "
                f"{_moved(base, got[-1], r['paper_ratio'])} |"
            )
    return "\n".join(lines)


def _moved(base: dict | None, last: dict | None, want: float) -> str:
    """The share of the gap from ``base``'s ratio to ``want`` that ``last``'s closes."""
    if not (base and last and isinstance(base["ratio"], dict) and isinstance(last["ratio"], dict)):
        return "-"
    gap = want - base["ratio"]["mean"]
    return f"{(last['ratio']['mean'] - base['ratio']['mean']) / gap:+.0%}" if gap else "-"


def routing_md(result: dict) -> str:
    """PD-CC's prompt trees against session affinity and least-load, (1 + gain)."""
    paper = 1 + PAPER["react", "prompt_tree vs session", "ttft_p99"]
    lines = [
        f"| workload | load | rate | vs session, TTFT P99 (paper, ReAct: {paper:.2f}) | "
        "vs session, TTFT mean | vs least_load, TTFT P99 | vs least_load, TTFT mean | "
        "session: busiest instance / even share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["routing"]:
        cells = " | ".join(
            _cell_md(r[f"vs {b} {m}"]) for b in ROUTING[1:] for m in ("ttft_p99", "ttft_mean")
        )
        share = r.get("session_max_share")
        lines.append(
            f"| {r['workload']} | {r['load']:.0%} | {r['rate']} | {cells} | "
            f"{'-' if share is None else f'{share:.2f}'} |"
        )
    return "\n".join(lines)


def plot_gains(result: dict, png: Path) -> None:
    """Each of the 19 numbers: the paper's (1 + gain) beside the simulated ones at the shown
    layout with their intervals, at each matched load (filled) and in finite runs past the
    knee (hollow, not steady state); an overloaded comparison is written, not drawn."""
    from matplotlib.figure import Figure  # slow to import: only plots need it

    rows = result["rows"]
    if not rows:
        return
    keys = load_keys(rows)
    series = [(f"{k} of knee", i, False) for i, k in enumerate(keys)]
    finite = list(dict.fromkeys(k for r in rows for k in r.get("finite", {}).get("cells", {})))
    series += [(f"{k} knee, {FINITE_LABEL}", k, True) for k in finite]
    fig = Figure(figsize=(16, 6), layout="tight")
    ax = fig.subplots()
    width = 0.8 / (len(series) + 1)
    ax.bar(range(len(rows)), [r["paper_ratio"] for r in rows], width, label="paper", color="k")
    for k, (label, at, open_run) in enumerate(series, 1):
        for i, r in enumerate(rows):
            if open_run:
                c = r.get("finite", {}).get("cells", {}).get(at)
            else:
                c = _shown_cells(r, result["shown"], keys)[1][at]
            x = i + k * width
            if c is None:
                continue
            if isinstance(c["ratio"], dict):
                ax.errorbar(
                    x,
                    c["ratio"]["mean"],
                    yerr=c["ratio"]["ci95"],
                    fmt="o",
                    mfc="white" if open_run else f"C{k}",
                    color=f"C{k}",
                    label=label if i == 0 else None,
                    ms=4,
                )
            else:
                ax.text(x, 0.05, c["ratio"], rotation=90, fontsize=6, color=f"C{k}")
    shown = [_shown_cells(r, result["shown"], keys)[0] for r in rows]
    labels = [f"{r['workload']} {r['metric']}\n{r['comparison']}\n{s}" for r, s in zip(rows, shown)]
    ax.set_xticks(range(len(rows)), labels, fontsize=6, rotation=40, ha="right")
    ax.axhline(1, color="black", linewidth=0.5)
    ax.set_ylim(0, 2)
    ax.set_ylabel("1 + gain (new / base), 95 % interval")
    ax.legend(fontsize=7, ncol=4)
    ax.set_title(
        f"MemServe's 19 numbers, paper vs simulated at the shown layout "
        f"({result['setup']['scheduler']}); filled: steady state at matched load; hollow: "
        f"{FINITE_LABEL}; text: overloaded"
    )
    fig.savefig(png, dpi=110)


class _Inline(Executor):
    """Runs each task at once in this process (``jobs=1``: no worker to start)."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        """``fn(*args, **kwargs)`` now; its result (or exception) in a finished future."""
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:
            future.set_exception(e)
        return future
