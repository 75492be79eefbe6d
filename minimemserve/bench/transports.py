"""The transports ``bench/transfer.py`` compares, beside the runtime's own GlooTransport.

A transfer moves whole aggregated blocks (``[num_blocks, L, 2, block_size, n_kv_heads,
head_dim]`` pool tensors, block dimension first) from a sender's pool into blocks the
receiver has already allocated. Paths, fastest first:

* same process -> :class:`CopyTransport`, a plain tensor copy;
* same host -> :class:`SharedMemoryTransport`: the receiver's pool tensor lives in shared
  memory (:class:`SharedPoolTensor`: a POSIX segment for CPU, CUDA IPC for one GPU) and the
  sender writes into it directly, one-sided;
* different hosts -> :class:`~minimemserve.disagg.transports.GlooTransport`:
  ``torch.distributed`` point-to-point, two-sided.

The runtime picks between shared memory and torch.distributed per pair of instances, by their
hosts' identity (``disagg.launch.pair_transport``)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from minimemserve.blocks.copy import is_run
from minimemserve.disagg.rpc import LOOPBACK
from minimemserve.disagg.transports import (
    GLOO_TIMEOUT_S,
    IdList,
    Staging,
    TransferMode,
    TransportKind,
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
