"""What makes a control frame trusted: the :class:`Envelope` it travels in, stamped by its
sender's :class:`Stream`; the HMAC :class:`Codec` of the cluster's secret (made by the frontend
and handed to the instances it spawns, or a :class:`ClusterKey` file, never on a command line);
and :class:`Freshness`. A frame without a valid tag is dropped unanswered, loopback included;
the tag covers the sender, the receiver and the frame's place in its sender's stream (a random
id per sending socket and a counter), so a captured frame replayed to any node is dropped and
counted. Off loopback, sockets are CURVE-encrypted with the cluster's key pair."""

from __future__ import annotations

import hmac
import itertools
import json
import os
import secrets
import stat
import time
from collections import OrderedDict
from pathlib import Path
from typing import Literal, Union, get_type_hints

import msgspec
import zmq

from ...config import LOOPBACK
from ...errors import TransferError
from .messages import MESSAGES, Msg

LOOPBACK_HOSTS = frozenset({LOOPBACK, "localhost", "::1"})
TAG_BYTES = 32  # HMAC-SHA256 of the payload, sent in front of it
# How old (sender's clock) the first frame of a stream a node has not seen may be, counted back
# from the node's last read (an idle node blames no frame for waiting): hosts' clocks agree to
# well within it, and a frame captured earlier is refused.
FRESH_S = 30.0
# Streams (sending sockets) a node remembers, least recently heard first to go: a cluster opens
# a few per peer and reconnection.
MAX_STREAMS = 4096


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


class ClusterMember:
    """Admits a CURVE client only if its public key is the cluster's (one key pair per
    cluster): a client with any other key fails the handshake and delivers nothing."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, client_key: bytes) -> bool:
        return hmac.compare_digest(client_key, self.public)
