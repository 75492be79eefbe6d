"""Cross-process pieces of the multi-process runtime: RPC node, remote pool proxy, remote peer.

An :class:`RpcNode` is one process's end of the control plane: a ROUTER socket that peers
send to, and a DEALER socket per peer it sends to. Messages are the dataclasses of
:mod:`minimemserve.disagg.control` plus the runtime's own (below), msgpack-encoded in the
same envelope, so nothing is pickled. While a node waits for the answer to its own
request it keeps answering requests that reach it: prefill and decode instances call each
other (the decode side sends decode-phase KV back to the prefill side while the prefill
side is sending to it), and a node that only waited would deadlock.

:class:`RemotePool` is what a recipe sees as the peer's MemPool. It implements the
receiving side of MemPool's transfer (``recv_alloc``, ``recv_copy``/``recv_write``,
``recv_commit``, ``recv_abort``) over the control plane, with the data step writing straight
into a shared-memory view of the peer's pool tensor, so ``MemPool.transfer(remote, ...)`` and
``transfer_with_insert`` work across processes unchanged. :class:`RemotePeer` is the
``dst`` object the prefill recipe hands requests to.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from minimemserve.blocks.copy import check_packed, check_pool_tensor, move_blocks
from minimemserve.blocks.layout import KVLayout
from minimemserve.disagg.control import (
    Abort,
    Ack,
    AllocReply,
    AllocRequest,
    Commit,
    Error,
    MessageCodec,
    RemoteError,
    endpoint,
)
from minimemserve.errors import InstanceDied, TransferError
from minimemserve.request import Request, RequestMetrics, RequestOutput
from minimemserve.sampling import SamplingParams

LOOPBACK = "127.0.0.1"
# A loopback round trip takes well under a millisecond; a peer that leaves a request
# unanswered this long is dead or stuck.
DEFAULT_RPC_TIMEOUT_S = 30.0
# Longest single poll while waiting for a reply, so heartbeats and dead-peer news are seen.
WAIT_SLICE_S = 0.05
# Messages queued towards one peer before sends fail fast instead of growing memory.
SEND_HWM = 10_000


# ---- the runtime's messages (the transfer protocol's own come from control.py) --------------


@dataclass
class Ready:
    """An instance is up: where it listens and the handle of its shared hbm pool tensor."""

    name: str
    address: str
    handle: dict | None
    pid: int


@dataclass
class Peers:
    """The other instances of the deployment: ``[{name, role, address, handle}]``."""

    peers: list


@dataclass
class Submit:
    """A new request for an instance: ``{request_id, prompt_token_ids, params, arrival_time}``."""

    request: dict


@dataclass
class Accept:
    """A request whose KV was just moved to the receiver (state as :func:`request_to_dict`)."""

    request: dict


@dataclass
class Output:
    """A finished request (as :func:`output_to_dict`), pushed to the frontend."""

    output: dict


@dataclass
class Handoff:
    """The prefill instance passed ``req_id`` to decode instance ``to``."""

    req_id: str
    to: str


@dataclass
class Probe:
    """How much of ``tokens`` is cached on the receiver, and how loaded it is."""

    tokens: list


@dataclass
class ProbeReply:
    """Answer to :class:`Probe`: cached prefix length in tokens and requests queued or running."""

    cached: int
    load: int


@dataclass
class FreeMem:
    """Drop one of the sender's references on each of ``blocks`` (receiver's ids)."""

    blocks: list


@dataclass
class Query:
    """Ask for ``what``: ``"stats"``, ``"check"`` or ``"validate"`` (with ``args``)."""

    what: str
    args: dict = field(default_factory=dict)


@dataclass
class Info:
    """Answer to :class:`Query`."""

    data: dict


@dataclass
class PeerDown:
    """Instance ``name`` died: release what was held for it and stop sending to it."""

    name: str
    reason: str


@dataclass
class PushPrefix:
    """Send the cached prefix of ``tokens`` (whatever of it this instance holds) to instance
    ``to``, indexed there; the reply is ``Info({"tokens": n})`` with the tokens now cached
    on ``to`` thanks to it (0 when nothing was held)."""

    tokens: list[int]
    to: str


@dataclass
class Shutdown:
    """Stop the instance process cleanly."""

    reason: str = ""


RUNTIME_MESSAGES: tuple[type, ...] = (
    Ready,
    Peers,
    Submit,
    Accept,
    Output,
    Handoff,
    Probe,
    ProbeReply,
    FreeMem,
    Query,
    Info,
    PeerDown,
    PushPrefix,
    Shutdown,
)


def make_codec() -> MessageCodec:
    """The codec every process of the runtime uses (protocol plus runtime messages)."""
    return MessageCodec(extra=RUNTIME_MESSAGES)


# ---- request state on the wire ---------------------------------------------------------------


def params_to_dict(params: SamplingParams) -> dict:
    """Sampling parameters as plain values."""
    d = dataclasses.asdict(params)
    d["stop_token_ids"] = list(d["stop_token_ids"])
    return d


def params_from_dict(d: dict) -> SamplingParams:
    """Inverse of :func:`params_to_dict`."""
    d = dict(d)
    d["stop_token_ids"] = tuple(d.get("stop_token_ids", ()))
    return SamplingParams(**d)


def request_to_dict(req: Request) -> dict:
    """Everything a receiving instance needs to continue ``req`` (its KV already moved)."""
    return {
        "request_id": req.request_id,
        "prompt_token_ids": list(req.prompt_token_ids),
        "output_token_ids": list(req.output_token_ids),
        "params": params_to_dict(req.params),
        "arrival_time": req.arrival_time,
        "blocks": list(req.blocks),
        "num_computed": req.num_computed,
        "max_total_tokens": req.max_total_tokens,
        "prefilled": req.prefilled,
        "metrics": dataclasses.asdict(req.metrics),
        "extra": dict(req.extra),
    }


def request_from_dict(d: dict) -> Request:
    """Rebuild a :class:`Request` from :func:`request_to_dict` output."""
    req = Request(
        d["request_id"],
        list(d["prompt_token_ids"]),
        params_from_dict(d["params"]),
        arrival_time=d["arrival_time"],
    )
    req.output_token_ids = list(d["output_token_ids"])
    req.blocks = list(d["blocks"])
    req.num_computed = int(d["num_computed"])
    req.max_total_tokens = int(d["max_total_tokens"])
    req.prefilled = bool(d["prefilled"])
    req.metrics = RequestMetrics(**d["metrics"])
    req.extra = dict(d["extra"])
    return req


def output_to_dict(out: RequestOutput) -> dict:
    """A finished request's output as plain values."""
    return {
        "request_id": out.request_id,
        "prompt_token_ids": list(out.prompt_token_ids),
        "token_ids": list(out.token_ids),
        "text": out.text,
        "finish_reason": out.finish_reason,
        "metrics": dataclasses.asdict(out.metrics),
        "error": out.error,
    }


def output_from_dict(d: dict) -> RequestOutput:
    """Inverse of :func:`output_to_dict`."""
    return RequestOutput(
        request_id=d["request_id"],
        prompt_token_ids=list(d["prompt_token_ids"]),
        token_ids=list(d["token_ids"]),
        text=d["text"],
        finish_reason=d["finish_reason"],
        metrics=RequestMetrics(**d["metrics"]),
        error=d["error"],
    )


# ---- the RPC node ----------------------------------------------------------------------------

Handler = Callable[[str, Any], Any]


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
        timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
        on_wait: Callable[[], None] | None = None,
    ) -> None:
        """Bind ``host:port`` (port 0 picks a free one; see :attr:`address`)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.name = name
        self.handler = handler
        self.timeout_s = timeout_s
        self.on_wait = on_wait
        self.codec = make_codec()
        self.dead: dict[str, str] = {}  # peer name -> why it is considered dead
        self._ctx = zmq.Context()
        self._server = self._ctx.socket(zmq.ROUTER)
        self._server.setsockopt(zmq.LINGER, 0)
        self._server.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._server.setsockopt(zmq.SNDHWM, SEND_HWM)
        try:
            self._server.bind(endpoint(host, port))
        except zmq.ZMQError as e:
            self.close()
            raise TransferError(f"{name} cannot bind {host}:{port}: {e}") from e
        self.address: str = self._server.getsockopt_string(zmq.LAST_ENDPOINT)
        self._peers: dict[str, zmq.Socket] = {}
        self._seq = itertools.count(1)

    def connect(self, peer: str, address: str) -> None:
        """Open (or reopen) the sending socket towards ``peer`` at ``address``."""
        old = self._peers.pop(peer, None)
        if old is not None:
            old.close(linger=0)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.connect(address)
        self._peers[peer] = sock

    @property
    def peers(self) -> list[str]:
        """Names of the peers this node can send to."""
        return list(self._peers)

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
            env, msg = self.codec.decode(payload)
        except TransferError as e:
            self._reply(ident, -1, Error("", "TransferError", str(e)))
            return
        sender = str(env.get("from", "?"))
        try:
            reply = self.handler(sender, msg)
        except Exception as e:
            reply = Error(getattr(msg, "req_id", ""), type(e).__name__, str(e))
        if env.get("kind") == "req":
            self._reply(ident, env.get("seq", -1), Ack() if reply is None else reply)

    def _reply(self, ident: bytes, seq: int, msg: Any) -> None:
        env = {"kind": "rep", "seq": seq, "from": self.name}
        try:
            self._server.send_multipart([ident, self.codec.encode(env, msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the asker is gone; its own timeout tells it

    # -- sending ----------------------------------------------------------------------------

    def _sock(self, peer: str, op: str) -> zmq.Socket:
        if peer in self.dead:
            raise InstanceDied(f"instance {peer} is dead ({self.dead[peer]}); cannot {op}")
        sock = self._peers.get(peer)
        if sock is None:
            raise TransferError(f"{self.name} has no connection to {peer!r} ({op})")
        return sock

    def push(self, peer: str, msg: Any) -> None:
        """Send ``msg`` to ``peer`` without waiting; raises TransferError if it cannot be queued."""
        op = type(msg).__name__
        sock = self._sock(peer, op)
        env = {"kind": "push", "seq": 0, "from": self.name}
        try:
            sock.send(self.codec.encode(env, msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise TransferError(f"{peer} is not taking messages ({op}): {e}") from e

    def try_push(self, peer: str, msg: Any) -> bool:
        """:meth:`push`, but report failure as False instead of raising."""
        try:
            self.push(peer, msg)
        except TransferError:
            return False
        return True

    def call(self, peer: str, msg: Any, timeout_s: float | None = None) -> Any:
        """Send a request to ``peer`` and return its reply, serving incoming messages meanwhile.

        Raises ``InstanceDied`` when the peer is or becomes known dead, ``TransferError`` when
        it does not answer within ``timeout_s`` and ``RemoteError`` when its handler failed.
        """
        op = type(msg).__name__
        sock = self._sock(peer, op)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        seq = next(self._seq)
        env = {"kind": "req", "seq": seq, "from": self.name}
        try:
            sock.send(self.codec.encode(env, msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise TransferError(f"{peer} is not taking messages ({op}): {e}") from e
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
            if sock in events:
                while True:
                    try:
                        payload = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    renv, reply = self.codec.decode(payload)
                    if renv.get("seq") != seq:
                        continue  # the late answer to a request that timed out
                    if isinstance(reply, Error):
                        raise RemoteError(peer, op, reply.kind, reply.message)
                    return reply
            if self.on_wait is not None:
                self.on_wait()

    def close(self) -> None:
        """Close every socket and the context. Idempotent."""
        for sock in self._peers.values():
            sock.close(linger=0)
        self._peers.clear()
        if not self._server.closed:
            self._server.close(linger=0)
        if not self._ctx.closed:
            self._ctx.term()


# ---- the remote pool and peer ----------------------------------------------------------------


class RemotePool:
    """A peer instance's MemPool as the sending side of a transfer sees it.

    ``kv`` is this process's view of the peer's hbm pool tensor (shared memory, or CUDA
    IPC), so ``recv_copy`` is a one-sided write; the other receiving steps are requests to
    the peer. Blocks the peer allocated for a transfer that then fails are released there
    (``recv_abort``, best effort when the peer is gone).
    """

    def __init__(
        self,
        node: RpcNode,
        peer: str,
        kv: torch.Tensor,
        layout: KVLayout,
        dtype: torch.dtype,
    ) -> None:
        """Proxy ``peer``'s pool, whose hbm tensor this process maps as ``kv``."""
        self.node = node
        self.peer = peer
        self.instance_id = peer
        self.kv = kv
        self.layout = layout
        self.dtype = dtype
        self.block_size = layout.block_size
        self._xfers = itertools.count()
        self._xfer = ""  # id of the transfer in progress towards this peer

    def recv_alloc(
        self, tokens: Sequence[int] | None, num_blocks: int
    ) -> tuple[list[int], list[int]]:
        """Step 1 on the peer: match ``tokens`` (if given) and allocate the rest."""
        self._xfer = f"{self.node.name}>{self.peer}#{next(self._xfers)}"
        toks = None if tokens is None else [int(t) for t in tokens]
        try:
            rep = self.node.call(self.peer, AllocRequest(self._xfer, toks, int(num_blocks)))
        except TransferError:
            # the peer may have allocated before the answer got lost: ask it to let go
            self.node.try_push(self.peer, Abort(self._xfer, []))
            raise
        if not isinstance(rep, AllocReply):
            raise TransferError(f"{self.peer} answered AllocRequest with {type(rep).__name__}")
        return list(rep.matched), list(rep.new)

    def recv_write(self, blocks: Sequence[int], data: torch.Tensor) -> None:
        """Step 2 from a packed buffer: ``data`` (``layout.pool_shape(len(blocks))``) goes
        into the peer's blocks."""
        check_packed(self.layout, len(blocks), data, "recv_write")
        self.recv_copy(blocks, data, range(len(blocks)))

    def recv_copy(self, blocks: Sequence[int], src: torch.Tensor, src_ids: Sequence[int]) -> None:
        """Step 2 from this process's pool tensor ``src``: its blocks ``src_ids`` go straight
        into the peer's ``blocks`` (one-sided; one pass when ``blocks`` is one run)."""
        blocks = list(blocks)
        check_pool_tensor(self.layout, self.dtype, src, "recv_copy")
        if not blocks:
            return
        if self.peer in self.node.dead:
            raise InstanceDied(f"instance {self.peer} died before the write")
        move_blocks(self.kv, blocks, src, src_ids, self.layout.block_dim)  # one-sided write
        if self.kv.is_cuda:
            torch.cuda.current_stream(self.kv.device).synchronize()  # land before Commit

    def recv_commit(self, tokens: Sequence[int] | None, blocks: Sequence[int]) -> None:
        """Step 3 on the peer: keep ``blocks`` (indexing ``tokens`` when given)."""
        toks = None if tokens is None else [int(t) for t in tokens]
        self.node.call(self.peer, Commit(self._xfer, toks, [int(b) for b in blocks]))

    def recv_abort(self, blocks: Sequence[int]) -> None:
        """On failure: the peer releases every block it took for this transfer (best effort)."""
        self.node.try_push(self.peer, Abort(self._xfer, [int(b) for b in blocks]))

    def free_mem(self, blocks: Sequence[int], tier: str = "hbm") -> None:
        """Drop one of this process's references on the peer's ``blocks``."""
        if tier != "hbm":
            raise ValueError("a remote pool frees hbm blocks only")
        self.node.call(self.peer, FreeMem([int(b) for b in blocks]))

    def probe(self, tokens: Sequence[int]) -> ProbeReply:
        """Cached prefix length of ``tokens`` on the peer and its load."""
        rep = self.node.call(self.peer, Probe([int(t) for t in tokens]))
        if not isinstance(rep, ProbeReply):
            raise TransferError(f"{self.peer} answered Probe with {type(rep).__name__}")
        return rep

    def cached_prefix_len(self, tokens: Sequence[int]) -> int:
        """Tokens the peer's ``match(tokens)`` would return now."""
        return self.probe(tokens).cached

    def __repr__(self) -> str:
        return f"RemotePool(peer={self.peer!r}, via={self.node.name!r})"


class RemotePeer:
    """A peer instance as recipes see it: ``.pool`` to transfer into, ``.accept`` to hand off.

    ``accept`` never raises: when the peer cannot take the request the failure is written
    into ``req.extra["handoff_error"]`` and the peer is asked to drop the blocks it holds
    for it, so the engine's hand-off path stays the same and the instance reports the error.
    """

    def __init__(self, name: str, role: str, pool: RemotePool) -> None:
        """Wrap ``pool`` (the peer's remote pool) under the peer's ``name`` and ``role``."""
        self.name = name
        self.role = role
        self.pool = pool

    def accept(self, req: Request) -> None:
        """Pass ``req`` (its ``blocks`` already ids in the peer's pool) to the peer."""
        req.extra["decode_instance"] = self.name
        try:
            self.pool.node.call(self.name, Accept(request_to_dict(req)))
        except TransferError as e:
            req.extra["handoff_error"] = f"{type(e).__name__}: {e}"
            self.pool.node.try_push(self.name, FreeMem(list(req.blocks)))
        req.blocks = []  # the peer's ids: never this instance's to free

    def __repr__(self) -> str:
        return f"RemotePeer({self.name!r}, role={self.role!r})"
