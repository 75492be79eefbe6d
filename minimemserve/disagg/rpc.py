"""The control plane: typed messages and the RPC node every process of the runtime uses.

An :class:`RpcNode` is one process's end: a ROUTER socket that peers send to, and a DEALER
socket per peer it sends to. Messages are ``msgspec`` structs, tagged by class name and
validated field by field (types, ranges) when decoded, inside an :class:`Envelope`; nothing
is pickled. Every frame carries an HMAC of the cluster's secret (made by the frontend and
handed to the instances it spawns, never on a command line or in a file): a frame without
it is dropped unanswered, whoever sent it, loopback included. A request carries a sequence
number, so a late reply to a request that timed out is recognised and dropped. While a node
waits for the answer to its own request it keeps answering requests that reach it: P and D
call each other (D sends decode-phase KV back while P is sending to it), and a node that
only waited would deadlock.

Transfer protocol (receiving side of ``MemPool.transfer``): :class:`AllocRequest` →
:class:`AllocReply` (``recv_alloc``), the sender writes into the shared pool tensor,
:class:`Commit` (``recv_commit``) or :class:`Abort` (``recv_abort``).
"""

from __future__ import annotations

import hmac
import itertools
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal, Union

import msgspec
import zmq

from ..errors import InstanceDied, RemoteError, TransferError
from ..request import RequestMetrics, RequestOutput
from ..sampling import SamplingParams

LOOPBACK = "127.0.0.1"
# A loopback round trip takes well under a millisecond; a peer that leaves a request
# unanswered this long is dead or stuck.
DEFAULT_TIMEOUT_S = 30.0
# Longest single poll while waiting for a reply, so heartbeats and dead-peer news are seen.
WAIT_SLICE_S = 0.05
# Messages queued towards one peer before sends fail fast instead of growing memory.
SEND_HWM = 10_000
# Largest control message accepted: a 1M-token prompt is ~9 MB of msgpack.
MAX_MESSAGE_BYTES = 32 << 20
TAG_BYTES = 32  # HMAC-SHA256 of the payload, sent in front of it

Count = Annotated[int, msgspec.Meta(ge=0)]
Ids = list[Count]


class Msg(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Base of every control message (tagged by class name on the wire)."""


# ---- the transfer protocol ----------------------------------------------------------------


class AllocRequest(Msg):
    """Ask the receiver for ``num_blocks`` blocks; with ``tokens`` it first matches its cache."""

    xfer: str
    tokens: Ids | None
    num_blocks: Count


class AllocReply(Msg):
    """Blocks the receiver already holds for the prefix (``matched``) and fresh ones (``new``)."""

    matched: Ids
    new: Ids


class Commit(Msg):
    """The receiver keeps ``blocks`` for transfer ``xfer`` (inserting ``tokens`` when given)."""

    xfer: str
    tokens: Ids | None
    blocks: Ids


class Abort(Msg):
    """Transfer ``xfer`` is off: the receiver releases what it took for it."""

    xfer: str
    blocks: Ids


class FreeMem(Msg):
    """Drop one of the sender's references on each of ``blocks`` (receiver's ids)."""

    blocks: Ids


class Probe(Msg):
    """How much of ``tokens`` is cached on the receiver, how loaded it is, and whether it
    has room for a request that may grow to ``blocks`` blocks."""

    tokens: Ids
    blocks: Count = 0


class ProbeReply(Msg):
    """Cached prefix length in tokens, requests queued or running, room for the request."""

    cached: Count
    load: Count
    room: bool = True


# ---- the runtime's messages ---------------------------------------------------------------


class PeerInfo(msgspec.Struct, forbid_unknown_fields=True):
    """An instance as its peers learn it: where it listens and how to map its pool."""

    name: str
    role: str
    address: str
    handle: dict[str, Any] | None


class Ready(Msg):
    """An instance is up (sent to the frontend)."""

    info: PeerInfo
    pid: Count


class Peers(Msg):
    """The instances of the deployment, for each to connect to the others."""

    peers: list[PeerInfo]


class Submit(Msg):
    """A new request for the receiving instance."""

    request_id: str
    prompt: Ids
    params: SamplingParams
    arrival_time: float


class RequestState(msgspec.Struct, forbid_unknown_fields=True):
    """Everything a receiving instance needs to continue a request (its KV already moved)."""

    request_id: str
    tokens: Ids
    num_prompt: Count
    params: SamplingParams
    arrival_time: float
    blocks: Ids
    num_computed: Count
    max_total_tokens: Count
    prefill_instance: str
    metrics: RequestMetrics


class Accept(Msg):
    """Take over a request whose KV was just moved to the receiver."""

    state: RequestState


class Output(Msg):
    """A finished request, pushed to the frontend."""

    output: RequestOutput


class Handoff(Msg):
    """The prefill instance passed ``request_id`` to decode instance ``to``."""

    request_id: str
    to: str


class AbortRequest(Msg):
    """Stop ``request_id`` if the receiver holds it; the reply is its ``Output`` or ``Ack``."""

    request_id: str


class Query(Msg):
    """Ask for ``what``; ``validate`` checks ``prompt`` with ``params`` against the instance."""

    what: Literal["stats", "check", "validate"]
    prompt: Ids = []
    params: SamplingParams | None = None


class Info(Msg):
    """Answer to :class:`Query` and :class:`PeerDown`."""

    data: dict[str, Any]


class PeerDown(Msg):
    """Instance ``name`` died: release what was held for it and stop sending to it."""

    name: str
    reason: str


class PushPrefix(Msg):
    """Send the cached prefix of ``tokens`` to instance ``to`` (indexed there); the reply is
    ``Info({"tokens": n})``, the tokens now cached on ``to`` thanks to it."""

    tokens: Ids
    to: str


class Shutdown(Msg):
    """Stop the instance process cleanly."""

    reason: str = ""


class Heartbeat(Msg):
    """Liveness ping, pushed periodically."""


class Ack(Msg):
    """A plain success reply."""


class Error(Msg):
    """A failed request: ``kind`` is the remote exception's class name."""

    kind: str
    message: str


MESSAGES = (
    AllocRequest, AllocReply, Commit, Abort, FreeMem, Probe, ProbeReply, Ready, Peers, Submit,
    Accept, Output, Handoff, AbortRequest, Query, Info, PeerDown, PushPrefix, Shutdown,
    Heartbeat, Ack, Error,
)  # fmt: skip


class Envelope(msgspec.Struct, forbid_unknown_fields=True):
    """What travels: the kind of frame, its sequence number, the sender and the message."""

    kind: Literal["req", "rep", "push"]
    seq: int
    sender: str
    msg: Msg


class Unauthenticated(TransferError):
    """A frame without a valid authentication tag: dropped unanswered."""


class Codec:
    """Packs envelopes behind an HMAC-SHA256 tag of the cluster's secret; checks the tag,
    then decodes and validates against a fixed set of message types (the runtime's
    ``MESSAGES`` plus any ``extra`` a tool adds, such as a benchmark's)."""

    def __init__(self, secret: bytes, extra: tuple[type[Msg], ...] = ()) -> None:
        """Sign with ``secret`` (at least 16 bytes, shared by every process of a cluster)."""
        if not isinstance(secret, bytes) or len(secret) < 16:
            raise ValueError("the control-plane secret must be at least 16 bytes")
        self._secret = secret
        msg_type = Union[MESSAGES + tuple(extra)]  # noqa: UP007 - a runtime union of classes
        env = msgspec.defstruct("Envelope", [("kind", Literal["req", "rep", "push"]),
                                             ("seq", int), ("sender", str), ("msg", msg_type)],
                                forbid_unknown_fields=True)  # fmt: skip
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(env).decode

    def encode(self, env: Envelope) -> bytes:
        """Tag and pack a frame (msgpack maps; message structs tagged by class name)."""
        payload = self._encode(env)
        return hmac.digest(self._secret, payload, "sha256") + payload

    def decode(self, frame: bytes) -> Envelope:
        """Check the tag, unpack and validate; raises ``Unauthenticated``, or
        ``TransferError`` naming what is wrong with an authentic frame."""
        tag, payload = frame[:TAG_BYTES], frame[TAG_BYTES:]
        if not hmac.compare_digest(tag, hmac.digest(self._secret, payload, "sha256")):
            raise Unauthenticated("control frame without a valid authentication tag")
        try:
            return self._decode(payload)
        except (msgspec.DecodeError, ValueError) as e:
            raise TransferError(f"malformed control message: {e}") from None

    @staticmethod
    def seq_of(frame: bytes) -> int:
        """The sequence number of an authentic frame that failed validation (-1 if none)."""
        try:
            seq = msgspec.msgpack.decode(frame[TAG_BYTES:]).get("seq", -1)
        except (msgspec.DecodeError, AttributeError):
            return -1
        return seq if type(seq) is int else -1


def endpoint(host: str = LOOPBACK, port: int = 0) -> str:
    """A ``tcp://`` endpoint; port 0 means any free port (when binding)."""
    if not 0 <= port < 65536:
        raise ValueError(f"port must be in [0, 65536), got {port}")
    return f"tcp://{host}:{port if port else '*'}"


Handler = Callable[[str, Msg], "Msg | None"]


class RpcNode:
    """One process's end of the control plane.

    ``handler(sender, msg) -> reply | None`` answers every request and push that arrives
    (``None`` replies :class:`Ack`; an exception replies :class:`Error`, which the caller
    raises as ``RemoteError``). Handlers must not call :meth:`call` themselves. While
    :meth:`call` waits for its reply it keeps serving incoming messages and runs
    ``on_wait`` (heartbeats); a peer in :attr:`dead` fails at once with ``InstanceDied``.
    Not thread-safe: one owner.
    """

    def __init__(
        self,
        name: str,
        handler: Handler,
        *,
        host: str = LOOPBACK,
        port: int = 0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        on_wait: Callable[[], None] | None = None,
        codec: Codec,
    ) -> None:
        """Bind ``host:port`` (port 0 picks a free one; see :attr:`address`); ``codec`` holds
        the cluster's secret."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.name = name
        self.handler = handler
        self.timeout_s = timeout_s
        self.on_wait = on_wait
        self.codec = codec
        self.rejected = 0  # frames dropped: unauthenticated, or failed validation
        self.dead: dict[str, str] = {}  # peer name -> why it is considered dead
        self._ctx = zmq.Context()
        self._server = self._socket(zmq.ROUTER)
        self._server.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._server.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        try:
            self._server.bind(endpoint(host, port))
        except zmq.ZMQError as e:
            self.close()
            raise TransferError(f"{name} cannot bind {host}:{port}: {e}") from e
        self.address: str = self._server.getsockopt_string(zmq.LAST_ENDPOINT)
        self._peers: dict[str, zmq.Socket] = {}
        self._seq = itertools.count(1)

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        return sock

    def connect(self, peer: str, address: str) -> None:
        """Open (or reopen) the sending socket towards ``peer`` at ``address``."""
        old = self._peers.pop(peer, None)
        if old is not None:
            old.close(linger=0)
        sock = self._socket(zmq.DEALER)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.connect(address)
        self._peers[peer] = sock

    # -- serving ----------------------------------------------------------------------------

    def serve(self, timeout_s: float = 0.0) -> int:
        """Wait up to ``timeout_s`` for a message, then handle every queued one; the count."""
        if not self._server.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
            return 0
        return self._drain()

    def _drain(self) -> int:
        n = 0
        while True:
            try:
                frames = self._server.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return n
            n += 1
            if len(frames) == 2:
                self._handle(*frames)

    def _handle(self, ident: bytes, payload: bytes) -> None:
        try:
            env = self.codec.decode(payload)
        except Unauthenticated:
            self.rejected += 1
            return
        except TransferError as e:  # a member sent something invalid: tell it at once
            self.rejected += 1
            self._reply(ident, self.codec.seq_of(payload), Error("TransferError", str(e)))
            return
        try:
            reply = self.handler(env.sender, env.msg)
        except Exception as e:  # every handler failure goes back to the caller
            reply = Error(type(e).__name__, str(e))
        if env.kind == "req":
            self._reply(ident, env.seq, Ack() if reply is None else reply)

    def _reply(self, ident: bytes, seq: int, msg: Msg) -> None:
        try:
            frame = self.codec.encode(Envelope("rep", seq, self.name, msg))
            self._server.send_multipart([ident, frame])
        except zmq.ZMQError:
            pass  # the asker is gone; its own timeout tells it

    # -- sending ----------------------------------------------------------------------------

    def _send(self, peer: str, kind: str, seq: int, msg: Msg) -> zmq.Socket:
        op = type(msg).__name__
        if peer in self.dead:
            raise InstanceDied(f"instance {peer} is dead ({self.dead[peer]}); cannot {op}")
        sock = self._peers.get(peer)
        if sock is None:
            raise TransferError(f"{self.name} has no connection to {peer!r} ({op})")
        try:
            sock.send(self.codec.encode(Envelope(kind, seq, self.name, msg)), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise TransferError(f"{peer} is not taking messages ({op}): {e}") from e
        return sock

    def push(self, peer: str, msg: Msg) -> None:
        """Send ``msg`` to ``peer`` without waiting; raises TransferError if it cannot be queued."""
        self._send(peer, "push", 0, msg)

    def try_push(self, peer: str, msg: Msg) -> bool:
        """:meth:`push`, but report failure as False instead of raising."""
        try:
            self.push(peer, msg)
        except TransferError:
            return False
        return True

    def call(self, peer: str, msg: Msg, timeout_s: float | None = None) -> Msg:
        """Send a request to ``peer`` and return its reply, serving incoming messages meanwhile.

        Raises ``InstanceDied`` when the peer is or becomes known dead, ``TransferError`` when
        it does not answer within ``timeout_s`` and ``RemoteError`` when its handler failed.
        """
        op = type(msg).__name__
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        seq = next(self._seq)
        sock = self._send(peer, "req", seq, msg)
        poller = zmq.Poller()
        poller.register(self._server, zmq.POLLIN)
        poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while True:
            if peer in self.dead:
                raise InstanceDied(f"instance {peer} died during {op} ({self.dead[peer]})")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferError(f"instance {peer} did not answer {op} within {timeout_s:g} s")
            events = dict(poller.poll(int(min(left, WAIT_SLICE_S) * 1000) + 1))
            if self._server in events:
                self._drain()
            if sock in events and (reply := self._reply_to(sock, seq)) is not None:
                if isinstance(reply, Error):
                    raise RemoteError(peer, op, reply.kind, reply.message)
                return reply
            if self.on_wait is not None:
                self.on_wait()

    def _reply_to(self, sock: zmq.Socket, seq: int) -> Msg | None:
        """The reply numbered ``seq`` among the frames waiting on ``sock``, if it came."""
        while True:
            try:
                env = self.codec.decode(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return None
            except Unauthenticated:
                self.rejected += 1
                continue
            if env.kind == "rep" and env.seq == seq:
                return env.msg
            # else: the late answer to a request that timed out

    def close(self) -> None:
        """Close every socket and the context. Idempotent."""
        for sock in self._peers.values():
            sock.close(linger=0)
        self._peers.clear()
        if not self._server.closed:
            self._server.close(linger=0)
        if not self._ctx.closed:
            self._ctx.term()
