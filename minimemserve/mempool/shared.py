"""Pool tensors that peers on this host write into one-sided: a POSIX shared-memory segment
``{prefix}-{pid}-{random}`` in ``shm_dir`` (CPU) or CUDA IPC (one GPU). The owner publishes
``handle.to_dict()`` (plain values, msgpack-able); a peer maps it with :func:`attach`."""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import re
import secrets
import weakref
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from minimemserve.errors import ConfigError, TransferError

DEFAULT_SHM_PREFIX = "mms"  # short: segment names show up in listings; macOS caps them at 31
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory (shm_open(3))
_SEGMENT_NAME = re.compile(rf"{DEFAULT_SHM_PREFIX}-\d+-[0-9a-f]{{8}}")  # see create()


@dataclass(frozen=True)
class SharedHandle:
    """What a peer needs to map a :class:`SharedPoolTensor`, in plain values: ``kind`` is
    ``"cpu_shm"`` (``name`` is a segment in ``shm_dir``) or ``"cuda_ipc"`` (``cuda`` holds
    the IPC fields); ``nbytes`` is the size of the segment or storage the view lives in."""

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
        return asdict(self) | {"shape": list(self.shape), "strides": list(self.strides)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SharedHandle:
        """Read a handle back from :meth:`to_dict` output; raises TransferError if malformed."""
        try:
            shape, strides = (tuple(int(x) for x in data[k]) for k in ("shape", "strides"))
            kind, name, dtype = (str(data[k]) for k in ("kind", "name", "dtype"))
            offset, nbytes = int(data["storage_offset"]), int(data["nbytes"])
            shm_dir, cuda = str(data.get("shm_dir", SHM_DIR)), data.get("cuda")
            return cls(kind, name, shape, strides, offset, dtype, nbytes, shm_dir, cuda)
        except (KeyError, TypeError, ValueError) as e:
            raise TransferError(f"malformed shared-tensor handle: {e!r}") from e


def segment_path(handle: dict[str, Any] | SharedHandle) -> str | None:
    """The path of a CPU segment handle (None for CUDA IPC), accepted only in the project's
    own namespace (``SHM_DIR``, a default-prefix name as made here); raises TransferError."""
    h = SharedHandle.from_dict(handle) if isinstance(handle, dict) else handle
    if h.kind == "cuda_ipc":
        return None
    if h.kind != "cpu_shm" or h.shm_dir != SHM_DIR or not _SEGMENT_NAME.fullmatch(h.name):
        raise TransferError(f"refusing shared segment {h.shm_dir!r}/{h.name!r} ({h.kind})")
    return os.path.join(SHM_DIR, h.name)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _map_segment(path: str, nbytes: int, create: bool) -> torch.Tensor:
    """Map a shared segment as a flat uint8 tensor, which keeps the mapping alive."""
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            try:  # reserve the pages now: writing to an over-committed tmpfs mapping is SIGBUS
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
    return torch.frombuffer(mm, dtype=torch.uint8)


class SharedPoolTensor:
    """A pool tensor another process on this host can write into, one-sided. CPU: the owner unlinks
    the segment on :meth:`close`, garbage collection or exit; the memory goes once every mapping is
    dropped. CUDA: keep the owner alive while peers use it."""

    def __init__(self, tensor: torch.Tensor, handle: SharedHandle, path: str | None) -> None:
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
        dt = str(dtype).removeprefix("torch.")
        handle = SharedHandle("cpu_shm", name, shape, tensor.stride(), 0, dt, nbytes, shm_dir)
        return cls(tensor, handle, path)

    @property
    def name(self) -> str:
        """The segment name (CPU) or a label of the IPC handle (CUDA)."""
        return self.handle.name

    def close(self) -> None:
        """Unlink the segment (mappings stay valid; no peer can attach) and drop the tensor."""
        if self._finalizer is not None:
            self._finalizer()
        self.tensor = None  # type: ignore[assignment]

    def __enter__(self) -> SharedPoolTensor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cuda_handle(tensor: torch.Tensor) -> SharedHandle:
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
    name, dt = f"cuda:{device}:{ipc.hex()[:16]}", str(dtype).removeprefix("torch.")
    shape, strides = tuple(size), tuple(stride)
    return SharedHandle("cuda_ipc", name, shape, strides, int(offset), dt, int(nbytes), cuda=cuda)


def attach(handle: SharedHandle | dict[str, Any]) -> torch.Tensor:
    """Map a peer's shared pool tensor here: a writable view that keeps the mapping alive.
    Raises TransferError if the segment is gone or does not match the handle."""
    h = SharedHandle.from_dict(handle) if isinstance(handle, dict) else handle
    dtype = getattr(torch, h.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise TransferError(f"shared handle names an unknown dtype {h.dtype!r}")
    if h.kind == "cpu_shm":
        if "/" in h.name:
            raise TransferError(f"bad shared segment name {h.name!r}")
        path = os.path.join(h.shm_dir, h.name)
        try:
            flat = _map_segment(path, h.nbytes, create=False)  # [nbytes] uint8
        except FileNotFoundError as e:
            raise TransferError(f"shared segment {path} does not exist (owner closed?)") from e
        return flat.view(dtype).as_strided(h.shape, h.strides, h.storage_offset)
    if h.kind != "cuda_ipc":
        raise TransferError(f"unknown shared handle kind {h.kind!r}")
    if not torch.cuda.is_available():
        raise TransferError("a CUDA IPC handle cannot be attached without CUDA")
    c = h.cuda or {}
    try:  # the arguments reduce_tensor gave, in order (False: requires_grad)
        args = (torch.Tensor, torch.Size(h.shape), h.strides, h.storage_offset)
        args += (torch.UntypedStorage, dtype, c["device"], c["ipc_handle"], h.nbytes)
        args += (c["storage_offset_bytes"], False, c["ref_counter_handle"], c["ref_counter_offset"])
        return rebuild_cuda_tensor(*args, c["event_handle"], c["event_sync_required"])
    except (KeyError, RuntimeError) as e:
        raise TransferError(f"cannot open CUDA IPC handle {h.name}: {e}") from e
