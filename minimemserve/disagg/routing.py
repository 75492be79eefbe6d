"""Routing of a process deployment's requests: the global scheduler picks an entry instance
among the live ones (after the prefix push it may ask for, from the instance holding most of
the prompt), and the request is submitted there and entered in the ledger."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from ..errors import InstanceDied, MiniMemServeError, TransferError
from ..scheduler.global_scheduler import GlobalScheduler, Route
from . import rpc
from .launch import InstanceInfo
from .ledger import Inflight, Ledger

logger = logging.getLogger(__name__)


class Router:
    """Routes and submits requests through ``node`` with ``scheduler``; ``roles`` must each
    have a live instance of ``instances`` (the ledger's ``dead`` says which died)."""

    def __init__(
        self,
        node: rpc.RpcNode,
        scheduler: GlobalScheduler,
        ledger: Ledger,
        instances: Mapping[str, InstanceInfo],
        roles: Sequence[str],
    ) -> None:
        self.node = node
        self.scheduler = scheduler
        self.ledger = ledger
        self.instances = instances
        self.roles = roles
        self.dead = ledger.dead
        self.prefix_tokens_moved = 0  # tokens of KV moved by the scheduler's prefix transfers

    def route(self, prompt: Sequence[int], max_tokens: int, session_id: str | None = None) -> Route:
        """The scheduler's route for a prompt (of conversation ``session_id``), after the
        prefix push it asks for."""
        live = {i.role for i in self.instances.values() if i.name not in self.dead}
        if not live.issuperset(self.roles):
            raise InstanceDied(f"a role has no live instance left: {self.dead}")
        try:
            route = self.scheduler.route(prompt, max_tokens, session_id)
        except InstanceDied:
            raise InstanceDied(f"every instance taking new requests died: {self.dead}") from None
        if route.transfer_from is not None:
            route = self._push_prefix(prompt, route)
        return route

    def _push_prefix(self, prompt: Sequence[int], route: Route) -> Route:
        """Have ``route.transfer_from`` send its cached prefix first; on failure, go without it."""
        src, dst = route.transfer_from, route.instance
        try:
            moved = int(self.node.call(src, rpc.PushPrefix(list(prompt), dst)).data["tokens"])
        except (TransferError, MiniMemServeError) as e:
            logger.warning("prefix transfer %s -> %s failed: %s", src, dst, e)
            moved = 0
        self.prefix_tokens_moved += moved
        if moved:
            self.scheduler.record(dst, prompt[:moved])
        return self.scheduler.landed(route, prompt)

    def submit(self, route: Route, rid: str, f: Inflight) -> None:
        """Send a request where ``route`` says; it is in flight from before the call."""
        self.ledger.inflight[rid] = f
        f.where = route.instance
        # before the call: the instance may report on it as soon as it has the request
        self.scheduler.dispatched(rid, route, f.req.num_prompt, f.req.params.max_tokens)
        try:
            self.node.call(route.instance, rpc.Submit(rpc.RequestState.of(f.req)))
        except BaseException:
            self.ledger.inflight.pop(rid, None)
            self.scheduler.finished(rid)
            raise

    def resubmit(self, rid: str, f: Inflight) -> str:
        """Route and send a request again; the instance it went to."""
        route = self.route(f.req.prompt_token_ids, f.req.params.max_tokens)
        self.submit(route, rid, f)
        return route.instance

    def on_cache_events(self, sender: str, msg: rpc.CacheEvents) -> None:
        """An entry instance's index gained or lost prefixes: its prompt tree follows, in
        order."""
        for added, tokens in msg.events:
            self.scheduler.cache_changed(sender, added, tokens)
