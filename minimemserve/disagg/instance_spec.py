"""What an instance process runs with: one :class:`InstanceSpec`, its host's part given at
start-up, its session's part (the frontend's ``Join``) added when a frontend joins it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from ..config import EngineConfig, parse_config_name
from ..links import AUTO, KV_LINKS, candidates, kv_link
from ..model.loader import read_checkpoint
from . import rpc


@dataclass(frozen=True)
class InstanceSpec:
    """What one instance process runs with. Its host's part, given at start-up (``minimemserve
    instance``'s options, or what the launcher spawns it with): ``role``, the checkpoint at
    ``model_dir``, the address it listens on (``host``, ``port``), the cluster ``key``, the KV
    ``transport`` it asks for, ``device``, ``dtype``, torch threads, the ``engine_overrides``
    (EngineConfig sizes set on this host), ``once`` (serve one frontend, then exit), the
    ``parent_pid`` whose end ends it, the ``host_id`` peers see it on ("": host_identity();
    Ray: its node), ``managed`` (a manager such as Ray restarts it: end when a frontend closes,
    or on a crash), and the KV links it knows (``kv_links``: this process's table when it was
    made; a spawned instance gets its frontend's). The session's part, once a frontend joined
    it: that frontend's ``join``; everything of the session (its name, the frontend,
    timeouts, the engine) is read from it, never copied."""

    role: str
    model_dir: str
    host: str = rpc.LOOPBACK
    port: int = 0
    key: rpc.ClusterKey | None = field(default=None, repr=False)
    transport: str = AUTO
    device: str = "cpu"
    dtype: str = "float32"
    num_threads: int = 1
    engine_overrides: dict = field(default_factory=dict)
    once: bool = False
    parent_pid: int = 0
    host_id: str = ""
    managed: bool = False
    kv_links: dict[str, str] = field(default_factory=lambda: dict(KV_LINKS), repr=False)
    join: rpc.Join | None = None

    def joined(self, m: rpc.Join) -> InstanceSpec:
        """This instance in the session ``m`` joins it to."""
        return replace(self, join=m)

    @property
    def session_join(self) -> rpc.Join:
        """The ``Join`` of its session; a ValueError before it has one."""
        if self.join is None:
            raise ValueError(f"the {self.role} instance at {self.host}:{self.port} has no session")
        return self.join

    name = property(lambda self: self.session_join.name, doc="its name in the deployment")
    config = property(lambda self: self.session_join.config, doc="the deployment's name")
    frontend = property(lambda self: self.session_join.frontend, doc="the frontend's address")
    timeout_s = property(lambda self: self.session_join.timeout_s, doc="of a control call")
    heartbeat_s = property(lambda self: self.session_join.heartbeat_s, doc="its beat period")
    linked = property(lambda self: self.session_join.linked, doc="peers move KV into it")
    session = property(lambda self: self.session_join.session, doc="names its pair groups")

    @property
    def engine_config(self) -> EngineConfig:
        """Its session's engine: the frontend's, with the sizes set on this host."""
        return replace(self.session_join.engine, **self.engine_overrides)

    frontend_timeout_s = property(
        lambda self: self.session_join.frontend_timeout_s,
        doc="the frontend's silence that ends the session",
    )

    @property
    def secret(self) -> bytes:
        """The cluster's control-plane secret."""
        return self.key.secret

    @property
    def curve(self) -> tuple[bytes, bytes] | None:
        """The CURVE key pair its sockets use (none on loopback)."""
        return self.key.curve_for(self.host)

    @property
    def shared_pool(self) -> bool:
        """Whether its hbm pool lives in shared memory, for peers on its host to write into."""
        links = candidates(self.transport, self.kv_links)
        return self.linked and any(link.shares_pool for link in links)


def spawned_options(spec: InstanceSpec, address: str) -> InstanceSpec:
    """A spawned instance as a standalone one listening where it did (``address``), with no
    session, so the frontend that declared it dead by mistake can join it again."""
    return replace(spec, port=int(address.rsplit(":", 1)[1]), join=None)


_NAME = re.compile(r"[A-Za-z0-9_-]{1,32}")


def model_summary(model_dir: str) -> dict[str, int]:
    """The shape of the checkpoint, for the frontend to check it serves the same model."""
    mc, _ = read_checkpoint(model_dir)  # the engine this process builds reads it again: free
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    return {k: int(getattr(mc, k)) for k in keys}


def check_join(m: rpc.Join, opts: InstanceSpec) -> InstanceSpec:
    """The spec of the session a Join asks for; raises naming what is wrong with it."""
    milestone = parse_config_name(m.config).milestone
    if opts.role not in milestone.roles:
        raise ValueError(f"{m.config} has no {opts.role} instances (roles {milestone.roles})")
    if not _NAME.fullmatch(m.name) or m.name == rpc.FRONTEND:
        raise ValueError(f"bad instance name {m.name!r}")
    if not m.frontend.startswith("tcp://") or not _NAME.fullmatch(m.session):
        raise ValueError(f"bad frontend address {m.frontend!r} or session {m.session!r}")
    joined = opts.joined(m)
    try:
        config = joined.engine_config
    except ValueError as e:
        raise ValueError(f"bad engine config: {e}") from None
    whole = [name for name in opts.kv_links if kv_link(name, opts.kv_links).whole_model]
    if config.tp_size(opts.role) != 1 and opts.transport not in whole:
        raise ValueError(  # its ranks' KV reaches peers whole only through a landing tensor
            f"a standalone instance runs tensor-parallel ranks only over the {'/'.join(whole)} "
            f"transport (--transport {whole[0]})"
        )
    return joined
