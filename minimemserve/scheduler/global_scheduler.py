"""The global scheduler: which instance serves a request, judged by global prompt trees.

Per instance, a prompt tree holds the prefixes finished requests left cached there, for a
TTL (instances evict on their own). A prompt of ``x`` tokens goes where one more request
costs least, in time summed over it and the requests already there::

    cost_p = waiting_p + (1 + n_p) * exec(x, y_p) + n_p * L * decode(x)

``y_p`` is the fraction believed cached on ``p``; ``exec`` the predicted prefill, which the
request waits for and which holds up each of the ``n_p`` requests decoding on ``p``;
``waiting_p`` the prefills routed to ``p`` and not yet begun, which go first; ``decode(x)``
what one more sequence adds to a decode step, which the request pays beside each of the
``n_p`` others and they beside it while both run: for half an answer on average (a running
request is half-way through its answer), an answer being the ``L`` tokens answers have had on
average so far (at most the request's ``max_tokens``). ``prompt_tree``, the paper's policy, also
weighs moving a cache instead of recomputing it: the instance ``q`` holding most of the prompt
sends ``p`` the part it lacks first, for ``transfer(y_q - y_p)``, and ``p`` then computes
``exec(x, y_q)``. ``prompt_tree_local`` never moves a prefix: a prompt hits only what its
instance holds. The policies are a table, :data:`ROUTING`. The scheduler only decides; its owner,
the ``Frontend`` (``frontend.py``), submits, moves KV and reports back (first tokens, hand-offs,
ends). Not thread-safe."""

from __future__ import annotations

import itertools
import time
import zlib
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from minimemserve.errors import ConfigError, InstanceDied, InvalidRequest
from minimemserve.mempool.radix import RadixTree, as_tokens

# Expired entries on paths no lookup walks are swept this often, so the trees stay bounded.
SWEEP_EVERY_S = 10.0
# How long a prompt-tree entry is trusted after its request finished (instances evict on
# their own; a stale entry costs one misrouted request, a short one forgets useful caches).
DEFAULT_TTL_S = 600.0
# The longest session id a request may carry (the ``session`` policy hashes it).
MAX_SESSION_ID = 256
# Without a fitted model, time is counted in prompt tokens. A step costs this many on top
# of its new tokens (the model fitted for the tiny preset on this CPU: a lone decode step
# ~7.5 ms, a prefill token ~0.6 ms), so a decode is not mistaken for nearly free.
STEP_TOKENS = 16
# Moving one token's KV between instances costs this fraction of computing it (tiny
# preset here: ~16 KiB per token at ~15 GB/s, against ~0.6 ms of prefill compute).
UNIT_TRANSFER_COST = 0.01
Clock = Callable[[], float]  # monotonic seconds


class Cost(Protocol):
    """What the scheduler needs of a cost model (``CostModel`` fits one from measurements)."""

    def exec(self, x: int, y: float) -> float:
        """Predicted prefill time of ``x`` prompt tokens with a fraction ``y`` cached."""

    def decode(self, x: int) -> float:
        """Predicted time one more sequence of ``x`` tokens adds to a decode step."""

    def transfer(self, num_tokens: int) -> float:
        """Predicted time to move the KV of ``num_tokens`` tokens between instances."""


class TokenCost:
    """The cost model used when none was fitted: time is counted in prompt tokens."""

    def exec(self, x: int, y: float) -> float:
        """New tokens to compute, ``x * (1 - y)``, plus a step's fixed ``STEP_TOKENS``."""
        return x * (1.0 - y) + STEP_TOKENS

    def decode(self, x: int) -> float:
        """One token: a decode row through the model."""
        return 1.0

    def transfer(self, num_tokens: int) -> float:
        """A transferred token costs ``UNIT_TRANSFER_COST`` of a computed one."""
        return UNIT_TRANSFER_COST * num_tokens


@dataclass(frozen=True)
class Route:
    """Where a request goes, its expected prefix hit there (after any transfer) and predicted queue
    plus prefill ``cost``; ``transfer_from`` first sends it a ``transfer_tokens``-token prefix."""

    instance: str
    cached_tokens: int
    cost: float
    transfer_from: str | None = None
    transfer_tokens: int = 0


class PromptTrees:
    """Per instance, a radix tree of ``block_size``-token prefixes believed cached there,
    each entry living ``ttl_s`` seconds (exact per instance: a prefix may live on several)."""

    def __init__(
        self, block_size: int, ttl_s: float = DEFAULT_TTL_S, clock: Clock = time.monotonic
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.block_size = block_size
        self.ttl_s = ttl_s
        self._clock = clock
        self._trees: dict[str, RadixTree] = {}

    def add(self, name: str) -> None:
        """Start an empty tree for ``name`` (no-op when it has one)."""
        self._trees.setdefault(name, RadixTree(self.block_size, clock=self._clock))

    def drop(self, name: str) -> None:
        """Forget ``name`` and everything believed cached there."""
        self._trees.pop(name, None)

    def record(self, name: str, tokens: Sequence[int]) -> None:
        """``tokens`` (whole blocks of them) are now cached on ``name``; renews their TTL."""
        tree, toks = self._trees.get(name), as_tokens(tokens)  # no tree: dropped meanwhile
        whole = len(toks) - len(toks) % self.block_size
        if tree is not None and whole:
            tree.insert(toks[:whole], [0] * (whole // self.block_size), ttl=self.ttl_s)

    def forget(self, name: str, path: Sequence[int]) -> None:
        """``name`` evicted the subtree whose token path ends with ``path``'s last block."""
        tree, toks = self._trees.get(name), as_tokens(path)
        m = None if tree is None else tree.match_prefix(toks, touch=False)
        if m is None or m.num_tokens != len(toks) or not m.nodes or len(toks) % self.block_size:
            return  # not believed cached there: nothing to forget
        node = m.nodes[-1]
        last = len(m.values) - sum(len(n.values) for n in m.nodes[:-1]) - 1  # index in node
        tree.truncate(node, len(node.values) - last)

    def cached(self, name: str, tokens: Sequence[int]) -> int:
        """Tokens of ``tokens``' prefix believed cached on ``name`` (whole blocks)."""
        tree = self._trees.get(name)
        return 0 if tree is None else tree.match_prefix(tokens).num_tokens

    def expire(self) -> int:
        """Drop every expired entry now; returns how many blocks were dropped."""
        return sum(len(v) for t in self._trees.values() for _, v in t.expire())

    def num_blocks(self, name: str) -> int:
        """Blocks in ``name``'s tree."""
        tree = self._trees.get(name)
        return 0 if tree is None else tree.num_blocks


@dataclass(slots=True)
class _Queued:
    instance: str
    prefill: float  # predicted prefill time
    started: bool = False  # its first token is out: it decodes (or is handed over)
    active: bool = True  # still weighing on the instance (not handed to a decode instance)


class GlobalScheduler:
    """Routes requests over named instances of one kind by ``policy`` (see the module). Without
    ``caching`` (no prefix cache on instances) tree policies reduce to the shortest queue."""

    def __init__(
        self,
        instances: Sequence[str],
        *,
        policy: str = "prompt_tree",
        block_size: int = 16,
        cost_model: Cost | None = None,
        ttl_s: float = DEFAULT_TTL_S,
        caching: bool = True,
        clock: Clock = time.monotonic,
    ) -> None:
        if policy not in ROUTING:
            raise ConfigError(f"unknown routing policy {policy!r}; choose from {ROUTING_POLICIES}")
        if not instances:
            raise ValueError("a global scheduler needs at least one instance")
        if len(set(instances)) != len(instances):
            raise ValueError(f"instance names repeat: {list(instances)}")
        self.policy = policy
        self.block_size = block_size
        self.caching = caching
        self.cost = cost_model or TokenCost()
        self._clock = clock
        self._last_sweep = clock()
        self.trees = PromptTrees(block_size, ttl_s, clock)
        self.live = list(instances)
        for name in instances:
            self.trees.add(name)
        self._queued: dict[str, _Queued] = {}
        self._rr = itertools.count()
        self.num_transfers = 0  # routes that asked for a prefix transfer
        self._answers = [0, 0]  # output tokens and requests finished: the mean answer length
        self._last_exec: tuple[tuple[int, int] | None, float] = (None, 0.0)  # see _exec
        self.dispatches: Counter[str] = Counter()  # requests sent to each instance

    def add(self, name: str) -> None:
        """Route to ``name`` (again), starting from an empty prompt tree."""
        if name not in self.live:
            self.live.append(name)
        self.trees.add(name)

    def drop(self, name: str) -> list[str]:
        """Remove a dead instance; returns the request ids that were routed to it."""
        self.live = [p for p in self.live if p != name]
        self.trees.drop(name)
        lost = [rid for rid, q in self._queued.items() if q.instance == name]
        self._queued = {rid: q for rid, q in self._queued.items() if q.instance != name}
        return lost

    def queued_cost(self, name: str) -> float:
        """Predicted prefills routed to ``name`` and not yet begun (a new prompt waits for them)."""
        mine = self._mine(name)
        return sum(q.prefill for q in mine if not q.started)

    def decoding(self, name: str) -> int:
        """Requests decoding on ``name`` (first token out, not finished or handed over)."""
        return sum(1 for q in self._mine(name) if q.started)

    def _mine(self, name: str) -> list[_Queued]:
        return [q for q in self._queued.values() if q.instance == name and q.active]

    def answer_tokens(self, max_tokens: int | None = None) -> float:
        """The mean answer length of finished requests (``max_tokens`` until one finished),
        at most ``max_tokens``."""
        tokens, done = self._answers
        mean = tokens / done if done else (max_tokens or 0)
        return mean if max_tokens is None else min(mean, max_tokens)

    def marginal_cost(self, name: str, x: int, cached: int, max_tokens: int | None = None) -> float:
        """What one more request of ``x`` prompt tokens, ``cached`` of them held there, costs
        on ``name`` (see the module docstring)."""
        base, n = self._load(name, x, max_tokens)
        return base + (1 + n) * self._exec(x, cached)

    def _load(self, name: str, x: int, max_tokens: int | None) -> tuple[float, int]:
        """The part of :meth:`marginal_cost` the cache does not change (waiting prefills and
        shared decode steps), and the requests decoding on ``name``."""
        n = self.decoding(name)
        decode = n * self.answer_tokens(max_tokens) * self.cost.decode(x) if n else 0.0
        return self.queued_cost(name) + decode, n

    def _loads(self, x: int, max_tokens: int | None) -> dict[str, tuple[float, int]]:
        """:meth:`_load` of every live instance, from one pass over the queue."""
        waiting: dict[str, list[float]] = {p: [] for p in self.live}
        decoding = dict.fromkeys(self.live, 0)
        for q in self._queued.values():
            if q.active and q.instance in waiting:
                if q.started:
                    decoding[q.instance] += 1
                else:
                    waiting[q.instance].append(q.prefill)
        if any(decoding.values()):
            answer, step = self.answer_tokens(max_tokens), self.cost.decode(x)
        out = {}
        for p, n in decoding.items():
            decode = n * answer * step if n else 0.0
            out[p] = (sum(waiting[p]) + decode, n)
        return out

    def queued_requests(self, name: str) -> int:
        """Unfinished requests routed to ``name``."""
        return sum(1 for q in self._queued.values() if q.instance == name and q.active)

    def route(
        self, tokens: Sequence[int], max_tokens: int | None = None, session_id: str | None = None
    ) -> Route:
        """Pick the instance for a prompt that may be answered in up to ``max_tokens``, sent in
        the conversation ``session_id`` (None: unknown); raises ``InstanceDied`` when none is
        live."""
        if session_id is not None and not (
            isinstance(session_id, str) and 0 < len(session_id) <= MAX_SESSION_ID
        ):
            raise InvalidRequest(
                f"session_id must be a string of 1 to {MAX_SESSION_ID} characters, "
                f"got {session_id!r:.80}"
            )
        if not self.live:
            raise InstanceDied("no live instance to route to")
        toks = as_tokens(tokens)
        if not toks:
            raise InvalidRequest("empty prompt: nothing to route")
        if (now := self._clock()) - self._last_sweep >= SWEEP_EVERY_S:
            self._last_sweep = now
            self.trees.expire()
        rule = ROUTING[self.policy]
        if rule.pick is None:
            cached = {p: self.cached_tokens(p, toks) for p in self.live}
            return self._by_cost(len(toks), cached, max_tokens)
        name = rule.pick(self, toks, session_id)
        cached = self.cached_tokens(name, toks)
        return Route(name, cached, self.marginal_cost(name, len(toks), cached, max_tokens))

    def cached_tokens(self, name: str, tokens: Sequence[int]) -> int:
        """Tokens of ``tokens`` believed cached on ``name``, but the last (always computed)."""
        if not self.caching or not tokens:
            return 0
        return min(self.trees.cached(name, tokens), len(tokens) - 1)

    def _exec(self, x: int, cached: int) -> float:
        """``cost.exec`` of a prompt of ``x`` tokens, ``cached`` of them cached there; the last
        remembered (a prompt is priced as it is routed, then again as it is dispatched)."""
        key, seconds = self._last_exec
        if key != (x, cached):
            seconds = self.cost.exec(x, cached / x)
            self._last_exec = ((x, cached), seconds)
        return seconds

    def _by_cost(self, x: int, cached: dict[str, int], max_tokens: int | None) -> Route:
        holder = max(self.live, key=lambda q: cached[q])  # the first of those holding most
        moves = ROUTING[self.policy].moves_prefixes
        loads = self._loads(x, max_tokens)
        execs: dict[int, float] = {}  # by cached tokens: most instances share a value
        for y in cached.values():
            if y not in execs:
                execs[y] = self._exec(x, y)
        options = []  # Route's fields, cost first; the first cheapest wins ties
        for p in self.live:
            base, n = loads[p]
            options.append((base + (1 + n) * execs[cached[p]], p, cached[p], None, 0))
            if moves and cached[holder] > cached[p]:  # or the holder sends what p lacks first
                cost = self.cost.transfer(cached[holder] - cached[p])
                cost += base + (1 + n) * execs[cached[holder]]
                options.append((cost, p, cached[holder], holder, cached[holder]))
        cost, p, hit, src, moved = min(options, key=lambda o: o[0])
        if src is not None:
            self.num_transfers += 1
        return Route(p, hit, cost, src, moved)  # the winner's alone (a frozen one is slow)

    def after_push(self, route: Route, tokens: Sequence[int], moved: int = 0) -> Route:
        """``route`` once its prefix push is over, ``moved`` tokens of it landed (0: none, the
        push failed): the hit is what the trees now believe its instance holds, and
        ``transfer_from`` / ``transfer_tokens`` say what was sent (None / 0 when nothing was)."""
        cached = self.cached_tokens(route.instance, tokens)
        src = route.transfer_from if moved else None
        return Route(route.instance, cached, route.cost, src, moved)

    def dispatched(
        self, request_id: str, route: Route, num_tokens: int, max_tokens: int = 0
    ) -> None:
        """``request_id`` (``num_tokens`` prompt tokens, up to ``max_tokens`` to generate) was
        submitted as ``route`` says. Its prefill weighs on the instance until its first token,
        then it decodes there until it finishes (or is handed to a decode instance)."""
        prefill = self._exec(num_tokens, route.cached_tokens) if num_tokens else 0.0
        self._queued[request_id] = _Queued(route.instance, prefill)
        self.dispatches[route.instance] += 1

    def started(self, request_id: str) -> None:
        """``request_id``'s first token is out: its prefill is done, it decodes."""
        if (q := self._queued.get(request_id)) is not None:
            q.started = True

    def prefilled(self, request_id: str) -> None:
        """``request_id``'s prefill is done (handed to a decode instance): it no longer
        weighs on its instance's queue, but its cache is still recorded when it finishes."""
        if (q := self._queued.get(request_id)) is not None:
            q.active = False

    def finished(
        self,
        request_id: str,
        cached_tokens: Sequence[int] | None = None,
        output_tokens: int | None = None,
    ) -> None:
        """``request_id`` ended with ``output_tokens`` generated (None: unknown, or it failed);
        ``cached_tokens`` is what it left cached where it ran (its prompt plus output with
        caching, None when it failed or nothing is cached)."""
        q = self._queued.pop(request_id, None)
        if q is not None and output_tokens is not None:
            self._answers[0] += output_tokens
            self._answers[1] += 1
        if q is not None and cached_tokens is not None:
            self.record(q.instance, cached_tokens)

    def cache_changed(self, instance: str, added: bool, tokens: Sequence[int]) -> None:
        """``instance``'s index gained ``tokens`` (``added``) or lost the subtree whose path
        ends with them: its prompt tree follows (a pool's ``on_change``, or the events an
        instance process reports)."""
        (self.record if added else self.trees.forget)(instance, tokens)

    def record(self, instance: str, tokens: Sequence[int]) -> None:
        """``tokens`` are now cached on ``instance`` (e.g. after a prefix transfer)."""
        if self.caching:
            self.trees.record(instance, tokens)


def _round_robin(s: GlobalScheduler, toks: array, session_id: str | None) -> str:
    """The live instance after the one picked last time."""
    return s.live[next(s._rr) % len(s.live)]


def _least_load(s: GlobalScheduler, toks: array, session_id: str | None) -> str:
    """The live instance with the fewest unfinished requests (the first of equals)."""
    return min(s.live, key=lambda p: (s.queued_requests(p), s.live.index(p)))


def _by_session(s: GlobalScheduler, toks: array, session_id: str | None) -> str:
    """A hash of the conversation (without one, of the prompt's first block) over the live."""
    key = session_id.encode() if session_id else toks[: s.block_size].tobytes()
    return s.live[zlib.crc32(key) % len(s.live)]


@dataclass(frozen=True)
class RoutingPolicy:
    """How a routing policy picks: ``pick(scheduler, tokens, session_id)`` names the instance
    (None: the one where the request costs least, see the module); ``moves_prefixes``: a
    cached prefix may be sent to it first from the instance holding most of the prompt."""

    pick: Callable[[GlobalScheduler, array, str | None], str] | None = None
    moves_prefixes: bool = False


# The routing policies by name (``DeploymentSpec.policy``, ``--policy``).
ROUTING: dict[str, RoutingPolicy] = {
    "round_robin": RoutingPolicy(_round_robin),
    "least_load": RoutingPolicy(_least_load),
    "session": RoutingPolicy(_by_session),
    "prompt_tree": RoutingPolicy(moves_prefixes=True),
    "prompt_tree_local": RoutingPolicy(),
}
ROUTING_POLICIES = tuple(ROUTING)
# The policies that may have one instance send another a cached prefix before a request.
MOVES_PREFIXES = tuple(name for name, rule in ROUTING.items() if rule.moves_prefixes)
