"""KV links: how an instance moves KV into the pool of a peer instance. A link is one peer as
this instance reaches it (:class:`KVLink`); :data:`KV_LINKS` is the table of link classes by
transport name, the one place the transport names (``--transport`` choices, what a
``PeerInfo.transport`` may say), what a pair of instances may use and how a peer is reached
are read from. Adding a transport is one class (its own file) and its line in the table.

- ``shm`` (:class:`~.disagg.shm.ShmLink`): a peer on this host; its hbm pool tensor, mapped
  here from shared memory (CPU) or CUDA IPC (one GPU), written one-sided.
- ``nixl`` (:class:`~.disagg.nixl.NixlLink`): the peer's registered memory written by a NIXL
  agent (RDMA, or whatever UCX finds between the two hosts).
- ``gloo`` (:class:`~.disagg.transports.GlooLink`): a two-rank ``torch.distributed`` group the
  pair forms through the frontend's store (gloo on CPU tensors, NCCL on CUDA ones); ``nccl``
  asks for the same link on CUDA.

Under ``auto`` a pair takes the first link of the table that fits it: shared memory on one
host, else NIXL where both instances have an agent, else gloo.

The table names each class by its import path (``module:Class``), loaded when first used:
the names are known where only the engine is imported (no ZeroMQ, no msgspec), and a link
registered in a frontend's table reaches the instance processes it spawns (their spec carries
the table; each imports the module). A link class has, beside the methods of :class:`KVLink`:
``name`` (the transport the frontend announces for a pair), ``shares_pool`` (an instance
reached this way keeps its hbm pool in shared memory), ``whole_model`` (it carries a
tensor-parallel instance's KV whole), ``devices`` (the device types it moves),
``meets_in_store`` (pairs form it through the frontend's store, in order) and three class
methods: ``unfit(a, b)`` (why instances ``a`` and ``b``, as their ``PeerInfo`` says, cannot
use it, or None), ``endpoint(spec, pool)`` (this instance's side of the link, or None: an
object whose ``offer()`` is the link's data, bytes its peers are told in
``PeerInfo.links[name]`` and only the link reads, and ``close()``) and ``reach(peers, p)``
(connect to peer ``p``, with ``peers.endpoints[name]`` and ``p.links[name]``:
``peers.add(p, link)``, or ``peers.on_down(name, why)``). A peer reaching an instance over a
link that ``shares_pool`` is also told its pool's handle."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

AUTO = "auto"  # not a link: each pair takes the first of the table that fits it
ONE_HOST = "shm"  # what ``auto`` is when every instance runs on one host

# transport name -> its link class (``module:Class``), in the order ``auto`` tries them
KV_LINKS: dict[str, str] = {
    "shm": "minimemserve.disagg.shm:ShmLink",
    "nixl": "minimemserve.disagg.nixl:NixlLink",
    "gloo": "minimemserve.disagg.transports:GlooLink",
    "nccl": "minimemserve.disagg.transports:NcclLink",
}


class KVLink(Protocol):
    """One peer as this instance reaches it: ``write`` moves blocks into the peer's pool,
    ``receive`` takes what the peer posted for a ``KVData`` message, ``await_landing`` waits
    before a commit until what the peer wrote for a transfer is here, ``forget`` drops an
    aborted transfer, ``close`` ends the link (its counters stay) and ``stats`` counts bytes
    and messages each way."""

    peer: str

    def write(self, node: Any, xfer: str, blocks: list[int], src, src_ids) -> None:
        """Blocks ``src_ids`` of ``src`` (this process's pool tensor) into the peer's
        ``blocks`` for transfer ``xfer`` (``node``: the control plane); returns once they are
        there, or raises TransferError."""

    def receive(self, pool: Any, m: Any) -> None:
        """Receive what the peer posted for ``KVData`` ``m`` into ``m.blocks`` of ``pool``."""

    def await_landing(self, xfer: str, new: list[int]) -> None:
        """Before a commit: the peer's writes of transfer ``xfer`` into ``new`` are all here."""

    def forget(self, xfer: str) -> None:
        """Transfer ``xfer`` from the peer was aborted."""

    def close(self) -> None:
        """Nothing more moves over this link."""

    def stats(self) -> dict[str, int | str]:
        """Bytes and messages each way, and the transport."""


@dataclass
class Counts:
    """Bytes and messages each way over one link."""

    sent_bytes: int = 0
    recv_bytes: int = 0
    sent_messages: int = 0
    recv_messages: int = 0

    def stats(self, transport: str) -> dict[str, int | str]:
        """The counts and the transport they went over."""
        return {"transport": transport, **self.__dict__}


def transport_names(links: Mapping[str, str] = KV_LINKS) -> tuple[str, ...]:
    """What a deployment or an instance may ask for: ``auto`` or a link of the table."""
    return (AUTO, *links)


def kv_link(name: str, links: Mapping[str, str] = KV_LINKS) -> Any:
    """The link class of transport ``name`` (its module imported on first use); a name not in
    the table is a ValueError naming the ones that are."""
    if (path := links.get(name)) is None:
        raise ValueError(f"unknown KV transport {name!r}; choose from {tuple(links)}")
    module, _, cls = path.partition(":")
    return getattr(importlib.import_module(module), cls)


def candidates(transport: str, links: Mapping[str, str] = KV_LINKS) -> list[Any]:
    """The link classes an instance that asks for ``transport`` may be reached over."""
    names = list(links) if transport == AUTO else [transport]
    return [kv_link(name, links) for name in names]


def link_endpoints(spec: Any, pool: Any) -> dict[str, Any]:
    """The instance's side of every link it may be reached over (``spec``: its
    ``InstanceSpec``), by transport name: those whose ``endpoint`` has one."""
    ends = {}
    for link in candidates(spec.transport, spec.kv_links):
        if link.name not in ends and (end := link.endpoint(spec, pool)) is not None:
            ends[link.name] = end
    return ends
