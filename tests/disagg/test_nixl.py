"""KV over NIXL at the level of one agent per pool: writes from either tier and from memory it
did not register, the receiver's checks on what a peer claims, a commit that comes before the
write's notification, and a peer killed in the middle of a write (both sides)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import msgspec
import pytest
import torch

from minimemserve.blocks.layout import KVLayout
from minimemserve.disagg import rpc
from minimemserve.disagg.nixl import NixlEndpoint, NixlInfo, nixl_missing
from minimemserve.disagg.peering import Grants
from minimemserve.errors import TransferError
from minimemserve.mempool import MemPool

if (_why := nixl_missing()) is not None:
    pytest.skip(_why, allow_module_level=True)

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)  # 1 KiB fp32 blocks
BIG = KVLayout(num_layers=8, block_size=16, num_kv_heads=8, head_dim=64)  # 512 KiB blocks
BIG_BLOCKS = 256  # 128 MiB: a write long enough to be cut in the middle
WAIT_S = 1.0  # how long an endpoint here waits for a write or its notification
DEATH_S = 30.0  # a write to or from a killed process must have ended by then


def _endpoint(name: str, pool: MemPool, timeout_s: float = WAIT_S) -> NixlEndpoint:
    return NixlEndpoint(f"{name}-{os.getpid()}", pool, timeout_s)


def _filled(layout: KVLayout, n: int, dram: int = 0, seed: int = 0, device: str = "cpu") -> MemPool:
    pool = MemPool(layout, n, dram_blocks=dram, device=device)
    g = torch.Generator().manual_seed(seed)
    for tier in pool.tiers:
        pool.kv(tier).copy_(torch.randn(pool.kv(tier).shape, generator=g))
    return pool


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def pair(request):
    """Two endpoints in this process, each with the other's agent loaded: pools in DRAM, or
    in VRAM (a dram tier beside it)."""
    device = request.param
    a_pool, b_pool = _filled(LAYOUT, 16, dram=8, device=device), MemPool(LAYOUT, 16, device=device)
    a, b = _endpoint("A", a_pool), _endpoint("B", b_pool)
    ab, ba = a.connect("B", b.info()), b.connect("A", a.info())
    yield a, b, ab, ba
    for x in (ab, ba, a, b):
        x.close()


def test_writes_from_either_tier_and_from_unregistered_memory_arrive(pair):
    a, b, ab, ba = pair
    src, dram = a.pool.kv(), a.pool.kv("dram")
    loose = torch.randn(3, *src.shape[1:], device=src.device)  # a tensor-parallel gather
    cases = [("x1", src, [5, 1, 9]), ("x2", dram, [7, 0]), ("x3", loose, [2, 0, 1])]
    for xfer, tensor, ids in cases:
        dst = b.pool.alloc_mem(len(ids))
        ab.write(None, xfer, dst, tensor, ids)
        ba.await_landing(xfer, dst)  # the notification is in: every block arrived
        assert torch.equal(b.pool.kv()[dst].cpu(), tensor[ids].cpu())
        b.pool.free_mem(dst)
    block = LAYOUT.block_bytes(4)
    assert ab.stats() | {"sent_bytes": 8 * block, "sent_messages": 3} == ab.stats()
    assert ba.stats()["recv_bytes"] == 8 * block and ba.stats()["recv_messages"] == 3
    assert b.pool.num_free() == 16


def test_what_a_peer_claims_is_checked(pair):
    a, b, ab, ba = pair
    info = b.info()
    other = MemPool(KVLayout(1, 4, 2, 8), 4)  # blocks of another size: another model
    c = _endpoint("C", other)
    with pytest.raises(TransferError, match="bytes"):
        a.connect("C", c.info())
    c.close()
    with pytest.raises(TransferError, match="does not load"):
        a.connect("C", NixlInfo("C", b"\x00garbage", 4096, info.block_bytes, 4, "DRAM"))
    renamed = NixlInfo("someone-else", *[getattr(info, f) for f in info.__struct_fields__[1:]])
    with pytest.raises(TransferError, match="names agent"):
        a.connect("B2", renamed)
    with pytest.raises(TransferError, match="outside"):  # never posted
        ab.write(None, "x", [info.num_blocks], a.pool.kv(), [0])
    with pytest.raises(TransferError, match="0 of 2"):  # nothing was written: no commit
        ba.await_landing("never", [3, 4])
    for junk in ("x9|\u00b2", "x9|-1", "x9", "|1"):  # notifications are a peer's bytes
        a.agent.nixl.send_notif(ab.agent, junk.encode())
    with pytest.raises(TransferError, match="0 of 1"):  # none of them counts as a write
        ba.await_landing("x9", [5])
    dst = b.pool.alloc_mem(2)
    ab.write(None, "x4", dst, a.pool.kv(), [0, 1])
    with pytest.raises(ValueError, match="notified 2"):  # more than the transfer was granted
        ba.await_landing("x4", dst[:1])
    b.pool.free_mem(dst)


def test_a_commit_before_the_write_is_refused_and_the_abort_frees_both_sides(pair):
    a, b, ab, ba = pair
    grants = Grants("B", b.pool, vocab_size=100, links={"A": ba})
    granted = grants.on_alloc("A", rpc.AllocRequest("x5", None, 3))
    blocks = granted.matched + granted.new
    with pytest.raises(TransferError, match="0 of 3"):  # the sender commits, never wrote
        grants.on_commit("A", rpc.Commit("x5", None, blocks))
    assert b.pool.num_free() == 16 - 3 and grants.xfers  # nothing kept, nothing released
    grants.on_abort("A", rpc.Abort("x5", blocks))
    assert b.pool.num_free() == 16 and grants.totals() == {"A": 0} and not grants.xfers
    b.pool.check()


# ---- a peer killed in the middle of a write --------------------------------------------------
def _receiver(out: mp.Queue) -> None:
    """A receiving pool that publishes its agent and waits to be killed."""
    pool = MemPool(BIG, BIG_BLOCKS)
    ep = _endpoint("R", pool)
    out.put(msgspec_bytes(ep.info()))
    time.sleep(600)


def _sender(info: bytes, out: mp.Queue) -> None:
    """Post one large write into the parent's pool and die before it can complete."""
    pool = _filled(BIG, BIG_BLOCKS, seed=1)
    ep = _endpoint("S", pool)
    link = ep.connect("R", rpc_info(info))
    out.put(msgspec_bytes(ep.info()))
    out.close()
    out.join_thread()  # in the pipe before this process dies
    rows, device = ep.source_rows(pool.kv(), range(BIG_BLOCKS))
    notif = f"x{BIG_BLOCKS}|{BIG_BLOCKS}".encode()
    threading.Thread(
        target=ep.write,
        args=(link.agent, link.info, rows, list(range(BIG_BLOCKS)), "DRAM", device, notif),
        daemon=True,
    ).start()
    time.sleep(0.002)  # the write is posted and under way
    os.kill(os.getpid(), signal.SIGKILL)


def msgspec_bytes(info: NixlInfo) -> bytes:
    return msgspec.msgpack.encode(info)


def rpc_info(data: bytes) -> NixlInfo:
    return msgspec.msgpack.decode(data, type=NixlInfo)


def test_receiver_killed_mid_write_fails_the_sender_without_a_hang():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    child = ctx.Process(target=_receiver, args=(q,), daemon=True)
    child.start()
    pool = _filled(BIG, BIG_BLOCKS)
    ep = _endpoint("S", pool, timeout_s=5.0)
    try:
        link = ep.connect("R", rpc_info(q.get(timeout=60)))
        link.write(None, "x0", list(range(BIG_BLOCKS)), pool.kv(), range(BIG_BLOCKS))
        threading.Timer(0.05, os.kill, (child.pid, signal.SIGKILL)).start()
        start, writes = time.monotonic(), 0
        with pytest.raises(TransferError):
            while time.monotonic() - start < DEATH_S:
                link.write(
                    None, f"x{writes + 1}", list(range(BIG_BLOCKS)), pool.kv(), range(BIG_BLOCKS)
                )
                writes += 1
        assert time.monotonic() - start < DEATH_S
        pool.check()
    finally:
        child.kill()
        child.join(10)
        ep.close()


def test_sender_killed_mid_write_leaves_nothing_committed_or_held():
    ctx = mp.get_context("spawn")
    pool = MemPool(BIG, BIG_BLOCKS)
    ep = _endpoint("R", pool, timeout_s=3.0)
    q = ctx.Queue()
    grants = Grants("R", pool, vocab_size=100, links={})
    granted = grants.on_alloc("S", rpc.AllocRequest(f"x{BIG_BLOCKS}", None, BIG_BLOCKS))
    assert granted.new == list(range(BIG_BLOCKS)) and pool.num_free() == 0
    child = ctx.Process(target=_sender, args=(msgspec_bytes(ep.info()), q), daemon=True)
    child.start()
    try:
        link = ep.connect("S", rpc_info(q.get(timeout=60)))
        grants.links["S"] = link
        child.join(DEATH_S)
        assert child.exitcode == -signal.SIGKILL
        commit = rpc.Commit(f"x{BIG_BLOCKS}", None, granted.new)
        try:  # what a commit would find: the whole write, or no notification at all
            grants.on_commit("S", commit)
            want = _filled(BIG, BIG_BLOCKS, seed=1).kv()
            assert torch.equal(pool.kv(), want), "notified, but not every block arrived"
            pool.free_mem(granted.new)
            grants.ungrant("S", granted.new)
        except TransferError as e:
            assert "of 256 blocks" in str(e)
        grants.drop("S")  # the frontend reports the sender dead: its blocks go back
        assert pool.num_free() == BIG_BLOCKS and grants.totals() == {}
        pool.check()
    finally:
        child.kill()
        ep.close()
