"""The process of one serving instance: an engine with a role, behind an RPC node.

:class:`InstanceServer` builds the engine with its role's recipe, puts the hbm pool tensor in
shared memory so peers on this host can write KV into it one-sided, reports ``Ready`` to the
frontend, and then loops: answer control messages, step the engine while it has work, push
finished outputs (and hand-offs) to the frontend. Heartbeats go to the frontend from a thread
(``rpc.Beacon``), started before the engine is built: loading the model and a long step are
work, not silence, and only a stopped or vanished process goes quiet. Its peers
(:mod:`~.peering`) are reached as ``RemotePool`` proxies, a peer's MemPool as a transfer sees
it, so ``MemPool.transfer(remote, ...)`` works across processes unchanged.

What each instance holds for a peer is tracked (``Grants``: blocks it allocated for the
peer's transfers and references the peer has not returned yet), so when the frontend
reports the peer dead, every such block is released and nothing leaks.

KV reaches a peer over a KV link of the transport the frontend chose for the pair, from the
table in :mod:`~.links`: written one-sided into the peer's pool tensor mapped here (same
host), by NIXL, or over a two-rank torch.distributed group the pair forms through the
frontend's store. The process's life around the server (spawned, or started on its own and
joined by frontends one session after another) is :mod:`~.sessions`."""

from __future__ import annotations

import contextlib
import os
import time
from collections import OrderedDict

from ..config import parse_config_name
from ..engine import Engine, new_request
from ..errors import InstanceDied, InvalidRequest, RemoteError, TransferError
from ..links import link_endpoints
from ..mempool import push_cached
from ..recipes import Role
from ..request import Request, logprobs_fit
from . import rpc
from .host import host_identity, process_gone
from .instance_spec import InstanceSpec
from .peering import GRANT_TIMEOUTS, Grants, PeerLinks, RemotePool
from .shm import SharedMemPool

PEER = "peer"  # any instance the frontend announced
# How long an idle instance blocks on its socket before checking its parent and the frontend.
IDLE_POLL_S = 0.02
# How often the loop checks that the launching process still exists.
PARENT_CHECK_S = 0.5
# Hand-offs remembered per prefill instance; far more than can be in flight at once.
HANDOFF_MEMORY = 65_536
# What the frontend asks that waits for the end of the instance's step (see InstanceServer).
BETWEEN_STEPS = frozenset({rpc.Query, rpc.PushPrefix, rpc.AbortRequest, rpc.Peers, rpc.PeerUp})
# Default heartbeat period; the frontend declares an instance dead after many missed beats.
# The Shutdown reason of a frontend that closes: its instances have nobody to rejoin.
CLOSING = "frontend closing"


class SessionOver(Exception):
    """A standalone instance's frontend went silent: the session ends, the instance waits for
    the next frontend. The error a waiting instance answers its frontend's requests with (the
    frontend then knows the session is over)."""


def _control_node(
    spec: InstanceSpec, node: rpc.RpcNode | None, handler: rpc.Handler, on_wait
) -> rpc.RpcNode:
    """``node`` (a standalone instance's, already bound), or a new one bound where ``spec``
    says, named for ``spec``; ``handler`` answers it and ``on_wait`` runs while it waits."""
    if node is None:
        node = rpc.RpcNode(
            spec.name,
            handler,
            host=spec.host,
            port=spec.port,
            timeout_s=spec.timeout_s,
            codec=rpc.Codec(spec.secret),
            curve=spec.curve,
        )
    node.name = spec.name
    node.handler = handler
    node.timeout_s = spec.timeout_s
    node.any_recipient = False  # named now: frames for another name are not for us
    node.on_wait = on_wait
    # A step calls peers and serves their messages while it waits: what the frontend asks of
    # the engine waits for the step's end (an abort then would run a request's hooks a second
    # time, a prefix push would call from inside a call)
    node.deferred = BETWEEN_STEPS
    return node


class InstanceServer:
    """One instance: engine, RPC node, peers, and the loop that drives them."""

    def __init__(self, spec: InstanceSpec, node: rpc.RpcNode | None = None) -> None:
        """Start the heartbeats, build the engine and bind the control socket, or take over
        ``node`` (a standalone instance's, already bound); does not announce itself yet."""
        self.spec = spec
        self.name = spec.name
        self.stopping = False
        self.stop_reason = ""
        self.inbox: list[Request] = []
        self.last_frontend = time.monotonic()  # when the frontend was last heard (see announce)
        # recent hand-offs (request id -> decode instance), so the frontend can find the
        # requests a dead decode instance held even if our Handoff notice is still in flight
        self.handed: OrderedDict[str, str] = OrderedDict()
        self._last_parent_check = 0.0
        self._ppid = os.getppid()  # the frontend, or the forkserver that ends with it
        # beats while the model loads and while a step runs; only a stopped process is silent
        self.beacon = rpc.Beacon(spec.name, rpc.Codec(spec.secret), spec.heartbeat_s, spec.curve)
        self.beacon.add(rpc.FRONTEND, spec.frontend)
        try:
            self._build(spec, node)
        except BaseException:
            self.beacon.close()
            raise

    def _build(self, spec: InstanceSpec, node: rpc.RpcNode | None) -> None:
        """The engine, the control node and the peers."""
        self.engine = Engine(
            spec.model_dir,
            config=spec.config,
            role=spec.role,
            peers=self,
            device=spec.device,
            dtype=spec.dtype,
            engine_config=spec.engine_config,
            instance_id=spec.name,
            pool_factory=SharedMemPool if spec.shared_pool else None,
        )
        self.pool = self.engine.pool
        self.cache_events: list = []  # for the frontend's prompt tree of this instance
        if spec.role == parse_config_name(spec.config).milestone.roles[0]:
            self.pool.on_change = lambda added, toks: self.cache_events.append((added, toks))
        self.node = node = _control_node(spec, node, self._handle, self._watch_parent)
        self.node.connect(rpc.FRONTEND, spec.frontend)
        self.endpoints = link_endpoints(spec, self.pool)  # its side of each link (NIXL's agent)
        self.peers = PeerLinks(spec, node, self.pool, self._peer_down, self.endpoints)
        vocab = self.engine.model_config.vocab_size
        expire_s = GRANT_TIMEOUTS * spec.timeout_s
        self.grants = Grants(spec.name, self.pool, vocab, self.peers.links, expire_s)
        self.handlers = self._handler_table()

    def _handler_table(self) -> dict:
        """Message type -> (who may send it, handler)."""
        return {
            rpc.AllocRequest: (PEER, self.grants.on_alloc),
            rpc.Commit: (PEER, self.grants.on_commit),
            rpc.Abort: (PEER, self.grants.on_abort),
            rpc.FreeMem: (PEER, self.grants.on_free),
            rpc.Accept: (PEER, self._on_accept),
            rpc.Probe: (PEER, self._on_probe),
            rpc.Submit: (rpc.FRONTEND, self._on_submit),
            rpc.Query: (rpc.FRONTEND, self._on_query),
            rpc.Peers: (rpc.FRONTEND, self.peers.on_peers),
            rpc.PushPrefix: (rpc.FRONTEND, self._on_push_prefix),
            rpc.PeerDown: (rpc.FRONTEND, self._on_peer_down),
            rpc.PeerUp: (rpc.FRONTEND, self.peers.on_peer_up),
            rpc.AbortRequest: (rpc.FRONTEND, self._on_abort_request),
            rpc.Shutdown: (rpc.FRONTEND, self._on_shutdown),
            rpc.Heartbeat: (rpc.FRONTEND, lambda s, m: None),
            rpc.KVData: (PEER, self.grants.on_kv_data),
        }

    # ---- what recipes need (``Peers``) -------------------------------------------------------
    def decodes(self) -> dict[str, RemotePool]:
        """The live decode peers, by name."""
        remotes = self.peers.remotes.items()
        return {n: p for n, p in remotes if p.role == Role.DECODE and n not in self.node.dead}

    def decodes_down(self) -> dict[str, str]:
        """The decode peers that died, and why."""
        decodes = [n for n, p in self.peers.remotes.items() if p.role == Role.DECODE]
        return {n: self.node.dead[n] for n in decodes if n in self.node.dead}

    def offer(self, peer: RemotePool, blocks: int, tokens) -> tuple[int, int] | None:
        """Its load and cached prefix of ``tokens`` if it answers that it has room."""
        with contextlib.suppress(TransferError):
            rep = peer.probe(tokens, blocks)
            return (rep.load, rep.cached) if rep.room else None
        return None

    def prefill_pool(self, req: Request) -> RemotePool:
        """The pool of the instance that prefilled ``req``."""
        if (peer := self.peers.remotes.get(req.prefill_instance)) is None:
            raise InstanceDied(f"prefill instance {req.prefill_instance!r} is unknown here")
        return peer

    def peer_failed(self, name: str, error: TransferError) -> None:
        """A peer that answered with an error is alive; one that did not answer is dead."""
        if not isinstance(error, RemoteError) and name not in self.node.dead:
            self._peer_down(name, f"stopped answering: {error}")

    def clock(self) -> float:
        """Wall seconds (hand-offs are timed with it)."""
        return time.perf_counter()

    # ---- control messages -----------------------------------------------------------------
    def _handle(self, sender: str, msg: rpc.Msg) -> rpc.Msg | None:
        who, handler = self.handlers.get(type(msg), (None, None))
        allowed = sender == rpc.FRONTEND if who == rpc.FRONTEND else sender in self.peers.names
        if who is None or not allowed or sender in self.node.dead:
            raise PermissionError(f"{self.name} takes no {type(msg).__name__} from {sender!r}")
        if sender == rpc.FRONTEND:
            self.last_frontend = time.monotonic()
        return handler(sender, msg)

    def _on_probe(self, sender: str, m: rpc.Probe) -> rpc.ProbeReply:
        offer = self.engine.offer(m.blocks, m.tokens, self.inbox)
        load, cached = offer or (self.engine.num_load(self.inbox), 0)
        return rpc.ProbeReply(cached, load, offer is not None)

    def _on_accept(self, sender: str, m: rpc.Accept) -> None:
        self._check_state(m.state)
        req = m.state.request()
        req.decode_instance = self.name
        held = self.grants.ungrant(sender, req.blocks)
        if len(held) != len(req.blocks):
            self.pool.free_mem(held)
            raise ValueError(f"request {req.request_id} arrived with blocks not sent here")
        self.inbox.append(req)

    def _check_state(self, s: rpc.RequestState) -> None:
        """A handed-over request must be one this engine can continue."""
        n, vocab = len(s.tokens), self.engine.model_config.vocab_size
        problems = {
            "a token id is outside the vocabulary": any(not 0 <= t < vocab for t in s.tokens),
            "lengths do not add up": not 0 < s.num_prompt <= n <= s.max_total_tokens
            or s.num_computed > n
            or s.max_total_tokens > self.engine.max_model_len,
            "blocks do not cover the computed tokens": len(s.blocks)
            != self.pool.layout.num_blocks_for(s.num_computed),
            "the prefill instance is unknown": s.metrics.prefill_instance not in self.peers.names,
            "the request id is in use": s.request_id in self.engine.requests,
            "logprobs do not match the tokens": not logprobs_fit(
                s.logprobs, n - s.num_prompt, s.params.logprobs, vocab
            ),
        }
        if bad := [what for what, failed in problems.items() if failed]:
            raise ValueError(f"request {s.request_id!r} refused: {'; '.join(bad)}")

    def _on_submit(self, sender: str, m: rpc.Submit) -> None:
        s = m.state
        if not s.is_new:
            raise InvalidRequest(f"request {s.request_id!r} is not new: it carries KV or output")
        ids = self.engine.validate(s.tokens, s.params).ids  # a socket's message: checked here
        rid = s.request_id
        if rid in self.engine.requests or any(r.request_id == rid for r in self.inbox):
            raise InvalidRequest(f"request id {rid!r} is already in use on {self.name}")
        arrival, limit = s.metrics.arrival_time, self.engine.max_model_len
        self.inbox.append(new_request(rid, ids, s.params, arrival, limit, self.name))

    def _on_query(self, sender: str, m: rpc.Query) -> rpc.Info:
        if m.what == "check":
            try:
                self.pool.check()
                ok, error = True, None
            except AssertionError as e:
                ok, error = False, str(e)
            return rpc.Info(
                {
                    "ok": ok,
                    "error": error,
                    "pool": self.pool.stats(),
                    "load": self.engine.load()[self.name],
                    "returned": dict(self.grants.returned),
                }
            )
        if m.what == "links":  # answered once every pair group of this instance formed
            if self.peers.pending:
                self.peers.form()
            return rpc.Info({p: link.stats() for p, link in self.peers.links.items()})
        stats = {
            "links": {p: link.stats() for p, link in self.peers.links.items()},
            "pool": self.pool.stats(),
            "ranks": self.engine.tp.size,
            "requests": len(self.engine.requests) + len(self.inbox),
            "load": self.engine.load()[self.name],
            "grants": self.grants.totals(),
            "returned": dict(self.grants.returned),
            "dead_peers": dict(self.node.dead),
            "rejected": self.node.rejected,
            "replayed": self.node.replayed,
        }
        return rpc.Info(stats)

    def _on_peer_down(self, sender: str, m: rpc.PeerDown) -> rpc.Info:
        """Release what was held for ``m.name``; answer the requests handed on to it, and those
        it prefilled that run here (the frontend may not have their hand-off notice yet)."""
        self._peer_down(m.name, m.reason)
        handed = [r for r, d in self.handed.items() if d == m.name]
        held = [r.request_id for r in self.engine.requests.values()]
        holding = [rid for rid in held if self.engine.requests[rid].prefill_instance == m.name]
        return rpc.Info({"handed": handed, "holding": holding})

    def _on_abort_request(self, sender: str, m: rpc.AbortRequest) -> rpc.Msg | None:
        """Between steps: the request's partial output, where it was handed on to, or nothing."""
        if (out := self._abort(m.request_id)) is not None:
            return rpc.Output(out)
        if (to := self.handed.get(m.request_id)) is not None:
            return rpc.Info({"handed_to": to})
        return None

    def _abort(self, request_id: str):
        for i, req in enumerate(self.inbox):
            if req.request_id == request_id:  # not admitted yet: let the engine finish it
                del self.inbox[i]
                self.engine.add_prefilled(req)
                break
        return self.engine.abort(request_id)

    def _on_shutdown(self, sender: str, m: rpc.Shutdown) -> None:
        self.stopping, self.stop_reason = True, m.reason

    def _on_push_prefix(self, sender: str, m: rpc.PushPrefix) -> rpc.Info:
        """Send the cached prefix of ``m.tokens`` to ``m.to`` (indexed there); reply its length."""
        peer = self.peers.remotes.get(m.to)
        if peer is None or m.to in self.node.dead:
            raise InstanceDied(f"{self.name} has no live peer {m.to!r} to send a prefix to")
        return rpc.Info({"tokens": push_cached(self.pool, peer, m.tokens)})

    def _peer_down(self, name: str, reason: str) -> None:
        self.node.dead.setdefault(name, reason)
        if (link := self.peers.links.get(name)) is not None:
            link.close()  # keeps its counters; nothing more moves over it
        self.grants.drop(name)

    # ---- the loop -------------------------------------------------------------------------
    def announce(self) -> None:
        """Tell the frontend where this instance listens and how to map its pool."""
        shared = getattr(self.pool, "shared", None)
        handle = shared.handle.to_dict() if shared is not None else None
        info = rpc.PeerInfo(
            self.name,
            self.spec.role,
            self.node.address,
            handle,
            self.spec.host_id or host_identity(),
            self.spec.transport,
            {name: end.offer() for name, end in self.endpoints.items()},
        )
        ready = rpc.Ready(info, os.getpid(), self.engine.max_model_len, self.pool.capacity())
        self.node.push(rpc.FRONTEND, ready)
        self.last_frontend = time.monotonic()  # the session's silence clock starts now

    def _watch_parent(self) -> None:
        """Runs between steps and while waiting on a call: quit if orphaned."""
        if not self._parent_alive():  # the frontend died without shutting us down
            raise SystemExit(f"{self.name}: the launching process is gone")

    def _flush(self, outputs=()) -> None:
        if self.cache_events:  # first: the frontend reads them before the outputs they follow
            events = [(added, toks.tolist()) for added, toks in self.cache_events]
            self.node.try_push(rpc.FRONTEND, rpc.CacheEvents(events))
            self.cache_events.clear()
        if deltas := self.engine.take_deltas():  # before the outputs and hand-offs they precede
            self.node.try_push(rpc.FRONTEND, rpc.Tokens(deltas))
        for out in outputs:
            self.node.try_push(rpc.FRONTEND, rpc.Output(out))
        for req in self.engine.handoffs:
            self.handed[req.request_id] = req.decode_instance
            if len(self.handed) > HANDOFF_MEMORY:
                self.handed.popitem(last=False)
            self.node.try_push(rpc.FRONTEND, rpc.Handoff(req.request_id, req.decode_instance))
        self.engine.handoffs.clear()

    def run(self) -> None:
        """Serve until told to stop, or until the launching process is gone."""
        while not self.stopping:
            self._watch_parent()
            if self.peers.pending:
                self.peers.form()
            busy = bool(self.inbox) or self.engine.has_unfinished()
            self.node.serve(0.0 if busy else IDLE_POLL_S)
            if self.stopping:
                break
            silent = time.monotonic() - self.last_frontend  # checked once the inbox is read
            if self.spec.frontend_timeout_s and silent > self.spec.frontend_timeout_s:
                raise SessionOver(f"nothing from the frontend for {silent:.1f} s")
            self.grants.expire()
            inbox, self.inbox = self.inbox, []
            for req in inbox:
                self.engine.add_prefilled(req)
            self._flush(self.engine.step() if self.engine.has_unfinished() else [])

    def _parent_alive(self) -> bool:
        """Whether the launching process still runs: it has not exited (a zombie nobody reaped
        has), and this process has not been handed to another parent since it started."""
        now = time.monotonic()
        if now - self._last_parent_check < PARENT_CHECK_S or not self.spec.parent_pid:
            return True
        self._last_parent_check = now
        return os.getppid() == self._ppid and not process_gone(self.spec.parent_pid)

    def close(self) -> None:
        """Stop the heartbeats, release sockets and links, and unlink the shared pool segment."""
        self.beacon.close()
        for link in self.peers.links.values():
            link.close()
        for end in self.endpoints.values():
            end.close()
        self.node.close()
        if (shared := getattr(self.pool, "shared", None)) is not None:
            shared.close()
