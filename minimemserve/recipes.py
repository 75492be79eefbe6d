"""Recipes: which MemPool calls run at each hook of a request, per role and caching milestone.

Hooks: arrival (admitted, no KV yet), prefilled (first token sampled), finish (done or
aborted), preempt (released to be recomputed), failure (released without caching). This
table is the whole difference between deployments; all other code is shared and reads it.

| milestone    | role      | arrival | prefilled                         | finish                  |
|--------------|-----------|---------|-----------------------------------|-------------------------|
| PD           | colocated | —       | —                                 | free                    |
| PD-CC        | colocated | match   | insert                            | insert, free            |
| PD-Basic     | prefill   | —       | transfer                          | free                    |
|              | decode    | —       | —                                 | free                    |
| PD-Caching-1 | prefill   | match   | insert, transfer                  | insert, free            |
|              | decode    | —       | —                                 | free                    |
| PD-Caching-2 | prefill   | match   | insert, transfer_with_insert      | insert, free            |
|              | decode    | match   | —                                 | insert, free            |
| PD-Caching-3 | prefill   | match   | insert, transfer_with_insert      | insert, free            |
|              | decode    | match   | —                                 | send_back, insert, free |

``transfer[_with_insert]`` sends the computed KV to a decode instance (with insert, only blocks it
lacks), frees it here and hands the request over; ``send_back`` returns decode-phase KV to P for
its next hit. Preempt runs ``insert, free`` where the role caches, else ``free``."""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from .blocks.layout import KVLayout
from .errors import InstanceDied, PoolExhausted, RemoteError, TransferError
from .mempool.transfer import KVReceiver
from .request import Request

logger = logging.getLogger(__name__)


class Role(str, enum.Enum):
    """An instance's job in a deployment: both phases of a request (colocated), or one."""

    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"

    def __str__(self) -> str:
        return self.value


class Hook(str, enum.Enum):
    """The points of a request's life where a recipe runs pool calls."""

    ARRIVAL = "arrival"
    PREFILLED = "prefilled"
    FINISH = "finish"
    PREEMPT = "preempt"
    FAILURE = "failure"


class Outcome(enum.Enum):
    """What a hook did: keep, handed off, later (all decodes full: retry, KV kept here), failed."""

    KEEP = "keep"
    HANDED_OFF = "handed_off"
    LATER = "later"
    FAILED = "failed"


class Peer(Protocol):
    """Another instance as a recipe sees it: its pool, and a way to hand it a request."""

    name: str
    pool: KVReceiver  # a MemPool, or a proxy of a remote one

    def accept(self, req: Request) -> None:
        """Take over ``req`` (its ``blocks`` are ids here); on ``TransferError`` it holds none."""


class Peers(Protocol):
    """What the transfer calls of a recipe need from the instance's surroundings."""

    def decodes(self) -> Mapping[str, Peer]:
        """The live decode instances a request may be handed to, by name."""

    def decodes_down(self) -> Mapping[str, str]:
        """The decode instances that died, and why (for the error when none is left)."""

    def offer(self, peer: Peer, blocks: int, tokens: Sequence[int]) -> tuple[int, int] | None:
        """``(load, cached tokens of tokens)`` of ``peer`` if it has room for ``blocks`` more
        blocks; None when it is full or did not answer."""

    def prefill_pool(self, req: Request) -> KVReceiver:
        """The pool of the instance that prefilled ``req`` (for sending decode-phase KV back)."""

    def peer_failed(self, name: str, error: TransferError) -> None:
        """A transfer to ``name`` failed with ``error`` (the peer may be dead)."""

    def clock(self) -> float:
        """Now in seconds (hand-offs are timed with it): wall time, or a simulator's."""


def decode_preference(load: int, cached_tokens: int) -> tuple[int, int]:
    """How hand-offs choose among decode instances with room (the largest wins): the least
    loaded, then the one holding most of the request. Where it decodes weighs on every step of
    the answer; what it holds saves only part of one copy."""
    return (-load, cached_tokens)


def pick_decode(
    peers: Peers, req: Request, exclude: Sequence[str], layout: KVLayout
) -> Peer | None:
    """The decode instance, not in ``exclude``, with room to continue all of ``req``, by
    ``decode_preference``; None when every live one is full (backpressure); raises
    ``InstanceDied`` when none is left."""
    live = {name: p for name, p in peers.decodes().items() if name not in exclude}
    if not live:
        gone = {name: "refused" for name in exclude} | dict(peers.decodes_down())
        why = ", ".join(f"{name}: {reason}" for name, reason in gone.items()) or "none"
        raise InstanceDied(f"no live decode instance left to continue the request ({why})")
    blocks = layout.num_blocks_for(req.max_total_tokens)
    tokens = req.tokens[: req.num_computed]
    offers = {n: o for n, p in live.items() if (o := peers.offer(p, blocks, tokens)) is not None}
    best = max(offers, key=lambda n: decode_preference(*offers[n]), default=None)
    return None if best is None else live[best]


def _match(pool, req: Request, peers: Peers | None) -> None:
    """``match`` all but the last token (one token is always computed, for its logits)."""
    req.blocks = pool.match(req.tokens[: req.num_tokens - 1])
    req.num_computed = len(req.blocks) * pool.block_size
    if req.metrics.preemptions == 0:
        req.metrics.cached_tokens = req.num_computed


def _insert(pool, req: Request, peers: Peers | None) -> None:
    if req.blocks and req.num_computed:
        pool.insert(req.tokens[: req.num_computed], req.blocks)


def _free(pool, req: Request, peers: Peers | None) -> None:
    if req.blocks:
        pool.free_mem(req.blocks)
    req.blocks, req.num_computed = [], 0


def _sent_bytes(pool) -> int:
    return pool.counters["sent_bytes"]


def _hand_off(pool, req: Request, peers: Peers, with_insert: bool) -> Outcome:
    """Send the computed KV to a decode instance (the next one if that fails), hand ``req`` over."""
    tokens = req.tokens[: req.num_computed]
    src = req.blocks[: pool.layout.num_blocks_for(req.num_computed)]
    tried: list[str] = []
    while True:
        try:
            peer = pick_decode(peers, req, tried, pool.layout)
        except TransferError as e:  # no decode instance left
            req.error = f"{type(e).__name__}: {e}"
            return Outcome.FAILED
        if peer is None:
            return Outcome.LATER
        before, began = _sent_bytes(pool), peers.clock()
        try:
            if with_insert:
                got = pool.transfer_with_insert(peer.pool, tokens, src)
            else:
                got = pool.transfer(peer.pool, src)
        except PoolExhausted:  # filled up since it said it had room: wait, as when full
            return Outcome.LATER
        except TransferError as e:
            if isinstance(e, RemoteError) and e.kind == "PoolExhausted":
                return Outcome.LATER
            tried.append(peer.name)
            peers.peer_failed(peer.name, e)
            continue
        req.metrics.handoff_seconds += peers.clock() - began
        req.metrics.handoff_bytes += _sent_bytes(pool) - before
        req.metrics.transferred_bytes += _sent_bytes(pool) - before
        pool.free_mem(req.blocks)
        req.blocks = got
        try:
            peer.accept(req)
        except TransferError as e:  # the peer released what it held for the request
            req.blocks, req.num_computed = [], 0
            req.error = f"{type(e).__name__}: {e}"
            return Outcome.FAILED
        return Outcome.HANDED_OFF


def _send_back(pool, req: Request, peers: Peers) -> None:
    """``transfer_with_insert`` the whole blocks of the sequence to the prefill instance."""
    whole = req.num_computed // pool.block_size
    if not (req.blocks and whole):
        return
    before = _sent_bytes(pool)
    try:
        dst, n = peers.prefill_pool(req), whole * pool.block_size
        got = pool.transfer_with_insert(dst, req.tokens[:n], req.blocks[:whole])
        dst.free_mem(got)  # the prefill pool's index keeps its own references
    except (TransferError, PoolExhausted) as e:  # the answer stands; the next hit is smaller
        logger.info("request %s: decode-phase KV not sent back: %s", req.request_id, e)
    req.metrics.transferred_bytes += _sent_bytes(pool) - before


OPS = {
    "match": _match,
    "insert": _insert,
    "free": _free,
    "send_back": _send_back,
    "transfer": partial(_hand_off, with_insert=False),
    "transfer_with_insert": partial(_hand_off, with_insert=True),
}
HANDOFF_OPS = frozenset({"transfer", "transfer_with_insert"})
TRANSFER_OPS = HANDOFF_OPS | {"send_back"}


@dataclass(frozen=True)
class Recipe:
    """The pool calls (names in ``OPS``) of one role at each hook."""

    arrival: tuple[str, ...] = ()
    prefilled: tuple[str, ...] = ()
    finish: tuple[str, ...] = ("free",)
    preempt: tuple[str, ...] = ("free",)
    failure: tuple[str, ...] = ("free",)

    def __post_init__(self) -> None:
        if unknown := {op for ops in self.hooks().values() for op in ops} - OPS.keys():
            raise ValueError(f"unknown pool calls in a recipe: {sorted(unknown)}")

    def hooks(self) -> dict[str, tuple[str, ...]]:
        """``{hook name: pool calls}``."""
        return {h.value: getattr(self, h.value) for h in Hook}

    @property
    def hands_off(self) -> bool:
        """Whether this role hands requests to another instance once prefilled."""
        return bool(set(self.prefilled) & HANDOFF_OPS)

    @property
    def caches(self) -> bool:
        """Whether this role keeps a prefix cache (it matches on arrival)."""
        return "match" in self.arrival

    def run(self, hook: Hook, pool, req: Request, peers: Peers | None = None) -> Outcome:
        """Run the pool calls of ``hook`` on ``req``; a hand-off or failure ends the hook."""
        for op in getattr(self, hook.value):
            if (outcome := OPS[op](pool, req, peers)) is not None:
                return outcome
        return Outcome.KEEP


@dataclass(frozen=True)
class Milestone:
    """A caching milestone: one recipe per role, the entry role first."""

    name: str
    recipes: dict[str, Recipe] = field(hash=False)

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles, the entry role first."""
        return tuple(self.recipes)

    @property
    def moves_kv(self) -> bool:
        """Whether any recipe transfers KV between instances."""
        return any(
            set(ops) & TRANSFER_OPS for r in self.recipes.values() for ops in r.hooks().values()
        )

    @property
    def entry_caches(self) -> bool:
        """Whether the instances that take new requests keep a prefix cache."""
        return self.recipes[self.roles[0]].caches


_CACHED = ("insert", "free")
# PD-CC colocated, and a caching decode (whose requests arrive prefilled): the prompt is
# shareable once computed, so concurrent requests with the same prefix (n > 1) hit it
_CACHING = Recipe(("match",), ("insert",), _CACHED, _CACHED)
_P_CC1 = Recipe(("match",), ("insert", "transfer"), _CACHED, _CACHED)
_P_CC2 = Recipe(("match",), ("insert", "transfer_with_insert"), _CACHED, _CACHED)
_D_CC3 = Recipe(("match",), (), ("send_back", *_CACHED), _CACHED)

MILESTONES = {
    m.name: m
    for m in (
        Milestone("PD", {Role.COLOCATED: Recipe()}),
        Milestone("PD-CC", {Role.COLOCATED: _CACHING}),
        Milestone("PD-Basic", {Role.PREFILL: Recipe((), ("transfer",)), Role.DECODE: Recipe()}),
        Milestone("PD-Caching-1", {Role.PREFILL: _P_CC1, Role.DECODE: Recipe()}),
        Milestone("PD-Caching-2", {Role.PREFILL: _P_CC2, Role.DECODE: _CACHING}),
        Milestone("PD-Caching-3", {Role.PREFILL: _P_CC2, Role.DECODE: _D_CC3}),
    )
}
