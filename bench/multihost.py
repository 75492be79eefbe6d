"""The four configurations on the multi-host runtime with KV over gloo, beside the process
runtime with shared memory, in one run on the same sessions.

Each configuration runs twice, back to back: spawned instances writing KV into each other's
shared memory (the default runtime), then ``minimemserve instance`` processes joined by a
frontend and moving KV over torch.distributed (gloo on loopback: what two hosts would do,
minus the network). Prints the bench table, then per configuration the gloo/shm ratios of
mean TTFT and JCT and the KV bytes each moved; writes bench/results/multihost/.

    python bench/multihost.py [--sessions 16] [--rate 1.0]
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import replace
from pathlib import Path

from minimemserve.bench.driver import COLOCATED_INSTANCES, CORES_PER_INSTANCE, run_bench
from minimemserve.bench.hosts import HostsCluster
from minimemserve.deployment import DeploymentSpec
from minimemserve.disagg.runtime import ProcessCluster
from minimemserve.workloads.results import DEFAULT_CONFIGS, DEFAULT_RATE, DEFAULT_SESSIONS

RUNTIMES = {"shm": (ProcessCluster, "shm"), "gloo": (HostsCluster, "gloo")}
OUT = Path("bench/results/multihost")


def target(config: str, runtime: str, spec: DeploymentSpec):
    """``config`` on ``runtime`` (a key of RUNTIMES), whatever name the bench gives it."""
    cluster, transport = RUNTIMES[runtime]
    spec = replace(
        spec,
        config=config,
        runtime="process",
        cores_per_instance=CORES_PER_INSTANCE,
        num_colocated=COLOCATED_INSTANCES,
        transport=transport,
    )
    return spec.build(cluster)


def sent_bytes(pool_stats: dict) -> int:
    """KV bytes the instances' pools sent to peers during the run."""
    return sum(p["counters"]["sent_bytes"] for p in pool_stats["pool"].values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=DEFAULT_SESSIONS)
    ap.add_argument("--rate", type=float, default=DEFAULT_RATE)
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    args = ap.parse_args()
    factories = {
        f"{c} {r}": functools.partial(target, c, r)
        for c in args.configs.split(",")
        for r in RUNTIMES
    }
    res = run_bench(
        configs=list(factories),
        factories=factories,
        num_sessions=args.sessions,
        rate=args.rate,
        out_dir=OUT,
        runtime={"kind": "process vs hosts", "runtimes": list(RUNTIMES)},
    )
    s, rows = res["summaries"], []
    print("\nconfig    TTFT gloo/shm   JCT gloo/shm   KV bytes shm / gloo")
    for c in args.configs.split(","):
        shm, gloo = s[f"{c} shm"], s[f"{c} gloo"]
        row = {
            "config": c,
            "ttft_ratio": gloo["ttft_mean"] / shm["ttft_mean"],
            "jct_ratio": gloo["jct_mean"] / shm["jct_mean"],
            "bytes_shm": sent_bytes(res["pool_stats"][f"{c} shm"]),
            "bytes_gloo": sent_bytes(res["pool_stats"][f"{c} gloo"]),
        }
        rows.append(row)
        print(
            f"{c:9s} {row['ttft_ratio']:13.2f}x {row['jct_ratio']:13.2f}x   "
            f"{row['bytes_shm']:,} / {row['bytes_gloo']:,}"
        )
    (OUT / "ratios.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
