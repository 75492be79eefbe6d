"""The simulator against a real run: the default `minimemserve bench` and its simulation.

    python bench/sim_validate.py [--out DIR] [--cpu-model FILE] [--sessions N] [--rate R]

Fits the CPU step model (real steps of the tiny preset on one thread, ~15 s) unless
``--cpu-model`` is given, measures the process runtime's per-step cost beyond the forward
pass (one decode-heavy request per instance, ~15 s) and how much longer a prefill takes while
the other instance decodes (~5 s), runs the default four-configuration
benchmark for real (process runtime, one core per instance, two colocated instances,
``prompt_tree`` routing), then
simulates the same sessions (same seed, same instance layout) and prints measured against
predicted mean TTFT and mean JCT per configuration, with the ranking of each. Writes
``sim_validate.json`` and ``sim_validate.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minimemserve.bench import driver
from minimemserve.bench.presets import preset_dir
from minimemserve.sim.profiles import FittedStepModel, fit_cpu_steps
from minimemserve.sim.runner import (
    CPU_INSTANCES,
    DEFAULT_CONFIGS,
    cpu_setup,
    measure_prefill_contention,
    measure_runtime_overhead,
    run_sim,
)

METRICS = (("ttft_mean", "TTFT mean"), ("jct_mean", "JCT mean"))
TARGET_ERROR = 0.20  # the accuracy the simulator aims for on each mean


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/sim_validate")
    ap.add_argument("--cpu-model", default=None, help="fitted step model JSON (default: fit now)")
    ap.add_argument("--sessions", type=int, default=driver.DEFAULT_SESSIONS)
    ap.add_argument("--rate", type=float, default=driver.DEFAULT_RATE)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    return ap.parse_args()


def real_run(configs: list[str], args: argparse.Namespace, out: Path) -> dict:
    """The default benchmark, as ``minimemserve bench`` runs it."""
    factories = driver.process_factories(
        configs,
        cores_per_instance=driver.CORES_PER_INSTANCE,
        num_colocated=driver.COLOCATED_INSTANCES,
        policy="prompt_tree",
        cost_model=None,
    )
    return driver.run_bench(
        configs=configs,
        num_sessions=args.sessions,
        rate=args.rate,
        seed=args.seed,
        out_dir=out / "real",
        factories=factories,
        runtime={"kind": "process", "policy": "prompt_tree"},
    )


def ranking(summaries: dict, key: str) -> list[str]:
    """Configs from best (lowest) to worst on ``key``."""
    return sorted(summaries, key=lambda c: summaries[c][key])


def compare(real: dict, sim: dict) -> list[dict]:
    """One row per config: measured, predicted and relative error of each metric."""
    rows = []
    for c in real:
        row = {"config": c}
        for key, _ in METRICS:
            m, p = real[c][key], sim[c][key]
            row |= {f"{key}_measured": m, f"{key}_predicted": p, f"{key}_error": p / m - 1}
        rows.append(row)
    return rows


def report(rows: list[dict], real: dict, sim: dict) -> dict:
    """Print the side-by-side table and rankings; return the rankings."""
    print(
        f"{'config':10}" + "".join(f"{n + ' meas':>16}{'pred':>10}{'error':>8}" for _, n in METRICS)
    )
    for r in rows:
        cells = "".join(
            f"{r[k + '_measured'] * 1e3:>13.1f} ms{r[k + '_predicted'] * 1e3:>7.1f} ms"
            f"{r[k + '_error']:>8.1%}"
            for k, _ in METRICS
        )
        print(f"{r['config']:10}{cells}")
    ranks = {}
    for key, name in METRICS:
        ranks[key] = {"measured": ranking(real, key), "predicted": ranking(sim, key)}
        same = "same" if ranks[key]["measured"] == ranks[key]["predicted"] else "different"
        print(f"{name} ranking, measured:  {' < '.join(ranks[key]['measured'])}")
        print(f"{name} ranking, predicted: {' < '.join(ranks[key]['predicted'])} ({same})")
    worst = max(abs(r[f"{k}_error"]) for r in rows for k, _ in METRICS)
    print(f"largest error {worst:.1%} (target ±{TARGET_ERROR:.0%})")
    return ranks


def plot(rows: list[dict], path: Path) -> None:
    """Measured against predicted bars per config, one panel per metric."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), layout="tight")
    x = np.arange(len(rows))  # [configs]
    for ax, (key, name) in zip(fig.subplots(1, 2), METRICS):
        ax.bar(x - 0.2, [r[f"{key}_measured"] for r in rows], 0.4, label="measured")
        ax.bar(x + 0.2, [r[f"{key}_predicted"] for r in rows], 0.4, label="simulated")
        ax.set_xticks(x, [r["config"] for r in rows])
        ax.set_ylabel("seconds")
        ax.set_title(name)
        ax.legend()
    fig.suptitle("default minimemserve bench: real run against the simulator (CPU step model)")
    fig.savefig(path, dpi=100)


def main() -> None:
    """Fit (or load), run for real, simulate, compare."""
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    t0 = time.perf_counter()
    if args.cpu_model:
        fitted = FittedStepModel.load(args.cpu_model)
    else:
        # timed in as many processes at once as the bench runs instances: the cores are shared
        fitted = fit_cpu_steps(preset_dir("tiny"), concurrent=CPU_INSTANCES)
        fitted.save(out / "sim_cpu_steps.json")
    print(f"CPU step model: {fitted.samples} steps, mean fit error {fitted.relative_error:.1%}")
    overhead = measure_runtime_overhead(fitted)
    print(
        f"process runtime beyond the forward pass: {overhead[0] * 1e3:.2f} ms per step + "
        f"{overhead[1] * 1e3:.2f} ms per sequence"
    )
    contention = measure_prefill_contention()
    print(f"a prefill beside the other instance's decodes takes {contention:.2f}x as long")
    load_before = os.getloadavg()
    real = real_run(configs, args, out)["summaries"]
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min) before the real run {load_before}, after {load_after}")
    sim = run_sim(
        cpu_setup(fitted, runtime_overhead_s=overhead, prefill_contention=contention),
        configs,
        num_sessions=args.sessions,
        rate=args.rate,
        seed=args.seed,
        out_dir=out / "sim",
        verbose=False,
    )["summaries"]
    rows = compare(real, sim)
    ranks = report(rows, real, sim)
    plot(rows, out / "sim_validate.png")
    result = {
        "rows": rows,
        "rankings": ranks,
        "step_model": fitted.__dict__,
        "runtime_overhead_s": overhead,
        "prefill_contention": contention,
        "load_average": {"before": load_before, "after": load_after},
        "wall_s": time.perf_counter() - t0,
    }
    (out / "sim_validate.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'sim_validate.json'}, {out / 'sim_validate.png'}")


if __name__ == "__main__":
    main()
