"""The disk tier under the engine: an instance killed while its disk writer is busy restarts on
its directory and serves what survived, with the same greedy tokens as a cold run; a block
altered on purpose is a miss."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from minimemserve import LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
SIZES = dict(num_blocks=12, dram_blocks=6, disk_blocks=64)  # hbm and dram overflow to disk
# the instance to kill: its writer is slowed so blocks are still queued when it is killed
CHILD = textwrap.dedent(
    """
    import json, sys, time
    from minimemserve import LLM, SamplingParams
    from minimemserve.mempool.disk import DiskStore

    write = DiskStore._write_file
    DiskStore._write_file = lambda s, b, blob: (time.sleep(0.2), write(s, b, blob))
    model, disk, prompts, sizes = sys.argv[1], sys.argv[2], *map(json.loads, sys.argv[3:])
    llm = LLM(model, config="PD-CC", disk_dir=disk, **sizes)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for p in prompts:
        llm.generate([p], params)
    disk = llm.pool.store("disk")
    while disk.stats()["queued_blocks"] > 2:  # most written: whole paths are on disk
        time.sleep(0.01)
    print(json.dumps(disk.stats()), flush=True)
    time.sleep(600)
    """
)


def prompts(n: int = 8) -> list[list[int]]:
    """Prompts of 4 to 5 blocks, in pairs sharing their first block: the first ones are pushed
    whole through hbm and dram to disk by the later ones."""
    return [
        [(i // 2) * 13 % 500 + 5] * 16 + [(i * 31 + j) % 500 + 5 for j in range(50 + 3 * i)]
        for i in range(n)
    ]


def run(llm: LLM, ps: list[list[int]]) -> list:
    params = SamplingParams(max_tokens=6, **GREEDY)
    return [llm.generate([p], params)[0] for p in ps]


@pytest.mark.slow
def test_killed_while_writing_restarts_with_what_survived(tiny_llama_dir, tmp_path):
    disk, ps = tmp_path / "kv", prompts()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tiny_llama_dir), str(disk), json.dumps(ps)]
        + [json.dumps(SIZES)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = child.stdout.readline()
        assert json.loads(line)["queued_blocks"] > 0, "the writer was idle when it died"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    (instance,) = [d for d in disk.iterdir() if d.is_dir()]
    written = list(instance.glob("blk-*.kv"))
    assert 0 < len(written) <= SIZES["disk_blocks"]

    again = LLM(tiny_llama_dir, config="PD-CC", disk_dir=str(disk), **SIZES)
    index = again.pool.index
    assert index.num_blocks > 0, "nothing survived the kill"
    # alter one block a prompt will read: the second restored block of the longest path
    longest = max(ps, key=lambda p: len(index.match_prefix(p, touch=False).values))
    path = index.match_prefix(longest, touch=False).values
    assert len(path) >= 2
    victim = instance / f"blk-{path[1]:08d}.kv"
    blob = bytearray(victim.read_bytes())
    blob[-3] ^= 0x5A
    victim.write_bytes(bytes(blob))

    order = [longest] + [p for p in ps if p is not longest]
    got = run(again, order)
    disk_stats = again.pool.stats()["counters"]["tiers"]["disk"]
    again.close()
    cold = run(LLM(tiny_llama_dir, config="PD", num_blocks=256), order)
    assert [o.token_ids for o in got] == [o.token_ids for o in cold]
    assert got[0].metrics.cached_tokens == 16  # the hit stops at the altered block
    assert disk_stats["corrupt_blocks"] == 1
    assert disk_stats["hit_tokens"] > 16  # the other prompts hit what survived on disk
    assert len(list(instance.glob("blk-*.kv"))) <= SIZES["disk_blocks"]


@pytest.mark.parametrize("command", ["serve", "bench", "sim"])
def test_every_entry_point_names_the_tiers_alike(command):
    from minimemserve.cli import build_parser

    args = ["--dram-blocks", "8", "--disk-blocks", "64"]
    if command != "sim":  # the simulator takes capacities only
        args += ["--disk-dir", "/tmp/kv"]
    parsed = build_parser().parse_args([command, *args])
    assert (parsed.dram_blocks, parsed.disk_blocks) == (8, 64)
    assert getattr(parsed, "disk_dir", None) == (None if command == "sim" else "/tmp/kv")


def test_a_disk_dir_needs_a_capacity(tiny_llama_dir, tmp_path):
    from minimemserve.errors import ConfigError

    with pytest.raises(ConfigError, match="disk_blocks"):
        LLM(tiny_llama_dir, config="PD-CC", disk_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="disk_dir"):
        LLM(tiny_llama_dir, config="PD-CC", disk_blocks=8)
