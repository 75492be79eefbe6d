"""A hostile local process on the control plane: forged frames are dropped, a member's
invalid messages are refused, and the cluster keeps serving with balanced pools."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch
import zmq

from minimemserve import LLM, SamplingParams
from minimemserve.config import EngineConfig
from minimemserve.disagg import rpc
from minimemserve.disagg.runtime import ProcessCluster
from minimemserve.request import RequestMetrics, RequestOutput, TokenDelta

NUM_BLOCKS = 64
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prompt(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (37,), generator=g).tolist()


def forged_messages(victim_file: str) -> list[tuple[str, rpc.Msg]]:
    """(target, message) pairs a hostile process would send, each aimed at real harm."""
    handle = dict(kind="cpu_shm", name=os.path.basename(victim_file), shm_dir="/tmp",
                  shape=[1], strides=[1], storage_offset=0, dtype="uint8", nbytes=4)  # fmt: skip
    fake = rpc.PeerInfo("D0", "decode", "tcp://127.0.0.1:9", handle)
    state = rpc.RequestState("evil", [10**6], 1, PARAMS, 0.0, [0], 1, 9, "P0", RequestMetrics(0.0))
    out = RequestOutput("r-victim", [1], [66, 66], "forged", "stop", RequestMetrics(0.0))
    return [
        ("P0", rpc.Peers([fake])),  # attach a "segment" at an arbitrary path, reroute hand-offs
        ("frontend", rpc.Ready(rpc.PeerInfo("D0", "decode", "tcp://127.0.0.1:9", handle), 1)),
        ("P0", rpc.Shutdown("forged")),
        ("D0", rpc.Accept(state)),  # an out-of-vocabulary token
        ("frontend", rpc.Output(out)),  # a spoofed result
        ("P0", rpc.PeerDown("D0", "forged")),  # poison routing
        ("D0", rpc.AllocRequest("hold-all", None, NUM_BLOCKS)),  # hold every free block
    ]


def _forge(addresses: dict[str, str], victim_file: str) -> None:
    """A separate process without the cluster's secret: send every forged message."""
    node = rpc.RpcNode("P0", lambda s, m: None, timeout_s=0.5,
                       codec=rpc.Codec(os.urandom(32)))  # fmt: skip
    for name, address in addresses.items():
        node.connect(name, address)
    for target, msg in forged_messages(victim_file):
        try:
            node.call(target, msg)
        except rpc.TransferError:
            pass  # dropped: no answer comes
    node.close()


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    with ProcessCluster(
        tiny_llama_dir, "1P1D-CC", engine_config=EngineConfig(num_blocks=NUM_BLOCKS), timeout_s=5
    ) as c:
        yield c


def test_forged_messages_from_another_process_are_dropped(cluster, tiny_llama_dir, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    addresses = {n: i.address for n, i in cluster.instances.items()}
    addresses["frontend"] = cluster.node.address
    rid = cluster.add_request(prompt(1), PARAMS, request_id="r-victim")
    child = mp.get_context("spawn").Process(target=_forge, args=(addresses, str(victim)))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    outs = {o.request_id: o for o in cluster.run_until_done(timeout_s=60)}
    ref = LLM(tiny_llama_dir, config="PD", num_blocks=NUM_BLOCKS).generate([prompt(1)], PARAMS)
    assert outs[rid].token_ids == ref[0].token_ids and outs[rid].text != "forged"
    assert victim.read_bytes() == b"keep" and not cluster.dead
    stats = cluster.stats()
    rejected = {n: s["rejected"] for n, s in stats.items()}
    assert rejected == {"P0": 3, "D0": 2, "frontend": 2}, rejected  # one per forged message
    assert not any(stats["D0"]["grants"].values()) and stats["P0"]["dead_peers"] == {}
    cluster.check_pools(require_idle=True)
    cluster.add_request(prompt(2), PARAMS)  # still serving
    assert [o.finish_reason for o in cluster.run_until_done(timeout_s=60)] == ["length"]


def test_a_members_invalid_messages_are_refused_at_once(cluster):
    """With the secret (a buggy member), each message is checked field by field."""
    node = rpc.RpcNode("P0", lambda s, m: None, timeout_s=5, codec=cluster.node.codec)
    node.connect("D0", cluster.instances["D0"].address)
    node.connect("P0", cluster.instances["P0"].address)
    bad = {
        "outside the vocabulary": ("D0", forged_messages("/nonexistent")[3][1]),
        "cannot be received": ("D0", rpc.AllocRequest("x", None, NUM_BLOCKS + 1)),
        "16 tokens cannot be received": ("D0", rpc.AllocRequest("y", [10**6] * 16, 1)),
        "not allocated for transfer": ("D0", rpc.Commit("never", None, [1, 2])),
        "takes no Shutdown": ("P0", rpc.Shutdown("not from the frontend")),
    }
    try:
        for match, (target, msg) in bad.items():
            with pytest.raises(rpc.RemoteError, match=match):
                node.call(target, msg)
    finally:
        node.close()
    cluster.add_request(prompt(3), PARAMS)
    assert [o.finish_reason for o in cluster.run_until_done(timeout_s=60)] == ["length"]
    cluster.check_pools(require_idle=True)


def test_a_members_tokens_are_checked_before_they_stream(cluster):
    """Token deltas pushed to the frontend must fit their request: ids in the vocabulary,
    positions within max_tokens, logprobs only when asked; others never reach a stream."""
    node = rpc.RpcNode("P0", lambda s, m: None, timeout_s=5, codec=cluster.node.codec)
    node.connect("frontend", cluster.node.address)
    long = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)  # streams a while
    rid = cluster.add_request(prompt(4), long, request_id="r-stream")
    for bad in (
        TokenDelta(rid, 0, [10**6]),  # outside the vocabulary
        TokenDelta(rid, -3, [5, 6, 7, 8]),  # before the start
        TokenDelta(rid, 0, [5] * (long.max_tokens + 1)),  # past max_tokens
        TokenDelta(rid, 0, [5], [(-0.1, [])]),  # logprobs nobody asked for
    ):
        node.push("frontend", rpc.Tokens([bad]))
    streamed, outs = [], []
    while cluster.has_unfinished():
        outs += cluster.step()
        streamed += [t for d in cluster.take_deltas() for t in d.token_ids]
    node.close()
    (out,) = outs
    assert streamed and streamed == out.token_ids[: len(streamed)]
    cluster.check_pools(require_idle=True)


def test_binding_off_loopback_needs_curve_keys():
    with pytest.raises(ValueError, match="needs CURVE keys"):
        rpc.RpcNode("x", lambda s, m: None, host="0.0.0.0", codec=rpc.Codec(os.urandom(32)))


def _knock(address: str, curve_server_key: bytes | None) -> bool:
    """Send junk and a forged call to ``address``; whether any answer came back."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve_server_key is not None:  # a CURVE client that guesses the wrong server key
        sock.curve_serverkey = curve_server_key
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(address)
    sock.send(os.urandom(64))
    sock.send(rpc.Codec(os.urandom(32)).encode(rpc.Envelope("req", 1, "P0", rpc.Shutdown("x"))))
    answered = bool(sock.poll(1500))
    sock.close()
    ctx.term()
    return answered


def test_off_loopback_a_peer_without_the_curve_key_gets_nothing(tiny_llama_dir):
    """Bound to every interface, the cluster encrypts its sockets with a CURVE key pair of its
    own: a plain client and a CURVE client with the wrong key get no answer, no frame even
    reaches the handler (nothing counted as rejected), and the cluster keeps serving."""
    with ProcessCluster(tiny_llama_dir, "1P1D-CC", engine_config=EngineConfig(
            num_blocks=NUM_BLOCKS), host="0.0.0.0", timeout_s=10) as c:  # fmt: skip
        port = c.node.address.rsplit(":", 1)[1]
        targets = [f"tcp://127.0.0.1:{port}"]
        targets += [f"tcp://127.0.0.1:{i.address.rsplit(':', 1)[1]}" for i in c.instances.values()]
        for address in targets:
            assert not _knock(address, None)
            assert not _knock(address, zmq.curve_keypair()[0])
        rid = c.add_request(prompt(2), PARAMS)
        outs = {o.request_id: o for o in c.run_until_done(timeout_s=60)}
        assert outs[rid].finish_reason == "length" and len(outs[rid].token_ids) == 8
        stats = c.stats()
        assert stats["frontend"]["rejected"] == 0 and not c.dead
        assert all(stats[n]["rejected"] == 0 for n in c.instances)
        c.check_pools()
