"""Control plane: typed messages over ZeroMQ + msgpack, across processes, timeouts, close."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from dataclasses import dataclass

import msgpack
import pytest

from minimemserve.disagg.control import (
    Abort,
    Ack,
    AllocReply,
    AllocRequest,
    Commit,
    ControlClient,
    ControlServer,
    Error,
    Heartbeat,
    MessageCodec,
    RemoteError,
    WriteDone,
)
from minimemserve.errors import TransferError

JOIN_S = 30
BLOCK_SIZE = 4


@dataclass
class Stop:
    """Test-only: ask the child server to exit."""

    reason: str


@dataclass
class Heard:
    """Test-only: which peers the child server has heard from."""

    peers: list[str]


CODEC_TYPES = (Stop, Heard)


class _Receiver:
    """A fake receiving instance: hands out block ids, remembers commits."""

    def __init__(self, server: ControlServer) -> None:
        self.server = server
        self.next_block = 100
        self.committed: dict[str, list[int]] = {}
        self.stop = False

    def __call__(self, msg: object) -> object:
        if isinstance(msg, AllocRequest):
            matched = list(range(len(msg.tokens or []) // BLOCK_SIZE))
            new = list(range(self.next_block, self.next_block + msg.num_blocks - len(matched)))
            self.next_block += len(new)
            return AllocReply(msg.req_id, matched, new)
        if isinstance(msg, Commit):
            self.committed[msg.req_id] = msg.blocks
            return None  # -> Ack
        if isinstance(msg, Abort):
            raise KeyError(f"no transfer {msg.req_id}")
        if isinstance(msg, Heard):
            return Heard(sorted(self.server.last_heard))
        if isinstance(msg, Stop):
            self.stop = True
            return Ack(msg.reason)
        return None


def _serve(queue: mp.Queue) -> None:
    """Child: bind a free port, report it, serve until told to stop."""
    with ControlServer(name="decode-0", codec=MessageCodec(CODEC_TYPES)) as server:
        queue.put(server.port)
        receiver = _Receiver(server)
        server.serve(receiver, lambda: receiver.stop)


def _start_server() -> tuple[mp.Process, int]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_serve, args=(queue,))
    child.start()
    return child, queue.get(timeout=JOIN_S)


def test_every_message_round_trips_through_plain_msgpack() -> None:
    codec = MessageCodec(CODEC_TYPES)
    messages = [
        AllocRequest("r1", [1, 2, 3], 4),
        AllocRequest("r2", None, 0),
        AllocReply("r1", [0], [7, 8]),
        WriteDone("r1", [7, 8]),
        Commit("r1", None, [0, 7, 8]),
        Abort("r1", [7]),
        Ack("r1"),
        Heartbeat("prefill-0", 12.5),
        Error("r1", "PoolExhausted", "no blocks"),
        Stop("done"),
    ]
    for msg in messages:
        payload = codec.encode({"kind": "push", "seq": 3}, msg)
        raw = msgpack.unpackb(payload, raw=False)  # plain maps, no pickle inside
        assert raw["msg"]["type"] == type(msg).__name__
        env, back = codec.decode(payload)
        assert back == msg and env["seq"] == 3


def test_malformed_messages_raise_clear_errors() -> None:
    codec = MessageCodec()
    with pytest.raises(TransferError, match="unknown control message type 'Nope'"):
        codec.from_dict({"type": "Nope"})
    with pytest.raises(TransferError, match="malformed AllocRequest"):
        codec.from_dict({"type": "AllocRequest", "req_id": "r"})
    with pytest.raises(TransferError, match="num_blocks"):
        codec.from_dict({"type": "AllocRequest", "req_id": "r", "tokens": None, "num_blocks": -1})
    with pytest.raises(TransferError, match="blocks must be a list"):
        codec.from_dict({"type": "WriteDone", "req_id": "r", "blocks": ["x"]})
    with pytest.raises(TransferError, match="undecodable|without a message"):
        codec.decode(b"\xc1garbage")
    with pytest.raises(TypeError, match="not a registered"):
        codec.encode({}, Stop("x"))
    with pytest.raises(ValueError, match="tokens"):
        AllocRequest("r", [1, -2], 1)


def test_requests_round_trip_across_processes() -> None:
    child, port = _start_server()
    try:
        with ControlClient(
            f"tcp://127.0.0.1:{port}",
            name="prefill-0",
            peer="decode-0",
            codec=MessageCodec(CODEC_TYPES),
        ) as client:
            reply = client.request(AllocRequest("r1", list(range(9)), 5))
            assert reply == AllocReply("r1", [0, 1], [100, 101, 102])
            reply = client.request(AllocRequest("r2", None, 2))
            assert reply == AllocReply("r2", [], [103, 104])
            assert client.request(Commit("r1", list(range(9)), [0, 1, 100])) == Ack()
            with pytest.raises(RemoteError, match="peer decode-0 failed Abort: KeyError") as e:
                client.request(Abort("r9", [5]))
            assert isinstance(e.value, TransferError) and e.value.kind == "KeyError"
            client.push(Heartbeat("prefill-0", time.time()))
            assert client.request(Heard([])) == Heard(["prefill-0"])
            assert client.request(Stop("bye")) == Ack("bye")
    finally:
        child.join(JOIN_S)
    assert child.exitcode == 0


def test_dead_peer_times_out_quickly_with_a_named_error() -> None:
    child, port = _start_server()
    try:
        with ControlClient(f"tcp://127.0.0.1:{port}", peer="decode-0", timeout_s=0.3) as client:
            assert client.request(AllocRequest("r1", None, 1)).new == [100]
            child.kill()
            child.join(JOIN_S)
            start = time.monotonic()
            with pytest.raises(TransferError, match="peer decode-0 did not answer AllocRequest"):
                client.request(AllocRequest("r2", None, 1))
            assert time.monotonic() - start < 1.5
            with pytest.raises(TransferError, match="did not answer Commit within 0.1 s"):
                client.request(Commit("r2", None, [1]), timeout_s=0.1)
    finally:
        if child.is_alive():
            child.kill()


def test_late_reply_is_dropped_and_the_next_request_gets_its_own() -> None:
    with ControlServer(name="d") as server, ControlClient(server.address, peer="d") as client:
        receiver = _Receiver(server)
        with pytest.raises(TransferError, match="did not answer"):
            client.request(AllocRequest("late", None, 1), timeout_s=0.05)
        assert server.serve_once(receiver, timeout_s=1.0)  # answers the timed-out request now
        stop = threading.Event()
        thread = threading.Thread(target=server.serve, args=(receiver, stop.is_set, 0.01))
        thread.start()
        try:
            reply = client.request(AllocRequest("fresh", None, 1))
        finally:
            stop.set()
            thread.join(JOIN_S)
        assert reply.req_id == "fresh" and reply.new == [101]


def test_close_is_quick_and_final() -> None:
    client = ControlClient("tcp://127.0.0.1:9", peer="nobody", timeout_s=0.05)
    for _ in range(100):
        client.push(Heartbeat("p", 0.0))  # queued towards a port nobody listens on
    start = time.monotonic()
    client.close()
    client.close()
    assert time.monotonic() - start < 1.0
    with pytest.raises(TransferError, match="closed"):
        client.request(Ack())
    server = ControlServer(port=0)
    assert server.port > 0 and server.address.startswith("tcp://127.0.0.1:")
    server.close()
    server.close()
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        ControlClient("tcp://127.0.0.1:9", timeout_s=0)
