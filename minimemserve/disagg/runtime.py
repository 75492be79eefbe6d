"""The multi-process runtime: one process per instance, and a frontend that drives them.

:class:`ProcessCluster` is the multi-process twin of ``InProcessCluster``: it spawns one
process per instance (``sessions.instance_main``), waits until all are ready, tells each
where its peers are, routes requests, and implements ``Serving``. KV moves between processes
only through MemPool's transfer calls, whose receiving side is an ``peering.RemotePool``.

Routing: the ``Frontend`` (the request's life across instances, shared with the in-process
runtime and the simulator) picks the entry instance (colocated, or prefill) by its ``policy``;
its prompt trees mirror what each entry instance reports its index gained and evicted
(``CacheEvents``); under ``prompt_tree`` the instance holding most of a prompt may first send
the missing KV to the chosen one (``PushPrefix``).

Instances started on their own (``minimemserve instance``, any host) join a frontend given
their addresses (``instances=``) and the cluster key: it asks each its role (``Hello``), names
it, sends it the deployment (``Join``) and treats it like a spawned one. KV moves between two
instances through shared memory when they are on one host, else over a torch.distributed pair
group formed through a ``TCPStore`` the frontend hosts; ``transport`` forces one.

Requests are checked here, against the limits every instance reported when it got ready,
and submitted without waiting for the instance's answer (see :mod:`~.routing`): an instance
in the middle of a long step does not hold up the frontend.

Faults: the frontend watches exit codes and heartbeats (see :mod:`~.membership` for the
rule: a busy instance is alive, a silent one is not). When an instance dies it is named
(log, :attr:`ProcessCluster.dead`, the error of affected requests), its shared segment
unlinked, every other instance told (they release what they held for it), and its requests
re-run elsewhere when possible, else ended with ``finish_reason="error"``."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import signal
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..deployment import DeploymentSpec
from ..engine import Checked, check_once, tightest
from ..errors import (
    ConfigError,
    InstanceDied,
    InvalidRequest,
    TransferError,
)
from ..mempool import TIERS, PoolAccountingError
from ..model.loader import read_checkpoint
from ..request import Request, RequestOutput, TokenDelta
from ..sampling import SamplingParams
from ..scheduler.frontend import Frontend
from . import rpc
from .instance import CLOSING
from .launch import InstanceInfo, Launcher, cluster_key, reap
from .ledger import Inflight, Ledger
from .membership import Membership
from .routing import Router, push_prefix

logger = logging.getLogger(__name__)

# How long step() waits for a finished request before returning an empty list.
STEP_WAIT_S = 0.005
# How long survey() waits for the instances' answers before it returns what it has (an
# instance answers between its steps: one stuck in a step keeps its last report).
SURVEY_WAIT_S = 0.05


class ProcessCluster:
    """Instances of one deployment (``PD``, ``PD-CC``, ``1P1D``, ``1P1D-CC1/2/3``,
    ``xPyD[-CC...]``), each in its own process, behind one frontend, as ``spec`` says:
    spawned here, or joined (its ``instances``, the ``host:port`` of ``minimemserve instance``
    processes whose roles make the deployment; its ``key`` is then required and its
    ``cluster_host`` must be an address they reach). Use as a context manager, or call
    :meth:`close`; an abandoned cluster is reaped when garbage collected."""

    def __init__(self, spec: DeploymentSpec) -> None:
        """Start the deployment ``spec``."""
        self._setup(spec)
        try:
            self._start(spec)
        except BaseException:
            self.close()
            raise
        self._old_sigterm = _sigterm_as_interrupt()

    @classmethod
    def of(cls, model: str | Path | None, config: str, **fields: Any) -> ProcessCluster:
        """The cluster of ``DeploymentSpec(config, model, runtime="process", **fields)``: the
        spec's other fields by name (``engine``, ``timeout_s``, ``instances``...)."""
        return cls(DeploymentSpec(config, model, **{"runtime": "process"} | fields))

    def _setup(self, spec: DeploymentSpec) -> None:
        """The frontend's node and launcher, before any instance starts."""
        self.spec = spec
        self.deployment = spec.deployment
        key = cluster_key(spec.instances, spec.key)
        self.model_dir = spec.model_dir
        self.engine_config = spec.engine
        self._closed = False
        self._old_sigterm = None
        self.launcher, self._secret, self._curve = Launcher.open(
            spec, key, spec.base_port, self._handle
        )
        self.session = self.launcher.session
        self.node = self.launcher.node
        self.instances: dict[str, InstanceInfo] = self.launcher.instances
        self._finalizer = weakref.finalize(
            self, reap, self.instances.values(), self.launcher.beacon
        )
        self.dead: dict[str, str] = {}  # instance name -> why it died
        self.membership: Membership | None = None  # once every instance is ready
        self._reports: dict[str, dict] = {}  # instance -> its latest audit (see survey)
        self._asked: set[str] = set()  # instances whose audit has not come back yet
        self._handlers = {rpc.Ready: self.launcher.on_ready, rpc.Heartbeat: _ignore}

    def _start(self, spec: DeploymentSpec) -> None:
        """Spawn the instances, or join those at ``spec.instances``, wait until all are ready,
        link them; the scheduler, ledger and membership over them."""
        milestone = self.deployment.milestone
        model_config, self.tokenizer = read_checkpoint(self.model_dir)
        self._ids = itertools.count()
        spawned = not spec.instances
        if spawned and max(map(self.engine_config.tp_size, milestone.roles)) > 1:
            raise ConfigError(  # an instance process it spawns is daemonic: it cannot spawn ranks
                "tensor parallelism runs in-process deployments, or standalone instances "
                "(minimemserve instance --transport nixl) joined by a ProcessCluster"
            )
        if spawned:
            self.launcher.spawn(self._secret, self._curve)
        else:
            self.launcher.join(spec.instances, model_config, spec.startup_timeout_s)
        entry = milestone.roles[0]
        self.frontend = Frontend(
            [n for n, i in self.instances.items() if i.info.role == entry],
            functools.partial(push_prefix, self.node),
            policy=spec.policy,
            block_size=self.engine_config.block_size,
            cost_model=spec.cost_model,
            ttl_s=spec.ttl_s,
            caching=milestone.entry_caches,
            rerun_on_failure=spec.kv_load_failure_policy == "recompute",
        )
        self.scheduler = self.frontend.scheduler
        self.ledger = Ledger(
            self.node,
            self.frontend,
            self.instances,
            self.dead,
            model_config.vocab_size,
            lambda rid, f: self.router.submit(rid, f),
        )
        self.router = Router(
            self.node,
            self.frontend,
            self.ledger,
            self.instances,
            milestone.roles,
            lambda name, why: self.membership.end_session(name, why),
        )
        self._handlers |= {
            rpc.Output: self.ledger.on_output,
            rpc.Tokens: self.ledger.on_tokens,
            rpc.Handoff: self.ledger.on_handoff,
            rpc.CacheEvents: self.router.on_cache_events,
        }
        self.launcher.wait_ready(spec.startup_timeout_s)
        self.membership = Membership(self.launcher, self.scheduler, self.ledger, entry)
        self._handlers[rpc.Rejoin] = self.membership.on_rejoin
        # what instances report about requests and membership is handled between the
        # frontend's own calls, never inside one (a call waits for its reply and heartbeats)
        self.node.deferred = frozenset(self._handlers) - {rpc.Ready, rpc.Heartbeat}
        for inst in self.instances.values():
            self.node.connect(inst.info.name, inst.info.address)
        if spec.linked:
            self.launcher.link(spec.startup_timeout_s)

    # ---- start-up and shutdown -------------------------------------------------------------
    def close(self) -> None:
        """Shut every instance down, reap the processes, unlink shared memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for inst in self.instances.values():
            if inst.info.name not in self.dead and inst.ready:
                self.node.try_push(inst.info.name, rpc.Shutdown(CLOSING))
            elif inst.process is not None and inst.process.is_alive():
                inst.process.terminate()  # declared dead, maybe waiting to rejoin: no grace
        if any(i.process is None for i in self.instances.values()):
            time.sleep(0.05)  # let the Shutdown frames to other hosts leave before the sockets go
        self._finalizer()
        if self.launcher.store is not None:
            self.launcher.store.close()
            self.launcher.store = None
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
        if self.membership is not None:
            admitted = self.membership.admits(sender, msg)
        else:  # starting up: instances report ready
            admitted = sender in self.instances and sender not in self.dead
        if handler is None or not admitted:
            raise PermissionError(f"the frontend takes no {type(msg).__name__} from {sender!r}")
        handler(sender, msg)

    def take_deltas(self) -> list[TokenDelta]:
        """Tokens of unfinished requests received since the last call, in order per request."""
        return self.ledger.take_deltas()

    def load(self) -> dict[str, dict]:
        """Every live instance's role and requests waiting and running."""
        return {name: data["load"] for name, data in self._ask_all("stats").items()}

    # ---- liveness --------------------------------------------------------------------------
    def monitor(self, read: bool = True) -> dict[str, str]:
        """Read what the instances sent (with ``read``: heartbeats, reports, an instance asking
        to rejoin, also while no request runs), then check every instance (exit code,
        heartbeat) and handle deaths (see :meth:`Membership.monitor`). Returns :attr:`dead`,
        instance name -> why it died."""
        if not self._closed and self.membership is not None:
            if read:
                self.node.serve(0.0)
            self.membership.monitor()
        return self.dead

    def survey(self) -> dict[str, dict]:
        """Every live instance's latest audit, ``{"ok", "error", "pool", "load"}``, without
        waiting on any: each one with no question open is asked again, and what answers within
        ``SURVEY_WAIT_S`` is taken; an instance stuck in a step keeps its last report (the
        liveness check, not this, decides whether it is dead)."""
        live = [n for n, i in self.instances.items() if n not in self.dead and i.ready]
        for name in live:
            if name not in self._asked:
                answer = functools.partial(self._reported, name)
                with contextlib.suppress(TransferError):  # not taking messages: asked next time
                    self.node.send(name, rpc.Query("check"), answer)
                    self._asked.add(name)
        deadline = time.monotonic() + SURVEY_WAIT_S
        while self._asked & set(live) and (left := deadline - time.monotonic()) > 0:
            self.node.serve(left)
        return {name: self._reports[name] for name in live if name in self._reports}

    def _reported(self, name: str, reply: rpc.Msg) -> None:
        self._asked.discard(name)
        if isinstance(reply, rpc.Info):
            self._reports[name] = reply.data
        else:  # an error: it died, or its session ended; the next survey asks again
            self._reports.pop(name, None)

    def beyond_repair(self) -> str | None:
        """Why this deployment cannot serve and will not recover on its own (a role whose
        every instance stays dead, see :meth:`Membership.beyond_repair`); None if it may."""
        return None if self.membership is None else self.membership.beyond_repair()

    @property
    def num_reruns(self) -> int:
        """Requests re-run after the instance holding them died."""
        return self.frontend.num_reruns

    @property
    def num_rejoins(self) -> int:
        """Instances taken back after they were declared dead."""
        return self.membership.num_rejoins if self.membership is not None else 0

    @property
    def prefix_tokens_moved(self) -> int:
        """Tokens of KV moved by the scheduler's prefix transfers."""
        return self.frontend.prefix_tokens_moved

    # ---- engine API ------------------------------------------------------------------------
    def validate(self, prompt: str | Sequence[int] | Checked, params: SamplingParams) -> Checked:
        """``prompt`` checked (token ids in ``.ids``), or an exception naming the problem;
        checked here (no instance is asked) against the smallest context and pool of the live
        instances. The instance a request reaches checks the message it receives again: it
        comes over a socket."""
        if not (live := [i for i in self.instances.values() if i.info.name not in self.dead]):
            raise InstanceDied(f"every instance died: {self.dead}")
        limits = tightest(
            [
                (
                    self.ledger.vocab_size,
                    i.max_model_len,
                    self.engine_config.block_size,
                    i.hbm_blocks,
                )
                for i in live
            ]
        )
        return check_once(prompt, params, self.tokenizer, limits)

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
        session_id: str | None = None,
    ) -> str:
        """Route (``session_id``: its conversation, for the ``session`` policy) and queue a
        request; returns its id. Bad requests raise here."""
        if self._closed:
            raise RuntimeError("the cluster is closed")
        self.monitor(read=False)  # what came is read by the next step (or check)
        ids = self.validate(prompt, params).ids
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.ledger.inflight:
            raise InvalidRequest(f"request id {rid!r} is already in use")
        f = Inflight(Request(rid, ids, params, arrival_time or time.perf_counter()))
        self.router.submit(rid, f, session_id)
        return rid

    def step(self) -> list[RequestOutput]:
        """Collect the requests that finished since the last call (waits a few ms for one)."""
        deadline = time.monotonic() + STEP_WAIT_S
        while not (self.ledger.done or self._closed) and (left := deadline - time.monotonic()) > 0:
            self.node.serve(left)
        if not self._closed:
            self.node.serve(0.0)
            self.monitor()
        return self.ledger.take_done()

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and return its partial output; None if unknown or
        done (see :meth:`Ledger.abort`)."""
        return self.ledger.abort(request_id)

    def location(self, request_id: str) -> str | None:
        """The instance a request is on now (as far as the frontend knows); None once done."""
        f = self.ledger.inflight.get(request_id)
        return None if f is None else f.where

    def has_unfinished(self) -> bool:
        """Whether any submitted request has not been returned by :meth:`step` yet."""
        return bool(self.ledger.inflight or self.ledger.done)

    def run_until_done(self, timeout_s: float | None = None) -> list[RequestOutput]:
        """Step until every request finished and return their outputs; after ``timeout_s``
        the requests still running are aborted (their partial outputs come back with
        ``finish_reason="abort"``), so nothing keeps holding blocks."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        outs: list[RequestOutput] = []
        while self.has_unfinished():
            outs.extend(self.step())
            if deadline is not None and time.monotonic() > deadline:
                left = [self.abort(rid) for rid in list(self.ledger.inflight)]
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
        reports = self._ask_all("check")
        if problems := _pool_problems(reports, require_idle):
            raise PoolAccountingError("pool balance: " + "; ".join(problems))
        return reports


def _ignore(sender: str, msg: rpc.Msg) -> None:
    """A message that only shows the sender is alive (a heartbeat)."""


def _sigterm_as_interrupt():
    """Make SIGTERM end the program like Ctrl-C does, so ``with`` blocks shut down cleanly;
    returns the handler it replaced (None where it changed nothing: not the main thread, or
    the application handles SIGTERM)."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    return signal.signal(signal.SIGTERM, on_term)


def _pool_problems(reports: dict[str, dict], require_idle: bool) -> list[str]:
    """What the instances' pool audits found wrong (with ``require_idle``, blocks still
    referenced outside the cache index too)."""
    problems = []
    for name, rep in reports.items():
        if not rep["ok"]:
            problems.append(f"{name}: {rep['error']}")
        for tier, counts in rep["pool"].items():
            if require_idle and tier in TIERS and counts["referenced"]:
                problems.append(f"{name}: {counts['referenced']} {tier} blocks referenced")
    return problems
