"""The KV link table: a link written here, one class and one line in the table, carries a
1P1D-CC deployment across processes with the same greedy tokens as one colocated engine; so
does one that tells its peers data of its own, which the control plane passes on unread."""

from __future__ import annotations

import time
import types

import msgspec
import pytest
from helpers import sharegpt_user_turns

from minimemserve import LLM, SamplingParams
from minimemserve.config import EngineConfig
from minimemserve.disagg import rpc
from minimemserve.disagg.launch import pair_transport
from minimemserve.disagg.peering import PeerLinks
from minimemserve.disagg.runtime import ProcessCluster
from minimemserve.errors import ConfigError
from minimemserve.links import KV_LINKS, Counts, candidates, kv_link, transport_names
from minimemserve.mempool.shared import SharedPoolTensor, attach

NUM_BLOCKS = 128
PARAMS = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)


class FakeLink:
    """A peer on this host written one block at a time into its mapped shared pool, counting
    what it moves: a transport the package does not know."""

    name, shares_pool, whole_model, devices, meets_in_store = "fake", True, False, ("cpu",), False

    def __init__(self, peer: str, kv) -> None:
        self.peer, self.kv, self.counts = peer, kv, Counts()

    @classmethod
    def unfit(cls, a, b) -> str | None:
        return None if a.host == b.host else "the fake link needs one host"

    @classmethod
    def endpoint(cls, spec, pool) -> None:
        return None

    @classmethod
    def reach(cls, peers, p) -> None:
        peers.add(p, cls(p.name, attach(p.handle)))

    def write(self, node, xfer: str, blocks: list[int], src, src_ids) -> None:
        for b, s in zip(blocks, src_ids):
            self.kv[b].copy_(src[s])
        self.counts.sent_bytes += len(blocks) * self.kv[0].nbytes
        self.counts.sent_messages += 1

    def receive(self, pool, m) -> None:
        raise ValueError("the fake link sends no KVData")

    def await_landing(self, xfer: str, new: list[int]) -> None:
        self.counts.recv_bytes += len(new) * self.kv[0].nbytes
        self.counts.recv_messages += bool(new)

    def forget(self, xfer: str) -> None:
        pass

    def close(self) -> None:
        self.kv = None

    def stats(self) -> dict:
        return self.counts.stats(self.name)


class LandingEnd:
    """An instance's side of the landing link: a shared tensor of its own, shaped as its pool's
    hbm tier, that peers write into; its handle is the link's data peers are told."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.landing = SharedPoolTensor.create(pool.kv().shape, pool.dtype, pool.device)

    def offer(self) -> bytes:
        return msgspec.msgpack.encode(self.landing.handle.to_dict())

    def close(self) -> None:
        self.landing.close()


class LandingLink(FakeLink):
    """A peer reached through the landing tensor its link data names (not its pool, which is
    not shared): the receiver moves what landed into its pool before the commit, as a NIXL
    instance does with its landing tensor. The package knows neither the class nor its data."""

    name, shares_pool = "landing", False

    def __init__(self, peer: str, kv, end: LandingEnd) -> None:
        super().__init__(peer, kv)
        self.end = end

    @classmethod
    def endpoint(cls, spec, pool) -> LandingEnd | None:
        return LandingEnd(pool) if spec.linked else None

    @classmethod
    def reach(cls, peers, p) -> None:
        assert p.handle is None and set(p.links) == {cls.name}  # only its own data reaches it
        handle = msgspec.msgpack.decode(p.links[cls.name])
        peers.add(p, cls(p.name, attach(handle), peers.endpoints[cls.name]))

    def await_landing(self, xfer: str, new: list[int]) -> None:
        super().await_landing(xfer, new)
        if new:
            self.end.pool.recv_copy(new, self.end.landing.tensor, new)


def turns(engine, sessions: list[list[list[int]]]) -> list[list[int]]:
    """Multi-turn, every session in step: turn k+1 = history + own output + new tokens."""
    history, answers = [[] for _ in sessions], []
    for k in range(len(sessions[0])):
        prompts = [history[s] + session[k] for s, session in enumerate(sessions)]
        rids = [
            engine.add_request(p, PARAMS, request_id=f"s{s}t{k}") for s, p in enumerate(prompts)
        ]
        done, deadline = {}, time.monotonic() + 60
        while engine.has_unfinished():
            done.update((o.request_id, o) for o in engine.step())
            assert time.monotonic() < deadline, "requests did not finish in time"
        for s, rid in enumerate(rids):
            answers.append(done[rid].token_ids)
            history[s] = prompts[s] + done[rid].token_ids
    return answers


@pytest.mark.timeout(300)
def test_a_link_added_in_a_test_file_carries_1p1d_cc(tiny_llama_dir, monkeypatch):
    monkeypatch.setitem(KV_LINKS, "fake", "disagg.test_links:FakeLink")  # tests/ is on the path
    assert "fake" in transport_names() and kv_link("fake").name == "fake"
    sessions = sharegpt_user_turns(tiny_llama_dir, num_sessions=2, num_turns=3, max_user_tokens=40)
    want = turns(LLM(tiny_llama_dir, config="PD", num_blocks=NUM_BLOCKS).engine, sessions)
    with ProcessCluster.of(
        tiny_llama_dir,
        "1P1D-CC",
        engine=EngineConfig(num_blocks=NUM_BLOCKS),
        transport="fake",
        timeout_s=10,
    ) as cluster:
        got = turns(cluster, sessions)
        stats = cluster.stats()
        reports = cluster.check_pools(require_idle=True)
    assert got == want
    assert all(rep["ok"] and rep["pool"]["hbm"]["referenced"] == 0 for rep in reports.values())
    for a, b in (("P0", "D0"), ("D0", "P0")):  # prefill KV to D, decode-phase KV back to P
        sent = stats[a]["pool"]["counters"]["sent_bytes"]
        link, back = stats[a]["links"][b], stats[b]["links"][a]
        assert link["transport"] == "fake" and link["sent_messages"] > 0
        assert sent > 0 and link["sent_bytes"] == back["recv_bytes"] == sent


@pytest.mark.timeout(300)
def test_a_link_with_its_own_peer_data_carries_1p1d_cc(tiny_llama_dir, monkeypatch):
    monkeypatch.setitem(KV_LINKS, "landing", "disagg.test_links:LandingLink")
    sessions = sharegpt_user_turns(tiny_llama_dir, num_sessions=2, num_turns=3, max_user_tokens=40)
    want = turns(LLM(tiny_llama_dir, config="PD", num_blocks=NUM_BLOCKS).engine, sessions)
    with ProcessCluster.of(
        tiny_llama_dir,
        "1P1D-CC",
        engine=EngineConfig(num_blocks=NUM_BLOCKS),
        transport="landing",
        timeout_s=10,
    ) as cluster:
        told = {name: inst.info.links for name, inst in cluster.instances.items()}
        got = turns(cluster, sessions)
        stats = cluster.stats()
        reports = cluster.check_pools(require_idle=True)
    assert got == want
    assert all(set(links) == {"landing"} for links in told.values())
    assert all(rep["ok"] and rep["pool"]["hbm"]["referenced"] == 0 for rep in reports.values())
    for a, b in (("P0", "D0"), ("D0", "P0")):  # prefill KV to D, decode-phase KV back to P
        link, back = stats[a]["links"][b], stats[b]["links"][a]
        assert link["transport"] == "landing" and link["sent_messages"] > 0
        assert (
            link["sent_bytes"] == back["recv_bytes"] == stats[b]["pool"]["counters"]["recv_bytes"]
        )


def test_auto_takes_the_first_link_of_the_table_that_fits_the_pair():
    agent = b"an agent's data"

    def inst(name: str, host: str, transport: str = "auto", nixl=None) -> rpc.PeerInfo:
        links = {} if nixl is None else {"nixl": nixl}
        return rpc.PeerInfo(name, "prefill", "", None, host, transport, links)

    assert pair_transport(inst("a", "h1"), inst("b", "h1")) == "shm"
    assert pair_transport(inst("a", "h1", nixl=agent), inst("b", "h2", nixl=agent)) == "nixl"
    assert pair_transport(inst("a", "h1"), inst("b", "h2")) == "gloo"
    assert pair_transport(inst("a", "h1"), inst("b", "h2"), "nccl") == "gloo"  # CUDA's backend
    with pytest.raises(ConfigError, match="different hosts: no shared memory"):
        pair_transport(inst("a", "h1"), inst("b", "h2"), "shm")
    with pytest.raises(ValueError, match="unknown KV transport 'carrier'; choose from"):
        kv_link("carrier")
    assert [c.name for c in candidates("auto")] == ["shm", "nixl", "gloo", "gloo"]
    assert [c.name for c in candidates("nccl")] == ["gloo"] and kv_link("nccl").devices == ("cuda",)
    peer = {"name": "D0", "role": "decode", "address": "tcp://127.0.0.1:1", "handle": None}
    with pytest.raises(msgspec.ValidationError, match="transport"):  # never a module path
        msgspec.convert(peer | {"transport": "os:system"}, rpc.PeerInfo)
    peers = PeerLinks(types.SimpleNamespace(name="P0", kv_links=dict(KV_LINKS)), None, None, None)
    with pytest.raises(ValueError, match="unknown KV transport 'carrier'"):
        peers.on_peers(rpc.FRONTEND, rpc.Peers([rpc.PeerInfo(**peer, transport="carrier")]))
    assert not peers.names and not peers.links  # refused whole, before reaching anyone
