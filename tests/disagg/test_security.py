"""A hostile local process on the control plane: forged frames are dropped, a member's
invalid messages are refused, and the cluster keeps serving with balanced pools."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time

import pytest
import torch
import zmq

from minimemserve import LLM, SamplingParams
from minimemserve.config import EngineConfig
from minimemserve.disagg import rpc
from minimemserve.disagg.runtime import ProcessCluster
from minimemserve.request import Request, RequestMetrics, RequestOutput, TokenDelta

NUM_BLOCKS = 64
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prompt(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (37,), generator=g).tolist()


def forged_messages(victim_file: str) -> list[tuple[str, rpc.Msg]]:
    """(target, message) pairs a hostile process would send, each aimed at real harm."""
    handle = dict(
        kind="cpu_shm",
        name=os.path.basename(victim_file),
        shm_dir="/tmp",
        shape=[1],
        strides=[1],
        storage_offset=0,
        dtype="uint8",
        nbytes=4,
    )
    fake = rpc.PeerInfo("D0", "decode", "tcp://127.0.0.1:9", handle)
    metrics = RequestMetrics(0.0, prefill_instance="P0")
    state = rpc.RequestState("evil", [10**6], 1, PARAMS, [0], 1, 9, metrics)
    out = RequestOutput("r-victim", [1], [66, 66], "forged", "stop", RequestMetrics(0.0))
    return [
        ("P0", rpc.Peers([fake])),  # attach a "segment" at an arbitrary path, reroute hand-offs
        ("frontend", rpc.Ready(rpc.PeerInfo("D0", "decode", "tcp://127.0.0.1:9", handle), 1, 9, 9)),
        ("P0", rpc.Shutdown("forged")),
        ("D0", rpc.Accept(state)),  # an out-of-vocabulary token
        ("frontend", rpc.Output(out)),  # a spoofed result
        ("P0", rpc.PeerDown("D0", "forged")),  # poison routing
        ("D0", rpc.AllocRequest("hold-all", None, NUM_BLOCKS)),  # hold every free block
    ]


def _forge(addresses: dict[str, str], victim_file: str) -> None:
    """A separate process without the cluster's secret: send every forged message."""
    node = rpc.RpcNode("P0", lambda s, m: None, timeout_s=0.5, codec=rpc.Codec(os.urandom(32)))
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
    with ProcessCluster.of(
        tiny_llama_dir, "1P1D-CC", engine=EngineConfig(num_blocks=NUM_BLOCKS), timeout_s=5
    ) as c:
        yield c


def test_forged_messages_from_another_process_are_dropped(cluster, tiny_llama_dir, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    addresses = {n: i.info.address for n, i in cluster.instances.items()}
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
    node.connect("D0", cluster.instances["D0"].info.address)
    node.connect("P0", cluster.instances["P0"].info.address)
    bad = {
        "outside the vocabulary": ("D0", forged_messages("/nonexistent")[3][1]),
        "cannot be received": ("D0", rpc.AllocRequest("x", None, NUM_BLOCKS + 1)),
        "16 tokens cannot be received": ("D0", rpc.AllocRequest("y", [10**6] * 16, 1)),
        "not allocated for transfer": ("D0", rpc.Commit("never", None, [1, 2])),
        "takes no Shutdown": ("P0", rpc.Shutdown("not from the frontend")),
    }
    # a new request must carry no KV and no output: its blocks would be another's
    carried = Request("r-kv", prompt(5), PARAMS, 0.0)
    carried.blocks, carried.num_computed = [0], 4
    front = rpc.RpcNode("frontend", lambda s, m: None, timeout_s=5, codec=cluster.node.codec)
    front.connect("P0", cluster.instances["P0"].info.address)
    try:
        for match, (target, msg) in bad.items():
            with pytest.raises(rpc.RemoteError, match=match):
                node.call(target, msg)
        with pytest.raises(rpc.RemoteError, match="is not new: it carries KV or output"):
            front.call("P0", rpc.Submit(rpc.RequestState.of(carried)))
    finally:
        node.close()
        front.close()
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


class Tap:
    """A TCP relay in front of ``address`` that records what its one client sends: a capture
    of the wire, as a process sniffing loopback (or the network) would get it."""

    def __init__(self, address: str) -> None:
        self.target = ("127.0.0.1", int(address.rsplit(":", 1)[1]))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sent = bytearray()
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(self.target)
        self.socks += [client, server]
        threading.Thread(target=self._pump, args=(server, client, None), daemon=True).start()
        self._pump(client, server, self.sent)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, record: bytearray | None) -> None:
        while data := _recv(src):
            if record is not None:
                record += data
            dst.sendall(data)

    def close(self) -> bytes:
        for sock in [self.listener, *self.socks]:
            sock.close()
        return bytes(self.sent)


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def capture_alloc(target: str, codec: rpc.Codec, curve=None) -> tuple[bytes, rpc.AllocReply]:
    """P0 (a member) asks D0 for 4 blocks through a tap: what crossed the wire, and the reply."""
    tap = Tap(target)
    member = rpc.RpcNode("P0", lambda s, m: None, timeout_s=5, codec=codec, curve=curve)
    member.connect("D0", tap.address)
    try:
        reply = member.call("D0", rpc.AllocRequest("captured", None, 4))
        time.sleep(0.1)  # the tap has relayed every byte
        return tap.close(), reply
    finally:
        member.close()


GREETING = 64  # bytes of a ZMTP 3 greeting: a 10-byte signature, then the rest


def replay(wire: bytes, address: str, times: int) -> list[socket.socket]:
    """Send the captured bytes ``times`` over, each on a new connection (kept open), pacing
    the greeting as a ZMTP peer does: the server reads the rest only after its signature."""
    port = int(address.rsplit(":", 1)[1])
    socks = []
    for _ in range(times):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        got = 0
        for part in (wire[:10], wire[10:GREETING]):
            sock.sendall(part)
            got += len(sock.recv(GREETING - got if got else 10))
        while got < GREETING:
            got += len(sock.recv(GREETING - got))
        sock.sendall(wire[GREETING:])
        socks.append(sock)
    return socks


def release(cluster: ProcessCluster, reply: rpc.AllocReply, codec, curve=None) -> None:
    """The genuine transfer is called off, as P0 would: D0 releases its blocks."""
    member = rpc.RpcNode("P0", lambda s, m: None, timeout_s=5, codec=codec, curve=curve)
    member.connect("D0", cluster.instances["D0"].info.address.replace("0.0.0.0", "127.0.0.1"))
    member.call("D0", rpc.Abort("captured", reply.matched + reply.new))
    member.close()


def wait_for(what, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (got := what()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def test_a_captured_control_frame_replayed_is_dropped_and_counted(cluster):
    """A member's AllocRequest captured on loopback and replayed 200 times to D0 (and once to
    P0 and the frontend): D0 grants nothing more, every replay is counted, pools balance."""
    codec, d0 = cluster.node.codec, cluster.instances["D0"].info.address
    before = {n: s["replayed"] for n, s in cluster.stats().items()}
    wire, reply = capture_alloc(d0, codec)
    assert len(reply.new) == 4
    socks = replay(wire, d0, 200)
    socks += replay(wire, cluster.instances["P0"].info.address, 1)
    socks += replay(wire, cluster.node.address, 1)

    def counted() -> dict[str, int]:
        return {n: s["replayed"] - before[n] for n, s in cluster.stats().items()}

    assert wait_for(lambda: counted() == {"P0": 1, "D0": 200, "frontend": 1}), counted()
    for sock in socks:
        sock.close()
    stats = cluster.stats()
    assert stats["D0"]["grants"] == {"P0": 4} and not cluster.dead
    release(cluster, reply, codec)
    assert cluster.stats()["D0"]["grants"] == {"P0": 0}
    cluster.check_pools(require_idle=True)
    cluster.add_request(prompt(5), PARAMS)
    assert [o.finish_reason for o in cluster.run_until_done(timeout_s=60)] == ["length"]
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
    forged = rpc.Stream().envelope("req", 1, "frontend", "P0", rpc.Shutdown("x"))
    sock.send(rpc.Codec(os.urandom(32)).encode(forged))
    answered = bool(sock.poll(1500))
    sock.close()
    ctx.term()
    return answered


def test_off_loopback_a_peer_without_the_curve_key_gets_nothing(tiny_llama_dir):
    """Bound to every interface, the cluster encrypts its sockets with its CURVE key pair: a
    plain client and a CURVE client with the wrong key get no answer, a member's encrypted
    AllocRequest captured on the wire and replayed delivers nothing (each connection has its own
    session keys), no frame even reaches the handler (nothing counted), and the cluster keeps
    serving."""
    key = rpc.ClusterKey.generate()
    with ProcessCluster.of(
        tiny_llama_dir,
        "1P1D-CC",
        engine=EngineConfig(num_blocks=NUM_BLOCKS),
        cluster_host="0.0.0.0",
        timeout_s=10,
        key=key,
    ) as c:
        port = c.node.address.rsplit(":", 1)[1]
        targets = [f"tcp://127.0.0.1:{port}"]
        targets += [
            f"tcp://127.0.0.1:{i.info.address.rsplit(':', 1)[1]}" for i in c.instances.values()
        ]
        for address in targets:
            assert not _knock(address, None)
            assert not _knock(address, zmq.curve_keypair()[0])
        codec, d0 = rpc.Codec(key.secret), c.instances["D0"].info.address
        wire, reply = capture_alloc(d0, codec, key.curve)
        assert len(reply.new) == 4 and wire
        socks = replay(wire, d0, 20)
        time.sleep(1.0)
        for sock in socks:
            sock.close()
        assert c.stats()["D0"]["grants"] == {"P0": 4}
        release(c, reply, codec, key.curve)
        rid = c.add_request(prompt(2), PARAMS)
        outs = {o.request_id: o for o in c.run_until_done(timeout_s=60)}
        assert outs[rid].finish_reason == "length" and len(outs[rid].token_ids) == 8
        stats = c.stats()
        assert stats["frontend"]["rejected"] == 0 and not c.dead
        assert all(stats[n]["rejected"] == stats[n]["replayed"] == 0 for n in c.instances)
        c.check_pools()
