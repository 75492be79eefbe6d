"""Faults across processes: a dead decode instance, unanswered calls, calls in both directions."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from minimemserve import LLM, SamplingParams
from minimemserve.config import EngineConfig
from minimemserve.disagg import membership, rpc
from minimemserve.disagg.runtime import ProcessCluster
from minimemserve.errors import InstanceDied

NUM_BLOCKS = 128
TIMEOUT_S = 3.0  # control-request timeout of the clusters under test
WAIT_S = 20.0
ORPHAN_S = 5.0  # how long instances may outlive their frontend


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (20 + 7 * i,), generator=g).tolist() for i in range(n)]


def cluster(model_dir, config: str) -> ProcessCluster:
    return ProcessCluster.of(
        model_dir,
        config,
        engine=EngineConfig(num_blocks=NUM_BLOCKS),
        timeout_s=TIMEOUT_S,
        start_method="forkserver",
    )


def wait_until_on_decode(c: ProcessCluster, rids: list[str], want_rid: bool = False) -> str:
    """Step until a request sits on a decode instance; returns that instance's name (or,
    with ``want_rid``, the request's id)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        assert c.step() == [], "a request finished before the fault was injected"
        for rid in rids:
            where = c.location(rid)
            if where is not None and where.startswith("D"):
                return rid if want_rid else where
    raise AssertionError("no request reached a decode instance")


@pytest.fixture
def no_restarts(monkeypatch):
    """Instances that exit stay dead: the tests of what a death leaves behind."""
    monkeypatch.setattr(membership, "MAX_RESTARTS", 0)


def test_decode_death_ends_requests_with_error_and_frees_prefill_blocks(
    tiny_llama_dir, no_restarts
):
    with cluster(tiny_llama_dir, "1P1D") as c:
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        rids = [c.add_request(p, params) for p in prompts(3)]
        wait_until_on_decode(c, rids)
        rids += [c.add_request(p, params) for p in prompts(2, seed=1)]  # still on P when D dies
        segment = c.instances["D0"].info.handle["name"]
        t0 = time.monotonic()
        os.kill(c.instances["D0"].process.pid, signal.SIGKILL)
        outs = c.run_until_done(timeout_s=WAIT_S)
        elapsed = time.monotonic() - t0

        assert sorted(o.request_id for o in outs) == sorted(rids)
        for o in outs:
            assert o.finish_reason == "error", o
            assert "D0" in o.error and "InstanceDied" in o.error, o.error
        assert elapsed < 2 * TIMEOUT_S
        assert list(c.dead) == ["D0"] and "-9" in c.dead["D0"]
        assert not os.path.exists(f"/dev/shm/{segment}")  # the launcher unlinked it
        reports = c.check_pools(require_idle=True)  # raises if P still holds a block
        assert list(reports) == ["P0"]
        assert reports["P0"]["pool"]["hbm"]["free"] == NUM_BLOCKS  # 1P1D caches nothing
        with pytest.raises(InstanceDied, match="D0"):
            c.add_request(prompts(1)[0], params)


def test_one_decode_dies_and_its_requests_finish_on_the_other(tiny_llama_dir, no_restarts):
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    ps = prompts(6, seed=2)
    ref = LLM(tiny_llama_dir, config="PD", num_blocks=NUM_BLOCKS).generate(ps, params)
    with cluster(tiny_llama_dir, "1P2D") as c:
        rids = [c.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(ps)]
        victim = wait_until_on_decode(c, rids)
        os.kill(c.instances[victim].process.pid, signal.SIGKILL)
        outs = {o.request_id: o for o in c.run_until_done(timeout_s=WAIT_S)}

        assert list(c.dead) == [victim]
        assert c.num_reruns >= 1
        for i, r in enumerate(ref):
            assert outs[f"r{i}"].finish_reason == "length", outs[f"r{i}"].error
            assert outs[f"r{i}"].token_ids == r.token_ids
        reports = c.check_pools(require_idle=True)
        assert victim not in reports and len(reports) == 2


def test_colocated_instance_dies_and_the_scheduler_routes_around_it(tiny_llama_dir, no_restarts):
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    ps = prompts(4, seed=3)
    ref = LLM(tiny_llama_dir, config="PD", num_blocks=NUM_BLOCKS).generate(ps, params)
    with cluster(tiny_llama_dir, "PD-CC") as c:
        rids = [c.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(ps)]
        assert {c.location(r) for r in rids} == {"C0", "C1"}  # the scheduler spread them
        victim = c.location("r0")
        os.kill(c.instances[victim].process.pid, signal.SIGKILL)
        outs = {o.request_id: o for o in c.run_until_done(timeout_s=WAIT_S)}

        assert list(c.dead) == [victim] and victim not in c.scheduler.live
        assert c.num_reruns >= 1
        for i, r in enumerate(ref):  # re-run on the survivor, same greedy tokens
            assert outs[f"r{i}"].finish_reason == "length", outs[f"r{i}"].error
            assert outs[f"r{i}"].token_ids == r.token_ids
        rid = c.add_request(ps[0], params)
        assert c.location(rid) != victim
        c.run_until_done(timeout_s=WAIT_S)
        reports = c.check_pools(require_idle=True)
        assert list(reports) == [n for n in ("C0", "C1") if n != victim]


def test_a_spawned_instance_that_exits_is_restarted_rejoins_and_serves(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(membership, "RESTART_WAIT_S", 0.2)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with cluster(tiny_llama_dir, "1P1D-CC") as c:
        c.add_request(prompts(1)[0], params)
        (before,) = c.run_until_done(timeout_s=WAIT_S)
        pid = c.instances["D0"].process.pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + WAIT_S
        while "D0" not in c.dead:
            assert time.monotonic() < deadline, "the death went unnoticed"
            c.step()
        with pytest.raises(InstanceDied, match="D0"):  # while it restarts, nothing goes there
            c.add_request(prompts(1)[0], params)
        while "D0" in c.dead:
            assert time.monotonic() < deadline + WAIT_S, f"D0 did not come back: {c.dead}"
            c.step()
        assert c.num_rejoins == 1 and c.instances["D0"].process.pid != pid
        assert c.membership.restarts == {"D0": 1}
        c.add_request(prompts(1)[0], params)
        (after,) = c.run_until_done(timeout_s=WAIT_S)
        assert after.token_ids == before.token_ids and after.metrics.decode_instance == "D0"
        c.check_pools(require_idle=True)


def test_restarts_back_off_and_stop_at_the_bound(tiny_llama_dir, monkeypatch):
    """A restarted instance that exits again at once (a crash loop) is restarted after twice
    the wait each time, and no more than ``MAX_RESTARTS`` times."""
    monkeypatch.setattr(membership, "RESTART_WAIT_S", 0.1)
    monkeypatch.setattr(membership, "MAX_RESTARTS", 3)
    with cluster(tiny_llama_dir, "1P1D") as c:
        starts: list[float] = []

        def crashing(name: str) -> None:  # the process "started" is the one that exited
            starts.append(time.monotonic())
            c.instances[name].ready = False

        monkeypatch.setattr(c.launcher, "respawn", crashing)
        killed = time.monotonic()
        os.kill(c.instances["D0"].process.pid, signal.SIGKILL)
        while time.monotonic() < killed + 2.5:
            c.step()
        assert len(starts) == 3 and "D0" in c.dead and not c.membership.restart_at
        gaps = [b - a for a, b in zip([killed, *starts], starts)]
        assert gaps[1] >= 0.2 and gaps[2] >= 0.4 and gaps[2] > gaps[1], gaps
        assert c.num_rejoins == 0


def _kill_and_wait(c: ProcessCluster, name: str, back: bool) -> None:
    """SIGKILL instance ``name``; step until it is dead, and with ``back`` until it rejoined."""
    os.kill(c.instances[name].process.pid, signal.SIGKILL)
    deadline = time.monotonic() + WAIT_S
    while name not in c.dead:
        assert time.monotonic() < deadline, "the death went unnoticed"
        c.step()
    while back and name in c.dead:
        assert time.monotonic() < deadline + WAIT_S, f"{name} did not come back: {c.dead}"
        c.step()


def test_the_restart_budget_comes_back_after_a_while_up_and_a_role_past_it_is_beyond_repair(
    tiny_llama_dir, monkeypatch
):
    """One restart in a row: D0, killed, is restarted; having served for the reset time it
    is killed and restarted again; killed once more at once, it stays dead, and the deployment
    says it is beyond repair (the server's /health then fails)."""
    monkeypatch.setattr(membership, "RESTART_WAIT_S", 0.1)
    monkeypatch.setattr(membership, "MAX_RESTARTS", 1)
    monkeypatch.setattr(membership, "RESTART_RESET_S", 1.0)
    with cluster(tiny_llama_dir, "1P1D") as c:
        _kill_and_wait(c, "D0", back=True)
        time.sleep(membership.RESTART_RESET_S)
        _kill_and_wait(c, "D0", back=True)
        assert c.num_rejoins == 2 and c.membership.restarts == {"D0": 1}
        assert c.beyond_repair() is None
        _kill_and_wait(c, "D0", back=False)
        deadline = time.monotonic() + WAIT_S
        while (why := c.beyond_repair()) is None:
            assert time.monotonic() < deadline, f"D0 was not given up: {c.membership.restart_at}"
            c.step()
        assert "no decode instance will come back" in why and "D0" in why, why
        assert not c.membership.restart_at and c.num_rejoins == 2


def test_an_idle_cluster_keeps_its_instances(tiny_llama_dir):
    """Nobody steps for three heartbeat timeouts: no instance is blamed, a request is served."""
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    with ProcessCluster.of(
        tiny_llama_dir,
        "1P1D-CC",
        engine=EngineConfig(num_blocks=NUM_BLOCKS),
        timeout_s=TIMEOUT_S,
        heartbeat_timeout_s=2.0,
        start_method="forkserver",
    ) as c:
        time.sleep(3 * c.spec.heartbeat_timeout_s)
        c.add_request(prompts(1)[0], params)
        outs = c.run_until_done(timeout_s=WAIT_S)
        assert not c.dead and [o.finish_reason for o in outs] == ["length"], outs
        c.check_pools(require_idle=True)


def test_abort_on_decode_and_on_prefill_frees_every_block(tiny_llama_dir):
    with cluster(tiny_llama_dir, "1P1D-CC") as c:
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        rids = [c.add_request(p, params) for p in prompts(3)]
        on_decode = [wait_until_on_decode(c, rids, want_rid=True)]
        queued = c.add_request(prompts(1, seed=9)[0], params)  # just submitted: on P
        outs = {rid: c.abort(rid) for rid in [*on_decode, queued]}
        assert all(o.finish_reason == "abort" for o in outs.values())
        assert outs[on_decode[0]].token_ids  # it had decoded some tokens on D
        assert c.abort(queued) is None and c.location(queued) is None
        left = c.run_until_done(timeout_s=0.5)  # the rest is aborted at the deadline
        assert sorted(o.request_id for o in left) == sorted(set(rids) - set(on_decode))
        assert all(o.finish_reason in ("abort", "length") for o in left)
        c.check_pools(require_idle=True)  # every block came back, on P and on D


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_an_orphaned_instance_exits_even_while_it_waits_on_a_peer(tiny_llama_dir, tmp_path, reaped):
    """The frontend is SIGKILLed, and reaped or left a zombie by its own parent: within 5 s
    every instance has exited and its shared-memory segment is gone."""
    script = tmp_path / "frontend.py"
    script.write_text(
        "import os, sys, time\n"
        "from minimemserve import ProcessCluster, SamplingParams\n"
        "from minimemserve.config import EngineConfig\n"
        "if __name__ == '__main__':\n"
        f"    c = ProcessCluster.of({str(tiny_llama_dir)!r}, '1P1D-CC',\n"
        "                       engine=EngineConfig(num_blocks=128))\n"
        "    p = SamplingParams(max_tokens=400, ignore_eos=True)\n"
        "    for i in range(3):\n"
        "        c.add_request(list(range(3, 40 + i)), p)\n"
        "    print(' '.join(str(i.process.pid) for i in c.instances.values()), flush=True)\n"
        "    time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        segments = [n for n in os.listdir("/dev/shm") for p in pids if n.startswith(f"mms-{p}-")]
        assert len(segments) == 2, segments
        proc.kill()
        if reaped:
            proc.wait()
        deadline = time.monotonic() + ORPHAN_S
        while time.monotonic() < deadline and (
            any(map(_alive, pids)) or any(os.path.exists(f"/dev/shm/{n}") for n in segments)
        ):
            time.sleep(0.1)
        if not reaped:  # still there, exited but never reaped
            assert _state(proc.pid) == "Z"
        assert not [p for p in pids if _alive(p)]
        assert not [n for n in segments if os.path.exists(f"/dev/shm/{n}")]
    finally:
        proc.kill()
        proc.wait()


def _state(pid: int) -> str:
    """A process's state letter (``Z``: a zombie, exited); "" once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return ""


def _alive(pid: int) -> bool:
    return _state(pid) not in ("", "Z", "X")


@pytest.mark.parametrize("load", ["fast", "slow"])
def test_a_spawned_instance_declared_dead_by_mistake_rejoins(tiny_llama_dir, slow_engines, load):
    """D0 stalls (SIGSTOP) past the heartbeat timeout while a request runs on it: it is
    declared dead within the timeout and a beat, and its request ends naming it; woken, it
    drops that session, waits, is joined again (rebuilding its engine, slower than the
    timeout with ``slow``), and serves with the same tokens as before; pools balance."""
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ref = LLM(tiny_llama_dir, config="PD", num_blocks=NUM_BLOCKS).generate(prompts(1), short)
    if load == "slow":
        slow_engines("decode", load_s=2 * SLOW_S, step_s=0)
    with ProcessCluster.of(
        tiny_llama_dir,
        "1P1D-CC",
        engine=EngineConfig(num_blocks=NUM_BLOCKS),
        timeout_s=TIMEOUT_S,
        heartbeat_timeout_s=2.0,
        start_method="forkserver" if load == "fast" else "spawn",
    ) as c:
        rid = c.add_request(prompts(1, seed=5)[0], params)
        wait_until_on_decode(c, [rid])
        pid = c.instances["D0"].process.pid
        os.kill(pid, signal.SIGSTOP)
        outs, t0, deadline = [], time.monotonic(), time.monotonic() + WAIT_S
        while "D0" not in c.dead and time.monotonic() < deadline:
            outs += c.step()
        assert time.monotonic() - t0 < c.spec.heartbeat_timeout_s + 1.0, c.dead
        os.kill(pid, signal.SIGCONT)
        while "D0" in c.dead and time.monotonic() < deadline + WAIT_S + 2 * SLOW_S:
            outs += c.step()
        assert not c.dead and c.num_rejoins == 1 and c.instances["D0"].process.pid == pid
        (out,) = outs + c.run_until_done(timeout_s=WAIT_S)
        assert out.finish_reason == "error" and "D0" in out.error, out
        c.add_request(prompts(1)[0], short)
        (out,) = c.run_until_done(timeout_s=WAIT_S)
        assert out.token_ids == ref[0].token_ids and out.metrics.decode_instance == "D0"
        c.check_pools(require_idle=True)


# Loaded by every process started with its directory on PYTHONPATH: once minimemserve.engine
# is imported there, an engine of a role in SLOW_ROLES takes SLOW_LOAD_S longer to build and
# SLOW_STEP_S longer per step (sleeping, as a step waiting on a GPU would).
SLOW_HOOK = """
import importlib.abc, importlib.util, os, sys, time

class SlowEngines(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "minimemserve.engine":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            slow(module.Engine)

        spec.loader.exec_module = exec_module
        return spec

def slow(cls):
    roles = os.environ["SLOW_ROLES"].split(",")
    init, step = cls.__init__, cls.step

    def slow_init(self, *args, **kwargs):
        if kwargs.get("role") in roles:
            time.sleep(float(os.environ["SLOW_LOAD_S"]))
        init(self, *args, **kwargs)

    def slow_step(self):
        if self.role in roles:
            time.sleep(float(os.environ["SLOW_STEP_S"]))
        return step(self)

    cls.__init__, cls.step = slow_init, slow_step

sys.meta_path.insert(0, SlowEngines())
"""
HEARTBEAT_TIMEOUT_S = 1.0  # shorter than every slow load and step below
SLOW_S = 4.0  # longer than the heartbeat timeout and the control-request timeout


@pytest.fixture
def slow_engines(tmp_path, monkeypatch):
    """``slow(*roles, load_s, step_s)``: the engines of ``roles`` in instances spawned from
    now on (start method ``spawn``) take ``load_s`` longer to build and ``step_s`` longer
    per step."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_HOOK)

    def slow(*roles: str, load_s: float = SLOW_S, step_s: float = SLOW_S) -> None:
        path = f"{hook}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
        monkeypatch.setenv("PYTHONPATH", path)
        monkeypatch.setenv("SLOW_ROLES", ",".join(roles))
        monkeypatch.setenv("SLOW_LOAD_S", str(load_s))
        monkeypatch.setenv("SLOW_STEP_S", str(step_s))

    return slow


@pytest.mark.parametrize("config, slow", [("PD", "colocated"), ("1P1D", "prefill")])
def test_a_busy_instance_is_not_a_dead_one(tiny_llama_dir, slow_engines, config, slow):
    """Loading the model and every step of the entry instance take 4 s, four times the
    heartbeat timeout and longer than a control request may wait: the requests all finish,
    nobody is declared dead, nothing re-runs, and a request added during a step is queued
    without waiting for the step to end."""
    slow_engines(slow)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    ps = prompts(2, seed=6)
    ref = LLM(tiny_llama_dir, config="PD", num_blocks=NUM_BLOCKS).generate(ps, params)
    with ProcessCluster.of(
        tiny_llama_dir,
        config,
        num_colocated=1,
        engine=EngineConfig(num_blocks=NUM_BLOCKS),
        timeout_s=TIMEOUT_S,
        heartbeat_s=0.2,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
    ) as c:
        c.add_request(ps[0], params, request_id="r0")
        time.sleep(1.0)  # the entry instance is in its first step
        t0 = time.monotonic()
        c.add_request(ps[1], params, request_id="r1")
        assert time.monotonic() - t0 < SLOW_S / 4
        outs = {o.request_id: o for o in c.run_until_done(timeout_s=60)}
        assert not c.dead and c.num_reruns == 0 and c.num_rejoins == 0
        for i, r in enumerate(ref):
            assert outs[f"r{i}"].finish_reason == "length", outs[f"r{i}"].error
            assert outs[f"r{i}"].token_ids == r.token_ids
        c.check_pools(require_idle=True)


def test_an_instance_that_ended_its_session_is_not_routed_to_until_it_rejoined(
    tiny_llama_dir, caplog
):
    """C0 stops hearing the frontend and ends its session on its own: the requests the
    frontend sent it before it noticed are refused as "waiting" and go to C1 (nothing ran
    on C0, so nothing re-runs); C0 is declared dead for it, joined again, and serves."""
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ps = prompts(4, seed=7)
    ref = LLM(tiny_llama_dir, config="PD", num_blocks=NUM_BLOCKS).generate(ps, params)
    with ProcessCluster.of(
        tiny_llama_dir,
        "PD",
        engine=EngineConfig(num_blocks=NUM_BLOCKS),
        timeout_s=TIMEOUT_S,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        start_method="forkserver",
    ) as c:
        c.launcher.beacon.remove("C0")  # C0 hears nothing more from the frontend
        time.sleep(3 * HEARTBEAT_TIMEOUT_S)  # it gives up; the frontend reads nothing meanwhile
        rids = [c.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(ps)]
        assert "C0" in {c.location(r) for r in rids}  # the frontend has not noticed yet
        outs = {o.request_id: o for o in c.run_until_done(timeout_s=WAIT_S)}
        assert c.num_reruns == 0  # nothing ran on C0
        for i, r in enumerate(ref):
            assert outs[f"r{i}"].finish_reason == "length", outs[f"r{i}"].error
            assert outs[f"r{i}"].token_ids == r.token_ids
            assert outs[f"r{i}"].metrics.prefill_instance == "C1"
        deadline = time.monotonic() + WAIT_S
        while (c.dead or not c.num_rejoins) and time.monotonic() < deadline:
            c.step()
        assert not c.dead and c.num_rejoins == 1
        rids = [c.add_request(p, params) for p in ps]
        assert {c.location(r) for r in rids} == {"C0", "C1"}
        outs = c.run_until_done(timeout_s=WAIT_S)
        assert [o.finish_reason for o in outs] == ["length"] * len(ps)
        c.check_pools(require_idle=True)
    assert "no heartbeat" not in caplog.text  # waiting, C0 was alive without a session


def test_an_instance_waiting_without_a_session_is_never_silent(tiny_llama_dir):
    """C0 ends its session and waits to be joined again: it says so as often as it sent
    heartbeats, so the frontend, even before it handles those messages, never declares it
    dead for silence (which would give up, and re-run, what it sent C0 meanwhile)."""
    with ProcessCluster.of(
        tiny_llama_dir,
        "PD",
        engine=EngineConfig(num_blocks=NUM_BLOCKS),
        timeout_s=TIMEOUT_S,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        start_method="forkserver",
    ) as c:
        c._handlers[rpc.Rejoin] = lambda sender, msg: None  # read, not acted on yet
        c.launcher.beacon.remove("C0")  # C0 hears nothing more from the frontend
        deadline = time.monotonic() + 6 * HEARTBEAT_TIMEOUT_S
        while time.monotonic() < deadline:
            c.step()
            assert "C0" not in c.dead, c.dead


def test_requests_an_ended_session_never_answered_go_elsewhere_and_are_not_reruns(
    tiny_llama_dir,
):
    """The frontend learns that C0 ended its session (its Rejoin, or a refusal, read first)
    before it reads C0's answers to requests it sent it: C0 never ran them (it answers a
    request as it reads it, and ends a session only after a silence of the frontend), so they
    go to C1 as new requests, not as re-runs of work done twice."""
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ps = prompts(4, seed=7)
    ref = LLM(tiny_llama_dir, config="PD", num_blocks=NUM_BLOCKS).generate(ps, params)
    with ProcessCluster.of(
        tiny_llama_dir,
        "PD",
        engine=EngineConfig(num_blocks=NUM_BLOCKS),
        timeout_s=TIMEOUT_S,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        start_method="forkserver",
    ) as c:
        c.launcher.beacon.remove("C0")  # C0 hears nothing more from the frontend
        time.sleep(3 * HEARTBEAT_TIMEOUT_S)  # it ends its session
        rids = [c.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(ps)]
        assert any(c.ledger.inflight[r].answer_from == "C0" for r in rids)
        c.membership.end_session("C0", "it ended its session (read before its answers)")
        outs = {o.request_id: o for o in c.run_until_done(timeout_s=WAIT_S)}
        assert c.num_reruns == 0
        for i, r in enumerate(ref):
            assert outs[f"r{i}"].finish_reason == "length", outs[f"r{i}"].error
            assert outs[f"r{i}"].token_ids == r.token_ids
            assert outs[f"r{i}"].metrics.prefill_instance == "C1"
        c.check_pools(require_idle=True)


def test_work_redone_after_a_silent_instance_is_bounded_and_answered_once(tiny_llama_dir):
    """What cannot be closed: C0 stops (SIGSTOP) while it computes a request, so the frontend
    cannot tell it from a dead one. The request is re-run on C1 (counted, at most
    ``MAX_RERUNS`` times); woken, C0 reads the frontend's Shutdown between two steps and drops
    the request, whose tokens from C0 are never taken: the client gets one answer, C1's."""
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    ps = prompts(2, seed=9)
    ref = LLM(tiny_llama_dir, config="PD", num_blocks=NUM_BLOCKS).generate(ps, params)
    with ProcessCluster.of(
        tiny_llama_dir,
        "PD",
        engine=EngineConfig(num_blocks=NUM_BLOCKS),
        timeout_s=TIMEOUT_S,
        heartbeat_timeout_s=2.0,
        start_method="forkserver",
    ) as c:
        rids = [c.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(ps)]
        victim = next(r for r in rids if c.location(r) == "C0")
        streamed, deadline = 0, time.monotonic() + WAIT_S
        while streamed < 5:  # C0 has done part of the work
            assert time.monotonic() < deadline and c.step() == []
            streamed += sum(len(d.token_ids) for d in c.take_deltas() if d.request_id == victim)
        pid = c.instances["C0"].process.pid
        os.kill(pid, signal.SIGSTOP)
        outs = []
        while "C0" not in c.dead:
            assert time.monotonic() < deadline
            outs += c.step()
        os.kill(pid, signal.SIGCONT)
        outs = {o.request_id: o for o in outs + c.run_until_done(timeout_s=WAIT_S)}
        assert c.num_reruns == 1 and c.ledger.inflight == {}
        for i, r in enumerate(ref):
            assert outs[f"r{i}"].finish_reason == "length", outs[f"r{i}"].error
            assert outs[f"r{i}"].token_ids == r.token_ids
        assert outs[victim].metrics.prefill_instance == "C1"  # the answer is C1's
        while c.dead or not c.num_rejoins:  # C0 dropped the request and comes back
            assert time.monotonic() < deadline + WAIT_S, c.dead
            c.step()
        c.check_pools(require_idle=True)
