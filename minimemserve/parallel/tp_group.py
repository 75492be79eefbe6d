"""Rank 0 of an instance: :class:`SingleRank` when it is not tensor-parallel, else
:class:`TPGroup`, which starts the workers, builds rank 0's model and announces every step."""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections.abc import Iterator

import torch
import torch.multiprocessing as mp

from ..attention.base import SeqSlice
from ..config import EngineConfig
from ..errors import ConfigError, InstanceDied
from ..mempool import MemPool
from ..mempool.tiers import HBM
from ..model.loader import load_weights
from .groups import (
    KV_TAG,
    MOVE_KV,
    OP_TIERS,
    RECV_KV,
    SEND_KV,
    START_TIMEOUT,
    STEP,
    STOP,
    encode_step,
    open_groups,
)
from .layers import Collectives, build_model
from .pool import ShardedPool
from .shard import TPShard
from .store import LOOPBACK, HostStore
from .worker import JOIN_TIMEOUT_S, reap_workers, worker_main

POLL_S = 0.05  # rank 0 checks this often whether a starting worker is ready or dead


class SingleRank:
    """The group of an instance that is not tensor-parallel: every step is local."""

    size = 1

    def step(self, slices, ids, rows) -> contextlib.AbstractContextManager:
        """Nothing to announce."""
        return contextlib.nullcontext()

    def make_pool(self, factory):
        """The pool class to build: the given one."""
        return factory

    def close(self) -> None:
        """Nothing to release."""


class TPGroup:
    """Rank 0 of a tensor-parallel instance: starts the workers (each loads its shard of
    ``model_dir`` and zero-fills a KV shard of ``num_blocks`` blocks), builds rank 0's model
    (``.model``), announces every step to the other ranks and moves their KV shards. A rank
    that keeps rank 0 waiting ``timeout_s`` in one collective stops the group, as a dead one
    does."""

    def __init__(
        self,
        model_dir,
        shard: TPShard,
        config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
    ):
        """``config``: the instance's, with ``num_blocks`` resolved (every rank reads its sizes,
        attention backend, decode graphs and ``collective_timeout_s`` from it)."""
        self.size = shard.size
        self.device = device
        self.dtype = dtype
        self.shard = shard
        self.block_size = config.block_size
        self.shards = [TPShard(r, shard.size, shard.cfg) for r in range(shard.size)]
        self.dead: str | None = None  # why the group stopped, once it has
        self.timeout_s = timeout_s = config.collective_timeout_s
        self.store = HostStore(LOOPBACK, START_TIMEOUT.total_seconds())
        threads = max(1, torch.get_num_threads() // self.size)
        group = (self.size, self.store.port, threads)
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(
                target=worker_main,
                args=(r, *group, str(model_dir), config, str(device), dtype),
                daemon=True,
                name=f"tp-rank{r}",
            )
            for r in range(1, self.size)
        ]
        self._reaper = weakref.finalize(self, reap_workers, self.procs)
        for p in self.procs:
            p.start()
        weights = load_weights(model_dir, shard.cfg, dtype, device)
        self._wait_ready(self.store.store)
        with self._guard("start"):
            self.control, group = open_groups(self.store.store, 0, self.size, device, timeout_s)
        self.comm = Collectives(group, self.size)
        self.model = build_model(weights, shard, self.comm).to(device=device, dtype=dtype).eval()

    def _wait_ready(self, store) -> None:
        deadline = time.monotonic() + START_TIMEOUT.total_seconds()
        for r, p in enumerate(self.procs, start=1):
            while not store.check([f"ready{r}"]):
                if not p.is_alive():
                    self._fail(f"tensor-parallel rank {r} exited while starting ({p.exitcode})")
                if time.monotonic() > deadline:
                    self._fail(f"tensor-parallel rank {r} did not start in {START_TIMEOUT}")
                time.sleep(POLL_S)

    def _fail(self, why: str):
        """Stop every worker and raise ``InstanceDied``; later calls raise it too."""
        self.dead = self.dead or why
        reap_workers(self.procs)
        raise InstanceDied(self.dead)

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise InstanceDied(self.dead)
        for r, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                self._fail(f"tensor-parallel rank {r} died (exit code {p.exitcode})")

    def _send(self, op: int, payload: list[int], rank: int = 0) -> None:
        self.control.broadcast(torch.tensor([op, len(payload), rank]), 0).wait()
        if payload:
            self.control.broadcast(torch.tensor(payload, dtype=torch.int64), 0).wait()

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """Run a multi-rank exchange; one that fails midway leaves the ranks out of step, so
        the group is stopped and this and every later call raise ``InstanceDied``."""
        self._check_alive()
        try:
            yield
        except BaseException as e:
            limit = f"collective_timeout_s={self.timeout_s:g}"
            self._fail(f"a tensor-parallel {what} failed ({limit}): {type(e).__name__}: {e}")

    @contextlib.contextmanager
    def step(self, slices: list[SeqSlice], ids: list[int], rows: list[int]) -> Iterator[None]:
        """Announce a step, then run rank 0's share in the ``with`` body."""
        with self._guard("step"):
            self._send(STEP, encode_step(slices, ids, rows))
            yield

    def pull_kv(self, rank: int, blocks: list[int], tier: str = HBM) -> torch.Tensor:
        """Blocks ``blocks`` of rank ``rank``'s ``tier`` KV shard, sent by it in one message."""
        shape = self.shards[rank].kv_layout(self.block_size).pool_shape(len(blocks))
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        with self._guard("KV send"):
            self._send(SEND_KV, [OP_TIERS.index(tier), *blocks], rank)
            self.comm.group.recv([buf], rank, KV_TAG).wait()
        return buf

    def push_kv(self, rank: int, blocks: list[int], piece: torch.Tensor) -> None:
        """Write ``piece`` (rank ``rank``'s heads of ``blocks``) into that rank's KV shard."""
        with self._guard("KV receive"):
            self._send(RECV_KV, blocks, rank)
            self.comm.group.send([piece.contiguous()], rank, KV_TAG).wait()

    def move_kv(self, dst: str, dst_ids: list[int], src: str, src_ids: list[int]) -> None:
        """Every worker copies its shard's ``src`` tier blocks into its ``dst`` tier blocks."""
        with self._guard("KV move"):
            self._send(MOVE_KV, [OP_TIERS.index(dst), OP_TIERS.index(src), *dst_ids, *src_ids])

    def make_pool(self, factory):
        """The pool class to build: a ``ShardedPool`` over this group."""
        if factory is not MemPool:
            raise ConfigError("a tensor-parallel instance builds its own pool (ShardedPool)")
        return functools.partial(ShardedPool, group=self)

    def close(self) -> None:
        """Tell the workers to exit and wait for them (killing any that do not)."""
        if self.dead is None:
            self.dead = "the tensor-parallel group was closed"
            with contextlib.suppress(Exception):  # a worker that is already gone
                self._send(STOP, [])
            for p in self.procs:
                p.join(JOIN_TIMEOUT_S)
        reap_workers(self.procs)
