"""The control plane's messages: ``msgspec`` structs tagged by class name and validated field by
field (types, ranges) when decoded; nothing is pickled. Transfer protocol (receiving side of
``MemPool.transfer``): AllocRequest → AllocReply, the sender writes the blocks, Commit or Abort."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from ...config import EngineConfig
from ...request import Request, RequestMetrics, RequestOutput, TokenDelta, TokenLogprob
from ...sampling import SamplingParams

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


# "auto" or a transport of the KV link table (minimemserve.links: a table a test may extend,
# so the name is checked against it where it is used, in the frontend and in the instance)
Transport = Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9_]{0,31}$")]
# What one KV link of an instance tells its peers (an agent's metadata and region for NIXL):
# bytes the control plane passes on unread, decoded and checked by the link's own class.
MAX_LINK_DATA = 1 << 20  # NIXL's is ~0.5 KiB on one host; a few per NIC
LinkData = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_LINK_DATA)]
MAX_LINKS = 16  # link data entries one instance may announce


class PeerInfo(msgspec.Struct, forbid_unknown_fields=True):
    """An instance as its peers learn it: where it listens, how to map its pool (``handle``,
    same host only), its host's identity, the KV transport (in ``Ready`` the one it asks for,
    in ``Peers`` the one the frontend chose for the pair) and ``links``: by transport, what
    that KV link of the instance tells peers reaching it so (opaque here)."""

    name: str
    role: str
    address: str
    handle: dict[str, Any] | None
    host: str = ""
    transport: Transport = "auto"
    links: Annotated[dict[Transport, LinkData], msgspec.Meta(max_length=MAX_LINKS)] = {}


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
    builds its engine with ``engine`` (checked on receipt as ``EngineConfig`` checks itself;
    the sizes set on the instance's host override it), reports ``Ready`` to
    ``frontend`` and serves until shut down, or until it hears nothing from the frontend for
    ``frontend_timeout_s``; ``linked``: peers will move KV into its pool."""

    session: str
    name: str
    config: str
    frontend: str
    engine: EngineConfig
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
