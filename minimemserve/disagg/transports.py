"""Ways to move whole KV blocks between pools: copy, shared memory, CUDA IPC, torch.distributed.

A transfer moves whole aggregated blocks (``[num_blocks, L, 2, block_size, n_kv_heads,
head_dim]`` pool tensors, block dimension first) from a sender's pool into blocks the
receiver has already allocated. The fastest path available for a pair is picked by
:func:`choose_transport`:

* same process -> :class:`CopyTransport`, a plain tensor copy;
* same host -> :class:`SharedMemoryTransport`: the receiver's pool tensor lives in shared
  memory (:class:`SharedPoolTensor`: a POSIX segment for CPU, CUDA IPC for one GPU) and the
  sender writes into it directly, one-sided;
* different hosts -> :class:`GlooTransport`: ``torch.distributed`` point-to-point (gloo for
  CPU tensors, NCCL for CUDA), two-sided: the receiver posts matching receives.

The block ids on both sides come from a control plane; this module moves bytes only. The
process runtime writes a same-host peer's pool through :mod:`minimemserve.mempool.shared`
and reaches other peers through a :class:`GlooTransport` per pair (``packed``: one message
per transfer); ``bench/transfer.py`` compares all of them.

Transfer modes (:class:`TransferMode`) exist so the benchmark can compare them:
``by_layer`` sends each layer's K/V as that layer finishes, ``by_request`` sends the
2*L per-layer pieces of each block (per-layer layout ``[L, 2, num_blocks, ...]``),
``by_request_aggregated`` sends one piece per aggregated block and ``packed`` gathers all
blocks into one buffer and sends it once.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import torch

from minimemserve.blocks.copy import is_run
from minimemserve.disagg.rpc import LOOPBACK
from minimemserve.errors import TransferError
from minimemserve.mempool.shared import (
    DEFAULT_SHM_PREFIX,
    SHM_DIR,
    SharedHandle,
    SharedPoolTensor,
    attach,
)

# A transfer of a few hundred MiB over loopback takes well under a second; a minute means
# the peer is gone or hung.
GLOO_TIMEOUT_S = 60.0
# Gloo's TCP device uses this many I/O threads per group; more only adds contention on small
# hosts (measured: 1 thread is both faster and steadier on 2 cores).
GLOO_THREADS = 1
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", ""})

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


def pieces_per_transfer(mode: TransferMode | str, num_layers: int, num_blocks: int) -> int:
    """Number of separate sends (or copy calls) one transfer of ``num_blocks`` blocks takes."""
    mode = TransferMode(mode)
    if mode is TransferMode.BY_LAYER:
        return num_layers
    if mode is TransferMode.BY_REQUEST:
        return 2 * num_layers * num_blocks
    if mode is TransferMode.AGGREGATED:
        return num_blocks
    return 1


# --------------------------------------------------------------------------------------------
# shared-memory segments


def remove_stale_segments(prefix: str = DEFAULT_SHM_PREFIX, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink segments named ``{prefix}-{pid}-...`` whose owning process no longer exists.

    A process killed with SIGKILL cannot unlink its segments; run this at start-up.
    Returns the names removed.
    """
    removed = []
    if not os.path.isdir(shm_dir):
        return removed
    for name in os.listdir(shm_dir):
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != prefix or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        try:
            os.kill(pid, 0)
            continue  # owner alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, someone else's
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(shm_dir, name))
        removed.append(name)
    return removed


class SharedTensorFactory:
    """A ``tensor_factory`` for MemPool that places every tier tensor in shared memory.

    ``factory(shape, dtype, device) -> Tensor`` (zero-filled); :meth:`handle_of` gives the
    handle to publish for a tensor it made; :meth:`close` unlinks everything.
    """

    def __init__(self, prefix: str = DEFAULT_SHM_PREFIX, shm_dir: str = SHM_DIR) -> None:
        """Segments get names ``{prefix}-{pid}-{random}`` in ``shm_dir``."""
        self.prefix = prefix
        self.shm_dir = shm_dir
        self._owned: list[SharedPoolTensor] = []

    def __call__(
        self, shape: Sequence[int], dtype: torch.dtype, device: str | torch.device
    ) -> torch.Tensor:
        """Allocate one zero-filled shared tensor."""
        shared = SharedPoolTensor.create(shape, dtype, device, self.prefix, self.shm_dir)
        self._owned.append(shared)
        return shared.tensor

    def handle_of(self, tensor: torch.Tensor) -> SharedHandle:
        """The handle of a tensor this factory made (the same tensor object or a full view)."""
        for shared in self._owned:
            t = shared.tensor
            if t is not None and t.data_ptr() == tensor.data_ptr() and t.shape == tensor.shape:
                return shared.handle
        raise ValueError("tensor was not made by this SharedTensorFactory")

    def close(self) -> None:
        """Close every segment this factory made."""
        for shared in self._owned:
            shared.close()
        self._owned.clear()


# --------------------------------------------------------------------------------------------
# in-memory block copies (used by the same-process and same-host transports)


def as_index(ids: IdList, device: torch.device | str = "cpu") -> torch.Tensor:
    """Block ids as an int64 tensor on ``device``."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype != torch.int64 or ids.dim() != 1:
            ids = ids.reshape(-1).to(torch.int64)
        return ids.to(device)
    return torch.tensor(list(ids), dtype=torch.int64, device=device)


def _check_pair(
    src: torch.Tensor, dst: torch.Tensor, src_ids: list[int], dst_ids: list[int], block_dim: int
) -> None:
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    if src.dtype != dst.dtype:
        raise ValueError(f"dtype mismatch: source {src.dtype}, destination {dst.dtype}")
    if src.dim() != dst.dim():
        raise ValueError(f"rank mismatch: source {tuple(src.shape)}, dest {tuple(dst.shape)}")
    s_shape = src.shape[:block_dim] + src.shape[block_dim + 1 :]
    d_shape = dst.shape[:block_dim] + dst.shape[block_dim + 1 :]
    if s_shape != d_shape:
        raise ValueError(
            f"block shape mismatch: source {tuple(src.shape)}, destination {tuple(dst.shape)}"
        )
    for name, ids, n in (
        ("source", src_ids, src.shape[block_dim]),
        ("destination", dst_ids, dst.shape[block_dim]),
    ):
        if ids and (min(ids) < 0 or max(ids) >= n):
            raise ValueError(f"{name} block id out of range [0, {n}): {ids}")


def _ids_list(ids: IdList) -> list[int]:
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


def _in_place_pieces(pool: torch.Tensor, ids: list[int], mode: TransferMode) -> list[torch.Tensor]:
    """The views that travel as they are: one ``[L, 2, bs, h, d]`` block each
    (``by_request_aggregated``), or the 2*L ``[bs, h, d]`` pieces of each block of a
    per-layer pool (``by_request``)."""
    if mode is TransferMode.AGGREGATED:
        return [pool[b] for b in ids]
    if mode is not TransferMode.BY_REQUEST:
        raise ValueError(f"{mode.value} blocks do not travel in place")
    layers = range(pool.shape[0])
    return [pool[layer, kv, b] for b in ids for layer in layers for kv in range(2)]


def copy_blocks(
    dst: torch.Tensor,
    src: torch.Tensor,
    src_ids: IdList,
    dst_ids: IdList,
    mode: TransferMode | str = TransferMode.PACKED,
    staging: Staging | None = None,
) -> int:
    """Copy blocks ``src[src_ids]`` into ``dst[dst_ids]`` in ``mode``; returns the call count.

    Aggregated tensors (``[num_blocks, L, 2, ...]``) for every mode but ``by_request``, which
    takes per-layer tensors (``[L, 2, num_blocks, ...]``) and copies each of the 2*L pieces
    of each block on its own. ``packed`` gathers into one buffer and scatters it with one
    call (straight into ``dst`` when ``dst_ids`` is one ascending run).
    """
    mode = TransferMode(mode)
    s_ids, d_ids = _ids_list(src_ids), _ids_list(dst_ids)
    block_dim = 2 if mode is TransferMode.BY_REQUEST else 0
    _check_pair(src, dst, s_ids, d_ids, block_dim)
    if not s_ids:
        return 0
    if mode is TransferMode.AGGREGATED:
        for s, d in zip(s_ids, d_ids):
            dst[d].copy_(src[s])  # one [L, 2, bs, h, d] block
        return len(s_ids)
    if mode is TransferMode.BY_REQUEST:
        num_layers = src.shape[0]
        for s, d in zip(s_ids, d_ids):
            for layer in range(num_layers):
                for kv in range(2):
                    dst[layer, kv, d].copy_(src[layer, kv, s])  # one [bs, h, d] piece
        return 2 * num_layers * len(s_ids)
    if mode is TransferMode.BY_LAYER:
        for layer in range(src.shape[1]):
            copy_layer(dst, src, layer, s_ids, d_ids, staging)
        return src.shape[1]
    staging = staging or Staging()
    s_idx = as_index(s_ids, src.device)
    if is_run(d_ids):
        torch.index_select(src, 0, s_idx, out=dst[d_ids[0] : d_ids[0] + len(d_ids)])
    else:
        packed = staging.get((len(s_ids), *src.shape[1:]), src.dtype, src.device)
        torch.index_select(src, 0, s_idx, out=packed)  # [n, L, 2, bs, h, d]
        dst.index_copy_(0, as_index(d_ids, dst.device), packed.to(dst.device))
    return 1


def copy_layer(
    dst: torch.Tensor,
    src: torch.Tensor,
    layer: int,
    src_ids: IdList,
    dst_ids: IdList,
    staging: Staging | None = None,
) -> None:
    """Copy layer ``layer`` (K and V) of blocks ``src_ids`` into ``dst_ids`` (aggregated pools)."""
    s_ids, d_ids = _ids_list(src_ids), _ids_list(dst_ids)
    _check_pair(src, dst, s_ids, d_ids, 0)
    if not 0 <= layer < src.shape[1]:
        raise ValueError(f"layer {layer} out of range [0, {src.shape[1]})")
    if not s_ids:
        return
    staging = staging or Staging()
    packed = staging.get((len(s_ids), *src.shape[2:]), src.dtype, src.device)
    s_idx = as_index(s_ids, src.device)
    torch.index_select(src[:, layer], 0, s_idx, out=packed)  # [n, 2, bs, h, d]
    dst[:, layer].index_copy_(0, as_index(d_ids, dst.device), packed.to(dst.device))


# --------------------------------------------------------------------------------------------
# transports


class Transport(Protocol):
    """Moves blocks of the sender's pool tensor into blocks the receiver allocated.

    One-sided transports (``one_sided``) finish the write inside ``send_blocks``; two-sided
    ones need the receiver to post the matching receive (see :class:`GlooTransport`).
    """

    kind: TransportKind

    @property
    def one_sided(self) -> bool:
        """True when the receiver does nothing while the data moves."""
        ...

    def send_blocks(self, src: torch.Tensor, src_ids: IdList, dst_ids: IdList) -> None:
        """Send blocks ``src[src_ids]`` into the receiver's ``dst_ids``."""
        ...

    def send_layer(self, src: torch.Tensor, layer: int, src_ids: IdList, dst_ids: IdList) -> None:
        """Send layer ``layer`` (K and V) of blocks ``src_ids`` into the receiver's ``dst_ids``."""
        ...

    def close(self) -> None:
        """Release what the transport holds (mappings, process groups)."""
        ...


class CopyTransport:
    """Same-process transport: writes straight into the receiver's pool tensor.

    ``mode`` picks how :meth:`send_blocks` copies; the default is one copy per aggregated
    block on the CPU (a single pass over memory) and a packed gather/scatter on CUDA (two
    kernels instead of one launch per block).
    """

    kind = TransportKind.COPY

    def __init__(self, dst: torch.Tensor, mode: TransferMode | str | None = None) -> None:
        """Write into ``dst``, the receiver's aggregated pool tensor."""
        if dst.dim() < 2:
            raise ValueError(f"a pool tensor has a block dimension and a block shape: {dst.shape}")
        self.dst = dst
        if mode is None:
            mode = TransferMode.PACKED if dst.is_cuda else TransferMode.AGGREGATED
        self.mode = TransferMode(mode)
        self._staging = Staging()

    @property
    def one_sided(self) -> bool:
        """Always true: the sender does the copy."""
        return True

    def send_blocks(
        self,
        src: torch.Tensor,
        src_ids: IdList,
        dst_ids: IdList,
        mode: TransferMode | str | None = None,
    ) -> int:
        """Copy ``src[src_ids]`` into ``dst[dst_ids]``; returns the number of copy calls."""
        calls = copy_blocks(self.dst, src, src_ids, dst_ids, mode or self.mode, self._staging)
        self._finish()
        return calls

    def send_layer(self, src: torch.Tensor, layer: int, src_ids: IdList, dst_ids: IdList) -> None:
        """Copy one layer of ``src[src_ids]`` into ``dst[dst_ids]``."""
        copy_layer(self.dst, src, layer, src_ids, dst_ids, self._staging)
        self._finish()

    def _finish(self) -> None:
        if self.dst.is_cuda:
            # the peer reads after our "write done" message, so the copy must have landed
            torch.cuda.current_stream(self.dst.device).synchronize()

    def close(self) -> None:
        """Drop the reference to the receiver's tensor."""
        self.dst = None  # type: ignore[assignment]


class SharedMemoryTransport(CopyTransport):
    """Same-host transport: maps the receiver's shared pool tensor and writes it one-sided."""

    def __init__(
        self, handle: SharedHandle | dict[str, Any], mode: TransferMode | str | None = None
    ) -> None:
        """Attach the receiver's pool from its published handle."""
        handle = handle if isinstance(handle, SharedHandle) else SharedHandle.from_dict(handle)
        super().__init__(attach(handle), mode)
        self.handle = handle
        self.kind = TransportKind.CUDA_IPC if handle.kind == "cuda_ipc" else TransportKind.SHM


def pick_free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on ``host`` a moment ago (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_store(
    host: str = LOOPBACK, port: int = 0, world_size: int = 2, timeout_s: float = GLOO_TIMEOUT_S
) -> torch.distributed.TCPStore:
    """Start the rendezvous store (rank 0 does this); ``store.port`` is the port it got."""
    return torch.distributed.TCPStore(
        host,
        port,
        world_size,
        True,
        datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


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
                store = torch.distributed.TCPStore(
                    host, port, 2, rank == 0, timeout, wait_for_workers=False
                )
            except (RuntimeError, TimeoutError) as e:
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
        ids = _ids_list(src_ids)
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
            pieces = _in_place_pieces(src, ids, mode)
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
        ids = _ids_list(dst_ids)
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
            pieces = _in_place_pieces(dst, ids, mode)  # received in place, no staging
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
        ids = _ids_list(dst_ids)
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


def _same_host(local_host: str, peer_host: str) -> bool:
    if local_host == peer_host:
        return True
    return local_host in _LOOPBACK_NAMES and peer_host in _LOOPBACK_NAMES


def choose_transport(
    local_host: str,
    peer_host: str,
    same_process: bool,
    device: str | torch.device = "cpu",
    peer_device: str | torch.device | None = None,
) -> TransportKind:
    """The fastest data path between this instance and a peer.

    Same process -> copy; same host -> shared memory (CPU) or CUDA IPC (both on the same
    GPU); otherwise torch.distributed point-to-point (gloo for CPU, NCCL for CUDA). Hosts
    are compared by name; loopback names count as this host.
    """
    device = torch.device(device)
    peer = torch.device(peer_device) if peer_device is not None else device
    if device.type != peer.type:
        raise ValueError(f"peers keep KV on different device types: {device} and {peer}")
    if same_process:
        return TransportKind.COPY
    if _same_host(local_host, peer_host):
        if device.type == "cpu":
            return TransportKind.SHM
        if (device.index or 0) == (peer.index or 0):
            return TransportKind.CUDA_IPC
        return TransportKind.NCCL
    return TransportKind.NCCL if device.type == "cuda" else TransportKind.GLOO
