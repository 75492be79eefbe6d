"""KV transfer micro-benchmark: moving one request's KV from a prefill (P) to a decode (D) pool.

P is this process; D is a second process (spawned) that owns the receiving pools and
answers on the runtime's control plane (``minimemserve.disagg.rpc``: ZeroMQ + msgpack, with
the benchmark's own messages added to the codec). For every transport available here and
every transfer mode, the same blocks go from P's pool to D's pool, at low load (1 transfer
at a time) and high load (16 transfers at once), and the result is checked bit for bit in D.

Transports:
  copy  same process: P copies into a pool of its own (the in-process path).
  shm   same host: D's pools live in shared memory; P maps them and writes one-sided, then
        tells D with the runtime's Commit request (the timing includes that round trip).
  gloo  torch.distributed point-to-point between P and D (two-sided; the timing ends when
        D has scattered the data and its 1-element acknowledgement reached P).
  nixl  NIXL (UCX) one-sided WRITEs from P's registered pool into D's registered pools, one
        descriptor per piece; the timing ends when every WRITE is done and D, on P's Commit,
        has the notification of each (the runtime's path). Skipped, with the reason, where
        the nixl extra does not load. Descriptors per transfer of n blocks: by_layer n*L (L
        WRITEs, one per layer, as layers finish), by_request 2*L*n (per-layer pools),
        by_request_aggregated n; packed does not apply (NIXL gathers and scatters itself).

Modes: by_layer (L sends: each layer's K/V of all blocks, as a layer finishes prefill),
by_request (2*L sends per block from a per-layer layout pool [L, 2, N, ...]),
by_request_aggregated (one send per aggregated block), packed (gather into one buffer,
one send). When D's blocks for a request are one ascending run, that buffer is the run
itself and the data lands in one pass; otherwise packed is a gather and a scatter.

High load: copy and shm run the 16 transfers in 16 threads (torch copies release the
GIL); gloo posts all 16 transfers back-to-back without waiting (async isend/irecv, one tag
each), then waits for all. P's block ids are random and disjoint (a pool after some churn).
D's are what its allocator hands out (``--dst-ids alloc``: a free list scrambled by churn,
asked for one run per request, as MemPool.recv_alloc does) or random (``--dst-ids random``:
a fragmented pool with no free run, the worst case for packed).

Across hosts (``--netns``, root only): gloo and nixl (shm and copy cannot leave the host),
once on loopback and once with D in a fresh network namespace joined to this one by a veth
pair (P at 10.232.X.1, D at 10.232.X.2), side by side. UCX is kept to TCP there
(``UCX_TLS=tcp,self``), as between hosts: on one kernel it would otherwise find cross-memory
attach between the namespaces. The control plane then runs off loopback, so both nodes use a
fresh cluster key's CURVE pair. The namespace and the veth pair are
removed on exit, also after an error, Ctrl-C or SIGTERM.

    python bench/transfer.py                       # tiny geometry, 2048 tokens, fp32
    python bench/transfer.py --layers 32 --kv-heads 32 --head-dim 128 --tokens 1024 --dtype fp16
    python bench/transfer.py --transports nixl,shm --modes by_layer,by_request_aggregated
    sudo python bench/transfer.py --netns          # gloo, nixl: loopback vs veth

Prints a table and writes bench/results/transfer.json (transfer_netns.json with --netns).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import math
import multiprocessing as mp
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec
import numpy as np
import torch
from tqdm.auto import tqdm

from minimemserve.blocks.allocator import BlockAllocator
from minimemserve.blocks.copy import is_run
from minimemserve.blocks.layout import KVLayout
from minimemserve.disagg import rpc
from minimemserve.disagg.nixl import POLL_S, Agent, descs, nixl_missing
from minimemserve.disagg.transports import Staging
from minimemserve.errors import TransferError
from minimemserve.mempool.shared import SharedPoolTensor
from minimemserve_lab.harness.transfer_paths import (
    BenchGlooTransport,
    SharedMemoryTransport,
    TransferMode,
    copy_blocks,
    pieces_per_transfer,
    start_store,
)

RESULTS = Path(__file__).resolve().parent / "results" / "transfer.json"
RESULTS_NETNS = RESULTS.with_name("transfer_netns.json")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TRANSPORTS = ("copy", "shm", "gloo", "nixl")
REMOTE_ONLY = ("gloo", "nixl")  # what --netns measures
NIXL_MODES = (
    TransferMode.BY_LAYER.value,
    TransferMode.BY_REQUEST.value,
    TransferMode.AGGREGATED.value,
)
# Seconds of measurement per table cell after warm-up; the repeat count follows from it.
CELL_BUDGET_S = 1.0
# Seconds for the plain-copy baseline timed beside each cell.
MEMCPY_BUDGET_S = 0.25
MIN_REPS = 5  # enough for a median; P99 of so few runs is their maximum
MAX_REPS = 50
STARTUP_TIMEOUT_S = 60.0
# A high-load gloo round of by_request pieces takes about a second on 2 cores.
CONTROL_TIMEOUT_S = 120.0
ACK_TAG = 1_000  # above every per-transfer tag
STOP_TIMEOUT_S = 10.0  # D answers Stop at once unless it is stuck in a gloo round
NETNS_PREFIX = "10.232"  # --netns takes the first free 10.232.X.0/24 for its veth pair
CLONE_NEWNET = 0x40000000  # setns(2): join a network namespace
CLONE_NEWNS, MS_REC, MS_PRIVATE, MNT_DETACH = 0x00020000, 0x4000, 1 << 18, 2  # a private /sys


# ------------------------------------------------------------------ control messages (bench)


class Setup(rpc.Msg):
    """P -> D: allocate the receiving pools (aggregated and per-layer) in shared memory."""

    agg_shape: list[rpc.Count]
    per_layer_shape: list[rpc.Count]
    dtype: str
    threads: Annotated[int, msgspec.Meta(ge=1)]


class Handles(rpc.Msg):
    """D -> P: the shared handles of D's two pools."""

    agg: dict[str, Any]
    per_layer: dict[str, Any]


class JoinGloo(rpc.Msg):
    """P -> D: join the gloo group whose store listens on host:port; D's gloo device binds
    ``bind_host``."""

    host: str
    port: Annotated[int, msgspec.Meta(ge=1, lt=65536)]
    bind_host: str


class Prepare(rpc.Msg):
    """P -> D: zero the destination blocks; for gloo, then run ``rounds`` receive rounds; for
    nixl, each round's Commit waits for ``rounds`` notifications (one per WRITE)."""

    transport: str
    mode: str
    dst_ids: list[rpc.Ids]
    rounds: rpc.Count


class JoinNixl(rpc.Msg):
    """P -> D: make a NIXL agent over D's pools (reply: ``NixlPools``)."""


class NixlPools(rpc.Msg):
    """D -> P: D's agent metadata and the addresses of its aggregated and per-layer pools."""

    metadata: bytes
    agg: rpc.Count
    per_layer: rpc.Count


class Verify(rpc.Msg):
    """P -> D: per-block checksums of the destination blocks of every transfer."""

    mode: str
    dst_ids: list[rpc.Ids]


class Checksums(rpc.Msg):
    """D -> P: one list of per-block checksums per transfer."""

    sums: list[list[list[list[int]]]]  # [transfer][block][layer][K, V]


class Stop(rpc.Msg):
    """P -> D: exit."""

    reason: str


# Both nodes decode these besides the runtime's own messages (P sends rpc.Commit for shm).
BENCH_MESSAGES = (Setup, Handles, JoinGloo, JoinNixl, NixlPools, Prepare, Verify, Checksums, Stop)


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def piece_checksums(pool: torch.Tensor, mode: str) -> torch.Tensor:
    """Sum of the bit patterns of every (block, layer, K|V) piece: int64 ``[N, L, 2]``.

    One pass over the pool, no copies; a misplaced, missing or altered piece shows.
    """
    ints = pool.view(_INT_VIEW[pool.element_size()])
    if mode == TransferMode.BY_REQUEST.value:
        num_layers, _, n = ints.shape[:3]
        return ints.view(num_layers, 2, n, -1).sum(-1).permute(2, 0, 1)  # [N, L, 2]
    n, num_layers = ints.shape[:2]
    return ints.view(n, num_layers, 2, -1).sum(-1)  # [N, L, 2]


# ------------------------------------------------------------------ D: the receiving process


class Decoder:
    """D's side: owns the receiving pools and follows P's commands (the node's handler)."""

    def __init__(self) -> None:
        self.pools: dict[str, SharedPoolTensor] = {}
        self.gloo: BenchGlooTransport | None = None
        self.nixl: Agent | None = None
        self.notifs = 0  # nixl: notifications a Commit waits for
        self.job: tuple | None = None  # work to run after the reply went out
        self.stop = False

    def pool_for(self, mode: str) -> torch.Tensor:
        """The receiving pool ``mode`` writes to: per-layer for by_request, else aggregated."""
        key = "per_layer" if mode == TransferMode.BY_REQUEST.value else "agg"
        return self.pools[key].tensor

    def __call__(self, sender: str, msg: rpc.Msg) -> rpc.Msg | None:
        """Answer one message from P (``None`` replies ``Ack``)."""
        handler = self.HANDLERS.get(type(msg))
        if handler is None:
            raise ValueError(f"unexpected message {type(msg).__name__}")
        return handler(self, msg)

    def _setup(self, msg: Setup) -> Handles:
        torch.set_num_threads(msg.threads)
        dtype = DTYPES[msg.dtype]
        self.pools["agg"] = SharedPoolTensor.create(msg.agg_shape, dtype)
        self.pools["per_layer"] = SharedPoolTensor.create(msg.per_layer_shape, dtype)
        for p in self.pools.values():
            p.tensor.zero_()  # touch every page now, not during a measurement
        return Handles(self.pools["agg"].handle.to_dict(), self.pools["per_layer"].handle.to_dict())

    def _join(self, msg: JoinGloo) -> None:
        self.job = ("join", msg)

    def _join_nixl(self, msg: JoinNixl) -> NixlPools:
        self.nixl = Agent(f"D-bench-{os.getpid()}")
        for p in self.pools.values():
            self.nixl.register(p.tensor)
        agg, per_layer = (self.pools[k].tensor.data_ptr() for k in ("agg", "per_layer"))
        return NixlPools(self.nixl.metadata(), agg, per_layer)

    def _prepare(self, msg: Prepare) -> None:
        pool = self.pool_for(msg.mode)
        for ids in msg.dst_ids:
            if msg.mode == TransferMode.BY_REQUEST.value:
                pool[:, :, ids] = 0
            else:
                pool[ids] = 0
        if msg.transport == "gloo" and msg.rounds > 0:
            self.job = ("recv", msg)
        self.notifs = msg.rounds if msg.transport == "nixl" else 0

    def _commit(self, msg: rpc.Commit) -> None:
        """The data is already in our pool (over nixl: once every WRITE's notification is in);
        a real D would keep the blocks."""
        got, deadline = 0, time.monotonic() + CONTROL_TIMEOUT_S
        while got < self.notifs and time.monotonic() < deadline:
            got += sum(len(m) for m in self.nixl.notifs().values())
            time.sleep(POLL_S)  # notifs() drives progress itself; this only keeps from spinning
        if got != self.notifs:
            raise TransferError(f"{got} of {self.notifs} NIXL notifications arrived")

    def _verify(self, msg: Verify) -> Checksums:
        sums = piece_checksums(self.pool_for(msg.mode), msg.mode)
        return Checksums([sums[ids].tolist() for ids in msg.dst_ids])

    def _stop(self, msg: Stop) -> None:
        self.stop = True

    HANDLERS = {
        Setup: _setup,
        JoinGloo: _join,
        JoinNixl: _join_nixl,
        Prepare: _prepare,
        rpc.Commit: _commit,
        Verify: _verify,
        Stop: _stop,
    }

    def run_job(self) -> None:
        """Run the job left after a reply: join the gloo group, or receive ``rounds`` rounds of
        gloo transfers, acknowledging each round."""
        kind, msg = self.job
        self.job = None
        if kind == "join":
            self.gloo = BenchGlooTransport(
                1, msg.host, msg.port, bind_host=msg.bind_host, timeout_s=CONTROL_TIMEOUT_S
            )
            return
        pool = self.pool_for(msg.mode)
        ack = torch.ones(1)
        stagings = [Staging() for _ in msg.dst_ids]
        for _ in range(msg.rounds):
            pending = [
                self.gloo.recv_blocks(pool, ids, msg.mode, tag=i, wait=False, staging=stage)
                for i, (ids, stage) in enumerate(zip(msg.dst_ids, stagings))
            ]
            for p in pending:
                p.wait()
            self.gloo.send_tensor(ack, tag=ACK_TAG)

    def close(self) -> None:
        """Leave the gloo group, drop the NIXL registrations and release the shared pools."""
        if self.gloo is not None:
            self.gloo.close()
        if self.nixl is not None:
            self.nixl.close()
        for p in self.pools.values():
            p.close()


def enter_netns(name: str) -> None:
    """Move this process into the network namespace ``ip netns add name`` made, as ``ip netns
    exec`` does: sockets opened afterwards (and by threads started afterwards) live there, and
    a private /sys lists that namespace's interfaces (UCX finds its devices there)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(ok: bool, what: str) -> None:
        if not ok:
            err = ctypes.get_errno()
            raise OSError(err, f"{what} for network namespace {name}: {os.strerror(err)}")

    with open(f"/var/run/netns/{name}") as f:
        check(libc.setns(f.fileno(), CLONE_NEWNET) == 0, "setns")
    check(libc.unshare(CLONE_NEWNS) == 0, "unshare the mounts")
    check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0, "make / private")
    check(libc.umount2(b"/sys", MNT_DETACH) == 0, "unmount /sys")
    check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None) == 0, "mount /sys")


def decoder_main(
    host: str,
    port: int,
    key: rpc.ClusterKey,
    queue: mp.Queue,
    netns: str | None = None,
) -> None:
    """Entry point of the D process: enter ``netns`` if given (before any socket exists),
    report the node's address, then serve until told to stop."""
    if netns is not None:
        enter_netns(netns)
    torch.set_num_threads(1)
    decoder = Decoder()
    node = rpc.RpcNode(
        "D",
        decoder,
        host=host,
        port=port,
        timeout_s=CONTROL_TIMEOUT_S,
        codec=rpc.Codec(key.secret, extra=BENCH_MESSAGES),
        curve=key.curve_for(host),
    )
    try:
        queue.put(node.address)
        while not decoder.stop:
            node.serve(0.05)
            if decoder.job is not None:
                decoder.run_job()
    finally:
        decoder.close()
        node.close()


# ------------------------------------------------------------------ the link between P and D


@dataclass(frozen=True)
class Link:
    """Where P and D meet: their addresses, and the network namespace D runs in."""

    name: str  # "" for the --host address; "lo" and "veth" side by side under --netns
    p_host: str
    d_host: str
    netns: str | None = None


def netns_unavailable() -> str | None:
    """Why ``--netns`` cannot run here, or ``None`` when it can."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    if os.geteuid() != 0:
        return "creating a network namespace and a veth pair needs root"
    return None


def _ip(*args: str) -> str:
    """Run ``ip args``; raise with its error output when it fails."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _free_subnet() -> str:
    """The first ``10.232.X`` with no address or route on this host."""
    used = _ip("-4", "route", "show", "table", "all") + _ip("-4", "-o", "addr")
    for x in range(256):
        if f"{NETNS_PREFIX}.{x}." not in used:
            return f"{NETNS_PREFIX}.{x}"
    raise RuntimeError(f"no free {NETNS_PREFIX}.X.0/24 subnet for the veth pair")


@contextlib.contextmanager
def veth_namespace() -> Iterator[Link]:
    """A fresh network namespace joined to this one by a veth pair, with P's end here and D's
    end (and the namespace's loopback) up in it; both are deleted on exit."""
    tag = str(os.getpid())
    name, here, there = f"mmsbench{tag}", f"mmsb{tag}p", f"mmsb{tag}d"  # names <= 15 chars
    subnet = _free_subnet()
    link = Link("veth", f"{subnet}.1", f"{subnet}.2", name)
    try:
        _ip("netns", "add", name)
        _ip("link", "add", here, "type", "veth", "peer", "name", there, "netns", name)
        _ip("addr", "add", f"{link.p_host}/24", "dev", here)
        _ip("link", "set", here, "up")
        _ip("-n", name, "addr", "add", f"{link.d_host}/24", "dev", there)
        _ip("-n", name, "link", "set", there, "up")
        _ip("-n", name, "link", "set", "lo", "up")
        yield link
    finally:
        # deleting one end removes both; each step runs even when an earlier one failed
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    """Turn SIGTERM into SystemExit so the ``finally`` blocks (namespace cleanup) run."""
    sys.exit(128 + signum)


# ------------------------------------------------------------------ P: the sending side


@dataclass
class Cell:
    """One measured table row."""

    transport: str
    mode: str
    concurrency: int
    calls: int  # sends or copy calls per transfer
    bytes_per_round: int
    link: str = ""  # Link.name: empty unless --netns measures several links
    times_ms: list[float] = field(default_factory=list)
    data_ms: list[float] = field(default_factory=list)  # shm: write only, before the notice
    verified: bool = False
    memcpy_ms: list[float] = field(default_factory=list)  # baseline timed beside this cell
    cma_ms: list[float] = field(default_factory=list)  # nixl: the kernel's copy, same pieces

    @property
    def label(self) -> str:
        """The transport, with the link when one is named ("gloo veth")."""
        return f"{self.transport} {self.link}".strip()

    @property
    def median_ms(self) -> float:
        """Median round time (ms)."""
        return statistics.median(self.times_ms)

    @property
    def p99_ms(self) -> float:
        """99th-percentile round time (ms, nearest rank)."""
        ordered = sorted(self.times_ms)
        return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]

    @property
    def gbps(self) -> float:
        """Bytes per round over the median round time, in GB/s."""
        return self.bytes_per_round / (self.median_ms * 1e-3) / 1e9


IOV_MAX = 1024  # iovecs one process_vm_writev call takes


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def process_vm_writev(pid: int, writes: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Write the pieces of NIXL descriptor pairs ``writes`` into process ``pid`` with the
    kernel's cross-memory attach (the copy UCX's cma transport makes), as a reference."""
    libc = ctypes.CDLL(None, use_errno=True)
    local = np.concatenate([w[0] for w in writes])
    remote = np.concatenate([w[1] for w in writes])
    for at in range(0, len(local), IOV_MAX):
        n = min(IOV_MAX, len(local) - at)
        src, dst = (
            (_IoVec * n)(*[_IoVec(int(d[0]), int(d[1])) for d in x[at : at + n]])
            for x in (local, remote)
        )
        want = int(local[at : at + n, 1].sum())
        if libc.process_vm_writev(pid, src, n, dst, n, 0) != want:
            raise OSError(ctypes.get_errno(), "process_vm_writev wrote short")


def timed(fn) -> float:
    """Wall time of one ``fn()`` call (ms)."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def measure(fn, budget_s: float, min_reps: int, max_reps: int) -> list[float]:
    """Warm up once, then time ``fn`` (ms) as often as the budget allows."""
    first = timed(fn)
    reps = int(min(max_reps, max(min_reps, budget_s * 1e3 / max(first, 1e-3))))
    return [timed(fn) for _ in range(reps)]


class RemoteDecoder:
    """D as P reaches it: its process, the control node to it and the transports open to it
    (shared-memory views of its pools, a gloo pair, a NIXL agent with D's pools loaded)."""

    def __init__(self, args: argparse.Namespace, src: dict[str, torch.Tensor]) -> None:
        self.args = args
        self.src = src
        self.node: rpc.RpcNode | None = None
        self.child: mp.Process | None = None
        self.shm: dict[str, torch.Tensor] = {}
        self.gloo: BenchGlooTransport | None = None
        self.nixl: Agent | None = None
        self.nixl_peer: Any = None  # D's agent as NIXL names it
        self.nixl_pools: dict[str, int] = {}  # D's pool addresses

    def start(self, link: Link) -> None:
        """Spawn D (in ``link``'s namespace), connect to it, have it create its pools, and open
        the shm / gloo transports asked for."""
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        a = self.args
        key = rpc.ClusterKey.generate()  # reaches D through the spawn pipe, not argv
        self.child = ctx.Process(
            target=decoder_main, args=(link.d_host, a.ctrl_port, key, queue, link.netns)
        )
        self.child.start()
        address = queue.get(timeout=STARTUP_TIMEOUT_S)
        self.node = rpc.RpcNode(
            "P",
            self._unexpected,
            host=link.p_host,
            timeout_s=CONTROL_TIMEOUT_S,
            codec=rpc.Codec(key.secret, extra=BENCH_MESSAGES),
            curve=key.curve_for(link.p_host),
        )
        self.node.connect("D", address)
        handles = self.call(
            Setup(
                list(self.src["agg"].shape),
                list(self.src["per_layer"].shape),
                a.dtype,
                a.threads,
            )
        )
        if "shm" in a.transports:
            self.shm["agg"] = SharedMemoryTransport(handles.agg).dst
            self.shm["per_layer"] = SharedMemoryTransport(handles.per_layer).dst
        if "gloo" in a.transports:
            store = start_store(link.p_host, a.gloo_port, timeout_s=CONTROL_TIMEOUT_S)
            self.call(JoinGloo(link.p_host, store.port, link.d_host))
            self.gloo = BenchGlooTransport(
                0, link.p_host, store=store, bind_host=link.p_host, timeout_s=CONTROL_TIMEOUT_S
            )
        if "nixl" in a.transports:
            pools = self.call(JoinNixl())
            self.nixl = Agent(f"P-bench-{os.getpid()}-{link.name}")
            for t in self.src.values():
                self.nixl.register(t)
            self.nixl_peer = self.nixl.load(pools.metadata)
            self.nixl_pools = {"agg": pools.agg, "per_layer": pools.per_layer}

    def stop(self) -> None:
        """Close the transports, tell D to stop and wait for it (killed after 30 s, or at once
        when it does not answer: an error or a signal that cut a gloo round short leaves D
        waiting inside that round)."""
        if self.gloo is not None:
            self.gloo.close()
            self.gloo = None
        if self.nixl is not None:
            self.nixl.close()
            self.nixl = None
        self.shm.clear()
        answered = False
        if self.node is not None:
            with contextlib.suppress(TransferError):
                self.call(Stop("done"), timeout_s=STOP_TIMEOUT_S)
                answered = True
            self.node.close()
            self.node = None
        if self.child is not None:
            self.child.join(30 if answered else 0)
            if self.child.is_alive():
                self.child.kill()
                self.child.join()
            self.child = None

    @staticmethod
    def _unexpected(sender: str, msg: rpc.Msg) -> rpc.Msg | None:
        """P's handler: D only answers, it never asks."""
        raise ValueError(f"unexpected {type(msg).__name__} from {sender}")

    def call(self, msg: rpc.Msg, timeout_s: float | None = None) -> rpc.Msg:
        """Send ``msg`` to D and return its reply."""
        return self.node.call("D", msg, timeout_s=timeout_s)


class Bench:
    """P's side of the benchmark."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dtype = DTYPES[args.dtype]
        self.layout = KVLayout(args.layers, args.block_size, args.kv_heads, args.head_dim)
        self.n = self.layout.num_blocks_for(args.tokens)
        self.max_c = max(args.concurrency)
        self.pool_blocks = self.n * self.max_c
        self.block_bytes = self.layout.block_bytes(self.dtype.itemsize)
        self.request_bytes = self.n * self.block_bytes
        g = torch.Generator().manual_seed(0)
        src = torch.randn(self.layout.pool_shape(self.pool_blocks), generator=g)
        self.src = {"agg": src.to(self.dtype)}  # [N, L, 2, bs, h, d]
        # [L, 2, N, bs, h, d]: the same values in the per-layer layout
        self.src["per_layer"] = self.src["agg"].permute(1, 2, 0, 3, 4, 5).contiguous()
        self.src_ids = self._disjoint_ids(seed=1)
        if args.dst_ids == "alloc":
            self.dst_ids = self._allocated_ids(seed=2)
        else:
            self.dst_ids = self._disjoint_ids(seed=2)
        self.dst_runs = sum(is_run(ids) for ids in self.dst_ids)
        self.cells: list[Cell] = []
        self.src_sums: dict[str, torch.Tensor] = {}  # layout -> [N, L, 2] piece checksums
        self.memcpy_ms: dict[int, list[float]] = {}  # every baseline run, by concurrency
        self.memcpy_bufs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.d = RemoteDecoder(args, self.src)

    def _disjoint_ids(self, seed: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(self.pool_blocks, generator=g).tolist()
        return [perm[i * self.n : (i + 1) * self.n] for i in range(self.max_c)]

    def _allocated_ids(self, seed: int) -> list[list[int]]:
        """D's blocks as its pool hands them to incoming transfers: from an allocator whose
        free list churn has put in random order, asking for one run per request."""
        alloc = BlockAllocator(self.pool_blocks)
        held = alloc.alloc(self.pool_blocks)
        g = torch.Generator().manual_seed(seed)
        alloc.decref([held[i] for i in torch.randperm(len(held), generator=g).tolist()])
        return [alloc.alloc(self.n, contiguous=True) for _ in range(self.max_c)]

    def key(self, mode: str) -> str:
        """Pool layout ``mode`` uses: "per_layer" for by_request, else "agg"."""
        return "per_layer" if mode == TransferMode.BY_REQUEST.value else "agg"

    # -- measurements

    def run_memcpy(self, c: int, budget_s: float) -> list[float]:
        """Time a plain contiguous copy of the bytes of ``c`` transfers (ms)."""
        if c not in self.memcpy_bufs:
            a = torch.ones(c * self.request_bytes // self.dtype.itemsize, dtype=self.dtype)
            self.memcpy_bufs[c] = (a, torch.empty_like(a))
        a, b = self.memcpy_bufs[c]
        runs = measure(lambda: b.copy_(a), budget_s, MIN_REPS, MAX_REPS)
        self.memcpy_ms.setdefault(c, []).extend(runs)
        return runs

    def run_local(self, transport: str, mode: str, c: int, dst: torch.Tensor) -> Cell:
        """copy and shm: P writes into ``dst`` (its own tensor, or D's mapped pool)."""
        src = self.src[self.key(mode)]
        stagings = [Staging() for _ in range(c)]
        cell = self._cell(transport, mode, c)
        pool = ThreadPoolExecutor(c) if c > 1 else None

        def write(i: int) -> None:
            copy_blocks(dst, src, self.src_ids[i], self.dst_ids[i], mode, stagings[i])

        def one_round() -> None:
            t0 = time.perf_counter()
            if pool is None:
                write(0)
            else:
                list(pool.map(write, range(c)))
            cell.data_ms.append((time.perf_counter() - t0) * 1e3)
            if transport == "shm":
                self.d.call(rpc.Commit(f"round{c}", None, sum(self.dst_ids[:c], [])))

        self._zero_dst(transport, mode, c, dst)
        cell.times_ms = measure(one_round, self.args.cell_budget_s, MIN_REPS, MAX_REPS)
        cell.data_ms = cell.data_ms[1:]  # drop the warm-up
        if pool is not None:
            pool.shutdown()
        cell.verified = self._verify(transport, mode, c, dst)
        return cell

    def run_gloo(self, mode: str, c: int) -> Cell:
        """Time rounds of ``c`` concurrent gloo transfers until D acknowledges; verify in D."""
        src = self.src[self.key(mode)]
        cell = self._cell("gloo", mode, c)
        ack = torch.zeros(1)
        stagings = [Staging() for _ in range(c)]

        def one_round() -> None:
            pending = [
                self.d.gloo.send_blocks(
                    src, self.src_ids[i], mode=mode, tag=i, wait=False, staging=stagings[i]
                )
                for i in range(c)
            ]
            for p in pending:
                p.wait()
            self.d.gloo.recv_tensor(ack, tag=ACK_TAG)

        ids = self.dst_ids[:c]
        self.d.call(Prepare("gloo", mode, ids, rounds=1))
        first = timed(one_round)
        budget_ms = self.args.cell_budget_s * 1e3
        reps = int(min(MAX_REPS, max(MIN_REPS, budget_ms / max(first, 1e-3))))
        self.d.call(Prepare("gloo", mode, ids, rounds=reps))
        cell.times_ms = [timed(one_round) for _ in range(reps)]
        cell.verified = self._verify("gloo", mode, c, None)
        return cell

    def nixl_writes(self, mode: str, i: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The WRITEs of transfer ``i`` in ``mode``: (P's descriptors, D's descriptors) each."""
        key, layers = self.key(mode), self.layout.num_layers
        src, dst = self.src[key].data_ptr(), self.d.nixl_pools[key]
        s, d = (np.asarray(ids, dtype=np.uint64) for ids in (self.src_ids[i], self.dst_ids[i]))
        if mode == TransferMode.BY_REQUEST.value:  # piece (layer, kv, block) of [L, 2, N, ...]
            size = self.block_bytes // (2 * layers)
            rows = np.arange(2 * layers, dtype=np.uint64)[:, None] * np.uint64(self.pool_blocks)
            s, d = ((rows + ids).reshape(-1) * np.uint64(size) for ids in (s, d))
            return [(descs(src + s, size, 0), descs(dst + d, size, 0))]
        s, d = s * np.uint64(self.block_bytes), d * np.uint64(self.block_bytes)
        if mode == TransferMode.AGGREGATED.value:
            return [(descs(src + s, self.block_bytes, 0), descs(dst + d, self.block_bytes, 0))]
        size = self.block_bytes // layers  # by_layer: K and V of one layer of every block
        return [
            (
                descs(src + s + np.uint64(k * size), size, 0),
                descs(dst + d + np.uint64(k * size), size, 0),
            )
            for k in range(layers)
        ]

    def run_nixl(self, mode: str, c: int) -> Cell:
        """Time rounds of ``c`` concurrent NIXL transfers: post every WRITE, wait until all are
        done, then Commit (D waits for every notification); verify in D."""
        plans = [self.nixl_writes(mode, i) for i in range(c)]
        writes = [w for plan in plans for w in plan]
        cell = self._cell("nixl", mode, c)
        cell.calls = sum(len(local) for local, _ in plans[0])  # descriptors per transfer

        def one_round() -> None:
            handles = [
                self.d.nixl.post(self.d.nixl_peer, local, "DRAM", remote, "DRAM", b"round")
                for local, remote in writes
            ]
            self.d.nixl.wait(handles, CONTROL_TIMEOUT_S, f"nixl {mode} round")
            self.d.call(rpc.Commit(f"round{c}", None, []))

        self.d.call(Prepare("nixl", mode, self.dst_ids[:c], rounds=len(writes)))
        cell.times_ms = measure(one_round, self.args.cell_budget_s, MIN_REPS, MAX_REPS)
        cell.verified = self._verify("nixl", mode, c, None)
        if mode == TransferMode.AGGREGATED.value and not self.args.netns:  # UCX's cma copy
            cma = functools.partial(process_vm_writev, self.d.child.pid, writes)
            cell.cma_ms = measure(cma, MEMCPY_BUDGET_S, MIN_REPS, MAX_REPS)
        return cell

    def _cell(self, transport: str, mode: str, c: int) -> Cell:
        calls = pieces_per_transfer(mode, self.layout.num_layers, self.n)
        return Cell(transport, mode, c, calls, c * self.request_bytes)

    def _zero_dst(self, transport: str, mode: str, c: int, dst: torch.Tensor) -> None:
        if transport == "shm":
            self.d.call(Prepare("shm", mode, self.dst_ids[:c], rounds=0))
        else:
            dst.zero_()

    def _verify(self, transport: str, mode: str, c: int, dst: torch.Tensor | None) -> bool:
        key = self.key(mode)
        if key not in self.src_sums:
            self.src_sums[key] = piece_checksums(self.src[key], mode)
        want = [self.src_sums[key][self.src_ids[i]].tolist() for i in range(c)]
        if transport == "copy":
            sums = piece_checksums(dst, mode)
            got = [sums[self.dst_ids[i]].tolist() for i in range(c)]
        else:
            got = self.d.call(Verify(mode, self.dst_ids[:c])).sums
        return got == want

    def run(self, links: list[Link]) -> None:
        """Measure every (link, transport, mode, concurrency) cell, each followed by its memcpy
        baseline; starts and stops D, once per link, when a remote transport is asked for."""
        for link in links:
            self.run_link(link)

    def run_link(self, link: Link) -> None:
        """The cells of one link (see :meth:`run`)."""
        a = self.args
        remote = [t for t in a.transports if t != "copy"]
        cells = [(t, m, c) for t in a.transports for m in a.modes for c in a.concurrency]
        cells = [(t, m, c) for t, m, c in cells if t != "nixl" or m in NIXL_MODES]
        if remote:
            self.d.start(link)
        local_dst: dict[str, torch.Tensor] = {}
        try:
            for t, m, c in tqdm(cells, desc=f"transfer cells {link.name}".strip()):
                if t == "copy":
                    k = self.key(m)
                    if k not in local_dst:
                        local_dst[k] = torch.zeros_like(self.src[k])
                    cell = self.run_local("copy", m, c, local_dst[k])
                elif t == "shm":
                    cell = self.run_local("shm", m, c, self.d.shm[self.key(m)])
                elif t == "nixl":
                    cell = self.run_nixl(m, c)
                else:
                    cell = self.run_gloo(m, c)
                # the baseline right after the cell, under the same host load
                cell.memcpy_ms = self.run_memcpy(c, MEMCPY_BUDGET_S)
                cell.link = link.name
                self.cells.append(cell)
        finally:
            if remote:
                self.d.stop()

    # -- report

    def memcpy_median(self, c: int) -> float:
        """Median of all memcpy baseline runs at concurrency ``c`` (ms)."""
        return statistics.median(self.memcpy_ms[c])

    def rows(self) -> list[dict]:
        """One JSON-ready dict per measured cell."""
        out = []
        for cell in self.cells:
            row = {
                "transport": cell.transport,
                "mode": cell.mode,
                "concurrency": cell.concurrency,
                "calls_per_transfer": cell.calls,
                "bytes_per_round": cell.bytes_per_round,
                "reps": len(cell.times_ms),
                "ms_median": cell.median_ms,
                "ms_p99": cell.p99_ms,
                "gb_per_s": cell.gbps,
                "memcpy_ms_median": statistics.median(cell.memcpy_ms),
                "vs_memcpy": statistics.median(cell.memcpy_ms) / cell.median_ms,
                "verified": cell.verified,
            }
            if cell.transport == "shm" and cell.data_ms:
                row["write_ms_median"] = statistics.median(cell.data_ms)
            if cell.cma_ms:
                row["process_vm_writev_ms_median"] = statistics.median(cell.cma_ms)
            if cell.link:
                row["link"] = cell.link
            out.append(row)
        return out

    def summary(self, rows: list[dict]) -> dict:
        """Ratios from ``rows``: by_request over aggregated time; shm bandwidth over memcpy;
        under --netns, veth over loopback time per mode and load."""
        by = {(_label(r), r["mode"], r["concurrency"]): r for r in rows}
        out: dict[str, float] = {}
        for t in dict.fromkeys(_label(r) for r in rows):
            for c in self.args.concurrency:
                req = by.get((t, TransferMode.BY_REQUEST.value, c))
                agg = by.get((t, TransferMode.AGGREGATED.value, c))
                if req and agg:
                    out[f"{t} c={c}: by_request / aggregated time"] = (
                        req["ms_median"] / agg["ms_median"]
                    )
                lay = by.get((t, TransferMode.BY_LAYER.value, c))
                if t.startswith("nixl") and lay and agg:
                    out[f"{t} c={c}: by_layer / aggregated time"] = (
                        lay["ms_median"] / agg["ms_median"]
                    )
                    out[f"{t} c={c}: by_request_aggregated bandwidth / memcpy"] = agg["vs_memcpy"]
                if t.startswith("nixl") and agg and "process_vm_writev_ms_median" in agg:
                    cma = agg["process_vm_writev_ms_median"]
                    out[f"{t} c={c}: process_vm_writev bandwidth / memcpy"] = (
                        agg["memcpy_ms_median"] / cma
                    )
                    out[f"{t} c={c}: by_request_aggregated bandwidth / process_vm_writev"] = (
                        cma / agg["ms_median"]
                    )
                for m in (TransferMode.PACKED.value, TransferMode.AGGREGATED.value):
                    r = by.get((t, m, c))
                    if r and t == "shm":
                        out[f"shm c={c}: {m} bandwidth / memcpy"] = r["vs_memcpy"]
                        out[f"shm c={c}: {m} write-only bandwidth / memcpy"] = (
                            r["memcpy_ms_median"] / r["write_ms_median"]
                        )
        for (t, m, c), veth in by.items():
            kind, _, link = t.partition(" ")
            if link == "veth" and (lo := by.get((f"{kind} lo", m, c))):
                out[f"{kind} c={c}: {m} veth / loopback time"] = veth["ms_median"] / lo["ms_median"]
        return out


def _label(row: dict) -> str:
    """A row's transport, with its link when it has one (see :attr:`Cell.label`)."""
    return f"{row['transport']} {row.get('link', '')}".strip()


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def print_report(bench: Bench, rows: list[dict], summary: dict) -> None:
    """Print the request geometry, the memcpy baselines, the table and the summary ratios."""
    a = bench.args
    print(
        f"\nKV of one {a.tokens}-token request: {bench.n} blocks x "
        f"{bench.block_bytes / 2**10:.0f} KiB = {bench.request_bytes / 2**20:.1f} MiB "
        f"(L={a.layers}, kv_heads={a.kv_heads}, head_dim={a.head_dim}, "
        f"block_size={a.block_size}, {a.dtype}); torch threads per process: {a.threads}; "
        f"destination ids: {a.dst_ids} ({bench.dst_runs} of {len(bench.dst_ids)} requests "
        "in one run)"
    )
    for c in a.concurrency:
        ms = bench.memcpy_median(c)
        gbps = c * bench.request_bytes / (ms * 1e-3) / 1e9
        print(
            f"plain memcpy of {c} x {bench.request_bytes / 2**20:.1f} MiB: "
            f"{ms:.2f} ms, {gbps:.2f} GB/s"
        )
    head = (
        f"{'transport':<9} {'mode':<22} {'load':>4} {'calls':>6} {'ms med':>9} "
        f"{'ms p99':>9} {'write ms':>9} {'GB/s':>7} {'x memcpy':>9} {'reps':>5} {'ok':>3}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        print(
            f"{_label(r):<9} {r['mode']:<22} {r['concurrency']:>4} "
            f"{r['calls_per_transfer']:>6} {r['ms_median']:>9.2f} {r['ms_p99']:>9.2f} "
            f"{_fmt(r.get('write_ms_median')):>9} "
            f"{r['gb_per_s']:>7.2f} {r['vs_memcpy']:>9.2f} {r['reps']:>5} "
            f"{'yes' if r['verified'] else 'NO':>3}"
        )
    print()
    for k, v in summary.items():
        print(f"{k}: {v:.2f}")


def parse_args() -> argparse.Namespace:
    """Command-line options, with the comma-separated lists split and checked."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument(
        "--transports",
        default=None,
        help="comma-separated subset of " + ",".join(TRANSPORTS) + " (default: all; gloo "
        "and nixl with --netns; nixl only where the nixl extra loads)",
    )
    p.add_argument("--modes", default=",".join(m.value for m in TransferMode))
    p.add_argument("--concurrency", default="1,16", help="concurrent transfers per round")
    p.add_argument("--threads", type=int, default=1, help="torch threads in each process")
    p.add_argument(
        "--dst-ids",
        choices=("alloc", "random"),
        default="alloc",
        help="receiver block ids: alloc (what D's allocator hands a transfer after churn: "
        "one run when its free blocks hold one) or random (no free run: scattered ids)",
    )
    p.add_argument("--cell-budget-s", type=float, default=CELL_BUDGET_S)
    p.add_argument("--host", default="127.0.0.1", help="control and gloo address")
    p.add_argument("--ctrl-port", type=int, default=0, help="D's control port (0 = free)")
    p.add_argument("--gloo-port", type=int, default=0, help="gloo store port (0 = free)")
    p.add_argument(
        "--netns",
        action="store_true",
        help="gloo and nixl on loopback and across a veth pair into a fresh network "
        "namespace (root; the namespace is removed on exit)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"default: {RESULTS} or, with --netns, {RESULTS_NETNS}",
    )
    a = p.parse_args()
    default_transports = REMOTE_ONLY if a.netns else TRANSPORTS
    a.transports = [t for t in (a.transports or ",".join(default_transports)).split(",") if t]
    if "nixl" in a.transports and (why := nixl_missing()):
        print(f"skipping nixl: {why}", file=sys.stderr)
        a.transports.remove("nixl")
    a.out = a.out or (RESULTS_NETNS if a.netns else RESULTS)
    a.modes = [TransferMode(m).value for m in a.modes.split(",") if m]
    a.concurrency = [int(c) for c in a.concurrency.split(",") if c]
    bad = [t for t in a.transports if t not in TRANSPORTS]
    if bad or not a.transports:
        p.error(f"unknown transports {bad}; choose from {TRANSPORTS}")
    if a.netns and not set(a.transports) <= set(REMOTE_ONLY):
        p.error("--netns measures gloo and nixl only: shm and copy cannot cross hosts")
    if not a.concurrency or min(a.concurrency) < 1:
        p.error("--concurrency needs positive integers")
    if a.tokens < 1:
        p.error("--tokens must be positive")
    return a


def result_json(
    args: argparse.Namespace, bench: Bench, rows: list[dict], summary: dict, wall_s: float
) -> dict:
    """What the run writes: its configuration, the machine, the request, memcpy, the rows."""
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {
            "load_average_at_end": os.getloadavg(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "request": {
            "dst_requests_in_one_run": bench.dst_runs,
            "blocks": bench.n,
            "block_bytes": bench.block_bytes,
            "bytes": bench.request_bytes,
        },
        "memcpy_ms": {
            str(c): {"median": bench.memcpy_median(c), "runs": v}
            for c, v in bench.memcpy_ms.items()
        },
        "rows": rows,
        "summary": summary,
        "notes": [
            "high load: copy/shm use one thread per transfer; gloo posts all transfers "
            "back-to-back (async, one tag each) and waits for all",
            "shm times include the Commit control round trip; write_ms_median excludes it",
            "nixl times include the Commit round trip, in which D waits for every WRITE's "
            "notification; calls_per_transfer is NIXL descriptors for nixl rows; "
            "process_vm_writev_ms_median: the kernel's cross-memory copy of the same pieces "
            "(UCX's cma transport between processes of one host), timed after the cell",
            "gloo times end when D's acknowledgement (sent after its scatter) reaches P",
            "vs_memcpy uses a plain copy of the same bytes timed right after each cell; "
            "the memcpy lines above the table pool all those runs",
            "source block ids are random and disjoint; destination ids per --dst-ids "
            f"({bench.dst_runs} of {len(bench.dst_ids)} requests in one run); "
            "vs_memcpy = memcpy time / transfer time",
        ],
        "wall_s": wall_s,
    }


def main() -> None:
    """Run the cells, print the report, write JSON and a plot; fail if a transfer was not
    bit-exact."""
    args = parse_args()
    if args.netns:
        if why := netns_unavailable():
            print(f"skipping --netns: {why}", file=sys.stderr)
            return
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        os.environ["UCX_TLS"] = "tcp,self"  # as between hosts (see the module docstring)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    bench = Bench(args)
    with veth_namespace() if args.netns else contextlib.nullcontext() as veth:
        if veth is None:
            links = [Link("", args.host, args.host)]
        else:  # loopback first, then across the namespaces, under the same conditions
            links = [Link("lo", rpc.LOOPBACK, rpc.LOOPBACK), veth]
        bench.run(links)
    rows = bench.rows()
    summary = bench.summary(rows)
    print_report(bench, rows, summary)
    result = result_json(args, bench, rows, summary, time.perf_counter() - start)
    if args.netns:
        result["links"] = [asdict(link) for link in links]
        result["notes"].append(
            "--netns: link lo = P and D on 127.0.0.1 in one namespace; link veth = P on the "
            "root side of a veth pair, D in a fresh network namespace on its other end (default "
            "MTU, CURVE-encrypted control plane); the same D pools and source blocks for both"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot_rows(rows, args.out.with_suffix(".png"))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\nwrote {args.out} ({result['wall_s']:.0f} s; host load average {load})")
    if not all(r["verified"] for r in rows):
        raise SystemExit("some transfers did not arrive bit-exact")


def plot_rows(rows: list[dict], path: Path) -> None:
    """Bars of bandwidth relative to memcpy per transport and mode, one series per load."""
    from plotting import grouped_bars

    cells = sorted({(_label(r), r["mode"]) for r in rows}, key=lambda c: (c[0], c[1]))
    loads = sorted({r["concurrency"] for r in rows})
    value = {(_label(r), r["mode"], r["concurrency"]): r["vs_memcpy"] for r in rows}
    grouped_bars(
        path,
        "KV transfer of one request: bandwidth / plain memcpy",
        [f"{t} {m}" for t, m in cells],
        {f"load {c}": [value.get((t, m, c)) for t, m in cells] for c in loads},
        "x memcpy",
        hline=0.5,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
