"""The simulator's speed on points of ``minimemserve sim --paper``, against another checkout.

Each point (workload, configuration, rate, seed, N) is one seed's run of the paper's sweep:
``2 N`` sessions on the paper's cluster (Llama-2-13B, 8 x H800, TP 2, ``prefill_first``).
Every run is its own process, importing minimemserve from this tree or from ``--base`` (e.g. an
unpacked ``git archive`` of an earlier commit), alternated so both see the same machine load;
each point's best of ``--repeat`` wall times is compared. A run digests its records (SHA-256
of their JSON), and both trees must give the same digest: the simulation is deterministic,
so a faster simulator must give the same records.

    python bench/sim_speed.py --base /tmp/base            # this tree against /tmp/base
    python bench/sim_speed.py --repeat 1 --points 0,1     # fewer points, one run each

Prints a table (seconds, this tree's speed-up, digests equal) and writes
bench/results/sim_speed.json and sim_speed.png (seconds per point, both trees).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

RESULTS = Path(__file__).resolve().parent / "results" / "sim_speed.json"
PNG = RESULTS.with_suffix(".png")
HERE = Path(__file__).resolve().parent.parent
# (workload, config, rate, seed, N): a LooGLE and a ReAct run as --quick has them (transfers
# and prefix matching dominate), ShareGPT ones of the full sweep (decode steps dominate; PD at
# 4/s with the N the sweep gives it, Plan().sessions("sharegpt", 4.0)).
POINTS = (
    ("loogle", "2P2D-CC", 3.0, 0, 60),
    ("loogle", "2P2D", 2.0, 1, 40),
    ("react", "2P2D-CC", 6.0, 0, 90),
    ("react", "PD", 8.0, 2, 120),
    ("sharegpt", "2P2D", 6.0, 0, 360),
    ("sharegpt", "PD", 4.0, 0, 240),
)
CAP = {"sharegpt": 1024}  # the paper run's output cap


def child(point: str) -> None:
    """Run one point in this process (minimemserve from ``PYTHONPATH``): prints the JSON of
    its wall time (the simulation alone, not building the sessions), the virtual seconds it
    simulated and its records' digest."""
    from minimemserve.sim.runner import (
        DEFAULT_HARDWARE,
        DEFAULT_MODEL,
        DEFAULT_TP,
        gpu_setup,
        simulate,
        workload_sessions,
    )

    workload, config, rate, seed, n = json.loads(point)
    base = gpu_setup(DEFAULT_MODEL, DEFAULT_HARDWARE, 8, DEFAULT_TP)
    engine = dataclasses.replace(base.engine_config, scheduler="prefill_first")
    setup = base.with_deployment(engine=engine)
    sessions = workload_sessions(setup, workload, 2 * n, seed, None, CAP.get(workload), None)
    t0 = time.perf_counter()
    records, stats = simulate(setup, [config], sessions, rate, seed, progress=False)
    wall = time.perf_counter() - t0
    digest = hashlib.sha256(json.dumps(records[config], sort_keys=True).encode()).hexdigest()
    out = {"wall_s": wall, "simulated_s": stats[config]["simulated_s"]}
    print(json.dumps(out | {"digest": digest[:16], "requests": len(records[config])}))


def run(tree: Path, point: tuple) -> dict:
    """One run of ``point`` in a fresh process importing minimemserve from ``tree``."""
    env = os.environ | {"PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(point)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    """Parse arguments, time every point under both trees, print and write the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, help="another checkout to compare against")
    ap.add_argument("--repeat", type=int, default=3, help="runs per point and tree (best kept)")
    ap.add_argument("--points", help="comma-separated indices into POINTS (default: all)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    picked = [POINTS[int(i)] for i in args.points.split(",")] if args.points else list(POINTS)
    trees = {"this": HERE} | ({"base": args.base.resolve()} if args.base else {})
    rows = []
    bar = tqdm(total=len(picked) * len(trees) * args.repeat, unit="run", desc="sim_speed")
    for point in picked:
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(args.repeat):
            for name, tree in trees.items():  # alternated: both see the same load
                runs[name].append(run(tree, point))
                bar.update()
        row = {"point": point, **{f"{k}_s": min(r["wall_s"] for r in v) for k, v in runs.items()}}
        row["digests"] = {k: sorted({r["digest"] for r in v}) for k, v in runs.items()}
        row["requests"] = runs["this"][0]["requests"]
        row["simulated_s"] = runs["this"][0]["simulated_s"]
        if "base" in trees:
            row["speedup"] = row["base_s"] / row["this_s"]
            row["same_records"] = row["digests"]["this"] == row["digests"]["base"]
        rows.append(row)
    bar.close()
    print(
        f"{'point':42}{'requests':>9}{'base s':>9}{'this s':>9}{'speed-up':>10}"
        f"{'sim s/s':>9}  same records"
    )
    for r in rows:
        name = "{} {} {:g}/s seed {} N={}".format(*r["point"])
        base = f"{r['base_s']:>9.2f}" if "base_s" in r else f"{'-':>9}"
        speed = f"{r['speedup']:>9.2f}x" if "speedup" in r else f"{'-':>10}"
        rate = r["simulated_s"] / r["this_s"]  # virtual seconds per wall second, this tree
        same = r.get("same_records")
        print(f"{name:42}{r['requests']:>9}{base}{r['this_s']:>9.2f}{speed}{rate:>9.0f}  {same}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    meta["load_average"] = os.getloadavg()
    RESULTS.write_text(json.dumps({**meta, "repeat": args.repeat, "rows": rows}, indent=1))
    plot(rows)
    print(f"wrote {RESULTS}, {PNG}")


def plot(rows: list[dict]) -> None:
    """Seconds per point, one bar per tree."""
    from matplotlib.figure import Figure  # slow to import: only the plot needs it

    fig = Figure(figsize=(9, 4), layout="tight")
    ax = fig.subplots()
    names = ["{} {} {:g}/s".format(*r["point"]) for r in rows]
    for k, tree in enumerate(t for t in ("base", "this") if f"{t}_s" in rows[0]):
        xs = [i + 0.4 * k for i in range(len(rows))]
        ax.bar(xs, [r[f"{tree}_s"] for r in rows], 0.4, label=tree)
    ax.set_xticks(range(len(rows)), names, fontsize=7, rotation=20, ha="right")
    ax.set_ylabel("seconds per run (best of the repeats)")
    ax.legend()
    fig.savefig(PNG, dpi=100)


if __name__ == "__main__":
    main()
