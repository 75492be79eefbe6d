"""Tensor parallelism: one instance's model split Megatron-style over ranks on torch.distributed.

Rank 0 is the engine: its scheduler and its MemPool decide everything (which requests run,
every block id, match, insert, eviction). Ranks 1..N-1 are worker processes (spawned, daemonic)
that hold one model shard and one KV shard tensor indexed by the same block ids; they own no
pool and decide nothing. Each step rank 0 announces the step over a gloo control group: the
token ids, each sequence's ``(num_computed, num_new, block table)`` and the rows to sample.
Every rank then runs its shard of the forward pass on the compute group (gloo on CPU, NCCL on
CUDA). The pool moves KV between blocks only in transfers and between tiers (offload to
dram, onload back): ``ShardedPool`` tells the workers of both (each KV head goes between the
rank holding it and the rank needing it; a tier move is mirrored by every rank on its own
shard); otherwise the step announcement is all a worker needs to keep its shard in step with
rank 0's pool.

What is split where (``r`` = rank, ``n`` = tensor-parallel size):

- ``q/k/v`` and ``gate/up`` projections: column-parallel, rank r computes its heads / its
  slice of the intermediate features; ``o`` and ``down``: row-parallel over the same slices,
  then one all-reduce each (two per layer);
- KV heads: split when ``num_kv_heads >= n``, else each head replicated on
  ``n / num_kv_heads`` ranks (the ranks whose query heads share it);
- embedding: vocabulary-parallel (rank r looks up its rows, zeros elsewhere, one all-reduce);
- LM head: vocabulary-parallel, the logits all-gathered (rank 0 samples).

Every wait of rank 0 has a deadline (``EngineConfig.collective_timeout_s`` per collective or
message): a worker that misses it, stopped, slow or cut off, is killed and its instance fails
with ``InstanceDied``, as when it dies. A worker exits when rank 0 closes the group, when rank
0's process ends (its connections close, and a watchdog thread waits on the parent), or when a
step's collectives time out. Every socket of the group (the store, gloo's pairs) listens on
loopback only."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import socket
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from .attention import make_backend
from .attention.base import SeqSlice
from .blocks.copy import check_pool_tensor, move_blocks
from .blocks.layout import AGGREGATED, KVLayout
from .decode_graphs import DecodeGraphs, run_step
from .errors import ConfigError, InstanceDied
from .mempool import KVReceiver, MemPool
from .mempool.tiers import DRAM, HBM
from .model import registry
from .model.config import ModelConfig
from .model.layers import CausalLM
from .model.loader import EMBED_NAME, LM_HEAD_NAME, load_weights

LOOPBACK = "127.0.0.1"  # the ranks of an instance share one host; the store listens nowhere else
START_TIMEOUT = timedelta(seconds=180)  # a worker imports torch and loads its shard (slow CPUs)
# workers wait this long for the next step of an idle instance; a dead rank 0 is noticed at
# once (its connections close and the watchdog sees the parent end), not by this timeout
IDLE_TIMEOUT = timedelta(days=30)
JOIN_TIMEOUT_S = 10.0  # close() waits this long for each worker to exit before killing it
POLL_S = 0.05  # rank 0 checks this often whether a starting worker is ready or dead
# control-message ops: stop; run a step; send KV blocks to rank 0; receive KV blocks from it
_STOP, _STEP, _SEND_KV, _RECV_KV, _MOVE_KV = range(5)
_TIERS = (HBM, DRAM)  # a tier's code in a KV op is its index here
_HEADER = 3  # op, payload length, the rank a KV op addresses
_KV_TAG = 7  # tag of the point-to-point KV messages on the compute group

# HF projection name -> the slice of its rows (column-parallel) or its columns (row-parallel)
_ROW_SPLIT = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp"}
_COL_SPLIT = {"o_proj": "q", "down_proj": "mlp"}


@dataclasses.dataclass(frozen=True)
class TPShard:
    """The part of ``cfg``'s model that rank ``rank`` of ``size`` holds (size 1: all of it).
    Raises ``ConfigError`` when ``size`` does not divide the attention heads or the
    intermediate size, or neither divides the other with the KV heads."""

    rank: int
    size: int
    cfg: ModelConfig

    def __post_init__(self) -> None:
        cfg = self.cfg
        n = self.size
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"tensor_parallel_size must be an int >= 1, got {n!r}")
        if not 0 <= self.rank < n:
            raise ConfigError(f"rank {self.rank} is outside [0, {n})")
        heads = cfg.num_attention_heads
        kv = cfg.num_key_value_heads
        if heads % n or cfg.intermediate_size % n:
            raise ConfigError(
                f"tensor_parallel_size {n} must divide the attention heads ({heads}) and the "
                f"intermediate size ({cfg.intermediate_size})"
            )
        if kv % n and n % kv:
            raise ConfigError(
                f"tensor_parallel_size {n} and the {kv} KV heads must divide one another "
                "(KV heads are split, or replicated when there are fewer than ranks)"
            )

    @property
    def heads(self) -> int:
        """Query heads on this rank."""
        return self.cfg.num_attention_heads // self.size

    @property
    def kv_heads(self) -> int:
        """KV heads on this rank (1 when they are replicated)."""
        return max(1, self.cfg.num_key_value_heads // self.size)

    @property
    def kv_start(self) -> int:
        """The first KV head on this rank: the one its query heads read."""
        return self.rank * self.heads // self.cfg.num_queries_per_kv

    @property
    def vocab_rows(self) -> int:
        """Embedding and LM-head rows per rank (the last rank's are zero-padded)."""
        return -(-self.cfg.vocab_size // self.size)

    def spans(self) -> dict[str, tuple[int, int]]:
        """Feature ranges of this rank: ``q`` (its heads), ``kv``, ``mlp`` and ``vocab``."""
        d, inter, r = self.cfg.head_dim, self.cfg.intermediate_size // self.size, self.rank
        return {
            "q": (r * self.heads * d, (r + 1) * self.heads * d),
            "kv": (self.kv_start * d, (self.kv_start + self.kv_heads) * d),
            "mlp": (r * inter, (r + 1) * inter),
            "vocab": (r * self.vocab_rows, (r + 1) * self.vocab_rows),
        }

    def local_config(self) -> ModelConfig:
        """The config of this rank's model (its heads, intermediate and vocabulary slices)."""
        return dataclasses.replace(
            self.cfg,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            intermediate_size=self.cfg.intermediate_size // self.size,
            vocab_size=self.vocab_rows,
            head_dim=self.cfg.head_dim,
            bos_token_id=None,  # special ids index the whole vocabulary, not a slice of it
            eos_token_id=None,
            eos_token_ids=(),
        )

    def kv_layout(self, block_size: int) -> KVLayout:
        """The layout of this rank's KV shard (same block ids and sizes on every rank)."""
        cfg = self.cfg
        return KVLayout(cfg.num_hidden_layers, block_size, self.kv_heads, cfg.head_dim)


def shard_weights(weights: Mapping[str, torch.Tensor], shard: TPShard) -> dict[str, torch.Tensor]:
    """HF-named weights cut to ``shard``: projection rows or columns (a q/k/v bias by the rows
    of its projection), vocabulary rows (the last shard zero-padded); norms whole (a q/k norm
    acts on one head's ``head_dim`` features, the same on every rank)."""
    spans, out = shard.spans(), {}
    for name, w in weights.items():
        proj = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if proj in _ROW_SPLIT:
            lo, hi = spans[_ROW_SPLIT[proj]]
            w = w[lo:hi]
        elif proj in _COL_SPLIT:
            lo, hi = spans[_COL_SPLIT[proj]]
            w = w[:, lo:hi]
        elif name in (EMBED_NAME, LM_HEAD_NAME):
            lo, hi = spans["vocab"]
            w = F.pad(w[lo:hi], (0, 0, 0, hi - lo - w[lo:hi].shape[0]))
        out[name] = w.contiguous()
    return out


class Collectives:
    """The compute-group collectives of one rank (what the parallel layers call)."""

    def __init__(self, group, size: int):
        self.group = group
        self.size = size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        self.group.allreduce(x).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, in rank order: one
        gather into one buffer (the form a CUDA graph captures), then one copy."""
        x = x.contiguous()
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        self.group._allgather_base(out, x).wait()  # [size * rows, ...], rank-major
        return out.view(self.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], -1)


class RowParallelLinear(nn.Linear):
    """A bias-free linear layer over this rank's slice of the input features; the partial
    outputs of all ranks are summed by one all-reduce."""

    def __init__(self, in_features: int, out_features: int, comm: Collectives):
        super().__init__(in_features, out_features, bias=False)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / n] -> [T, out]
        return self.comm.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Embedding):
    """Embedding rows ``[first, first + rows)`` of the vocabulary; other ids give zeros here
    and their rows on the rank holding them, summed by one all-reduce."""

    def __init__(self, rows: int, dim: int, first: int, comm: Collectives):
        super().__init__(rows, dim)
        self.first = first
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        local = ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.comm.all_reduce(x.masked_fill_(outside[:, None], 0.0))


class VocabParallelHead(nn.Linear):
    """LM head over this rank's vocabulary rows; the logits of all ranks are gathered and the
    padding cut off, so every rank returns the whole ``[B, vocab]``."""

    def __init__(self, dim: int, rows: int, vocab: int, comm: Collectives):
        super().__init__(dim, rows, bias=False)
        self.vocab = vocab
        self.comm = comm

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [B, hidden] -> [B, vocab]
        return self.comm.all_gather(super().forward(h))[:, : self.vocab]


def build_model(weights: Mapping[str, torch.Tensor], shard: TPShard, comm: Collectives) -> CausalLM:
    """This rank's model: the family's flat model at the shard's sizes, with the parallel
    layers in place of the embedding, the LM head and every ``o``/``down`` projection."""
    local, hidden = shard.local_config(), shard.cfg.hidden_size
    model = registry.build_model(local)
    model.embed_tokens = VocabParallelEmbedding(
        local.vocab_size, hidden, shard.spans()["vocab"][0], comm
    )
    model.lm_head = VocabParallelHead(hidden, local.vocab_size, shard.cfg.vocab_size, comm)
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.q_size, hidden, comm)
        layer.mlp.down_proj = RowParallelLinear(local.intermediate_size, hidden, comm)
    model.load_hf_weights(shard_weights(weights, shard))
    return model


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a worker rank needs to build its shard (sent once, at spawn)."""

    model_dir: str
    size: int
    port: int
    num_blocks: int
    block_size: int
    attention: str | None
    device: str
    dtype: torch.dtype
    threads: int
    dram_blocks: int
    timeout_s: float  # of each compute collective
    graph_batch: int = 0  # decode graphs' largest batch (0: none), the same on every rank
    max_model_len: int = 0  # the longest sequence the graphs serve


def _rank_device(device: str, rank: int) -> torch.device:
    """Rank ``rank``'s device: the same CPU, or CUDA device ``rank`` modulo the count."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", rank % torch.cuda.device_count())


def _gloo(store, rank: int, size: int, timeout: timedelta):
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _nccl(store, rank: int, size: int, timeout: timedelta):
    if torch.cuda.device_count() < size:
        # ranks share a GPU: NCCL refuses two ranks of one host on one device ("Duplicate GPU
        # detected"), so each rank names itself a host of its own (their traffic then goes
        # through NCCL's network transport)
        os.environ["NCCL_HOSTID"] = f"{os.environ.get('NCCL_HOSTID', 'tp')}-rank{rank}"
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts)


_COMPUTE_BACKENDS = {"cpu": _gloo, "cuda": _nccl}  # device type -> compute group


def _groups(store, rank: int, size: int, device: torch.device, timeout_s: float):
    """The control group (gloo, step metadata on the host) and the compute group. Rank 0 waits
    ``timeout_s`` in each; a worker waits for rank 0's next announcement without end."""
    timeout = timedelta(seconds=timeout_s)
    control = _gloo(
        dist.PrefixStore("control", store), rank, size, timeout if rank == 0 else IDLE_TIMEOUT
    )
    make = _COMPUTE_BACKENDS[device.type]
    return control, make(dist.PrefixStore("compute", store), rank, size, timeout)


class HostStore:
    """A ``TCPStore`` listening on ``host`` only (by itself it listens on every interface), on
    ``port`` (0: a free one, then read :attr:`port`): where torch.distributed ranks meet. It has
    no authentication (see the README)."""

    def __init__(self, host: str, timeout_s: float, port: int = 0) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, port))
            sock.listen(128)
            self.port = sock.getsockname()[1]
            self.store = dist.TCPStore(
                host,
                self.port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=timeout_s),
                master_listen_fd=sock.fileno(),
            )
            sock.detach()  # the store owns the socket now, and closes it

    def close(self) -> None:
        self.store = None


def encode_step(slices: list[SeqSlice], ids: list[int], rows: list[int]) -> list[int]:
    """One step as int64s: the counts, then token ids, per-slice counts, block ids, rows."""
    blocks = [b for s in slices for b in s.block_table]
    counts = [x for s in slices for x in (s.num_computed, s.num_new, len(s.block_table))]
    return [len(ids), len(slices), len(blocks), *ids, *counts, *blocks, *rows]


def decode_step(msg: list[int]) -> tuple[list[SeqSlice], list[int], list[int]]:
    """``(slices, ids, rows)`` from ``encode_step``'s message."""
    n_ids, n_slices, n_blocks = msg[:3]
    ids, rest = msg[3 : 3 + n_ids], msg[3 + n_ids :]
    counts, blocks = rest[: 3 * n_slices], rest[3 * n_slices :][:n_blocks]
    rows = rest[3 * n_slices + n_blocks :]
    slices, at = [], 0
    for i in range(n_slices):
        done, new, nb = counts[3 * i : 3 * i + 3]
        slices.append(SeqSlice(blocks[at : at + nb], done, new))
        at += nb
    return slices, ids, rows


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
        num_blocks: int,
        block_size: int,
        attention: str | None,
        device: torch.device,
        dtype: torch.dtype,
        dram_blocks: int,
        timeout_s: float,
        graph_batch: int = 0,
        max_model_len: int = 0,
    ):
        self.size = shard.size
        self.device = device
        self.dtype = dtype
        self.shard = shard
        self.block_size = block_size
        self.shards = [TPShard(r, shard.size, shard.cfg) for r in range(shard.size)]
        self.dead: str | None = None  # why the group stopped, once it has
        self.timeout_s = timeout_s
        self.store = HostStore(LOOPBACK, START_TIMEOUT.total_seconds())
        spec = WorkerSpec(
            str(model_dir),
            self.size,
            self.store.port,
            num_blocks,
            block_size,
            attention,
            str(device),
            dtype,
            max(1, torch.get_num_threads() // self.size),
            dram_blocks,
            timeout_s,
            graph_batch,
            max_model_len,
        )
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(target=_worker_main, args=(r, spec), daemon=True, name=f"tp-rank{r}")
            for r in range(1, self.size)
        ]
        self._reaper = weakref.finalize(self, _reap, self.procs)
        for p in self.procs:
            p.start()
        weights = load_weights(model_dir, shard.cfg, dtype, device)
        self._wait_ready(self.store.store)
        with self._guard("start"):
            self.control, group = _groups(self.store.store, 0, self.size, device, timeout_s)
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
        _reap(self.procs)
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
            self._send(_STEP, encode_step(slices, ids, rows))
            yield

    def pull_kv(self, rank: int, blocks: list[int], tier: str = HBM) -> torch.Tensor:
        """Blocks ``blocks`` of rank ``rank``'s ``tier`` KV shard, sent by it in one message."""
        shape = self.shards[rank].kv_layout(self.block_size).pool_shape(len(blocks))
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        with self._guard("KV send"):
            self._send(_SEND_KV, [_TIERS.index(tier), *blocks], rank)
            self.comm.group.recv([buf], rank, _KV_TAG).wait()
        return buf

    def push_kv(self, rank: int, blocks: list[int], piece: torch.Tensor) -> None:
        """Write ``piece`` (rank ``rank``'s heads of ``blocks``) into that rank's KV shard."""
        with self._guard("KV receive"):
            self._send(_RECV_KV, blocks, rank)
            self.comm.group.send([piece.contiguous()], rank, _KV_TAG).wait()

    def move_kv(self, dst: str, dst_ids: list[int], src: str, src_ids: list[int]) -> None:
        """Every worker copies its shard's ``src`` tier blocks into its ``dst`` tier blocks."""
        with self._guard("KV move"):
            self._send(_MOVE_KV, [_TIERS.index(dst), _TIERS.index(src), *dst_ids, *src_ids])

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
                self._send(_STOP, [])
            for p in self.procs:
                p.join(JOIN_TIMEOUT_S)
        _reap(self.procs)


class ShardedPool(MemPool):
    """The MemPool of a tensor-parallel instance, on rank 0: it keeps the books for every rank
    (one set of block ids), its tensor holds rank 0's heads and the workers hold the others.
    A transfer moves each head slice between the rank holding it and the rank needing it,
    one message per rank pair with every block of the transfer; ``moved`` counts the pieces
    (one block's slice) and bytes per ``("sent" | "received", rank)``."""

    def __init__(self, layout: KVLayout, num_blocks: int, *, group: TPGroup, **kwargs):
        if layout.kind != AGGREGATED:
            raise ConfigError("a tensor-parallel pool uses the aggregated block layout")
        super().__init__(layout, num_blocks, **kwargs)
        self.group = group
        self._model_layout = dataclasses.replace(
            layout, num_kv_heads=group.shard.cfg.num_key_value_heads
        )
        self.block_bytes = self._model_layout.block_bytes(self.dtype.itemsize)
        self.moved: Counter = Counter()
        # each KV head is sent from the first rank holding it; every rank holding it receives it
        heads = [(s.kv_start, s.kv_start + s.kv_heads) for s in group.shards]
        first = {h: r for r, (a, b) in reversed(list(enumerate(heads))) for h in range(a, b)}
        self._holds = heads
        self._owns = [
            sorted(h for h, r in first.items() if r == rank) for rank in range(group.size)
        ]

    @property
    def model_layout(self) -> KVLayout:
        """The layout of the whole model's KV (every head)."""
        return self._model_layout

    def _count(self, what: str, rank: int, piece: torch.Tensor) -> None:
        self.moved[(what, rank, "pieces")] += piece.shape[0]
        self.moved[(what, rank, "bytes")] += piece.numel() * piece.element_size()

    def copy_tier(self, dst: str, dst_ids: list[int], src: str, src_ids: list[int]) -> None:
        """Offload or onload: rank 0 copies its shard, and every worker the same blocks of its."""
        super().copy_tier(dst, dst_ids, src, src_ids)
        self.group.move_kv(dst, dst_ids, src, src_ids)

    def send_blocks(
        self, dst: KVReceiver, blocks: list[int], src: list[int], tier: str = HBM
    ) -> None:
        """Gather every head of ``src`` (in ``tier``) from the ranks owning them, write it
        into ``dst``: from dram straight, each rank reading its own shard."""
        whole = torch.empty(
            self._model_layout.pool_shape(len(src)), dtype=self.dtype, device=self.device
        )
        ids = torch.tensor(src, device=self.device)
        for rank, owned in enumerate(self._owns):
            if not owned:
                continue
            (lo, hi), start = (owned[0], owned[-1] + 1), self._holds[rank][0]
            held = (
                self.kv(tier).index_select(0, ids)
                if rank == 0
                else self.group.pull_kv(rank, src, tier)
            )
            piece = held[..., lo - start : hi - start, :]
            whole[..., lo:hi, :] = piece
            self._count("sent", rank, piece)
        dst.recv_copy(blocks, whole, range(len(src)))

    def recv_copy(self, blocks: Sequence[int], src: torch.Tensor, src_ids: Sequence[int]) -> None:
        """Blocks ``src_ids`` of a whole-model pool tensor ``src`` into ``blocks``: each
        rank's heads go to that rank."""
        check_pool_tensor(self._model_layout, self.dtype, src, "recv_copy")
        blocks = self.held_blocks(blocks, "recv_copy into")
        whole = src.index_select(0, torch.tensor(list(src_ids), device=src.device))
        whole = whole.to(self.device)
        for rank, (lo, hi) in enumerate(self._holds):
            piece = whole[..., lo:hi, :]
            if rank == 0:
                self.kv().index_copy_(0, torch.tensor(blocks, device=self.device), piece)
            else:
                self.group.push_kv(rank, blocks, piece)
            self._count("received", rank, piece)
        self.counters["recv_blocks"] += len(blocks)
        self.counters["recv_bytes"] += len(blocks) * self.block_bytes


def _reap(procs) -> None:
    """Kill the workers still running and collect them."""
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(JOIN_TIMEOUT_S)


def _exit_with_parent() -> None:
    """Watchdog of a worker: end the process when rank 0's process ends."""
    mp.parent_process().join()
    os._exit(0)


class _Worker:
    """A worker rank's state: its model shard, its KV shard and the ops rank 0 sends."""

    def __init__(self, rank: int, spec: WorkerSpec):
        self.rank = rank
        self.device = _rank_device(spec.device, rank)
        cfg = ModelConfig.from_hf(spec.model_dir)
        shard = TPShard(rank, spec.size, cfg)
        weights = load_weights(Path(spec.model_dir), cfg, spec.dtype, self.device)
        store = dist.TCPStore(LOOPBACK, spec.port, spec.size, False, timeout=START_TIMEOUT)
        store.set(f"ready{rank}", "1")
        self.control, group = _groups(store, rank, spec.size, self.device, spec.timeout_s)
        self.comm = Collectives(group, spec.size)
        self.store = store
        self.model = build_model(weights, shard, self.comm)
        self.model.to(device=self.device, dtype=spec.dtype).eval()
        layout = shard.kv_layout(spec.block_size)
        self.kv = torch.zeros(
            layout.pool_shape(spec.num_blocks), dtype=spec.dtype, device=self.device
        )
        # the dram tier's shard: host memory, pinned on a CUDA machine, as rank 0's pool has it
        self.tiers = {
            HBM: self.kv,
            DRAM: torch.zeros(
                layout.pool_shape(spec.dram_blocks),
                dtype=spec.dtype,
                pin_memory=self.device.type == "cuda",
            ),
        }
        self.block_dim = layout.block_dim
        self.backend = make_backend(
            spec.attention, self.kv, layout, shard.heads, cfg.head_dim**-0.5
        )
        self.graphs = None  # each rank captures and replays its own (same buckets as rank 0)
        if spec.graph_batch and hasattr(self.backend, "plan_graph"):
            args = (spec.graph_batch, spec.max_model_len)
            self.graphs = DecodeGraphs(self.model, self.backend, *args, capture=True)
        self.ops = {
            _STEP: self._step,
            _SEND_KV: self._send_kv,
            _RECV_KV: self._recv_kv,
            _MOVE_KV: self._move_kv,
        }

    @torch.inference_mode()
    def serve(self) -> None:
        """Run the ops rank 0 announces until the stop message."""
        while True:
            header = torch.empty(_HEADER, dtype=torch.int64)
            self.control.broadcast(header, 0).wait()
            op, n, rank = header.tolist()
            if op == _STOP:
                return
            payload = torch.empty(n, dtype=torch.int64)
            if n:
                self.control.broadcast(payload, 0).wait()
            if op in (_STEP, _MOVE_KV) or rank == self.rank:
                self.ops[op](payload.tolist())

    def _step(self, msg: list[int]) -> None:
        slices, ids, rows = decode_step(msg)
        run_step(self.model, self.backend, self.graphs, slices, ids, rows, self.device)

    def _send_kv(self, msg: list[int]) -> None:
        kv, blocks = self.tiers[_TIERS[msg[0]]], msg[1:]
        piece = kv.index_select(0, torch.tensor(blocks, device=kv.device)).to(self.device)
        self.comm.group.send([piece], 0, _KV_TAG).wait()

    def _move_kv(self, msg: list[int]) -> None:
        dst, src, n = self.tiers[_TIERS[msg[0]]], self.tiers[_TIERS[msg[1]]], (len(msg) - 2) // 2
        move_blocks(dst, msg[2 : 2 + n], src, msg[2 + n :], self.block_dim)

    def _recv_kv(self, blocks: list[int]) -> None:
        shape = (len(blocks), *self.kv.shape[1:])
        piece = torch.empty(shape, dtype=self.kv.dtype, device=self.device)
        self.comm.group.recv([piece], 0, _KV_TAG).wait()
        self.kv.index_copy_(0, torch.tensor(blocks, device=self.device), piece)


def _worker_main(rank: int, spec: WorkerSpec) -> None:
    """A worker rank: load the shard, then run each announced op until told to stop."""
    torch.set_num_threads(spec.threads)
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    worker, code = _Worker(rank, spec), 0
    try:
        worker.serve()
    except Exception as e:  # rank 0 went away or a collective timed out: this rank ends
        print(f"tensor-parallel rank {rank} stops: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    sys.stderr.flush()
    os._exit(code)  # skip the process groups' teardown: their peers may be gone already
