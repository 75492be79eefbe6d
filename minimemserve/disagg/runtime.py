"""The multi-process runtime: one process per instance, and a frontend that drives them.

:class:`ProcessCluster` is the multi-process twin of ``InProcessCluster``: it spawns one
process per instance (``instance.instance_main``), waits until all are ready, tells each
where its peers are, routes requests, and implements ``Serving``. KV moves between processes
only through MemPool's transfer calls, whose receiving side is an ``instance.RemotePool``.

Routing: a ``GlobalScheduler`` picks the entry instance (colocated, or prefill) by its
``policy``; its prompt trees mirror what each entry instance reports its index gained and
evicted (``CacheEvents``); under ``prompt_tree`` the instance holding most of a prompt may
first send the missing KV to the chosen one (``PushPrefix``).

Instances started on their own (``minimemserve instance``, any host) join a frontend given
their addresses (``instances=``) and the cluster key: it asks each its role (``Hello``), names
it, sends it the deployment (``Join``) and treats it like a spawned one. KV moves between two
instances through shared memory when they are on one host, else over a torch.distributed pair
group formed through a ``TCPStore`` the frontend hosts; ``transport`` forces one.

Faults: the frontend watches exit codes and heartbeats. When an instance dies it is named
(log, :attr:`ProcessCluster.dead`, the error of affected requests), its shared segment
unlinked, every other instance told (they release what they held for it), and its requests
re-run elsewhere when possible, else ended with ``finish_reason="error"``."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import secrets
import signal
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from ..config import NAME_PREFIX, EngineConfig, parse_config_name
from ..errors import (
    ConfigError,
    InstanceDied,
    InvalidRequest,
    MiniMemServeError,
    PoolExhausted,
    RemoteError,
    TransferError,
)
from ..mempool import TIERS, PoolAccountingError
from ..mempool.shared import segment_path
from ..model.config import ModelConfig
from ..model.tokenizer import Tokenizer
from ..parallel import HostStore
from ..request import RequestMetrics, RequestOutput, TokenDelta, logprobs_fit
from ..sampling import INT64_LIMIT, SamplingParams
from ..scheduler.global_scheduler import (
    DEFAULT_TTL_S,
    MOVES_PREFIXES,
    Cost,
    GlobalScheduler,
    Route,
)
from . import rpc
from .instance import CLOSING, DEFAULT_HEARTBEAT_S, InstanceSpec, instance_main

logger = logging.getLogger(__name__)

# Loading a checkpoint and importing torch takes seconds per process; a minute means stuck.
DEFAULT_STARTUP_TIMEOUT_S = 120.0
# Missed heartbeats tolerated: a long CPU prefill step sends none while it runs.
DEFAULT_HEARTBEAT_TIMEOUT_S = 20.0
# How long step() waits for a finished request before returning an empty list.
STEP_WAIT_S = 0.005
# Time a process gets to exit after Shutdown before it is terminated, then killed.
SHUTDOWN_GRACE_S = 5.0
# Modules the forkserver imports once, so instances forked from it start fast.
FORKSERVER_PRELOAD = ("minimemserve.disagg.instance",)
# A request is re-run at most this many times after instances died under it.
MAX_RERUNS = 2
# Aborts remembered until the instance that deferred them hands the request on.
ABORT_MEMORY = 4096
# How long abort() blocks on the socket per wait for an instance to finish its step.
ABORT_POLL_S = 0.002
# How long a frontend waits for a standalone instance's answer before asking again.
HELLO_RETRY_S = 2.0
# KV transports a cluster or an instance may ask for; "auto": shared memory on one host.
TRANSPORTS = ("auto", "shm", "gloo", "nccl")
# Exceptions an instance may raise for a bad request, re-raised here under their own class.
_REQUEST_ERRORS = {c.__name__: c for c in (InvalidRequest, PoolExhausted, ConfigError)}


@dataclass
class _Inflight:
    """What the frontend remembers of a request until its output arrives."""

    prompt: list[int]
    params: SamplingParams
    arrival_time: float
    where: str
    reruns: int = 0
    streamed: int = 0  # output tokens taken by take_deltas() so far
    pending: dict[int, tuple[int, Any]] = field(default_factory=dict)  # position -> (token, lp)

    def end(self, rid: str, reason: str, error: str | None = None) -> RequestOutput:
        """The output of a request ended here, with no token from an instance."""
        m = RequestMetrics(self.arrival_time, finish_time=time.perf_counter())
        m.prompt_tokens = len(self.prompt)
        return RequestOutput(rid, list(self.prompt), [], None, reason, m, error)


@dataclass
class InstanceInfo:
    """One instance process as the frontend knows it."""

    name: str
    role: str
    process: Any  # None: started on its own, maybe on another host
    address: str = ""
    handle: dict | None = None
    pid: int = 0
    ready: bool = False
    host: str = ""  # its host's identity (instance.host_identity)
    transport: str = "auto"  # the KV transport it asks for

    def peer_info(self) -> rpc.PeerInfo:
        """How its peers reach it."""
        return rpc.PeerInfo(
            self.name, self.role, self.address, self.handle, self.host, self.transport
        )


def pair_transport(a: InstanceInfo, b: InstanceInfo, forced: str = "auto") -> str:
    """How KV moves between ``a`` and ``b``: what the cluster (``forced``) or either asks for,
    else shared memory when they share a host, else torch.distributed (gloo on CPU, NCCL on
    CUDA: "gloo" names both)."""
    asked = {a.transport, b.transport, forced} - {"auto"}
    if len(asked) > 1:
        raise ConfigError(
            f"{a.name} asks for {a.transport} KV transport, {b.name} for {b.transport}"
        )
    same_host = a.host == b.host
    transport = asked.pop() if asked else ("shm" if same_host else "gloo")
    if transport == "shm" and not same_host:
        raise ConfigError(f"{a.name} and {b.name} are on different hosts: no shared memory")
    return "gloo" if transport == "nccl" else transport


def _cluster_key(
    instances: Sequence[str] | None, key: rpc.ClusterKey | str | Path | None, transport: str
) -> rpc.ClusterKey | None:
    """The cluster key a frontend was given (a file is read), after checking the options."""
    if transport not in TRANSPORTS:
        raise ConfigError(f"unknown KV transport {transport!r}; choose from {TRANSPORTS}")
    if instances is not None and key is None:
        raise ConfigError("instances started on their own need the cluster key (keygen)")
    if key is None or isinstance(key, rpc.ClusterKey):
        return key
    try:
        return rpc.ClusterKey.load(key)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _host_store(host: str, timeout_s: float) -> HostStore:
    try:
        return HostStore(host, timeout_s)
    except (OSError, RuntimeError) as e:
        raise TransferError(f"cannot host the torch.distributed store on {host}: {e}") from e


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` (an instance's ``--listen``) as a pair; raises ConfigError."""
    host, sep, port = address.removeprefix("tcp://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"instance address must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def _unlink_segment(handle: dict | None) -> None:
    with contextlib.suppress(TransferError, OSError):  # OSError: already gone
        if handle is not None and (path := segment_path(handle)) is not None:
            os.unlink(path)


def _reap(instances: Iterable[InstanceInfo], beacon: rpc.Beacon) -> None:
    """Stop the heartbeats, every process still running, and unlink every segment (idempotent)."""
    beacon.close()
    for inst in instances:
        if (p := inst.process) is None:
            continue  # started on its own: told to stop, its host cleans up after it
        for stop, wait_s in ((None, SHUTDOWN_GRACE_S), (p.terminate, 2.0), (p.kill, 2.0)):
            if p.is_alive():
                if stop is not None:
                    stop()
                p.join(wait_s)
        _unlink_segment(inst.handle)


class ProcessCluster:
    """Instances of one deployment, each in its own process, behind one frontend. ``config_name`` is
    a deployment name (``PD``, ``PD-CC``, ``1P1D``, ``1P1D-CC1/2/3``, ``xPyD[-CC...]``). Colocated
    configs run ``num_colocated`` engines; each process gets ``cores_per_instance`` torch threads.
    Ports: ``base_port=0`` binds free loopback ports, else the frontend binds ``base_port`` and
    instance ``i`` ``base_port + 1 + i``. ``timeout_s`` bounds every control request.
    ``start_method`` is ``"spawn"`` (fresh interpreters) or ``"forkserver"`` (forked from one server
    that imported torch once: much faster to start several clusters). ``policy``, ``cost_model`` and
    ``ttl_s`` configure the ``GlobalScheduler``. ``instances``: addresses (``host:port``) of
    instances started with ``minimemserve instance`` instead of spawning any (their roles make
    the deployment; ``key``, the cluster key file or :class:`~rpc.ClusterKey` they were started
    with, is then required, and ``host`` must be an address they reach). ``transport`` forces
    the KV transport of every pair (``shm``, ``gloo``; ``auto``: shared memory within a host).
    Use as a context manager, or call :meth:`close`; an abandoned cluster is reaped when
    garbage collected."""

    def __init__(
        self,
        model_dir: str | Path,
        config_name: str = "1P1D",
        *,
        cores_per_instance: int = 1,
        num_colocated: int = 2,
        engine_config: EngineConfig | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        timeout_s: float = rpc.DEFAULT_TIMEOUT_S,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        host: str = rpc.LOOPBACK,
        base_port: int = 0,
        rerun_on_failure: bool = True,
        start_method: str = "spawn",
        policy: str = "prompt_tree",
        cost_model: Cost | None = None,
        ttl_s: float = DEFAULT_TTL_S,
        instances: Sequence[str] | None = None,
        key: rpc.ClusterKey | str | Path | None = None,
        transport: str = "auto",
    ) -> None:
        self.deployment = parse_config_name(config_name)
        key, self.transport = _cluster_key(instances, key, transport), transport
        if cores_per_instance < 1:
            raise ConfigError(f"cores_per_instance must be >= 1, got {cores_per_instance}")
        if num_colocated < 1:
            raise ConfigError(f"num_colocated must be >= 1, got {num_colocated}")
        if not 0 <= base_port < 65536:
            raise ConfigError(f"base_port must be in [0, 65536), got {base_port}")
        self.model_dir, self.engine_config = Path(model_dir), engine_config or EngineConfig()
        if max(map(self.engine_config.tp_size, self.deployment.milestone.roles)) > 1:
            raise ConfigError(
                "tensor parallelism runs in-process deployments (LLM, InProcessCluster); "
                "a ProcessCluster instance is one process"
            )
        self.timeout_s, self.heartbeat_timeout_s = timeout_s, heartbeat_timeout_s
        self._heartbeat_s = heartbeat_s
        self.rerun_on_failure, self.tokenizer = rerun_on_failure, Tokenizer.from_dir(self.model_dir)
        model_config = ModelConfig.from_hf(self.model_dir)
        self.vocab_size = model_config.vocab_size  # to check what arrives
        self.dead: dict[str, str] = {}  # instance name -> why it died
        self.num_reruns = 0  # requests re-run after the instance holding them died
        self.prefix_tokens_moved = 0  # tokens of KV moved by the scheduler's prefix transfers
        self._inflight: dict[str, _Inflight] = {}
        # aborted while an instance was stepping: it aborts after its step (its Output lands
        # here), or hands the request on and the abort follows (request id -> its output)
        self._abort_later: OrderedDict[str, RequestOutput | None] = OrderedDict()
        self._late_aborts: list[tuple[str, str]] = []
        self._done: list[RequestOutput] = []
        self._ids, self._closed, self._old_sigterm = itertools.count(), False, None
        self._last_heard: dict[str, float] = {}
        self._handlers = {
            rpc.Output: self._on_output,
            rpc.Tokens: self._on_tokens,
            rpc.Handoff: self._on_handoff,
            rpc.Ready: self._on_ready,
            rpc.Heartbeat: lambda sender, msg: None,
            rpc.CacheEvents: self._on_cache_events,
            rpc.Rejoin: self._on_rejoin,
        }
        # standalone instances declared dead, that may come back: gone (nothing heard),
        # back (it said it is waiting again), joining (asked to join again, at a time)
        self._gone: set[str] = set()
        self._back: set[str] = set()
        self._joining: dict[str, float] = {}
        self.num_rejoins = 0  # instances taken back after they were declared dead
        self._host = host
        milestone = self.deployment.milestone
        # transfers (the recipes', or the scheduler's prefix pushes) need pools peers can reach
        pushes = policy in MOVES_PREFIXES and milestone.entry_caches
        linked = self._linked = milestone.moves_kv or pushes
        # the secret reaches spawned instances through the spawn pipe; off loopback every
        # socket is CURVE-encrypted with a key pair made here (or the cluster key's)
        secret = key.secret if key is not None else secrets.token_bytes(32)
        curve = (key or rpc.ClusterKey.generate()).curve_for(host)
        codec = rpc.Codec(secret)
        self.session = secrets.token_hex(8)  # names this deployment's pair groups
        self._store: HostStore | None = None  # where torch.distributed pairs meet, if any
        self.node = rpc.RpcNode(
            "frontend",
            self._handle,
            host=host,
            port=base_port,
            timeout_s=timeout_s,
            codec=codec,
            curve=curve,
        )
        # heartbeats to every instance, from a thread: they hear the frontend while it is idle
        self._beacon = rpc.Beacon("frontend", codec, heartbeat_s, curve)
        self.instances: dict[str, InstanceInfo] = {}
        self._finalizer = weakref.finalize(self, _reap, self.instances.values(), self._beacon)
        try:
            if instances is not None:
                self._join(instances, model_config, startup_timeout_s)
            else:
                roles = self.deployment.instances(colocated=num_colocated)
                spec_args = (device, dtype, cores_per_instance, host, base_port, heartbeat_s)
                self._spawn(roles, start_method, spec_args, linked, transport, secret, curve)
            entry = milestone.roles[0]
            self.scheduler = GlobalScheduler(
                [n for n, i in self.instances.items() if i.role == entry],
                policy=policy,
                block_size=self.engine_config.block_size,
                cost_model=cost_model,
                ttl_s=ttl_s,
                caching=milestone.entry_caches,
            )
            self._wait_ready(startup_timeout_s)
            for inst in self.instances.values():
                self.node.connect(inst.name, inst.address)
            if linked:
                self._link(startup_timeout_s)
        except BaseException:
            self.close()
            raise
        self._install_sigterm()

    # ---- start-up and shutdown -------------------------------------------------------------
    def _spawn(self, roles, start_method, spec_args, linked, transport, secret, curve) -> None:
        """Start one process per ``(name, role)`` on this host."""
        device, dtype, cores_per_instance, host, base_port, heartbeat_s = spec_args
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        for i, (name, role) in enumerate(roles):
            spec = InstanceSpec(
                name=name,
                role=role,
                config=self.deployment.name,
                model_dir=str(self.model_dir),
                frontend=self.node.address,
                engine_config=self.engine_config,
                device=device,
                dtype=dtype,
                num_threads=cores_per_instance,
                host=host,
                port=base_port + 1 + i if base_port else 0,
                timeout_s=self.timeout_s,
                heartbeat_s=heartbeat_s,
                parent_pid=os.getpid(),
                frontend_timeout_s=self.heartbeat_timeout_s,
                shared_pool=linked and transport in ("auto", "shm"),
                secret=secret,
                curve=curve,
                transport=transport,
            )
            proc = ctx.Process(target=instance_main, args=(spec,), name=f"mms-{name}")
            proc.daemon = True
            proc.start()
            self.instances[name] = InstanceInfo(name, role, proc)

    def _join(self, addresses: Sequence[str], model_config: ModelConfig, timeout_s: float) -> None:
        """Ask each standalone instance what it is, name it by role, and send it the deployment."""
        found: list[tuple[str, str, dict]] = []  # (address, role, hello)
        for i, address in enumerate(addresses):
            host, port = parse_address(address)
            address = rpc.endpoint(host, port)
            found.append((address, *self._hello(f"?{i}", address, timeout_s)))
        roles = self.deployment.milestone.roles
        for address, role, hello in found:
            model = hello.get("model")
            if role not in roles:
                raise ConfigError(f"{self.deployment.name} has no {role!r} role ({address})")
            if (
                not isinstance(model, dict)
                or not model
                or any(getattr(model_config, str(k), None) != v for k, v in model.items())
            ):
                raise ConfigError(f"the instance at {address} serves another model: {model}")
        if missing := [r for r in roles if r not in {role for _, role, _ in found}]:
            raise ConfigError(f"{self.deployment.name} needs {missing} instances too")
        counts: dict[str, int] = {}
        for address, role, _ in found:
            name = f"{NAME_PREFIX[role]}{counts.setdefault(role, 0)}"
            counts[role] += 1
            self.instances[name] = InstanceInfo(name, role, None, address)
            self.node.connect(name, address)
            join = self._join_message(name)
            try:
                self.node.call(name, join, timeout_s=timeout_s)
            except RemoteError as e:
                raise ConfigError(f"the instance at {address} refused to join: {e}") from None

    def _join_message(self, name: str) -> rpc.Join:
        """What a standalone instance named ``name`` is sent to join this deployment."""
        return rpc.Join(
            self.session,
            name,
            self.deployment.name,
            self.node.address,
            dataclasses.asdict(self.engine_config),
            self.timeout_s,
            self._heartbeat_s,
            self.heartbeat_timeout_s,
            self._linked,
        )

    def _hello(self, name: str, address: str, timeout_s: float) -> tuple[str, dict]:
        """The role and ``Hello`` answer of the instance at ``address``. Asked again every
        :data:`HELLO_RETRY_S`: a frame that reached a socket the instance was closing (it
        rebinds between sessions) is lost, not refused."""
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                self.node.connect(name, address)
                left = deadline - time.monotonic()
                try:
                    hello = self.node.call(name, rpc.Hello(), timeout_s=min(HELLO_RETRY_S, left))
                    return str(hello.data.get("role")), hello.data
                except RemoteError:
                    raise
                except TransferError as e:
                    if time.monotonic() >= deadline:
                        raise InstanceDied(f"no instance answers at {address}: {e}") from None
        finally:
            self.node.disconnect(name)

    def _link(self, timeout_s: float) -> None:
        """Tell every instance its peers and the transport of each pair; pairs that use
        torch.distributed form their groups through a store hosted here."""
        insts = list(self.instances.values())
        for a in insts:
            self.node.push(a.name, rpc.Peers(self._seen_by(a, insts), self._store_address()))
        for a in insts:  # answered once its pair groups formed
            formed = self.node.call(a.name, rpc.Query("links"), timeout_s=timeout_s).data
            ways = {b.name: pair_transport(a, b, self.transport) for b in insts if b is not a}
            if missing := {b for b, way in ways.items() if way == "gloo"} - set(formed):
                raise TransferError(f"{a.name} formed no torch.distributed link with {missing}")

    def _seen_by(self, a: InstanceInfo, insts: Sequence[InstanceInfo]) -> list[rpc.PeerInfo]:
        """``a`` and the instances ``insts`` as ``a`` reaches them (transport, pool handle)."""
        out = [a.peer_info()]
        for b in (b for b in insts if b is not a):
            way = pair_transport(a, b, self.transport)
            handle = b.handle if way == "shm" else None
            out.append(msgspec.structs.replace(b.peer_info(), transport=way, handle=handle))
            if way == "gloo" and self._store is None:
                self._store = _host_store(self._host, self.timeout_s)
        return out

    def _store_address(self) -> str:
        return f"{self._host}:{self._store.port}" if self._store is not None else ""

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(not i.ready for i in self.instances.values()):
            self.node.serve(0.05)
            for inst in self.instances.values():
                if not inst.ready and inst.process is not None and not inst.process.is_alive():
                    raise RuntimeError(
                        f"instance {inst.name} ({inst.role}) exited during start-up with code "
                        f"{inst.process.exitcode}; see its stderr above"
                    )
            if time.monotonic() > deadline:
                late = [i.name for i in self.instances.values() if not i.ready]
                raise TimeoutError(f"instances {late} not ready within {timeout_s:g} s")
        self._last_heard = dict.fromkeys(self.instances, time.monotonic())

    def _install_sigterm(self) -> None:
        """SIGTERM ends the program like Ctrl-C does, so ``with`` blocks shut down cleanly."""
        main = threading.current_thread() is threading.main_thread()
        if not main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # only the main thread may set it; or the application handles it

        def on_term(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")

        self._old_sigterm = signal.signal(signal.SIGTERM, on_term)

    def close(self) -> None:
        """Shut every instance down, reap the processes, unlink shared memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for inst in self.instances.values():
            if inst.name not in self.dead and inst.ready:
                self.node.try_push(inst.name, rpc.Shutdown(CLOSING))
            elif inst.process is not None and inst.process.is_alive():
                inst.process.terminate()  # declared dead, maybe waiting to rejoin: no grace
        if any(i.process is None for i in self.instances.values()):
            time.sleep(0.05)  # let the Shutdown frames to other hosts leave before the sockets go
        self._finalizer()
        if self._store is not None:
            self._store.close()
            self._store = None
        self.node.close()
        if self._old_sigterm is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def __enter__(self) -> ProcessCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- messages from instances -----------------------------------------------------------
    def _handle(self, sender: str, msg: rpc.Msg) -> None:
        handler = self._handlers.get(type(msg))
        back = (type(msg) is rpc.Rejoin and sender in self._gone) or (
            type(msg) is rpc.Ready and sender in self._joining
        )
        if handler is None or sender not in self.instances or (sender in self.dead and not back):
            raise PermissionError(f"the frontend takes no {type(msg).__name__} from {sender!r}")
        self._last_heard[sender] = time.monotonic()
        handler(sender, msg)

    def _on_output(self, sender: str, msg: rpc.Output) -> None:
        out = msg.output
        if out.request_id in self._abort_later:  # the end of an abort that waited for a step
            self._abort_later[out.request_id] = out
        elif self._inflight.pop(out.request_id, None) is not None:
            self._done.append(out)
            answered = out.finish_reason in ("stop", "length")
            self.scheduler.finished(out.request_id, None, len(out.token_ids) if answered else None)

    def _on_tokens(self, sender: str, msg: rpc.Tokens) -> None:
        """Stream positions from P and D may arrive out of order: keep them by position."""
        for d in msg.deltas:
            f = self._inflight.get(d.request_id)
            if f is None:
                continue  # ended meanwhile (aborted, or re-run elsewhere)
            n = len(d.token_ids)
            if not (
                0 <= d.start
                and d.start + n <= f.params.max_tokens
                and all(0 <= t < self.vocab_size for t in d.token_ids)
                and logprobs_fit(d.logprobs, n, f.params.logprobs, self.vocab_size)
            ):
                raise ValueError(f"{sender} sent tokens that do not fit {d.request_id!r}")
            if d.start == 0:
                self.scheduler.started(d.request_id)
            lps = d.logprobs or [None] * len(d.token_ids)
            for i, (tok, lp) in enumerate(zip(d.token_ids, lps)):
                if d.start + i >= f.streamed:
                    f.pending[d.start + i] = (tok, lp)

    def take_deltas(self) -> list[TokenDelta]:
        """Tokens of unfinished requests received since the last call, in order per request."""
        out = []
        for rid, f in self._inflight.items():
            run = []
            while (item := f.pending.pop(f.streamed + len(run), None)) is not None:
                run.append(item)
            if run:
                lps = None if f.params.logprobs is None else [lp for _, lp in run]
                out.append(TokenDelta(rid, f.streamed, [t for t, _ in run], lps))
                f.streamed += len(run)
        return out

    def load(self) -> dict[str, dict]:
        """Every live instance's role and requests waiting and running."""
        return {name: data["load"] for name, data in self._ask_all("stats").items()}

    def _on_handoff(self, sender: str, msg: rpc.Handoff) -> None:
        if msg.request_id in self._abort_later and msg.to in self.instances:
            self._late_aborts.append((msg.request_id, msg.to))
        f = self._inflight.get(msg.request_id)
        if f is None or f.where != sender or msg.to not in self.instances:
            return
        if msg.to in self.dead:  # handed over before that instance died: lost there
            reason = f"InstanceDied: instance {msg.to} died ({self.dead[msg.to]})"
            self._recover(msg.request_id, f, reason)
        else:
            f.where = msg.to
            self.scheduler.prefilled(msg.request_id)

    def _on_cache_events(self, sender: str, msg: rpc.CacheEvents) -> None:
        for added, tokens in msg.events:  # the instance's own index, in order
            (self.scheduler.record if added else self.scheduler.trees.forget)(sender, tokens)

    def _on_ready(self, sender: str, msg: rpc.Ready) -> None:
        inst, info = self.instances[sender], msg.info
        if inst.ready or (info.name, info.role) != (sender, inst.role):
            raise PermissionError(f"{sender} cannot report ready as {info.name} ({info.role})")
        if info.handle is not None:
            segment_path(info.handle)  # only the project's own segments are ever mapped
        if inst.process is not None:  # spawned here: where it listens is what it says
            inst.address = info.address
        inst.handle, inst.pid, inst.host, inst.transport = (
            info.handle,
            msg.pid,
            info.host,
            info.transport,
        )
        inst.ready = True
        self._beacon.add(inst.name, inst.address)

    # ---- liveness --------------------------------------------------------------------------
    def monitor(self) -> dict[str, str]:
        """Check every instance (exit code, heartbeat); handle deaths. Returns :attr:`dead`.
        Silence counts up to the frontend's last read of its socket, not up to now: a caller
        that has not stepped for a while has not read the heartbeats, and blames nobody."""
        if self._closed:
            return self.dead
        now, read = time.monotonic(), self.node.drained_at
        for inst in [i for i in self.instances.values() if i.name not in self.dead]:
            if inst.process is not None and not inst.process.is_alive():
                self._on_death(inst, f"process exited with code {inst.process.exitcode}")
            elif read - self._last_heard.get(inst.name, read) > self.heartbeat_timeout_s:
                # should it wake up, it drops this session and rejoins (spawned ones too)
                self.node.try_push(inst.name, rpc.Shutdown("declared dead: no heartbeat"))
                self._gone.add(inst.name)
                self._on_death(inst, f"no heartbeat for {self.heartbeat_timeout_s:g} s")
        for name in list(self._back):
            self._ask_back(self.instances[name])
        for name, asked in list(self._joining.items()):
            if self.instances[name].ready:
                self._revive(self.instances[name])
            elif now - asked > self.timeout_s:  # it never got ready: wait for its next Rejoin
                del self._joining[name]
                self._gone.add(name)
        return self.dead

    def _on_rejoin(self, sender: str, msg: rpc.Rejoin) -> None:
        if sender in self._gone:
            self._gone.discard(sender)
            self._back.add(sender)  # monitor() asks it to join (a handler must not call)

    def _ask_back(self, inst: InstanceInfo) -> None:
        """Send a Join to a standalone instance that came back."""
        self._back.discard(inst.name)
        inst.ready, inst.handle = False, None
        self.node.connect(inst.name, inst.address)  # frames queued for its old session go
        join = self._join_message(inst.name)
        reason = self.node.dead.pop(inst.name, "")  # the node would refuse to call it
        try:
            self.node.call(inst.name, join, timeout_s=self.timeout_s)
        except TransferError as e:
            logger.warning("instance %s did not rejoin: %s", inst.name, e)
            self.node.dead[inst.name] = reason
            self._gone.add(inst.name)
            return
        self._joining[inst.name] = time.monotonic()

    def _revive(self, inst: InstanceInfo) -> None:
        """Take a rejoined instance back: peers reach it again, the scheduler routes to it."""
        del self._joining[inst.name]
        self.num_rejoins += 1
        scope = f"r{self.num_rejoins}"  # new pair groups: the old ones died with its session
        others = [i for i in self.instances.values() if i.name not in self.dead]
        try:
            if self._linked:
                seen = self._seen_by(inst, [inst, *others])
                for b, way in zip(others, (info.transport for info in seen[1:])):
                    info = msgspec.structs.replace(
                        inst.peer_info(),
                        transport=way,
                        handle=inst.handle if way == "shm" else None,
                    )
                    self.node.push(b.name, rpc.PeerUp(info, self._store_address(), scope))
                self.node.push(inst.name, rpc.Peers(seen, self._store_address(), scope))
                self.node.call(inst.name, rpc.Query("links"), timeout_s=self.timeout_s)
        except (TransferError, ConfigError) as e:
            logger.warning("instance %s could not rejoin: %s", inst.name, e)
            self.node.dead[inst.name] = self.dead[inst.name]
            self._gone.add(inst.name)
            return
        del self.dead[inst.name]
        self._last_heard[inst.name] = time.monotonic()
        if inst.role == self.deployment.milestone.roles[0]:
            self.scheduler.add(inst.name)
        logger.warning("instance %s (%s) rejoined", inst.name, inst.role)

    def _on_death(self, inst: InstanceInfo, reason: str) -> None:
        self.dead[inst.name] = reason
        self.node.dead[inst.name] = reason
        self.scheduler.drop(inst.name)
        logger.error("instance %s (%s) died: %s", inst.name, inst.role, reason)
        self._beacon.remove(inst.name)
        if inst.process is not None:
            _unlink_segment(inst.handle)
        for other in self.instances.values():
            if other.name in self.dead or not other.ready:
                continue
            try:
                rep = self.node.call(other.name, rpc.PeerDown(inst.name, reason))
            except TransferError as e:
                logger.warning("could not tell %s that %s died: %s", other.name, inst.name, e)
                continue
            # hand-offs to the dead instance whose notice has not reached us yet
            for rid in rep.data.get("handed", ()) if isinstance(rep, rpc.Info) else ():
                if (f := self._inflight.get(rid)) is not None and f.where == other.name:
                    f.where = inst.name
        for rid, f in list(self._inflight.items()):
            if f.where == inst.name:
                self._recover(rid, f, f"InstanceDied: instance {inst.name} died ({reason})")

    def _recover(self, rid: str, f: _Inflight, error: str) -> None:
        """Re-run a request whose instance died, or end it with ``error``."""
        if self.rerun_on_failure and f.reruns < MAX_RERUNS:
            with contextlib.suppress(TransferError, MiniMemServeError):
                route = self._route(f.prompt, f.params.max_tokens)
                f.reruns += 1
                self._submit(route, rid, f)
                self.num_reruns += 1
                logger.warning("request %s re-run on %s after: %s", rid, route.instance, error)
                return
        self._inflight.pop(rid, None)
        self.scheduler.finished(rid)
        self._done.append(f.end(rid, "error", error))

    # ---- routing ---------------------------------------------------------------------------
    def _route(self, prompt: Sequence[int], max_tokens: int) -> Route:
        live = {i.role for i in self.instances.values() if i.name not in self.dead}
        if not live.issuperset(self.deployment.milestone.roles):
            raise InstanceDied(f"a role has no live instance left: {self.dead}")
        try:
            route = self.scheduler.route(prompt, max_tokens)
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

    def _submit(self, route: Route, rid: str, f: _Inflight) -> None:
        self._inflight[rid] = f
        f.where = route.instance
        # before the call: its output may be handled while the call waits for the reply
        self.scheduler.dispatched(rid, route, len(f.prompt), f.params.max_tokens)
        try:
            self.node.call(
                route.instance, rpc.Submit(rid, list(f.prompt), f.params, f.arrival_time)
            )
        except BaseException:
            self._inflight.pop(rid, None)
            self.scheduler.finished(rid)
            raise

    # ---- engine API ------------------------------------------------------------------------
    def _raise_remote(self, e: RemoteError) -> None:
        if (cls := _REQUEST_ERRORS.get(e.kind)) is not None:
            raise cls(e.remote_message) from None
        raise e

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of ``prompt``; ids no message may carry are refused here (the instance
        checks the model's vocabulary)."""
        ids = self.tokenizer.prompt_ids(prompt)
        if bad := [t for t in ids if not 0 <= t < INT64_LIMIT]:
            raise InvalidRequest(f"token id {bad[0]!r} is outside the vocabulary")
        return ids

    def validate(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        """Token ids of ``prompt``, or the instance's exception naming the problem."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self._prompt_ids(prompt)
        if not (live := [n for n in self.instances if n not in self.dead]):
            raise InstanceDied(f"every instance died: {self.dead}")
        try:
            info = self.node.call(live[0], rpc.Query("validate", ids, params))
        except RemoteError as e:
            self._raise_remote(e)
        return list(info.data["ids"])

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Route and queue a request; returns its id. Bad requests raise here."""
        if self._closed:
            raise RuntimeError("the cluster is closed")
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self._prompt_ids(prompt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._inflight:
            raise InvalidRequest(f"request id {rid!r} is already in use")
        self.monitor()
        f = _Inflight(ids, params, arrival_time or time.perf_counter(), "")
        try:
            self._submit(self._route(ids, params.max_tokens), rid, f)
        except RemoteError as e:
            self._raise_remote(e)
        return rid

    def step(self) -> list[RequestOutput]:
        """Collect the requests that finished since the last call (waits a few ms for one)."""
        deadline = time.monotonic() + STEP_WAIT_S
        while not (self._done or self._closed) and (left := deadline - time.monotonic()) > 0:
            self.node.serve(left)
        if not self._closed:
            self.node.serve(0.0)
            self.monitor()
            self._abort_handed_on()
        out, self._done = self._done, []
        return out

    def _abort_handed_on(self) -> None:
        """Abort requests that were handed on while their first abort waited for a step."""
        late, self._late_aborts = self._late_aborts, []
        for rid, name in late:
            if name not in self.dead:
                with contextlib.suppress(TransferError):
                    rep = self.node.call(name, rpc.AbortRequest(rid))
                    if isinstance(rep, rpc.Output) and rid in self._abort_later:
                        self._abort_later[rid] = rep.output

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is (asking the instance the frontend believes holds it
        first, then the others) and return its partial output; None if unknown or done. An
        instance in the middle of a step aborts after it (or hands the request on, and the
        abort follows it there); this waits for that output, up to ``timeout_s``."""
        if (f := self._inflight.pop(request_id, None)) is None:
            return None
        self.scheduler.finished(request_id)
        order = [f.where] + [n for n in self.instances if n != f.where]
        for name in (n for n in order if n not in self.dead):
            with contextlib.suppress(TransferError):
                rep = self.node.call(name, rpc.AbortRequest(request_id))
                if isinstance(rep, rpc.Output):
                    return rep.output
                if isinstance(rep, rpc.Info) and rep.data.get("deferred"):
                    return self._await_abort(request_id) or f.end(request_id, "abort")
        return f.end(request_id, "abort")

    def _await_abort(self, request_id: str) -> RequestOutput | None:
        self._abort_later[request_id] = None
        while len(self._abort_later) > ABORT_MEMORY:
            self._abort_later.popitem(last=False)
        deadline = time.monotonic() + self.timeout_s
        while self._abort_later.get(request_id, 0) is None and time.monotonic() < deadline:
            self.node.serve(ABORT_POLL_S)
            self.monitor()
            self._abort_handed_on()
        return self._abort_later.pop(request_id, None)

    def location(self, request_id: str) -> str | None:
        """The instance a request is on now (as far as the frontend knows); None once done."""
        f = self._inflight.get(request_id)
        return None if f is None else f.where

    def has_unfinished(self) -> bool:
        """Whether any submitted request has not been returned by :meth:`step` yet."""
        return bool(self._inflight or self._done)

    def run_until_done(self, timeout_s: float | None = None) -> list[RequestOutput]:
        """Step until every request finished and return their outputs; after ``timeout_s``
        the requests still running are aborted (their partial outputs come back with
        ``finish_reason="abort"``), so nothing keeps holding blocks."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        outs: list[RequestOutput] = []
        while self.has_unfinished():
            outs.extend(self.step())
            if deadline is not None and time.monotonic() > deadline:
                left = [self.abort(rid) for rid in list(self._inflight)]
                logger.warning("%d requests aborted after %g s", len(left), timeout_s)
                return outs + [o for o in left if o is not None] + self.step()
        return outs

    def _ask_all(self, what: str) -> dict[str, dict]:
        live = [name for name in self.instances if name not in self.dead]
        return {name: self.node.call(name, rpc.Query(what)).data for name in live}

    def stats(self) -> dict[str, dict]:
        """Per live instance: pool stats, requests held, blocks granted to peers, dead peers,
        control frames rejected and dropped as replayed; ``"frontend"``: the frontend's."""
        frontend = {"rejected": self.node.rejected, "replayed": self.node.replayed}
        return self._ask_all("stats") | {"frontend": frontend}

    def pool_stats(self) -> dict[str, dict]:
        """``{live instance: MemPool.stats()}``."""
        return {name: data["pool"] for name, data in self._ask_all("stats").items()}

    def check_pools(self, require_idle: bool = True) -> dict[str, dict]:
        """Every live instance audits its pool (``MemPool.check``); raises ``PoolAccountingError``
        if one is off, or with ``require_idle`` if a block is still referenced (held outside the
        cache index): call it once every request finished. Returns the reports by name."""
        reports, problems = self._ask_all("check"), []
        for name, rep in reports.items():
            if not rep["ok"]:
                problems.append(f"{name}: {rep['error']}")
            for tier, counts in rep["pool"].items():
                if require_idle and tier in TIERS and counts["referenced"]:
                    problems.append(f"{name}: {counts['referenced']} {tier} blocks referenced")
        if problems:
            raise PoolAccountingError("pool balance: " + "; ".join(problems))
        return reports
