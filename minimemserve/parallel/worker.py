"""A worker rank (1..N-1) of a tensor-parallel instance: a spawned, daemonic process holding one
model shard and one KV shard, running the ops rank 0 announces until told to stop."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..attention import make_backend
from ..blocks.copy import move_blocks
from ..config import EngineConfig
from ..decode_graphs import DecodeGraphs, run_step
from ..mempool.chain import DRAM, HBM
from ..model.config import ModelConfig
from ..model.loader import load_weights
from .groups import (
    HEADER,
    KV_TAG,
    MOVE_KV,
    OP_TIERS,
    RECV_KV,
    SEND_KV,
    START_TIMEOUT,
    STEP,
    STOP,
    decode_step,
    open_groups,
    rank_device,
)
from .layers import Collectives, build_model
from .shard import TPShard
from .store import LOOPBACK

JOIN_TIMEOUT_S = 10.0  # close() waits this long for each worker to exit before killing it


def reap_workers(procs) -> None:
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

    def __init__(
        self,
        rank: int,
        size: int,
        port: int,
        model_dir: str,
        config: EngineConfig,
        device: str,
        dtype: torch.dtype,
    ):
        """Rank ``rank`` of ``size`` (rank 0's store at ``port``): the shard of ``model_dir`` on
        its share of ``device``, with the instance's ``config`` (``num_blocks`` resolved by
        rank 0)."""
        self.rank = rank
        self.device = rank_device(device, rank)
        self.dtype = dtype
        cfg = ModelConfig.from_hf(model_dir)
        shard = TPShard(rank, size, cfg)
        weights = load_weights(Path(model_dir), cfg, self.dtype, self.device)
        store = dist.TCPStore(LOOPBACK, port, size, False, timeout=START_TIMEOUT)
        store.set(f"ready{rank}", "1")
        timeout_s = config.collective_timeout_s
        self.control, group = open_groups(store, rank, size, self.device, timeout_s)
        self.comm = Collectives(group, size)
        self.store = store
        self.model = build_model(weights, shard, self.comm)
        self.model.to(device=self.device, dtype=self.dtype).eval()
        layout = shard.kv_layout(config.block_size)
        self.kv = torch.zeros(
            layout.pool_shape(config.num_blocks), dtype=self.dtype, device=self.device
        )
        # the dram tier's shard: host memory, pinned on a CUDA machine, as rank 0's pool has it
        self.tiers = {
            HBM: self.kv,
            DRAM: torch.zeros(
                layout.pool_shape(config.dram_blocks),
                dtype=self.dtype,
                pin_memory=self.device.type == "cuda",
            ),
        }
        self.block_dim = layout.block_dim
        self.backend = make_backend(
            config.attention, self.kv, layout, shard.heads, cfg.head_dim**-0.5
        )
        self.graphs = None  # each rank captures and replays its own (same buckets as rank 0)
        graph_batch = config.decode_graph_batch(self.device)
        if graph_batch and hasattr(self.backend, "plan_graph"):
            args = (graph_batch, config.model_len(cfg))
            self.graphs = DecodeGraphs(self.model, self.backend, *args, capture=True)
        self.ops = {
            STEP: self._step,
            SEND_KV: self._send_kv,
            RECV_KV: self._recv_kv,
            MOVE_KV: self._move_kv,
        }

    @torch.inference_mode()
    def serve(self) -> None:
        """Run the ops rank 0 announces until the stop message."""
        while True:
            header = torch.empty(HEADER, dtype=torch.int64)
            self.control.broadcast(header, 0).wait()
            op, n, rank = header.tolist()
            if op == STOP:
                return
            payload = torch.empty(n, dtype=torch.int64)
            if n:
                self.control.broadcast(payload, 0).wait()
            if op in (STEP, MOVE_KV) or rank == self.rank:
                self.ops[op](payload.tolist())

    def _step(self, msg: list[int]) -> None:
        slices, ids, rows = decode_step(msg)
        run_step(self.model, self.backend, self.graphs, slices, ids, rows, self.device)

    def _send_kv(self, msg: list[int]) -> None:
        kv, blocks = self.tiers[OP_TIERS[msg[0]]], msg[1:]
        piece = kv.index_select(0, torch.tensor(blocks, device=kv.device)).to(self.device)
        self.comm.group.send([piece], 0, KV_TAG).wait()

    def _move_kv(self, msg: list[int]) -> None:
        dst, src, n = (
            self.tiers[OP_TIERS[msg[0]]],
            self.tiers[OP_TIERS[msg[1]]],
            (len(msg) - 2) // 2,
        )
        move_blocks(dst, msg[2 : 2 + n], src, msg[2 + n :], self.block_dim)

    def _recv_kv(self, blocks: list[int]) -> None:
        shape = (len(blocks), *self.kv.shape[1:])
        piece = torch.empty(shape, dtype=self.kv.dtype, device=self.device)
        self.comm.group.recv([piece], 0, KV_TAG).wait()
        self.kv.index_copy_(0, torch.tensor(blocks, device=self.device), piece)


def worker_main(
    rank: int,
    size: int,
    port: int,
    threads: int,
    model_dir: str,
    config: EngineConfig,
    device: str,
    dtype: torch.dtype,
) -> None:
    """A worker rank (see :class:`_Worker`; ``threads``: its torch threads, on its share of
    ``device``): load the shard, then run each announced op until told to stop."""
    torch.set_num_threads(threads)
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    worker, code = _Worker(rank, size, port, model_dir, config, device, dtype), 0
    try:
        worker.serve()
    except Exception as e:  # rank 0 went away or a collective timed out: this rank ends
        print(f"tensor-parallel rank {rank} stops: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    sys.stderr.flush()
    os._exit(code)  # skip the process groups' teardown: their peers may be gone already
