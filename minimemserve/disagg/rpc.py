"""The control plane: typed messages and the :class:`RpcNode` every process of the runtime uses.

Messages are ``msgspec`` structs tagged by class name and validated field by field (types,
ranges) when decoded; nothing is pickled. Every frame carries an HMAC of the cluster's secret
(made by the frontend and handed to the instances it spawns, never on a command line or in a
file); a frame without it is dropped unanswered, loopback included. Frames are fresh: the tag
covers the sender, the receiver and the frame's place in its sender's stream (a random id per
sending socket and a counter), so a captured frame replayed to any node is dropped and counted
(:attr:`RpcNode.replayed`). A node waiting for its reply keeps answering requests: P and D call
each other (D sends decode-phase KV back while P sends to it), and a node that only waited
would deadlock. Transfer protocol (receiving side of
``MemPool.transfer``): AllocRequest → AllocReply, the sender writes the blocks, Commit or Abort."""

from __future__ import annotations

import contextlib
import hmac
import itertools
import json
import math
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_type_hints

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator

from ..config import LOOPBACK
from ..errors import InstanceDied, RemoteError, TransferError
from ..request import Request, RequestMetrics, RequestOutput, TokenDelta, TokenLogprob
from ..sampling import SamplingParams

LOOPBACK_HOSTS = frozenset({LOOPBACK, "localhost", "::1"})
# The frontend's name on the control plane (instances are named by role: p0, d0, c0, ...).
FRONTEND = "frontend"
DEFAULT_TIMEOUT_S = 30.0  # a loopback round trip takes < 1 ms: a peer this late is dead or stuck
WAIT_SLICE_S = 0.05  # longest poll while awaiting a reply, so heartbeats and dead peers are seen
SEND_HWM = 10_000  # messages queued towards one peer before sends fail fast
MAX_DEFERRED = 10_000  # deferred messages a node keeps while it waits; more are refused
MAX_MESSAGE_BYTES = 32 << 20  # largest control message accepted: a 1M-token prompt is ~9 MB
TAG_BYTES = 32  # HMAC-SHA256 of the payload, sent in front of it
# How old (sender's clock) the first frame of a stream a node has not seen may be, counted back
# from the node's last read (an idle node blames no frame for waiting): hosts' clocks agree to
# well within it, and a frame captured earlier is refused.
FRESH_S = 30.0
# Streams (sending sockets) a node remembers, least recently heard first to go: a cluster opens
# a few per peer and reconnection.
MAX_STREAMS = 4096

Count = Annotated[int, msgspec.Meta(ge=0)]
Ids = list[Count]


class Msg(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Base of every control message (tagged by class name on the wire)."""


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
    """How much of ``tokens`` is cached, the load, and room for a request of ``blocks`` blocks."""

    tokens: Ids
    blocks: Count = 0


class ProbeReply(Msg):
    """Cached prefix length in tokens, requests queued or running, room for the request."""

    cached: Count
    load: Count
    room: bool = True


# "auto" or a transport of the KV link table (disagg.links, above this module: the name is
# checked against the table where it is used, in the frontend and in the instance)
Transport = Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9_]{0,31}$")]
MAX_NIXL_METADATA = 1 << 20  # an agent's metadata is ~0.5 KiB on one host; a few per NIC


class NixlInfo(msgspec.Struct, forbid_unknown_fields=True):
    """An instance's NIXL agent as its peers learn it: the agent's name and metadata (loaded
    by each peer that writes into it), and the region peers write into: ``num_blocks`` blocks
    of ``block_bytes`` each (whole-model layout) from ``address``, in ``memory`` ("DRAM" or
    "VRAM") of device ``device_id``."""

    agent: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    metadata: Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_NIXL_METADATA)]
    address: Annotated[int, msgspec.Meta(gt=0, le=(1 << 63) - 1)]
    block_bytes: Annotated[int, msgspec.Meta(gt=0)]
    num_blocks: Annotated[int, msgspec.Meta(gt=0)]
    memory: Literal["DRAM", "VRAM"]
    device_id: Count = 0


class PeerInfo(msgspec.Struct, forbid_unknown_fields=True):
    """An instance as its peers learn it: where it listens, how to map its pool (``handle``,
    same host only), its host's identity, and the KV transport: in ``Ready`` the one it asks
    for, in ``Peers`` the one the frontend chose for the pair."""

    name: str
    role: str
    address: str
    handle: dict[str, Any] | None
    host: str = ""
    transport: Transport = "auto"
    nixl: NixlInfo | None = None


class Ready(Msg):
    """An instance is up (sent to the frontend), with the longest context it holds and the
    blocks of its hbm pool (the frontend checks requests against them)."""

    info: PeerInfo
    pid: Count
    max_model_len: Count
    hbm_blocks: Count


class Peers(Msg):
    """The instances of the deployment, for each to connect to the others; pairs that move KV
    over torch.distributed meet in the frontend's store at ``store`` (``host:port``)."""

    peers: list[PeerInfo]
    store: str = ""
    scope: str = "s0"  # names this round of pair groups in the store


class PeerUp(Msg):
    """Instance ``info.name``, declared dead before, is back: reach it again (over
    ``info.transport``; pair groups meet in ``store`` under ``scope``)."""

    info: PeerInfo
    store: str = ""
    scope: str = "s0"


class Rejoin(Msg):
    """A standalone instance the frontend gave up on is waiting again (pushed by it)."""


class Hello(Msg):
    """A frontend asks a standalone instance what it is (reply: ``Info`` with its role, host
    identity, transport, device and model)."""


class Join(Msg):
    """A frontend takes a standalone instance into its deployment ``config`` as ``name``: it
    builds its engine with ``engine_config`` (``EngineConfig`` fields), reports ``Ready`` to
    ``frontend`` and serves until shut down, or until it hears nothing from the frontend for
    ``frontend_timeout_s``; ``linked``: peers will move KV into its pool."""

    session: str
    name: str
    config: str
    frontend: str
    engine_config: dict[str, Any]
    timeout_s: Annotated[float, msgspec.Meta(gt=0)]
    heartbeat_s: Annotated[float, msgspec.Meta(gt=0)]
    frontend_timeout_s: Annotated[float, msgspec.Meta(gt=0)]
    linked: bool


class KVData(Msg):
    """The blocks ``blocks`` of transfer ``xfer`` were posted to the receiver over its
    torch.distributed link, tagged ``tag``: receive them into those blocks."""

    xfer: str
    blocks: Ids
    tag: Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]


class RequestState(msgspec.Struct, forbid_unknown_fields=True):
    """A :class:`Request` on the wire: its attributes of the same names (arrival and the
    prefill instance travel in its metrics), derived by :meth:`of` and rebuilt by
    :meth:`request`. A new request travels so to its entry instance (no KV, no output yet);
    a handed-off one with everything its receiver needs to continue (its KV already moved)."""

    request_id: str
    tokens: Ids
    num_prompt: Count
    params: SamplingParams
    blocks: Ids
    num_computed: Count
    max_total_tokens: Count
    metrics: RequestMetrics
    logprobs: list[TokenLogprob] | None = None

    @classmethod
    def of(cls, req: Request) -> RequestState:
        """``req``'s state: its attributes named by the fields."""
        fields = {f: getattr(req, f) for f in cls.__struct_fields__}
        return cls(**fields | {"tokens": req.tokens.tolist(), "blocks": list(req.blocks)})

    def request(self) -> Request:
        """The request again (the inverse of :meth:`of`); prefilled once it has output."""
        req = Request(self.request_id, self.tokens, self.params, self.metrics.arrival_time)
        for f in self.__struct_fields__:
            if f not in _BUILT:
                setattr(req, f, getattr(self, f))
        if req.params.logprobs is not None:
            req.logprobs = list(self.logprobs or ())
        req.prefilled = req.num_output > 0
        return req

    @property
    def is_new(self) -> bool:
        """Whether this is a request no instance has computed anything of."""
        return (
            not self.blocks
            and self.num_computed == 0
            and len(self.tokens) == self.num_prompt
            and not self.logprobs
        )


# Request attributes its constructor sets from the state; the others are copied by name.
_BUILT = ("request_id", "tokens", "params")


class Submit(Msg):
    """A new request for the receiving instance, as its state (:attr:`RequestState.is_new`)."""

    state: RequestState


class Accept(Msg):
    """Take over a request whose KV was just moved to the receiver."""

    state: RequestState


class Output(Msg):
    """A finished request, pushed to the frontend."""

    output: RequestOutput


class Tokens(Msg):
    """Tokens sampled in the last step, per request (streamed before any ``Output``)."""

    deltas: list[TokenDelta]


class Handoff(Msg):
    """The prefill instance passed ``request_id`` to decode instance ``to``."""

    request_id: str
    to: str


class CacheEvents(Msg):
    """What the sender's index gained (``True``, tokens) and evicted (``False``, the token
    path through the first evicted block), in order: its prompt tree mirrors it."""

    events: list[tuple[bool, Ids]]


class AbortRequest(Msg):
    """Stop ``request_id`` if the receiver holds it; the reply is its ``Output`` or ``Ack``."""

    request_id: str


class Query(Msg):
    """Ask for ``what``: the instance's stats, its pool's audit, or its links once formed."""

    what: Literal["stats", "check", "links"]


class Info(Msg):
    """Answer to :class:`Query` and :class:`PeerDown`."""

    data: dict[str, Any]


class PeerDown(Msg):
    """Instance ``name`` died: release what was held for it and stop sending to it."""

    name: str
    reason: str


class PushPrefix(Msg):
    """Copy the cached prefix of ``tokens`` to ``to``; replies ``Info({"tokens": its length})``."""

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


MESSAGES = tuple(Msg.__subclasses__())  # the runtime's messages, all defined above


class Envelope(msgspec.Struct, forbid_unknown_fields=True):
    """What travels: the kind of frame, its call number (``seq``, which a reply repeats), who
    sends it to whom, its place in the sender's stream (``stream``: a random id per sending
    socket, ``count``: growing by one per frame), the sender's clock, and the message."""

    kind: Literal["req", "rep", "push"]
    seq: int
    sender: str
    to: str
    stream: int
    count: int
    sent: float
    msg: Msg


class Stream:
    """The frames one socket sends, stamped with this stream's id and the next count."""

    def __init__(self) -> None:
        self.id = secrets.randbits(63)
        self._count = itertools.count(1)

    def envelope(self, kind: str, seq: int, sender: str, to: str, msg: Msg) -> Envelope:
        """``msg`` from ``sender`` to ``to`` as the next frame of this stream."""
        return Envelope(kind, seq, sender, to, self.id, next(self._count), time.time(), msg)


class Freshness:
    """Admits each frame of a stream once, in order (its count must grow), and the first frame
    of a stream it does not know only if sent at most :data:`FRESH_S` before ``horizon``."""

    def __init__(self) -> None:
        self._last: OrderedDict[tuple[str, int], int] = OrderedDict()  # -> last count

    def admit(self, env: Envelope, horizon: float) -> bool:
        """Whether ``env`` is fresh; ``horizon``: wall-clock time of the receiver's last read."""
        key = (env.sender, env.stream)
        last = self._last.get(key)
        if (env.count <= last) if last is not None else (env.sent < horizon - FRESH_S):
            return False
        self._last[key] = env.count
        self._last.move_to_end(key)
        if len(self._last) > MAX_STREAMS:
            self._last.popitem(last=False)
        return True


class ClusterKey:
    """What every process of a cluster shares: the HMAC secret of control frames and the ZeroMQ
    CURVE key pair of sockets off loopback. ``minimemserve keygen`` writes one to a file that
    only its owner may read; copy it to every host of the cluster."""

    def __init__(self, secret: bytes, curve: tuple[bytes, bytes]) -> None:
        """Check and keep ``secret`` (32 bytes) and ``curve`` (public, secret; Z85)."""
        public, private = curve
        if not isinstance(secret, bytes) or len(secret) != 32:
            raise ValueError("a cluster key's secret is 32 bytes")
        try:
            ok = zmq.curve_public(private) == public
        except (zmq.ZMQError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError("a cluster key's CURVE public key does not match its secret key")
        self.secret = secret
        self.curve = (public, private)

    def curve_for(self, host: str) -> tuple[bytes, bytes] | None:
        """The CURVE key pair a socket bound on ``host`` uses: none on loopback."""
        return None if host in LOOPBACK_HOSTS else self.curve

    @classmethod
    def generate(cls) -> ClusterKey:
        """A fresh random key."""
        return cls(secrets.token_bytes(32), zmq.curve_keypair())

    def save(self, path: str | Path) -> None:
        """Write the key to a new file ``path``, readable by its owner only."""
        data = {
            "secret": self.secret.hex(),
            "public": self.curve[0].decode(),
            "private": self.curve[1].decode(),
        }
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)

    @classmethod
    def load(cls, path: str | Path) -> ClusterKey:
        """Read a key file; refused when group or others may read it, or when malformed."""
        try:
            mode = os.stat(path).st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise ValueError(f"{path} is open to group or others (chmod 600 it)")
            with open(path) as f:
                data = json.load(f)
            secret, curve = bytes.fromhex(data["secret"]), (data["public"], data["private"])
            return cls(secret, tuple(k.encode("ascii") for k in curve))
        except (OSError, KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"cannot use cluster key file {path}: {e}") from None


class Unauthenticated(TransferError):
    """A frame without a valid authentication tag: dropped unanswered."""


class Codec:
    """Envelopes behind an HMAC-SHA256 tag; decoded as ``MESSAGES`` plus ``extra`` (a tool's)."""

    def __init__(self, secret: bytes, extra: tuple[type[Msg], ...] = ()) -> None:
        """Sign with ``secret`` (at least 16 bytes, shared by every process of a cluster)."""
        if not isinstance(secret, bytes) or len(secret) < 16:
            raise ValueError("the control-plane secret must be at least 16 bytes")
        self._secret = secret
        msg_type = Union[MESSAGES + tuple(extra)]  # noqa: UP007 - a runtime union of classes
        fields = [(f, msg_type if f == "msg" else t) for f, t in get_type_hints(Envelope).items()]
        env = msgspec.defstruct("Envelope", fields, forbid_unknown_fields=True)
        self._decode = msgspec.msgpack.Decoder(env).decode

    def encode(self, env: Envelope) -> bytes:
        """Tag and pack a frame (msgpack maps; message structs tagged by class name)."""
        payload = msgspec.msgpack.encode(env)
        return hmac.digest(self._secret, payload, "sha256") + payload

    def decode(self, frame: bytes) -> Envelope:
        """Check the tag, unpack and validate; raises ``Unauthenticated`` or ``TransferError``."""
        tag, payload = frame[:TAG_BYTES], frame[TAG_BYTES:]
        if not hmac.compare_digest(tag, hmac.digest(self._secret, payload, "sha256")):
            raise Unauthenticated("control frame without a valid authentication tag")
        try:
            return self._decode(payload)
        except (msgspec.DecodeError, ValueError) as e:
            raise TransferError(f"malformed control message: {e}") from None

    @staticmethod
    def origin(frame: bytes) -> tuple[int, str]:
        """The call number and sender of an authentic frame that failed validation (to
        answer it), or ``(-1, "")``."""
        try:
            env = msgspec.msgpack.decode(frame[TAG_BYTES:])
            seq, sender = env.get("seq", -1), env.get("sender", "")
        except (msgspec.DecodeError, AttributeError):
            return -1, ""
        return (seq, sender) if type(seq) is int and type(sender) is str else (-1, "")


class _ClusterMember:
    """Admits a CURVE client only if its public key is the cluster's (one key pair per
    cluster): a client with any other key fails the handshake and delivers nothing."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, client_key: bytes) -> bool:
        return hmac.compare_digest(client_key, self.public)


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
            self._auth.configure_curve_callback("*", _ClusterMember(curve[0]))
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


class Beacon:
    """Pushes a :class:`Heartbeat` signed as ``name`` to every target, each ``period_s``, from a
    thread with its own sockets (an RpcNode is not thread-safe): the targets hear from this
    process whether it is busy, blocked in a call or idle."""

    def __init__(
        self, name: str, codec: Codec, period_s: float, curve: tuple[bytes, bytes] | None = None
    ) -> None:
        """Start the thread; add targets with :meth:`add`."""
        self.name = name
        self.codec = codec
        self.period_s = period_s
        self._curve = curve
        self._targets: dict[str, str] = {}  # peer -> address, as wanted
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"beacon-{name}", daemon=True)
        self._thread.start()

    def add(self, peer: str, address: str) -> None:
        """Beat towards ``peer`` at ``address`` from now on."""
        with self._lock:
            self._targets[peer] = address

    def remove(self, peer: str) -> None:
        """Stop beating towards ``peer``."""
        with self._lock:
            self._targets.pop(peer, None)

    def _run(self) -> None:
        ctx = zmq.Context()
        ctx.setsockopt(zmq.LINGER, 0)
        ctx.setsockopt(zmq.SNDHWM, 4)  # a stopped peer queues a few beats, not a backlog
        socks: dict[str, tuple[str, zmq.Socket]] = {}
        stream = Stream()
        try:
            while not self._stop.wait(self.period_s):
                with self._lock:
                    wanted = dict(self._targets)
                for peer in [p for p in socks if socks[p][0] != wanted.get(p)]:
                    socks.pop(peer)[1].close(linger=0)
                for peer, address in wanted.items():
                    if peer not in socks:
                        sock = ctx.socket(zmq.DEALER)
                        if self._curve is not None:
                            sock.curve_serverkey = self._curve[0]
                            sock.curve_publickey, sock.curve_secretkey = self._curve
                        sock.connect(address)
                        socks[peer] = (address, sock)
                    beat = stream.envelope("push", 0, self.name, peer, Heartbeat())
                    with contextlib.suppress(zmq.ZMQError):
                        socks[peer][1].send(self.codec.encode(beat), zmq.NOBLOCK)
        finally:
            for _, sock in socks.values():
                sock.close(linger=0)
            ctx.term()

    def close(self) -> None:
        """Stop the thread and close its sockets. Idempotent."""
        self._stop.set()
        self._thread.join(5.0)
