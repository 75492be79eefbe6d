"""Across processes: the in-process tokens, balanced pools, a clean shutdown."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import sharegpt_user_turns

from minimemserve import LLM, SamplingParams
from minimemserve.config import EngineConfig
from minimemserve.disagg.runtime import ProcessCluster
from minimemserve.scheduler.global_scheduler import Route

CONFIGS = ["PD", "PD-CC", "1P1D", "1P1D-CC1", "1P1D-CC2", "1P1D-CC3"]
BS = 16
NUM_BLOCKS = 128
MAX_TOKENS = 9
RUN_TIMEOUT_S = 60.0


def run_turns(engine, sessions: list[list[list[int]]], streamed: dict | None = None) -> list[list]:
    """Multi-turn over the engine API: turn k+1 = history + own output + new tokens. With
    ``streamed``, the tokens ``take_deltas`` gave are collected there by request id."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs: list[list] = [[] for _ in sessions]
    history: list[list[int]] = [[] for _ in sessions]
    for k in range(len(sessions[0])):
        prompts = [history[s] + sessions[s][k] for s in range(len(sessions))]
        rids = [
            engine.add_request(p, params, request_id=f"s{s}-t{k}") for s, p in enumerate(prompts)
        ]
        done = {}
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while engine.has_unfinished():
            for out in engine.step():
                done[out.request_id] = out
            for d in engine.take_deltas() if streamed is not None else ():
                got = streamed.setdefault(d.request_id, [])
                assert d.start == len(got), "deltas are contiguous"
                got += d.token_ids
            assert time.monotonic() < deadline, "requests did not finish in time"
        for s, rid in enumerate(rids):
            outs[s].append(done[rid])
            history[s] = prompts[s] + done[rid].token_ids
    return outs


def tokens(outs) -> list[list[list[int]]]:
    return [[o.token_ids for o in session] for session in outs]


def shm_segments(pids) -> list[str]:
    return [n for n in os.listdir("/dev/shm") for p in pids if n.startswith(f"mms-{p}-")]


@pytest.fixture(scope="module")
def sessions(tiny_llama_dir):
    """Real multi-turn ShareGPT user messages (cut short to fit the tiny context)."""
    return sharegpt_user_turns(tiny_llama_dir, num_sessions=2, num_turns=3, max_user_tokens=40)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, sessions):
    llm = LLM(tiny_llama_dir, config="PD", num_blocks=NUM_BLOCKS)
    return tokens(run_turns(llm.engine, sessions))


@pytest.fixture(scope="module")
def runs(tiny_llama_dir, sessions):
    """Each config across processes: outputs, pool reports, and what was left after close."""
    res = {}
    for config in CONFIGS:
        cluster = ProcessCluster.of(
            tiny_llama_dir,
            config,
            engine=EngineConfig(num_blocks=NUM_BLOCKS),
            timeout_s=10,
            start_method="forkserver",  # torch imported once for every cluster of the session
        )
        with cluster:
            pids = [i.process.pid for i in cluster.instances.values()]
            segments = shm_segments(pids)
            streamed: dict[str, list[int]] = {}
            outs = run_turns(cluster, sessions, streamed)
            reports = cluster.check_pools(require_idle=True)
        res[config] = {
            "outs": outs,
            "streamed": streamed,
            "reports": reports,
            "pids": pids,
            "segments": segments,
            "alive_after": [
                i.info.name for i in cluster.instances.values() if i.process.is_alive()
            ],
            "segments_after": shm_segments(pids),
        }
    return res


def test_prefill_first_across_processes_gives_the_same_tokens(tiny_llama_dir, sessions, reference):
    """The step policy travels to every instance of a process cluster (1P1D-CC, and the
    colocated PD-CC), and changes no token."""
    for config in ("1P1D-CC", "PD-CC"):
        cfg = EngineConfig(num_blocks=NUM_BLOCKS, scheduler="prefill_first")
        with ProcessCluster.of(
            tiny_llama_dir, config, engine=cfg, timeout_s=10, start_method="forkserver"
        ) as cluster:
            outs = run_turns(cluster, sessions)
            assert tokens(outs) == reference
            cluster.check_pools(require_idle=True)
            # the frontend told the global scheduler each answer's length as it finished
            lengths = [len(o.token_ids) for session in outs for o in session]
            assert cluster.scheduler.answer_tokens() == pytest.approx(sum(lengths) / len(lengths))


@pytest.mark.parametrize("config", CONFIGS)
def test_same_greedy_tokens_as_in_process(runs, reference, config):
    assert tokens(runs[config]["outs"]) == reference


@pytest.mark.parametrize("config", CONFIGS)
def test_tokens_stream_in_order_before_the_output(runs, config):
    streamed, outs = runs[config]["streamed"], runs[config]["outs"]
    finals = {o.request_id: o.token_ids for session in outs for o in session}
    for rid, toks in streamed.items():
        assert toks == finals[rid][: len(toks)]
    assert sum(map(len, streamed.values())) > 0  # deltas did arrive before outputs


@pytest.mark.parametrize("config", CONFIGS)
def test_pools_balance_on_every_instance(runs, config):
    reports = runs[config]["reports"]
    assert len(reports) == 2
    for name, rep in reports.items():
        assert rep["ok"], name
        assert rep["pool"]["hbm"]["referenced"] == 0, name


def test_colocated_routing_keeps_sessions_on_their_cache(tiny_llama_dir, sessions):
    """With the instances idle, each turn goes where its conversation is cached (under
    load the scheduler may trade the hit for the idler instance: that is its job)."""
    with ProcessCluster.of(
        tiny_llama_dir,
        "PD-CC",
        engine=EngineConfig(num_blocks=NUM_BLOCKS),
        start_method="forkserver",
    ) as cluster:
        history = [[] for _ in sessions]
        for k in range(len(sessions[0])):
            for s, session in enumerate(sessions):
                prompt = history[s] + session[k]
                out = run_one(cluster, prompt, f"s{s}-t{k}")
                if k:
                    # all of the previous turn whose KV exists, in whole blocks
                    assert out.metrics.cached_tokens == (len(history[s]) - 1) // BS * BS > 0
                history[s] = prompt + out.token_ids


def test_disagg_moves_kv_between_processes(runs):
    for config in ("1P1D", "1P1D-CC2", "1P1D-CC3"):
        reports = runs[config]["reports"]
        assert reports["P0"]["pool"]["counters"]["sent_bytes"] > 0, config
        assert all(o.metrics.transferred_bytes > 0 for s in runs[config]["outs"] for o in s[:1])


def test_cc3_prefill_hit_covers_previous_answer_across_processes(runs):
    outs3, outs2 = runs["1P1D-CC3"]["outs"], runs["1P1D-CC2"]["outs"]
    for s3, s2 in zip(outs3, outs2):
        for k in range(1, len(s3)):
            prev_total = len(s3[k - 1].prompt_token_ids) + len(s3[k - 1].token_ids)
            # KV exists for everything but the last sampled token; whole blocks are cached
            assert s3[k].metrics.cached_tokens == (prev_total - 1) // BS * BS
            assert s3[k].metrics.cached_tokens >= s2[k].metrics.cached_tokens
    assert any(
        s3[k].metrics.cached_tokens > s2[k].metrics.cached_tokens
        for s3, s2 in zip(outs3, outs2)
        for k in range(1, len(s3))
    )
    # D sent decode-phase KV back to P
    assert runs["1P1D-CC3"]["reports"]["D0"]["pool"]["counters"]["sent_bytes"] > 0


@pytest.mark.parametrize("config", CONFIGS)
def test_clean_shutdown_leaves_no_process_and_no_segment(runs, config):
    run = runs[config]
    if not config.startswith("PD"):  # colocated instances keep their pool private
        assert len(run["segments"]) == 2
    assert run["alive_after"] == []
    assert run["segments_after"] == []
    assert mp.active_children() == []
    for pid in run["pids"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def run_one(engine, prompt: list[int], rid: str):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt, params, request_id=rid)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        for out in engine.step():
            if out.request_id == rid:
                return out
        assert time.monotonic() < deadline, "request did not finish in time"


def test_prefix_transfer_between_colocated_instances(tiny_llama_dir, sessions):
    """A busy instance holds a conversation's cache: the scheduler sends the next turn to
    the idle one and has the busy one push the cached prefix over first."""
    first = sessions[0][0] + sessions[0][1]
    llm = LLM(tiny_llama_dir, config="PD", num_blocks=NUM_BLOCKS)
    ref1 = run_one(llm.engine, first, "a")
    second = first + ref1.token_ids + sessions[0][2]
    ref2 = run_one(llm.engine, second, "b")
    with ProcessCluster.of(
        tiny_llama_dir,
        "PD-CC",
        engine=EngineConfig(num_blocks=NUM_BLOCKS),
        timeout_s=10,
        start_method="forkserver",
        policy="prompt_tree",
    ) as cluster:
        out1 = run_one(cluster, first, "a")
        holder = next(n for n in ("C0", "C1") if cluster.scheduler.trees.cached(n, first))
        idle = "C1" if holder == "C0" else "C0"
        cluster.scheduler.dispatched("busy", Route(holder, 0, 0.0), 10_000)  # a long queue
        out2 = run_one(cluster, second, "b")
        cluster.scheduler.finished("busy")
        assert cluster.scheduler.num_transfers == 1
        moved = cluster.prefix_tokens_moved
        assert moved == (len(first) + len(out1.token_ids) - 1) // BS * BS > 0
        assert out2.metrics.cached_tokens == moved  # the idle instance hit the moved prefix
        assert [out1.token_ids, out2.token_ids] == [ref1.token_ids, ref2.token_ids]
        reports = cluster.check_pools(require_idle=True)
        assert reports[holder]["pool"]["counters"]["transfers_sent"] == 1
        assert reports[idle]["pool"]["counters"]["transfers_recv"] == 1
        assert cluster.scheduler.trees.cached(idle, second) >= moved


def test_bad_request_raises_in_the_frontend(tiny_llama_dir):
    """Also the default start method (spawn)."""
    from minimemserve.errors import InvalidRequest

    with ProcessCluster.of(
        tiny_llama_dir, "PD", num_colocated=1, engine=EngineConfig(num_blocks=32)
    ) as cluster:
        params = SamplingParams(max_tokens=4, temperature=0.0)
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            cluster.add_request([1, 2, 10**6], params)
        with pytest.raises(InvalidRequest, match="empty prompt"):
            cluster.add_request([], params)
        assert cluster.validate("hello there", params)
        assert not cluster.has_unfinished()
        with pytest.raises(InvalidRequest, match="stop_token_ids"):
            cluster.add_request([5, 6], SamplingParams(stop_token_ids=[2**64]))
        rid = cluster.add_request(np.array([5, 6, 7]), params)  # numpy ints are token ids
        assert [o.request_id for o in cluster.run_until_done(timeout_s=60)] == [rid]


FRONTEND_SCRIPT = """
import signal
import sys
from minimemserve.config import EngineConfig
from minimemserve.disagg.runtime import ProcessCluster
from minimemserve.scheduler.global_scheduler import Route

if __name__ == "__main__":
    # Ctrl-C raises KeyboardInterrupt, as in a shell, even if the test run ignores SIGINT (a
    # non-interactive shell starts a background job, `pytest &`, so; every child inherits an
    # ignored signal, across exec)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cfg = EngineConfig(num_blocks=16)
    with ProcessCluster.of(sys.argv[1], "1P1D", engine=cfg, start_method="forkserver") as c:
        print(" ".join(str(i.process.pid) for i in c.instances.values()), flush=True)
        while True:
            c.step()
"""


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)]
)
def test_ctrl_c_or_sigterm_on_the_frontend_shuts_everything_down(tiny_llama_dir, tmp_path, sig):
    """Ctrl-C reaches the whole process group; the instances leave it to the frontend."""
    script = tmp_path / "frontend.py"
    script.write_text(FRONTEND_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tiny_llama_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal gives it
    )
    try:
        line = proc.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, proc.stderr.read()
        assert all(running(p) for p in pids)
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # what Ctrl-C in a terminal does
        else:
            proc.send_signal(sig)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the frontend did not exit within 30 s; its log:\n{proc.stderr.read()}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "KeyboardInterrupt" in proc.stderr.read()
    deadline = time.monotonic() + 10
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(running(p) for p in pids)
    assert shm_segments(pids) == []


def test_benchmark_runs_configs_across_processes(tiny_llama_dir):
    from minimemserve.deployment import DeploymentSpec
    from minimemserve_lab.harness.driver import process_factories, run_bench

    configs = ["1P1D-CC"]
    res = run_bench(
        configs,
        num_sessions=2,
        rate=5.0,
        max_turns=2,
        model_dir=tiny_llama_dir,
        out_dir=None,
        options=DeploymentSpec(engine=EngineConfig(num_blocks=NUM_BLOCKS)),
        max_output_tokens=6,
        factories=process_factories(configs, start_method="forkserver"),
        progress=False,
        verbose=False,
    )
    summary = res["summaries"]["1P1D-CC"]
    assert summary["requests"] == 4 and summary["errors"] == 0
    assert summary["transferred_bytes"] > 0
    assert mp.active_children() == []  # the benchmark closed the cluster
