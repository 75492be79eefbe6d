"""KV over torch.distributed point-to-point: :class:`GlooTransport`, a two-rank group (gloo for
CPU tensors, NCCL for CUDA) that moves whole aggregated blocks (``[num_blocks, L, 2,
block_size, n_kv_heads, head_dim]`` pool tensors, block dimension first) from a sender's pool
into blocks the receiver has already allocated. It is two-sided: the receiver posts matching
receives, with the block ids and tag a control plane gave it; this module moves bytes only.

The process runtime reaches a peer on another host through one of these per pair
(``packed``: one message per transfer; a peer on the same host is written one-sided through
:mod:`minimemserve.mempool.shared`). The other modes (:class:`TransferMode`) exist so
``bench/transfer.py`` can compare them: ``by_layer`` sends each layer's K/V as that layer
finishes, ``by_request`` sends the 2*L per-layer pieces of each block (per-layer layout
``[L, 2, num_blocks, ...]``), ``by_request_aggregated`` sends one piece per aggregated block
and ``packed`` gathers all blocks into one buffer and sends it once."""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from minimemserve.blocks.copy import is_run
from minimemserve.disagg.rpc import LOOPBACK
from minimemserve.errors import TransferError
from minimemserve.parallel import HostStore

# A transfer of a few hundred MiB over loopback takes well under a second; a minute means
# the peer is gone or hung.
GLOO_TIMEOUT_S = 60.0


# Gloo's TCP device uses this many I/O threads per group; more only adds contention on small
# hosts (measured: 1 thread is both faster and steadier on 2 cores).
GLOO_THREADS = 1


IdList = Sequence[int] | torch.Tensor


class TransportKind(str, Enum):
    """Data paths, fastest first for a given pair."""

    COPY = "copy"  # same process
    CUDA_IPC = "cuda_ipc"  # same host, same GPU, one-sided
    SHM = "shm"  # same host, CPU memory, one-sided
    NCCL = "nccl"  # CUDA tensors across hosts or GPUs
    GLOO = "gloo"  # CPU tensors across hosts

    @property
    def one_sided(self) -> bool:
        """True when the sender writes the receiver's memory without the receiver acting."""
        return self in (TransportKind.COPY, TransportKind.CUDA_IPC, TransportKind.SHM)


class TransferMode(str, Enum):
    """How a request's blocks are cut into pieces on the wire (see the module docstring)."""

    BY_LAYER = "by_layer"
    BY_REQUEST = "by_request"
    AGGREGATED = "by_request_aggregated"
    PACKED = "packed"


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


def in_place_pieces(pool: torch.Tensor, ids: list[int], mode: TransferMode) -> list[torch.Tensor]:
    """The views that travel as they are: one ``[L, 2, bs, h, d]`` block each
    (``by_request_aggregated``), or the 2*L ``[bs, h, d]`` pieces of each block of a
    per-layer pool (``by_request``)."""
    if mode is TransferMode.AGGREGATED:
        return [pool[b] for b in ids]
    if mode is not TransferMode.BY_REQUEST:
        raise ValueError(f"{mode.value} blocks do not travel in place")
    layers = range(pool.shape[0])
    return [pool[layer, kv, b] for b in ids for layer in layers for kv in range(2)]


def _buffer(staging: Staging | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if staging is not None:
        return staging.get(shape, like.dtype, like.device)
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _check_contiguous(pieces: list[torch.Tensor]) -> None:
    if any(not p.is_contiguous() for p in pieces):
        raise ValueError("point-to-point pieces must be contiguous: pass a contiguous pool tensor")


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

    The sender calls ``send_blocks(src, src_ids, mode=...)``; the receiver calls
    ``recv_blocks(dst, dst_ids, mode=...)`` with the same mode and number of blocks (the ids
    come from the control plane, so nothing but KV travels here). ``wait=False`` returns a
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
        self.kind = TransportKind.NCCL if self.device.type == "cuda" else TransportKind.GLOO
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
            if self.kind is TransportKind.NCCL:
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
        self._staging = Staging()

    @property
    def one_sided(self) -> bool:
        """Always false: the receiver posts matching receives."""
        return False

    def _check(self, t: torch.Tensor) -> None:
        if t.device.type != self.device.type:
            raise ValueError(
                f"{self.kind.value} transport moves {self.device.type} tensors, "
                f"got one on {t.device}"
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
        dst_ids: IdList | None = None,
        mode: TransferMode | str = TransferMode.PACKED,
        *,
        tag: int = 0,
        wait: bool = True,
        staging: Staging | None = None,
    ) -> Pending:
        """Send ``src[src_ids]`` cut as ``mode`` says (``dst_ids`` is the receiver's business).

        ``by_request`` takes a per-layer pool ``[L, 2, num_blocks, ...]``, the other modes
        an aggregated one. ``staging`` (packed, by_layer) reuses a gather buffer; do not
        reuse it for another transfer before this one is waited for.
        """
        self._check(src)
        mode = TransferMode(mode)
        ids = ids_list(src_ids)
        n = len(ids)
        if mode is TransferMode.BY_LAYER:
            num_layers = src.shape[1]
            buf = _buffer(staging, (num_layers, n, *src.shape[2:]), src)  # [L, n, 2, bs, h, d]
            idx = as_index(ids, src.device)
            for layer in range(num_layers):
                torch.index_select(src[:, layer], 0, idx, out=buf[layer])
            pieces = list(buf)
        elif mode is TransferMode.PACKED:
            buf = _buffer(staging, (n, *src.shape[1:]), src)  # [n, L, 2, bs, h, d]
            torch.index_select(src, 0, as_index(ids, src.device), out=buf)
            pieces = [buf]
        else:
            pieces = in_place_pieces(src, ids, mode)
        _check_contiguous(pieces)
        what = f"send {mode.value} to rank {self.peer}"
        result = Pending(self._post(pieces, True, tag), None, self.timeout_s, what)
        if wait:
            result.wait()
        return result

    def recv_blocks(
        self,
        dst: torch.Tensor,
        dst_ids: IdList,
        mode: TransferMode | str = TransferMode.PACKED,
        *,
        tag: int = 0,
        wait: bool = True,
        staging: Staging | None = None,
    ) -> Pending:
        """Receive into ``dst[dst_ids]`` what the peer sends with ``send_blocks`` in ``mode``.

        ``by_request_aggregated`` and ``by_request`` land in place, and so does ``packed``
        when ``dst_ids`` is one ascending run; otherwise ``packed`` and ``by_layer`` land in
        a buffer (``staging``, or a fresh one) scattered by ``wait``.
        """
        self._check(dst)
        mode = TransferMode(mode)
        ids = ids_list(dst_ids)
        n = len(ids)
        finish = None
        if mode is TransferMode.BY_LAYER:
            num_layers = dst.shape[1]
            buf = _buffer(staging, (num_layers, n, *dst.shape[2:]), dst)  # [L, n, 2, bs, h, d]
            idx = as_index(ids, dst.device)
            pieces = list(buf)

            def finish() -> None:
                for layer in range(num_layers):
                    dst[:, layer].index_copy_(0, idx, buf[layer])

        elif mode is TransferMode.PACKED and is_run(ids):
            pieces = [dst.narrow(0, ids[0] if n else 0, n)]  # one run: straight into place
        elif mode is TransferMode.PACKED:
            buf = _buffer(staging, (n, *dst.shape[1:]), dst)  # [n, L, 2, bs, h, d]
            idx = as_index(ids, dst.device)
            pieces = [buf]

            def finish() -> None:
                dst.index_copy_(0, idx, buf)

        else:
            pieces = in_place_pieces(dst, ids, mode)  # received in place, no staging
        _check_contiguous(pieces)
        what = f"receive {mode.value} from rank {self.peer}"
        result = Pending(self._post(pieces, False, tag), finish, self.timeout_s, what)
        if wait:
            result.wait()
        return result

    def send_layer(
        self,
        src: torch.Tensor,
        layer: int,
        src_ids: IdList,
        dst_ids: IdList | None = None,
        *,
        tag: int = 0,
        wait: bool = True,
    ) -> Pending:
        """Send K and V of ``layer`` for blocks ``src_ids`` (aggregated pool) as one piece."""
        self._check(src)
        piece = torch.index_select(src[:, layer], 0, as_index(src_ids, src.device))  # [n, 2, ...]
        what = f"send layer {layer} to rank {self.peer}"
        result = Pending(self._post([piece], True, tag), None, self.timeout_s, what)
        if wait:
            result.wait()
        return result

    def recv_layer(
        self, dst: torch.Tensor, layer: int, dst_ids: IdList, *, tag: int = 0, wait: bool = True
    ) -> Pending:
        """Receive one layer sent by :meth:`send_layer` into blocks ``dst_ids``."""
        self._check(dst)
        ids = ids_list(dst_ids)
        piece = torch.empty((len(ids), *dst.shape[2:]), dtype=dst.dtype, device=dst.device)
        idx = as_index(ids, dst.device)
        result = Pending(
            self._post([piece], False, tag),
            lambda: dst[:, layer].index_copy_(0, idx, piece),
            self.timeout_s,
            f"receive layer {layer} from rank {self.peer}",
        )
        if wait:
            result.wait()
        return result

    def send_tensor(self, t: torch.Tensor, tag: int = 0) -> None:
        """Send one contiguous tensor (small signals, acknowledgements)."""
        Pending(self._post([t], True, tag), None, self.timeout_s, "send").wait()

    def recv_tensor(self, t: torch.Tensor, tag: int = 0) -> None:
        """Receive one contiguous tensor into ``t``."""
        Pending(self._post([t], False, tag), None, self.timeout_s, "receive").wait()

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
