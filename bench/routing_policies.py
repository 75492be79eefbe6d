"""Every routing policy of the global scheduler at the paper's setup, simulated: PD-CC on
Llama-2-13B, 8 x H800, TP 2 (four instances), ShareGPT with answers up to 1,024 tokens.

    python bench/routing_policies.py [--sessions 400] [--rates 2,4,8,16] [--scheduler chunked]

Prints, per rate and policy, the cached fraction of prompt tokens, mean and P99 JCT and mean
TTFT, and whether each prompt-tree policy (``prompt_tree``, the paper's, which may move a cached
prefix to the instance it picks, and ``prompt_tree_local``, which never does) caches at least as
much as ``session`` and how far its mean JCT is from the best simple policy's; writes
``routing_policies.json``."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from minimemserve.sim.paper import simulate_one
from minimemserve.sim.runner import gpu_setup, workload_sessions

TREES = ("prompt_tree", "prompt_tree_local")
SIMPLE = ("session", "least_load", "round_robin")
POLICIES = TREES + SIMPLE


def main() -> None:
    """Parse the options, simulate every (rate, policy), print and write."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=400)
    p.add_argument("--rates", default="2,4,8,16")
    p.add_argument("--scheduler", default="chunked", choices=("chunked", "prefill_first"))
    p.add_argument("--max-output-tokens", type=int, default=1024)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    base = gpu_setup("llama2-13b", "h800", 8, 2, scheduler=args.scheduler)
    sessions = workload_sessions(
        base, "sharegpt", args.sessions, 0, None, args.max_output_tokens, None
    )
    rates = [float(r) for r in args.rates.split(",")]
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.jobs, mp_context=spawn) as pool:
        futures = {
            (rate, policy): pool.submit(
                simulate_one, base.with_deployment(policy=policy), "PD-CC", sessions, rate, 0
            )
            for rate in rates
            for policy in POLICIES
        }
        rows = {}
        for key, f in futures.items():
            summary, stats = f.result()
            rows[key] = {**summary, "prefix_pushes": stats["prefix_pushes"]}
    out = []
    for rate in rates:
        best = min(rows[rate, q]["jct_mean"] for q in SIMPLE)
        for policy in POLICIES:
            s = rows[rate, policy]
            out.append({"rate": rate, "policy": policy, **s})
            print(
                f"{rate:5g}/s {policy:17} cached {s['cached_ratio']:6.1%}  JCT mean "
                f"{1e3 * s['jct_mean']:7.0f} ms (P99 {1e3 * s['jct_p99']:6.0f})  TTFT mean "
                f"{1e3 * s['ttft_mean']:5.1f} ms  TPOT {1e3 * s['tpot_mean']:4.1f} ms  "
                f"prefix pushes {s['prefix_pushes']}"
            )
        session = rows[rate, "session"]
        for name in TREES:
            tree = rows[rate, name]
            cmp = ">=" if tree["cached_ratio"] >= session["cached_ratio"] else "<"
            print(
                f"  {name} caches {cmp} session; its JCT is "
                f"{tree['jct_mean'] / best - 1:+.1%} from the best simple policy's"
            )
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "routing_policies.json").write_text(json.dumps({"args": vars(args), "rows": out}))


if __name__ == "__main__":
    main()
