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

from .runner import DEFAULT_HARDWARE, DEFAULT_MODEL, DEFAULT_TP, SimSetup, gpu_setup
from .sweep import (
    DOUBLINGS,
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
# The disaggregated layouts of the paper's 8 GPUs at TP 2 (3P1D starves every workload's decode
# side and is left out), each with and without caching, and colocated PD and PD-CC.
LAYOUTS = ("1P3D", "2P2D")
CONFIGS = ("PD", "PD-CC", *LAYOUTS, *(f"{x}-CC" for x in LAYOUTS))
GPUS = 8
# ShareGPT's real answers, capped where the paper's 4k-token model leaves room anyway; the
# synthetic workloads keep their own answer lengths (LooGLE 8-32, ReAct 20-100 tokens).
MAX_OUTPUT_TOKENS = {"sharegpt": 1024}
# The loads each comparison is made at: these fractions of the weaker side's capacity.
LOADS = (0.5, 0.7, 0.9)
# Routing compared on PD-CC at the same loads: the paper's prompt trees, session affinity and
# the shortest queue.
ROUTING = ("prompt_tree", "session", "least_load")
# A simulated (1 + gain) matches the paper's when its mean is within MATCH of it (relative).
MATCH = 0.10
# ``--quick``: two workloads, four configurations, every point of them as the full run has it.
QUICK_WORKLOADS = ("loogle", "react")
QUICK_CONFIGS = ("PD", "1P3D", "2P2D", "2P2D-CC")
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


class Points:
    """Every point of one reproduction: each seed's run submitted once to ``pool``, the seeds
    aggregated once (and printed as they complete, with ``progress``)."""

    def __init__(self, pool: Executor, setup: SimSetup, plan: Plan, progress: bool) -> None:
        self.pool = pool
        self.setup = setup
        self.plan = plan
        self.progress = progress
        # (workload, config, policy, rate, doubled): N is doubled ``doubled`` times
        self.futures: dict[tuple, list[Future]] = {}
        self._points: dict[tuple, dict] = {}
        self.t0 = time.perf_counter()

    def submit(
        self, workload: str, config: str, policy: str, rate: float, doubled: int = 0
    ) -> tuple:
        """Simulate the point (once), with N doubled ``doubled`` times; returns its key."""
        key = (workload, config, policy, float(rate), doubled)
        if key not in self.futures:
            setup = self.setup.with_deployment(policy=policy)
            n = self.plan.sessions(workload, rate, doubled)
            cap = MAX_OUTPUT_TOKENS.get(workload)
            self.futures[key] = [
                self.pool.submit(run_point, setup, workload, config, rate, seed, n, cap)
                for seed in self.plan.seeds
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
        return any(not self.point(k)["stable"] for k in list(self.futures) if k[:4] == point)


def _fmt(value: dict | str | None, scale: float = 1.0, digits: int = 2) -> str:
    """``mean ±ci`` of an interval, or the string it is."""
    if not isinstance(value, dict):
        return str(value)
    if value["mean"] is None:
        return "-"
    return f"{scale * value['mean']:.{digits}f} ±{scale * value['ci95']:.{digits}f}"


def point_line(key: tuple, p: dict) -> str:
    """One point in a line: JCT and TTFT means, stability, in-system growth, drift."""
    workload, config, policy, rate, doubled = key
    grow = " ".join("/".join(f"{x:.0f}" for x in s["mean_in_system"][1::2]) for s in p["stability"])
    drift = max(abs(d) for d in p["drift"].values() if d is not None)
    longer = f", N x{2**doubled}" if doubled else ""
    return (
        f"{workload} {config} ({policy}) {rate:g}/s{longer}: JCT {_fmt(p['jct_mean'])} s, TTFT "
        f"{_fmt(p['ttft_mean'], 1e3, 0)} ms, {'stable' if p['stable'] else 'UNSTABLE'} (in "
        f"system, 2nd / 4th quarter: {grow}), moves {drift:.1%} from N to 2N"
    )


def sweep(points: Points, workloads: Sequence[str], configs: Sequence[str]) -> dict:
    """Every configuration's :func:`knee_chain` walked on ``points`` at once:
    ``{workload: {config: Curve}}``."""
    chains, rates, pending = {}, {}, {}
    for w in workloads:
        for c in configs:
            chains[w, c] = knee_chain(
                points.plan.ladders[w], points.plan.extend, points.plan.bisections
            )
            rates[w, c] = list(next(chains[w, c]))
            pending[w, c] = [points.submit(w, c, POLICY, r) for r in rates[w, c]]
    while pending:
        futures = [f for keys in pending.values() for k in keys for f in points.futures[k]]
        wait(futures, return_when=FIRST_COMPLETED)
        for (w, c), keys in list(pending.items()):
            if not all(points.done(k) for k in keys):
                continue
            verdicts = {r: points.point((w, c, POLICY, r, 0))["stable"] for r in rates[w, c]}
            try:
                more = chains[w, c].send(verdicts)
            except StopIteration:
                del pending[w, c]
                continue
            rates[w, c] += more
            pending[w, c] = [points.submit(w, c, POLICY, r) for r in more]
    return {
        w: {c: Curve({r: points.point((w, c, POLICY, r, 0)) for r in rates[w, c]}) for c in configs}
        for w in workloads
    }


def _pairs(layout: str) -> dict[str, tuple[str, str]]:
    """The paper's comparisons for one layout: name -> (new, base)."""
    return {"disagg vs PD": (layout, "PD"), "disagg-CC vs disagg": (f"{layout}-CC", layout)}


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
        for layout in LAYOUTS:
            pair = _pairs(layout)[comparison]
            if set(pair) <= set(curves[w]):
                for load in LOADS:
                    rate = _rate(curves[w], *pair, load)
                    plan.append(
                        (row, f"{layout}@{load:.0%}", (w, pair, (POLICY,) * 2, rate, metric))
                    )
    doubled = settle(points, [c for _, _, c in plan if c[3] is not None])
    for row, name, c in plan:
        row["cells"][name] = cell(points, c, doubled.get(c, 0), row["paper"])
    return rows


def routing_rows(points: Points, curves: dict, workloads: Sequence[str]) -> list[dict]:
    """PD-CC's routing policies at :data:`LOADS` of its capacity under prompt trees: prompt
    trees against session affinity (the paper's row 19 on ReAct) and against the shortest
    queue, P99 and mean TTFT, each run as long as :func:`settle` finds it needs, and how
    evenly ``session`` spread the requests."""
    rows, plan = [], []  # plan: (row, cell name, comparison)
    for w in workloads:
        if "PD-CC" not in curves[w]:
            continue
        for load in LOADS:
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
    in markdown (``sim_paper.md``), a sweep plot per workload and the gains plot. ``quick``
    runs :data:`QUICK_WORKLOADS` x :data:`QUICK_CONFIGS` only, each point as the full run has
    it. Runs go ``jobs`` at a time (default: one per core), each in its own process."""
    t0 = time.perf_counter()
    plan = plan or Plan()
    if quick:
        workloads, configs = QUICK_WORKLOADS, QUICK_CONFIGS
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
    result = {
        "setup": {**setup.describe, "scheduler": scheduler, "quick": quick},
        "plan": dataclasses.asdict(plan),
        "load_rule": LOAD_RULE,
        "stability_rule": STABILITY_RULE,
        "slo": {"ttft_s": SLO_TTFT_S, "tpot_s": SLO_TPOT_S, "attainment": SLO_ATTAINMENT},
        "workloads": {w: _curves_json(curves[w]) for w in workloads},
        "rows": rows,
        "routing": routing,
        "wall_s": time.perf_counter() - t0,
        "files": [],
    }
    print(markdown(result))
    if out_dir is not None:
        write(result, curves, Path(out_dir))
    return result


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


def _cell_md(c: dict) -> str:
    text = _fmt(c["ratio"])
    text = f"**{text}**" if c["verdict"] == "match" else text
    moved = isinstance(c["ratio"], dict) and not c["ratio"]["converged"]
    return f"{text} {MOVED}" if moved else text


def markdown(result: dict) -> str:
    """The reproduction's tables: knees and goodput, the 18 gains at matched load as ratios
    of (1 + gain) with 95 % intervals, and routing (row 19)."""
    lines = [LOAD_RULE, "", knees_md(result), "", rows_md(result["rows"]), "", routing_md(result)]
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


def rows_md(rows: list[dict]) -> str:
    """The 18 numbers: paper's (1 + gain) against the simulated one per layout and load."""
    if not rows:
        return ""
    keys = list(rows[0]["cells"])
    lines = [
        "| workload | comparison | metric | paper | " + " | ".join(keys) + " |",
        "|---" * (4 + len(keys)) + "|",
    ]
    for r in rows:
        cells = " | ".join(_cell_md(r["cells"][k]) if k in r["cells"] else "" for k in keys)
        lines.append(
            f"| {r['workload']} | {r['comparison']} | {r['metric']} | {r['paper_ratio']:.3f} | "
            f"{cells} |"
        )
    rates = "; ".join(
        f"{r['workload']} {r['comparison']}: "
        + ", ".join(f"{k} = {c['rate']}/s" for k, c in r["cells"].items())
        for r in rows
        if r["metric"] == "jct_mean"
    )
    return "\n".join(lines) + f"\n\n{MOVED_NOTE}\n\nRates: {rates}."


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
    """Each of the 18 numbers: the paper's (1 + gain) beside the simulated ones with their
    intervals, per layout and load; an overloaded comparison is written, not drawn."""
    from matplotlib.figure import Figure  # slow to import: only plots need it

    rows = result["rows"]
    if not rows:
        return
    keys = list(rows[0]["cells"])
    fig = Figure(figsize=(15, 6), layout="tight")
    ax = fig.subplots()
    width = 0.8 / (len(keys) + 1)
    ax.bar(range(len(rows)), [r["paper_ratio"] for r in rows], width, label="paper", color="k")
    for k, key in enumerate(keys, 1):
        for i, r in enumerate(rows):
            c, x = r["cells"].get(key), i + k * width
            if c is None:
                continue
            if isinstance(c["ratio"], dict):
                ax.errorbar(
                    x,
                    c["ratio"]["mean"],
                    yerr=c["ratio"]["ci95"],
                    fmt="o",
                    color=f"C{k}",
                    label=key if i == 0 else None,
                    ms=4,
                )
            else:
                ax.text(x, 0.05, c["ratio"], rotation=90, fontsize=6, color=f"C{k}")
    labels = [f"{r['workload']} {r['metric']}\n{r['comparison']}" for r in rows]
    ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=40, ha="right")
    ax.axhline(1, color="black", linewidth=0.5)
    ax.set_ylim(0, 2)
    ax.set_ylabel("1 + gain (new / base), 95 % interval")
    ax.legend(fontsize=7, ncol=4)
    ax.set_title(
        f"MemServe's gains at matched load, paper vs simulated "
        f"({result['setup']['scheduler']}); text: no number (overloaded)"
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
