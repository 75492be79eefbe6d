"""An instance's peers: how it reaches each one (:class:`PeerLinks`: a mapped shared pool,
a torch.distributed pair group or a NIXL agent, behind a :class:`RemotePool` proxy) and the
blocks it granted to their transfers into it (:class:`Grants`). A request handed to a peer
travels as its state (:class:`rpc.RequestState`)."""

from __future__ import annotations

import datetime
import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..blocks.copy import check_pool_tensor, move_blocks
from ..errors import InstanceDied, TransferError
from ..mempool import MemPool
from ..mempool.shared import attach, segment_path
from ..request import Request
from . import rpc
from .nixl import NixlEndpoint, NixlLink
from .transports import GlooTransport, TransferMode


@dataclass
class Link:
    """A two-rank torch.distributed group with peer ``peer``, and what moved over it."""

    transport: GlooTransport
    peer: str
    tags: itertools.count = field(default_factory=itertools.count)
    sent_bytes: int = 0
    recv_bytes: int = 0
    sent_messages: int = 0
    recv_messages: int = 0

    def stats(self) -> dict[str, int | str]:
        """Bytes and messages each way, and the backend."""
        return {
            "transport": self.transport.kind.value,
            "sent_bytes": self.sent_bytes,
            "recv_bytes": self.recv_bytes,
            "sent_messages": self.sent_messages,
            "recv_messages": self.recv_messages,
        }

    def send(self, node: rpc.RpcNode, xfer: str, blocks: list[int], src, src_ids) -> None:
        """Post blocks ``src_ids`` of ``src`` as one message, then have the peer receive it
        into ``blocks`` (``KVData``); returns once it has."""
        tag = next(self.tags) % (1 << 31)
        posted = self.transport.send_blocks(
            src, list(src_ids), mode=TransferMode.PACKED, tag=tag, wait=False
        )
        node.call(self.peer, rpc.KVData(xfer, blocks, tag))
        posted.wait()  # the peer has it: its reply came after its receive finished
        self.sent_bytes += len(blocks) * src[0].nbytes
        self.sent_messages += 1

    def receive(self, pool: MemPool, m: rpc.KVData) -> None:
        """Receive what the peer posted for ``m`` into ``m.blocks`` of ``pool``."""
        self.transport.recv_blocks(pool.kv(), m.blocks, TransferMode.PACKED, tag=m.tag)
        self.recv_bytes += len(m.blocks) * pool.kv()[0].nbytes
        self.recv_messages += 1

    def landed(self, xfer: str, new: list[int]) -> None:
        """Before a commit: nothing to wait for (each KVData was received as it came)."""

    def forget(self, xfer: str) -> None:
        """A transfer was aborted: nothing is kept per transfer here."""

    def close(self) -> None:
        """Nothing more moves over this link (its counters stay)."""
        self.transport.close()


PeerLink = Link | NixlLink  # a peer reached over torch.distributed or over NIXL


class RemotePool:
    """A peer instance as a transfer and a recipe see it from here: its MemPool (``recv_*`` and
    ``free_mem`` are requests to the peer, ``recv_copy`` a one-sided write into ``kv``, this
    process's mapping of its hbm pool tensor) and ``accept`` to hand it a request. Blocks it took
    for a failed transfer are released there (``recv_abort``, best effort)."""

    def __init__(
        self,
        node: rpc.RpcNode,
        info: rpc.PeerInfo,
        kv: torch.Tensor | None,
        pool: MemPool,
        link: PeerLink | None = None,
    ) -> None:
        """Proxy ``info``, whose hbm tensor is mapped here as ``kv`` (same host) or reached over
        ``link`` (any host); its layout is ``pool``'s."""
        self.node = node
        self.name = info.name
        self.role = info.role
        self.kv = kv
        self.link = link
        self.peer = self.instance_id = info.name
        self.layout = pool.layout
        self.dtype = pool.dtype
        self.block_size = pool.block_size
        self.model_layout = pool.model_layout  # the layout transfers agree on
        self.pool = self  # as a ``Peer``: the pool to transfer into is this proxy
        self._xfers = itertools.count()
        self._xfer = ""  # transfer ids; the one in progress

    def recv_alloc(self, tokens: Sequence[int] | None, num_blocks: int) -> tuple[list, list]:
        """Step 1 on the peer: match ``tokens`` (if given) and allocate the rest."""
        self._xfer = f"{self.node.name}>{self.peer}#{next(self._xfers)}"
        toks = None if tokens is None else list(tokens)
        try:
            rep = self.node.call(self.peer, rpc.AllocRequest(self._xfer, toks, num_blocks))
            if not isinstance(rep, rpc.AllocReply) or len(rep.matched) + len(rep.new) != num_blocks:
                raise TransferError(f"{self.peer} answered AllocRequest with {rep!r:.200}")
        except TransferError:
            # the peer may have allocated before its answer got lost or came wrong: let it go
            self.node.try_push(self.peer, rpc.Abort(self._xfer, []))
            raise
        return rep.matched, rep.new

    def recv_copy(self, blocks: Sequence[int], src: torch.Tensor, src_ids: Sequence[int]) -> None:
        """Step 2: blocks ``src_ids`` of this process's pool tensor ``src`` go straight into
        the peer's ``blocks`` (one-sided; one pass when ``blocks`` is one run)."""
        check_pool_tensor(self.model_layout, self.dtype, src, "recv_copy")
        if not blocks:
            return
        if self.peer in self.node.dead:
            raise InstanceDied(f"instance {self.peer} died before the write")
        if self.link is not None:
            self.link.send(self.node, self._xfer, list(blocks), src, list(src_ids))
            return
        move_blocks(self.kv, list(blocks), src, list(src_ids), self.layout.block_dim)
        if self.kv.is_cuda:
            torch.cuda.current_stream(self.kv.device).synchronize()  # land before Commit

    def recv_commit(self, tokens: Sequence[int] | None, blocks: Sequence[int]) -> None:
        """Step 3 on the peer: keep ``blocks`` (indexing ``tokens`` when given)."""
        toks = None if tokens is None else list(tokens)
        self.node.call(self.peer, rpc.Commit(self._xfer, toks, list(blocks)))

    def recv_abort(self, blocks: Sequence[int]) -> None:
        """On failure: the peer releases every block it took for this transfer (best effort)."""
        self.node.try_push(self.peer, rpc.Abort(self._xfer, list(blocks)))

    def free_mem(self, blocks: Sequence[int], tier: str = "hbm") -> None:
        """Drop one of this process's references on the peer's hbm ``blocks``."""
        self.node.call(self.peer, rpc.FreeMem(list(blocks)))

    def probe(self, tokens: Sequence[int], blocks: int = 0) -> rpc.ProbeReply:
        """The peer's cached prefix of ``tokens``, its load, and its room for ``blocks`` blocks."""
        rep = self.node.call(self.peer, rpc.Probe(list(tokens), blocks))
        if not isinstance(rep, rpc.ProbeReply):
            raise TransferError(f"{self.peer} answered Probe with {type(rep).__name__}")
        return rep

    def accept(self, req: Request) -> None:
        """Pass ``req`` (its ``blocks`` already ids in the peer's pool) to the peer; when it
        cannot take it, the peer drops the blocks and ``TransferError`` is raised."""
        req.decode_instance = self.name
        try:
            self.node.call(self.name, rpc.Accept(rpc.RequestState.of(req)))
        except TransferError:
            self.node.try_push(self.name, rpc.FreeMem(list(req.blocks)))
            raise


def store_client(host: str, port: int, timeout_s: float) -> Any:
    """A client of the frontend's TCPStore, where pairs meet to form their groups."""
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        return torch.distributed.TCPStore(host, port, is_master=False, timeout=timeout)
    except (RuntimeError, TimeoutError, ValueError) as e:
        raise TransferError(f"cannot reach the frontend's store at {host}:{port}: {e}") from e


class Grants:
    """Blocks of ``pool`` granted to peers' transfers into this instance: which each peer
    holds (until it commits them, hands a request over with them, or frees them), and the
    transfers under way, (peer, transfer id) -> (blocks, tokens, blocks matched). ``links``
    are the peers reached over torch.distributed or NIXL (their KV arrives there)."""

    def __init__(self, name: str, pool: MemPool, vocab_size: int, links: dict[str, PeerLink]):
        self.name = name
        self.pool = pool
        self.vocab_size = vocab_size
        self.links = links
        self.held: dict[str, Counter[int]] = {}
        self.xfers: dict[tuple[str, str], tuple] = {}  # (peer, transfer) -> (blocks, tokens, m)

    def on_alloc(self, sender: str, m: rpc.AllocRequest) -> rpc.AllocReply:
        """A peer asks for blocks to transfer into: granted to it, after checking the sizes."""
        n, layout, toks = m.num_blocks, self.pool.layout, m.tokens
        if n > self.pool.capacity() or (
            toks is not None
            and (
                not len(toks) // layout.block_size <= n <= layout.num_blocks_for(len(toks))
                or max(toks, default=0) >= self.vocab_size
            )
        ):
            raise ValueError(f"{n} blocks for {len(toks or ())} tokens cannot be received here")
        matched, new = self.pool.recv_alloc(toks, n)
        self.held.setdefault(sender, Counter()).update(matched + new)
        self.xfers[(sender, m.xfer)] = (matched + new, toks, len(matched))
        return rpc.AllocReply(matched, new)

    def on_commit(self, sender: str, m: rpc.Commit) -> None:
        """A peer commits what it wrote into the blocks granted for that transfer (over NIXL,
        once its writes' notifications are all in)."""
        blocks, toks, matched = self.xfers.get((sender, m.xfer), (None, None, 0))
        if (blocks, toks) != (m.blocks, m.tokens):
            raise ValueError(f"{sender} commits what was not allocated for transfer {m.xfer!r}")
        if (link := self.links.get(sender)) is not None:
            link.landed(m.xfer, blocks[matched:])  # raises: the sender aborts, both sides free
        del self.xfers[(sender, m.xfer)]
        self.pool.recv_commit(m.tokens, m.blocks)

    def on_kv_data(self, sender: str, m: rpc.KVData) -> None:
        """Receive the blocks a peer posted over our link into blocks it was granted."""
        granted = self.xfers.get((sender, m.xfer), ((),))[0]
        if (link := self.links.get(sender)) is None:
            raise ValueError(f"{self.name} has no torch.distributed link with {sender}")
        if not m.blocks or len(set(m.blocks)) != len(m.blocks) or not set(m.blocks) <= set(granted):
            raise ValueError(f"{sender} sends KV into blocks not allocated for {m.xfer!r}")
        link.receive(self.pool, m)

    def on_abort(self, sender: str, m: rpc.Abort) -> None:
        """A peer's transfer failed: every block granted to it goes back."""
        blocks = self.xfers.pop((sender, m.xfer), (m.blocks,))[0]
        if (link := self.links.get(sender)) is not None:
            link.forget(m.xfer)
        self.pool.recv_abort(self.ungrant(sender, blocks))

    def ungrant(self, peer: str, blocks: list[int]) -> list[int]:
        """Remove ``blocks`` from what ``peer`` holds here; returns those it really held."""
        held = self.held.get(peer, Counter())
        out = []
        for b in blocks:
            if held[b] > 0:
                held[b] -= 1
                out.append(b)
        return out

    def on_free(self, sender: str, m: rpc.FreeMem) -> None:
        """A peer drops its references on blocks it holds here."""
        self.pool.free_mem(self.ungrant(sender, m.blocks))

    def drop(self, peer: str) -> None:
        """``peer`` died: its transfers end and the blocks it held go back."""
        self.xfers = {k: v for k, v in self.xfers.items() if k[0] != peer}
        if blocks := list(self.held.pop(peer, Counter()).elements()):
            self.pool.free_mem(blocks)

    def totals(self) -> dict[str, int]:
        """Blocks each peer holds here."""
        return {p: sum(c.values()) for p, c in self.held.items()}


class PeerLinks:
    """The other instances as this one reaches them (the frontend announces them): each one's
    pool as a :class:`RemotePool`, mapped from shared memory on one host, over a
    torch.distributed pair group (a :class:`Link`) formed through the frontend's store, or
    over NIXL (a :class:`NixlLink` of this instance's agent ``nixl``). ``on_down(name,
    reason)`` is told about a peer that cannot be reached so."""

    def __init__(
        self, spec, node: rpc.RpcNode, pool: MemPool, on_down, nixl: NixlEndpoint | None = None
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.node = node
        self.pool = pool
        self.on_down = on_down
        self.nixl = nixl
        self.names: set[str] = set()  # the other instances, as the frontend announced
        self.infos: dict[str, rpc.PeerInfo] = {}
        self.remotes: dict[str, RemotePool] = {}
        self.links: dict[str, PeerLink] = {}  # peers reached over torch.distributed or NIXL
        self.pending: list[tuple[str, str, int]] = []  # (store key, peer, our rank)
        self.store: Any = None  # the frontend's TCPStore, while pairs form links

    def on_peers(self, sender: str, m: rpc.Peers) -> None:
        """The frontend announces the other instances (once): each is reached."""
        if self.names:
            raise PermissionError("the peers of an instance are announced once")
        self.names = {p.name for p in m.peers} - {self.name, rpc.FRONTEND}
        for p in (p for p in m.peers if p.name in self.names):
            self.reach(p, m.store, m.scope)

    def reach(self, p: rpc.PeerInfo, store: str, scope: str) -> None:
        """Connect to peer ``p``: map its pool, or queue the pair group the loop forms."""
        self.node.connect(p.name, p.address)
        self.infos[p.name] = p
        if p.transport in ("gloo", "nccl"):  # formed by the loop, in the pairs' order
            pair = tuple(sorted((self.name, p.name)))
            key = f"{self.spec.session}/{scope}/{'|'.join(pair)}"
            self.pending.append((key, p.name, pair.index(self.name)))
            self.pending.sort(key=lambda x: x[0].rpartition("/")[2])
            if self.store is None:
                host, _, port = store.rpartition(":")
                self.store = store_client(host, int(port), self.spec.timeout_s)
        elif p.transport == "nixl":
            self._reach_nixl(p)
        elif p.handle is not None:
            segment_path(p.handle)  # only the project's own segments are mapped
            self.remotes[p.name] = RemotePool(self.node, p, attach(p.handle), self.pool)

    def on_peer_up(self, sender: str, m: rpc.PeerUp) -> None:
        """A peer that died rejoined: it is reached again, with a new link if it needs one."""
        if m.info.name not in self.names or m.info.name not in self.node.dead:
            raise PermissionError(f"{m.info.name!r} is not a peer that died")
        del self.node.dead[m.info.name]
        if (old := self.links.pop(m.info.name, None)) is not None:
            old.close()
        self.remotes.pop(m.info.name, None)
        self.reach(m.info, m.store, m.scope)

    def _reach_nixl(self, p: rpc.PeerInfo) -> None:
        """Load ``p``'s NIXL agent, or tell ``on_down`` why it cannot be."""
        if self.nixl is None or p.nixl is None:
            side = self.name if self.nixl is None else p.name
            self.on_down(p.name, f"no NIXL link: {side} has no NIXL agent")
            return
        try:
            link = self.nixl.connect(p.name, p.nixl)
        except TransferError as e:
            self.on_down(p.name, f"no NIXL link: {e}")
            return
        self.links[p.name] = link
        self.remotes[p.name] = RemotePool(self.node, p, None, self.pool, link)

    def form(self) -> None:
        """Join every pending pair group, in the order of the pairs' names everywhere (so two
        instances never wait on each other's second pair): each call blocks until the peer
        joins too."""
        pending, self.pending = self.pending, []
        for key, peer, rank in pending:
            prefix = torch.distributed.PrefixStore(key, self.store)
            try:
                link = Link(
                    GlooTransport(
                        rank,
                        self.spec.host,
                        store=prefix,
                        device=self.pool.device,
                        bind_host=self.spec.host,
                        timeout_s=self.spec.timeout_s,
                    ),
                    peer,
                )
            except TransferError as e:
                self.on_down(peer, f"no torch.distributed link: {e}")
                continue
            self.links[peer] = link
            self.remotes[peer] = RemotePool(self.node, self.infos[peer], None, self.pool, link)
        self.store = None  # the groups are formed; the store is not needed any more
