"""Two instances on one GPU, simulated and measured: the setup of ``scripts/gpu-check-7b.sh``.

    python bench/shared_gpu.py pick-rate --workload loogle           # the load, from the simulator
    python bench/shared_gpu.py compare --bench DIR/e2e_loogle.json --hardware PROFILE.json
    python bench/shared_gpu.py handoffs DIR/e2e_loogle.json

The simulated setup is the measured one: Llama-2-7B in bf16, every configuration on two
instances that share one GPU (each holds DEFAULT_GPU_MEMORY_UTILIZATION / 2 of its memory,
as the engine sizes it), the bench's engine settings, the workload built with the
``llama-2-7b-dummy`` preset's tokenizer. Two instances that step at once share the GPU's
compute and bandwidth: a step beside another takes CONTENTION times as long (an assumption,
stated beside every table; the measured run is what checks it).

``pick-rate`` simulates PD over a rate sweep (WINDOW_S seconds of arrivals at each rate) and
prints the knee: the highest rate whose mean TTFT stays within KNEE_TTFT_GROWTH of the
lightest load's, and LOAD_OF_KNEE of it, the rate the GPU stage runs at.
``compare`` simulates a measured run's workload (same sessions, rate
and seed) and prints simulated against measured TTFT, JCT and TPOT (mean, P99) and the
rankings. ``handoffs`` prints the KV hand-offs of the disaggregated runs: bytes, seconds and
GB/s each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minimemserve.memory import CUDA_CONTEXT_BYTES, DEFAULT_GPU_MEMORY_UTILIZATION
from minimemserve.presets import preset_dir
from minimemserve.sim.cluster import Contention
from minimemserve.sim.profiles import GB
from minimemserve.sim.runner import SimSetup, gpu_setup
from minimemserve_lab.compare import run_sim

MODEL = "llama2-7b"
PRESET = "llama-2-7b-dummy"
INSTANCES = 2  # on the one GPU
CONTENTION = 1.7  # a step beside the other instance's step: both want the whole GPU
KNEE_TTFT_GROWTH = 3.0
LOAD_OF_KNEE = 0.8
SWEEP = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)
WINDOW_S = 15.0  # seconds of arrivals in each run: long enough to settle, short on the GPU
MIN_SESSIONS = 8
CONFIGS = ("PD", "PD-CC", "1P1D", "1P1D-CC")
METRICS = ("ttft", "jct", "tpot")


def shared_setup(hardware: str, contention: float = CONTENTION) -> SimSetup:
    """Two instances of Llama-2-7B on one GPU of ``hardware``, as the engine sizes them."""
    setup = gpu_setup(MODEL, hardware, INSTANCES, 1, max_num_seqs=64, max_batched_tokens=512)
    roof = setup.step_model
    share = DEFAULT_GPU_MEMORY_UTILIZATION / INSTANCES
    kv = share * roof.hw.hbm_gb * GB - roof.weight_bytes - CUDA_CONTEXT_BYTES
    blocks = int(kv // (roof.kv_bytes_per_token * setup.engine_config.block_size))
    topology = dataclasses.replace(setup.topology, contention=Contention.uniform(contention))
    describe = setup.describe | {"instances_per_gpu": INSTANCES, "contention": contention}
    return dataclasses.replace(
        setup,
        topology=topology,
        num_blocks=blocks,
        tokenizer_dir=Path(preset_dir(PRESET)),
        describe=describe | {"kv_blocks_per_instance": blocks, "gpus": 1},
    )


def _simulate(setup, configs, workload, sessions, rate, turns, out_tokens, seed=0) -> dict:
    return run_sim(
        setup,
        list(configs),
        workload=workload,
        num_sessions=sessions,
        rate=rate,
        seed=seed,
        max_turns=turns,
        max_output_tokens=out_tokens,
        progress=False,
        verbose=False,
    )


def sessions_at(rate: float) -> int:
    """Sessions whose arrivals span :data:`WINDOW_S` at ``rate``: a run that can settle."""
    return max(MIN_SESSIONS, math.ceil(WINDOW_S * rate))


def pick_rate(args) -> float:
    """The knee of PD's mean TTFT over :data:`SWEEP` (sessions over :data:`WINDOW_S` at each
    rate); prints the sweep, each run's simulated length, and the rate the stage runs at."""
    setup = shared_setup(args.hardware)
    base = None
    knee = SWEEP[0]
    print(f"PD, {args.workload}, {WINDOW_S} s of arrivals on {setup.describe['hardware']}:")
    for rate in [r for r in SWEEP if LOAD_OF_KNEE * r <= args.max_rate] or SWEEP[:1]:
        n = sessions_at(rate)
        s = _simulate(setup, ["PD"], args.workload, n, rate, args.max_turns, args.max_output)
        ttft = s["summaries"]["PD"]["ttft_mean"]
        span = max(r["arrival"] + (r["jct"] or 0) for r in s["records"]["PD"])
        base = base or ttft
        print(
            f"  rate {rate:>5}/s, {n:>3} sessions: TTFT mean {ttft * 1e3:8.1f} ms "
            f"({ttft / base:.1f}x), run {span:5.1f} s"
        )
        if ttft > KNEE_TTFT_GROWTH * base:
            break
        knee = rate
    rate = min(round(LOAD_OF_KNEE * knee, 2), args.max_rate)
    print(
        f"knee {knee}/s (TTFT within {KNEE_TTFT_GROWTH:g}x); the stage runs at {rate}/s "
        f"({LOAD_OF_KNEE:g} of the knee, at most {args.max_rate:g}/s), {sessions_at(rate)} sessions"
    )
    if args.out:
        Path(args.out).write_text(f"{rate} {sessions_at(rate)}\n")
    return rate


def _row(summary: dict) -> list[float | None]:
    return [summary.get(f"{m}_{k}") for m in METRICS for k in ("mean", "p99")]


def _rank(summaries: dict, key: str) -> list[str]:
    return sorted(summaries, key=lambda c: summaries[c].get(key) or float("inf"))


def compare(args) -> dict:
    """Simulate the measured run's workload and print simulated against measured."""
    bench = json.loads(Path(args.bench).read_text())
    s = bench["setup"]
    configs = [c for c in bench["summaries"] if c in CONFIGS]
    sim = _simulate(
        shared_setup(args.hardware, args.contention),
        configs,
        s["workload"],
        s["sessions"],
        s["rate"],
        s.get("max_turns"),
        s.get("max_output_tokens"),
        s.get("seed", 0),
    )
    measured, simulated = bench["summaries"], sim["summaries"]
    names = [f"{m} {k}" for m in METRICS for k in ("mean", "P99")]
    print(
        f"{s['workload']}, {s['sessions']} sessions at {s['rate']}/s, contention {args.contention}"
    )
    print(f"{'config':9}" + "".join(f"{n:>20}" for n in names) + "   (ms, simulated / measured)")
    errors = []
    for c in configs:
        cells = []
        for m, x in zip(_row(measured[c]), _row(simulated[c])):
            ok = m is not None and x is not None and m > 0
            cells.append(f"{x * 1e3:.0f}/{m * 1e3:.0f} ({x / m - 1:+.0%})" if ok else "-")
            errors += [x / m - 1] if ok else []
        print(f"{c:9}" + "".join(f"{cell:>20}" for cell in cells))
    means = [e for i, e in enumerate(errors) if i % 2 == 0]
    print(f"means within 15 %: {sum(abs(e) <= 0.15 for e in means)} of {len(means)}")
    for key in ("ttft_mean", "jct_mean", "tpot_mean"):
        same = _rank(measured, key) == _rank(simulated, key)
        print(
            f"ranking by {key}: measured {_rank(measured, key)}, simulated "
            f"{_rank(simulated, key)} ({'same' if same else 'DIFFERENT'})"
        )
    return {"measured": measured, "simulated": simulated}


def handoffs(args) -> list[dict]:
    """Per configuration: the hand-offs' count, bytes, seconds and GB/s (median and P99)."""
    bench = json.loads(Path(args.bench).read_text())
    rows = []
    for config, records in bench["records"].items():
        moved = [r for r in records if r.get("handoff_bytes")]
        if not moved:
            continue
        gbps = sorted(r["handoff_bytes"] / r["handoff_seconds"] / 1e9 for r in moved)
        row = {
            "config": config,
            "handoffs": len(moved),
            "mb_median": statistics.median(r["handoff_bytes"] for r in moved) / 1e6,
            "ms_median": statistics.median(r["handoff_seconds"] for r in moved) * 1e3,
            "gb_per_s_median": statistics.median(gbps),
            "gb_per_s_p99_low": gbps[int(0.01 * (len(gbps) - 1))],
            "gb_total": sum(r["handoff_bytes"] for r in moved) / 1e9,
        }
        rows.append(row)
        print(
            f"{config}: {row['handoffs']} hand-offs, median {row['mb_median']:.1f} MB in "
            f"{row['ms_median']:.2f} ms = {row['gb_per_s_median']:.3g} GB/s (slowest 1 %: "
            f"{row['gb_per_s_p99_low']:.3g} GB/s), {row['gb_total']:.3g} GB in all"
        )
    if not rows:
        print("no hand-offs recorded")
    return rows


def main(argv: list[str] | None = None) -> None:
    """Parse the subcommand and run it."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pick-rate", help="PD's knee over a simulated rate sweep")
    p.add_argument("--workload", default="loogle")
    p.add_argument("--max-turns", type=int, default=None)
    p.add_argument("--max-output-tokens", dest="max_output", type=int, default=None)
    p.add_argument("--hardware", default="h200")
    p.add_argument("--max-rate", type=float, default=math.inf, help="cap on the rate picked")
    p.add_argument("--out", default=None, help="write 'RATE SESSIONS' here")
    p.set_defaults(fn=pick_rate)
    c = sub.add_parser("compare", help="simulated against measured, per configuration")
    c.add_argument("--bench", required=True, help="e2e_<workload>.json of minimemserve bench")
    c.add_argument("--hardware", default="h200", help="a profile (sim --calibrate --write)")
    c.add_argument("--contention", type=float, default=CONTENTION)
    c.set_defaults(fn=compare)
    h = sub.add_parser("handoffs", help="bytes, time and GB/s of every KV hand-off")
    h.add_argument("bench", help="e2e_<workload>.json of minimemserve bench")
    h.set_defaults(fn=handoffs)
    args = ap.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
