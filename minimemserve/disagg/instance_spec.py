"""What an instance process is started with: :class:`StandaloneOptions` (its host's part: role,
checkpoint, where it listens, device), and the :class:`InstanceSpec` of one session, built in
one place (:func:`instance_spec`) from those and the frontend's ``Join``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import msgspec
import zmq

from ..config import EngineConfig, parse_config_name
from ..model.config import ModelConfig
from . import rpc
from .links import AUTO, KV_LINKS, candidates, kv_link

# Default heartbeat period; the frontend declares an instance dead after many missed beats.
DEFAULT_HEARTBEAT_S = 0.5


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


def model_summary(model_dir: str) -> dict[str, int]:
    """The shape of the checkpoint, for the frontend to check it serves the same model."""
    mc = ModelConfig.from_hf(model_dir)
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    return {k: int(getattr(mc, k)) for k in keys}


def check_join(m: rpc.Join, opts: StandaloneOptions) -> InstanceSpec:
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
