"""The control plane between instances: small typed messages over ZeroMQ, encoded with msgpack.

Messages are dataclasses; on the wire each is a msgpack map ``{"type": name, **fields}``
inside an envelope ``{"kind": "req" | "rep" | "push", "seq": n, "from": sender, "msg": ...}``.
Nothing is ever pickled.

A :class:`ControlServer` binds a ROUTER socket and answers requests (and takes pushes) from
any number of :class:`ControlClient` peers, each a DEALER socket. Requests carry a sequence
number, so a reply that arrives after its request timed out is recognised and dropped; a
request that is not answered in time raises :class:`~minimemserve.errors.TransferError`
naming the peer and the operation. A handler that raises makes the client raise
:class:`RemoteError`, a TransferError carrying the remote exception's class name.

The transfer protocol's receiving side maps to: :class:`AllocRequest` -> :class:`AllocReply`
(``recv_alloc``), :class:`WriteDone` (the data has landed), :class:`Commit` (``recv_commit``),
:class:`Abort` (``recv_abort``), each answered by :class:`Ack`; :class:`Heartbeat` is pushed;
:class:`Error` is what a failing handler sends back.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import msgpack
import zmq

from minimemserve.errors import TransferError

LOOPBACK = "127.0.0.1"
# A loopback round trip takes well under a millisecond; five seconds without an answer
# means the peer is dead or stuck.
DEFAULT_TIMEOUT_S = 5.0
# Messages queued towards one peer before sends fail fast instead of growing memory.
SEND_HWM = 10_000


def _check_ids(name: str, values: Any, optional: bool = False) -> None:
    if values is None and optional:
        return
    if not isinstance(values, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values
    ):
        raise ValueError(f"{name} must be a list of non-negative ints, got {values!r:.80}")


@dataclass
class AllocRequest:
    """Ask the receiver for ``num_blocks`` blocks; with ``tokens`` it first matches its cache."""

    req_id: str
    tokens: list[int] | None
    num_blocks: int

    def __post_init__(self) -> None:
        _check_ids("tokens", self.tokens, optional=True)
        if not isinstance(self.num_blocks, int) or self.num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {self.num_blocks!r}")


@dataclass
class AllocReply:
    """Blocks the receiver already holds for the prefix (``matched``) and fresh ones (``new``)."""

    req_id: str
    matched: list[int]
    new: list[int]

    def __post_init__(self) -> None:
        _check_ids("matched", self.matched)
        _check_ids("new", self.new)


@dataclass
class WriteDone:
    """The sender finished writing ``blocks`` (a one-sided write has landed)."""

    req_id: str
    blocks: list[int]

    def __post_init__(self) -> None:
        _check_ids("blocks", self.blocks)


@dataclass
class Commit:
    """The receiver keeps ``blocks`` for the request (inserting ``tokens`` when given)."""

    req_id: str
    tokens: list[int] | None
    blocks: list[int]

    def __post_init__(self) -> None:
        _check_ids("tokens", self.tokens, optional=True)
        _check_ids("blocks", self.blocks)


@dataclass
class Abort:
    """The transfer is off: the receiver releases ``blocks``."""

    req_id: str
    blocks: list[int]

    def __post_init__(self) -> None:
        _check_ids("blocks", self.blocks)


@dataclass
class Ack:
    """A plain success reply."""

    req_id: str = ""


@dataclass
class Heartbeat:
    """Liveness ping, pushed periodically; ``time`` is the sender's wall clock."""

    sender: str
    time: float


@dataclass
class Error:
    """A failed request: ``kind`` is the remote exception's class name."""

    req_id: str
    kind: str
    message: str


PROTOCOL_MESSAGES: tuple[type, ...] = (
    AllocRequest,
    AllocReply,
    WriteDone,
    Commit,
    Abort,
    Ack,
    Heartbeat,
    Error,
)


def _type_name(cls: type) -> str:
    return cls.__name__


class RemoteError(TransferError):
    """A peer's handler failed; ``peer``, ``op`` and ``kind`` (its exception class) say which."""

    def __init__(self, peer: str, op: str, kind: str, message: str) -> None:
        """Build the error from the peer's :class:`Error` reply."""
        super().__init__(f"peer {peer} failed {op}: {kind}: {message}")
        self.peer = peer
        self.op = op
        self.kind = kind
        self.remote_message = message


class MessageCodec:
    """Turns message dataclasses into msgpack bytes and back; knows a fixed set of types.

    Pass ``extra`` to add application messages (dataclasses with msgpack-able fields, names
    unique) on both ends.
    """

    def __init__(self, extra: Iterable[type] = ()) -> None:
        """Know the protocol messages plus ``extra``."""
        types: dict[str, type] = {}
        for cls in (*PROTOCOL_MESSAGES, *extra):
            if not dataclasses.is_dataclass(cls):
                raise TypeError(f"message type {cls!r} must be a dataclass")
            name = _type_name(cls)
            if name in types and types[name] is not cls:
                raise ValueError(f"two message types are named {name!r}")
            types[name] = cls
        self.types = MappingProxyType(types)

    def to_dict(self, msg: Any) -> dict[str, Any]:
        """The ``{"type": name, **fields}`` dict of a known message."""
        name = _type_name(type(msg))
        if self.types.get(name) is not type(msg):
            raise TypeError(f"{type(msg).__name__} is not a registered message type")
        out = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
        out["type"] = name
        return out

    def from_dict(self, data: Any) -> Any:
        """Rebuild a message from its dict; raises TransferError when it is malformed."""
        if not isinstance(data, dict) or not isinstance(data.get("type"), str):
            raise TransferError(f"malformed control message: {data!r:.200}")
        cls = self.types.get(data["type"])
        if cls is None:
            raise TransferError(f"unknown control message type {data['type']!r}")
        fields = {k: v for k, v in data.items() if k != "type"}
        try:
            return cls(**fields)
        except (TypeError, ValueError) as e:
            raise TransferError(f"malformed {data['type']} message: {e}") from e

    def encode(self, envelope: dict[str, Any], msg: Any) -> bytes:
        """Pack an envelope around ``msg``."""
        try:
            return msgpack.packb({**envelope, "msg": self.to_dict(msg)}, use_bin_type=True)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{type(msg).__name__} holds a value msgpack cannot carry: {e}") from e

    def decode(self, payload: bytes) -> tuple[dict[str, Any], Any]:
        """Unpack ``(envelope, message)``; raises TransferError on garbage."""
        try:
            env = msgpack.unpackb(payload, raw=False)
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise TransferError(f"undecodable control frame: {e}") from e
        if not isinstance(env, dict) or "msg" not in env:
            raise TransferError("control frame without a message")
        return env, self.from_dict(env["msg"])


def endpoint(host: str = LOOPBACK, port: int = 0) -> str:
    """A ``tcp://`` endpoint; port 0 means any free port (when binding)."""
    if not 0 <= port < 65536:
        raise ValueError(f"port must be in [0, 65536), got {port}")
    return f"tcp://{host}:{port if port else '*'}"


class ControlServer:
    """Answers requests from peers (ROUTER socket) with a handler you supply.

    ``handler(msg) -> reply | None`` runs for every request and push; its return value is
    sent back for requests (``None`` sends :class:`Ack`), and an exception it raises goes
    back as :class:`Error`. Use :meth:`serve_once` in your own loop or :meth:`serve`.
    """

    def __init__(
        self,
        host: str = LOOPBACK,
        port: int = 0,
        *,
        name: str = "server",
        codec: MessageCodec | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        """Bind ``host:port`` (port 0 picks a free one; see :attr:`address`)."""
        self.name = name
        self.codec = codec or MessageCodec()
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        try:
            self._sock.bind(endpoint(host, port))
        except zmq.ZMQError as e:
            self.close()
            raise TransferError(f"{name} cannot bind {host}:{port}: {e}") from e
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.last_heard: dict[str, float] = {}  # peer name -> time.monotonic() of last message

    @property
    def port(self) -> int:
        """The TCP port actually bound."""
        return int(self.address.rsplit(":", 1)[1])

    def serve_once(self, handler: Callable[[Any], Any], timeout_s: float | None = None) -> bool:
        """Handle one incoming message if one arrives within ``timeout_s``; True if it did."""
        timeout_ms = None if timeout_s is None else max(0, int(timeout_s * 1000))
        if not self._sock.poll(timeout_ms, zmq.POLLIN):
            return False
        frames = self._sock.recv_multipart()
        if len(frames) != 2:
            return True  # not from a ControlClient; nothing to answer
        ident, payload = frames
        try:
            env, msg = self.codec.decode(payload)
        except TransferError as e:
            self._send(ident, {"kind": "rep", "seq": -1}, Error("", "TransferError", str(e)))
            return True
        peer = str(env.get("from", "?"))
        self.last_heard[peer] = time.monotonic()
        try:
            reply = handler(msg)
        except Exception as e:
            reply = Error(getattr(msg, "req_id", ""), type(e).__name__, str(e))
        if env.get("kind") == "req":
            rep_env = {"kind": "rep", "seq": env.get("seq", -1)}
            reply = reply if reply is not None else Ack()
            try:
                self._send(ident, rep_env, reply)
            except TypeError as e:  # the handler returned something that cannot travel
                self._send(ident, rep_env, Error(getattr(msg, "req_id", ""), "TypeError", str(e)))
        return True

    def serve(
        self,
        handler: Callable[[Any], Any],
        should_stop: Callable[[], bool],
        poll_s: float = 0.05,
    ) -> None:
        """Handle messages until ``should_stop()`` is true (checked every ``poll_s``)."""
        while not should_stop():
            self.serve_once(handler, poll_s)

    def _send(self, ident: bytes, env: dict[str, Any], msg: Any) -> None:
        env = {**env, "from": self.name}
        try:
            self._sock.send_multipart([ident, self.codec.encode(env, msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise TransferError(
                f"{self.name} cannot answer peer {ident!r} ({type(msg).__name__}): {e}"
            ) from e

    def close(self) -> None:
        """Close the socket (and the context if this server made it). Idempotent."""
        if not self._sock.closed:
            self._sock.close(linger=0)
        if self._own_context and not self._ctx.closed:
            self._ctx.term()

    def __enter__(self) -> ControlServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ControlClient:
    """Sends requests and pushes to one :class:`ControlServer` (DEALER socket).

    Not thread-safe: use one client per thread.
    """

    def __init__(
        self,
        address: str,
        *,
        name: str = "client",
        peer: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        codec: MessageCodec | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        """Connect to ``address`` (``tcp://host:port``); ``peer`` names it in errors."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.address = address
        self.name = name
        self.peer = peer or address
        self.timeout_s = timeout_s
        self.codec = codec or MessageCodec()
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._sock.connect(address)
        self._seq = 0

    def request(self, msg: Any, timeout_s: float | None = None) -> Any:
        """Send ``msg`` and wait for the reply; raises TransferError on timeout.

        An :class:`Error` reply raises :class:`RemoteError`.
        """
        op = type(msg).__name__
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self._seq += 1
        seq = self._seq
        self._send({"kind": "req", "seq": seq}, msg, op)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                raise TransferError(f"peer {self.peer} did not answer {op} within {timeout_s:g} s")
            env, reply = self.codec.decode(self._sock.recv())
            if env.get("seq") != seq:
                continue  # the late answer to a request that already timed out
            if isinstance(reply, Error):
                raise RemoteError(self.peer, op, reply.kind, reply.message)
            return reply

    def push(self, msg: Any) -> None:
        """Send ``msg`` without waiting for an answer (heartbeats, notifications)."""
        self._send({"kind": "push", "seq": 0}, msg, type(msg).__name__)

    def _send(self, env: dict[str, Any], msg: Any, op: str) -> None:
        if self._sock.closed:
            raise TransferError(f"control client to {self.peer} is closed ({op})")
        env = {**env, "from": self.name}
        try:
            self._sock.send(self.codec.encode(env, msg), zmq.NOBLOCK)
        except zmq.Again as e:
            raise TransferError(f"peer {self.peer} is not taking messages ({op})") from e

    def close(self) -> None:
        """Close the socket without waiting for unsent messages. Idempotent."""
        if not self._sock.closed:
            self._sock.close(linger=0)
        if self._own_context and not self._ctx.closed:
            self._ctx.term()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
