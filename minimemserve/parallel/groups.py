"""An instance's process groups (the gloo control group, the compute group: gloo on CPU, NCCL on
CUDA) and what rank 0 announces on the control group: op codes and steps as int64s."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ..attention.base import SeqSlice
from ..mempool.chain import DRAM, HBM
from .store import LOOPBACK

START_TIMEOUT = timedelta(seconds=180)  # a worker imports torch and loads its shard (slow CPUs)
# workers wait this long for the next step of an idle instance; a dead rank 0 is noticed at
# once (its connections close and the watchdog sees the parent end), not by this timeout
IDLE_TIMEOUT = timedelta(days=30)
# control-message ops: stop; run a step; send KV blocks to rank 0; receive KV blocks from it
STOP, STEP, SEND_KV, RECV_KV, MOVE_KV = range(5)
OP_TIERS = (HBM, DRAM)  # a tier's code in a KV op is its index here
HEADER = 3  # op, payload length, the rank a KV op addresses
KV_TAG = 7  # tag of the point-to-point KV messages on the compute group


def rank_device(device: str, rank: int) -> torch.device:
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


def open_groups(store, rank: int, size: int, device: torch.device, timeout_s: float):
    """The control group (gloo, step metadata on the host) and the compute group. Rank 0 waits
    ``timeout_s`` in each; a worker waits for rank 0's next announcement without end."""
    timeout = timedelta(seconds=timeout_s)
    control = _gloo(
        dist.PrefixStore("control", store), rank, size, timeout if rank == 0 else IDLE_TIMEOUT
    )
    make = _COMPUTE_BACKENDS[device.type]
    return control, make(dist.PrefixStore("compute", store), rank, size, timeout)


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
