"""The tiers as one chain: a tier defined here (one class) and put in a pool's chain (one
line) carries a workload down and back up with the books balanced; and the disk tier's
files: capacity, checksums, persistence, the lock, the bounded write queue."""

from __future__ import annotations

import logging
import threading
import zlib

import pytest
import torch

from minimemserve.blocks.layout import KVLayout
from minimemserve.errors import ConfigError
from minimemserve.mempool import Disk, Dram, MemPool
from minimemserve.mempool.chain import default_chain

BS = 4
LAYOUT = KVLayout(num_layers=2, block_size=BS, num_kv_heads=1, head_dim=2)


class Remote(Dram):
    """A fourth tier for the test: host memory again, under another name."""

    name = "remote"


def tag(tokens: list[int], i: int) -> float:
    """What block ``i`` of ``tokens`` holds: a function of the tokens up to its end."""
    return float(zlib.crc32(bytes(tokens[: (i + 1) * BS])) % 65536)


def seqs(n: int, blocks: int = 3) -> list[list[int]]:
    """``n`` prompts of ``blocks`` whole blocks sharing their first block in pairs."""
    return [[i // 2] * BS + [i % 250 + 1] * (blocks - 1) * BS for i in range(n)]


def serve(pool: MemPool, tokens: list[int]) -> int:
    """One request: match, check what came back, fill the rest, insert, free; the hit."""
    got = pool.match(tokens)
    kv = pool.kv()
    for i, b in enumerate(got):
        assert torch.all(kv[b] == tag(tokens, i)), f"block {i} of a hit holds other tokens' KV"
    rest = pool.alloc_mem(len(tokens) // BS - len(got))
    for i, b in enumerate(rest, start=len(got)):
        kv[b] = tag(tokens, i)
    pool.insert(tokens, got + rest)
    pool.free_mem(got + rest)
    pool.check()
    return len(got)


def files(directory) -> list:
    return sorted(directory.glob("blk-*.kv"))


def test_a_fourth_tier_is_one_class_and_one_line(tmp_path):
    pool = MemPool(LAYOUT, 6, tiers=[Dram(6), Disk(6, tmp_path), Remote(9)])
    assert pool.tiers == ("hbm", "dram", "disk", "remote")
    prompts = seqs(10)
    for p in prompts:  # 30 blocks through 27 places: every tier fills, the first go to remote
        serve(pool, p)
        assert len(files(tmp_path)) <= 6
    hits = [serve(pool, p) for p in prompts]  # promoted back up, each checked on the way
    assert sum(hits) > 0
    c = pool.stats()["counters"]["tiers"]
    for name in ("hbm", "dram", "disk"):
        assert c[name]["demoted_blocks"] > 0, name
    assert c["remote"]["promoted_blocks"] > 0 and c["remote"]["hit_tokens"] > 0
    assert c["disk"]["written_bytes"] > 0 and c["disk"]["read_bytes"] > 0
    assert sum(t["hit_tokens"] for t in c.values()) == pool.counters["hit_tokens"]
    pool.check()
    pool.close()


def test_disk_tier_needs_a_directory_and_one_owner(tmp_path):
    with pytest.raises(ConfigError, match="disk_dir"):
        MemPool(LAYOUT, 4, tiers=default_chain(disk_blocks=4))
    with pytest.raises(ConfigError, match="disk_blocks"):
        MemPool(LAYOUT, 4, tiers=default_chain(disk_dir=str(tmp_path)))
    first = MemPool(LAYOUT, 4, tiers=[Disk(4, str(tmp_path))])
    with pytest.raises(ConfigError, match=str(tmp_path)):
        MemPool(LAYOUT, 4, tiers=[Disk(4, str(tmp_path))])
    first.close()
    MemPool(LAYOUT, 4, tiers=[Disk(4, str(tmp_path))]).close()  # free once released


def fill_disk(directory, prompts, **kw) -> MemPool:
    """A pool whose hbm is too small for ``prompts``: what it evicts goes to disk."""
    pool = MemPool(LAYOUT, 3, tiers=[Disk(16, str(directory))], **kw)
    for p in prompts:
        serve(pool, p)
    pool.store("disk").flush()
    return pool


def test_a_restarted_pool_serves_what_its_directory_holds(tmp_path):
    prompts = seqs(4)
    fill_disk(tmp_path, prompts, model="m").close()
    again = MemPool(LAYOUT, 3, tiers=[Disk(16, str(tmp_path))], model="m")
    # what reached disk along a path from the root (a block whose parent stayed in hbm went)
    on_disk = [len(again.index.match_prefix(p, touch=False).values) for p in prompts]
    assert sum(on_disk) >= 5
    hits = [serve(again, p) for p in prompts]  # contents checked on the way
    assert all(h >= d for h, d in zip(hits, on_disk)) and hits[:2] == on_disk[:2] == [3, 3]
    again.close()


def test_another_model_or_layout_starts_empty_and_says_why(tmp_path, caplog):
    fill_disk(tmp_path, seqs(4), model="m").close()
    with caplog.at_level(logging.WARNING):
        other = MemPool(LAYOUT, 3, tiers=[Disk(16, str(tmp_path))], model="n")
    assert other.index.num_blocks == 0 and not files(tmp_path)
    assert "model: was 'm', now 'n'" in caplog.text
    other.close()
    fill_disk(tmp_path, seqs(4), model="n").close()
    wide = KVLayout(num_layers=2, block_size=BS, num_kv_heads=2, head_dim=2)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        MemPool(wide, 3, tiers=[Disk(16, str(tmp_path))], model="n").close()
    assert "layout" in caplog.text


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap"])
def test_a_damaged_block_is_a_miss(tmp_path, damage):
    prompts = seqs(4)
    fill_disk(tmp_path, prompts).close()
    again = MemPool(LAYOUT, 3, tiers=[Disk(16, str(tmp_path))])
    # the first prompt's second block: its file, found by what the index lists
    node = again.index.match_prefix(prompts[0], touch=False)
    victim = tmp_path / f"blk-{node.values[1]:08d}.kv"
    blob = bytearray(victim.read_bytes())
    if damage == "flip":
        blob[-1] ^= 0xFF
    elif damage == "truncate":
        blob = blob[: len(blob) // 2]
    else:  # a whole, valid block of another path put in its place
        other = again.index.match_prefix(prompts[1], touch=False).values[2]
        blob = bytearray((tmp_path / f"blk-{other:08d}.kv").read_bytes())
    victim.write_bytes(bytes(blob))
    assert serve(again, prompts[0]) == 1  # the block before it only; contents checked
    assert again.stats()["counters"]["tiers"]["disk"]["corrupt_blocks"] == 1
    assert serve(again, prompts[0]) == 3  # recomputed, cached again
    again.close()


def test_a_full_write_queue_drops_blocks_and_never_waits(tmp_path, monkeypatch):
    from minimemserve.mempool.disk import DiskStore

    gate = threading.Event()
    write = DiskStore._write_file
    monkeypatch.setattr(
        DiskStore, "_write_file", lambda s, b, blob: (gate.wait(), write(s, b, blob))
    )
    pool = MemPool(LAYOUT, 3, tiers=[Disk(16, tmp_path, queue_blocks=2)])
    prompts = seqs(6)
    for p in prompts:  # the writer is stuck: two blocks queue, the rest are dropped
        serve(pool, p)
    c = pool.stats()["counters"]["tiers"]
    assert c["disk"]["write_refused"] > 0 and c["hbm"]["dropped_blocks"] > 0
    assert c["hbm"]["demoted_blocks"] == 2
    assert pool.index.num_blocks <= 3 + 2
    gate.set()
    pool.store("disk").flush()
    assert len(files(tmp_path)) == 2
    pool.close()
