"""The frontend's liveness never waits on an instance: a stopped one holds up neither the
server's once-a-second check (audits, load) nor its own death; one that wakes up while the
server is idle is taken back; a request a decode instance reports on is known to be there,
whatever became of the instance that prefilled it."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from minimemserve import LLM, SamplingParams
from minimemserve.config import EngineConfig
from minimemserve.disagg import rpc
from minimemserve.disagg.ledger import ABORT_WAIT_S, Inflight, Ledger
from minimemserve.disagg.runtime import ProcessCluster
from minimemserve.mempool import PoolAccountingError
from minimemserve.request import Request, TokenDelta
from minimemserve.scheduler.frontend import Frontend

pytest.importorskip("prometheus_client")
from minimemserve.server.app import Watcher
from minimemserve.server.metrics import ServerMetrics

NUM_BLOCKS = 64
HEARTBEAT_TIMEOUT_S = 1.5
TIMEOUT_S = 3.0  # control-request timeout: a check that waited on a stopped peer takes this
TICK_BOUND_S = 0.5  # what one check may take, a stopped instance or not
WAIT_S = 30.0


def _cluster(model_dir) -> ProcessCluster:
    return ProcessCluster.of(
        model_dir,
        "1P1D-CC",
        engine=EngineConfig(num_blocks=NUM_BLOCKS),
        timeout_s=TIMEOUT_S,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        start_method="forkserver",
    )


def _prompt() -> list[int]:
    return torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(3)).tolist()


def test_a_stopped_instance_holds_up_no_check_and_is_declared_dead_on_time(tiny_llama_dir):
    """P0 stopped (SIGSTOP) in an idle deployment: each of the server's checks (liveness,
    then the pools' audit and load) takes well under a control request's timeout, and P0 is
    declared dead within the heartbeat timeout and a check."""
    metrics = ServerMetrics("tiny")
    watcher = Watcher(metrics)
    with _cluster(tiny_llama_dir) as c:
        watcher(c)
        assert {v["role"] for v in metrics.snapshot.load.values()} == {"prefill", "decode"}
        pid = c.instances["P0"].process.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            start, longest = time.monotonic(), 0.0
            while "P0" not in c.dead:
                t0 = time.monotonic()
                watcher(c)
                longest = max(longest, time.monotonic() - t0)
                assert time.monotonic() - start < HEARTBEAT_TIMEOUT_S + 2, "P0 not declared dead"
                time.sleep(0.1)
            assert longest < TICK_BOUND_S, f"a check took {longest:.2f} s"
            watcher(c)
            assert {v["role"] for v in metrics.snapshot.load.values()} == {"decode"}
        finally:
            os.kill(pid, signal.SIGCONT)


def test_an_instance_that_wakes_while_no_request_runs_is_taken_back(tiny_llama_dir):
    """P0 stopped past the heartbeat timeout, then woken, while no request runs and only the
    liveness check is made (as an idle server makes it): P0 is declared dead, rejoins, and
    serves with the same tokens as the library."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ref = LLM(tiny_llama_dir, config="PD", num_blocks=NUM_BLOCKS).generate([_prompt()], params)
    with _cluster(tiny_llama_dir) as c:
        pid = c.instances["P0"].process.pid
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + WAIT_S
        try:
            while "P0" not in c.monitor():
                assert time.monotonic() < deadline, "P0 not declared dead"
                time.sleep(0.1)
        finally:
            os.kill(pid, signal.SIGCONT)
        while "P0" in c.monitor():
            assert time.monotonic() < deadline, f"P0 not taken back: {c.dead}"
            time.sleep(0.1)
        assert c.num_rejoins == 1
        c.add_request(_prompt(), params)
        (out,) = c.run_until_done(timeout_s=WAIT_S)
        assert out.token_ids == ref[0].token_ids and out.metrics.decode_instance == "D0"
        c.check_pools(require_idle=True)


def test_aborts_wait_on_a_stopped_instance_once_and_it_drops_them_when_woken(tiny_llama_dir):
    """D0 stops (SIGSTOP) as the first of three requests decodes there (P0 then waits on it
    too, handing the next one over): aborting all three takes about one abort's wait per
    instance, not a control-call timeout each; woken, the instances drop what they were told
    to, and every block comes back."""
    params = SamplingParams(max_tokens=450, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (30,), generator=g).tolist() for _ in range(3)]
    with ProcessCluster.of(
        tiny_llama_dir,
        "1P1D-CC",
        engine=EngineConfig(num_blocks=NUM_BLOCKS),
        timeout_s=10.0,  # what each abort would wait without the bound
        start_method="forkserver",
    ) as c:
        rids = [c.add_request(p, params) for p in prompts]
        deadline = time.monotonic() + WAIT_S
        while "D0" not in {c.location(r) for r in rids}:
            assert time.monotonic() < deadline and not c.step(), "none reached D0"
        pid = c.instances["D0"].process.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            outs = [c.abort(r) for r in rids]
            took = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        assert took < 2 * ABORT_WAIT_S + 1.0, f"the aborts took {took:.1f} s"
        assert [o.finish_reason for o in outs] == ["abort"] * 3
        while True:  # the aborts are read, the hand-offs under way end: blocks come back
            c.step()
            try:
                c.check_pools(require_idle=True)
                break
            except PoolAccountingError:
                assert time.monotonic() < deadline + WAIT_S, "blocks still held"
                time.sleep(0.1)
        assert not c.dead


class _Node:
    """The ledger's node, where nothing is sent (no request is re-run)."""


def test_tokens_from_the_decode_instance_show_the_request_is_there_before_the_notice():
    """D0 streams a request whose hand-off notice from P0 has not come: when P0 then dies,
    the request is D0's and runs on; without the tokens it would have been lost with P0."""
    frontend = Frontend(["P0"], lambda *a: 0)
    ledger = Ledger(_Node(), frontend, ["P0", "D0"], {}, 512, lambda rid, f: "")
    params = SamplingParams(max_tokens=8)
    for rid in ("streamed", "silent"):
        ledger.inflight[rid] = Inflight(Request(rid, [5, 6, 7], params), where="P0")
    ledger.on_tokens("P0", _tokens("streamed", 0, [9]))  # P's first token: still on P
    assert ledger.location("streamed") == "P0"
    ledger.on_tokens("D0", _tokens("streamed", 1, [10, 11, 12, 13]))
    ledger.lost("P0", "InstanceDied: instance P0 died")
    assert ledger.location("streamed") == "D0" and "streamed" in ledger.inflight
    (out,) = ledger.take_done()
    assert out.request_id == "silent" and out.finish_reason == "error"
    assert [d.token_ids for d in ledger.take_deltas()] == [[9, 10, 11, 12, 13]]


def _tokens(rid: str, start: int, ids: list[int]) -> rpc.Tokens:
    return rpc.Tokens([TokenDelta(rid, start, ids)])
