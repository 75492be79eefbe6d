"""Rate sweeps at the paper's setup (Llama-2-13B, 8 x H800, TP 2) under both local step
policies: colocated PD and PD-CC against a disaggregated layout and its caching variant, on
every workload, from light load to past saturation.

    python bench/paper_sweeps.py [--ratio 2P2D] [--sessions 600] [--out bench/results]

Writes ``paper_sweep.json`` and one plot per workload (``paper_sweep_<workload>.png``: JCT and
TTFT, mean and P99, against the session rate; solid lines prefill_first, dashed chunked), and
prints each point as it is simulated."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from minimemserve.bench.driver import summarize
from minimemserve.sim.paper import LIGHT_RATE, MAX_OUTPUT_TOKENS, WORKLOADS
from minimemserve.sim.runner import _sessions, gpu_setup, simulate

METRICS = ("jct_mean", "jct_p99", "ttft_mean", "ttft_p99")
SCHEDULERS = ("prefill_first", "chunked")


def sweep(ratio: str, num_sessions: int, doublings: int, seed: int) -> list[dict]:
    """Every (workload, scheduler, config, rate) point: its summary and simulator stats."""
    rows = []
    base = gpu_setup("llama2-13b", "h800", 8, 2)
    configs = ["PD", "PD-CC", ratio, f"{ratio}-CC"]
    rates = [LIGHT_RATE * 2**k for k in range(doublings)]
    for workload in WORKLOADS:
        cap = MAX_OUTPUT_TOKENS.get(workload)
        sessions = _sessions(base, workload, num_sessions, seed, None, cap, None)
        for scheduler in SCHEDULERS:
            cfg = dataclasses.replace(base.engine_config, scheduler=scheduler)
            setup = dataclasses.replace(base, engine_config=cfg)
            for rate in rates:
                t0 = time.perf_counter()
                records, stats = simulate(setup, configs, sessions, rate, seed, progress=False)
                for c in configs:
                    s = summarize(records[c])
                    rows.append(
                        {
                            "workload": workload,
                            "scheduler": scheduler,
                            "config": c,
                            "rate": rate,
                            **{k: s[k] for k in (*METRICS, "tpot_mean", "cached_ratio")},
                            "prefill_share": stats[c]["prefill_share"],
                            "decode_stall_s": stats[c]["decode_stall_s"],
                        }
                    )
                line = ", ".join(
                    f"{r['config']} {r['jct_mean']:.2f}/{1e3 * r['ttft_mean']:.0f}"
                    for r in rows[-len(configs) :]
                )
                print(
                    f"{workload} {scheduler} {rate:g}/s (JCT s/TTFT ms): {line} "
                    f"[{time.perf_counter() - t0:.0f} s]",
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
    p.add_argument("--doublings", type=int, default=7, help="rates from 0.25/s, doubling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    t0 = time.perf_counter()
    rows = sweep(args.ratio, args.sessions, args.doublings, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "paper_sweep.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    for workload in WORKLOADS:
        plot(rows, workload, out / f"paper_sweep_{workload}.png")
    took = time.perf_counter() - t0
    print(f"wrote {out}/paper_sweep.json and paper_sweep_<workload>.png in {took:.0f} s")


if __name__ == "__main__":
    main()
