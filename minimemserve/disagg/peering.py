"""An instance's peers: how it reaches each one (:class:`PeerLinks`: a KV link per peer, of
the class the table in :mod:`~.links` gives the pair's transport, behind a :class:`RemotePool`
proxy) and the blocks it granted to their transfers into it (:class:`Grants`). A request handed
to a peer travels as its state (:class:`rpc.RequestState`)."""

from __future__ import annotations

import datetime
import itertools
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from ..blocks.copy import check_pool_tensor
from ..errors import InstanceDied, TransferError
from ..links import KVLink, kv_link
from ..mempool import MemPool
from ..request import Request
from . import rpc
from .transports import GlooLink

logger = logging.getLogger(__name__)

# A transfer into this instance that neither commits nor aborts within this many control-call
# timeouts has lost its sender (stopped, or its completion went astray): its blocks go back.
GRANT_TIMEOUTS = 2
# Why granted blocks came back to the pool (the counters :attr:`Grants.returned` keeps).
RETURNED = ("aborted", "expired", "peer_died")


class RemotePool:
    """A peer instance as a transfer and a recipe see it from here: its MemPool (``recv_*`` and
    ``free_mem`` are requests to the peer, ``recv_copy`` a write over its KV link) and ``accept``
    to hand it a request. Blocks it took for a failed transfer are released there
    (``recv_abort``, best effort)."""

    def __init__(self, node: rpc.RpcNode, info: rpc.PeerInfo, link: KVLink, pool: MemPool) -> None:
        """Proxy ``info``, reached over ``link``; its layout is ``pool``'s."""
        self.node = node
        self.name = info.name
        self.role = info.role
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
        """Step 2: blocks ``src_ids`` of this process's pool tensor ``src`` go into the peer's
        ``blocks`` over the link."""
        check_pool_tensor(self.model_layout, self.dtype, src, "recv_copy")
        if not blocks:
            return
        if self.peer in self.node.dead:
            raise InstanceDied(f"instance {self.peer} died before the write")
        self.link.write(self.node, self._xfer, list(blocks), src, list(src_ids))

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
    transfers under way, (peer, transfer id) -> (blocks, tokens, blocks matched). ``links``:
    each peer's KV link (its KV arrives there). A transfer under way for ``expire_s`` is
    given up (:meth:`expire`); :attr:`returned` counts the blocks that came back without a
    commit, by why (``RETURNED``)."""

    def __init__(
        self,
        name: str,
        pool: MemPool,
        vocab_size: int,
        links: dict[str, KVLink],
        expire_s: float = GRANT_TIMEOUTS * rpc.DEFAULT_TIMEOUT_S,
    ):
        self.name = name
        self.pool = pool
        self.vocab_size = vocab_size
        self.links = links
        self.expire_s = expire_s
        self.held: dict[str, Counter[int]] = {}
        self.xfers: dict[tuple[str, str], tuple] = {}  # (peer, transfer) -> (blocks, tokens, m)
        self.opened: dict[tuple[str, str], float] = {}  # (peer, transfer) -> when it began
        self.returned: Counter[str] = Counter({why: 0 for why in RETURNED})

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
        self.opened[(sender, m.xfer)] = time.monotonic()
        return rpc.AllocReply(matched, new)

    def on_commit(self, sender: str, m: rpc.Commit) -> None:
        """A peer commits what it wrote into the blocks granted for that transfer (once its
        link says all of it landed)."""
        blocks, toks, matched = self.xfers.get((sender, m.xfer), (None, None, 0))
        if (blocks, toks) != (m.blocks, m.tokens):
            raise ValueError(f"{sender} commits what was not allocated for transfer {m.xfer!r}")
        if (link := self.links.get(sender)) is not None:
            # raises if it never lands: the sender aborts, both sides free
            link.await_landing(m.xfer, blocks[matched:])
        del self.xfers[(sender, m.xfer)]
        del self.opened[(sender, m.xfer)]
        self.pool.recv_commit(m.tokens, m.blocks)

    def on_kv_data(self, sender: str, m: rpc.KVData) -> None:
        """Receive the blocks a peer posted over our link into blocks it was granted."""
        granted = self.xfers.get((sender, m.xfer), ((),))[0]
        if (link := self.links.get(sender)) is None:
            raise ValueError(f"{self.name} has no KV link with {sender}")
        if not m.blocks or len(set(m.blocks)) != len(m.blocks) or not set(m.blocks) <= set(granted):
            raise ValueError(f"{sender} sends KV into blocks not allocated for {m.xfer!r}")
        link.receive(self.pool, m)

    def on_abort(self, sender: str, m: rpc.Abort) -> None:
        """A peer's transfer failed: every block granted to it goes back."""
        blocks = self.xfers.pop((sender, m.xfer), (m.blocks,))[0]
        self.opened.pop((sender, m.xfer), None)
        if (link := self.links.get(sender)) is not None:
            link.forget(m.xfer)
        back = self.ungrant(sender, blocks)
        self.returned["aborted"] += len(back)
        self.pool.recv_abort(back)

    def expire(self) -> int:
        """Give up the transfers under way for ``expire_s`` (their sender stopped, or its
        commit went astray): their blocks go back to the pool; a late commit is refused (the
        sender then aborts, and frees what it holds). Returns how many blocks came back."""
        if not self.opened:
            return 0
        now, n = time.monotonic(), 0
        for key in [k for k, t in self.opened.items() if now - t > self.expire_s]:
            peer, xfer = key
            del self.opened[key]
            blocks = self.xfers.pop(key)[0]
            if (link := self.links.get(peer)) is not None:
                link.forget(xfer)
            back = self.ungrant(peer, blocks)
            logger.warning(
                "%s: transfer %s from %s did not complete in %g s: %d blocks back",
                self.name,
                xfer,
                peer,
                self.expire_s,
                len(back),
            )
            self.returned["expired"] += len(back)
            self.pool.recv_abort(back)
            n += len(back)
        return n

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
        self.opened = {k: t for k, t in self.opened.items() if k[0] != peer}
        if blocks := list(self.held.pop(peer, Counter()).elements()):
            self.returned["peer_died"] += len(blocks)
            self.pool.free_mem(blocks)

    def totals(self) -> dict[str, int]:
        """Blocks each peer holds here."""
        return {p: sum(c.values()) for p, c in self.held.items()}


class PeerLinks:
    """The other instances as this one reaches them (the frontend announces them): each one's
    pool as a :class:`RemotePool` over a KV link of the class the table (``spec.kv_links``)
    gives the pair's transport; links that meet in the frontend's store (torch.distributed
    pairs) are queued and formed by :meth:`form`. ``endpoints``: this instance's side of its
    links, by transport (``links.link_endpoints``); ``on_down(name, reason)`` is told about a
    peer that cannot be reached."""

    def __init__(
        self, spec, node: rpc.RpcNode, pool: MemPool, on_down, endpoints: dict | None = None
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.node = node
        self.pool = pool
        self.on_down = on_down
        self.endpoints: dict[str, Any] = endpoints or {}
        self.names: set[str] = set()  # the other instances, as the frontend announced
        self.infos: dict[str, rpc.PeerInfo] = {}
        self.remotes: dict[str, RemotePool] = {}
        self.links: dict[str, KVLink] = {}  # each reached peer's link
        self.pending: list[tuple[str, str, int]] = []  # (store key, peer, our rank)
        self.store: Any = None  # the frontend's TCPStore, while pairs form links
        self._meeting = ("", "")  # (store address, scope) of the announcement being reached

    def on_peers(self, sender: str, m: rpc.Peers) -> None:
        """The frontend announces the other instances (once): each is reached."""
        if self.names:
            raise PermissionError("the peers of an instance are announced once")
        peers = [p for p in m.peers if p.name not in (self.name, rpc.FRONTEND)]
        links = [kv_link(p.transport, self.spec.kv_links) for p in peers]  # all known, first
        self.names = {p.name for p in peers}
        for p, link in zip(peers, links):
            self.reach(p, link, m.store, m.scope)

    def reach(self, p: rpc.PeerInfo, link: type, store: str, scope: str) -> None:
        """Connect to peer ``p`` over ``link`` (meeting in ``store`` under ``scope`` if it
        forms through the frontend's store)."""
        self.node.connect(p.name, p.address)
        self.infos[p.name] = p
        self._meeting = (store, scope)
        link.reach(self, p)

    def add(self, p: rpc.PeerInfo, link: KVLink) -> None:
        """Peer ``p`` is reached over ``link``."""
        self.links[p.name] = link
        self.remotes[p.name] = RemotePool(self.node, p, link, self.pool)

    def queue_pair(self, p: rpc.PeerInfo) -> None:
        """Queue the pair group with ``p``, formed by the loop in the pairs' order."""
        store, scope = self._meeting
        pair = tuple(sorted((self.name, p.name)))
        key = f"{self.spec.session}/{scope}/{'|'.join(pair)}"
        self.pending.append((key, p.name, pair.index(self.name)))
        self.pending.sort(key=lambda x: x[0].rpartition("/")[2])
        if self.store is None:
            host, _, port = store.rpartition(":")
            self.store = store_client(host, int(port), self.spec.timeout_s)

    def on_peer_up(self, sender: str, m: rpc.PeerUp) -> None:
        """A peer that died rejoined: it is reached again, with a new link."""
        if m.info.name not in self.names or m.info.name not in self.node.dead:
            raise PermissionError(f"{m.info.name!r} is not a peer that died")
        link = kv_link(m.info.transport, self.spec.kv_links)
        del self.node.dead[m.info.name]
        if (old := self.links.pop(m.info.name, None)) is not None:
            old.close()
        self.remotes.pop(m.info.name, None)
        self.reach(m.info, link, m.store, m.scope)

    def form(self) -> None:
        """Join every pending pair group, in the order of the pairs' names everywhere (so two
        instances never wait on each other's second pair): each call blocks until the peer
        joins too."""
        pending, self.pending = self.pending, []
        for key, peer, rank in pending:
            prefix = torch.distributed.PrefixStore(key, self.store)
            try:
                link = GlooLink.join(peer, rank, prefix, self.spec, self.pool.device)
            except TransferError as e:
                self.on_down(peer, f"no torch.distributed link: {e}")
                continue
            self.add(self.infos[peer], link)
        self.store = None  # the groups are formed; the store is not needed any more
