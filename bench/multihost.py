"""The four configurations on the multi-host runtime with KV over gloo and over NIXL, beside
the process runtime with shared memory, in one run on the same sessions.

Each configuration runs back to back: spawned instances writing KV into each other's shared
memory (the default runtime), then ``minimemserve instance`` processes joined by a frontend
and moving KV over torch.distributed (gloo on loopback: what two hosts would do, minus the
network), then the same over NIXL (where the nixl extra loads; UCX picks cross-memory attach
on one host). Prints the bench table, then per configuration each transport's ratios of mean
TTFT and JCT to shared memory and the KV bytes each moved; writes bench/results/multihost/.

    python bench/multihost.py [--sessions 16] [--rate 1.0] [--configs 1P1D,1P1D-CC]
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import replace
from pathlib import Path

from minimemserve.deployment import DeploymentSpec
from minimemserve.disagg.nixl import nixl_missing
from minimemserve.disagg.runtime import ProcessCluster
from minimemserve.workloads.results import DEFAULT_CONFIGS, DEFAULT_RATE, DEFAULT_SESSIONS
from minimemserve_lab.harness.driver import COLOCATED_INSTANCES, CORES_PER_INSTANCE, run_bench
from minimemserve_lab.harness.hosts import HostsCluster

RUNTIMES = {"shm": (ProcessCluster, "shm"), "gloo": (HostsCluster, "gloo")}
if nixl_missing() is None:
    RUNTIMES["nixl"] = (HostsCluster, "nixl")
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
    print("\nconfig    transport  TTFT / shm   JCT / shm   KV bytes (shm: the same)")
    for c in args.configs.split(","):
        shm = s[f"{c} shm"]
        for r in [r for r in RUNTIMES if r != "shm"]:
            other = s[f"{c} {r}"]
            row = {
                "config": c,
                "transport": r,
                "ttft_ratio": other["ttft_mean"] / shm["ttft_mean"],
                "jct_ratio": other["jct_mean"] / shm["jct_mean"],
                "bytes_shm": sent_bytes(res["pool_stats"][f"{c} shm"]),
                "bytes": sent_bytes(res["pool_stats"][f"{c} {r}"]),
            }
            rows.append(row)
            same = "yes" if row["bytes"] == row["bytes_shm"] else f"no: {row['bytes_shm']:,}"
            print(
                f"{c:9s} {r:9s} {row['ttft_ratio']:10.2f}x {row['jct_ratio']:10.2f}x   "
                f"{row['bytes']:,} ({same})"
            )
    (OUT / "ratios.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
