"""KV over NIXL: one-sided writes into the blocks a peer granted, on the transfer library of
the field (UCX underneath: cross-memory attach within a host, TCP, RDMA or NVLink, picked per
pair of agents).

Each instance that moves KV over NIXL has one agent (:class:`NixlEndpoint`) that registers its
pool's tiers once, HBM and DRAM, and publishes its metadata and the region peers write into
(:class:`NixlInfo`, the link's data in ``Ready``: bytes only this module reads); the frontend
hands it on to the instance's NIXL peers in ``Peers``, over the authenticated control plane, so
no other store or port is opened. A transfer maps one to one onto MemPool's: the receiver
grants blocks (``AllocRequest``), the sender posts one WRITE with one descriptor per aggregated
block, from the tier that holds each block (no onload first), into those blocks, waits for it
to complete and commits; the WRITE carries a notification (transfer id and block count) that
the receiver must have before it commits, so a partial write is never kept. A failed or late
write frees both sides.

A tensor-parallel instance's own tensor holds one rank's heads, so its agent registers a
whole-model landing tensor indexed by the same block ids: peers write there and rank 0 moves
each head to its rank on commit; what it sends is gathered from its ranks into a registered
staging tensor first (one agent per instance, not per rank).

What NIXL does not protect: the data plane is neither authenticated nor encrypted, and a peer
holding an agent's metadata can write any memory that agent registered (NIXL confines writes
to registered regions, not to granted blocks). The control plane checks what a peer commits;
it cannot stop a faulty peer from writing blocks it was not granted."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
import torch

from ..errors import ConfigError, TransferError
from ..mempool import MemPool
from . import rpc

POLL_S = 0.0002  # how often a sender asks NIXL about its write in progress
# How often an agent's thread drives UCX's progress: a receiver's share of a write over TCP
# and every notification wait for it (measured idle cost: about 5 % of a core per agent).
PROGRESS_S = 0.001
MAX_NOTIFS = 4096  # notifications (and transfers they name) kept per peer agent
NOTIF_SEP = "|"  # a notification is "<transfer id>|<blocks written>"
logger = logging.getLogger(__name__)

MAX_NIXL_METADATA = 1 << 20  # an agent's metadata is ~0.5 KiB on one host; a few per NIC


class NixlInfo(msgspec.Struct, forbid_unknown_fields=True):
    """An instance's NIXL agent as its peers learn it: the agent's name and metadata (loaded
    by each peer that writes into it), and the region peers write into: ``num_blocks`` blocks
    of ``block_bytes`` each (whole-model layout) from ``address``, in ``memory`` ("DRAM" or
    "VRAM") of device ``device_id``."""

    agent: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    metadata: Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_NIXL_METADATA)]
    address: Annotated[int, msgspec.Meta(gt=0, le=(1 << 63) - 1)]
    block_bytes: Annotated[int, msgspec.Meta(gt=0)]
    num_blocks: Annotated[int, msgspec.Meta(gt=0)]
    memory: Literal["DRAM", "VRAM"]
    device_id: Annotated[int, msgspec.Meta(ge=0)] = 0


def nixl_missing() -> str | None:
    """Why this process cannot move KV over NIXL (the ``nixl`` extra is not installed or does
    not load), or None when it can."""
    try:
        importlib.import_module("nixl._api")
    except Exception as e:  # an ImportError, or the native library failing to load
        return f"nixl does not load here ({type(e).__name__}: {e}); install the nixl extra"
    return None


def _memory(t: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type and device id of tensor ``t``."""
    return ("VRAM", t.get_device()) if t.is_cuda else ("DRAM", 0)


def _name(agent: Any) -> str:
    """An agent's name as NIXL returns it (bytes or str) as text."""
    return agent.decode(errors="replace") if isinstance(agent, bytes) else str(agent)


def descs(addresses: np.ndarray, length: int, device_id: int) -> np.ndarray:
    """NIXL descriptors (address, length, device), one per address in ``addresses``."""
    out = np.empty((len(addresses), 3), dtype=np.uint64)
    out[:, 0] = addresses
    out[:, 1] = length
    out[:, 2] = device_id
    return out


class Agent:
    """One NIXL agent as this project uses it: the UCX backend, no listening socket (metadata
    travels over the control plane), and a thread of ours that drives UCX's progress every
    :data:`PROGRESS_S` and keeps the notifications it brings. (NIXL's own progress thread
    spins: a whole core per agent, idle or not.) It registers tensors, loads peers' metadata,
    posts WRITEs of descriptor lists and waits for them."""

    def __init__(self, name: str) -> None:
        """Create agent ``name`` (the nixl extra is imported here, on first use)."""
        api = importlib.import_module("nixl._api")
        log = logging.getLogger("nixl")  # NIXL prints INFO lines to stdout on import: instead,
        log.handlers.clear()  # its warnings and errors join this process's own logging
        log.setLevel(logging.WARNING)
        log.propagate = True
        config = api.nixl_agent_config(
            enable_prog_thread=False,
            backends=["UCX"],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,  # two threads call it
        )
        self.nixl = api.nixl_agent(name, config)
        self.name = name
        self._regs: dict[int, Any] = {}  # data_ptr -> registration
        self._notifs: dict[str, list[bytes]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._progress, name=f"nixl-{name}", daemon=True)
        self._pump.start()
        # stopped before the interpreter ends: a daemon thread still inside NIXL when its
        # native destructors run aborts the process ("terminate called")
        atexit.register(self.close)

    def _progress(self) -> None:
        """Until closed: let UCX progress (peers' writes over TCP land only then) and keep
        the notifications that arrived."""
        while not self._stop.wait(PROGRESS_S):
            self._progress_once()

    def _progress_once(self) -> None:
        """One turn of UCX's progress; keeps the notifications it brought."""
        try:
            new = self.nixl.get_new_notifs()
        except Exception as e:  # a broken peer connection: keep serving the others
            logger.warning("NIXL agent %s: progress failed: %s", self.name, e)
            return
        with self._lock:
            for agent, msgs in new.items():
                kept = self._notifs.setdefault(_name(agent), [])
                kept.extend(bytes(m) for m in msgs)
                del kept[:-MAX_NOTIFS]  # a peer that floods loses its oldest, not our memory

    def register(self, t: torch.Tensor) -> None:
        """Register contiguous tensor ``t`` (once) for transfers from or into it."""
        if t.data_ptr() not in self._regs:
            self._regs[t.data_ptr()] = self.nixl.register_memory(t)

    def deregister(self, t: torch.Tensor) -> None:
        """Undo :meth:`register`."""
        if (reg := self._regs.pop(t.data_ptr(), None)) is not None:
            self.nixl.deregister_memory(reg)

    def registered(self, t: torch.Tensor) -> bool:
        """Whether ``t`` starts a registered region."""
        return t.data_ptr() in self._regs

    def metadata(self) -> bytes:
        """What a peer loads to write into this agent's registered memory."""
        return self.nixl.get_agent_metadata()

    def load(self, metadata: bytes) -> Any:
        """Load a peer's metadata; returns its agent as NIXL names it."""
        try:
            return self.nixl.add_remote_agent(metadata)
        except Exception as e:  # NIXL raises its own error types for malformed metadata
            raise TransferError(f"NIXL metadata does not load: {e}") from e

    def unload(self, agent: Any) -> None:
        """Forget a peer's agent (best effort)."""
        with contextlib.suppress(Exception):
            self.nixl.remove_remote_agent(agent)

    def post(
        self, agent: Any, local, local_memory: str, remote, remote_memory: str, notif: bytes
    ) -> Any:
        """Start one WRITE of descriptors ``local`` into ``remote`` of ``agent`` (arrays of
        :func:`descs`), notifying it with ``notif`` once all arrived; returns its handle."""
        a, handle = self.nixl, None
        try:
            src = a.get_xfer_descs(local, local_memory)
            dst = a.get_xfer_descs(remote, remote_memory)
            handle = a.initialize_xfer("WRITE", src, dst, agent, notif)
            if a.transfer(handle) == "ERR":
                raise TransferError("posting failed")
        except Exception as e:  # NIXL's errors: peer gone, descriptors refused
            if handle is not None:
                self._release(handle)
            raise TransferError(f"NIXL write to {_name(agent)} failed: {e}") from e
        return handle

    def wait(self, handles: list, timeout_s: float, what: str) -> None:
        """Wait until every posted WRITE is done, then release them; raises TransferError
        when one fails or ``timeout_s`` passes first."""
        deadline, state = time.monotonic() + timeout_s, "DONE"
        try:
            for h in handles:
                while (state := self.nixl.check_xfer_state(h)) == "PROC":
                    if time.monotonic() > deadline:
                        break
                    time.sleep(POLL_S)
                if state != "DONE":
                    break
        except Exception as e:
            raise TransferError(f"{what} failed: {e}") from e
        finally:
            for h in handles:
                self._release(h)
        if state != "DONE":
            late = "did not finish in time" if state == "PROC" else "failed"
            raise TransferError(f"{what} {late}")

    def _release(self, handle: Any) -> None:
        with contextlib.suppress(Exception):
            self.nixl.release_xfer_handle(handle)

    def notifs(self) -> dict[str, list[bytes]]:
        """Notifications that arrived since the last call, by sending agent's name (UCX
        progresses first: a waiting receiver need not wait for the thread's next turn)."""
        self._progress_once()
        with self._lock:
            out, self._notifs = self._notifs, {}
        return out

    def close(self) -> None:
        """Stop the progress thread and deregister everything. Idempotent."""
        atexit.unregister(self.close)
        self._stop.set()
        if self._pump.is_alive() and self._pump is not threading.current_thread():
            self._pump.join()
        for reg in self._regs.values():
            with contextlib.suppress(Exception):
                self.nixl.deregister_memory(reg)
        self._regs.clear()


class NixlEndpoint:
    """This instance's NIXL agent over ``pool``: registers its tiers (or, tensor-parallel, a
    whole-model landing tensor) once; :meth:`connect` makes a :class:`NixlLink` to a peer from
    its ``NixlInfo``. ``timeout_s`` bounds every wait for a write or its notification."""

    def __init__(self, name: str, pool: MemPool, timeout_s: float) -> None:
        """Create the agent ``name`` and register the pool's memory."""
        self.agent = Agent(name)
        self.name = name
        self.pool = pool
        self.timeout_s = timeout_s
        self.block_bytes = pool.model_layout.block_bytes(pool.dtype.itemsize)
        whole = pool.layout == pool.model_layout
        shape = pool.model_layout.pool_shape(pool.capacity())
        self.landing = None if whole else torch.zeros(shape, dtype=pool.dtype, device=pool.device)
        self.target = pool.kv() if whole else self.landing
        self.staging: torch.Tensor | None = None  # for blocks sent from unregistered tensors
        for t in [self.target, *([pool.kv(tier) for tier in pool.tiers] if whole else [])]:
            self.agent.register(t)
        self._written: dict[str, OrderedDict[str, int]] = {}  # agent -> transfer -> blocks

    def info(self) -> NixlInfo:
        """What peers need to write into this instance."""
        memory, device = _memory(self.target)
        return NixlInfo(
            self.name,
            self.agent.metadata(),
            self.target.data_ptr(),
            self.block_bytes,
            self.target.shape[0],
            memory,
            device,
        )

    def offer(self) -> bytes:
        """The link's data peers are told (:meth:`info`, packed)."""
        return msgspec.msgpack.encode(self.info())

    def connect(self, peer: str, info: NixlInfo) -> NixlLink:
        """Load peer ``peer``'s agent, after checking its region fits this pool's blocks."""
        if info.block_bytes != self.block_bytes:
            raise TransferError(
                f"{peer}'s NIXL blocks are {info.block_bytes} bytes, this pool's "
                f"{self.block_bytes}: the two models or dtypes differ"
            )
        if info.agent in self._written or info.agent == self.name:
            raise TransferError(f"{peer} claims NIXL agent {info.agent!r}, which is not new here")
        try:
            agent = self.agent.load(info.metadata)
        except TransferError as e:
            raise TransferError(f"{peer}'s {e}") from e
        name = _name(agent)
        if name != info.agent:
            if name not in self._written and name != self.name:  # never another peer's agent
                self.agent.unload(agent)
            raise TransferError(f"{peer}'s NIXL metadata names agent {name!r}, not {info.agent!r}")
        self._written[name] = OrderedDict()
        return NixlLink(self, peer, agent, info)

    def source_rows(self, src: torch.Tensor, src_ids: Sequence[int]) -> tuple[np.ndarray, int]:
        """Addresses of blocks ``src_ids`` of ``src`` in registered memory (copied into the
        staging tensor first when ``src`` is not registered), and their device id."""
        ids = np.asarray(list(src_ids), dtype=np.int64)
        if not self.agent.registered(src) or not src.is_contiguous():
            staging = self._staging_for(src, len(ids))
            torch.index_select(src, 0, torch.from_numpy(ids).to(src.device), out=staging)
            if staging.is_cuda:  # the gather must have landed before NIXL reads it
                torch.cuda.current_stream(staging.device).synchronize()
            src, ids = staging, np.arange(len(ids))
        stride = src[0].nbytes
        return src.data_ptr() + ids.astype(np.uint64) * np.uint64(stride), _memory(src)[1]

    def _staging_for(self, like: torch.Tensor, n: int) -> torch.Tensor:
        """``n`` blocks of registered staging memory shaped as ``like``'s (grown on demand)."""
        st = self.staging
        fits = st is not None and st.shape[0] >= n and st.shape[1:] == like.shape[1:]
        if not fits or st.device != like.device or st.dtype != like.dtype:
            if st is not None:
                self.agent.deregister(st)
            shape = (n, *like.shape[1:])
            st = self.staging = torch.empty(shape, dtype=like.dtype, device=like.device)
            self.agent.register(st)
        return st[:n]

    def write(
        self,
        agent: Any,
        info: NixlInfo,
        rows: np.ndarray,
        blocks: list[int],
        memory: str,
        device_id: int,
        notif: bytes,
    ) -> None:
        """One WRITE of ``rows`` (local block addresses) into ``blocks`` of ``info``'s region;
        returns once NIXL reports it done, or raises TransferError (failed, or late)."""
        if any(not 0 <= b < info.num_blocks for b in blocks):
            raise TransferError(f"blocks {blocks} are outside {info.agent}'s region")
        remote = info.address + np.asarray(blocks, dtype=np.uint64) * np.uint64(info.block_bytes)
        local = descs(rows, self.block_bytes, device_id)
        dst = descs(remote, self.block_bytes, info.device_id)
        handle = self.agent.post(agent, local, memory, dst, info.memory, notif)
        what = f"NIXL write of {len(blocks)} blocks to {info.agent}"
        self.agent.wait([handle], self.timeout_s, what)

    def _collect(self) -> None:
        """Move new notifications into what each known peer agent wrote, per transfer."""
        for agent, msgs in self.agent.notifs().items():
            if (written := self._written.get(agent)) is None:
                continue  # not a peer of this instance (any more)
            for msg in msgs:
                xfer, _, count = msg.decode(errors="replace").rpartition(NOTIF_SEP)
                if xfer and count.isascii() and count.isdigit():  # a peer's bytes: checked
                    written[xfer] = written.get(xfer, 0) + int(count)
                    written.move_to_end(xfer)
            while len(written) > MAX_NOTIFS:
                written.popitem(last=False)

    def wait_written(self, agent: str, xfer: str, blocks: int) -> None:
        """Wait until peer ``agent`` notified writes of ``blocks`` blocks for ``xfer``."""
        deadline = time.monotonic() + self.timeout_s
        written = self._written.get(agent)
        while True:
            self._collect()
            got = written.get(xfer, 0) if written is not None else 0
            if got == blocks:
                written.pop(xfer, None)
                return
            if got > blocks:
                raise ValueError(f"{agent} notified {got} blocks written for {xfer}, not {blocks}")
            if time.monotonic() > deadline:
                raise TransferError(f"{agent} wrote {got} of {blocks} blocks of {xfer} in time")
            time.sleep(POLL_S)

    def forget(self, agent: str, xfer: str) -> None:
        """Transfer ``xfer`` from ``agent`` is off: drop what it notified."""
        self._collect()
        if (written := self._written.get(agent)) is not None:
            written.pop(xfer, None)

    def drop(self, agent: Any) -> None:
        """A peer's agent is gone: unload it."""
        self._written.pop(_name(agent), None)
        self.agent.unload(agent)

    def close(self) -> None:
        """Deregister the memory; nothing more moves. Idempotent."""
        self.agent.close()
        self._written.clear()


class NixlLink:
    """A peer reached over NIXL (a KV link, :mod:`~.links`): writes into its granted blocks,
    waits for its writes into ours before a commit, and counts both. Both instances need an
    agent (:class:`NixlEndpoint`); peers learn one from its ``NixlInfo``."""

    kind = name = "nixl"
    shares_pool = False
    whole_model = True  # a tensor-parallel pool lands whole in its landing tensor
    devices = ("cpu", "cuda")
    meets_in_store = False

    def __init__(self, endpoint: NixlEndpoint, peer: str, agent: Any, info: NixlInfo):
        """``agent``: the peer's agent as NIXL names it; ``info``: its region."""
        self.endpoint = endpoint
        self.peer = peer
        self.agent = agent
        self.info = info
        self.sent_bytes = 0
        self.recv_bytes = 0
        self.sent_messages = 0
        self.recv_messages = 0
        self.closed = False

    @classmethod
    def unfit(cls, a: Any, b: Any) -> str | None:
        """Both instances need a NIXL agent."""
        if cls.name in a.links and cls.name in b.links:
            return None
        lacks = a.name if cls.name not in a.links else b.name
        return f"{lacks} has no NIXL agent for the nixl KV transport"

    @classmethod
    def endpoint(cls, spec: Any, pool: MemPool) -> NixlEndpoint | None:
        """This instance's NIXL agent over ``pool``: when it asks for NIXL (which must then
        load here), or under "auto" (a standalone instance: peers may be on other hosts) when
        NIXL loads and peers move KV into its pool; else None."""
        missing = nixl_missing()
        if missing is not None and spec.transport == cls.name:
            raise ConfigError(f"{spec.name} asks for the nixl KV transport, but {missing}")
        if missing is not None or not spec.linked:
            return None
        agent = f"{spec.name}-{os.getpid()}-{secrets.token_hex(4)}"  # unique across restarts
        return NixlEndpoint(agent, pool, spec.timeout_s)

    @classmethod
    def reach(cls, peers: Any, p: rpc.PeerInfo) -> None:
        """Load ``p``'s agent into this instance's, or tell ``peers.on_down`` why it cannot be."""
        ours, data = peers.endpoints.get(cls.name), p.links.get(cls.name)
        if ours is None or data is None:
            side = peers.name if ours is None else p.name
            peers.on_down(p.name, f"no NIXL link: {side} has no NIXL agent")
            return
        try:
            info = msgspec.msgpack.decode(data, type=NixlInfo)
            link = ours.connect(p.name, info)
        except (msgspec.DecodeError, TransferError) as e:
            peers.on_down(p.name, f"no NIXL link: {e}")
            return
        peers.add(p, link)

    def stats(self) -> dict[str, int | str]:
        """Bytes and writes each way, and the backend."""
        return {
            "transport": self.kind,
            "sent_bytes": self.sent_bytes,
            "recv_bytes": self.recv_bytes,
            "sent_messages": self.sent_messages,
            "recv_messages": self.recv_messages,
        }

    def write(self, node: rpc.RpcNode, xfer: str, blocks: list[int], src, src_ids) -> None:
        """Write blocks ``src_ids`` of ``src`` into the peer's ``blocks``: one WRITE, one
        descriptor per block, notifying the peer of transfer ``xfer`` (``node`` is not used:
        nothing of the data goes over the control plane)."""
        if self.closed:
            raise TransferError(f"the NIXL link with {self.peer} is closed")
        rows, device_id = self.endpoint.source_rows(src, src_ids)
        memory = _memory(src)[0]
        notif = f"{xfer}{NOTIF_SEP}{len(blocks)}".encode()
        self.endpoint.write(self.agent, self.info, rows, blocks, memory, device_id, notif)
        self.sent_bytes += len(blocks) * self.endpoint.block_bytes
        self.sent_messages += 1

    def receive(self, pool: MemPool, m: rpc.KVData) -> None:
        """KV from this peer never comes as KVData."""
        raise ValueError(f"{self.peer}'s KV arrives over NIXL, not in KVData")

    def await_landing(self, xfer: str, new: list[int]) -> None:
        """Before a commit: the peer's writes into ``new`` (the blocks of ``xfer`` it did not
        find cached here) have all arrived; a tensor-parallel pool then takes them from the
        landing tensor to its ranks."""
        if not new:
            return
        ep = self.endpoint
        ep.wait_written(self.info.agent, xfer, len(new))
        if ep.landing is not None:
            ep.pool.recv_copy(new, ep.landing, new)
        self.recv_bytes += len(new) * ep.block_bytes
        self.recv_messages += 1

    def forget(self, xfer: str) -> None:
        """Transfer ``xfer`` from this peer was aborted."""
        self.endpoint.forget(self.info.agent, xfer)

    def close(self) -> None:
        """Nothing more moves over this link (its counters stay). Idempotent."""
        if not self.closed:
            self.closed = True
            self.endpoint.drop(self.agent)
