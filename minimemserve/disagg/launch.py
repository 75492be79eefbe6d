"""Start-up of a process deployment: spawn its instances here, or join instances started on
their own (``minimemserve instance``, any host) given their addresses, wait until each is
ready, and link them: tell every instance its peers and the KV transport of each pair (a KV
link of :mod:`~.links`' table: shared memory within a host, NIXL, or a torch.distributed pair
group formed through a store hosted here)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from ..config import NAME_PREFIX
from ..deployment import DeploymentSpec
from ..errors import ConfigError, InstanceDied, RemoteError, TransferError
from ..links import AUTO, KV_LINKS, ONE_HOST, kv_link, transport_names
from ..mempool.shared import segment_path
from ..model.config import ModelConfig
from ..parallel import HostStore
from . import rpc
from .instance_spec import InstanceSpec
from .sessions import instance_main

# Time a process gets to exit after Shutdown before it is terminated, then killed.
SHUTDOWN_GRACE_S = 5.0
# Modules the forkserver imports once, so instances forked from it start fast.
FORKSERVER_PRELOAD = ("minimemserve.disagg.sessions",)
# How long a frontend waits for a standalone instance's answer before asking again.
HELLO_RETRY_S = 2.0


@dataclass
class InstanceInfo:
    """One instance process as the frontend knows it: how peers reach it (``info``: its name
    and role from the start, the rest from its ``Ready``), and what only the frontend keeps."""

    info: rpc.PeerInfo
    process: Any  # None: started on its own, maybe on another host
    pid: int = 0
    ready: bool = False
    max_model_len: int = 0  # the longest context it holds (from Ready)
    hbm_blocks: int = 0  # the blocks of its hbm pool (from Ready)


def seen_over(info: rpc.PeerInfo, way: str) -> rpc.PeerInfo:
    """How a peer that reaches instance ``info`` over transport ``way`` sees it: that link's
    data (passed on unread), and its pool's handle if the link shares the pool; nothing else."""
    handle = info.handle if kv_link(way).shares_pool else None
    links = {way: info.links[way]} if way in info.links else {}
    return msgspec.structs.replace(info, transport=way, handle=handle, links=links)


def pair_transport(a: rpc.PeerInfo, b: rpc.PeerInfo, forced: str = AUTO) -> str:
    """How KV moves between ``a`` and ``b``: what the cluster (``forced``) or either asks for,
    else the first link of the table that fits the pair (shared memory when they share a
    host, else NIXL when both have an agent, else torch.distributed: "gloo" names it on CPU
    and CUDA alike)."""
    asked = {a.transport, b.transport, forced} - {AUTO}
    if len(asked) > 1:
        raise ConfigError(
            f"{a.name} asks for {a.transport} KV transport, {b.name} for {b.transport}"
        )
    links = [kv_link(name) for name in (asked or KV_LINKS)]
    why = [link.unfit(a, b) for link in links]
    if None not in why:
        raise ConfigError(why[0])
    return links[why.index(None)].name


def cluster_key(
    instances: Sequence[str], key: rpc.ClusterKey | str | Path | None
) -> rpc.ClusterKey | None:
    """The cluster key a frontend was given (a file is read); joined ``instances`` need one."""
    if instances and key is None:
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


def unlink_segment(handle: dict | None) -> None:
    """Remove a spawned instance's shared pool segment, if it is still there."""
    with contextlib.suppress(TransferError, OSError):  # OSError: already gone
        if handle is not None and (path := segment_path(handle)) is not None:
            os.unlink(path)


def reap(instances: Iterable[InstanceInfo], beacon: rpc.Beacon) -> None:
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
        unlink_segment(inst.info.handle)


class Launcher:
    """The deployment's instances (:attr:`instances`) from spawn or join to linked, over the
    frontend's ``node``; ``beacon`` heartbeats each once it is ready."""

    @classmethod
    def open(cls, spec: DeploymentSpec, key: rpc.ClusterKey | None, port: int, handler):
        """The launcher of a new frontend node that listens on ``port`` of ``spec.cluster_host``
        and hands messages to ``handler``; returns it with the deployment's secret and key pair.
        The secret reaches spawned instances through the spawn pipe; off loopback every
        socket is CURVE-encrypted with a key pair made here (or the cluster key's). A beacon
        heartbeats every instance from a thread, so they hear the frontend while it is idle."""
        secret = key.secret if key is not None else secrets.token_bytes(32)
        curve = (key or rpc.ClusterKey.generate()).curve_for(spec.cluster_host)
        codec = rpc.Codec(secret)
        node = rpc.RpcNode(
            rpc.FRONTEND,
            handler,
            host=spec.cluster_host,
            port=port,
            timeout_s=spec.timeout_s,
            codec=codec,
            curve=curve,
        )
        beacon = rpc.Beacon(rpc.FRONTEND, codec, spec.heartbeat_s, curve)
        return cls(spec, node, beacon), secret, curve

    def __init__(self, spec: DeploymentSpec, node: rpc.RpcNode, beacon: rpc.Beacon) -> None:
        self.spec = spec
        self.node = node
        self.beacon = beacon
        self.instances: dict[str, InstanceInfo] = {}
        self.store: HostStore | None = None  # where torch.distributed pairs meet, if any
        self.session = secrets.token_hex(8)  # names this deployment's pair groups
        self._spawns: dict[str, tuple[Any, InstanceSpec]] = {}  # name -> (context, spec)

    def spawn(self, secret: bytes, curve) -> None:
        """Start one process per instance of the deployment on this host."""
        transport = self.spec.transport
        key = rpc.ClusterKey(secret, curve or rpc.ClusterKey.generate().curve)  # loopback: unused
        ctx = mp.get_context(self.spec.start_method)
        if self.spec.start_method == "forkserver":
            ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        roles = self.spec.deployment.instances(colocated=self.spec.num_colocated)
        engine_config = self.spec.engine.placed(len(roles))  # all on ``spec.device``
        for i, (name, role) in enumerate(roles):
            spec = InstanceSpec(
                role=role,
                model_dir=str(self.spec.model_dir),
                host=self.spec.cluster_host,
                port=self.spec.base_port + 1 + i if self.spec.base_port else 0,
                key=key,
                transport=ONE_HOST if transport == AUTO else transport,
                device=self.spec.device,
                dtype=self.spec.dtype,
                num_threads=self.spec.cores_per_instance,
                parent_pid=os.getpid(),
            ).joined(msgspec.structs.replace(self.join_message(name), engine=engine_config))
            self._spawns[name] = (ctx, spec)
            info = rpc.PeerInfo(name, role, "", None)  # the rest comes with its Ready
            self.instances[name] = InstanceInfo(info, self._start(name))

    def _start(self, name: str):
        """Start the process of spawned instance ``name`` (it reports ``Ready`` when loaded)."""
        ctx, spec = self._spawns[name]
        proc = ctx.Process(target=instance_main, args=(spec,), name=f"mms-{name}")
        proc.daemon = True
        proc.start()
        return proc

    def respawn(self, name: str) -> None:
        """Start spawned instance ``name`` again, its last process having exited: a new process
        of the same spec, on a new shared segment, not ready until it reports ``Ready``."""
        inst = self.instances[name]
        inst.process.join(0)  # reap the one that exited
        inst.process = self._start(name)
        inst.ready = False
        inst.info.handle = None

    def join(self, addresses: Sequence[str], model_config: ModelConfig, timeout_s: float) -> None:
        """Ask each standalone instance what it is, name it by role, and send it the deployment."""
        found: list[tuple[str, str, dict]] = []  # (address, role, hello)
        for i, address in enumerate(addresses):
            host, port = parse_address(address)
            address = rpc.endpoint(host, port)
            found.append((address, *self.hello(f"?{i}", address, timeout_s)))
        roles = self.spec.deployment.milestone.roles
        for address, role, hello in found:
            model = hello.get("model")
            if role not in roles:
                raise ConfigError(f"{self.spec.deployment.name} has no {role!r} role ({address})")
            if (
                not isinstance(model, dict)
                or not model
                or any(getattr(model_config, str(k), None) != v for k, v in model.items())
            ):
                raise ConfigError(f"the instance at {address} serves another model: {model}")
        if missing := [str(r) for r in roles if r not in {role for _, role, _ in found}]:
            raise ConfigError(f"{self.spec.deployment.name} needs {missing} instances too")
        counts: dict[str, int] = {}
        for address, role, _ in found:
            name = f"{NAME_PREFIX[role]}{counts.setdefault(role, 0)}"
            counts[role] += 1
            self.instances[name] = InstanceInfo(rpc.PeerInfo(name, role, address, None), None)
            self.node.connect(name, address)
            join = self.join_message(name)
            try:
                self.node.call(name, join, timeout_s=timeout_s)
            except RemoteError as e:
                raise ConfigError(f"the instance at {address} refused to join: {e}") from None

    def join_message(self, name: str) -> rpc.Join:
        """What a standalone instance named ``name`` is sent to join this deployment."""
        return rpc.Join(
            self.session,
            name,
            self.spec.deployment.name,
            self.node.address,
            self.spec.engine,
            self.spec.timeout_s,
            self.spec.heartbeat_s,
            self.spec.heartbeat_timeout_s,
            self.spec.linked,
        )

    def hello(self, name: str, address: str, timeout_s: float) -> tuple[str, dict]:
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

    def link(self, timeout_s: float) -> None:
        """Tell every instance its peers and the transport of each pair; pairs that use
        torch.distributed form their groups through a store hosted here."""
        insts = [i.info for i in self.instances.values()]
        for a in insts:
            self.node.push(a.name, rpc.Peers(self.seen_by(a, insts), self.store_address()))
        for a in insts:  # answered once its pair groups formed
            formed = self.node.call(a.name, rpc.Query("links"), timeout_s=timeout_s).data
            ways = {b.name: pair_transport(a, b, self.spec.transport) for b in insts if b is not a}
            if missing := set(ways) - set(formed):
                raise TransferError(f"{a.name} formed no KV link with {missing}")

    def seen_by(self, a: rpc.PeerInfo, insts: Sequence[rpc.PeerInfo]) -> list[rpc.PeerInfo]:
        """``a`` and the instances ``insts`` as ``a`` reaches them (transport, pool handle)."""
        out = [a]
        for b in (b for b in insts if b is not a):
            way = pair_transport(a, b, self.spec.transport)
            out.append(seen_over(b, way))
            if kv_link(way).meets_in_store and self.store is None:
                self.store = _host_store(self.spec.cluster_host, self.spec.timeout_s)
        return out

    def store_address(self) -> str:
        """``host:port`` of the store pair groups form through, or "" when none is hosted."""
        return f"{self.spec.cluster_host}:{self.store.port}" if self.store is not None else ""

    def wait_ready(self, timeout_s: float) -> None:
        """Serve until every instance reported ``Ready`` (a spawned one that exits fails it)."""
        deadline = time.monotonic() + timeout_s
        while any(not i.ready for i in self.instances.values()):
            self.node.serve(0.05)
            for inst in self.instances.values():
                if not inst.ready and inst.process is not None and not inst.process.is_alive():
                    raise RuntimeError(
                        f"instance {inst.info.name} ({inst.info.role}) exited during start-up "
                        f"with code {inst.process.exitcode}; see its stderr above"
                    )
            if time.monotonic() > deadline:
                late = [i.info.name for i in self.instances.values() if not i.ready]
                raise TimeoutError(f"instances {late} not ready within {timeout_s:g} s")

    def on_ready(self, sender: str, msg: rpc.Ready) -> None:
        """An instance reports where it listens and how to map its pool; it is heartbeaten."""
        inst, info = self.instances[sender], msg.info
        if inst.ready or (info.name, info.role) != (sender, inst.info.role):
            raise PermissionError(f"{sender} cannot report ready as {info.name} ({info.role})")
        if info.transport not in transport_names():
            raise ValueError(f"{sender} asks for unknown KV transport {info.transport!r}")
        if info.handle is not None:
            segment_path(info.handle)  # only the project's own segments are ever mapped
        if inst.process is None:  # joined: reached where the frontend found it
            info = msgspec.structs.replace(info, address=inst.info.address)
        inst.info = info
        inst.pid, inst.max_model_len, inst.hbm_blocks = msg.pid, msg.max_model_len, msg.hbm_blocks
        inst.ready = True
        self.beacon.add(info.name, info.address)
