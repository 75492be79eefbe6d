"""The process of one serving instance: an engine with a role, behind an RPC node.

``instance_main(spec)`` is the entry point the launcher spawns. It builds the engine with
its role's recipe, puts the hbm pool tensor in shared memory so peers on this host can
write KV into it one-sided, reports ``Ready`` to the frontend, and then loops: answer
control messages, step the engine while it has work, push finished outputs (and
hand-offs) to the frontend. Heartbeats go to the frontend from a thread (``rpc.Beacon``),
started before the engine is built: loading the model and a long step are work, not
silence, and only a stopped or vanished process goes quiet. Its peers (:mod:`~.peering`)
are reached as ``RemotePool`` proxies, a peer's MemPool as a transfer sees it, so
``MemPool.transfer(remote, ...)`` works across processes unchanged.

What each instance holds for a peer is tracked (``Grants``: blocks it allocated for the
peer's transfers and references the peer has not returned yet), so when the frontend
reports the peer dead, every such block is released and nothing leaks.

KV reaches a peer over a KV link of the transport the frontend chose for the pair, from the
table in :mod:`~.links`: written one-sided into the peer's pool tensor mapped here (same
host), by NIXL, or over a two-rank torch.distributed group the pair forms through the
frontend's store.

``minimemserve instance`` runs :func:`standalone_main`: an instance started on its own (any
host) that waits for a frontend's ``Hello`` and ``Join``, serves that frontend's deployment
and then waits for the next one."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import signal
import socket
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from ..config import EngineConfig, parse_config_name
from ..engine import Engine, new_request
from ..errors import ConfigError, InstanceDied, InvalidRequest, RemoteError, TransferError
from ..mempool import MemPool
from ..mempool.shared import SharedPoolTensor
from ..model.config import ModelConfig
from ..recipes import Role
from ..request import Request, logprobs_fit
from . import rpc
from .links import AUTO, KV_LINKS, candidates, kv_link
from .nixl import NixlEndpoint, NixlLink, nixl_missing
from .peering import Grants, PeerLinks, RemotePool

logger = logging.getLogger(__name__)

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
DEFAULT_HEARTBEAT_S = 0.5
# How long a standalone instance waits between polls for a frontend.
LOBBY_POLL_S = 0.1
# How often a standalone instance cut off from its frontend tells it that it is back.
REJOIN_EVERY_S = 1.0
# The Shutdown reason of a frontend that closes: its instances have nobody to rejoin.
CLOSING = "frontend closing"


@dataclass(frozen=True)
class InstanceSpec:
    """Start-up arguments of one instance process (passed once, at spawn)."""

    name: str
    role: str
    config: str
    model_dir: str
    frontend: str
    engine_config: EngineConfig
    device: str = "cpu"
    dtype: str = "float32"
    num_threads: int = 1
    host: str = rpc.LOOPBACK
    port: int = 0
    timeout_s: float = rpc.DEFAULT_TIMEOUT_S
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    parent_pid: int = 0
    linked: bool = False  # peers move KV into its pool (over whichever transport)
    secret: bytes = field(default=b"", repr=False)  # the cluster's control-plane key
    curve: tuple[bytes, bytes] | None = field(default=None, repr=False)  # off loopback
    transport: str = AUTO  # the KV transport this instance asks for (links.transport_names)
    frontend_timeout_s: float = 0.0  # standalone: end the session after this much silence
    session: str = ""  # the frontend's session id: names this deployment's pair groups
    host_id: str = ""  # the host peers see it on ("": host_identity(); Ray: its node)
    kv_links: dict[str, str] = field(default_factory=lambda: dict(KV_LINKS), repr=False)

    @property
    def shared_pool(self) -> bool:
        """Whether its hbm pool lives in shared memory, for peers on its host to write into."""
        links = candidates(self.transport, self.kv_links)
        return self.linked and any(link.shares_pool for link in links)


def host_identity() -> str:
    """This host as the network sees it: the kernel's boot id and the network namespace, so
    processes in different namespaces count as different hosts (they share no sockets on
    loopback and reach each other only through the network)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{boot}/{netns}"


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited, including as a zombie nobody reaped (``kill(pid, 0)``
    still succeeds on those); without ``/proc``, the kernel's word."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")  # state, after the name
    except FileNotFoundError:
        return True
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # exists, owned by someone else
    return False


class SharedMemPool(MemPool):
    """A MemPool whose hbm tier tensor lives in shared memory (CPU) or is IPC-exported (CUDA;
    dram stays private). :attr:`shared` is the segment; publish ``shared.handle.to_dict()``."""

    def __init__(self, layout, num_blocks: int, **kw) -> None:
        self.shared: SharedPoolTensor | None = None

        def factory(shape, dtype, device) -> torch.Tensor:
            if self.shared is not None:  # the dram tier: private host memory, pinned with CUDA
                return torch.zeros(shape, dtype=dtype, pin_memory=torch.cuda.is_available())
            self.shared = SharedPoolTensor.create(tuple(shape), dtype, device)
            return self.shared.tensor  # [num_blocks, L, 2, block_size, n_kv_heads, head_dim]

        super().__init__(layout, num_blocks, tensor_factory=factory, **kw)


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


def nixl_endpoint(spec: InstanceSpec, pool: MemPool) -> NixlEndpoint | None:
    """This instance's NIXL agent over ``pool``: when it asks for NIXL (which must then load
    here), or under "auto" (a standalone instance: peers may be on other hosts) when NIXL
    loads and peers move KV into its pool; else None."""
    if NixlLink not in candidates(spec.transport, spec.kv_links):
        return None
    missing = nixl_missing()
    if missing is not None and spec.transport != AUTO:
        raise ConfigError(f"{spec.name} asks for the nixl KV transport, but {missing}")
    if missing is not None or not spec.linked:
        return None
    agent = f"{spec.name}-{os.getpid()}-{secrets.token_hex(4)}"  # unique across restarts
    return NixlEndpoint(agent, pool, spec.timeout_s)


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
        self.nixl = nixl_endpoint(spec, self.pool)
        self.peers = PeerLinks(spec, node, self.pool, self._peer_down, self.nixl)
        vocab = self.engine.model_config.vocab_size
        self.grants = Grants(spec.name, self.pool, vocab, self.peers.links)
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
        sched, room = self.engine.scheduler, self.engine.has_room(m.blocks, self.inbox)
        load = len(sched.waiting) + len(sched.running) + len(self.inbox)
        return rpc.ProbeReply(self.pool.cached_prefix_len(m.tokens), load, room)

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
        ids = self.engine.validate(s.tokens, s.params)
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
            return rpc.Info({"ok": ok, "error": error, "pool": self.pool.stats()})
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
            "dead_peers": dict(self.node.dead),
            "rejected": self.node.rejected,
            "replayed": self.node.replayed,
        }
        return rpc.Info(stats)

    def _on_peer_down(self, sender: str, m: rpc.PeerDown) -> rpc.Info:
        self._peer_down(m.name, m.reason)
        return rpc.Info({"handed": [r for r, d in self.handed.items() if d == m.name]})

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
        got = self.pool.send_cached(peer, m.tokens)  # from hbm or dram, as cached
        if got:
            peer.free_mem(got)  # the peer's index keeps its own reference
        return rpc.Info({"tokens": len(got) * self.pool.block_size})

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
            self.nixl.info() if self.nixl is not None else None,
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
        if self.nixl is not None:
            self.nixl.close()
        self.node.close()
        if (shared := getattr(self.pool, "shared", None)) is not None:
            shared.close()


@dataclass(frozen=True)
class StandaloneOptions:
    """What ``minimemserve instance`` is started with (the frontend supplies the rest)."""

    role: str
    model_dir: str
    host: str
    port: int
    key: rpc.ClusterKey
    transport: str = AUTO
    device: str = "cpu"
    dtype: str = "float32"
    num_threads: int = 1
    engine_overrides: dict = field(default_factory=dict)  # EngineConfig sizes set on this host
    once: bool = False  # serve one frontend, then exit
    parent_pid: int = 0  # spawned by a frontend: end when it is gone, even while waiting
    host_id: str = ""  # the host peers see it on ("": host_identity(); Ray: its node)
    managed: bool = False  # a manager (Ray) restarts it: end when a frontend closes, or crashes
    # the KV links it knows, by transport name: this process's table when it was made (a
    # spawned instance gets its frontend's, links registered there included)
    kv_links: dict[str, str] = field(default_factory=lambda: dict(KV_LINKS), repr=False)


def spawned_options(spec: InstanceSpec, address: str) -> StandaloneOptions:
    """A spawned instance as a standalone one listening where it did (``address``), so the
    frontend that declared it dead by mistake can join it again. On loopback the CURVE key
    pair is unused: a throwaway one makes the key whole."""
    key = rpc.ClusterKey(spec.secret, spec.curve or zmq.curve_keypair())
    return StandaloneOptions(
        role=spec.role,
        model_dir=spec.model_dir,
        host=spec.host,
        port=int(address.rsplit(":", 1)[1]),
        key=key,
        transport=spec.transport,
        device=spec.device,
        dtype=spec.dtype,
        num_threads=spec.num_threads,
        parent_pid=spec.parent_pid,
        kv_links=spec.kv_links,
    )


_NAME = re.compile(r"[A-Za-z0-9_-]{1,32}")


def _model_summary(model_dir: str) -> dict[str, int]:
    """The shape of the checkpoint, for the frontend to check it serves the same model."""
    mc = ModelConfig.from_hf(model_dir)
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    return {k: int(getattr(mc, k)) for k in keys}


def _check_join(m: rpc.Join, opts: StandaloneOptions) -> InstanceSpec:
    """The spec of the session a Join asks for; raises naming what is wrong with it."""
    milestone = parse_config_name(m.config).milestone
    if opts.role not in milestone.roles:
        raise ValueError(f"{m.config} has no {opts.role} instances (roles {milestone.roles})")
    if not _NAME.fullmatch(m.name) or m.name == rpc.FRONTEND:
        raise ValueError(f"bad instance name {m.name!r}")
    if not m.frontend.startswith("tcp://") or not _NAME.fullmatch(m.session):
        raise ValueError(f"bad frontend address {m.frontend!r} or session {m.session!r}")
    try:
        config = msgspec.convert(m.engine_config | opts.engine_overrides, EngineConfig)
    except (msgspec.ValidationError, ValueError) as e:
        raise ValueError(f"bad engine config: {e}") from None
    whole = [name for name in opts.kv_links if kv_link(name, opts.kv_links).whole_model]
    if config.tp_size(opts.role) != 1 and opts.transport not in whole:
        raise ValueError(  # its ranks' KV reaches peers whole only through a landing tensor
            f"a standalone instance runs tensor-parallel ranks only over the {'/'.join(whole)} "
            f"transport (--transport {whole[0]})"
        )
    return instance_spec(m, opts, config)


def instance_spec(m: rpc.Join, opts: StandaloneOptions, config: EngineConfig) -> InstanceSpec:
    """The spec of the instance ``opts`` describes, joined to a deployment by ``m`` with engine
    ``config``: what the frontend decides (``m``) and what its own host does (``opts``). The
    one place a spec is built, for spawned and standalone instances alike."""
    return InstanceSpec(
        name=m.name,
        role=opts.role,
        config=m.config,
        model_dir=opts.model_dir,
        frontend=m.frontend,
        engine_config=config,
        device=opts.device,
        dtype=opts.dtype,
        num_threads=opts.num_threads,
        host=opts.host,
        port=opts.port,
        timeout_s=m.timeout_s,
        heartbeat_s=m.heartbeat_s,
        parent_pid=opts.parent_pid,
        linked=m.linked,
        secret=opts.key.secret,
        curve=opts.key.curve_for(opts.host),
        transport=opts.transport,
        frontend_timeout_s=m.frontend_timeout_s,
        session=m.session,
        host_id=opts.host_id,
        kv_links=opts.kv_links,
    )


def _await_join(
    opts: StandaloneOptions, back: InstanceSpec | None = None
) -> tuple[rpc.RpcNode, InstanceSpec]:
    """Bind the listening address and answer frontends until one joins this instance; with
    ``back`` (the session a frontend gave up on), keep telling that frontend it may rejoin."""
    summary, joined = _model_summary(opts.model_dir), []
    hello = {
        "role": opts.role,
        "host": opts.host_id or host_identity(),
        "transport": opts.transport,
        "device": opts.device,
        "model": summary,
    }

    def handle(sender: str, msg: rpc.Msg) -> rpc.Msg | None:
        if sender != rpc.FRONTEND or joined:
            raise PermissionError(f"a waiting instance takes no {type(msg).__name__}")
        if not isinstance(msg, rpc.Hello | rpc.Join):  # a frontend that has not noticed yet
            raise SessionOver(f"{node.name} has no session: it waits to be joined")
        if isinstance(msg, rpc.Hello):
            return rpc.Info(hello)
        joined.append(_check_join(msg, opts))
        return None

    node = rpc.RpcNode(
        "waiting",
        handle,
        host=opts.host,
        port=opts.port,
        codec=rpc.Codec(opts.key.secret),
        curve=opts.key.curve_for(opts.host),
    )
    node.any_recipient = True  # frontends address it by the name they are about to give it
    logger.info("instance (%s) waiting for a frontend at %s", opts.role, node.address)
    if back is not None:
        node.name = back.name  # the name the frontend knows, to rejoin under
        node.connect(rpc.FRONTEND, back.frontend)
    try:
        last = 0.0
        # as often as its heartbeats went: to that frontend it is alive, with no session
        every = min(REJOIN_EVERY_S, back.heartbeat_s) if back is not None else REJOIN_EVERY_S
        while not joined:
            node.serve(LOBBY_POLL_S)
            if back is not None and time.monotonic() - last > every:
                if opts.parent_pid and process_gone(opts.parent_pid):
                    raise SystemExit(f"{back.name}: the launching process is gone")
                node.try_push(rpc.FRONTEND, rpc.Rejoin())
                last = time.monotonic()
    except BaseException:
        node.close()
        raise
    return node, joined[0]


def standalone_main(opts: StandaloneOptions) -> int:
    """``minimemserve instance``: wait for a frontend, serve its deployment, repeat (or stop
    after one with ``once``). Ctrl-C or SIGTERM ends it."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    torch.set_num_threads(opts.num_threads)
    serve_sessions(opts)
    return 0


def serve_sessions(opts: StandaloneOptions, first: InstanceServer | None = None) -> None:
    """Serve one frontend's session after another: ``first``'s (a spawned instance's), then each
    one a frontend joins. After a session the frontend gave up on (it declared this instance
    dead, or went silent), wait for that frontend to join it again; after one it closed, for the
    next frontend. A spawned instance returns once its frontend closed its session, and stops
    on a crash (a ``managed`` one too); with ``once``, return after one session."""
    spawned, back = first is not None or opts.managed, None
    while True:
        server, node, first = first, None, None
        if server is None:
            node, spec = _await_join(opts, back)
            logger.info("%s: joined %s as %s", spec.name, spec.config, opts.role)
        else:
            spec = server.spec
        given_up = False
        try:
            server = server or InstanceServer(spec, node)
            server.announce()
            logger.info("%s: ready", spec.name)
            server.run()
            logger.info("%s: the frontend ended the session (%s)", spec.name, server.stop_reason)
            given_up = server.stop_reason != CLOSING
        except SessionOver as e:
            logger.warning("%s: session over: %s", spec.name, e)
            given_up = True
        except Exception as e:  # a session that failed to start or crashed: the next one
            if spawned:
                raise
            logger.error("%s: session failed: %s: %s", spec.name, type(e).__name__, e)
            given_up = True
        finally:
            (server or node).close()
        back = spec if given_up else None
        if opts.once or (spawned and not given_up):
            return


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def instance_main(spec: InstanceSpec) -> None:
    """Entry point of a spawned instance process: it serves its frontend until that closes it
    (or is gone); declared dead by mistake (it stalled), it waits to be joined again."""
    # Ctrl-C reaches the whole process group; the frontend decides how we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    torch.set_num_threads(spec.num_threads)
    server = InstanceServer(spec)
    try:
        serve_sessions(spawned_options(spec, server.node.address), server)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    # Everything this process owns is released above; skip the slow interpreter teardown.
    os._exit(0)
