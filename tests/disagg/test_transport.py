"""KV data plane: shared-memory one-sided writes, gloo point-to-point, copies, path choice."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os

import msgpack
import pytest
import torch
from helpers import listening

from minimemserve.errors import TransferError
from minimemserve.mempool.shared import SHM_DIR, SharedHandle, SharedPoolTensor, attach
from minimemserve_lab.harness.transfer_paths import (
    BenchGlooTransport,
    CopyTransport,
    SharedMemoryTransport,
    SharedTensorFactory,
    TransferMode,
    TransportKind,
    copy_blocks,
    pieces_per_transfer,
    remove_stale_segments,
    start_store,
)

NUM_BLOCKS = 12
LAYERS = 3
BLOCK = (LAYERS, 2, 4, 2, 8)  # [L, 2, block_size, n_kv_heads, head_dim]
SRC_IDS = [9, 2, 5, 11, 0]
DST_IDS = [3, 10, 1, 7, 4]  # non-contiguous, not sorted
JOIN_S = 30


def _prefix(tag: str) -> str:
    return f"mmstest{tag}{os.getpid()}"


def _segments(prefix: str) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(prefix + "-")]


def _aggregated_src(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((NUM_BLOCKS, *BLOCK), generator=g)  # [N, L, 2, bs, h, d]


def _per_layer(t: torch.Tensor) -> torch.Tensor:
    return t.permute(1, 2, 0, 3, 4, 5).contiguous()  # [L, 2, N, bs, h, d]


needs_shm = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm on this host")


def _shm_writer(handle_bytes: bytes) -> None:
    """Child: attach the receiver's pool from a msgpack handle and write into it one-sided."""
    torch.set_num_threads(1)
    handle = msgpack.unpackb(handle_bytes, raw=False)
    transport = SharedMemoryTransport(handle)
    src = _aggregated_src(seed=1)
    transport.send_blocks(src, SRC_IDS[:3], DST_IDS[:3])
    transport.send_layer(src, 1, SRC_IDS[3:], DST_IDS[3:])
    transport.close()


@needs_shm
def test_shared_memory_write_is_visible_in_the_receiver() -> None:
    prefix = _prefix("w")
    with SharedPoolTensor.create((NUM_BLOCKS, *BLOCK), torch.float32, prefix=prefix) as pool:
        payload = msgpack.packb(pool.handle.to_dict(), use_bin_type=True)
        child = mp.get_context("spawn").Process(target=_shm_writer, args=(payload,))
        child.start()
        child.join(JOIN_S)
        assert child.exitcode == 0
        src = _aggregated_src(seed=1)
        assert torch.equal(pool.tensor[DST_IDS[:3]], src[SRC_IDS[:3]])  # bit-exact
        assert torch.equal(pool.tensor[DST_IDS[3:], 1], src[SRC_IDS[3:], 1])
        assert not pool.tensor[DST_IDS[3:], 0].any()  # other layers untouched
        untouched = [b for b in range(NUM_BLOCKS) if b not in DST_IDS]
        assert not pool.tensor[untouched].any()
        assert _segments(prefix) == [pool.name]  # the writer exiting did not unlink it
    assert _segments(prefix) == []


@needs_shm
def test_segments_are_unlinked_on_close_gc_and_when_stale() -> None:
    prefix = _prefix("leak")
    factory = SharedTensorFactory(prefix=prefix)
    a = factory((4, *BLOCK), torch.float16, "cpu")
    b = factory((2, *BLOCK), torch.float32, torch.device("cpu"))
    assert a.dtype == torch.float16 and not a.any()
    assert factory.handle_of(b).shape == (2, *BLOCK)
    with pytest.raises(ValueError, match="not made by"):
        factory.handle_of(torch.zeros(2))
    assert len(_segments(prefix)) == 2
    peer_view = attach(factory.handle_of(a))
    factory.close()
    assert _segments(prefix) == []
    peer_view.fill_(1)  # an existing mapping outlives the unlink
    assert a.sum().item() == a.numel()
    del peer_view, a, b

    dropped = SharedPoolTensor.create((2, *BLOCK), prefix=prefix)
    assert len(_segments(prefix)) == 1
    del dropped
    gc.collect()
    assert _segments(prefix) == []

    # a segment whose owner died without closing it
    child = mp.get_context("spawn").Process(target=int)
    child.start()
    child.join(JOIN_S)
    stale = f"{prefix}-{child.pid}-0badc0de"
    live = f"{prefix}-{os.getpid()}-600dc0de"
    for name in (stale, live):
        open(os.path.join(SHM_DIR, name), "wb").close()
    try:
        assert remove_stale_segments(prefix) == [stale]
        assert _segments(prefix) == [live]
    finally:
        for name in _segments(prefix):
            os.unlink(os.path.join(SHM_DIR, name))


@needs_shm
def test_attach_rejects_bad_handles() -> None:
    prefix = _prefix("bad")
    with SharedPoolTensor.create((2, *BLOCK), prefix=prefix) as pool:
        good = pool.handle.to_dict()
        assert msgpack.unpackb(msgpack.packb(good), raw=False) == good  # plain values only
        assert SharedHandle.from_dict(good) == pool.handle
        with pytest.raises(TransferError, match="has .* bytes"):
            attach({**good, "nbytes": good["nbytes"] * 2})
        with pytest.raises(TransferError, match="unknown dtype"):
            attach({**good, "dtype": "no_such_dtype"})
        with pytest.raises(TransferError, match="malformed"):
            attach({k: v for k, v in good.items() if k != "shape"})
        gone = {**good, "name": f"{prefix}-1-missing"}
    with pytest.raises(TransferError, match="does not exist"):
        attach(good)  # closed: nobody can attach any more
    with pytest.raises(TransferError, match="does not exist"):
        attach(gone)
    assert _segments(prefix) == []
    with pytest.raises(ValueError, match="positive"):
        SharedPoolTensor.create((0, 3), prefix=prefix)


@pytest.mark.parametrize("mode", list(TransferMode))
def test_copy_modes_are_exact(mode: TransferMode) -> None:
    src = _aggregated_src(seed=2)
    dst = torch.zeros_like(src)
    if mode is TransferMode.BY_REQUEST:
        src, dst = _per_layer(src), _per_layer(dst)
    calls = copy_blocks(dst, src, SRC_IDS, DST_IDS, mode)
    assert calls == pieces_per_transfer(mode, LAYERS, len(SRC_IDS))
    _assert_moved(dst, src, mode)


def _assert_moved(dst: torch.Tensor, src: torch.Tensor, mode: TransferMode) -> None:
    """dst holds src's SRC_IDS blocks at DST_IDS, bit for bit, and zeros elsewhere."""
    others = [b for b in range(NUM_BLOCKS) if b not in DST_IDS]
    if mode is TransferMode.BY_REQUEST:
        assert torch.equal(dst[:, :, DST_IDS], src[:, :, SRC_IDS]), mode
        assert not dst[:, :, others].any(), mode
    else:
        assert torch.equal(dst[DST_IDS], src[SRC_IDS]), mode
        assert not dst[others].any(), mode


def test_copy_transport_contiguous_run_and_bad_input() -> None:
    src = _aggregated_src(seed=3)
    dst = torch.zeros_like(src)
    transport = CopyTransport(dst, mode=TransferMode.PACKED)
    assert transport.one_sided and transport.kind is TransportKind.COPY
    transport.send_blocks(src, [4, 1, 8], [5, 6, 7])  # gathered straight into dst[5:8]
    assert torch.equal(dst[5:8], src[[4, 1, 8]])
    with pytest.raises(ValueError, match="3 source blocks but 2"):
        transport.send_blocks(src, [0, 1, 2], [0, 1])
    with pytest.raises(ValueError, match="out of range"):
        transport.send_blocks(src, [0], [NUM_BLOCKS])
    with pytest.raises(ValueError, match="dtype mismatch"):
        transport.send_blocks(src.half(), [0], [1])
    with pytest.raises(ValueError, match="block shape mismatch"):
        transport.send_blocks(src[:, :2], [0], [1])
    with pytest.raises(ValueError, match="layer 7 out of range"):
        transport.send_layer(src, 7, [0], [1])


def _gloo_receiver(port: int) -> None:
    """Child, rank 1: receive every mode into zeroed pools and send the pools back."""
    torch.set_num_threads(1)
    with BenchGlooTransport(1, port=port, timeout_s=JOIN_S) as t:
        for mode in TransferMode:
            dst = torch.zeros((NUM_BLOCKS, *BLOCK))
            if mode is TransferMode.BY_REQUEST:
                dst = _per_layer(dst)
            t.recv_blocks(dst, DST_IDS, mode)
            t.send_tensor(dst)
        dst = torch.zeros((NUM_BLOCKS, *BLOCK))
        first = t.recv_blocks(dst, DST_IDS[:2], TransferMode.PACKED, tag=1, wait=False)
        second = t.recv_blocks(dst, DST_IDS[2:], TransferMode.AGGREGATED, tag=2, wait=False)
        second.wait()
        first.wait()
        t.recv_layer(dst, 2, [8], tag=3)
        t.recv_blocks(dst, [5, 6], TransferMode.PACKED, tag=4)  # a run: received in place
        t.send_tensor(dst)


def test_gloo_blocks_are_bit_exact_across_processes() -> None:
    store = start_store(port=0, timeout_s=JOIN_S)
    assert {a for a, port in listening(os.getpid()) if port == store.port} == {"127.0.0.1"}
    child = mp.get_context("spawn").Process(target=_gloo_receiver, args=(store.port,))
    child.start()
    try:
        with BenchGlooTransport(0, store=store, timeout_s=JOIN_S) as t:
            assert t.kind == TransportKind.GLOO and not t.one_sided
            src = _aggregated_src(seed=4)
            for mode in TransferMode:
                s = _per_layer(src) if mode is TransferMode.BY_REQUEST else src
                t.send_blocks(s, SRC_IDS, mode=mode)
                back = torch.empty_like(s)
                t.recv_tensor(back)
                _assert_moved(back, s, mode)
            # two transfers in flight at once, kept apart by tags, then one layer
            a = t.send_blocks(src, SRC_IDS[:2], mode=TransferMode.PACKED, tag=1, wait=False)
            b = t.send_blocks(src, SRC_IDS[2:], mode=TransferMode.AGGREGATED, tag=2, wait=False)
            a.wait()
            b.wait()
            t.send_layer(src, 2, [6], tag=3)
            t.send_blocks(src, [1, 3], mode=TransferMode.PACKED, tag=4)
            back = torch.empty_like(src)
            t.recv_tensor(back)
            assert torch.equal(back[DST_IDS], src[SRC_IDS])
            assert torch.equal(back[5:7], src[[1, 3]])
            assert torch.equal(back[8, 2], src[6, 2]) and not back[8, :2].any()
    finally:
        child.join(JOIN_S)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


def test_gloo_rejects_bad_setup() -> None:
    with pytest.raises(ValueError, match="ranks, 0 and 1"):
        BenchGlooTransport(2)
    with pytest.raises(ValueError, match="port of rank 0"):
        BenchGlooTransport(1, port=0)


def _cuda_writer(handle_bytes: bytes) -> None:
    handle = msgpack.unpackb(handle_bytes, raw=False)
    transport = SharedMemoryTransport(handle)
    src = _aggregated_src(seed=5).cuda()
    transport.send_blocks(src, SRC_IDS, DST_IDS)
    transport.close()


@pytest.mark.gpu
def test_cuda_ipc_write_is_visible_in_the_receiver() -> None:
    with SharedPoolTensor.create((NUM_BLOCKS, *BLOCK), device="cuda") as pool:
        assert pool.handle.kind == "cuda_ipc"
        payload = msgpack.packb(pool.handle.to_dict(), use_bin_type=True)
        child = mp.get_context("spawn").Process(target=_cuda_writer, args=(payload,))
        child.start()
        child.join(JOIN_S)
        assert child.exitcode == 0
        torch.cuda.synchronize()
        assert torch.equal(pool.tensor[DST_IDS].cpu(), _aggregated_src(seed=5)[SRC_IDS])
