"""The :class:`RpcNode` every process of the runtime uses: ROUTER in, a DEALER per peer out,
authenticated frames (:mod:`.auth`) carrying typed messages (:mod:`.messages`). A node waiting
for its reply keeps answering requests: P and D call each other (D sends decode-phase KV back
while P sends to it), and a node that only waited would deadlock."""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections import deque
from collections.abc import Callable

import zmq
from zmq.auth.thread import ThreadAuthenticator

from ...config import DEFAULT_TIMEOUT_S, LOOPBACK
from ...errors import InstanceDied, RemoteError, TransferError
from .auth import (
    LOOPBACK_HOSTS,
    ClusterMember,
    Codec,
    Envelope,
    Freshness,
    Stream,
    Unauthenticated,
)
from .messages import Ack, Error, Msg

# The frontend's name on the control plane (instances are named by role: p0, d0, c0, ...).
FRONTEND = "frontend"
WAIT_SLICE_S = 0.05  # longest poll while awaiting a reply, so heartbeats and dead peers are seen
SEND_HWM = 10_000  # messages queued towards one peer before sends fail fast
MAX_DEFERRED = 10_000  # deferred messages a node keeps while it waits; more are refused
MAX_MESSAGE_BYTES = 32 << 20  # largest control message accepted: a 1M-token prompt is ~9 MB


def endpoint(host: str = LOOPBACK, port: int = 0) -> str:
    """A ``tcp://`` endpoint; port 0 means any free port (when binding)."""
    if not 0 <= port < 65536:
        raise ValueError(f"port must be in [0, 65536), got {port}")
    return f"tcp://{host}:{port if port else '*'}"


Handler = Callable[[str, Msg], "Msg | None"]


def _context() -> zmq.Context:
    """A ZeroMQ context whose options are the defaults of every socket it opens."""
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    ctx.setsockopt(zmq.SNDHWM, SEND_HWM)
    ctx.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    return ctx


class RpcNode:
    """One process's end: a ROUTER socket peers send to, a DEALER socket per peer it sends to.
    ``handler(sender, msg)`` answers every request and push (a ``None`` reply is sent as
    :class:`Ack`, an exception as :class:`Error`). A message whose type is in :attr:`deferred`
    that arrives while this node waits on a :meth:`call` is queued, and handled (and answered)
    by the next :meth:`serve` made outside a call: its handler may call, and never runs inside
    another handler's or the owner's call; the others are handled at once and must not call.
    The replies to requests sent with :meth:`send` are handed to their callbacks the same way.
    Frames addressed to another name than :attr:`name` (unless ``any_recipient``: a standalone
    instance waiting to be named) or not fresh are dropped unanswered; every other authentic
    frame, reply or not, counts as hearing from its sender (:attr:`heard`). Not thread-safe."""

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
        curve: tuple[bytes, bytes] | None = None,
    ) -> None:
        """Bind ``host:port`` (port 0: a free one, see :attr:`address`); ``codec`` signs. A
        ``host`` other than loopback needs ``curve``, the cluster's ZeroMQ CURVE key pair
        (``zmq.curve_keypair()``): every socket is then encrypted, and a peer that does not
        know the key cannot even complete the handshake, let alone deliver a frame."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if curve is None and host not in LOOPBACK_HOSTS:
            raise ValueError(f"{name}: binding {host} (not loopback) needs CURVE keys")
        self._curve = curve
        self.name = name
        self.handler = handler
        self.codec = codec
        self.timeout_s = timeout_s
        self.on_wait = on_wait
        self.rejected = 0  # frames dropped: unauthenticated, or failed validation
        self.replayed = 0  # authentic frames dropped: seen before, too old, or not for us
        self.any_recipient = False
        self.drained_at = time.monotonic()  # when every frame sent to us before was read
        self.dead: dict[str, str] = {}  # peer name -> why it is considered dead
        self.heard: dict[str, float] = {}  # sender -> when its last authentic frame was read
        self.deferred: frozenset[type[Msg]] = frozenset()  # handled outside calls only
        self._queued: deque[tuple[bytes, Envelope]] = deque()
        self._sent: dict[tuple[str, int], Callable[[Msg], None]] = {}  # (peer, seq) -> callback
        self._answers: deque[tuple[Callable[[Msg], None], Msg]] = deque()
        self._calls = 0  # calls this node is waiting on (nested through handlers)
        self._early: dict[tuple[str, int], Msg | None] = {}  # open call -> reply read early
        self._fresh = Freshness()
        self._peers: dict[str, tuple[zmq.Socket, Stream]] = {}
        self._replies = Stream()  # what the ROUTER socket sends
        self._seq = itertools.count(1)
        self._ctx = _context()
        self._auth: ThreadAuthenticator | None = None
        self._server = self._ctx.socket(zmq.ROUTER)
        self._server.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if curve is not None:  # handshakes only with clients holding the cluster's key pair
            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve_callback("*", ClusterMember(curve[0]))
            self._server.curve_publickey, self._server.curve_secretkey = curve
            self._server.curve_server = True
        try:
            self._server.bind(endpoint(host, port))
        except zmq.ZMQError as e:
            self.close()
            raise TransferError(f"{name} cannot bind {host}:{port}: {e}") from e
        self.address: str = self._server.getsockopt_string(zmq.LAST_ENDPOINT)

    def connect(self, peer: str, address: str) -> None:
        """Open (or reopen) the sending socket towards ``peer`` at ``address``."""
        self.disconnect(peer)
        sock = self._ctx.socket(zmq.DEALER)
        if self._curve is not None:  # one key pair per cluster: every server has its public key
            sock.curve_serverkey = self._curve[0]
            sock.curve_publickey, sock.curve_secretkey = self._curve
        sock.connect(address)
        self._peers[peer] = (sock, Stream())

    def disconnect(self, peer: str) -> None:
        """Close the sending socket towards ``peer``, if any; what was sent to it with
        :meth:`send` and not answered yet is answered with an ``InstanceDied`` error."""
        self._give_up(peer, f"the connection to {peer} was closed")
        if (old := self._peers.pop(peer, None)) is not None:
            old[0].close(linger=0)

    def _give_up(self, peer: str, why: str) -> None:
        """Answer every request :meth:`send` sent to ``peer`` that is still open with ``why``,
        after taking the replies that came already."""
        if (out := self._peers.get(peer)) is not None:
            self._reply_to(peer, out[0], 0)
        for key in [k for k in self._sent if k[0] == peer]:
            self._answers.append((self._sent.pop(key), Error("InstanceDied", why)))

    def serve(self, timeout_s: float = 0.0) -> int:
        """Wait up to ``timeout_s`` for a message, then handle every queued one; the count.
        A wait shorter than the poll's one-millisecond grain waits that millisecond rather
        than spinning. Outside a call, the replies to :meth:`send` read so far go to their
        callbacks first."""
        horizon = self._horizon()
        n = 0
        while (self._queued or self._answers) and not self._calls:  # what came while it waited
            if self._answers:
                callback, reply = self._answers.popleft()
                callback(reply)
            else:
                self._dispatch(*self._queued.popleft())
            n += 1
        if n:
            timeout_s = 0.0
        if not self._poll_sent(timeout_s):
            self.drained_at = time.monotonic()
            return n
        while True:
            try:
                frames = self._server.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                self.drained_at = time.monotonic()
                return n
            n += 1
            if len(frames) == 2:
                self._handle(*frames, horizon)

    def _poll_sent(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a frame on the listening socket or for a reply to a
        :meth:`send` (read into the callbacks' queue); whether the listening socket has one."""
        wait_ms = max(0, math.ceil(timeout_s * 1000))
        if not self._sent:
            return bool(self._server.poll(wait_ms, zmq.POLLIN))
        for peer in {p for p, _ in self._sent if p in self.dead}:
            self._give_up(peer, f"instance {peer} is dead ({self.dead[peer]})")
        socks = {self._peers[p][0]: p for p, _ in self._sent if p in self._peers}
        poller = zmq.Poller()
        poller.register(self._server, zmq.POLLIN)
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        events = dict(poller.poll(wait_ms))
        for sock in socks.keys() & events.keys():
            self._reply_to(socks[sock], sock, 0)
        return self._server in events

    def _horizon(self) -> float:
        """When this node last read every queued frame, on the wall clock (senders' clock)."""
        return time.time() - (time.monotonic() - self.drained_at)

    def _admit(self, env: Envelope, horizon: float) -> bool:
        """Whether an authentic frame is for this node and fresh; counts it if not."""
        if (env.to == self.name or self.any_recipient) and self._fresh.admit(env, horizon):
            self.heard[env.sender] = time.monotonic()
            return True
        self.replayed += 1
        return False

    def _handle(self, ident: bytes, payload: bytes, horizon: float) -> None:
        try:
            env = self.codec.decode(payload)
        except TransferError as e:
            self.rejected += 1
            if not isinstance(e, Unauthenticated):  # a member sent something invalid: tell it
                self._reply(ident, *self.codec.origin(payload), Error("TransferError", str(e)))
            return
        if not self._admit(env, horizon):
            return
        if self._calls and type(env.msg) in self.deferred:
            if len(self._queued) >= MAX_DEFERRED:  # a flood while we wait: refuse, count it
                self.rejected += 1
                if env.kind == "req":
                    why = f"{self.name} holds {MAX_DEFERRED} deferred messages already"
                    self._reply(ident, env.seq, env.sender, Error("TransferError", why))
                return
            self._queued.append((ident, env))
        else:
            self._dispatch(ident, env)

    def _dispatch(self, ident: bytes, env: Envelope) -> None:
        try:
            reply = self.handler(env.sender, env.msg)
        except Exception as e:  # every handler failure goes back to the caller
            reply = Error(type(e).__name__, str(e))
        if env.kind == "req":
            self._reply(ident, env.seq, env.sender, Ack() if reply is None else reply)

    def _reply(self, ident: bytes, seq: int, to: str, msg: Msg) -> None:
        frame = self.codec.encode(self._replies.envelope("rep", seq, self.name, to, msg))
        with contextlib.suppress(zmq.ZMQError):  # the asker is gone; its own timeout tells it
            self._server.send_multipart([ident, frame])

    def _send(self, peer: str, kind: str, seq: int, msg: Msg) -> zmq.Socket:
        op = type(msg).__name__
        if peer in self.dead:
            raise InstanceDied(f"instance {peer} is dead ({self.dead[peer]}); cannot {op}")
        if (out := self._peers.get(peer)) is None:
            raise TransferError(f"{self.name} has no connection to {peer!r} ({op})")
        sock, stream = out
        frame = self.codec.encode(stream.envelope(kind, seq, self.name, peer, msg))
        try:
            sock.send(frame, zmq.NOBLOCK)
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

    def send(self, peer: str, msg: Msg, on_reply: Callable[[Msg], None]) -> None:
        """Send a request to ``peer`` without waiting for its reply: a later :meth:`serve`
        made outside a call hands ``on_reply`` the reply (an :class:`Error` if it failed), or
        an ``Error`` of kind ``InstanceDied`` once ``peer`` is known dead or disconnected.
        Raises as :meth:`push` when it cannot be sent."""
        seq = next(self._seq)
        self._send(peer, "req", seq, msg)
        self._sent[(peer, seq)] = on_reply

    def call(self, peer: str, msg: Msg, timeout_s: float | None = None) -> Msg:
        """Send a request to ``peer`` and return its reply, serving incoming messages (queueing
        the :attr:`deferred` ones) and running ``on_wait`` meanwhile. Raises ``InstanceDied``
        when the peer is or becomes known dead, ``TransferError`` when it does not answer in
        ``timeout_s``, ``RemoteError`` if it failed."""
        op = type(msg).__name__
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        sock = self._send(peer, "req", seq := next(self._seq), msg)
        self._calls += 1
        self._early[(peer, seq)] = None
        try:
            return self._await_reply(peer, op, sock, seq, timeout_s)
        finally:
            self._calls -= 1
            del self._early[(peer, seq)]

    def _await_reply(self, peer: str, op: str, sock: zmq.Socket, seq: int, timeout_s: float) -> Msg:
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
            self.serve()  # also records that nothing waits unread
            reply = self._early[(peer, seq)]  # read by serve() among a send's replies
            if reply is None and sock in events:
                reply = self._reply_to(peer, sock, seq)
            if reply is not None:
                if isinstance(reply, Error):
                    raise RemoteError(peer, op, reply.kind, reply.message)
                return reply
            if self.on_wait is not None:
                self.on_wait()

    def _reply_to(self, peer: str, sock: zmq.Socket, seq: int) -> Msg | None:
        """The reply numbered ``seq`` among the frames waiting on ``sock`` (from ``peer``), if
        it came; replies to :meth:`send` read on the way are queued for their callbacks."""
        while True:
            try:
                env = self.codec.decode(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return None
            except Unauthenticated:
                self.rejected += 1
                continue
            if not self._admit(env, self._horizon()):
                continue
            if env.kind != "rep":
                continue
            if env.seq == seq:
                return env.msg
            if (callback := self._sent.pop((peer, env.seq), None)) is not None:
                self._answers.append((callback, env.msg))
            elif (peer, env.seq) in self._early:  # an open call's, read on a send's behalf
                self._early[(peer, env.seq)] = env.msg
            # any other reply answers a call that timed out

    def close(self) -> None:
        """Close every socket and the context. Idempotent. ``destroy`` also closes a socket an
        interrupt (Ctrl-C) left unregistered half-way through a connect, on which ``term``
        would wait forever."""
        self._peers.clear()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._ctx.destroy(linger=0)
