"""The transfer paths ``bench/transfer.py`` compares, beside the runtime's own GlooTransport.

A transfer moves whole aggregated blocks (``[num_blocks, L, 2, block_size, n_kv_heads,
head_dim]`` pool tensors, block dimension first) from a sender's pool into blocks the
receiver has already allocated. Paths, fastest first:

* same process -> :class:`CopyTransport`, a plain tensor copy;
* same host -> :class:`SharedMemoryTransport`: the receiver's pool tensor lives in shared
  memory (:class:`SharedPoolTensor`: a POSIX segment for CPU, CUDA IPC for one GPU) and the
  sender writes into it directly, one-sided;
* different hosts -> :class:`BenchGlooTransport`: the runtime's
  :class:`~minimemserve.disagg.transports.GlooTransport` (``torch.distributed``
  point-to-point, two-sided), with the ways of cutting a transfer the benchmark compares
  (:class:`TransferMode`) beside the runtime's packed one.

The runtime picks a KV link per pair of instances from its table
(:mod:`minimemserve.links`)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Sequence
from enum import Enum
from typing import Any, Protocol

import torch

from minimemserve.blocks.copy import is_run
from minimemserve.disagg.rpc import LOOPBACK
from minimemserve.disagg.transports import (
    GLOO_TIMEOUT_S,
    GlooTransport,
    IdList,
    Pending,
    Staging,
    as_index,
    ids_list,
)
from minimemserve.mempool.shared import (
    DEFAULT_SHM_PREFIX,
    SHM_DIR,
    SharedHandle,
    SharedPoolTensor,
    attach,
)
from minimemserve.parallel import HostStore


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
    """How a request's blocks are cut into pieces: ``by_layer`` sends each layer's K/V as that
    layer finishes, ``by_request`` the 2*L per-layer pieces of each block (per-layer layout
    ``[L, 2, num_blocks, ...]``), ``by_request_aggregated`` one piece per aggregated block and
    ``packed`` (the runtime's) gathers all blocks into one buffer sent once."""

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
    s_ids, d_ids = ids_list(src_ids), ids_list(dst_ids)
    block_dim = 2 if mode is TransferMode.BY_REQUEST else 0
    _check_pair(src, dst, s_ids, d_ids, block_dim)
    if not s_ids:
        return 0
    return _COPIERS[mode](dst, src, s_ids, d_ids, staging)


def _copy_aggregated(dst, src, s_ids: list[int], d_ids: list[int], staging) -> int:
    for s, d in zip(s_ids, d_ids):
        dst[d].copy_(src[s])  # one [L, 2, bs, h, d] block
    return len(s_ids)


def _copy_by_request(dst, src, s_ids: list[int], d_ids: list[int], staging) -> int:
    num_layers = src.shape[0]
    for s, d in zip(s_ids, d_ids):
        for layer in range(num_layers):
            for kv in range(2):
                dst[layer, kv, d].copy_(src[layer, kv, s])  # one [bs, h, d] piece
    return 2 * num_layers * len(s_ids)


def _copy_by_layer(dst, src, s_ids: list[int], d_ids: list[int], staging) -> int:
    for layer in range(src.shape[1]):
        copy_layer(dst, src, layer, s_ids, d_ids, staging)
    return src.shape[1]


def _copy_packed(dst, src, s_ids: list[int], d_ids: list[int], staging) -> int:
    staging = staging or Staging()
    s_idx = as_index(s_ids, src.device)
    if is_run(d_ids):
        torch.index_select(src, 0, s_idx, out=dst[d_ids[0] : d_ids[0] + len(d_ids)])
    else:
        packed = staging.get((len(s_ids), *src.shape[1:]), src.dtype, src.device)
        torch.index_select(src, 0, s_idx, out=packed)  # [n, L, 2, bs, h, d]
        dst.index_copy_(0, as_index(d_ids, dst.device), packed.to(dst.device))
    return 1


_COPIERS = {
    TransferMode.AGGREGATED: _copy_aggregated,
    TransferMode.BY_REQUEST: _copy_by_request,
    TransferMode.BY_LAYER: _copy_by_layer,
    TransferMode.PACKED: _copy_packed,
}


def copy_layer(
    dst: torch.Tensor,
    src: torch.Tensor,
    layer: int,
    src_ids: IdList,
    dst_ids: IdList,
    staging: Staging | None = None,
) -> None:
    """Copy layer ``layer`` (K and V) of blocks ``src_ids`` into ``dst_ids`` (aggregated pools)."""
    s_ids, d_ids = ids_list(src_ids), ids_list(dst_ids)
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
    host: str = LOOPBACK, port: int = 0, timeout_s: float = GLOO_TIMEOUT_S
) -> torch.distributed.TCPStore:
    """Start the rendezvous store (rank 0 does this), listening on ``host`` only;
    ``store.port`` is the port it got."""
    return HostStore(host, timeout_s, port).store


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


def _contiguous(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    if any(not p.is_contiguous() for p in pieces):
        raise ValueError("point-to-point pieces must be contiguous: pass a contiguous pool tensor")
    return pieces


class BenchGlooTransport(GlooTransport):
    """The runtime's two-rank transport with every :class:`TransferMode`, one layer at a time
    (:meth:`send_layer`) and plain tensors (acknowledgements), for ``bench/transfer.py``.

    ``send_blocks(src, src_ids, mode=...)`` pairs with ``recv_blocks(dst, dst_ids, mode)``
    of the same mode and number of blocks; ``by_request`` takes per-layer pools
    (``[L, 2, num_blocks, ...]``), the other modes aggregated ones."""

    @property
    def one_sided(self) -> bool:
        """Always false: the receiver posts matching receives."""
        return False

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
        """Send ``src[src_ids]`` cut as ``mode`` says (``dst_ids`` is the receiver's business)."""
        mode = TransferMode(mode)
        if mode is TransferMode.PACKED:
            return super().send_blocks(src, src_ids, tag=tag, wait=wait, staging=staging)
        self._check(src)
        ids = ids_list(src_ids)
        if mode is TransferMode.BY_LAYER:
            num_layers = src.shape[1]
            shape = (num_layers, len(ids), *src.shape[2:])  # [L, n, 2, bs, h, d]
            buf = staging.get(shape, src.dtype, src.device) if staging else src.new_empty(shape)
            idx = as_index(ids, src.device)
            for layer in range(num_layers):
                torch.index_select(src[:, layer], 0, idx, out=buf[layer])
            pieces = list(buf)
        else:
            pieces = _contiguous(in_place_pieces(src, ids, mode))
        return self._posted(pieces, True, tag, None, f"send {mode.value}", wait)

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
        """Receive into ``dst[dst_ids]`` what the peer sends with ``send_blocks`` in ``mode``:
        ``by_request_aggregated`` and ``by_request`` land in place, ``by_layer`` in a buffer
        (``staging``, or a fresh one) scattered by ``wait``."""
        mode = TransferMode(mode)
        if mode is TransferMode.PACKED:
            return super().recv_blocks(dst, dst_ids, tag=tag, wait=wait, staging=staging)
        self._check(dst)
        ids = ids_list(dst_ids)
        finish = None
        if mode is TransferMode.BY_LAYER:
            num_layers = dst.shape[1]
            shape = (num_layers, len(ids), *dst.shape[2:])  # [L, n, 2, bs, h, d]
            buf = staging.get(shape, dst.dtype, dst.device) if staging else dst.new_empty(shape)
            idx = as_index(ids, dst.device)
            pieces = list(buf)

            def finish() -> None:
                for layer in range(num_layers):
                    dst[:, layer].index_copy_(0, idx, buf[layer])

        else:
            pieces = _contiguous(in_place_pieces(dst, ids, mode))  # in place, no staging
        return self._posted(pieces, False, tag, finish, f"receive {mode.value}", wait)

    def send_layer(
        self, src: torch.Tensor, layer: int, src_ids: IdList, *, tag: int = 0, wait: bool = True
    ) -> Pending:
        """Send K and V of ``layer`` for blocks ``src_ids`` (aggregated pool) as one piece."""
        self._check(src)
        piece = torch.index_select(src[:, layer], 0, as_index(src_ids, src.device))  # [n, 2, ...]
        return self._posted([piece], True, tag, None, f"send layer {layer}", wait)

    def recv_layer(
        self, dst: torch.Tensor, layer: int, dst_ids: IdList, *, tag: int = 0, wait: bool = True
    ) -> Pending:
        """Receive one layer sent by :meth:`send_layer` into blocks ``dst_ids``."""
        self._check(dst)
        ids = ids_list(dst_ids)
        piece = torch.empty((len(ids), *dst.shape[2:]), dtype=dst.dtype, device=dst.device)
        idx = as_index(ids, dst.device)

        def finish() -> None:
            dst[:, layer].index_copy_(0, idx, piece)

        return self._posted([piece], False, tag, finish, f"receive layer {layer}", wait)

    def send_tensor(self, t: torch.Tensor, tag: int = 0) -> None:
        """Send one contiguous tensor (small signals, acknowledgements)."""
        self._posted([t], True, tag, None, "send", True)

    def recv_tensor(self, t: torch.Tensor, tag: int = 0) -> None:
        """Receive one contiguous tensor into ``t``."""
        self._posted([t], False, tag, None, "receive", True)

    def _posted(self, pieces, send: bool, tag: int, finish, what: str, wait: bool) -> Pending:
        way = "to" if send else "from"
        what = f"{what} {way} rank {self.peer}"
        result = Pending(self._post(pieces, send, tag), finish, self.timeout_s, what)
        if wait:
            result.wait()
        return result
