"""A paced finite run: every turn at its own arrival time, but never before its session's turn
before it ended (a user who waits for the answer)."""

from __future__ import annotations

import pytest

from minimemserve.errors import ConfigError
from minimemserve.model.tokenizer import Tokenizer
from minimemserve.presets import preset_dir
from minimemserve.sim import FittedStepModel, cpu_setup, gpu_setup, simulate
from minimemserve.sim.replay import open_arrivals
from minimemserve.workloads.sessions import make_workload, total_turns

# A step model in the range the tiny preset measures on this CPU (seconds per feature).
CPU_COEFS = (8e-3, 5e-4, 2e-7, 2e-6, 3e-4, 2.5e-4)


@pytest.fixture(scope="module")
def sessions():
    tok = Tokenizer.from_dir(preset_dir("tiny"))
    return make_workload("sharegpt", tok, 8, 384, seed=1, max_turns=3, max_output_tokens=8)


def _by_turn(records: list[dict]) -> dict:
    return {(r["session"], r["turn"]): r for r in records}


@pytest.mark.parametrize("config", ["PD", "1P1D-CC"])
def test_a_paced_turn_waits_for_its_arrival_and_for_the_turn_before_it(sessions, config):
    setup = cpu_setup(FittedStepModel(CPU_COEFS))
    rate = 50.0  # every turn's own arrival comes before the turn before it has ended
    got = {}
    for arrivals in ("open", "paced"):
        records, _ = simulate(setup, [config], sessions, rate, 0, False, arrivals)
        got[arrivals] = _by_turn(records[config])
        assert len(got[arrivals]) == total_turns(sessions)
        assert all(r["error"] is None for r in records[config])
    paced, waited = got["paced"], 0
    for si, k, t in open_arrivals(sessions, rate, 0):
        r = paced[sessions[si].id, k]
        assert r["arrival"] >= t
        if k == 0:
            assert r["arrival"] == pytest.approx(t)
            continue
        before = paced[sessions[si].id, k - 1]
        end = before["arrival"] + before["jct"]
        assert r["arrival"] >= end - 1e-9  # never before the answer it waits for
        if config == "PD":  # nor later than needed (where the answer is out as it ends: with
            # a send-back, once that has landed)
            assert r["arrival"] == pytest.approx(max(t, end), abs=1e-9)
        waited += r["arrival"] > t + 1e-9
    assert waited  # at this rate some turns had to wait
    # open sends them regardless: some turn left before the turn before it had its answer
    early = [
        key
        for key, r in got["open"].items()
        if key[1] > 0
        and r["arrival"]
        < got["open"][key[0], key[1] - 1]["arrival"] + got["open"][key[0], key[1] - 1]["jct"]
    ]
    assert early
    # the prompts are the same either way (built from the engine's own answers)
    assert {k: r["prompt_tokens"] for k, r in paced.items()} == {
        k: r["prompt_tokens"] for k, r in got["open"].items()
    }


@pytest.mark.parametrize("config", ["PD-CC", "1P1D"])
def test_paced_is_open_when_turns_arrive_long_after_the_answers(config):
    setup = gpu_setup("llama2-13b", "h800", 8, 2)
    tok = Tokenizer.from_dir(preset_dir("tiny"))
    sessions = make_workload("react", tok, 6, 1024, seed=3, max_turns=4, max_output_tokens=32)
    runs = {
        arrivals: simulate(setup, [config], sessions, 0.01, 0, False, arrivals)[0][config]
        for arrivals in ("open", "paced")
    }
    assert runs["paced"] == runs["open"]


def test_a_schedule_needs_a_finite_run(sessions):
    setup = cpu_setup(FittedStepModel(CPU_COEFS))
    schedule = open_arrivals(sessions, 1.0, 0)
    with pytest.raises(ConfigError, match="open' or 'paced"):
        setup.cluster("PD").replay(sessions, 1.0, 0, progress=False, schedule=schedule)
    paced = setup.cluster("PD").replay(
        sessions, 1.0, 0, progress=False, arrivals="paced", schedule=schedule
    )
    assert len(paced) == total_turns(sessions)
