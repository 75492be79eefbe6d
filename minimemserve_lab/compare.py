"""``minimemserve sim``'s comparison: the configurations simulated on one workload
(:func:`run_sim`) or over request rates (:func:`sweep`), and printed, written and plotted
as ``minimemserve bench`` reports its real runs."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from minimemserve.config import parse_config_name
from minimemserve.sim.runner import SimSetup, simulate, workload_sessions
from minimemserve.workloads.results import DEFAULT_CONFIGS, summarize
from minimemserve.workloads.sessions import total_turns, workload_args

from .report import caching_ratios, format_table, write_plots

# What tables, JSON and plots call a closed replay and a finite run (``--arrivals open``).
STEADY_LABEL, FINITE_LABEL = "closed loop", "finite run (not steady state)"


def regime_label(arrivals: str) -> str:
    """What a replay with ``arrivals`` measures, as tables, JSON and plots call it."""
    return STEADY_LABEL if arrivals == "closed" else FINITE_LABEL


# What a simulated workload is made of, with the defaults ``run_sim`` takes for them.
SIM_WORKLOAD_ARGS = {
    "workload": "sharegpt",
    "num_sessions": 16,
    "rate": 1.0,
    "seed": 0,
    "max_turns": None,
    "max_output_tokens": None,
    "max_context": None,
}


def run_sim(
    setup: SimSetup,
    configs: Sequence[str] = DEFAULT_CONFIGS,
    *,
    out_dir: str | Path | None = None,
    progress: bool = True,
    verbose: bool = True,
    tag: str = "sim",
    arrivals: str = "closed",
    **workload: Any,
) -> dict:
    """Simulate a workload (``workload``: :data:`SIM_WORKLOAD_ARGS`) under ``configs`` and compare
    them as ``minimemserve bench`` does: prints the table; with ``out_dir``, writes
    ``<tag>_<workload>.json`` and its bar and CDF plots there. ``arrivals="open"`` or
    ``"paced"``: a finite run (``SimCluster.replay``), labelled :data:`FINITE_LABEL` in the
    table, JSON and plots."""
    for c in configs:
        parse_config_name(c)
    w = workload_args(workload, SIM_WORKLOAD_ARGS)
    workload, rate, seed = w["workload"], w["rate"], w["seed"]
    sessions = workload_sessions(
        setup,
        workload,
        w["num_sessions"],
        seed,
        w["max_turns"],
        w["max_output_tokens"],
        w["max_context"],
    )
    records, stats = simulate(setup, configs, sessions, rate, seed, progress, arrivals)
    summaries = {c: summarize(records[c]) for c in configs}
    regime = regime_label(arrivals)
    result = {
        "setup": {
            "workload": workload,
            "arrivals": arrivals,
            "regime": regime,
            "sessions": len(sessions),
            "turns": total_turns(sessions),
            "rate": rate,
            "seed": seed,
            "configs": list(configs),
            **setup.describe,
        },
        "summaries": summaries,
        "ttft_later_ratio": caching_ratios(summaries),
        "sim_stats": stats,
        "records": records,
        "files": [],
    }
    if verbose:
        for c, s in stats.items():
            print(
                f"{c}: {s['simulated_s']:.1f} simulated s in {s['wall_s']:.2f} s "
                f"({s['steps']} steps, {s['steps_per_s']:.0f} steps/s), pools balanced"
            )
        print(f"{regime}:\n{format_table(summaries)}")
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        title = f"simulated {workload}: {len(sessions)} sessions, {rate} sessions/s, {regime}"
        pngs = write_plots(records, summaries, out / f"{tag}_{workload}", title=title)
        path = out / f"{tag}_{workload}.json"
        result["files"] = [str(path), *map(str, pngs)]
        path.write_text(json.dumps(result, indent=1))
        if verbose:
            print("wrote " + ", ".join(result["files"]))
    return result


def sweep(
    setup: SimSetup,
    configs: Sequence[str],
    workload: str,
    num_sessions: int,
    rates: Sequence[float],
    seed: int = 0,
    out_dir: str | Path | None = None,
    progress: bool = True,
    arrivals: str = "closed",
    **workload_kw,
) -> dict:
    """Mean and P99 JCT and TTFT of each config against the request rate (``arrivals``:
    ``SimCluster.replay``'s); with ``out_dir``, writes them (JSON) and one plot there."""
    sessions = workload_sessions(
        setup,
        workload,
        num_sessions,
        seed,
        workload_kw.get("max_turns"),
        workload_kw.get("max_output_tokens"),
        workload_kw.get("max_context"),
    )
    rows = []
    for rate in rates:
        records, _ = simulate(setup, configs, sessions, rate, seed, False, arrivals)
        for c in configs:
            s = summarize(records[c])
            rows.append(
                {
                    "rate": rate,
                    "config": c,
                    **{
                        k: s[k]
                        for k in (
                            "ttft_mean",
                            "ttft_p99",
                            "jct_mean",
                            "jct_p99",
                            "cached_ratio",
                            "errors",
                        )
                    },
                }
            )
            if progress:
                print(
                    f"rate {rate:g}/s {c}: JCT mean {s['jct_mean']:.3f} s, "
                    f"TTFT mean {s['ttft_mean']:.3f} s"
                )
    if out_dir is None:
        return {"rows": rows, "files": []}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png = out / f"sim_{workload}_sweep.png"
    regime = regime_label(arrivals)
    _plot_sweep(rows, configs, png, f"simulated {workload}, {regime}, {setup.describe}")
    path = out / f"sim_{workload}_sweep.json"
    meta = {**setup.describe, "arrivals": arrivals, "regime": regime}
    path.write_text(json.dumps({"setup": meta, "rows": rows}, indent=1))
    return {"rows": rows, "files": [str(path), str(png)]}


def _plot_sweep(rows: list[dict], configs: Sequence[str], png: Path, title: str) -> None:
    from matplotlib.figure import Figure  # slow to import: only plots need it

    fig = Figure(figsize=(12, 8), layout="tight")
    axes = fig.subplots(2, 2)
    for ax, key in zip(axes.flat, ("jct_mean", "jct_p99", "ttft_mean", "ttft_p99")):
        for c in configs:
            pts = [(r["rate"], r[key]) for r in rows if r["config"] == c and r[key] is not None]
            ax.plot(*zip(*pts), marker="o", label=c) if pts else None
        ax.set_xlabel("session arrival rate (1/s)")
        ax.set_ylabel(f"{key.replace('_', ' ')} (s)")
        ax.legend()
    fig.suptitle(title[:150], fontsize=9)
    fig.savefig(png, dpi=100)
