"""Control plane: typed msgspec messages over ZeroMQ, validation, processes, timeouts, close."""

from __future__ import annotations

import contextlib
import hmac
import multiprocessing as mp
import secrets
import threading
import time

import msgpack
import msgspec
import pytest
import zmq

from minimemserve.config import EngineConfig
from minimemserve.disagg import rpc
from minimemserve.disagg.rpc import (
    Abort,
    Ack,
    AllocReply,
    AllocRequest,
    Commit,
    Error,
    FreeMem,
    Heartbeat,
    Info,
    Probe,
    ProbeReply,
    RemoteError,
    RpcNode,
    Shutdown,
)
from minimemserve.errors import InstanceDied, TransferError
from minimemserve.request import Request
from minimemserve.sampling import SamplingParams

JOIN_S = 30
BLOCK_SIZE = 4
SECRET = b"a test secret of 32 bytes, fixed"
CODEC = rpc.Codec(SECRET)


def node(name: str, handler, **kw) -> RpcNode:
    return RpcNode(name, handler, codec=CODEC, **kw)


class _Bogus(rpc.Msg):
    """A message type the receiving node does not know."""

    n: int


class _Receiver:
    """A fake receiving instance: hands out block ids, remembers who it heard from."""

    def __init__(self) -> None:
        self.next_block = 100
        self.heard: list[str] = []
        self.stop = False

    def __call__(self, sender: str, msg: rpc.Msg) -> rpc.Msg | None:
        self.heard.append(sender)
        if isinstance(msg, AllocRequest):
            matched = list(range(len(msg.tokens or []) // BLOCK_SIZE))
            new = list(range(self.next_block, self.next_block + msg.num_blocks - len(matched)))
            self.next_block += len(new)
            return AllocReply(matched, new)
        if isinstance(msg, Abort):
            raise KeyError(f"no transfer {msg.xfer}")
        if isinstance(msg, Probe):
            return Info({"heard": sorted(set(self.heard))})
        if isinstance(msg, Shutdown):
            self.stop = True
        return None


def _serve(queue: mp.Queue) -> None:
    """Child: bind a free port, report it, serve until told to stop."""
    receiver = _Receiver()
    node = RpcNode("decode-0", receiver, codec=rpc.Codec(SECRET))
    queue.put(node.address)
    while not receiver.stop:
        node.serve(0.05)
    node.close()


def _start_child() -> tuple[mp.Process, RpcNode]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_serve, args=(queue,))
    child.start()
    node = RpcNode("prefill-0", lambda s, m: None, timeout_s=5, codec=CODEC)
    node.connect("decode-0", queue.get(timeout=JOIN_S))
    return child, node


def test_every_message_round_trips_as_plain_msgpack() -> None:
    messages = [
        AllocRequest("x1", [1, 2, 3], 4),
        AllocRequest("x2", None, 0),
        AllocReply([0], [7, 8]),
        Commit("x1", None, [0, 7, 8]),
        Abort("x1", [7]),
        rpc.Submit(
            rpc.RequestState.of(
                Request("r1", [5, 6], SamplingParams(max_tokens=3, stop_token_ids=(2,)), 1.5)
            )
        ),
        Ack(),
        Heartbeat(),
        Error("PoolExhausted", "no blocks"),
        rpc.Join("s0", "P0", "1P1D", "tcp://h:1", EngineConfig(num_blocks=8), 1.0, 0.5, 2.0, True),
    ]
    for msg in messages:
        payload = CODEC.encode(rpc.Stream().envelope("push", 3, "P0", "D0", msg))
        tag, body = payload[: rpc.TAG_BYTES], payload[rpc.TAG_BYTES :]
        assert tag == hmac.digest(SECRET, body, "sha256")
        raw = msgpack.unpackb(body, raw=False)  # plain maps, no pickle inside
        assert raw["msg"]["type"] == type(msg).__name__
        env = CODEC.decode(payload)
        assert env.msg == msg and env.seq == 3 and (env.sender, env.to) == ("P0", "D0")


@pytest.mark.parametrize(
    ("msg", "match"),
    [
        ({"type": "Nope"}, "Invalid value 'Nope'"),
        ({"type": "AllocRequest", "xfer": "x"}, "missing required field"),
        ({"type": "AllocRequest", "xfer": "x", "tokens": None, "num_blocks": -1}, ">= 0"),
        ({"type": "FreeMem", "blocks": ["x"]}, "Expected `int`"),
        ({"type": "FreeMem", "blocks": [1], "extra": 2}, "unknown field"),
        (
            {
                "type": "Submit",
                "state": {
                    "request_id": "r",
                    "tokens": [1],
                    "num_prompt": 1,
                    "params": {"max_tokens": 0},
                    "blocks": [],
                    "num_computed": 0,
                    "max_total_tokens": 0,
                    "metrics": {"arrival_time": 0.0},
                },
            },
            "max_tokens",
        ),
        (
            {
                "type": "Join",
                "session": "s0",
                "name": "P0",
                "config": "1P1D",
                "frontend": "tcp://h:1",
                "engine": {"block_size": 3},
                "timeout_s": 1.0,
                "heartbeat_s": 0.5,
                "frontend_timeout_s": 2.0,
                "linked": True,
            },
            r"block_size must be a positive power of two.*\$\.msg\.engine",
        ),
    ],
)
def test_malformed_messages_raise_clear_errors(msg, match) -> None:
    env = {"kind": "req", "seq": 1, "sender": "x", "to": "y", "stream": 1, "count": 1, "sent": 0.0}
    payload = msgpack.packb(env | {"msg": msg})
    payload = hmac.digest(SECRET, payload, "sha256") + payload  # authentic, but invalid
    with pytest.raises(TransferError, match=match):
        CODEC.decode(payload)


def test_garbage_and_frames_signed_with_another_key_are_unauthenticated() -> None:
    forged = rpc.Stream().envelope("req", 1, "frontend", "P0", Shutdown("forged"))
    for frame in (b"\xc1garbage", rpc.Codec(b"another secret, 32 bytes as well").encode(forged)):
        with pytest.raises(rpc.Unauthenticated):
            CODEC.decode(frame)


def test_forged_and_invalid_frames_are_dropped_or_refused_and_the_node_keeps_serving() -> None:
    receiver = _Receiver()
    server = node("d", receiver)
    forger = RpcNode(
        "frontend",
        lambda s, m: None,
        timeout_s=0.3,
        codec=rpc.Codec(b"not the cluster's secret, 32 b.."),
    )
    client = node("c", lambda s, m: None, timeout_s=5)
    forger.connect("d", server.address)
    client.connect("d", server.address)
    stop = threading.Event()
    thread = threading.Thread(target=lambda: [server.serve(0.01) for _ in iter(stop.is_set, True)])
    thread.start()
    try:
        with pytest.raises(TransferError, match="did not answer Shutdown"):  # dropped, no answer
            forger.call("d", Shutdown("forged"))
        assert not receiver.stop and server.rejected == 1 and receiver.heard == []
        bad = rpc.Codec(SECRET, extra=(_Bogus,))  # a member sending a type the node lacks
        client.codec = bad
        with pytest.raises(RemoteError, match="TransferError: malformed"):  # answered at once
            client.call("d", _Bogus(1))
        client.codec = CODEC
        assert client.call("d", AllocRequest("x", None, 1)) == AllocReply([], [100])
    finally:
        stop.set()
        thread.join(JOIN_S)
        for n in (server, forger, client):
            n.close()


def test_requests_round_trip_across_processes() -> None:
    child, node = _start_child()
    try:
        assert node.call("decode-0", AllocRequest("x1", list(range(9)), 5)) == AllocReply(
            [0, 1], [100, 101, 102]
        )
        assert node.call("decode-0", AllocRequest("x2", None, 2)) == AllocReply([], [103, 104])
        assert node.call("decode-0", Commit("x1", list(range(9)), [0, 1, 100])) == Ack()
        with pytest.raises(RemoteError, match="peer decode-0 failed Abort: KeyError") as e:
            node.call("decode-0", Abort("x9", [5]))
        assert isinstance(e.value, TransferError) and e.value.kind == "KeyError"
        node.push("decode-0", Heartbeat())
        assert node.call("decode-0", Probe([])) == Info({"heard": ["prefill-0"]})
        assert node.call("decode-0", Shutdown("bye")) == Ack()
    finally:
        child.join(JOIN_S)
        node.close()
    assert child.exitcode == 0


def test_dead_peer_fails_with_a_named_error() -> None:
    child, node = _start_child()
    try:
        assert node.call("decode-0", AllocRequest("x1", None, 1)).new == [100]
        child.kill()
        child.join(JOIN_S)
        with pytest.raises(TransferError, match="decode-0 did not answer AllocRequest within 0.3"):
            node.call("decode-0", AllocRequest("x2", None, 1), timeout_s=0.3)
        node.dead["decode-0"] = "killed in a test"
        with pytest.raises(InstanceDied, match="killed in a test"):  # no wait at all
            node.call("decode-0", Probe([1, 2]), timeout_s=1e9)
    finally:
        node.close()


def test_late_reply_is_dropped_and_the_next_request_gets_its_own() -> None:
    receiver = _Receiver()
    server = node("d", receiver)
    client = node("c", lambda s, m: None)
    client.connect("d", server.address)
    try:
        with pytest.raises(TransferError, match="did not answer"):
            client.call("d", AllocRequest("late", None, 1), timeout_s=0.05)
        assert server.serve(timeout_s=5.0) == 1  # answers the timed-out request now
        stop = threading.Event()

        def serve() -> None:
            while not stop.is_set():
                server.serve(0.01)

        thread = threading.Thread(target=serve)
        thread.start()
        try:
            reply = client.call("d", AllocRequest("fresh", None, 1))
        finally:
            stop.set()
            thread.join(JOIN_S)
        assert reply.new == [101]  # not the late [100]
    finally:
        client.close()
        server.close()


def test_close_is_final_and_idempotent() -> None:
    p = node("p", lambda s, m: None, timeout_s=0.05)
    p.connect("nobody", "tcp://127.0.0.1:9")
    for _ in range(100):
        p.push("nobody", Heartbeat())  # queued towards a port nobody listens on
    assert p.address.startswith("tcp://127.0.0.1:")
    p.close()
    p.close()
    with pytest.raises(TransferError, match="no connection"):
        p.push("nobody", Ack())
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        node("q", lambda s, m: None, timeout_s=0)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        rpc.Codec(b"short")


def test_calls_in_both_directions_at_once_do_not_deadlock():
    """A waits on B while B waits on A: each keeps serving while it waits."""
    seen: dict[str, list[str]] = {"A": [], "B": []}

    def handler(me):
        def handle(sender, msg):
            seen[me].append(sender)
            return ProbeReply(len(getattr(msg, "tokens", [])), 0)

        return handle

    a, b = node("A", handler("A"), timeout_s=5), node("B", handler("B"), timeout_s=5)
    a.connect("B", b.address)
    b.connect("A", a.address)
    results: dict[str, object] = {}
    start = threading.Barrier(2)
    done = threading.Barrier(2)

    def call(node, peer, n):
        start.wait(5)  # both calls go out together
        results[node.name] = node.call(peer, Probe(list(range(n))))
        while done.n_waiting == 0 and len(results) < 2:
            node.serve(0.02)  # keep serving until the other call has its answer too
        node.serve(0.02)
        done.wait(5)

    try:
        threads = [
            threading.Thread(target=call, args=(a, "B", 3)),
            threading.Thread(target=call, args=(b, "A", 5)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert results["A"] == ProbeReply(3, 0) and results["B"] == ProbeReply(5, 0)
        assert seen == {"A": ["B"], "B": ["A"]}
        a.push("B", FreeMem([]))  # a push is handled without a reply
        while len(seen["B"]) < 2 and b.serve(5.0):
            pass
        assert seen["B"] == ["A", "A"]
    finally:
        a.close()
        b.close()


@contextlib.contextmanager
def _a_waits_on_b(a_handler, from_c):
    """Nodes A (deferring Query), B (slow to answer) and C; ``from_c(c)`` runs in a thread
    once A is waiting on B. Yields A; B serves and C's thread runs until the block ends."""
    a = node("A", a_handler, timeout_s=5)
    b = node("B", lambda s, m: time.sleep(0.5) or ProbeReply(0, 0))  # A waits on it
    c = node("C", lambda s, m: None)
    a.deferred = frozenset({rpc.Query})
    a.connect("B", b.address)
    c.connect("A", a.address)
    stop = threading.Event()

    def serve_b():
        while not stop.is_set():
            b.serve(0.02)

    def run_c():
        time.sleep(0.1)  # A is waiting on B by now
        from_c(c)

    threads = [threading.Thread(target=serve_b), threading.Thread(target=run_c)]
    try:
        for t in threads:
            t.start()
        yield a
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        for n in (a, b, c):
            n.close()


def test_deferred_messages_wait_for_the_end_of_a_call_and_are_answered_then():
    """A waits on B; C's Query (deferred by A) is queued and handled after the call, by
    A's next serve, while C's Probe (not deferred) is handled during the wait."""
    handled: list[tuple[str, int]] = []
    answers = []

    def a_handler(sender, msg):
        handled.append((type(msg).__name__, a._calls))
        return Info({"calls": a._calls}) if isinstance(msg, rpc.Query) else None

    def from_c(c):
        c.push("A", Probe([]))
        answers.append(c.call("A", rpc.Query("stats"), timeout_s=5))

    with _a_waits_on_b(a_handler, from_c) as a:
        assert a.call("B", Probe([])) == ProbeReply(0, 0)
        assert handled == [("Probe", 1)]  # the Query waited
        deadline = time.monotonic() + 5
        while not answers and time.monotonic() < deadline:
            a.serve(0.02)
        assert handled == [("Probe", 1), ("Query", 0)]
        assert answers == [Info({"calls": 0})]


def test_deferred_messages_beyond_the_cap_are_refused(monkeypatch):
    """While a node waits, a deferred request that would exceed its queue gets an error."""
    monkeypatch.setattr(rpc.node, "MAX_DEFERRED", 0)
    errors = []

    def from_c(c):
        with pytest.raises(RemoteError, match="deferred messages already") as e:
            c.call("A", rpc.Query("stats"), timeout_s=5)
        errors.append(e.value)

    with _a_waits_on_b(lambda s, m: None, from_c) as a:
        assert a.call("B", Probe([])) == ProbeReply(0, 0)
        deadline = time.monotonic() + 5
        while not errors and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(errors) == 1 and a.rejected == 1 and not a._queued


def test_an_oversized_frame_is_dropped_and_the_node_keeps_serving(monkeypatch) -> None:
    monkeypatch.setattr(rpc.node, "MAX_MESSAGE_BYTES", 4096)  # read when the node is made
    receiver = _Receiver()
    server = node("d", receiver)
    big, small = (node(n, lambda s, m: None, timeout_s=0.5) for n in ("big", "small"))
    for n in (big, small):
        n.connect("d", server.address)
    stop = threading.Event()
    thread = threading.Thread(target=lambda: [server.serve(0.01) for _ in iter(stop.is_set, True)])
    thread.start()
    try:
        with pytest.raises(TransferError, match="did not answer"):
            big.call("d", Probe(list(range(2000))))  # ~4 KB of msgpack plus the tag
        assert receiver.heard == []
        assert small.call("d", AllocRequest("x", None, 1)) == AllocReply([], [100])
    finally:
        stop.set()
        thread.join(JOIN_S)
        for n in (server, big, small):
            n.close()


def test_replayed_stale_and_misaddressed_frames_are_dropped_and_counted() -> None:
    """Each frame of a stream is taken once; a stream's first frame must be fresh, counted
    back from the receiver's last read (an idle receiver blames no frame for waiting)."""
    receiver = _Receiver()
    server = node("d", receiver)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.address)
    stream, now = rpc.Stream(), time.time()

    def frame(to: str, sent: float | None = None) -> bytes:
        env = stream.envelope("push", 0, "c", to, AllocRequest("x", None, 1))
        if sent is not None:  # the first frame of a stream sent at ``sent``
            env = msgspec.structs.replace(env, stream=secrets.randbits(63), sent=sent)
        return CODEC.encode(env)

    try:
        server.drained_at -= 2 * rpc.FRESH_S  # it last read its socket a minute ago
        first = frame("d", sent=now - 1.5 * rpc.FRESH_S)  # sent while it was not reading
        stale = frame("d", sent=now - 5 * rpc.FRESH_S)
        sent = [first, first, frame("d"), frame("elsewhere"), stale]
        for f in sent:
            raw.send(f)
        got = 0
        while got < len(sent) and server.serve(5.0):
            got = server.replayed + len(receiver.heard)
        assert receiver.heard == ["c", "c"] and server.replayed == 3
        raw.send(first)  # later, to a node that reads: still taken only once
        server.serve(1.0)
        assert receiver.heard == ["c", "c"] and server.replayed == 4 and server.rejected == 0
    finally:
        raw.close()
        ctx.term()
        server.close()


def test_a_handed_off_request_round_trips_through_its_wire_state() -> None:
    """``RequestState.of`` and ``RequestState.request`` invert each other over the wire: every
    attribute the state names comes back, the arrival and the prefill instance inside the
    metrics."""
    req = Request("r1", [5, 6, 7, 8], SamplingParams(max_tokens=4, logprobs=2), 12.5)
    req.tokens.append(9)
    req.blocks, req.num_computed, req.max_total_tokens = [3], 4, 8
    req.prefill_instance = "P0"
    req.logprobs = [(-0.5, [(9, -0.5), (4, -1.0)])]
    wire = msgspec.msgpack.encode(rpc.RequestState.of(req))
    back = msgspec.msgpack.decode(wire, type=rpc.RequestState).request()
    for f in rpc.RequestState.__struct_fields__:
        assert getattr(back, f) == getattr(req, f), f
    assert (back.arrival_time, back.prefill_instance, back.prefilled) == (12.5, "P0", True)
    assert back.prompt_token_ids == [5, 6, 7, 8] and back.output_token_ids == [9]


def test_every_pool_a_transfer_writes_into_speaks_one_protocol() -> None:
    """A local MemPool, the simulator's pool and a peer's proxy are each a ``KVReceiver``, the
    one contract a sending pool writes against (recipes type their peers' pools with it)."""
    from minimemserve.blocks.layout import KVLayout
    from minimemserve.disagg.peering import RemotePool
    from minimemserve.mempool import KVReceiver, MemPool
    from minimemserve.sim.cluster import SimPool

    layout = KVLayout(num_layers=2, block_size=BLOCK_SIZE, num_kv_heads=1, head_dim=4)
    local = MemPool(layout, 4)
    sim = SimPool(layout, 4, on_send=lambda *a: None)
    info = rpc.PeerInfo("D0", "decode", "tcp://127.0.0.1:1", None)
    remote = RemotePool(node("P0", lambda s, m: None), info, None, local)
    try:
        for pool in (local, sim, remote):
            assert isinstance(pool, KVReceiver), type(pool).__name__
        assert remote.pool is remote and remote.model_layout == local.model_layout
    finally:
        remote.node.close()


def test_a_request_sent_without_waiting_is_answered_at_a_later_serve() -> None:
    """``send`` returns at once; the reply (or the error) goes to its callback at the next
    ``serve`` outside a call, also when a ``call`` read it first; what a peer declared dead
    never answered is given up with ``InstanceDied``; every frame counts as hearing from its
    sender."""
    receiver = _Receiver()
    server = node("d", receiver)
    client = node("c", lambda s, m: None)
    client.connect("d", server.address)
    got: list[tuple[str, rpc.Msg]] = []
    try:
        client.send("d", AllocRequest("a", None, 2), lambda m: got.append(("a", m)))
        client.send("d", Abort("b", []), lambda m: got.append(("b", m)))
        assert got == [] and "d" not in client.heard
        deadline = time.monotonic() + JOIN_S
        while server.serve(0.01) < 2 and time.monotonic() < deadline:
            pass
        while len(got) < 2 and time.monotonic() < deadline:
            client.serve(0.01)
        assert got[0] == ("a", AllocReply([], [100, 101]))
        assert got[1][0] == "b" and got[1][1].kind == "KeyError"
        assert "d" in client.heard and "c" in server.heard

        client.send("d", AllocRequest("c", None, 1), lambda m: got.append(("c", m)))
        thread = threading.Thread(target=lambda: [server.serve(0.2) for _ in range(10)])
        thread.start()
        assert client.call("d", Probe([1])).data == {"heard": ["c"]}  # read the reply to "c"
        thread.join(JOIN_S)
        assert len(got) == 2  # handed over at the next serve, not inside the call
        client.serve()
        assert got[2] == ("c", AllocReply([], [102]))

        client.send("d", AllocRequest("d", None, 1), lambda m: got.append(("d", m)))
        client.dead["d"] = "declared dead in a test"
        client.serve()  # gives it up (the server never read it)
        client.serve()
        assert got[3][0] == "d" and got[3][1].kind == "InstanceDied"
    finally:
        client.close()
        server.close()
