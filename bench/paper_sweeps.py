"""Rate sweeps at the paper's setup (Llama-2-13B, 8 x H800, TP 2) under both local step
policies: colocated PD and PD-CC against a disaggregated layout and its caching variant, on
every workload, from light load to past saturation.

    python bench/paper_sweeps.py [--ratio 2P2D] [--sessions 600] [--rates 0.5,1,2,4,8,16]

Writes ``paper_sweep.json`` and one plot per workload (``paper_sweep_<workload>.png``: JCT and
TTFT, mean and P99, against the session rate; solid lines prefill_first, dashed chunked), and
prints each point as it is simulated."""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from minimemserve.sim.paper import MAX_OUTPUT_TOKENS, WORKLOADS, simulate_one
from minimemserve.sim.runner import gpu_setup, workload_sessions

METRICS = ("jct_mean", "jct_p99", "ttft_mean", "ttft_p99")
SCHEDULERS = ("prefill_first", "chunked")


def sweep(ratio: str, num_sessions: int, rates: list[float], seed: int, jobs: int) -> list[dict]:
    """Every (workload, scheduler, config, rate) point: its summary and simulator stats."""
    base = gpu_setup("llama2-13b", "h800", 8, 2)
    configs = ["PD", "PD-CC", ratio, f"{ratio}-CC"]
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=spawn) as pool:
        points = []
        for workload in WORKLOADS:
            cap = MAX_OUTPUT_TOKENS.get(workload)
            sessions = workload_sessions(base, workload, num_sessions, seed, None, cap, None)
            for scheduler in SCHEDULERS:
                cfg = dataclasses.replace(base.engine_config, scheduler=scheduler)
                setup = base.with_deployment(engine=cfg)
                for rate in rates:
                    for c in configs:
                        f = pool.submit(simulate_one, setup, c, sessions, rate, seed)
                        points.append(((workload, scheduler, c, rate), f))
        rows = []
        for (workload, scheduler, c, rate), f in points:
            s, stats = f.result()
            rows.append(
                {
                    "workload": workload,
                    "scheduler": scheduler,
                    "config": c,
                    "rate": rate,
                    **{k: s[k] for k in (*METRICS, "tpot_mean", "cached_ratio")},
                    "prefill_share": stats["prefill_share"],
                    "decode_stall_s": stats["decode_stall_s"],
                }
            )
            print(
                f"{workload} {scheduler} {rate:g}/s {c}: JCT {s['jct_mean']:.2f} s "
                f"(P99 {s['jct_p99']:.2f}), TTFT {1e3 * s['ttft_mean']:.0f} ms "
                f"(P99 {1e3 * s['ttft_p99']:.0f}), TPOT {1e3 * s['tpot_mean']:.1f} ms",
                flush=True,
            )
    return rows


def plot(rows: list[dict], workload: str, png: Path) -> None:
    """JCT and TTFT (mean, P99) against rate: a line per config, solid prefill_first,
    dashed chunked."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 8), layout="tight")
    axes = fig.subplots(2, 2)
    configs = list(dict.fromkeys(r["config"] for r in rows))
    for ax, key in zip(axes.flat, METRICS):
        for k, c in enumerate(configs):
            for scheduler, style in zip(SCHEDULERS, ("-", "--")):
                pts = [
                    (r["rate"], r[key])
                    for r in rows
                    if (r["workload"], r["config"], r["scheduler"]) == (workload, c, scheduler)
                ]
                xs, ys = zip(*pts)
                ax.plot(xs, ys, style, color=f"C{k}", marker="o", label=f"{c} {scheduler}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("session arrival rate (1/s)")
        ax.set_ylabel(f"{key.replace('_', ' ')} (s)")
        ax.legend(fontsize=6)
    fig.suptitle(f"simulated {workload}: Llama-2-13B, 8 x H800, TP 2", fontsize=10)
    fig.savefig(png, dpi=100)


def main() -> None:
    """Parse the options, sweep, write JSON and plots."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ratio", default="2P2D", help="the disaggregated layout on the 4 instances")
    p.add_argument("--sessions", type=int, default=600)
    p.add_argument("--rates", default="0.5,1,2,4,8,16", help="session rates, comma-separated")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    t0 = time.perf_counter()
    rates = [float(r) for r in args.rates.split(",")]
    rows = sweep(args.ratio, args.sessions, rates, args.seed, args.jobs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "paper_sweep.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    for workload in WORKLOADS:
        plot(rows, workload, out / f"paper_sweep_{workload}.png")
    took = time.perf_counter() - t0
    print(f"wrote {out}/paper_sweep.json and paper_sweep_<workload>.png in {took:.0f} s")


if __name__ == "__main__":
    main()
