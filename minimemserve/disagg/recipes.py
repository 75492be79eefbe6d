"""Recipes: which MemPool calls run at each hook of a request, per role and caching milestone.

A request has five hooks on an instance: on arrival (admitted with no KV yet), once
prefilled (its first token was sampled), on finish (done or aborted), on preemption
(released to be recomputed) and on failure (released without caching). A recipe lists the
pool calls of each hook; a milestone gives one recipe per role. This table is the whole
difference between the deployments: the engine, schedulers, model and kernels are shared,
and every other place that needs to know what a deployment caches or transfers reads it here.

| milestone    | role      | arrival | prefilled                         | finish                  |
|--------------|-----------|---------|-----------------------------------|-------------------------|
| PD           | colocated | —       | —                                 | free                    |
| PD-CC        | colocated | match   | —                                 | insert, free            |
| PD-Basic     | prefill   | —       | transfer                          | free                    |
|              | decode    | —       | —                                 | free                    |
| PD-Caching-1 | prefill   | match   | insert, transfer                  | insert, free            |
|              | decode    | —       | —                                 | free                    |
| PD-Caching-2 | prefill   | match   | insert, transfer_with_insert      | insert, free            |
|              | decode    | match   | —                                 | insert, free            |
| PD-Caching-3 | prefill   | match   | insert, transfer_with_insert      | insert, free            |
|              | decode    | match   | —                                 | send_back, insert, free |

``transfer`` / ``transfer_with_insert`` move the computed KV to a decode instance (which, with
insert, matches its own index and receives only the blocks it lacks), ``free_mem`` it here
and hand the request over. Preemption runs ``insert, free`` where the role caches and ``free``
otherwise; failure always runs ``free``. ``send_back`` is ``transfer_with_insert`` of the
decode-phase KV to the prefill instance, so the next turn's hit there covers the answer too.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import PoolExhausted, RemoteError, TransferError
from ..request import Request

logger = logging.getLogger(__name__)


class Hook(str, enum.Enum):
    """The points of a request's life where a recipe runs pool calls."""

    ARRIVAL = "arrival"
    PREFILLED = "prefilled"
    FINISH = "finish"
    PREEMPT = "preempt"
    FAILURE = "failure"


class Outcome(enum.Enum):
    """What a hook did with the request: it stays, moved to another instance, must wait
    (every decode instance is full: it keeps its KV here and tries again), or failed."""

    KEEP = "keep"
    HANDED_OFF = "handed_off"
    LATER = "later"
    FAILED = "failed"


class Peer(Protocol):
    """Another instance as a recipe sees it: its pool, and a way to hand it a request."""

    name: str
    pool: Any  # a MemPool, or a proxy of a remote one

    def accept(self, req: Request) -> None:
        """Take over ``req`` (its ``blocks`` already ids in this peer's pool); may raise
        ``TransferError``, after which the peer holds nothing of it."""
        ...


class Peers(Protocol):
    """What the transfer calls of a recipe need from the instance's surroundings."""

    def pick_decode(self, req: Request, exclude: Sequence[str]) -> Peer | None:
        """The decode instance to continue ``req`` on, not one in ``exclude``, with room for
        the whole request; None when every live one is full (backpressure); raises
        ``InstanceDied`` (a ``TransferError``) naming why when none is alive."""
        ...

    def prefill_pool(self, req: Request) -> Any:
        """The pool of the instance that prefilled ``req`` (for sending decode-phase KV back)."""
        ...

    def peer_failed(self, name: str, error: TransferError) -> None:
        """A transfer to ``name`` failed with ``error`` (the peer may be dead)."""
        ...


# ---- the pool calls -----------------------------------------------------------------------


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
    req.blocks = []
    req.num_computed = 0


def _sent_bytes(pool) -> int:
    return pool.stats()["counters"]["sent_bytes"]


def _hand_off(pool, req: Request, peers: Peers, with_insert: bool) -> Outcome:
    """Send the computed KV to a decode instance, free it here, hand the request over.

    A failed transfer leaves the blocks here and the next decode instance is tried; with
    none left the request fails (its error says why)."""
    tokens = req.tokens[: req.num_computed]
    src = req.blocks[: pool.layout.num_blocks_for(req.num_computed)]
    tried: list[str] = []
    while True:
        try:
            peer = peers.pick_decode(req, tried)
        except TransferError as e:  # no decode instance left
            req.error = f"{type(e).__name__}: {e}"
            return Outcome.FAILED
        if peer is None:
            return Outcome.LATER
        before = _sent_bytes(pool)
        try:
            if with_insert:
                got = pool.transfer_with_insert(peer.pool, tokens, src)
            else:
                got = pool.transfer(peer.pool, src)
        except PoolExhausted:  # filled up since it said it had room: wait, as when full
            return Outcome.LATER
        except RemoteError as e:
            if e.kind == "PoolExhausted":
                return Outcome.LATER
            tried.append(peer.name)
            peers.peer_failed(peer.name, e)
            continue
        except TransferError as e:
            tried.append(peer.name)
            peers.peer_failed(peer.name, e)
            continue
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
        p_pool = peers.prefill_pool(req)
        got = pool.transfer_with_insert(
            p_pool, req.tokens[: whole * pool.block_size], req.blocks[:whole]
        )
        p_pool.free_mem(got)  # the prefill pool's index keeps its own references
    except (TransferError, PoolExhausted) as e:  # the answer stands; the next hit is smaller
        logger.warning("request %s: decode-phase KV not sent back: %s", req.request_id, e)
    req.metrics.transferred_bytes += _sent_bytes(pool) - before


OPS = {
    "match": _match,
    "insert": _insert,
    "free": _free,
    "transfer": lambda pool, req, peers: _hand_off(pool, req, peers, with_insert=False),
    "transfer_with_insert": lambda pool, req, peers: _hand_off(pool, req, peers, True),
    "send_back": _send_back,
}
TRANSFER_OPS = frozenset({"transfer", "transfer_with_insert", "send_back"})


# ---- the table ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Recipe:
    """The pool calls (names in ``OPS``) of one role at each hook."""

    arrival: tuple[str, ...] = ()
    prefilled: tuple[str, ...] = ()
    finish: tuple[str, ...] = ("free",)
    preempt: tuple[str, ...] = ("free",)
    failure: tuple[str, ...] = ("free",)

    def __post_init__(self) -> None:
        unknown = {op for ops in self.hooks().values() for op in ops} - OPS.keys()
        if unknown:
            raise ValueError(f"unknown pool calls in a recipe: {sorted(unknown)}")

    def hooks(self) -> dict[str, tuple[str, ...]]:
        """``{hook name: pool calls}``."""
        return {h.value: getattr(self, h.value) for h in Hook}

    @property
    def caches(self) -> bool:
        """Whether this role keeps a prefix cache (it matches on arrival)."""
        return "match" in self.arrival

    def run(self, hook: Hook, pool, req: Request, peers: Peers | None = None) -> Outcome:
        """Run the pool calls of ``hook`` on ``req``; a hand-off or failure ends the hook."""
        for op in getattr(self, hook.value):
            outcome = OPS[op](pool, req, peers)
            if outcome is not None:
                return outcome
        return Outcome.KEEP


NOTHING, PROMPT, PROMPT_AND_OUTPUT = "nothing", "prompt", "prompt and output"


@dataclass(frozen=True)
class Milestone:
    """A caching milestone: one recipe per role (the first role takes new requests), and
    what a finished request leaves cached on the instance it entered (``caches``)."""

    name: str
    recipes: dict[str, Recipe] = field(hash=False)
    caches: str = NOTHING

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

    def left_cached(self, prompt: Sequence[int], output: Sequence[int]) -> list[int] | None:
        """The tokens a finished request left cached on its entry instance (None: nothing)."""
        kept = {NOTHING: None, PROMPT: list(prompt), PROMPT_AND_OUTPUT: [*prompt, *output[:-1]]}
        return kept[self.caches]


_CACHED = ("insert", "free")
_PREFILL_CC1 = Recipe(("match",), ("insert", "transfer"), _CACHED, _CACHED)
_PREFILL_CC2 = Recipe(("match",), ("insert", "transfer_with_insert"), _CACHED, _CACHED)
_DECODE_CC2 = Recipe(("match",), (), _CACHED, _CACHED)

MILESTONES = {
    m.name: m
    for m in (
        Milestone("PD", {"colocated": Recipe()}),
        Milestone(
            "PD-CC", {"colocated": Recipe(("match",), (), _CACHED, _CACHED)}, PROMPT_AND_OUTPUT
        ),
        Milestone("PD-Basic", {"prefill": Recipe((), ("transfer",)), "decode": Recipe()}),
        Milestone("PD-Caching-1", {"prefill": _PREFILL_CC1, "decode": Recipe()}, PROMPT),
        Milestone("PD-Caching-2", {"prefill": _PREFILL_CC2, "decode": _DECODE_CC2}, PROMPT),
        Milestone(
            "PD-Caching-3",
            {
                "prefill": _PREFILL_CC2,
                "decode": Recipe(("match",), (), ("send_back", *_CACHED), _CACHED),
            },
            PROMPT_AND_OUTPUT,
        ),
    )
}
