"""KV transfers that fail half-way end in bounded time: the sender killed or stopped after the
receiver granted its blocks, or a completion that never arrives. Every request ends (an error,
or the same tokens recomputed on another prefill instance), the granted blocks go back to the
receiver's pool, and its counters say why (``returned``, and ``kv_grant_blocks_returned_total``
on the server)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from minimemserve import LLM, SamplingParams
from minimemserve.blocks.layout import KVLayout
from minimemserve.config import EngineConfig
from minimemserve.disagg import membership, rpc
from minimemserve.disagg.peering import Grants
from minimemserve.disagg.runtime import ProcessCluster
from minimemserve.mempool import MemPool

NUM_BLOCKS = 64
HEARTBEAT_TIMEOUT_S = 1.5
TIMEOUT_S = 3.0
# What a request caught in a failed transfer may take to end: the silence that means dead, and
# the re-run of its prompt on a tiny model.
END_BOUND_S = HEARTBEAT_TIMEOUT_S + 6.0

# Loaded by every process started with its directory on PYTHONPATH: in instance FAULT_NAME,
# once a decode instance granted the blocks of a transfer and before any KV is written, the
# process sends itself FAULT_SIGNAL: the sender dies, or stops, mid-transfer (a prefill
# instance named), or the receiver dies holding the blocks it granted (a decode one named).
FAULT_HOOK = """
import importlib.abc, importlib.util, os, signal, sys

class MidTransfer(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "minimemserve.disagg.peering":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            asked, granting = module.RemotePool.recv_alloc, module.Grants.on_alloc

            def fault(name):
                if name == os.environ["FAULT_NAME"]:
                    os.kill(os.getpid(), getattr(signal, os.environ["FAULT_SIGNAL"]))

            def recv_alloc(self, tokens, num_blocks):
                out = asked(self, tokens, num_blocks)
                if self.role == "decode":
                    fault(self.node.name)
                return out

            def on_alloc(self, sender, m):
                out = granting(self, sender, m)
                fault(self.name)
                return out

            module.RemotePool.recv_alloc = recv_alloc
            module.Grants.on_alloc = on_alloc

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, MidTransfer())
"""


@pytest.fixture
def mid_transfer(tmp_path, monkeypatch):
    """``fault(name, signal_name)``: instance ``name`` (spawned from now on) sends itself the
    signal once its first transfer to a decode instance was granted blocks."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FAULT_HOOK)
    monkeypatch.setattr(membership, "MAX_RESTARTS", 0)  # a restarted one would do it again

    def fault(name: str, signal_name: str) -> None:
        path = f"{hook}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
        monkeypatch.setenv("PYTHONPATH", path)
        monkeypatch.setenv("FAULT_NAME", name)
        monkeypatch.setenv("FAULT_SIGNAL", signal_name)

    return fault


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 512, (70 + 9 * i,), generator=g).tolist() for i in range(n)]


def _cluster(model_dir, config: str, **kw) -> ProcessCluster:
    return ProcessCluster.of(
        model_dir,
        config,
        engine=EngineConfig(num_blocks=NUM_BLOCKS),
        timeout_s=TIMEOUT_S,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        start_method="spawn",
        **kw,
    )


def _run(c: ProcessCluster, params: SamplingParams, n: int) -> tuple[dict, float]:
    """Submit ``n`` requests; step until all ended; their outputs by index and the time."""
    t0 = time.monotonic()
    rids = [c.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(_prompts(n))]
    outs = {o.request_id: o for o in c.run_until_done(timeout_s=60)}
    return {i: outs[r] for i, r in enumerate(rids)}, time.monotonic() - t0


def _receiver_returned(c: ProcessCluster, name: str) -> dict[str, int]:
    return c.stats()[name]["returned"]


def test_a_sender_killed_mid_transfer_is_recomputed_elsewhere_and_its_grant_returns(
    tiny_llama_dir, mid_transfer
):
    """2P1D-CC, P0 SIGKILLed once D0 granted it blocks: every request ends within the bound
    with the library's tokens (re-run on P1), D0's pool balances, and D0 counts the blocks
    that came back because their sender died."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ref = LLM(tiny_llama_dir, config="PD", num_blocks=NUM_BLOCKS).generate(_prompts(4), params)
    mid_transfer("P0", "SIGKILL")
    with _cluster(tiny_llama_dir, "2P1D-CC") as c:
        outs, took = _run(c, params, 4)
        assert "P0" in c.dead and took < END_BOUND_S, (c.dead, took)
        for i, r in enumerate(ref):
            assert outs[i].finish_reason == "length", outs[i].error
            assert outs[i].token_ids == r.token_ids
        assert c.num_reruns >= 1
        assert _receiver_returned(c, "D0")["peer_died"] > 0
        c.check_pools(require_idle=True)  # P1 and D0: nothing held


def test_a_sender_stopped_mid_transfer_ends_its_requests_and_its_grant_returns(
    tiny_llama_dir, mid_transfer
):
    """1P1D-CC, P0 stops itself (SIGSTOP) once D0 granted it blocks: declared dead after the
    heartbeat timeout, and with no other prefill instance its requests end with an error
    naming it, within the bound; D0's pool balances; the server's metric counts the blocks."""
    pytest.importorskip("prometheus_client")
    from minimemserve.server.app import Watcher
    from minimemserve.server.metrics import ServerMetrics

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    mid_transfer("P0", "SIGSTOP")
    with _cluster(tiny_llama_dir, "1P1D-CC") as c:
        try:
            outs, took = _run(c, params, 2)
            assert "P0" in c.dead and took < END_BOUND_S, (c.dead, took)
            for out in outs.values():
                assert out.finish_reason == "error" and "P0" in out.error, out
            returned = _receiver_returned(c, "D0")
            assert returned["peer_died"] > 0 and returned["expired"] == 0, returned
            c.check_pools(require_idle=True)
            metrics = ServerMetrics("tiny")
            Watcher(metrics)(c)
            text = metrics.registry.get_sample_value(
                "minimemserve:kv_grant_blocks_returned_total",
                {"model_name": "tiny", "instance": "D0", "role": "decode", "reason": "peer_died"},
            )
            assert text == returned["peer_died"]
        finally:
            os.kill(c.instances["P0"].process.pid, signal.SIGKILL)


def test_a_receiver_that_dies_holding_granted_blocks_ends_its_requests_and_frees_the_sender(
    tiny_llama_dir, mid_transfer
):
    """1P1D-CC, D0 killed right after it granted blocks to P0's transfer: with no decode
    instance left, every request ends with an error within the bound, and P0 keeps nothing
    for them (its pool balances, the prefixes it computed stay cached)."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    mid_transfer("D0", "SIGKILL")
    with _cluster(tiny_llama_dir, "1P1D-CC") as c:
        outs, took = _run(c, params, 2)
        assert "D0" in c.dead and took < END_BOUND_S, (c.dead, took)
        for out in outs.values():
            assert out.finish_reason == "error" and "D0" in out.error, out
        c.check_pools(require_idle=True)  # P0: every block of the two requests came back


LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)


def test_a_transfer_whose_completion_never_arrives_expires_and_its_blocks_return():
    """A sender that was granted blocks and then neither commits nor aborts (its Commit went
    astray): after ``expire_s`` the blocks go back, counted; the late commit is refused and
    a late abort frees nothing twice."""
    pool = MemPool(LAYOUT, 8)
    grants = Grants("D0", pool, vocab_size=100, links={}, expire_s=0.2)
    tokens = list(range(1, 13))  # three blocks
    granted = grants.on_alloc("P0", rpc.AllocRequest("x1", tokens, 3))
    other = grants.on_alloc("P0", rpc.AllocRequest("x2", None, 2))
    assert pool.num_free() == 3 and grants.expire() == 0  # not late yet
    time.sleep(0.25)
    grants.on_commit("P0", rpc.Commit("x2", None, other.new))  # x2 completes, late but alive
    assert grants.expire() == 3 and grants.returned["expired"] == 3
    with pytest.raises(ValueError, match="not allocated"):
        grants.on_commit("P0", rpc.Commit("x1", tokens, granted.new))
    grants.on_abort("P0", rpc.Abort("x1", granted.new))  # the sender gives up: nothing twice
    grants.drop("P0")  # and dies: what it still held for x2 goes back
    assert grants.returned == {"aborted": 0, "expired": 3, "peer_died": 2}
    assert pool.num_free() == 8
    pool.check()
