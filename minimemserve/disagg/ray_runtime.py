"""Instances as Ray actors (``runtime="ray"``): Ray places, starts, finds and watches them;
the hot path stays the project's own.

Each instance of a deployment is one actor (:class:`InstanceActor`) that holds a standalone
instance (``instance.serve_sessions``, what ``minimemserve instance`` runs) on a thread, bound
to its node's address. The frontend (:class:`RayCluster`) asks every actor where it listens
(discovery) and joins the instances exactly as it joins ones started by hand
(a spec with ``instances``): ``Hello``, ``Join``, ``Ready`` with the pool handle and the
NIXL agent's metadata, then the links. Nothing of a request crosses Ray: steps and token deltas
go over the authenticated RPC, KV through shared memory within a node, NIXL (where both
instances have an agent) or gloo between nodes. A Ray node counts as a host.

Placement: an instance's ranks are gang-scheduled in a placement group of one bundle per rank,
packed on one node (``STRICT_PACK``); the actor takes bundle 0 and its rank processes run beside
it in the reservation of the others. :func:`plan_nodes` chooses a node for every instance before
anything is reserved: ``placement="pack"`` fills as few nodes as it can, ``"spread"`` puts each
next instance on the node holding fewest; ``pin`` keeps a role on nodes with a custom resource
or a label (``key=value``). What cannot be placed fails at start with an error naming what is
missing; a reservation Ray does not grant within ``placement_timeout_s`` fails too.

Failure detection: each actor has one call outstanding (``wait``) that returns only when its
instance ends; Ray fails it when the actor dies (``RayActorError``). The frontend then declares
the instance dead as it does a process that exited (``Membership``): its in-flight requests
are re-run or fail with a clear error, its peers release what they held for it. With
``max_restarts`` Ray restarts the actor in its placement group; the instance binds anew and
the frontend asks it to join again.

Trust: anyone who reaches a Ray cluster runs code on it, so the runtime insists on Ray's token
authentication in this process, and the RPC still requires the deployment's key (made here,
handed to the actors in their creation arguments). See ``docs/ray.md``."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import secrets
import socket
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..deployment import DeploymentSpec
from ..errors import ConfigError
from ..links import AUTO, KV_LINKS, kv_link
from . import rpc
from .instance_spec import InstanceSpec
from .launch import parse_address, unlink_segment
from .membership import Membership
from .placement import NodeView, Wanted, plan_nodes
from .runtime import ProcessCluster
from .sessions import serve_sessions

logger = logging.getLogger(__name__)

# What to install when Ray is missing.
RAY_EXTRA = "pip install -e '.[ray]' in the checkout"


def import_ray() -> Any:
    """The ``ray`` module, or a ConfigError saying what to install."""
    try:
        return importlib.import_module("ray")
    except ImportError as e:
        raise ConfigError(f"the ray runtime needs Ray ({e}): {RAY_EXTRA}") from None


def _free_port(host: str) -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class InstanceActor:
    """A Ray actor holding one standalone instance on a thread, from before the frontend's
    ``Join`` until the frontend closes it. Its calls: :meth:`where` (discovery) and
    :meth:`wait` (returns when the instance ended). A crash ends the actor's process, so Ray
    reports it dead (and restarts it, if allowed)."""

    def __init__(self, options: dict, secret: bytes, curve: tuple[bytes, bytes]) -> None:
        ray = import_ray()
        self.node_id = ray.get_runtime_context().get_node_id()
        host = ray.util.get_node_ip_address()
        key = rpc.ClusterKey(secret, curve)
        port = _free_port(host)
        self.opts = InstanceSpec(
            key=key, host=host, port=port, host_id=f"ray:{self.node_id}", managed=True, **options
        )
        self.ended = threading.Event()
        self.why = ""
        torch.set_num_threads(self.opts.num_threads)
        threading.Thread(target=self._serve, name="minimemserve-instance", daemon=True).start()

    def where(self) -> dict:
        """Where the instance listens, on which node, in which process."""
        address = f"{self.opts.host}:{self.opts.port}"
        return {"address": address, "node": self.node_id, "pid": os.getpid()}

    def wait(self) -> str:
        """Block until the instance ended; why it did."""
        self.ended.wait()
        return self.why

    def _serve(self) -> None:
        try:
            serve_sessions(self.opts)
            self.why = "its frontend closed it"
        except BaseException as e:  # the instance crashed: so does the actor
            logger.exception("instance (%s) crashed: %s", self.opts.role, e)
            os._exit(1)
        finally:
            self.ended.set()


@dataclass
class Placed:
    """One instance's actor, its placement group, and what the frontend waits on."""

    actor: Any
    group: Any
    node: str
    watch: Any = None  # the outstanding wait(): Ray fails it when the actor dies
    back: Any = None  # after a death: the outstanding where() of the restarted actor


class RayActors:
    """The actors of one deployment: placed (:meth:`place`), watched (:meth:`watch`) and
    stopped (:meth:`close`)."""

    def __init__(self, ray: Any, opts: DeploymentSpec) -> None:
        self.ray = ray
        self.opts = opts
        self.placed: dict[str, Placed] = {}
        self.tag = f"{os.getpid()}-{secrets.token_hex(4)}"  # names its groups and actors

    def place(self, wanted: Sequence[Wanted], options: Sequence[dict], key: rpc.ClusterKey):
        """Reserve a placement group per instance on the node the plan chose, start the actors
        there; returns their addresses, in order."""
        ray = self.ray
        nodes = [
            NodeView(n["NodeID"], n["Resources"], n.get("Labels") or {})
            for n in ray.nodes()
            if n["Alive"]
        ]
        plan = plan_nodes(wanted, nodes, self.opts.placement, self.opts.pin)
        pg_api = importlib.import_module("ray.util.placement_group")
        strategies = importlib.import_module("ray.util.scheduling_strategies")
        remote = ray.remote(InstanceActor)
        for w, kw in zip(wanted, options):
            bundle = dict(w.bundle)
            if (pin := self.opts.pin.get(w.role)) is not None and "=" not in pin:
                bundle[pin] = 0.001  # a pinned resource: any node that has it
            selector = [_label(pin)] * w.ranks if pin and "=" in pin else None
            group = pg_api.placement_group(
                [bundle] * w.ranks,
                strategy="STRICT_PACK",
                name=f"minimemserve-{w.name}-{self.tag}",
                _soft_target_node_id=plan[w.name],
                bundle_label_selector=selector,
            )
            self.placed[w.name] = Placed(None, group, plan[w.name])
            if not group.wait(timeout_seconds=self.opts.placement_timeout_s):
                raise ConfigError(
                    f"Ray did not reserve {w.ranks} x {bundle} for {w.role} instance {w.name} "
                    f"within {self.opts.placement_timeout_s:g} s (taken by other work?)"
                )
            strategy = strategies.PlacementGroupSchedulingStrategy(group, 0)
            actor = remote.options(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                max_restarts=self.opts.max_restarts,
                max_concurrency=4,  # wait() blocks one thread; where() needs another
                scheduling_strategy=strategy,
                name=f"minimemserve-{w.name}-{self.tag}",
            ).remote(kw, key.secret, key.curve)
            self.placed[w.name].actor = actor
        wheres = self._discover()
        for p, where in zip(self.placed.values(), wheres):
            p.node = where["node"]
            p.watch = p.actor.wait.remote()
        return [w["address"] for w in wheres]

    def _discover(self) -> list[dict]:
        """Every actor's :meth:`InstanceActor.where`, or an error naming the one that did not
        start (its constructor failed, or it was not running within the placement timeout)."""
        ray, timeout_s = self.ray, self.opts.placement_timeout_s
        refs = {name: p.actor.where.remote() for name, p in self.placed.items()}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        out = []
        for name, ref in refs.items():
            try:
                out.append(ray.get(ref, timeout=0))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                raise ConfigError(
                    f"the Ray actor of instance {name} did not start within {timeout_s:g} s: "
                    f"{type(e).__name__}: {_first_line(e)}"
                ) from None
        return out

    def nodes_of_ranks(self, name: str) -> list[str]:
        """The node of each bundle of instance ``name``'s placement group."""
        table = importlib.import_module("ray.util").placement_group_table
        return list(table(self.placed[name].group)["bundles_to_node_id"].values())

    def watch(self, membership: Membership) -> None:
        """Hand deaths Ray reports to ``membership``; restarted actors back to it."""
        ray = self.ray
        for name, p in self.placed.items():
            if p.watch is not None and ray.wait([p.watch], timeout=0)[0]:
                reason = self._why(p.watch)
                p.watch = None
                unlink_segment(membership.instances[name].info.handle)  # if on this host
                membership.declare_dead(name, reason)
                if self.opts.max_restarts:
                    p.back = p.actor.where.remote()  # answered once Ray restarted it
                else:
                    membership.give_up(name, "its Ray actor has no restarts (max_restarts 0)")
            elif p.back is not None and ray.wait([p.back], timeout=0)[0]:
                try:
                    where = ray.get(p.back)
                except ray.exceptions.ActorUnavailableError:  # still restarting: ask again
                    p.back = p.actor.where.remote()
                    continue
                except ray.exceptions.RayActorError as e:
                    membership.give_up(name, f"Ray will not restart it: {_first_line(e)}")
                    p.back = None
                    continue
                p.back, p.node = None, where["node"]
                p.watch = p.actor.wait.remote()
                membership.returned(name, rpc.endpoint(*parse_address(where["address"])))
                logger.warning("instance %s restarted by Ray on node %s", name, p.node[:8])

    def _why(self, ref: Any) -> str:
        try:
            return f"its Ray actor ended: {self.ray.get(ref)}"
        except self.ray.exceptions.RayActorError as e:
            return f"its Ray actor died ({type(e).__name__}: {_first_line(e)})"

    def close(self) -> None:
        """Stop every actor (no restart) and release every placement group. Idempotent."""
        pg_api = importlib.import_module("ray.util.placement_group")
        for p in self.placed.values():
            with contextlib.suppress(Exception):  # already gone
                if p.actor is not None:
                    self.ray.kill(p.actor, no_restart=True)
            with contextlib.suppress(Exception):
                pg_api.remove_placement_group(p.group)
        self.placed.clear()


def _label(pin: str) -> dict[str, str]:
    key, _, value = pin.partition("=")
    return {key: value}


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def connect(ray: Any, address: str | None) -> bool:
    """Attach to the Ray cluster at ``address`` (None: ``RAY_ADDRESS``, else start a local one);
    returns whether this call started Ray here. Refuses a process without token
    authentication."""
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    raylet = importlib.import_module("ray._raylet")
    if raylet.get_authentication_mode() != raylet.AuthenticationMode.TOKEN:
        if started:
            ray.shutdown()
        raise ConfigError(
            "Ray runs without token authentication here: anyone who reaches the cluster runs "
            "code on it. Start every node and this process with RAY_AUTH_MODE=token and the "
            "cluster's token (RAY_AUTH_TOKEN or ~/.ray/auth_token); see docs/ray.md"
        )
    return started


@contextlib.contextmanager
def ray_attached(address: str | None) -> Iterator[Any]:
    """Ray attached for the ``with`` block (see :func:`connect`; ``address`` "" or None:
    ``RAY_ADDRESS``, else a local cluster, stopped at the end): deployments built inside share
    it. Yields the ``ray`` module."""
    ray = import_ray()
    started = connect(ray, address or None)
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()


class RayCluster(ProcessCluster):
    """A ``ProcessCluster`` whose instances are Ray actors (see the module docstring): placed
    as the spec's Ray fields say (``ray_address``, ``placement``, ``pin``, ``max_restarts``,
    ``placement_timeout_s``; ``cores_per_instance`` CPUs per rank), watched by Ray, joined
    and served by the process runtime's frontend. ``cluster_host`` is where the frontend
    listens (loopback: this node's address, which every actor must reach). Other fields as
    ``ProcessCluster``'s, except ``instances`` and ``key``: the runtime starts the instances
    and makes their key."""

    def __init__(self, spec: DeploymentSpec) -> None:
        if spec.instances or spec.key is not None:
            raise ConfigError("the ray runtime starts its own instances and makes their key")
        wanted, actors = _wanted(spec)
        if str(spec.device).startswith("cuda") and any(w.ranks > 1 for w in wanted):
            raise ConfigError("tensor-parallel instances on CUDA do not run under Ray yet")
        whole = next(name for name in KV_LINKS if kv_link(name).whole_model)  # NIXL
        for kw_i, w in zip(actors, wanted):  # a TP instance's ranks reach peers over it
            kw_i["transport"] = whole if w.ranks > 1 and spec.transport == AUTO else spec.transport
        self.ray = import_ray()
        self._owns_ray = connect(self.ray, spec.ray_address or None)
        self.actors = RayActors(self.ray, spec)
        try:
            key_made = rpc.ClusterKey.generate()
            addresses = self.actors.place(wanted, actors, key_made)
            host = _frontend_host(self.ray, spec.cluster_host)
            super().__init__(
                replace(spec, cluster_host=host, instances=tuple(addresses), key=key_made)
            )
        except BaseException:
            self._stop_ray()
            raise

    def monitor(self, read: bool = True) -> dict[str, str]:
        """Deaths Ray reports and actors it restarted, then the process runtime's checks."""
        if self.membership is not None and self.actors.placed:
            self.actors.watch(self.membership)
        return super().monitor(read)

    def node_of(self, name: str) -> str:
        """The Ray node instance ``name``'s actor runs on."""
        return self.actors.placed[name].node

    def close(self) -> None:
        """Close the frontend, then stop the actors and release their placement groups."""
        super().close()
        for inst in self.instances.values():
            unlink_segment(inst.info.handle)  # an actor killed on this host leaves its segment
        self._stop_ray()

    def _stop_ray(self) -> None:
        self.actors.close()
        if self._owns_ray and self.ray.is_initialized():
            self.ray.shutdown()


def _frontend_host(ray: Any, host: str) -> str:
    """Where the frontend listens: ``host``, unless it is loopback (an actor may be on any
    node): then this node's address."""
    return ray.util.get_node_ip_address() if host in rpc.LOOPBACK_HOSTS else host


def _wanted(spec: DeploymentSpec):
    """The instances to place, and each actor's standalone options."""
    gpu = str(spec.device).startswith("cuda")
    bundle = {"CPU": float(spec.cores_per_instance)} | ({"GPU": 1.0} if gpu else {})
    wanted, options = [], []
    for name, role in spec.deployment.instances(colocated=spec.num_colocated):
        wanted.append(Wanted(name, role, spec.engine.tp_size(role), bundle))
        options.append(
            {
                "role": role,
                "model_dir": str(spec.model_dir),
                "device": str(spec.device),
                "dtype": str(spec.dtype),
                "num_threads": spec.cores_per_instance,
            }
        )
    return wanted, options
