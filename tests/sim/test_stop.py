"""Stopping a replay at its arrival window's end once it is certainly unstable: a stable run
is left as it was, an unstable one ends early with the stability record the whole run gets."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from minimemserve.model.tokenizer import Tokenizer
from minimemserve.presets import preset_dir
from minimemserve.sim import FittedStepModel, cpu_setup, gpu_setup, simulate
from minimemserve.sim.runner import workload_sessions
from minimemserve.workloads.results import stability, summarize
from minimemserve.workloads.sessions import make_workload

# A step model in the range the tiny preset measures on this CPU (seconds per feature).
CPU_COEFS = (8e-3, 5e-4, 2e-7, 2e-6, 3e-4, 2.5e-4)
# What the window's end decides; the whole run's makespan and late first tokens it cannot know.
VERDICT = ("window_s", "in_system", "mean_in_system", "arrivals", "stable")
# Run statistics that measure the machine running the simulation, not the simulation.
WALL_STATS = ("wall_s", "steps_per_s", "route_us_mean")


@functools.cache
def _setup(kind: str):
    """The paper's cluster, one with 400 KV blocks per instance (it runs full), or this CPU's
    two instances (their transfers' control calls wait for steps: a finished request's report
    waits for its send-back to land)."""
    if kind == "cpu":
        return cpu_setup(FittedStepModel(CPU_COEFS))
    base = gpu_setup("llama2-13b", "h800", 8, 2)
    engine = dataclasses.replace(base.engine_config, scheduler="prefill_first")
    setup = base.with_deployment(engine=engine)
    return setup if kind == "gpu" else dataclasses.replace(setup, num_blocks=400)


@functools.cache
def _sessions(kind: str, workload: str, n: int) -> list:
    if kind == "cpu":
        tok = Tokenizer.from_dir(preset_dir("tiny"))
        return make_workload(workload, tok, n, 384, seed=1, max_turns=3, max_output_tokens=8)
    return workload_sessions(_setup(kind), workload, n, 0, None, 256, None)


def _both(kind, workload, config, n, rate, seed=0, arrivals="closed"):
    """The runs with ``stop_unstable`` off and on."""
    sessions, setup = _sessions(kind, workload, n), _setup(kind)
    return [
        simulate(setup, [config], sessions, rate, seed, False, arrivals, stop_unstable=stop)
        for stop in (False, True)
    ]


def _without_wall(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k not in WALL_STATS}


# (setup, workload, config, sessions, rate, seed): stable points, colocated, disaggregated,
# with caching
STABLE = [
    ("gpu", "sharegpt", "PD", 20, 2.0, 0),
    ("gpu", "sharegpt", "2P2D", 16, 2.0, 0),
    ("gpu", "loogle", "1P1D-CC", 8, 0.5, 0),
    ("gpu", "react", "PD-CC", 12, 2.0, 0),
    ("gpu", "react", "1P1D-CC", 12, 1.0, 0),
    ("cpu", "sharegpt", "1P1D-CC", 48, 16.0, 3),
]


@pytest.mark.parametrize("case", STABLE, ids=lambda c: "-".join(map(str, c)))
def test_a_stable_run_is_the_same_with_stopping_on(case):
    config = case[2]
    (full, full_stats), (run, stats) = _both(*case)
    assert run[config] == full[config]
    assert stability(full[config])["stable"] and not stats[config]["stopped"]
    assert _without_wall(stats[config]) == _without_wall(full_stats[config])
    assert summarize(run[config]) == summarize(full[config])


# overloaded points, colocated and disaggregated (hand-offs in flight at the stop; on the CPU
# finished requests whose send-back has not landed), closed and finite
UNSTABLE = [
    ("gpu", "sharegpt", "PD", 20, 40.0, 0, "closed"),
    ("gpu", "sharegpt", "2P2D", 16, 40.0, 0, "closed"),
    ("gpu", "react", "PD-CC", 12, 40.0, 0, "closed"),
    ("gpu", "react", "1P1D-CC", 12, 40.0, 0, "closed"),
    ("gpu", "sharegpt", "1P1D", 20, 40.0, 0, "open"),
    ("full", "sharegpt", "1P1D", 60, 6.0, 0, "closed"),
    ("cpu", "sharegpt", "1P1D-CC", 48, 16.0, 2, "closed"),
]


@pytest.mark.parametrize("case", UNSTABLE, ids=lambda c: "-".join(map(str, c)))
def test_an_unstable_run_stops_at_its_window_end_with_the_same_verdict(case):
    config = case[2]
    (full, full_stats), (run, stats) = _both(*case)
    whole, stopped = stability(full[config]), stability(run[config])
    assert not whole["stable"] and stats[config]["stopped"]
    assert {k: stopped[k] for k in VERDICT} == {k: whole[k] for k in VERDICT}
    assert stopped["makespan_ratio"] is None
    assert stats[config]["steps"] < full_stats[config]["steps"]
    # every request sent by the window's end has a record: as the whole run has it if it had
    # finished by then, else marked stopped, with no end
    end = min(r["arrival"] for r in run[config] if r["turn"] == 0) + whole["window_s"]
    by_key = {(r["session"], r["turn"]): r for r in full[config]}
    sent = {key for key, r in by_key.items() if r["arrival"] <= end}
    assert {(r["session"], r["turn"]) for r in run[config]} == sent
    cut = [r for r in run[config] if r.get("stopped")]
    assert cut and len(cut) == summarize(run[config])["stopped"]
    for r in run[config]:
        whole_r = by_key[r["session"], r["turn"]]
        if r.get("stopped"):
            assert r["jct"] is None and r["tpot"] is None and r["finish_reason"] is None
            assert whole_r["arrival"] + whole_r["jct"] > end
            assert r["ttft"] in (None, whole_r["ttft"])
        else:
            assert r == whole_r
