"""The prefill cost model: fitting, predictions, JSON, and profiling a real engine."""

from __future__ import annotations

import json
import math

import pytest
from helpers import assert_pool_clean

from minimemserve.config import EngineConfig
from minimemserve.engine import Engine
from minimemserve.scheduler.cost_model import CostModel, OpSample
from minimemserve_lab.harness.profile import load_transfer_samples, profile

KNOWN = CostModel(
    linear=(2.0e-5, 1.0e-3),
    attention=(-1.5e-8, 2.0e-8, 1.0e-6, 1.0e-4),
    other=(3.0e-6, 5.0e-4),
    transfer_coef=(1.0e-10, 2.0e-5),
    kv_bytes_per_token=16384,
)
LENGTHS = (16, 64, 100, 256, 512, 1000, 2048)
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 0.9)


def synthetic(model: CostModel) -> list[OpSample]:
    """Samples whose parts are exactly ``model``'s predictions."""
    out = []
    for x in LENGTHS:
        for f in FRACTIONS:
            y = round(x * f) / x
            p = model.parts(x, y)
            out.append(OpSample(x, y, p["linear"], p["attention"], p["other"], sum(p.values())))
    return out


def test_fit_recovers_known_coefficients():
    transfer = [(b, 1.0e-10 * b + 2.0e-5) for b in (1 << 20, 1 << 24, 1 << 26)]
    fitted = CostModel.fit(synthetic(KNOWN), transfer, kv_bytes_per_token=16384)
    for name in ("linear", "attention", "other", "transfer_coef"):
        for got, want in zip(getattr(fitted, name), getattr(KNOWN, name)):
            assert got == pytest.approx(want, rel=1e-7, abs=1e-15), name
    for x, y in [(1, 0.0), (37, 0.3), (2048, 0.9), (3000, 1.0)]:
        assert fitted.exec(x, y) == pytest.approx(KNOWN.exec(x, y), rel=1e-7)


def test_fit_single_transfer_size_is_a_bandwidth():
    fitted = CostModel.fit(synthetic(KNOWN), [(1 << 25, 2e-3), (1 << 25, 4e-3)], 1024)
    assert fitted.transfer_coef == pytest.approx((3e-3 / (1 << 25), 0.0))
    assert fitted.transfer(1 << 15) == pytest.approx(3e-3)


def test_exec_monotone_in_x_and_non_increasing_in_y():
    fitted = CostModel.fit(synthetic(KNOWN))
    ys = [i / 20 for i in range(21)]
    for y in ys:
        times = [fitted.exec(x, y) for x in range(0, 2200, 7)]
        assert all(a <= b for a, b in zip(times, times[1:])), y
    for x in (1, 16, 300, 2047):
        times = [fitted.exec(x, y) for y in ys]
        assert all(a >= b for a, b in zip(times, times[1:])), x
    assert fitted.exec(2048, 0.0) > fitted.exec(2048, 0.9) > 0


def test_parts_sum_and_clamp():
    m = CostModel(linear=(1e-5, -1.0), attention=(0, 0, 0, -1.0), other=(1e-6, 1e-3))
    p = m.parts(100, 0.5)
    assert p["linear"] == 0.0 and p["attention"] == 0.0  # negative fits clamp at zero
    assert p["other"] == pytest.approx(50e-6 + 1e-3)
    assert m.exec(100, 0.5) == pytest.approx(sum(p.values()))
    assert m.exec(0, 0.3) == 0.0
    assert KNOWN.transfer(0) == 0.0
    assert KNOWN.transfer(1000) == pytest.approx(1e-10 * 1000 * 16384 + 2e-5)


@pytest.mark.parametrize(
    "x, y, match",
    [
        (-1, 0.0, "x must be >= 0"),
        (10, -0.1, r"y must be in \[0, 1\]"),
        (10, 1.5, r"y must be in \[0, 1\]"),
        (10, math.nan, r"y must be in \[0, 1\]"),
        (2.5, 0.0, "x must be an int"),
        (True, 0.0, "x must be an int"),
        (10, "half", "y must be a number"),
    ],
)
def test_bad_input(x, y, match):
    with pytest.raises(ValueError, match=match):
        KNOWN.exec(x, y)


def test_bad_construction():
    with pytest.raises(ValueError, match="attention must be 4"):
        CostModel(linear=(1, 2), attention=(1, 2), other=(1, 2))
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        CostModel(linear=(1, 2), attention=(1, 2, 3, 4), other=(1, 2), kv_bytes_per_token=-1)
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        KNOWN.transfer(-3)
    with pytest.raises(ValueError, match="at least one OpSample"):
        CostModel.fit([])
    with pytest.raises(ValueError, match="lacks attention"):
        CostModel.from_dict({"linear": [0, 0], "other": [0, 0]})


def test_round_trip(tmp_path):
    assert CostModel.from_dict(KNOWN.to_dict()) == KNOWN
    assert CostModel.from_dict(json.loads(json.dumps(KNOWN.to_dict()))) == KNOWN
    path = KNOWN.save(tmp_path / "m.json")
    assert CostModel.load(path) == KNOWN
    wrapped = tmp_path / "bench.json"
    wrapped.write_text(json.dumps({"model": KNOWN.to_dict(), "samples": []}))
    assert CostModel.load(wrapped) == KNOWN


def test_load_transfer_samples(tmp_path):
    rows = [
        {
            "transport": "shm",
            "mode": "by_request_aggregated",
            "concurrency": 1,
            "bytes_per_round": 1000,
            "ms_median": 2.0,
        },
        {
            "transport": "shm",
            "mode": "by_request_aggregated",
            "concurrency": 16,
            "bytes_per_round": 16000,
            "ms_median": 9.0,
        },
        {
            "transport": "gloo",
            "mode": "by_request_aggregated",
            "concurrency": 1,
            "bytes_per_round": 1000,
            "ms_median": 5.0,
        },
    ]
    path = tmp_path / "transfer.json"
    path.write_text(json.dumps({"rows": rows}))
    assert load_transfer_samples(path) == [(1000, 2.0e-3)]
    path.write_text(json.dumps({"rows": rows[2:]}))
    assert load_transfer_samples(path) == []
    path.write_text("[]")
    with pytest.raises(ValueError, match="no 'rows' list"):
        load_transfer_samples(path)


@pytest.fixture
def cc_engine(tiny_llama_dir):
    engine = Engine(
        tiny_llama_dir,
        config="PD-CC",
        engine_config=EngineConfig(max_num_batched_tokens=128, num_blocks=64),
    )
    yield engine
    assert_pool_clean(engine.pool)


def test_profile_real_engine(cc_engine):
    lengths, fractions = (16, 50, 128), (0.0, 0.6)
    before = cc_engine.pool.stats()["index"]
    samples = profile(cc_engine, lengths, fractions, repeats=2, progress=False)
    assert [s.x for s in samples] == [x for x in lengths for _ in fractions]
    bs = cc_engine.pool.block_size
    for s, f in zip(samples, [f for _ in lengths for f in fractions]):
        cached = min(round(s.x * f) // bs, (s.x - 1) // bs) * bs
        assert s.y * s.x == pytest.approx(cached), (s.x, f)
        assert s.linear_s > 0 and s.attention_s > 0 and s.other_s > 0
        assert s.linear_s + s.attention_s + s.other_s == pytest.approx(s.total_s, rel=1e-12)
    assert any(s.y > 0 for s in samples)  # a prefix really was cached
    assert not cc_engine.has_unfinished()
    assert cc_engine.pool.stats()["index"] == before  # the profiled prompts left the cache
    # hooks are gone: the model and backend run as before
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in cc_engine.model.modules())
    assert "forward" not in vars(cc_engine.backend)
    model = CostModel.fit(samples, device=str(cc_engine.device))
    assert model.exec(128, 0.0) > 0


def test_profile_rejects_what_it_cannot_measure(tiny_llama_dir, cc_engine):
    with pytest.raises(ValueError, match="token budget"):
        profile(cc_engine, lengths=(200,), progress=False)
    with pytest.raises(ValueError, match="context"):
        profile(cc_engine, lengths=(512,), progress=False)
    with pytest.raises(ValueError, match="repeats"):
        profile(cc_engine, lengths=(16,), repeats=0, progress=False)
    plain = Engine(tiny_llama_dir, config="PD", engine_config=EngineConfig(num_blocks=64))
    with pytest.raises(ValueError, match="PD-CC"):
        profile(plain, lengths=(16,), fractions=(0.5,), progress=False)
    assert [s.y for s in profile(plain, (16,), (0.0,), repeats=1, progress=False)] == [0.0]
    assert_pool_clean(plain.pool)
