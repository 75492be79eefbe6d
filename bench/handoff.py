"""A prefill instance's hand-offs inside its steps (``--handoff inline``) against beside the next
step (``overlap``), measured and simulated side by side in one run.

Real: 1P1D under the process runtime (each instance a process on one core, KV over shared
memory), a burst of ``--prompts`` prompts of ``--prompt-len`` tokens that all arrive at once,
``--max-tokens`` output tokens each. The prefill instance's capacity is the prompts it clears
per second: the burst's size over the time from its arrival to the last prompt's first
token. Both modes alternate for ``--rounds`` rounds; medians.

Simulated: the same burst on the simulator's model of this machine (steps fitted here, or
``--cpu-model``), and 1P1D of the paper's model on its GPU (one each) on LooGLE at
``--sim-rates``: mean TTFT per mode where both are stable, "overloaded" where not.

    python bench/handoff.py [--quick]

Writes ``bench/results/handoff.json`` and ``handoff.png``."""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import time
from pathlib import Path

from plotting import grouped_bars

from minimemserve import LLM, SamplingParams
from minimemserve.config import EngineConfig
from minimemserve.deployment import DeploymentSpec
from minimemserve.presets import preset_dir
from minimemserve.sim.profiles import FittedStepModel, fit_cpu_steps
from minimemserve.sim.runner import (
    CPU_INSTANCES,
    DEFAULT_HARDWARE,
    DEFAULT_MODEL,
    cpu_setup,
    gpu_setup,
    simulate,
)
from minimemserve.workloads.sessions import Session, Turn
from minimemserve_lab.compare import run_sim
from minimemserve_lab.report import is_stable

OUT = Path("bench/results")
MODES = ("inline", "overlap")  # the baseline first in every round
BURST_RATE = 1e4  # sessions/s: the simulated burst arrives within milliseconds


def burst(mode: str, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """One burst through a fresh 1P1D process deployment with hand-offs in ``mode``."""
    spec = DeploymentSpec("1P1D", runtime="process", engine=EngineConfig(handoff=mode))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM.from_spec(spec) as llm:
        llm.generate(prompts[:2], params)  # warm-up, not measured
        began = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - began
        llm.engine.check_pools()
    records = [
        {
            "arrival": o.metrics.arrival_time,
            "ttft": o.metrics.first_token_time - o.metrics.arrival_time,
        }
        for o in outs
    ]
    digest = hashlib.sha1(repr([o.token_ids for o in outs]).encode()).hexdigest()[:12]
    handoff = statistics.mean(o.metrics.handoff_seconds for o in outs)
    return {**_burst_stats(records), "handoff_mean_s": handoff, "wall_s": wall, "tokens": digest}


def sim_burst(mode: str, fitted, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """The same burst on the simulator's model of this machine's 1P1D (``fitted`` steps)."""
    setup = cpu_setup(fitted, handoff=mode)
    sessions = [
        Session(f"s{i}", (Turn(f"s{i}", 0, tuple(p), max_tokens),), chain_outputs=False)
        for i, p in enumerate(prompts)
    ]
    records, _ = simulate(setup, ["1P1D"], sessions, BURST_RATE, 0, progress=False)
    return _burst_stats(records["1P1D"])


def sim_rates(mode: str, rates: list[float], sessions: int) -> list[dict]:
    """TTFT and stability of simulated 1P1D (the paper's model and GPU, one per instance) on
    LooGLE at each rate, hand-offs in ``mode``."""
    setup = gpu_setup(DEFAULT_MODEL, DEFAULT_HARDWARE, 2, 1, handoff=mode)
    rows = []
    for rate in rates:
        res = run_sim(
            setup,
            ["1P1D"],
            workload="loogle",
            num_sessions=sessions,
            rate=rate,
            progress=False,
            verbose=False,
        )
        s = res["summaries"]["1P1D"]
        rows.append({"rate": rate, "stable": is_stable(s), "ttft_mean": s["ttft_mean"]})
    return rows


def _burst_stats(records: list[dict]) -> dict[str, float]:
    start = min(r["arrival"] for r in records)
    ttft = sorted(r["ttft"] for r in records)
    last = max(r["arrival"] + r["ttft"] for r in records) - start
    return {
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "prefill_capacity_per_s": len(records) / last,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--prompt-len", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cpu-model", default=None, help="fitted CPU step model JSON (else fit now)")
    p.add_argument("--sim-rates", default="0.25,0.5,1,1.5,2,2.5")
    p.add_argument("--sim-sessions", type=int, default=60)
    p.add_argument("--quick", action="store_true", help="8 prompts, one round, two rates")
    a = p.parse_args()
    if a.quick:
        a.prompts, a.rounds, a.sim_rates, a.sim_sessions = 8, 1, "0.5,1", 20
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 8000) for _ in range(a.prompt_len)] for _ in range(a.prompts)]
    real: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(a.rounds):
        for mode in MODES:
            real[mode].append(burst(mode, prompts, a.max_tokens))
            print(f"round {r + 1}/{a.rounds} {mode}: {real[mode][-1]}", flush=True)
    med = {m: {k: _median(x[k] for x in runs) for k in runs[0]} for m, runs in real.items()}
    fitted = (
        FittedStepModel.load(a.cpu_model)
        if a.cpu_model
        else fit_cpu_steps(preset_dir("tiny"), progress=True, concurrent=CPU_INSTANCES)
    )
    sim = {m: sim_burst(m, fitted, prompts, a.max_tokens) for m in MODES}
    rates = [float(x) for x in a.sim_rates.split(",")]
    gpu = {m: sim_rates(m, rates, a.sim_sessions) for m in MODES}
    _report(med, sim, gpu, a)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "handoff.json"
    result = {"args": vars(a), "real": real, "median": med, "sim_burst": sim, "sim_gpu": gpu}
    path.write_text(json.dumps(result, indent=1))
    keys = ("ttft_mean_s", "ttft_p99_s")
    png = grouped_bars(
        OUT / "handoff.png",
        f"1P1D, a burst of {a.prompts} prompts of {a.prompt_len} tokens: TTFT",
        [f"{k} {src}" for src in ("real", "sim") for k in keys],
        {m: [d[m][k] for d in (med, sim) for k in keys] for m in MODES},
        "seconds",
    )
    print(f"wrote {path}, {png}")


def _median(values) -> float | str:
    values = list(values)
    return values[0] if isinstance(values[0], str) else statistics.median(values)


def _report(med: dict, sim: dict, gpu: dict, a: argparse.Namespace) -> None:
    print(
        f"\n1P1D, a burst of {a.prompts} prompts of {a.prompt_len} tokens (real: medians of "
        f"{a.rounds}; sim: this machine's fitted steps)"
    )
    print(f"{'':28}{'inline':>10}{'overlap':>10}{'overlap/inline':>16}")
    rows = [(f"real {k}", med, k) for k in ("prefill_capacity_per_s", "ttft_mean_s", "ttft_p99_s")]
    rows += [("real handoff_mean_s", med, "handoff_mean_s"), ("real wall_s", med, "wall_s")]
    rows += [(f"sim {k}", sim, k) for k in ("prefill_capacity_per_s", "ttft_mean_s", "ttft_p99_s")]
    for name, d, k in rows:
        i, o = d["inline"][k], d["overlap"][k]
        print(f"{name:28}{i:10.3f}{o:10.3f}{o / i:16.2f}")
    same = len({x["tokens"] for runs in [med] for x in runs.values()}) == 1
    print(f"same output tokens in both modes: {same}")
    print(
        f"\nsimulated 1P1D, {DEFAULT_MODEL} on {DEFAULT_HARDWARE} (a GPU each), LooGLE, "
        f"{a.sim_sessions} sessions: mean TTFT"
    )
    print(f"{'rate':>6}{'inline':>12}{'overlap':>12}{'overlap/inline':>16}")
    for i, o in zip(gpu["inline"], gpu["overlap"]):
        both = i["stable"] and o["stable"]
        ratio = f"{o['ttft_mean'] / i['ttft_mean']:16.3f}" if both else f"{'overloaded':>16}"
        print(f"{i['rate']:6g}{i['ttft_mean'] * 1e3:10.1f}ms{o['ttft_mean'] * 1e3:10.1f}ms{ratio}")


if __name__ == "__main__":
    main()
