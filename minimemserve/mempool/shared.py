"""Pool tensors shared with other processes on this host, written one-sided by peers.

CPU: a POSIX shared-memory segment named ``{prefix}-{pid}-{random}`` in ``shm_dir``. CUDA:
a device tensor exported through CUDA IPC (peers on the same GPU map the same memory). The
owner publishes ``SharedPoolTensor.handle.to_dict()`` (plain values, msgpack-able); a peer
maps it with :func:`attach`.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import secrets
import weakref
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from minimemserve.errors import ConfigError, TransferError

# Short on purpose: segment names show up in /dev/shm listings and macOS caps them at 31 chars.
DEFAULT_SHM_PREFIX = "mms"
# Where Linux keeps POSIX shared memory (what shm_open(3) creates files in).
SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class SharedHandle:
    """What a peer needs to map a :class:`SharedPoolTensor`: plain values only.

    ``kind`` is ``"cpu_shm"`` (``name`` is a segment in ``shm_dir``) or ``"cuda_ipc"``
    (``cuda`` holds the IPC handle fields). ``nbytes`` is the size of the whole segment or
    storage the view lives in.
    """

    kind: str
    name: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    storage_offset: int
    dtype: str
    nbytes: int
    shm_dir: str = SHM_DIR
    cuda: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """A dict of plain values (ints, strings, bytes, lists), safe to msgpack."""
        out = asdict(self)
        out["shape"], out["strides"] = list(self.shape), list(self.strides)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SharedHandle:
        """Read a handle back from :meth:`to_dict` output; raises TransferError if malformed."""
        try:
            return cls(
                kind=str(data["kind"]),
                name=str(data["name"]),
                shape=tuple(int(x) for x in data["shape"]),
                strides=tuple(int(x) for x in data["strides"]),
                storage_offset=int(data["storage_offset"]),
                dtype=str(data["dtype"]),
                nbytes=int(data["nbytes"]),
                shm_dir=str(data.get("shm_dir", SHM_DIR)),
                cuda=data.get("cuda"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise TransferError(f"malformed shared-tensor handle: {e!r}") from e


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _map_segment(path: str, nbytes: int, create: bool) -> torch.Tensor:
    """Map a shared segment as a flat uint8 tensor; the mapping lives as long as the tensor."""
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            try:
                # reserve the pages now: writing to an over-committed tmpfs mapping is SIGBUS
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                _unlink_quietly(path)
                raise ConfigError(
                    f"cannot reserve {nbytes / 2**20:.1f} MiB of shared memory at {path}: {e}; "
                    f"lower the pool size or enlarge {os.path.dirname(path)}"
                ) from e
        elif (size := os.fstat(fd).st_size) != nbytes:
            raise TransferError(f"shared segment {path} has {size} bytes, the handle says {nbytes}")
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    # the tensor holds a buffer export of the mmap, so the mapping outlives this frame
    return torch.frombuffer(mm, dtype=torch.uint8)


class SharedPoolTensor:
    """A pool tensor another process on this host can write into, one-sided.

    CPU: the owner unlinks the segment on :meth:`close` (or when garbage collected, or at
    interpreter exit); the memory itself goes away once every mapping, here and in peers,
    is dropped. CUDA: keep the owner alive while peers use it.
    """

    def __init__(self, tensor: torch.Tensor, handle: SharedHandle, path: str | None) -> None:
        """Wrap an already-shared tensor; use :meth:`create` instead."""
        self.tensor = tensor
        self.handle = handle
        self._finalizer = weakref.finalize(self, _unlink_quietly, path) if path else None

    @classmethod
    def create(
        cls,
        shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        prefix: str = DEFAULT_SHM_PREFIX,
        shm_dir: str = SHM_DIR,
    ) -> SharedPoolTensor:
        """Allocate a zero-filled shared tensor of ``shape`` and ``dtype`` on ``device``."""
        shape = tuple(int(s) for s in shape)
        if not shape or any(s <= 0 for s in shape):
            raise ValueError(f"shared tensor shape must be non-empty and positive, got {shape}")
        if not prefix or "/" in prefix:
            raise ValueError(f"shared-memory prefix must be a non-empty name, got {prefix!r}")
        device = torch.device(device)
        if device.type == "cuda":
            tensor = torch.zeros(shape, dtype=dtype, device=device)
            return cls(tensor, _cuda_handle(tensor), None)
        if device.type != "cpu":
            raise ValueError(f"shared pool tensors live on cpu or cuda, not {device}")
        if not os.path.isdir(shm_dir):
            raise ConfigError(f"shared-memory directory {shm_dir} does not exist on this host")
        name = f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"
        path = os.path.join(shm_dir, name)
        nbytes = math.prod(shape) * dtype.itemsize
        tensor = _map_segment(path, nbytes, create=True).view(dtype).view(shape)  # zeroed by tmpfs
        handle = SharedHandle(
            "cpu_shm", name, shape, tensor.stride(), 0, _dtype_name(dtype), nbytes, shm_dir
        )
        return cls(tensor, handle, path)

    @property
    def name(self) -> str:
        """The segment name (CPU) or a label of the IPC handle (CUDA)."""
        return self.handle.name

    def close(self) -> None:
        """Unlink the segment (CPU) and drop this object's tensor reference. Idempotent.

        Mappings still held (here or in peers) stay valid until they are dropped; no new
        peer can attach after this.
        """
        if self._finalizer is not None:
            self._finalizer()
        self.tensor = None  # type: ignore[assignment]

    def __enter__(self) -> SharedPoolTensor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cuda_handle(tensor: torch.Tensor) -> SharedHandle:
    """Export a CUDA tensor through CUDA IPC."""
    _, args = reduce_tensor(tensor)
    _, size, stride, offset, _, dtype, device, ipc, nbytes, offset_bytes, _, *rest = args
    ref, ref_offset, event, event_sync = rest
    cuda = {
        "device": int(device),
        "ipc_handle": bytes(ipc),
        "storage_offset_bytes": int(offset_bytes),
        "ref_counter_handle": bytes(ref),
        "ref_counter_offset": int(ref_offset),
        "event_handle": None if event is None else bytes(event),
        "event_sync_required": bool(event_sync),
    }
    name, dt = f"cuda:{device}:{ipc.hex()[:16]}", _dtype_name(dtype)
    shape, strides = tuple(size), tuple(stride)
    return SharedHandle("cuda_ipc", name, shape, strides, int(offset), dt, int(nbytes), cuda=cuda)


def attach(handle: SharedHandle | dict[str, Any]) -> torch.Tensor:
    """Map a peer's shared pool tensor into this process; returns a writable view of it.

    The mapping lasts as long as the returned tensor (and views of it). Raises
    TransferError if the segment is gone or does not match the handle.
    """
    if isinstance(handle, dict):
        handle = SharedHandle.from_dict(handle)
    dtype = getattr(torch, handle.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise TransferError(f"shared handle names an unknown dtype {handle.dtype!r}")
    if handle.kind == "cpu_shm":
        if "/" in handle.name:
            raise TransferError(f"bad shared segment name {handle.name!r}")
        path = os.path.join(handle.shm_dir, handle.name)
        try:
            flat = _map_segment(path, handle.nbytes, create=False)  # [nbytes] uint8
        except FileNotFoundError as e:
            raise TransferError(f"shared segment {path} does not exist (owner closed?)") from e
        return flat.view(dtype).as_strided(handle.shape, handle.strides, handle.storage_offset)
    if handle.kind != "cuda_ipc":
        raise TransferError(f"unknown shared handle kind {handle.kind!r}")
    if not torch.cuda.is_available():
        raise TransferError("a CUDA IPC handle cannot be attached without CUDA")
    c = handle.cuda or {}
    try:
        return rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size(handle.shape),
            handle.strides,
            handle.storage_offset,
            torch.UntypedStorage,
            dtype,
            c["device"],
            c["ipc_handle"],
            handle.nbytes,
            c["storage_offset_bytes"],
            False,  # requires_grad
            c["ref_counter_handle"],
            c["ref_counter_offset"],
            c["event_handle"],
            c["event_sync_required"],
        )
    except (KeyError, RuntimeError) as e:
        raise TransferError(f"cannot open CUDA IPC handle {handle.name}: {e}") from e
