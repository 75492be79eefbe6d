"""Routing of a process deployment's requests: the ``Frontend`` picks an entry instance among
the live ones (after the prefix push it may ask for, from the instance holding most of the
prompt: :func:`push_prefix` here), and the request is submitted there and entered in the
ledger.

A submission does not wait for the instance's answer: an instance answers between its steps,
and one step can take seconds (a long prompt on a CPU) or more. The request is queued on its
instance at once, and the answer is handled when it comes, at a later ``serve`` of the
frontend: an instance that ended its session refused it, so it goes elsewhere (it had not
started); any other refusal ends it with the error. The frontend checks every request before
it is submitted, so that refusal does not happen to a request it could check."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence

from ..errors import InstanceDied, MiniMemServeError, TransferError
from ..scheduler.frontend import Frontend
from ..scheduler.global_scheduler import Route
from . import rpc
from .instance import SessionOver
from .launch import InstanceInfo
from .ledger import Inflight, Ledger

logger = logging.getLogger(__name__)


def push_prefix(node: rpc.RpcNode, src: str, dst: str, prompt: Sequence[int]) -> int:
    """Have instance ``src`` send ``dst`` its cached prefix of ``prompt``; the tokens that
    moved (0 when the transfer failed: the request goes without them)."""
    try:
        return int(node.call(src, rpc.PushPrefix(list(prompt), dst)).data["tokens"])
    except (TransferError, MiniMemServeError) as e:
        logger.warning("prefix transfer %s -> %s failed: %s", src, dst, e)
        return 0


class Router:
    """Routes and submits requests through ``node`` with ``frontend``; ``roles`` must each
    have a live instance of ``instances`` (the ledger's ``dead`` says which died);
    ``ended(name, why)`` is told of an instance that refused a request because it ended its
    session."""

    def __init__(
        self,
        node: rpc.RpcNode,
        frontend: Frontend,
        ledger: Ledger,
        instances: Mapping[str, InstanceInfo],
        roles: Sequence[str],
        ended: Callable[[str, str], None],
    ) -> None:
        self.node = node
        self.ended = ended
        self.frontend = frontend
        self.ledger = ledger
        self.instances = instances
        self.roles = roles
        self.dead = ledger.dead

    def submit(self, rid: str, f: Inflight, session_id: str | None = None) -> str:
        """Route and send a checked request (``session_id``: its conversation) through the
        ``Frontend``, without waiting for the answer (see the module's docstring); the instance
        it went to."""
        live = {i.info.role for i in self.instances.values() if i.info.name not in self.dead}
        if not live.issuperset(self.roles):
            raise InstanceDied(f"a role has no live instance left: {self.dead}")
        ids, send = f.req.prompt_token_ids, functools.partial(self._send, rid, f)
        return self.frontend.submit(rid, ids, f.req.params.max_tokens, session_id, send).instance

    def _send(self, rid: str, f: Inflight, route: Route) -> None:
        """Send ``f`` where ``route`` says; it is in flight from before it is sent (the
        instance may report on it as soon as it has it)."""
        self.ledger.inflight[rid] = f
        f.where = f.answer_from = route.instance
        f.reported_by = ""
        to, msg = route.instance, rpc.Submit(rpc.RequestState.of(f.req))
        try:
            self.node.send(to, msg, lambda reply: self._answered(rid, f, to, reply))
        except BaseException:
            self.ledger.inflight.pop(rid, None)
            raise

    def _answered(self, rid: str, f: Inflight, to: str, reply: rpc.Msg) -> None:
        """``to``'s answer to the Submit of ``f``: taken, the request runs there (and is
        recovered if ``to`` died meanwhile, see ``Ledger.lost``); refused by an instance that
        ended its session, it goes elsewhere; refused otherwise, it ends with the error."""
        if self.ledger.inflight.get(rid) is not f or f.answer_from != to:
            return  # ended or aborted meanwhile
        f.answer_from = ""
        refused = isinstance(reply, rpc.Error)
        if refused and self._never_ran(to, reply):
            self.ledger.inflight.pop(rid)
            self.frontend.report(dropped=[rid])
            logger.warning("%s refused %s: %s; routing it again", to, rid, reply.message)
            self.ended(to, f"it ended its session ({reply.message})")
            self._reroute(rid, f)
        elif to in self.dead and f.where == to:  # taken, or not, by an instance that died
            self.ledger.recover(rid, f, f"InstanceDied: instance {to} died ({self.dead[to]})")
        elif refused:
            self.ledger.inflight.pop(rid)
            self.frontend.report(dropped=[rid])
            self.ledger.done.append(f.end("error", f"{reply.kind}: {reply.message}"))

    def _never_ran(self, to: str, reply: rpc.Error) -> bool:
        """Whether a refusal from ``to`` shows the request never ran there: ``to`` had no
        session, or it was declared dead for ending its session before it answered (so the
        answer is the node giving up: see ``Ledger.sessionless``)."""
        ended = reply.kind == InstanceDied.__name__ and to in self.ledger.sessionless
        return reply.kind == SessionOver.__name__ or ended

    def _reroute(self, rid: str, f: Inflight) -> None:
        """Submit a request no instance started elsewhere, or end it if none can take it."""
        try:
            self.submit(rid, f)
        except (TransferError, MiniMemServeError) as e:
            self.ledger.done.append(f.end("error", f"{type(e).__name__}: {e}"))

    def on_cache_events(self, sender: str, msg: rpc.CacheEvents) -> None:
        """An entry instance's index gained or lost prefixes: its prompt tree follows, in
        order."""
        for added, tokens in msg.events:
            self.frontend.scheduler.cache_changed(sender, added, tokens)
