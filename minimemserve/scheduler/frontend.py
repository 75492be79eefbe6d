"""The request's life across instances, written once for the in-process, process and Ray
runtimes and the simulator.

A new request is **routed** by the :class:`~.global_scheduler.GlobalScheduler` among the
entry instances; when the route asks for it, the instance holding most of the prompt first
**pushes** the part the chosen one lacks, and the route is re-judged on what **landed** (the
request goes without it when the push failed). It is **dispatched** there, **starts** when
its first token is out, may be **prefilled** and handed to a decode instance, and
**finishes**: its answer length counts toward the scheduler's mean answer only when it was
answered (``stop`` or ``length``), never when it was aborted or failed. A request that ends
with no answer (aborted, refused, failed, or sent elsewhere) is **dropped**. When an instance
dies under a request, the request is **re-run** elsewhere at most :data:`MAX_RERUNS` times
where the deployment allows it, else it ends with the error.

A request enters by :meth:`Frontend.submit` (route, push, dispatch, send: the runtime
checked it first, once) and everything instances say of it comes back through
:meth:`Frontend.report` (hand-offs, streamed tokens, outputs, drops). The runtimes differ only
in how a prefix moves (``push``: ``MemPool.send_cached`` in one process or in the simulator,
a control message to an instance process that calls it) and in how a request reaches an
instance (``send``); the bookkeeping is here. Not thread-safe."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sequence

from ..request import RequestOutput, TokenDelta
from .global_scheduler import DEFAULT_TTL_S, Clock, Cost, GlobalScheduler, Route

# A request is re-run at most this many times after instances died under it.
MAX_RERUNS = 2
# The finish reasons of a request that was answered (its length counts toward the mean).
ANSWERED = ("stop", "length")
# ``push(src, dst, prompt)``: ``src`` sends ``dst`` its cached prefix of ``prompt``; returns
# the tokens of it now cached on ``dst`` (0 when nothing moved).
Push = Callable[[str, str, Sequence[int]], int]


class Frontend:
    """One deployment's frontend over its ``entry`` instances (by name): the global scheduler
    it routes with (``policy``, ``block_size``, ``cost_model``, ``ttl_s``, ``caching``: the
    instances keep a prefix cache, ``clock``) and the request's transitions (see the module).
    ``push`` moves a prefix; ``rerun_on_failure`` lets a request whose instance died run
    again elsewhere."""

    def __init__(
        self,
        entry: Sequence[str],
        push: Push,
        *,
        policy: str = "prompt_tree",
        block_size: int = 16,
        cost_model: Cost | None = None,
        ttl_s: float = DEFAULT_TTL_S,
        caching: bool = True,
        clock: Clock = time.monotonic,
        rerun_on_failure: bool = False,
    ) -> None:
        self.scheduler = GlobalScheduler(
            entry,
            policy=policy,
            block_size=block_size,
            cost_model=cost_model,
            ttl_s=ttl_s,
            caching=caching,
            clock=clock,
        )
        self.push = push
        self.rerun_on_failure = rerun_on_failure
        self.prefix_tokens_moved = 0  # tokens of KV moved by prefix pushes
        self.num_reruns = 0  # requests re-run after the instance holding them died
        self.route_calls = 0
        self.route_wall_s = 0.0  # wall seconds the scheduler took to decide

    def follow(self, name: str, pool) -> None:
        """The prompt tree of ``name`` follows what its ``pool`` (in this process) caches."""
        pool.on_change = functools.partial(self.scheduler.cache_changed, name)

    def route(
        self, prompt: Sequence[int], max_tokens: int | None, session_id: str | None = None
    ) -> Route:
        """Where a prompt (of conversation ``session_id``) goes, after the prefix push its route
        asks for: ``transfer_from`` then names the sender and ``transfer_tokens`` what landed."""
        t0 = time.perf_counter()
        route = self.scheduler.route(prompt, max_tokens, session_id)
        self.route_wall_s += time.perf_counter() - t0
        self.route_calls += 1
        if route.transfer_from is None:
            return route
        moved = self.push(route.transfer_from, route.instance, prompt)
        self.prefix_tokens_moved += moved
        if moved:
            self.scheduler.record(route.instance, prompt[:moved])
        return self.scheduler.after_push(route, prompt, moved)

    def submit(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        session_id: str | None,
        send: Callable[[Route], None],
    ) -> Route:
        """A checked request's way in: routed (after the prefix push its route asks for),
        dispatched, then ``send(route)`` puts it on the chosen instance (a failed send drops
        it and raises). Returns the route."""
        route = self.route(prompt, max_tokens, session_id)
        self.dispatched(request_id, route, len(prompt), max_tokens)
        try:
            send(route)
        except BaseException:
            self.dropped(request_id)
            raise
        return route

    def report(
        self,
        handoffs: Iterable[str] = (),
        deltas: Iterable[TokenDelta] = (),
        outputs: Iterable[RequestOutput] = (),
        dropped: Iterable[str] = (),
        started: Iterable[str] = (),
    ) -> None:
        """What instances said, in this order: requests whose first token is out
        (``started``, where no delta carries it), requests handed to a decode instance,
        tokens streamed (a first one means started), requests that ended with ``outputs``, and
        requests ``dropped`` with no answer (aborted, refused, failed, sent again)."""
        for rid in started:
            self.started(rid)
        for rid in handoffs:
            self.prefilled(rid)
        for d in deltas:
            self.streamed(d)
        for out in outputs:
            self.finished(out)
        for rid in dropped:
            self.dropped(rid)

    def dispatched(self, request_id: str, route: Route, num_prompt: int, max_tokens: int) -> None:
        """``request_id`` was sent where ``route`` says (before the instance may report on it)."""
        self.scheduler.dispatched(request_id, route, num_prompt, max_tokens)

    def started(self, request_id: str) -> None:
        """``request_id``'s first token is out."""
        self.scheduler.started(request_id)

    def streamed(self, delta: TokenDelta) -> None:
        """Tokens of a request arrived: the first one means it started."""
        if delta.start == 0:
            self.started(delta.request_id)

    def prefilled(self, request_id: str) -> None:
        """``request_id`` was handed to a decode instance."""
        self.scheduler.prefilled(request_id)

    def finished(self, out: RequestOutput) -> None:
        """A request ended on an instance with ``out``; an answered one's length counts."""
        answered = out.finish_reason in ANSWERED
        self.scheduler.finished(out.request_id, None, len(out.token_ids) if answered else None)

    def dropped(self, request_id: str) -> None:
        """``request_id`` ended with no answer (aborted, refused, failed) or is sent again."""
        self.scheduler.finished(request_id)

    def may_rerun(self, reruns: int) -> bool:
        """Whether a request already re-run ``reruns`` times may run again after its instance
        died."""
        return self.rerun_on_failure and reruns < MAX_RERUNS
