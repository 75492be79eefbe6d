"""Routing policies of the global scheduler, compared on the same workloads side by side.

Two colocated instances with caching (PD-CC), each its own process on one core, serve the
same sessions under every policy: round_robin, least_load, session (hash of the first
block), prompt_tree (believed cached prefix + queued work, weighed by the cost model; the
instance holding most of a prompt may push the missing KV to the chosen one first) and
prompt_tree_local (the same without pushes).

Workloads: ``react`` (every question shares one few-shot prefix, so hashing the first block
sends everything to one instance) and ``sharegpt`` (multi-turn conversations).

    python bench/scheduler.py                                # both workloads, all policies
    python bench/scheduler.py --workloads react --policies session,prompt_tree
    python bench/scheduler.py --cost-model bench/results/cost_model.json

Prints a table and writes bench/results/scheduler.json and scheduler.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from minimemserve.config import EngineConfig
from minimemserve.deployment import DeploymentSpec
from minimemserve.scheduler.cost_model import CostModel
from minimemserve.scheduler.global_scheduler import ROUTING_POLICIES
from minimemserve_lab.harness.driver import (
    COLOCATED_INSTANCES,
    CORES_PER_INSTANCE,
    process_factories,
    run_bench,
)

RESULTS = Path(__file__).resolve().parent / "results" / "scheduler.json"
CONFIG = "PD-CC"
DEFAULT_WORKLOADS = ("react", "sharegpt")


def run_policy(args: argparse.Namespace, workload: str, policy: str, cost_model) -> dict:
    """One workload under one policy; returns its summary row."""
    seen: dict = {}

    process = process_factories(
        [CONFIG],
        cores_per_instance=CORES_PER_INSTANCE,
        num_colocated=COLOCATED_INSTANCES,
        policy=policy,
        cost_model=cost_model,
    )[CONFIG]

    def factory(spec):
        seen["cluster"] = process(spec)
        return seen["cluster"]

    result = run_bench(
        configs=[CONFIG],
        workload=workload,
        num_sessions=args.sessions,
        rate=args.rate,
        max_output_tokens=args.max_output_tokens,
        out_dir=None,
        seed=args.seed,
        options=DeploymentSpec(engine=EngineConfig(seed=args.seed)),
        factories={CONFIG: factory},
        progress=not args.no_progress,
        verbose=False,
    )
    s = result["summaries"][CONFIG]
    cluster = seen["cluster"]
    per_instance = dict(sorted(cluster.scheduler.dispatches.items()))
    return {
        "workload": workload,
        "policy": policy,
        "requests": s["requests"],
        "errors": s["errors"],
        "ttft_mean_ms": s["ttft_mean"] * 1e3,
        "ttft_p99_ms": s["ttft_p99"] * 1e3,
        "ttft_mean_later_ms": (s["ttft_mean_later"] or 0.0) * 1e3,
        "jct_mean_ms": s["jct_mean"] * 1e3,
        "jct_p99_ms": s["jct_p99"] * 1e3,
        "cached_ratio": s["cached_ratio"],
        "requests_per_instance": per_instance,
        "prefix_transfers": cluster.scheduler.num_transfers,
        "prefix_tokens_moved": cluster.prefix_tokens_moved,
        "wall_s": result["pool_stats"][CONFIG]["wall_s"],
    }


def print_table(rows: list[dict]) -> None:
    """Print one line per workload and policy: TTFT, JCT, cached ratio, requests per
    instance and prefix pushes."""
    head = (
        f"{'workload':<9} {'policy':<21} {'TTFT mean':>9} {'TTFT P99':>9} {'later':>7} "
        f"{'JCT mean':>9} {'cached':>7} {'per instance':>13} {'pushes':>6}"
    )
    print("\n(times in ms)\n" + head + "\n" + "-" * len(head))
    for r in rows:
        split = "/".join(str(v) for v in r["requests_per_instance"].values())
        print(
            f"{r['workload']:<9} {r['policy']:<21} {r['ttft_mean_ms']:>9.1f} "
            f"{r['ttft_p99_ms']:>9.1f} {r['ttft_mean_later_ms']:>7.1f} {r['jct_mean_ms']:>9.1f} "
            f"{r['cached_ratio']:>7.1%} {split:>13} {r['prefix_transfers']:>6}"
        )


def plot(rows: list[dict], path: Path) -> Path:
    """Mean TTFT, mean JCT and cached-token ratio per policy, one group per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    value = {(r["workload"], r["policy"]): r for r in rows}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / len(policies)
    for ax, key, label in (
        (axes[0], "ttft_mean_ms", "mean TTFT (ms)"),
        (axes[1], "jct_mean_ms", "mean JCT (ms)"),
        (axes[2], "cached_ratio", "cached prompt tokens"),
    ):
        for j, p in enumerate(policies):
            xs = [i + (j - (len(policies) - 1) / 2) * width for i in range(len(workloads))]
            ax.bar(xs, [value[(w, p)][key] for w in workloads], width, label=p)
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Global scheduler policies: {CONFIG}, two instances on one core each")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def parse_args() -> argparse.Namespace:
    """Command-line options, with workloads and policies split and the policies checked."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS))
    p.add_argument("--policies", default=",".join(ROUTING_POLICIES))
    p.add_argument("--sessions", type=int, default=12, help="sessions per workload")
    p.add_argument("--rate", type=float, default=1.0, help="session arrivals per second")
    p.add_argument("--max-output-tokens", type=int, default=32, help="cap per turn")
    p.add_argument("--cost-model", type=Path, default=None, help="fitted cost model JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args()
    a.workloads = [w for w in a.workloads.split(",") if w]
    a.policies = [x for x in a.policies.split(",") if x]
    bad = [x for x in a.policies if x not in ROUTING_POLICIES]
    if bad or not a.policies:
        p.error(f"unknown policies {bad}; choose from {ROUTING_POLICIES}")
    return a


def main() -> None:
    """Run every workload under every policy, print the table, write JSON and a plot."""
    args = parse_args()
    cost_model = None if args.cost_model is None else CostModel.load(args.cost_model)
    start = time.perf_counter()
    rows = []
    for workload in args.workloads:
        for policy in args.policies:
            print(f"{workload} / {policy}", flush=True)
            rows.append(run_policy(args, workload, policy, cost_model))
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "cost_model": "fitted" if cost_model is not None else "new tokens",
        "rows": rows,
        "wall_s": time.perf_counter() - start,
    }
    args.out.write_text(json.dumps(result, indent=1))
    png = plot(rows, args.out.with_suffix(".png"))
    print(f"\nwrote {args.out}, {png} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
