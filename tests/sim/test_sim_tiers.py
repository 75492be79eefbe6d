"""Tier moves in virtual time: each priced at the hardware profile's links, a disk whose write
queue drains at the disk's bandwidth, and a replay whose disk tier serves what the DRAM tier
could not hold."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from minimemserve.sim.profiles import GB, HardwareProfile
from minimemserve.sim.tiers import QueuedDiskStore, TierPrices
from minimemserve.workloads.trace import TRACE_BLOCK, load_trace
from minimemserve_lab.trace_replay import replay_trace, trace_setup

from .test_trace_replay import small_trace  # noqa: F401  (a fixture)


def test_a_move_costs_every_link_it_passes():
    links = HardwareProfile.load("a800").tiers
    prices = TierPrices(links, ("hbm", "dram", "disk"), gpus=8)
    n = 8 * GB
    pcie, nvme = links["dram"], links["disk"]
    up = n / (nvme.up_gb_per_s * GB * 8) + n / (pcie.up_gb_per_s * GB * 8)
    assert prices.seconds("disk", "hbm", n) == pytest.approx(up)  # disk -> dram -> hbm
    assert prices.seconds("dram", "hbm", n) == pytest.approx(n / (pcie.up_gb_per_s * GB * 8))
    assert prices.seconds("hbm", "dram", n) == pytest.approx(n / (pcie.down_gb_per_s * GB * 8))
    assert prices.seconds("dram", "disk", n) == 0.0  # queued off the step path
    assert "PM1733" in nvme.source and "PCI-SIG" in pcie.source


def test_a_full_disk_queue_refuses_until_it_drains():
    now = [0.0]
    store = QueuedDiskStore(None, 0, block_s=0.5, queue_blocks=4, clock=lambda: now[0])
    assert store.intake(6) == 4 and store.refused == 2
    now[0] = 1.0  # two blocks written since
    assert store.intake(5) == 2
    now[0] = 10.0
    assert store.intake(3) == 3


def test_a_disk_tier_serves_what_dram_could_not_hold(small_trace):  # noqa: F811
    trace = load_trace(small_trace)
    longest = max(len(r.hash_ids) for r in trace.requests) + 1
    rows = {}
    for name, dram, disk in (("dram", 40, 0), ("disk", 40, 400)):
        setup = trace_setup(
            "prompt_tree",
            instances=1,
            dram_tokens=dram * TRACE_BLOCK,
            disk_tokens=disk * TRACE_BLOCK,
        )
        setup.num_blocks = longest * TRACE_BLOCK // setup.engine_config.block_size
        rows[name] = replay_trace(setup, "PD-CC", trace, 1, False)
        if name == "disk":
            free = replace(setup, topology=replace(setup.topology, tiers=None))
            rows["free"] = replay_trace(free, "PD-CC", trace, 1, False)
    with_disk, only_dram = rows["disk"], rows["dram"]
    assert with_disk["hit_rate"] > only_dram["hit_rate"]
    by_tier = with_disk["hit_rate_by_tier"]
    assert by_tier["disk"] > 0 and sum(by_tier.values()) == pytest.approx(with_disk["hit_rate"])
    assert with_disk["tier_blocks"]["dram"]["demoted_blocks"] > 0
    assert with_disk["tier_blocks"]["disk"]["promoted_blocks"] > 0
    # the same run with tier moves free: the same hits, less prefill time
    assert rows["free"]["hit_rate"] == with_disk["hit_rate"]
    assert rows["free"]["prefill_s_per_request"] < with_disk["prefill_s_per_request"]


def test_cli_tier_study(small_trace, tmp_path):  # noqa: F811
    from minimemserve.cli import main

    assert main(["sim", "--trace", str(small_trace), "--tiers", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "trace_tiers.json").read_text())
    rows = {r["tiers"]: r for r in result["tiers"]}
    assert list(rows) == ["hbm", "hbm+dram", "hbm+dram+disk"]
    assert rows["hbm"]["hit_rate_by_tier"].keys() == {"hbm"}
    assert rows["hbm+dram+disk"]["hit_rate_by_tier"].keys() == {"hbm", "dram", "disk"}
    assert all(r["errors"] == 0 and r["requests"] == 40 for r in rows.values())
    assert (tmp_path / "trace_tiers.png").stat().st_size > 0
