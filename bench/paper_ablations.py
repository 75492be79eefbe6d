"""What moves each of the paper's gains in the simulator: one factor at a time from the
``sim --paper`` setup (local policy, disaggregated ratio, load, answer length, routing).

    python bench/paper_ablations.py --paper bench/results/sim_paper.json [--out bench/results]

For each workload at the load ``sim --paper`` chose (read from its JSON), each variant prints
disaggregation against colocated PD (JCT mean and P99), caching on top (JCT and TTFT mean),
and colocated PD's prefill share of busy time and the time its decodes were held up by
prefills per request: what disaggregation can remove at most, and caching's change to P99
TTFT. Then PD-CC's P99 TTFT under each routing policy. Writes ``paper_ablations.json``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from minimemserve.sim.paper import MAX_OUTPUT_TOKENS, RATIOS, WORKLOADS, simulate_one
from minimemserve.sim.runner import gpu_setup, workload_sessions


@dataclasses.dataclass(frozen=True)
class Variant:
    """One factor changed from the base setup."""

    name: str
    scheduler: str = "prefill_first"
    ratio: str = ""  # "": the base ratio
    rate_factor: float = 1.0
    cap: int | None = -1  # -1: the workload's own answer lengths
    policy: str = "prompt_tree"


def variants(workload: str, base_ratio: str) -> list[Variant]:
    """The base and one variant per factor."""
    out = [Variant("base"), Variant("chunked", scheduler="chunked")]
    out += [Variant(f"ratio {r}", ratio=r) for r in RATIOS if r != base_ratio]
    out += [Variant("load x0.5", rate_factor=0.5), Variant("load x2", rate_factor=2.0)]
    out += [Variant("no prefix moves", policy="prompt_tree_local")]
    if workload == "sharegpt":
        out += [Variant("answers <= 48", cap=48), Variant("answers <= 256", cap=256)]
    return out


def submit_variant(pool, workload: str, rate: float, v: Variant, base_ratio: str, n, seed):
    """Start one variant's three runs (PD, disaggregated, with caching) on ``pool``."""
    ratio = v.ratio or base_ratio
    setup = gpu_setup(
        "llama2-13b", "h800", RATIOS[ratio], 2, policy=v.policy, scheduler=v.scheduler
    )
    cap = MAX_OUTPUT_TOKENS.get(workload) if v.cap == -1 else v.cap
    sessions = workload_sessions(setup, workload, n, seed, None, cap, None)
    configs = ["PD", ratio, f"{ratio}-CC"]
    runs = {
        c: pool.submit(simulate_one, setup, c, sessions, rate * v.rate_factor, seed)
        for c in configs
    }
    return v, ratio, rate * v.rate_factor, runs


def variant_row(workload: str, v: Variant, ratio: str, rate: float, runs: dict) -> dict:
    """The gains of one variant, with PD's prefill share and decode hold-up."""
    done = {c: f.result() for c, f in runs.items()}
    s = {c: d[0] for c, d in done.items()}
    stats = {c: d[1] for c, d in done.items()}
    gain = lambda new, base, m: s[new][m] / s[base][m] - 1
    return {
        "workload": workload,
        "variant": v.name,
        "rate": rate,
        "ratio": ratio,
        "disagg_jct_mean": gain(ratio, "PD", "jct_mean"),
        "disagg_jct_p99": gain(ratio, "PD", "jct_p99"),
        "cc_jct_mean": gain(f"{ratio}-CC", ratio, "jct_mean"),
        "cc_ttft_mean": gain(f"{ratio}-CC", ratio, "ttft_mean"),
        "cc_ttft_p99": gain(f"{ratio}-CC", ratio, "ttft_p99"),
        "pd_jct_mean": s["PD"]["jct_mean"],
        "pd_tpot_mean": s["PD"]["tpot_mean"],
        "disagg_tpot_mean": s[ratio]["tpot_mean"],
        "pd_prefill_share": stats["PD"]["prefill_share"],
        "pd_decode_stall_s": stats["PD"]["decode_stall_s"],
    }


def submit_routing(pool, workload: str, rate: float, n: int, seed: int) -> dict:
    """Start PD-CC under each routing policy on ``pool``."""
    base = gpu_setup("llama2-13b", "h800", 8, 2, scheduler="prefill_first")
    sessions = workload_sessions(
        base, workload, n, seed, None, MAX_OUTPUT_TOKENS.get(workload), None
    )
    return {
        policy: pool.submit(
            simulate_one, base.with_deployment(policy=policy), "PD-CC", sessions, rate, seed
        )
        for policy in ("prompt_tree", "prompt_tree_local", "session", "least_load", "round_robin")
    }


def main() -> None:
    """Parse the options, run every variant and the routing comparison, print and write."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--paper", required=True, help="sim_paper.json of `minimemserve sim --paper`")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at once")
    args = p.parse_args()
    paper = json.loads(Path(args.paper).read_text())
    n, seed = paper["setup"]["sessions"], 0
    base_ratio = paper["best_ratio"]
    rows, routes = [], {}
    t0 = time.perf_counter()
    print(
        f"{'workload':9}{'variant':16}{'rate':>6}{'ratio':>6}{'D/PD JCT':>10}{'P99':>8}"
        f"{'CC JCT':>8}{'CC TTFT':>9}{'P99':>8}{'PD TPOT':>9}{'D TPOT':>8}{'PD prefill':>11}"
        f"{'held up':>9}"
    )
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        pending = []
        for workload in WORKLOADS:
            rate = paper["workloads"][workload]["rate"]
            for v in variants(workload, base_ratio):
                pending.append(
                    (workload, submit_variant(pool, workload, rate, v, base_ratio, n, seed))
                )
            routes[workload] = submit_routing(pool, workload, rate, n, seed)
        for workload, (v, ratio, rate, runs) in pending:
            r = variant_row(workload, v, ratio, rate, runs)
            rows.append(r)
            print(
                f"{workload:9}{v.name:16}{r['rate']:>6g}{r['ratio']:>6}"
                f"{r['disagg_jct_mean']:>+10.1%}{r['disagg_jct_p99']:>+8.1%}"
                f"{r['cc_jct_mean']:>+8.1%}{r['cc_ttft_mean']:>+9.1%}{r['cc_ttft_p99']:>+8.1%}"
                f"{1e3 * r['pd_tpot_mean']:>7.1f}ms{1e3 * r['disagg_tpot_mean']:>6.1f}ms"
                f"{r['pd_prefill_share']:>11.1%}{r['pd_decode_stall_s']:>8.2f}s",
                flush=True,
            )
        for workload, futures in routes.items():
            routes[workload] = {}
            for policy, f in futures.items():
                s = f.result()[0]
                routes[workload][policy] = {
                    k: s[k] for k in ("ttft_p99", "ttft_mean", "jct_mean", "cached_ratio")
                }
                print(
                    f"  {workload} PD-CC {policy:17} TTFT P99 {1e3 * s['ttft_p99']:7.1f} ms, "
                    f"mean {1e3 * s['ttft_mean']:6.1f} ms, JCT {s['jct_mean']:.2f} s, cached "
                    f"{s['cached_ratio']:.1%}",
                    flush=True,
                )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "paper_ablations.json"
    path.write_text(json.dumps({"paper": args.paper, "rows": rows, "routing": routes}, indent=1))
    print(f"wrote {path} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
