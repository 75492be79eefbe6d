"""The multi-process runtime: one process per instance, and a frontend that drives them.

:class:`ProcessCluster` is the multi-process twin of
:class:`~minimemserve.disagg.cluster.InProcessCluster` (and of a set of colocated engines):
it spawns one process per instance (:func:`~minimemserve.disagg.instance_proc.instance_main`),
waits until all are ready, tells each where its peers are, routes requests, and offers the
engine API the benchmark drives (``add_request``, ``step``, ``has_unfinished``,
``validate``, ``tokenizer``). KV moves between processes only through MemPool's transfer
calls, whose receiving side is a :class:`~minimemserve.disagg.remote.RemotePool`.

Routing: a :class:`~minimemserve.scheduler.global_scheduler.GlobalScheduler` picks the
colocated instance (PD, PD-CC) or the prefill instance (xPyD) by its ``policy``; the
default, ``prompt_tree``, weighs each instance's believed cached prefix and queued work
with the cost model. Finished requests update its prompt trees. With
``prompt_tree_transfer`` an instance holding more of a prompt first sends the missing KV
to the chosen one (``PushPrefix``). The prefill instance picks the decode instance
holding most of the prompt.

Faults: the frontend watches process exit codes and heartbeats. When an instance dies it
names it (log, :attr:`ProcessCluster.dead`, the error of affected requests), unlinks its
shared segment, tells every other instance (which then release whatever they held for it
and stop sending to it), and re-runs the requests that were on it elsewhere when possible;
otherwise they end with ``finish_reason="error"``. Nothing waits longer than ``timeout_s``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minimemserve.config import EngineConfig, parse_config_name
from minimemserve.disagg.control import Heartbeat, RemoteError
from minimemserve.disagg.instance_proc import DEFAULT_HEARTBEAT_S, InstanceSpec, instance_main
from minimemserve.disagg.remote import (
    LOOPBACK,
    Handoff,
    Output,
    PeerDown,
    Peers,
    PushPrefix,
    Query,
    Ready,
    RpcNode,
    Shutdown,
    Submit,
    output_from_dict,
    params_to_dict,
)
from minimemserve.errors import (
    ConfigError,
    InstanceDied,
    InvalidRequest,
    MiniMemServeError,
    PoolExhausted,
    TransferError,
)
from minimemserve.request import RequestMetrics, RequestOutput
from minimemserve.sampling import SamplingParams
from minimemserve.scheduler.global_scheduler import (
    DEFAULT_TTL_S,
    Cost,
    GlobalScheduler,
    Route,
)

logger = logging.getLogger(__name__)

# Loading a checkpoint and importing torch takes seconds per process; a minute means stuck.
DEFAULT_STARTUP_TIMEOUT_S = 120.0
DEFAULT_TIMEOUT_S = 30.0
# Missed heartbeats tolerated: a long CPU prefill step sends none while it runs.
DEFAULT_HEARTBEAT_TIMEOUT_S = 20.0
# How long step() waits for a finished request before returning an empty list.
STEP_WAIT_S = 0.005
# Time a process gets to exit after Shutdown before it is terminated, then killed.
SHUTDOWN_GRACE_S = 5.0
# Modules the forkserver imports once, so instances forked from it start fast.
FORKSERVER_PRELOAD = ("minimemserve.disagg.instance_proc", "minimemserve.engine")
# A request is re-run at most this many times after instances died under it.
MAX_RERUNS = 2
# Exceptions an instance may raise for a bad request, re-raised here under their own class.
_REQUEST_ERRORS: dict[str, type[MiniMemServeError]] = {
    "InvalidRequest": InvalidRequest,
    "PoolExhausted": PoolExhausted,
    "ConfigError": ConfigError,
}


@dataclass
class _Inflight:
    """What the frontend remembers of a request until its output arrives."""

    prompt: list[int]
    params: SamplingParams
    arrival_time: float
    where: str
    reruns: int = 0


@dataclass
class InstanceInfo:
    """One instance process as the frontend knows it."""

    name: str
    role: str
    process: Any
    address: str = ""
    handle: dict | None = None
    pid: int = 0


def _unlink_segment(handle: dict | None) -> None:
    if handle and handle.get("kind") == "cpu_shm":
        with contextlib.suppress(FileNotFoundError, OSError):
            os.unlink(os.path.join(handle["shm_dir"], handle["name"]))


def _reap(instances: list[InstanceInfo]) -> None:
    """Stop every process still running and unlink every segment (idempotent)."""
    for inst in instances:
        p = inst.process
        if p.is_alive():
            p.join(SHUTDOWN_GRACE_S)
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
        _unlink_segment(inst.handle)


class ProcessCluster:
    """Instances of one deployment, each in its own process, behind one frontend.

    ``config_name`` is a deployment name (``PD``, ``PD-CC``, ``1P1D``, ``1P1D-CC1/2/3``,
    ``xPyD[-CC...]``). Colocated configs run ``num_colocated`` engines. Each process gets
    ``cores_per_instance`` torch threads. Ports: ``base_port=0`` binds free loopback ports;
    otherwise the frontend binds ``base_port`` and instance ``i`` ``base_port + 1 + i``.
    ``timeout_s`` bounds every control request. ``start_method`` is ``"spawn"`` (fresh
    interpreters) or ``"forkserver"`` (fresh processes forked from one server that imported
    torch once: much faster to start several clusters in one program). ``policy``,
    ``cost_model`` and ``ttl_s`` configure the global scheduler (see
    :mod:`minimemserve.scheduler.global_scheduler`). Use as a context manager, or call
    :meth:`close`; an abandoned cluster is reaped when garbage collected.
    """

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
        timeout_s: float = DEFAULT_TIMEOUT_S,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        host: str = LOOPBACK,
        base_port: int = 0,
        rerun_on_failure: bool = True,
        start_method: str = "spawn",
        policy: str = "prompt_tree",
        cost_model: Cost | None = None,
        ttl_s: float = DEFAULT_TTL_S,
    ) -> None:
        from minimemserve.model.tokenizer import Tokenizer

        self.deployment = parse_config_name(config_name)
        if cores_per_instance < 1:
            raise ConfigError(f"cores_per_instance must be >= 1, got {cores_per_instance}")
        if num_colocated < 1:
            raise ConfigError(f"num_colocated must be >= 1, got {num_colocated}")
        if not 0 <= base_port < 65536:
            raise ConfigError(f"base_port must be in [0, 65536), got {base_port}")
        self.model_dir = Path(model_dir)
        self.engine_config = engine_config or EngineConfig()
        self.timeout_s = timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.rerun_on_failure = rerun_on_failure
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.dead: dict[str, str] = {}  # instance name -> why it died
        self.num_reruns = 0  # requests re-run after the instance holding them died
        self.prefix_tokens_moved = 0  # tokens of KV moved by the scheduler's prefix transfers
        self._inflight: dict[str, _Inflight] = {}
        self._done: list[RequestOutput] = []
        self._ids = itertools.count()
        self._last_heard: dict[str, float] = {}
        self._closed = False
        self._old_sigterm = None

        d = self.deployment
        if d.colocated:
            roles = [(f"C{i}", "colocated") for i in range(num_colocated)]
        else:
            roles = [(f"P{i}", "prefill") for i in range(d.num_prefill)]
            roles += [(f"D{i}", "decode") for i in range(d.num_decode)]
        first_role = "colocated" if d.colocated else "prefill"
        self.scheduler = GlobalScheduler(
            [n for n, r in roles if r == first_role],
            policy=policy,
            block_size=self.engine_config.block_size,
            cost_model=cost_model,
            ttl_s=ttl_s,
            caching=d.cache_level > 0,
        )
        # prefix transfers between colocated instances need their pools mapped by peers
        linked = not d.colocated or policy == "prompt_tree_transfer"
        self.node = RpcNode(
            "frontend", self._handle, host=host, port=base_port, timeout_s=timeout_s
        )
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # the server imports torch and the engine once; each instance then starts in ms
            ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        self.instances: dict[str, InstanceInfo] = {}
        self._finalizer = weakref.finalize(self, _reap, [])
        try:
            for i, (name, role) in enumerate(roles):
                spec = InstanceSpec(
                    name=name,
                    role=role,
                    config=d.name,
                    model_dir=str(self.model_dir),
                    frontend=self.node.address,
                    engine_config=self.engine_config,
                    device=device,
                    dtype=dtype,
                    num_threads=cores_per_instance,
                    host=host,
                    port=base_port + 1 + i if base_port else 0,
                    timeout_s=timeout_s,
                    heartbeat_s=heartbeat_s,
                    parent_pid=os.getpid(),
                    shared_pool=linked,
                )
                proc = ctx.Process(target=instance_main, args=(spec,), name=f"mms-{name}")
                proc.daemon = True
                proc.start()
                self.instances[name] = InstanceInfo(name, role, proc)
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _reap, list(self.instances.values()))
            self._wait_ready(startup_timeout_s)
            peers = [
                {"name": i.name, "role": i.role, "address": i.address, "handle": i.handle}
                for i in self.instances.values()
            ]
            for inst in self.instances.values():
                self.node.connect(inst.name, inst.address)
            if linked:
                for inst in self.instances.values():
                    self.node.call(inst.name, Peers(peers))
        except BaseException:
            self.close()
            raise
        self._install_sigterm()

    # ---- start-up and shutdown -------------------------------------------------------------
    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(not i.address for i in self.instances.values()):
            self.node.serve(0.05)
            for inst in self.instances.values():
                if not inst.address and not inst.process.is_alive():
                    raise RuntimeError(
                        f"instance {inst.name} ({inst.role}) exited during start-up with code "
                        f"{inst.process.exitcode}; see its stderr above"
                    )
            if time.monotonic() > deadline:
                late = [i.name for i in self.instances.values() if not i.address]
                raise TimeoutError(f"instances {late} not ready within {timeout_s:g} s")
        now = time.monotonic()
        for name in self.instances:
            self._last_heard[name] = now

    def _install_sigterm(self) -> None:
        """SIGTERM ends the program like Ctrl-C does, so ``with`` blocks shut down cleanly."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the application handles it

        def on_term(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")

        self._old_sigterm = signal.signal(signal.SIGTERM, on_term)

    def close(self) -> None:
        """Shut every instance down, reap the processes, unlink shared memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for inst in self.instances.values():
            if inst.name not in self.dead and inst.address:
                self.node.try_push(inst.name, Shutdown("frontend closing"))
        self._finalizer()
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
    def _handle(self, sender: str, msg: Any) -> None:
        self._last_heard[sender] = time.monotonic()
        if isinstance(msg, Output):
            rid = msg.output["request_id"]
            if self._inflight.pop(rid, None) is not None:
                out = output_from_dict(msg.output)
                self._done.append(out)
                self.scheduler.finished(rid, self._left_cached(out))
        elif isinstance(msg, Handoff):
            f = self._inflight.get(msg.req_id)
            if f is not None and f.where == sender:
                if msg.to in self.dead:  # handed over before that instance died: lost there
                    reason = self.dead[msg.to]
                    self._recover(msg.req_id, f, f"InstanceDied: instance {msg.to} died ({reason})")
                else:
                    f.where = msg.to
                    self.scheduler.prefilled(msg.req_id)
        elif isinstance(msg, Ready):
            inst = self.instances.get(msg.name)
            if inst is None:
                raise ValueError(f"unknown instance {msg.name!r} reported ready")
            inst.address, inst.handle, inst.pid = msg.address, msg.handle, msg.pid
        elif not isinstance(msg, Heartbeat):
            raise ValueError(f"the frontend does not handle {type(msg).__name__}")

    # ---- liveness --------------------------------------------------------------------------
    def _live(self, role: str) -> list[str]:
        return [
            i.name for i in self.instances.values() if i.role == role and i.name not in self.dead
        ]

    def monitor(self) -> dict[str, str]:
        """Check every instance (exit code, heartbeat); handle deaths. Returns :attr:`dead`."""
        if self._closed:
            return self.dead
        now = time.monotonic()
        for inst in list(self.instances.values()):
            if inst.name in self.dead:
                continue
            if not inst.process.is_alive():
                self._on_death(inst, f"process exited with code {inst.process.exitcode}")
            elif now - self._last_heard.get(inst.name, now) > self.heartbeat_timeout_s:
                inst.process.kill()
                inst.process.join(2.0)
                self._on_death(inst, f"no heartbeat for {self.heartbeat_timeout_s:g} s; killed")
        return self.dead

    def _on_death(self, inst: InstanceInfo, reason: str) -> None:
        self.dead[inst.name] = reason
        self.node.dead[inst.name] = reason
        self.scheduler.drop(inst.name)
        logger.error("instance %s (%s) died: %s", inst.name, inst.role, reason)
        _unlink_segment(inst.handle)
        for other in self.instances.values():
            if other.name in self.dead or not other.address:
                continue
            try:
                rep = self.node.call(other.name, PeerDown(inst.name, reason))
            except TransferError as e:
                logger.warning("could not tell %s that %s died: %s", other.name, inst.name, e)
                continue
            # hand-offs to the dead instance whose notice has not reached us yet
            for rid in rep.data.get("handed", ()):
                f = self._inflight.get(rid)
                if f is not None and f.where == other.name:
                    f.where = inst.name
        for rid, f in list(self._inflight.items()):
            if f.where == inst.name:
                self._recover(rid, f, f"InstanceDied: instance {inst.name} died ({reason})")

    def _recover(self, rid: str, f: _Inflight, error: str) -> None:
        """Re-run a request whose instance died, or end it with ``error``."""
        if self.rerun_on_failure and f.reruns < MAX_RERUNS:
            with contextlib.suppress(TransferError, MiniMemServeError):
                route = self._route(f.prompt)
                f.reruns += 1
                self._submit(route, rid, f)
                self.num_reruns += 1
                logger.warning("request %s re-run on %s after: %s", rid, route.instance, error)
                return
        self._inflight.pop(rid, None)
        self.scheduler.finished(rid)
        m = RequestMetrics(arrival_time=f.arrival_time, prompt_tokens=len(f.prompt))
        m.finish_time = time.perf_counter()
        self._done.append(RequestOutput(rid, list(f.prompt), [], None, "error", m, error=error))

    # ---- routing ---------------------------------------------------------------------------
    def _route(self, prompt: Sequence[int]) -> Route:
        d = self.deployment
        if not d.colocated and not self._live("decode"):
            raise InstanceDied(f"no live prefill/decode pair is left: {self.dead}")
        try:
            route = self.scheduler.route(prompt)
        except InstanceDied:
            raise InstanceDied(
                f"every instance that takes new requests died: {self.dead}"
            ) from None
        if route.transfer_from is not None:
            route = self._push_prefix(prompt, route)
        return route

    def _push_prefix(self, prompt: Sequence[int], route: Route) -> Route:
        """Have ``route.transfer_from`` send its cached prefix of ``prompt`` to the target
        first; on any failure the request simply goes without it."""
        src, dst = route.transfer_from, route.instance
        try:
            moved = self.node.call(src, PushPrefix(list(prompt), dst)).data["tokens"]
        except (TransferError, MiniMemServeError) as e:
            logger.warning("prefix transfer %s -> %s failed: %s", src, dst, e)
            moved = 0
        self.prefix_tokens_moved += moved
        if moved:
            self.scheduler.record(dst, prompt[:moved])
        return Route(dst, self.scheduler.cached_tokens(dst, prompt), route.cost)

    def _left_cached(self, out: RequestOutput) -> list[int] | None:
        """What a finished request left in the cache of the instance it was routed to."""
        level = self.deployment.cache_level
        if out.finish_reason == "error" or not level:
            return None
        if self.deployment.colocated or level >= 3:  # the answer's KV is cached there too
            return list(out.prompt_token_ids) + list(out.token_ids[:-1])
        return list(out.prompt_token_ids)

    def _submit(self, route: Route, rid: str, f: _Inflight) -> None:
        req = {
            "request_id": rid,
            "prompt_token_ids": list(f.prompt),
            "params": params_to_dict(f.params),
            "arrival_time": f.arrival_time,
        }
        self._inflight[rid] = f
        f.where = route.instance
        # before the call: its output may be handled while the call waits for the reply
        self.scheduler.dispatched(rid, route, len(f.prompt), f.params.max_tokens)
        try:
            self.node.call(route.instance, Submit(req))
        except BaseException:
            self._inflight.pop(rid, None)
            self.scheduler.finished(rid)
            raise

    # ---- engine API ------------------------------------------------------------------------
    def _ids_of(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("empty prompt")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _raise_remote(self, e: RemoteError) -> None:
        cls = _REQUEST_ERRORS.get(e.kind)
        if cls is not None:
            raise cls(e.remote_message) from None
        raise e

    def validate(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        """Token ids of ``prompt``, or the instance's exception naming the problem."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self._ids_of(prompt)
        live = [n for n in self.instances if n not in self.dead]
        if not live:
            raise InstanceDied(f"every instance died: {self.dead}")
        try:
            info = self.node.call(
                live[0], Query("validate", {"prompt": ids, "params": params_to_dict(params)})
            )
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
        ids = self._ids_of(prompt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._inflight:
            raise InvalidRequest(f"request id {rid!r} is already in use")
        self.monitor()
        f = _Inflight(ids, params, arrival_time or time.perf_counter(), "")
        try:
            self._submit(self._route(ids), rid, f)
        except RemoteError as e:
            self._raise_remote(e)
        return rid

    def step(self) -> list[RequestOutput]:
        """Collect the requests that finished since the last call (waits a few ms for one)."""
        deadline = time.monotonic() + STEP_WAIT_S
        while not self._done and not self._closed:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.node.serve(left)
        if not self._closed:
            self.node.serve(0.0)
            self.monitor()
        out, self._done = self._done, []
        return out

    def location(self, request_id: str) -> str | None:
        """The instance a request is on now (as far as the frontend knows); None once done."""
        f = self._inflight.get(request_id)
        return None if f is None else f.where

    def has_unfinished(self) -> bool:
        """Whether any submitted request has not been returned by :meth:`step` yet."""
        return bool(self._inflight or self._done)

    def run_until_done(self, timeout_s: float | None = None) -> list[RequestOutput]:
        """Step until every request finished; raises TimeoutError after ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        outs: list[RequestOutput] = []
        while self.has_unfinished():
            outs.extend(self.step())
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"requests {sorted(self._inflight)} unfinished after {timeout_s}"
                )
        return outs

    # ---- pools -----------------------------------------------------------------------------
    def _ask_all(self, what: str) -> dict[str, dict]:
        out = {}
        for name in self.instances:
            if name in self.dead:
                continue
            out[name] = self.node.call(name, Query(what)).data
        return out

    def pool_stats(self) -> dict[str, dict]:
        """Per live instance: its pool stats, request count, blocks held for peers, dead peers."""
        return self._ask_all("stats")

    def check_pools(self, require_idle: bool = True) -> dict[str, dict]:
        """Every live instance audits its pool (``MemPool.check``); raises if one is off.

        With ``require_idle``, a block still referenced (held outside the cache index) is
        also an error: call it once every request finished. Returns the reports by name.
        """
        reports = self._ask_all("check")
        problems = []
        for name, rep in reports.items():
            if not rep["ok"]:
                problems.append(f"{name}: {rep['error']}")
            if require_idle:
                for tier, counts in rep["pool"].items():
                    if isinstance(counts, Mapping) and counts.get("referenced", 0):
                        problems.append(f"{name}: {counts['referenced']} {tier} blocks referenced")
        if problems:
            raise RuntimeError("pool balance: " + "; ".join(problems))
        return reports


# ---- benchmark seam ------------------------------------------------------------------------


def process_target(spec: Any, **cluster_kw: Any) -> Any:
    """A ``minimemserve.benchmark.BenchTarget`` running ``spec.config`` as a ProcessCluster."""
    from minimemserve.benchmark import BenchTarget

    o = spec.options
    cluster = ProcessCluster(
        spec.model_dir,
        spec.config,
        engine_config=o.engine_config(),
        device=o.device,
        dtype=o.dtype,
        **cluster_kw,
    )

    def check() -> bool:
        cluster.check_pools(require_idle=True)
        return True

    return BenchTarget(engine=cluster, check=check, stats=cluster.pool_stats, close=cluster.close)


def process_factories(configs: Sequence[str], **cluster_kw: Any) -> dict[str, Any]:
    """``{config: factory}`` for ``run_bench(factories=...)``: each config in its own processes."""
    for c in configs:
        parse_config_name(c)
    return {c: (lambda spec, kw=cluster_kw: process_target(spec, **kw)) for c in configs}
