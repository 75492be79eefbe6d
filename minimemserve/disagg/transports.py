"""KV over torch.distributed point-to-point: :class:`GlooTransport`, a two-rank group (gloo for
CPU tensors, NCCL for CUDA) that moves whole aggregated blocks (``[num_blocks, L, 2,
block_size, n_kv_heads, head_dim]`` pool tensors, block dimension first) from a sender's pool
into blocks the receiver has already allocated, packed: one message per transfer. It is
two-sided: the receiver posts the matching receive, with the block ids and tag a control
plane gave it; this module moves bytes only.

:class:`GlooLink`, the runtime's ``gloo`` KV link (:mod:`~minimemserve.links`), holds
one per pair of instances.
The other ways of cutting a transfer into pieces (per layer, per block) exist only for the
transfer benchmark, in :mod:`minimemserve_lab.harness.transfer_paths`."""

from __future__ import annotations

import contextlib
import datetime
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from minimemserve.blocks.copy import is_run
from minimemserve.disagg import rpc
from minimemserve.disagg.rpc import LOOPBACK
from minimemserve.errors import TransferError
from minimemserve.links import Counts
from minimemserve.mempool import MemPool
from minimemserve.parallel import HostStore

# A transfer of a few hundred MiB over loopback takes well under a second; a minute means
# the peer is gone or hung.
GLOO_TIMEOUT_S = 60.0


# Gloo's TCP device uses this many I/O threads per group; more only adds contention on small
# hosts (measured: 1 thread is both faster and steadier on 2 cores).
GLOO_THREADS = 1


IdList = Sequence[int] | torch.Tensor


def as_index(ids: IdList, device: torch.device | str = "cpu") -> torch.Tensor:
    """Block ids as an int64 tensor on ``device``."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype != torch.int64 or ids.dim() != 1:
            ids = ids.reshape(-1).to(torch.int64)
        return ids.to(device)
    return torch.tensor(list(ids), dtype=torch.int64, device=device)


def ids_list(ids: IdList) -> list[int]:
    return ids.tolist() if isinstance(ids, torch.Tensor) else [int(i) for i in ids]


class Staging:
    """A reusable gather buffer, so packed copies do not allocate (and page-fault) each time."""

    def __init__(self) -> None:
        """Start empty; grows to the largest request seen."""
        self._buf: torch.Tensor | None = None

    def get(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous tensor of ``shape`` (contents undefined), reusing memory when it fits."""
        numel = 1
        for s in shape:
            numel *= s
        buf = self._buf
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self._buf = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)


def _buffer(staging: Staging | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if staging is not None:
        return staging.get(shape, like.dtype, like.device)
    return torch.empty(shape, dtype=like.dtype, device=like.device)


@dataclass
class Pending:
    """Posted sends or receives; :meth:`wait` blocks until they land (and scatters staged data)."""

    works: list[Any]
    finish: Callable[[], None] | None = None
    timeout_s: float = GLOO_TIMEOUT_S
    what: str = "transfer"
    _done: bool = field(default=False, repr=False)

    def wait(self) -> None:
        """Wait for every piece; raises TransferError on a timeout or a broken peer."""
        if self._done:
            return
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            for w in self.works:
                w.wait(timeout)
        except RuntimeError as e:
            raise TransferError(f"{self.what} failed: {e}") from e
        if self.finish is not None:
            self.finish()
        self._done = True


class GlooTransport:
    """Two-sided transport over ``torch.distributed`` point-to-point (gloo on CPU, NCCL on CUDA).

    Both ends build one with their rank (0 or 1); rank 0 hosts the TCP store at
    ``host:port`` (port 0 = pick a free one; read it from :attr:`port`, or start the store
    yourself with :func:`start_store` to publish the port before the blocking rendezvous).
    The process group is private to this object, not torch's global default group.

    The sender calls ``send_blocks(src, src_ids)``; the receiver calls
    ``recv_blocks(dst, dst_ids)`` with the same number of blocks (the ids come from the
    control plane, so nothing but KV travels here). ``wait=False`` returns a
    :class:`Pending` so many transfers can be in flight at once; ``tag`` keeps them apart.
    """

    def __init__(
        self,
        rank: int,
        host: str = LOOPBACK,
        port: int = 0,
        *,
        store: torch.distributed.Store | None = None,
        device: str | torch.device = "cpu",
        bind_host: str | None = None,
        timeout_s: float = GLOO_TIMEOUT_S,
    ) -> None:
        """Join the two-rank group; blocks until the peer joins (or ``timeout_s`` passes)."""
        if rank not in (0, 1):
            raise ValueError(f"GlooTransport connects two ranks, 0 and 1; got rank {rank}")
        self.rank = rank
        self.peer = 1 - rank
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.kind = "nccl" if self.device.type == "cuda" else "gloo"  # the backend
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            if rank == 1 and port == 0:
                raise ValueError("rank 1 needs the port of rank 0's store")
            try:
                if rank == 0:  # on the address gloo binds, not on every interface
                    store = HostStore(bind_host or host, timeout_s, port).store
                else:
                    store = torch.distributed.TCPStore(host, port, 2, False, timeout)
            except (OSError, RuntimeError) as e:
                raise TransferError(f"cannot reach the store at {host}:{port}: {e}") from e
        self.store = store
        self.host = host
        self.port = int(getattr(store, "port", port))
        try:
            if self.kind == "nccl":
                opts = torch.distributed.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                self.pg = torch.distributed.ProcessGroupNCCL(store, rank, 2, opts)
            else:
                opts = torch.distributed.ProcessGroupGloo._Options()
                opts._devices = [
                    torch.distributed.ProcessGroupGloo.create_device(hostname=bind_host or host)
                ]
                opts._timeout = timeout
                opts._threads = GLOO_THREADS
                self.pg = torch.distributed.ProcessGroupGloo(store, rank, 2, opts)
        except (RuntimeError, TimeoutError) as e:
            raise TransferError(
                f"rank {rank} could not join the transfer group at {host}:{self.port}: {e}"
            ) from e

    def _check(self, t: torch.Tensor) -> None:
        if t.device.type != self.device.type:
            raise ValueError(
                f"{self.kind} transport moves {self.device.type} tensors, got one on {t.device}"
            )

    def _post(self, pieces: list[torch.Tensor], send: bool, tag: int) -> list[Any]:
        op = self.pg.send if send else self.pg.recv
        try:
            return [op([p], self.peer, tag) for p in pieces]
        except RuntimeError as e:
            raise TransferError(f"rank {self.rank}: posting to peer {self.peer} failed: {e}") from e

    def send_blocks(
        self,
        src: torch.Tensor,
        src_ids: IdList,
        *,
        tag: int = 0,
        wait: bool = True,
        staging: Staging | None = None,
    ) -> Pending:
        """Send ``src[src_ids]`` as one packed message (which blocks receive it is the
        receiver's business). ``staging`` reuses a gather buffer; do not reuse it for another
        transfer before this one is waited for."""
        self._check(src)
        ids = ids_list(src_ids)
        buf = _buffer(staging, (len(ids), *src.shape[1:]), src)  # [n, L, 2, bs, h, d]
        torch.index_select(src, 0, as_index(ids, src.device), out=buf)
        what = f"send to rank {self.peer}"
        result = Pending(self._post([buf], True, tag), None, self.timeout_s, what)
        if wait:
            result.wait()
        return result

    def recv_blocks(
        self,
        dst: torch.Tensor,
        dst_ids: IdList,
        *,
        tag: int = 0,
        wait: bool = True,
        staging: Staging | None = None,
    ) -> Pending:
        """Receive into ``dst[dst_ids]`` what the peer sends with :meth:`send_blocks`: in
        place when ``dst_ids`` is one ascending run, else into a buffer (``staging``, or a
        fresh one) that ``wait`` scatters."""
        self._check(dst)
        ids = ids_list(dst_ids)
        n, finish = len(ids), None
        if is_run(ids):
            piece = dst.narrow(0, ids[0] if n else 0, n)  # one run: straight into place
        else:
            piece = _buffer(staging, (n, *dst.shape[1:]), dst)  # [n, L, 2, bs, h, d]
            idx = as_index(ids, dst.device)

            def finish() -> None:
                dst.index_copy_(0, idx, piece)

        what = f"receive from rank {self.peer}"
        result = Pending(self._post([piece], False, tag), finish, self.timeout_s, what)
        if wait:
            result.wait()
        return result

    def close(self) -> None:
        """Shut the process group down and drop the store. Idempotent."""
        pg = getattr(self, "pg", None)
        if pg is not None:
            with contextlib.suppress(RuntimeError):
                pg.shutdown()
            self.pg = None
        self.store = None

    def __enter__(self) -> GlooTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class GlooLink:
    """A two-rank torch.distributed group with peer ``peer``: one packed message per
    transfer, posted before a ``KVData`` call tells the peer which of its blocks to receive it
    into."""

    name: ClassVar[str] = "gloo"
    shares_pool: ClassVar[bool] = False
    whole_model: ClassVar[bool] = False
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    meets_in_store: ClassVar[bool] = True

    transport: GlooTransport
    peer: str
    tags: itertools.count = field(default_factory=itertools.count)
    counts: Counts = field(default_factory=Counts)

    @classmethod
    def unfit(cls, a: Any, b: Any) -> str | None:
        """Any two instances that reach each other's hosts."""
        return None

    @classmethod
    def endpoint(cls, spec: Any, pool: Any) -> None:
        """Nothing of its own: the pair meets in the frontend's store."""

    @classmethod
    def reach(cls, peers: Any, p: rpc.PeerInfo) -> None:
        """Queue the pair group; the instance's loop forms it (:meth:`join`)."""
        peers.queue_pair(p)

    @classmethod
    def join(cls, peer: str, rank: int, store: Any, spec: Any, device: Any) -> GlooLink:
        """Join the pair group with ``peer`` (we are ``rank``) in ``store``; blocks until the
        peer joins too."""
        transport = GlooTransport(
            rank,
            spec.host,
            store=store,
            device=device,
            bind_host=spec.host,
            timeout_s=spec.timeout_s,
        )
        return cls(transport, peer)

    def write(self, node: rpc.RpcNode, xfer: str, blocks: list[int], src, src_ids) -> None:
        """Post blocks ``src_ids`` of ``src`` as one message, then have the peer receive it
        into ``blocks`` (``KVData``); returns once it has."""
        tag = next(self.tags) % (1 << 31)
        posted = self.transport.send_blocks(src, list(src_ids), tag=tag, wait=False)
        node.call(self.peer, rpc.KVData(xfer, blocks, tag))
        posted.wait()  # the peer has it: its reply came after its receive finished
        self.counts.sent_bytes += len(blocks) * src[0].nbytes
        self.counts.sent_messages += 1

    def receive(self, pool: MemPool, m: rpc.KVData) -> None:
        """Receive what the peer posted for ``m`` into ``m.blocks`` of ``pool``."""
        self.transport.recv_blocks(pool.kv(), m.blocks, tag=m.tag)
        self.counts.recv_bytes += len(m.blocks) * pool.kv()[0].nbytes
        self.counts.recv_messages += 1

    def await_landing(self, xfer: str, new: list[int]) -> None:
        """Before a commit: nothing to wait for (each KVData was received as it came)."""

    def forget(self, xfer: str) -> None:
        """A transfer was aborted: nothing is kept per transfer here."""

    def close(self) -> None:
        """Nothing more moves over this link (its counters stay)."""
        self.transport.close()

    def stats(self) -> dict[str, int | str]:
        """Bytes and messages each way, and the backend (gloo or nccl)."""
        return self.counts.stats(self.transport.kind)


class NcclLink(GlooLink):
    """The gloo link asked for by its CUDA backend's name (the pair announces ``gloo``)."""

    devices: ClassVar[tuple[str, ...]] = ("cuda",)
