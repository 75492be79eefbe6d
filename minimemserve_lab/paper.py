"""``minimemserve sim --paper``: MemServe's evaluation (arXiv 2406.17565, Section 6) simulated.

The paper serves Llama-2-13B on 8 GPUs at tensor parallelism 2 and reports 19 relative
gains over three workloads (:data:`PAPER`): disaggregation against colocated PD, caching on
top of disaggregation, and prompt-tree against session routing. It states no request rates.
:func:`reproduce` sweeps every configuration's load to past its knee (``sweep.py``: steady
windows, three seeds, a stability verdict per point), then measures each gain at 50, 70 and
90 % of the weaker side's capacity, as the ratio of (1 + gain) with its 95 % interval; a
comparison with an unstable side is reported as overloaded, never as a number.

One rule decides each number (:func:`judge`): on its designated layout (:func:`designate`),
the paper's value inside the interval at a majority of the load points. Each verdict is
derived again under six changes to the cost profile (:data:`VARIANTS`), knees swept again,
and is robust when none flips it. Every run of every seed is kept in the JSON (``runs``), and
:func:`audit` derives every point, knee, cell and verdict again from them alone."""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import os
import re
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait
from pathlib import Path

import numpy as np

from minimemserve.sim.runner import (
    DEFAULT_HARDWARE,
    DEFAULT_MODEL,
    DEFAULT_TP,
    SimSetup,
    gpu_setup,
    with_costs,
)
from minimemserve.workloads.results import STABLE_GROWTH, STABLE_NOISE, STABLE_SLACK

from . import bound
from .compare import FINITE_LABEL
from .report import OVERLOADED
from .sweep import (
    DOUBLINGS,
    FINITE_LOADS,
    MATCHED_LOADS,
    SLO_ATTAINMENT,
    SLO_TPOT_S,
    SLO_TTFT_S,
    STEADY_TOLERANCE,
    TIME_GROWTH,
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
# The layout the paper names for a workload; elsewhere the designated layout is the one with
# the lowest mean JCT against PD on the same GPUs at DESIGNATING_LOAD of the knee.
NAMED = {"sharegpt": f"1P2D{ON}6"}
DESIGNATING_LOAD = 0.7
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
# The six changes to the cost profile every verdict is derived again under (knees swept
# again): ``runner.with_costs``'s arguments by name; "base" is the profile itself.
BASE = "base"
VARIANTS = {
    BASE: {},
    "prefill x0.7": {"prefill_speed": 0.7},
    "prefill x1.3": {"prefill_speed": 1.3},
    "decode x0.7": {"decode_speed": 0.7},
    "decode x1.3": {"decode_speed": 1.3},
    "10 ms a step": {"step_ms": 10.0},
    "20 ms a step": {"step_ms": 20.0},
}
# Finite runs (not steady state): every turn at its own arrival ("open"), and each turn at
# the later of its arrival and its session's turn before ending ("paced").
FINITE_MODES = ("open", "paced")
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
    sweep_seeds=(0,),
)
POLICY = "prompt_tree"
# The mark of a ratio that moves by STEADY_TOLERANCE or more between N and 2N sessions.
MOVED = "†"
MOVED_NOTE = (
    f"A ratio that moves by {STEADY_TOLERANCE:.0%} or more between N and 2N sessions is "
    "measured again with N doubled, up to {doublings} time(s) (each cell's N is in the JSON); "
    f"{MOVED}: it still moves that much at the largest N. A side found unstable at any N is "
    f"overloaded in every comparison at its rate."
)
LOAD_RULE = (
    "The paper states no request rates. Each configuration is swept from light load past its "
    "knee; its capacity is the highest stable rate below the lowest unstable one. Each gain is "
    "measured at 50, 70 and 90 % of the capacity of the weaker of its two sides."
)
VERDICT_RULE = (
    "A number is reproduced when the paper's 1 + gain lies inside the simulated ratio's 95 % "
    "interval at a majority of the load points, on its designated comparison: the paper's "
    "layout where it names one (ShareGPT: 1P2D on 6 GPUs against PD on 6), else the layout "
    f"with the lowest mean JCT against PD on the same GPUs at {DESIGNATING_LOAD:.0%} of the "
    "knee; row 19 is PD-CC under prompt trees against session routing. Robust: the same "
    "verdict under every change to the cost profile, knees swept again."
)


class AuditError(ValueError):
    """A recorded evaluation lacks a run that its own rule needs."""


def key_id(key: tuple) -> str:
    """A point's key as the JSON ``runs`` table names it."""
    return json.dumps(list(key[:7]) + [list(key[7])])


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
    aggregated once (and printed as they complete, with ``progress``). With ``table`` (a
    recorded evaluation's ``runs``) and no pool, every run is read from it instead: the
    audit's points."""

    def __init__(
        self,
        pool: Executor | None,
        setup: SimSetup,
        plan: Plan,
        progress: bool,
        table: dict | None = None,
    ) -> None:
        self.pool = pool
        self.setup = setup
        self.plan = plan
        self.progress = progress
        self.table = table
        self._recorded = [_key(k) for k in table] if table is not None else []
        # (workload, side, policy, rate, doubled, arrivals, variant, seeds): N is doubled
        # ``doubled`` times; a finite run's arrivals are "open" or "paced"
        self.futures: dict[tuple, list[Future]] = {}
        self._points: dict[tuple, dict] = {}
        self._setups: dict[str, SimSetup] = {BASE: setup}
        self.t0 = time.perf_counter()

    def setup_for(self, variant: str) -> SimSetup:
        """The setup with ``variant``'s costs (:data:`VARIANTS`)."""
        if variant not in self._setups:
            self._setups[variant] = with_costs(self.setup, **VARIANTS[variant])
        return self._setups[variant]

    def submit(
        self,
        workload: str,
        config: str,
        policy: str,
        rate: float,
        doubled: int = 0,
        arrivals: str = "closed",
        variant: str = BASE,
        seeds: tuple[int, ...] | None = None,
    ) -> tuple:
        """Simulate the point (once) of side ``config`` (:func:`side`), with N doubled
        ``doubled`` times, ``arrivals`` as ``SimCluster.replay`` takes them, the costs of
        ``variant`` and ``seeds`` (None: the plan's); returns its key."""
        seeds = tuple(seeds or self.plan.seeds)
        key = (workload, config, policy, float(rate), doubled, arrivals, variant, seeds)
        if self.table is not None:
            if key_id(key) not in self.table:
                raise AuditError(f"the rule needs a run that was not recorded: {key_id(key)}")
            return key
        if key not in self.futures:
            name, gpus = side(config)
            setup = dataclasses.replace(
                self.setup_for(variant).with_deployment(policy=policy), instances=gpus // DEFAULT_TP
            )
            n = self.plan.sessions(workload, rate, doubled)
            cap = MAX_OUTPUT_TOKENS.get(workload)
            self.futures[key] = [
                self.pool.submit(run_point, setup, workload, name, rate, seed, n, cap, arrivals)
                for seed in seeds
            ]
        return key

    def going(self, keys: Sequence[tuple]) -> list[Future]:
        """The runs of ``keys`` still going."""
        if self.table is not None:
            return []
        return [f for k in keys for f in self.futures[k] if not f.done()]

    def runs(self, key: tuple) -> list[dict]:
        """Each seed's run of ``key`` (waits for them)."""
        if self.table is not None:
            return self.table[key_id(key)]["runs"]
        return [f.result() for f in self.futures[key]]

    def point(self, key: tuple) -> dict:
        """``key``'s seeds aggregated (waits for them)."""
        if key not in self._points:
            self._points[key] = p = aggregate(self.runs(key))
            if self.progress:
                print(f"  {point_line(key, p)} [{time.perf_counter() - self.t0:.0f} s]", flush=True)
        return self._points[key]

    def unstable(
        self, workload: str, config: str, policy: str, rate: float, variant: str = BASE
    ) -> bool:
        """Whether the point is unstable at any N it was simulated with (waits for them)."""
        point = (workload, config, policy, float(rate))
        keys = self.futures if self.table is None else self._recorded
        closed = [k for k in list(keys) if k[:4] == point and k[5:7] == ("closed", variant)]
        return any(not self.point(k)["stable"] for k in closed)

    def recorded(self) -> dict:
        """Every run by key (:func:`key_id`), as the JSON keeps it: each seed's run without
        its wall time, and the wall times beside."""
        out = {}
        for key in self.futures:
            runs = self.runs(key)
            out[key_id(key)] = {
                "runs": [{k: v for k, v in r.items() if k != "wall_s"} for r in runs],
                "wall_s": [r["wall_s"] for r in runs],
            }
        return out


def _key(text: str) -> tuple:
    """:func:`key_id` read back."""
    k = json.loads(text)
    return (*k[:7], tuple(k[7]))


def _fmt(value: dict | str | None, scale: float = 1.0, digits: int = 2) -> str:
    """``mean ±ci`` of an interval, or the string it is."""
    if not isinstance(value, dict):
        return str(value)
    if value["mean"] is None:
        return "-"
    return f"{scale * value['mean']:.{digits}f} ±{scale * value['ci95']:.{digits}f}"


def point_line(key: tuple, p: dict) -> str:
    """One point in a line: JCT and TTFT means, stability, in-system growth, drift."""
    workload, config, policy, rate, doubled, arrivals, variant, _ = key
    grow = " ".join("/".join(f"{x:.0f}" for x in s["mean_in_system"][1::2]) for s in p["stability"])
    drift = max((abs(d) for d in p["drift"].values() if d is not None), default=0.0)
    longer = f", N x{2**doubled}" if doubled else ""
    longer += f", {FINITE_LABEL} ({arrivals})" if arrivals != "closed" else ""
    longer += f", {variant}" if variant != BASE else ""
    growth = "-" if p["growth"] is None else f"{p['growth']:+.0%}"
    return (
        f"{workload} {config} ({policy}) {rate:g}/s{longer}: JCT {_fmt(p['jct_mean'])} s, TTFT "
        f"{_fmt(p['ttft_mean'], 1e3, 0)} ms, {'stable' if p['stable'] else 'UNSTABLE'} (in "
        f"system, 2nd / 4th quarter: {grow}; time in system {growth}), moves {drift:.1%} from "
        "N to 2N"
    )


def sweep(
    points: Points,
    workloads: Sequence[str],
    configs: dict[str, Sequence[str]],
    variant: str = BASE,
    ladders: dict[tuple[str, str], Sequence[float]] | None = None,
) -> dict:
    """Every configuration's :func:`knee_chain` walked on ``points`` at once (``configs`` by
    workload; ``ladders`` by (workload, config), else the plan's), under ``variant``'s costs:
    ``{workload: {config: Curve}}``."""
    chains, rates, pending = {}, {}, {}
    seeds = points.plan.sweep_seeds

    def submit(w: str, c: str, r: float) -> tuple:
        return points.submit(w, c, POLICY, r, variant=variant, seeds=seeds)

    for w in workloads:
        for c in configs[w]:
            ladder = (ladders or {}).get((w, c)) or points.plan.ladders[w]
            chains[w, c] = knee_chain(ladder, points.plan.extend, points.plan.bisections)
            rates[w, c] = list(next(chains[w, c]))
            pending[w, c] = [submit(w, c, r) for r in rates[w, c]]
    while pending:
        # the runs still going (a finished one would end every wait at once: a busy loop)
        if going := points.going([k for ks in pending.values() for k in ks]):
            wait(going, return_when=FIRST_COMPLETED)
        for (w, c), keys in list(pending.items()):
            if points.going(keys):
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
        w: {c: Curve({r: points.point(submit(w, c, r)) for r in rates[w, c]}) for c in configs[w]}
        for w in workloads
    }


def _pairs(layout: str) -> dict[str, tuple[str, str]]:
    """The paper's comparisons for one layout: name -> (new, base), PD on the same GPUs."""
    return {
        "disagg vs PD": (layout, colocated(layout)),
        "disagg-CC vs disagg": (cached(layout), layout),
    }


def _columns(comparison: str, layouts: Sequence[str]) -> list[tuple[str, tuple[str, str]]]:
    """Each column of a row of ``comparison``: (its name, (new, base) sides): every one of
    ``layouts``, and for disaggregation over every layout 1P2D against PD on other GPU
    counts."""
    cols = [(layout, _pairs(layout)[comparison]) for layout in layouts]
    if comparison == "disagg vs PD" and tuple(layouts) == LAYOUTS:
        cols += [(f"{new} vs {base} ({UNEQUAL_NOTE})", (new, base)) for new, base in UNEQUAL]
    return cols


def _rate(curves: dict, new: str, base: str, load: float) -> float | None:
    """``load`` times the weaker side's capacity (None: either has no stable rate)."""
    knees = [curves[c].knee if c in curves else None for c in (new, base)]
    return None if None in knees else round(load * min(knees), 3)


# (workload, (new, base) configs, (new, base) policies, rate, metric, variant)
Comparison = tuple


def _submit(points: Points, comparison: Comparison, doubled: int) -> tuple[tuple, tuple]:
    """Both sides of ``comparison`` with N doubled ``doubled`` times; their keys."""
    workload, (new, base), (pnew, pbase), rate, _, variant = comparison
    return (
        points.submit(workload, new, pnew, rate, doubled, variant=variant),
        points.submit(workload, base, pbase, rate, doubled, variant=variant),
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
    workload, (new, base), (pnew, pbase), rate, metric, variant = c
    sides = f"{new} vs {base}" if new != base else f"{new} {pnew} vs {pbase}"
    costs = f" ({variant})" if variant != BASE else ""
    return f"{workload} {sides} {metric} at {rate:g}/s{costs}"


def cell(points: Points, comparison: Comparison, doubled: int, paper: float) -> dict:
    """One comparison at one rate, its N doubled ``doubled`` times: the simulated (1 + gain)
    with its interval and each seed's, and whether it holds the paper's value (inside the
    interval)."""
    rate = comparison[3]
    if rate is None:
        return {"rate": None, "ratio": "no stable load", "verdict": "no stable load"}
    r = _ratio(points, comparison, doubled)
    workload, configs, policies = comparison[:3]
    variant = comparison[5]
    if any(points.unstable(workload, c, p, rate, variant) for c, p in zip(configs, policies)):
        r = OVERLOADED  # a side that turned unstable with more sessions is overloaded at any N
    sessions = points.plan.sessions(workload, rate, doubled)
    if isinstance(r, str):
        return {"rate": rate, "sessions": sessions, "ratio": r, "verdict": r}
    new, base = (points.runs(k) for k in _submit(points, comparison, doubled))
    metric = comparison[4]
    return {
        "rate": rate,
        "sessions": sessions,
        "ratio": r,
        "per_seed": [a["steady"][metric] / b["steady"][metric] for a, b in zip(new, base)],
        "verdict": "holds" if abs(r["mean"] - (1 + paper)) <= r["ci95"] else "misses",
    }


def _row(workload: str, comparison: str, metric: str) -> dict:
    paper = PAPER[workload, comparison, metric]
    return {
        "workload": workload,
        "comparison": comparison,
        "metric": metric,
        "paper": paper,
        "paper_ratio": 1 + paper,
        "cells": {},
    }


def matched_rows(
    points: Points,
    curves: dict,
    workloads: Sequence[str],
    layouts: dict[str, Sequence[str]],
    variant: str = BASE,
) -> list[dict]:
    """The paper's 18 disaggregation and caching numbers, each at the plan's loads of the
    weaker side's capacity for each of ``layouts[workload]`` swept, under ``variant``'s
    costs, each run as long as :func:`settle` finds it needs."""
    rows, plan = [], []  # plan: (row, cell name, comparison)
    for w, comparison, metric in PAPER:
        if w not in workloads or comparison not in _pairs("x"):
            continue
        rows.append(row := _row(w, comparison, metric))
        for column, pair in _columns(comparison, layouts[w]):
            if set(pair) <= set(curves[w]):
                for load in points.plan.loads:
                    rate = _rate(curves[w], *pair, load)
                    c = (w, pair, (POLICY,) * 2, rate, metric, variant)
                    plan.append((row, f"{column}@{load:.0%}", c))
    doubled = settle(points, [c for _, _, c in plan if c[3] is not None])
    for row, name, c in plan:
        row["cells"][name] = x = cell(points, c, doubled.get(c, 0), row["paper"])
        if isinstance(x["ratio"], dict):
            _explain(points, x, row["comparison"], c, doubled.get(c, 0))
    return rows


def _explain(points: Points, x: dict, comparison: str, c: Comparison, doubled: int) -> None:
    """What a measured cell of ``comparison`` is made of: the TTFT share of its
    disaggregated side's JCT and, for disaggregation on equal GPUs, the estimate
    (``bound.py``) from both sides' runs."""
    new, base = (points.runs(k) for k in _submit(points, c, doubled))
    disagg = comparison == "disagg vs PD"
    x["ttft_share"] = bound.ttft_share(new if disagg else base)
    if disagg and side(c[1][0])[1] == side(c[1][1])[1]:
        x["bound"] = bound.bound(new, base, points.setup_for(c[5]).step_model)


def routing_rows(
    points: Points, curves: dict, workloads: Sequence[str], variant: str = BASE
) -> list[dict]:
    """PD-CC's routing policies at the plan's loads of its capacity under prompt trees:
    prompt trees against session affinity (the paper's row 19 on ReAct) and against the
    shortest queue, P99 and mean TTFT, each run as long as :func:`settle` finds it needs,
    and how evenly ``session`` spread the requests."""
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
                    c = (w, ("PD-CC", "PD-CC"), (POLICY, base), rate, metric, variant)
                    plan.append((row, f"vs {base} {metric}", c))
    doubled = settle(points, [c for _, _, c in plan if c[3] is not None])
    paper = PAPER["react", "prompt_tree vs session", "ttft_p99"]
    for row, name, c in plan:
        row[name] = cell(points, c, doubled.get(c, 0), paper)
    for row in rows:
        if row["rate"] is not None:
            key = points.submit(row["workload"], "PD-CC", "session", row["rate"], variant=variant)
            n = points.setup.instances
            row["session_max_share"] = max(spread(r["dispatches"], n) for r in points.runs(key))
    return rows


def spread(dispatches: dict[str, int], instances: int) -> float:
    """The busiest of ``instances``' requests over an even share (1.0: perfectly even)."""
    total = sum(dispatches.values())
    return max(dispatches.values()) * instances / total if total else 0.0


def row19(routing: list[dict]) -> dict | None:
    """Row 19 (prompt trees against session routing, P99 TTFT on ReAct's PD-CC) as a row of
    the 19: its cells are the routing table's."""
    (w, comparison, metric), _ = next((k, v) for k, v in PAPER.items() if k[1] in ROUTE)
    cells = {
        f"PD-CC@{r['load']:.0%}": r[f"vs session {metric}"] for r in routing if r["workload"] == w
    }
    if not cells:
        return None
    return _row(w, comparison, metric) | {"cells": cells}


# Row 19's sides: PD-CC under prompt trees against PD-CC under session routing.
ROUTE = {"prompt_tree vs session": (("PD-CC", "PD-CC"), (POLICY, "session"))}


def _numeric(cells: dict) -> dict[str, dict]:
    return {k: c for k, c in cells.items() if isinstance(c.get("ratio"), dict)}


def designate(rows: list[dict], workloads: Sequence[str]) -> dict[str, str]:
    """The designated layout per workload: the paper's where it names one (:data:`NAMED`),
    else the one whose mean JCT against PD on the same GPUs is lowest at
    :data:`DESIGNATING_LOAD` of the knee (an overloaded one cannot be picked; a tie goes to
    the first of :data:`LAYOUTS`; none measured: the first)."""
    out = {}
    for w in workloads:
        if w in NAMED:
            out[w] = NAMED[w]
            continue
        row = next(
            r
            for r in rows
            if (r["workload"], r["comparison"], r["metric"]) == (w, "disagg vs PD", "jct_mean")
        )
        cells = _numeric(row["cells"])
        scores = {
            layout: cells[k]["ratio"]["mean"]
            for layout in LAYOUTS
            if (k := f"{layout}@{DESIGNATING_LOAD:.0%}") in cells
        }
        out[w] = min(scores, key=scores.get) if scores else LAYOUTS[0]
    return out


def layout_of(row: dict, designated: dict[str, str]) -> str:
    """The column of ``row`` its verdict is decided on."""
    return "PD-CC" if row["comparison"] in ROUTE else designated[row["workload"]]


def judge(row: dict, designated: dict[str, str], loads: Sequence[float]) -> dict:
    """The rule (:data:`VERDICT_RULE`): which of the designated column's load points hold
    the paper's value, and whether a majority do."""
    layout = layout_of(row, designated)
    names = [f"{k:.0%}" for k in loads]
    held = [row["cells"].get(f"{layout}@{k}", {}).get("verdict") == "holds" for k in names]
    return {
        "layout": layout,
        "loads": names,
        "held": held,
        "reproduced": 2 * sum(held) > len(loads),
    }


def _sides(row: dict, layout: str) -> tuple[tuple[str, str], tuple[str, str]]:
    """A row's (new, base) sides and policies at ``layout``."""
    if row["comparison"] in ROUTE:
        return ROUTE[row["comparison"]]
    return _pairs(layout)[row["comparison"]], (POLICY, POLICY)


def finite_rows(
    points: Points, curves: dict, rows: list[dict], designated: dict, loads: Sequence[float]
) -> None:
    """Every row's comparison at the designated layout as finite runs (not steady state) in
    each of :data:`FINITE_MODES` at ``loads`` times its weaker side's knee; each row gets
    ``finite``: per mode and load the ratio, how far past each side's knee, each side's
    prefix-cache hit ratio and preemptions. Never part of a verdict."""
    plan = []
    for row in rows:
        w = row["workload"]
        layout = layout_of(row, designated)
        (new, base), policies = _sides(row, layout)
        knees = [curves[w][c].knee if c in curves[w] else None for c in (new, base)]
        row["finite"] = {"layout": layout, "label": FINITE_LABEL, "cells": {}}
        if None in knees:
            continue
        for mode in FINITE_MODES:
            for k in loads:
                rate = round(k * min(knees), 3)
                sides = zip((new, base), policies)
                keys = [points.submit(w, c, p, rate, 0, mode) for c, p in sides]
                plan.append((row, f"{mode} {k:g}x", rate, knees, keys))
    for row, name, rate, knees, (a, b) in plan:
        runs = points.runs(a), points.runs(b)
        row["finite"]["cells"][name] = {
            "rate": rate,
            "past_new": rate / knees[0],
            "past_base": rate / knees[1],
            "ratio": ratio(*runs, row["metric"], finite=True),
            "cached_ratio": [float(np.mean([hits(r) for r in x])) for x in runs],
            "preemptions": [sum(r["preemptions"] for r in x) for x in runs],
            "stable": points.point(a)["stable"] and points.point(b)["stable"],
        }


def hits(run: dict) -> float:
    """A run's prefix-cache hit ratio over its measured requests (0 where none)."""
    return run["steady"]["cached_ratio"] or 0.0


def _implied_ttft_share(workload: str) -> float | None:
    """The TTFT share of the disaggregated JCT that the paper's caching numbers imply (caching
    changes TTFT only): its JCT gain over its TTFT gain."""
    jct = PAPER.get((workload, "disagg-CC vs disagg", "jct_mean"))
    ttft = PAPER.get((workload, "disagg-CC vs disagg", "ttft_mean"))
    return None if jct is None or ttft is None else jct / ttft


def knee_estimate(name: str, b: dict) -> float:
    """A cell's estimate with U_P grown in proportion to the load up to the knee (at most 1):
    about the lowest its layout can reach at any stable load. ``name`` ends in its load."""
    load = float(name.rsplit("@", 1)[1].rstrip("%")) / 100
    d, floor = b["d_ratio"]["mean"], b["floor"]["mean"]
    share = 1 - floor / d  # x / n
    return (1 - share * min(1.0, b["u_p"]["mean"] / load)) * d


def _reason(row: dict, layout: str) -> str:
    """Why a number is not reproduced on ``layout``, in measured numbers: the cell nearest
    the paper's value, the estimate at the knee (disaggregation) and the TTFT share of JCT
    (caching, JCT)."""
    want = row["paper_ratio"]
    cells = {k: c for k, c in _numeric(row["cells"]).items() if k.rsplit("@", 1)[0] == layout}
    if not cells:
        return "every load point overloaded"
    near = min(cells, key=lambda k: abs(cells[k]["ratio"]["mean"] - want))
    r = cells[near]["ratio"]
    parts = [f"nearest {r['mean']:.2f} ±{r['ci95']:.2f} ({near})"]
    at_knee = {k: knee_estimate(k, c["bound"]) for k, c in cells.items() if c.get("bound")}
    if at_knee:
        k = min(at_knee, key=at_knee.get)
        parts.append(f"estimate at the knee {at_knee[k]:.2f}")
    shares = [c["ttft_share"]["mean"] for c in cells.values() if c.get("ttft_share")]
    if row["comparison"] == "disagg-CC vs disagg" and row["metric"].startswith("jct") and shares:
        implied = _implied_ttft_share(row["workload"])
        parts.append(f"TTFT {max(shares):.1%} of JCT (the paper's imply {implied:.0%})")
    return "; ".join(parts)


def verdict(row: dict) -> str:
    """A row's verdict in words: reproduced (at which loads) or not (why), and robust or
    fragile (under which changes)."""
    j = row["judged"]
    loads = [k for k, h in zip(j["loads"], j["held"]) if h]
    if j["reproduced"]:
        text = f"reproduced ({', '.join(loads)})"
    else:
        text = f"not reproduced: {_reason(row, j['layout'])}"
    flips = [v for v, ok in row.get("sensitivity", {}).items() if ok != j["reproduced"]]
    if not row.get("sensitivity"):
        return text
    return text + ("; robust" if not flips else f"; fragile: flips at {', '.join(flips)}")


def sensitivity(
    points: Points,
    curves: dict,
    rows: list[dict],
    designated: dict[str, str],
    workloads: Sequence[str],
) -> dict:
    """Every verdict derived again under each of :data:`VARIANTS` but the base: the
    designated sides' knees swept again (each ladder half, one and two times the base knee),
    their cells measured at the same loads, judged by the same rule. Each row gets
    ``sensitivity`` ({variant: reproduced}); returns each variant's knees and rows."""
    out = {}
    for variant in points.plan.variants or VARIANTS:
        if variant == BASE:
            continue
        configs = {
            w: [
                c
                for c in dict.fromkeys(
                    (*_pairs(designated[w])["disagg vs PD"], cached(designated[w]), "PD-CC")
                )
                if c in curves[w]
            ]
            for w in workloads
        }
        ladders = {
            (w, c): (round(k / 2, 3), k, 2 * k)
            for w in workloads
            for c in configs[w]
            if (k := curves[w][c].knee) is not None
        }
        vcurves = sweep(points, workloads, configs, variant, ladders)
        vrows = matched_rows(
            points, vcurves, workloads, {w: (designated[w],) for w in workloads}, variant
        )
        routing = routing_rows(points, vcurves, workloads, variant)
        vrows += [r for r in [row19(routing)] if r is not None]
        out[variant] = {
            "knees": {w: {c: cv.knee for c, cv in vcurves[w].items()} for w in workloads},
            "rows": vrows,
        }
        by = {(r["workload"], r["comparison"], r["metric"]): r for r in vrows}
        for row in rows:
            v = by.get((row["workload"], row["comparison"], row["metric"]))
            judged = judge(v, designated, points.plan.loads) if v else {"reproduced": False}
            if v:
                v["judged"] = judged
            row.setdefault("sensitivity", {})[variant] = judged["reproduced"]
    return out


def evaluate(points: Points, workloads: Sequence[str], configs: Sequence[str]) -> dict:
    """Every number the evaluation reports, derived from ``points`` (live runs, or a
    recorded table for the audit): the sweep, the 19 rows at matched loads, routing, the
    designated layouts and verdicts, the sensitivity to the cost profile and the finite
    runs."""
    curves = sweep(points, workloads, {w: configs for w in workloads})
    rows = matched_rows(points, curves, workloads, {w: LAYOUTS for w in workloads})
    routing = routing_rows(points, curves, workloads)
    numbers = rows + [r for r in [row19(routing)] if r is not None]
    designated = designate(rows, workloads)
    for row in numbers:
        row["judged"] = judge(row, designated, points.plan.loads)
    variants = sensitivity(points, curves, numbers, designated, workloads)
    finite_rows(points, curves, numbers, designated, points.plan.finite_loads)
    for row in numbers:
        row["verdict"] = verdict(row)
    return {
        "workloads": {w: _curves_json(curves[w]) for w in workloads},
        "designated": designated,
        "rows": numbers,
        "routing": routing,
        "sensitivity": variants,
    }


def _plan(text: dict) -> Plan:
    """A recorded plan (``dataclasses.asdict``) as a :class:`Plan`."""
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in text.items()}
    fields["ladders"] = {w: tuple(r) for w, r in text["ladders"].items()}
    return Plan(**fields)


def _base_setup(scheduler: str) -> SimSetup:
    base = gpu_setup(DEFAULT_MODEL, DEFAULT_HARDWARE, GPUS, DEFAULT_TP)
    return base.with_deployment(engine=dataclasses.replace(base.engine_config, scheduler=scheduler))


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
    ``prefill_first``): :func:`evaluate` on live runs; prints the tables; with ``out_dir``
    writes ``sim_paper.json`` (every seed's run in ``runs``, so that :func:`audit` can derive
    it all again), the tables in markdown (``sim_paper.md``), a sweep plot per workload and
    the gains plot. ``quick`` runs :data:`QUICK_PLAN` (every workload and configuration,
    fewer bisections and extra runs). Runs go ``jobs`` at a time (default: one per core),
    each in its own process."""
    t0 = time.perf_counter()
    plan = plan or (QUICK_PLAN if quick else Plan())
    setup = _base_setup(scheduler)
    jobs = jobs or os.cpu_count() or 1
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=spawn) if jobs > 1 else _Inline() as pool:
        points = Points(pool, setup, plan, progress)
        derived = evaluate(points, workloads, configs)
        table = points.recorded()
    result = {
        "setup": {**setup.describe, "scheduler": scheduler, "quick": quick},
        "plan": dataclasses.asdict(plan),
        "configs": list(configs),
        "load_rule": LOAD_RULE,
        "verdict_rule": VERDICT_RULE,
        "stability_rule": STABILITY_RULE,
        "finite_rule": FINITE_RULE,
        "slo": {"ttft_s": SLO_TTFT_S, "tpot_s": SLO_TPOT_S, "attainment": SLO_ATTAINMENT},
        **json.loads(json.dumps(derived)),
        "wall_s": time.perf_counter() - t0,
        "jobs": jobs,
        "run_wall_s": sum(sum(r["wall_s"]) for r in table.values()),
        "files": [],
        "runs": table,
    }
    print(markdown(result))
    if out_dir is not None:
        write(result, Path(out_dir))
    return result


DERIVED = ("workloads", "designated", "rows", "routing", "sensitivity")


def audit(path: str | Path) -> list[str]:
    """Every point, knee, cell, designated layout, verdict and sensitivity of a written
    evaluation derived again from its recorded runs alone (the same rule, no simulation);
    the differences from what it says, as ``path: recorded != derived`` lines (none: it
    holds), or the run its rule needed and lacks."""
    stored = json.loads(Path(path).read_text())
    plan = _plan(stored["plan"])
    points = Points(None, _base_setup(stored["setup"]["scheduler"]), plan, False, stored["runs"])
    try:
        derived = evaluate(points, list(stored["workloads"]), stored["configs"])
    except AuditError as e:
        return [str(e)]
    derived = json.loads(json.dumps(derived))
    out: list[str] = []
    for k in DERIVED:
        _diff(stored.get(k), derived[k], k, out)
    return out


def _diff(a, b, path: str, out: list[str]) -> None:
    """Append to ``out`` where ``a`` and ``b`` differ (numbers to 1e-9 relative)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in dict.fromkeys([*a, *b]):
            _diff(a.get(k), b.get(k), f"{path}.{k}", out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}[{i}]", out)
    elif isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        if not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12):
            out.append(f"{path}: {a!r} != {b!r}")
    elif a != b:
        out.append(f"{path}: {str(a)[:80]} != {str(b)[:80]}")


FINITE_RULE = (
    f"{FINITE_LABEL}: the sessions a point replays (N), counted over the whole run; open: every "
    f"turn sent at its own Poisson arrival time whether or not its session's turns before it "
    f"finished (its prompt built from their answers); paced: each turn sent at the later of its "
    f"arrival and the end of its session's turn before, as a user who waits for the answer; each "
    f"comparison of the designated layout at {', '.join(f'{k:g}' for k in FINITE_LOADS)} times "
    f"its weaker side's knee (--quick: fewer); never part of a verdict"
)
STABILITY_RULE = (
    f"stable: every seed's run passes the in-system test (the mean number of requests in system "
    f"over the last quarter of the arrival window, q4, is at most {STABLE_GROWTH} e + "
    f"{STABLE_NOISE} sqrt(e) + {STABLE_SLACK}, with e = q2 a4 / a2, q2 being that mean over its "
    f"second quarter and a2, a4 the requests arriving in the second and last quarters), and the "
    f"time in system, q / a summed over the seeds, grows by at most {TIME_GROWTH:.0%} from the "
    f"second quarter to the fourth"
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


def write(result: dict, out: Path) -> None:
    """The JSON, the markdown tables and the plots into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "sim_paper.json", out / "sim_paper.md", out / "sim_paper.png"]
    for w, cv in result["workloads"].items():
        files.append(out / f"paper_sweep_{w}.png")
        curves = {c: Curve({float(r): p for r, p in x["points"].items()}) for c, x in cv.items()}
        plot_sweep(curves, files[-1], f"{w}, simulated ({result['setup']['scheduler']})")
    result["files"] = list(map(str, files))
    files[0].write_text(json.dumps(result, indent=None, separators=(",", ":")))
    files[1].write_text(markdown(result) + "\n")
    plot_gains(result, files[2])
    print(f"wrote {', '.join(result['files'])} ({result['wall_s']:.0f} s)")


def _cell_md(c: dict | None) -> str:
    if c is None:
        return ""
    text = _fmt(c["ratio"])
    text = f"**{text}**" if c.get("verdict") == "holds" else text
    moved = isinstance(c["ratio"], dict) and not c["ratio"].get("converged", True)
    return f"{text} {MOVED}" if moved else text


def markdown(result: dict) -> str:
    """The reproduction's tables: the rule, knees and goodput, the 19 numbers with their
    verdicts, every layout's gains at matched load as ratios of (1 + gain) with 95 %
    intervals, the estimate per comparison, the sensitivity, the finite runs and routing."""
    lines = [
        LOAD_RULE,
        "",
        result.get("verdict_rule", VERDICT_RULE),
        "",
        knees_md(result),
        "",
        verdicts_md(result),
        "",
        rows_md(result["rows"], result["plan"]["doublings"]),
        "",
        bounds_md(result["rows"]),
        "",
        sensitivity_md(result),
        "",
        finite_md(result),
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


def _cells_at(row: dict, layout: str, keys: Sequence[str]) -> list[dict | None]:
    """A row's cells on ``layout`` at the loads ``keys``."""
    return [row["cells"].get(f"{layout}@{k}") for k in keys]


def verdicts_md(result: dict) -> str:
    """The 19 numbers on their designated layouts at each load point (bold: it holds the
    paper's value), and a verdict each by the one rule, robust or fragile."""
    keys = load_keys(result["rows"])
    lines = [
        f"| workload | comparison | metric | paper | designated | {' | '.join(keys)} | verdict |",
        "|---" * (6 + len(keys)) + "|",
    ]
    for r in result["rows"]:
        layout = r["judged"]["layout"]
        cells = " | ".join(map(_cell_md, _cells_at(r, layout, keys)))
        lines.append(
            f"| {r['workload']} | {r['comparison']} | {r['metric']} | {r['paper_ratio']:.3f} | "
            f"{layout} | {cells} | {r['verdict']} |"
        )
    return "\n".join(lines)


def rows_md(rows: list[dict], doublings: int = DOUBLINGS) -> str:
    """Every number at every layout and load: the paper's (1 + gain) against the simulated
    (``doublings``: the plan's most re-runs with N doubled)."""
    keys = load_keys(rows)
    lines = [
        f"| workload | comparison | metric | paper | sides | {' | '.join(keys)} | rates |",
        "|---" * (6 + len(keys)) + "|",
    ]
    for r in rows:
        columns = dict.fromkeys(k.rsplit("@", 1)[0] for k in r["cells"])
        for col in columns:
            cells = _cells_at(r, col, keys)
            rates = ", ".join(f"{c['rate']}" for c in cells if c is not None)
            lines.append(
                f"| {r['workload']} | {r['comparison']} | {r['metric']} | "
                f"{r['paper_ratio']:.3f} | {col} | {' | '.join(map(_cell_md, cells))} | {rates} |"
            )
    return "\n".join(lines) + "\n\n" + MOVED_NOTE.format(doublings=doublings)


def bounds_md(rows: list[dict]) -> str:
    """Per disaggregation comparison on equal GPUs: ρ, U_P, both decode batches, their step
    time ratio, the estimate, the stall estimate and the floor at U_P = 1, against the
    simulated mean JCT ratio (and that cell's P99 ratio) and the TTFT share of the layout's
    JCT."""
    lines = [
        "| workload | sides | load | ρ (PD) | U_P | B_PD | B_D | d(B_D)/d(B_PD) | estimate | "
        "(1 − ρ)·d ratio | floor (U_P = 1) | JCT mean ratio | reaches the estimate | "
        "JCT P99 ratio | TTFT share |",
        "|---" * 15 + "|",
    ]
    p99 = {
        (r["workload"], k): c
        for r in rows
        if (r["comparison"], r["metric"]) == ("disagg vs PD", "jct_p99")
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
    "estimate = (1 − (x/n)·U_P) × d(B_D)/d(B_PD): x of the layout's n instances prefill, U_P "
    "their utilisation, B_PD and B_D the row-weighted mean decode batch of PD and of the "
    "layout's decode instances, d(B) a decode step's time at that batch and mean KV length (the "
    "roofline); ρ is the share of PD's busy time in prefill steps; every term over the steady "
    "window of the ratio (from the first steady session's start to the last session's). "
    "reaches: the ratio's interval reaches the estimate's."
)


def sensitivity_md(result: dict) -> str:
    """Each number's verdict under each change to the cost profile (knees swept again), and
    the designated sides' knees under each."""
    variants = [v for v in VARIANTS if v in result.get("sensitivity", {})]
    if not variants:
        return ""
    mark = {True: "reproduced", False: "not"}
    lines = [
        f"| workload | comparison | metric | base | {' | '.join(variants)} |",
        "|---" * (4 + len(variants)) + "|",
    ]
    for r in result["rows"]:
        got = " | ".join(mark[r["sensitivity"][v]] for v in variants)
        lines.append(
            f"| {r['workload']} | {r['comparison']} | {r['metric']} | "
            f"{mark[r['judged']['reproduced']]} | {got} |"
        )
    lines += ["", f"| workload | config | base | {' | '.join(variants)} |"]
    lines.append("|---" * (3 + len(variants)) + "|")
    for w, curves in result["workloads"].items():
        first = result["sensitivity"][variants[0]]["knees"][w]
        for c in first:
            knees = " | ".join(str(result["sensitivity"][v]["knees"][w].get(c)) for v in variants)
            lines.append(f"| {w} | {c} | {curves[c]['knee']} | {knees} |")
    return "\n".join(lines)


def finite_md(result: dict) -> str:
    """Each number at the designated layout in finite runs past the knees (not steady
    state), open and paced: the ratio, each side's cache hit ratio and preemptions."""
    rows = [r for r in result["rows"] if r.get("finite")]
    keys = list(dict.fromkeys(k for r in rows for k in r["finite"]["cells"]))
    lines = [
        f"{result.get('finite_rule', FINITE_RULE)}. Each cell: the ratio "
        "(rate; cache hits new / base; preemptions new / base).",
        "",
        f"| workload | comparison | metric | paper | layout | {' | '.join(keys)} |",
        "|---" * (5 + len(keys)) + "|",
    ]
    for r in rows:
        f = r["finite"]
        cells = []
        for k in keys:
            c = f["cells"].get(k)
            if c is None:
                cells.append("")
                continue
            hits = " / ".join(f"{x:.0%}" for x in c["cached_ratio"])
            pre = " / ".join(str(x) for x in c["preemptions"])
            flag = "" if c["stable"] else ", unstable"
            cells.append(f"{_fmt(c['ratio'])} ({c['rate']:g}/s{flag}; {hits}; {pre})")
        lines.append(
            f"| {r['workload']} | {r['comparison']} | {r['metric']} | {r['paper_ratio']:.3f} | "
            f"{f['layout']} | {' | '.join(cells)} |"
        )
    return "\n".join(lines)


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
    """Each of the 19 numbers: the paper's (1 + gain) beside the simulated ones at the
    designated layout with their intervals, at each matched load (filled) and in finite runs
    past the knee (hollow, not steady state); an overloaded comparison is written, not
    drawn."""
    from matplotlib.figure import Figure  # slow to import: only plots need it

    rows = result["rows"]
    if not rows:
        return
    keys = load_keys(rows)
    series = [(f"{k} of knee", k, False) for k in keys]
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
                c = r["cells"].get(f"{r['judged']['layout']}@{at}")
            x = i + k * width
            if c is None:
                continue
            if isinstance(c["ratio"], dict):
                ax.errorbar(
                    x,
                    c["ratio"]["mean"],
                    yerr=c["ratio"]["ci95"],
                    fmt="o",
                    mfc="white" if open_run else f"C{k % 10}",
                    color=f"C{k % 10}",
                    label=label if i == 0 else None,
                    ms=4,
                )
            else:
                ax.text(x, 0.05, c["ratio"], rotation=90, fontsize=6, color=f"C{k % 10}")
    labels = [
        f"{r['workload']} {r['metric']}\n{r['comparison']}\n{r['judged']['layout']}" for r in rows
    ]
    ax.set_xticks(range(len(rows)), labels, fontsize=6, rotation=40, ha="right")
    ax.axhline(1, color="black", linewidth=0.5)
    ax.set_ylim(0, 2)
    ax.set_ylabel("1 + gain (new / base), 95 % interval")
    ax.legend(fontsize=7, ncol=4)
    ax.set_title(
        f"MemServe's 19 numbers, paper vs simulated at the designated layout "
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


# ---- the docs' numbers, rendered from a committed evaluation ----------------------------------
BLOCK = re.compile(r"<!-- sim_paper (\w+):(\w+) -->\n(.*?)<!-- /sim_paper -->", re.S)


def summary_md(result: dict) -> str:
    """The verdicts counted, and what the run was: its plan, points, runs and wall time."""
    rows = result["rows"]
    yes = [r for r in rows if r["judged"]["reproduced"]]
    robust = [r for r in rows if r["verdict"].endswith("robust")]
    plan = result["plan"]
    jobs = result.get("jobs")
    return (
        f"By the rule, {len(yes)} of the {len(rows)} numbers are reproduced "
        f"({sum(r in robust for r in yes)} of them robust) and {len(rows) - len(yes)} are not "
        f"({sum(r in robust for r in rows if r not in yes)} of them robust). The run: "
        f"{'the quick plan' if result['setup']['quick'] else 'the whole plan'} ("
        f"{len(plan['seeds'])} seeds a comparison, sessions scaled by {plan['scale']:g}, N "
        f"doubled at most {plan['doublings']} times), {len(result['runs'])} points "
        f"({sum(len(x['runs']) for x in result['runs'].values())} runs), "
        f"{result['wall_s']:.0f} s of wall time"
        + (f" with --jobs {jobs}" if jobs else "")
        + f", {result['run_wall_s']:.0f} s in runs."
    )


RENDERERS = {
    "summary": summary_md,
    "verdicts": verdicts_md,
    "routing": routing_md,
    "knees": knees_md,
    "sensitivity": sensitivity_md,
    "estimates": lambda result: bounds_md(result["rows"]),
    "finite": finite_md,
}


def render_blocks(text: str, results: dict[str, dict]) -> str:
    """``text`` (a markdown file) with every ``<!-- sim_paper RUN:BLOCK -->`` block rendered
    again from ``results[RUN]`` (:data:`RENDERERS`)."""

    def block(m: re.Match) -> str:
        run, name = m.group(1), m.group(2)
        body = RENDERERS[name](results[run])
        return f"<!-- sim_paper {run}:{name} -->\n{body}\n<!-- /sim_paper -->"

    return BLOCK.sub(block, text)
