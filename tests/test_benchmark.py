"""The benchmark driver and report: replay against a scripted Serving, summary math, end to end."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from minimemserve import cli
from minimemserve.request import RequestMetrics, RequestOutput
from minimemserve.sampling import SamplingParams
from minimemserve.serving import Serving
from minimemserve.workloads.results import (
    DEFAULT_CONFIGS,
    STABLE_GROWTH,
    STABLE_NOISE,
    STABLE_SLACK,
    summarize,
)
from minimemserve.workloads.sessions import Session, Turn, poisson_arrivals
from minimemserve.workloads.trace import load_trace
from minimemserve_lab.harness.driver import (
    PROBE_LOAD,
    burst_capacity,
    probed_configs,
    run_bench,
    run_workload,
)
from minimemserve_lab.report import OVERLOADED, caching_ratios, format_table, gain, write_plots


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    arrival: float
    out: list[int] = field(default_factory=list)
    first: float | None = None


class ScriptedServing:
    """A ``Serving`` that generates token ``1000 + len(prompt) + i`` one per step for each
    running request, and records what the driver asked of it."""

    tokenizer = None

    def __init__(self, reject_longer_than: int | None = None, balanced: bool = True):
        self.running: list[_Req] = []
        self.added: list[tuple[str, list[int], float]] = []  # (id, prompt, arrival_time)
        self.added_at: list[float] = []  # when each add_request call happened
        self.reject_longer_than = reject_longer_than
        self.balanced = balanced
        self.audits: list[bool] = []  # require_idle of each check_pools call
        self.closed = False
        self.sessions: dict[str, str | None] = {}  # request id -> the session id it carried

    def validate(self, prompt, params):
        if self.reject_longer_than is not None and len(prompt) > self.reject_longer_than:
            raise ValueError("prompt too long")
        return list(prompt)

    def add_request(self, prompt, params, request_id=None, arrival_time=None, session_id=None):
        self.sessions[request_id] = session_id
        self.added_at.append(time.perf_counter())
        prompt = self.validate(prompt, params)
        arrival = self.added_at[-1] if arrival_time is None else arrival_time
        self.added.append((request_id, prompt, arrival))
        self.running.append(_Req(request_id, prompt, params.max_tokens, arrival))
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self) -> list[RequestOutput]:
        now = time.perf_counter()
        done = []
        for r in self.running:
            r.out.append(1000 + len(r.prompt) + len(r.out))
            r.first = r.first or now
            if len(r.out) == r.max_tokens:
                done.append(r)
        self.running = [r for r in self.running if r not in done]
        return [
            RequestOutput(
                r.rid,
                r.prompt,
                r.out,
                None,
                "length",
                RequestMetrics(
                    r.arrival,
                    first_token_time=r.first,
                    finish_time=now,
                    cached_tokens=len(r.prompt) // 2,
                    prompt_tokens=len(r.prompt),
                    output_tokens=len(r.out),
                ),
            )
            for r in done
        ]

    def abort(self, request_id):
        return None

    def take_deltas(self):
        return []

    def load(self):
        return {"X0": {"role": "colocated", "waiting": 0, "running": len(self.running)}}

    def check_pools(self, require_idle=True):
        self.audits.append(require_idle)
        if not self.balanced:
            raise AssertionError("2 blocks neither free, cached nor referenced")
        return {"X0": {"pool": self.pool_stats()["X0"]}}

    def pool_stats(self):
        return {"X0": {"hbm": {"total": 8, "free": 8, "referenced": 0, "cached_only": 0}}}

    def close(self):
        self.closed = True


def _params(turn: Turn) -> SamplingParams:
    return SamplingParams(max_tokens=turn.max_tokens, temperature=0.0, ignore_eos=True)


def _sessions() -> list[Session]:
    a = Session("a", (Turn("a", 0, (1, 5, 6), 2), Turn("a", 1, (7,), 3), Turn("a", 2, (8, 9), 1)))
    b = Session("b", (Turn("b", 0, (2, 3), 4),), prefix_tokens=(1,), chain_outputs=False)
    return [a, b]


def test_scripted_serving_is_a_serving():
    assert isinstance(ScriptedServing(), Serving)


def test_run_workload_chains_history_and_own_output():
    engine = ScriptedServing()
    records = run_workload(
        engine, _sessions(), rate=math.inf, seed=0, progress=False, config="X", params_for=_params
    )
    assert len(records) == 4 and not engine.has_unfinished()
    prompts = {rid: p for rid, p, _ in engine.added}
    assert prompts["a/0"] == [1, 5, 6]
    out0 = [1003, 1004]
    assert prompts["a/1"] == [1, 5, 6, *out0, 7]
    out1 = [1006, 1007, 1008]
    assert prompts["a/2"] == [*prompts["a/1"], *out1, 8, 9]
    assert prompts["b/0"] == [1, 2, 3]
    by_key = {(r["session"], r["turn"]): r for r in records}
    assert [by_key["a", k]["prompt_tokens"] for k in range(3)] == [3, 6, 11]
    assert [by_key["a", k]["output_tokens"] for k in range(3)] == [2, 3, 1]
    assert [by_key["a", k]["cached_tokens"] for k in range(3)] == [1, 3, 5]
    assert all(r["config"] == "X" and r["error"] is None for r in records)
    # turns of one session run in order, each after the previous one finished
    order = [rid for rid, _, _ in engine.added]
    assert order.index("a/0") < order.index("a/1") < order.index("a/2")
    arrivals = {rid: t for rid, _, t in engine.added}
    assert arrivals["a/0"] < arrivals["a/1"] < arrivals["a/2"]
    assert engine.sessions == {"a/0": "a", "a/1": "a", "a/2": "a", "b/0": "b"}


def test_run_workload_respects_poisson_arrivals():
    sessions = [Session(f"s{i}", (Turn(f"s{i}", 0, (1, 2), 1),)) for i in range(4)]
    engine = ScriptedServing()
    records = run_workload(engine, sessions, rate=20.0, seed=1, progress=False, params_for=_params)
    offsets = poisson_arrivals(20.0, 4, 1)
    assert [r["arrival"] for r in records] == pytest.approx(offsets, abs=1e-6)
    submitted = [t for _, _, t in engine.added]
    assert [t - submitted[0] for t in submitted] == pytest.approx(offsets, abs=1e-6)
    # no session is sent before its arrival time
    assert all(at >= t for at, t in zip(engine.added_at, submitted))


def test_run_workload_rejected_turn_ends_its_session():
    engine = ScriptedServing(reject_longer_than=5)
    records = run_workload(
        engine, _sessions(), rate=math.inf, seed=0, progress=False, params_for=_params
    )
    by_key = {(r["session"], r["turn"]): r for r in records}
    assert by_key["a", 1]["error"].startswith("rejected: prompt too long")
    assert by_key["a", 1]["prompt_tokens"] == 6 and by_key["a", 1]["ttft"] is None
    assert ("a", 2) not in by_key
    assert by_key["a", 0]["error"] is None and by_key["b", 0]["error"] is None


def _rec(turn, ttft, jct, tpot, prompt=100, cached=0, error=None, nbytes=0, arrival=0.0):
    return {
        "config": "X",
        "session": "s",
        "turn": turn,
        "arrival": arrival,
        "prompt_tokens": prompt,
        "output_tokens": 10,
        "cached_tokens": cached,
        "ttft": ttft,
        "jct": jct,
        "tpot": tpot,
        "transferred_bytes": nbytes,
        "error": error,
    }


def test_summarize_math():
    records = [
        _rec(0, 1.0, 2.0, 0.1, prompt=100, cached=0, nbytes=5),
        _rec(1, 0.2, 1.0, 0.1, prompt=200, cached=150, nbytes=7),
        _rec(2, 0.4, 1.4, None, prompt=300, cached=250),
        _rec(1, 9.0, 9.0, 9.0, prompt=999, cached=999, error="boom", nbytes=1000),
    ]
    s = summarize(records)
    assert s["requests"] == 4 and s["errors"] == 1
    assert s["ttft_mean"] == pytest.approx((1.0 + 0.2 + 0.4) / 3)
    assert s["ttft_mean_later"] == pytest.approx(0.3)
    assert s["jct_mean"] == pytest.approx(4.4 / 3)
    assert s["tpot_mean"] == pytest.approx(0.1)  # None excluded
    assert s["ttft_p99_later"] == pytest.approx(0.2 + 0.99 * 0.2)  # linear interpolation
    assert s["cached_ratio"] == pytest.approx(400 / 600)
    assert s["cached_ratio_later"] == pytest.approx(400 / 500)
    assert s["transferred_bytes"] == 12 and s["prompt_tokens"] == 600
    values = list(np.linspace(0.0, 1.0, 101))
    s = summarize([_rec(0, v, v, v) for v in values])
    assert s["ttft_p99"] == pytest.approx(0.99)
    assert s["ttft_mean_later"] is None and s["cached_ratio_later"] is None
    assert summarize([])["ttft_mean"] is None


def test_caching_ratios_and_table():
    base = summarize([_rec(0, 1.0, 2.0, 0.1), _rec(1, 0.9, 2.0, 0.1)])
    cc = summarize([_rec(0, 1.0, 2.0, 0.1), _rec(1, 0.3, 1.0, 0.1, cached=50)])
    summaries = {"PD": base, "PD-CC": cc, "1P1D": base}
    assert caching_ratios(summaries) == {"PD/PD-CC": pytest.approx(3.0)}
    table = format_table(summaries)
    assert "PD-CC" in table and "900.0" in table and "25.0%" in table


def _queue(jct_of) -> list[dict]:
    """One single-turn session a second for 100 s; request k takes ``jct_of(k)`` s."""
    return [_rec(0, 0.1, jct_of(k), 0.01, arrival=float(k)) for k in range(101)]


def test_stability_rule_flags_a_growing_queue_and_gains_over_it():
    flat = summarize(_queue(lambda k: 3.0))  # three in system all along
    growing = summarize(_queue(lambda k: 3.0 + 0.5 * k))  # the wait grows with every arrival
    st = flat["stability"]
    assert st["stable"] and st["window_s"] == 100 and st["in_system"] == [3, 3, 3, 3]
    assert st["mean_in_system"][3] == pytest.approx(3.0, abs=0.2)
    assert st["makespan_ratio"] == pytest.approx(1.03) and st["ttft_trend"] == pytest.approx(
        [0.1] * 4
    )
    g = growing["stability"]
    assert not g["stable"] and g["in_system"][3] > 1.5 * g["in_system"][1]
    assert gain(flat, growing, "jct_mean") == OVERLOADED == gain(growing, flat, "jct_mean")
    assert gain(flat, flat, "jct_mean") == pytest.approx(0.0)
    ratios = caching_ratios({"PD": growing, "PD-CC": flat, "1P1D": flat, "1P1D-CC": flat})
    assert ratios == {"PD/PD-CC": OVERLOADED, "1P1D/1P1D-CC": None}  # no later turns
    assert "NO" in format_table({"PD": growing}) and summarize([])["stability"]["stable"]


def test_stability_rule_scales_by_the_arrivals_of_each_quarter():
    # Two arrivals a second for 75 s, then four: the same 10 s wait doubles the number in
    # system, which the busier quarter explains (q2 alone would call it a growing queue). The
    # same arrivals queued for one server that takes 0.625 s a request (1.6 a second) fail.
    times = [k / 2 for k in range(150)] + [75 + k / 4 for k in range(101)]
    st = summarize([_rec(0, 0.1, 10.0, 0.01, arrival=t) for t in times])["stability"]
    assert st["stable"] and st["arrivals"] == [50, 50, 50, 101]
    q2, q4 = st["mean_in_system"][1], st["mean_in_system"][3]
    assert q4 > STABLE_GROWTH * q2 + STABLE_NOISE * q2**0.5 + STABLE_SLACK
    done, queued = 0.0, []
    for t in times:
        done = max(t, done) + 0.625
        queued.append(_rec(0, 0.1, done - t, 0.01, arrival=t))
    assert not summarize(queued)["stability"]["stable"]


def test_write_plots(tmp_path):
    recs = {
        "PD": [_rec(0, 1.0, 2.0, 0.1), _rec(1, 0.5, 1.5, 0.1)],
        "PD-CC": [_rec(0, 1.0, 2.0, 0.1), _rec(1, 0.1, 1.0, 0.1)],
    }
    paths = write_plots(recs, {k: summarize(v) for k, v in recs.items()}, tmp_path / "e2e_x")
    assert [p.name for p in paths] == ["e2e_x_bars.png", "e2e_x_cdf.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_write_plots_marks_an_unstable_config(tmp_path, monkeypatch):
    """An overloaded configuration's bars are hatched and its tick says so; a stable one's not."""
    from matplotlib.axes import Axes

    ticks, hatches = [], []
    set_xticks = Axes.set_xticks
    monkeypatch.setattr(
        Axes, "set_xticks", lambda ax, x, labels: ticks.append(labels) or set_xticks(ax, x, labels)
    )
    bar = Axes.bar

    def spy(ax, *args, **kwargs):
        drawn = bar(ax, *args, **kwargs)
        hatches.append(drawn)
        return drawn

    monkeypatch.setattr(Axes, "bar", spy)
    recs = {"PD": [_rec(0, 1.0, 2.0, 0.1)], "1P1D": [_rec(0, 1.0, 2.0, 0.1)]}
    summaries = {k: summarize(v) for k, v in recs.items()}
    summaries["1P1D"]["stability"] = {"stable": False}
    write_plots(recs, summaries, tmp_path / "e2e_x")
    assert ticks[0] == ["PD", "1P1D\n(overloaded)"]
    assert all([b.get_hatch() for b in drawn] == [None, "//"] for drawn in hatches)


def _burst(session: str, ends: list[float]) -> list[dict]:
    """A session's records, all arriving at 0 (the burst), turn k finishing at ends[k]."""
    starts = [0.0, *ends[:-1]]
    recs = [_rec(k, 0.1, e - a, 0.01, arrival=a) for k, (a, e) in enumerate(zip(starts, ends))]
    return [r | {"session": session} for r in recs]


def test_burst_capacity_counts_turns_until_half_the_sessions_finished():
    # four sessions: two done by 2 s (3 turns in all), the others run on alone to 9 s
    records = _burst("a", [1.0]) + _burst("b", [1.0, 2.0])
    records += _burst("c", [1.5, 3.0, 9.0]) + _burst("d", [2.0, 8.0])
    # by 2 s: a's 1, b's 2, c's 1, d's 1 = 5 turns in 2 s, 2.5 turns per session
    assert burst_capacity(records, 2.5) == pytest.approx(5 / 2 / 2.5)
    assert burst_capacity(records[:1], 1.0) == pytest.approx(1.0)  # one session: to its end


def test_probe_runs_the_configs_without_their_caching_variant():
    assert probed_configs(["PD", "PD-CC", "1P1D", "1P1D-CC"]) == ["PD", "1P1D"]
    assert probed_configs(["PD-CC", "1P1D-CC", "2P2D"]) == ["PD-CC", "1P1D-CC", "2P2D"]
    assert probed_configs(["http://a", "http://b"]) == ["http://a", "http://b"]


def test_run_bench_without_a_rate_probes_then_runs_at_a_share_of_it(tiny_llama_dir):
    built = []

    def factory(spec):
        built.append(ScriptedServing())
        return built[-1]

    result = run_bench(
        configs=("FAKE",),
        factories={"FAKE": factory},
        num_sessions=3,
        rate=None,
        max_turns=2,
        max_output_tokens=2,
        model_dir=tiny_llama_dir,
        out_dir=None,
        progress=False,
        verbose=False,
    )
    probe = result["setup"]["rate_probe"]
    assert len(built) == 2 and all(s.closed and s.audits == [True] for s in built)
    assert len(built[0].added) == len(built[1].added)  # the probe: the same 3 sessions at once
    assert len({a for _, _, a in built[0].added[2:5]}) == 1  # after the two warm-ups
    assert probe["load"] == PROBE_LOAD and probe["capacity"]["FAKE"] > 0
    assert result["setup"]["rate"] == probe["rate"]
    assert probe["rate"] == pytest.approx(PROBE_LOAD * probe["capacity"]["FAKE"], rel=0.05)


def _bench_on(serving: ScriptedServing, model_dir):
    return run_bench(
        configs=("FAKE",),
        factories={"FAKE": lambda spec: serving},
        num_sessions=1,
        rate=math.inf,
        max_turns=2,
        max_output_tokens=2,
        model_dir=model_dir,
        out_dir=None,
        progress=False,
        verbose=False,
    )


def test_run_bench_audits_reports_and_closes_each_serving(tiny_llama_dir):
    with pytest.raises(ValueError, match="unknown config"):
        run_bench(configs=("XYZ",), model_dir=tiny_llama_dir, out_dir=None, verbose=False)
    serving = ScriptedServing()
    result = _bench_on(serving, tiny_llama_dir)
    assert serving.audits == [True] and serving.closed
    assert result["pool_stats"]["FAKE"]["pool"] == serving.pool_stats()
    assert result["summaries"]["FAKE"]["requests"] == 2
    unbalanced = ScriptedServing(balanced=False)
    with pytest.raises(RuntimeError, match="balance check failed after the FAKE run"):
        _bench_on(unbalanced, tiny_llama_dir)
    assert unbalanced.closed


def test_run_bench_end_to_end(tiny_llama_dir, tmp_path, capsys):
    result = run_bench(
        configs=("PD", "PD-CC"),
        workload="sharegpt",
        num_sessions=2,
        rate=math.inf,
        max_turns=2,
        max_output_tokens=8,
        model_dir=tiny_llama_dir,
        out_dir=tmp_path,
        progress=False,
    )
    printed = capsys.readouterr().out
    assert "PD/PD-CC" in printed and "pool balanced" in printed
    for config in ("PD", "PD-CC"):
        recs = result["records"][config]
        assert len(recs) == 4
        assert {(r["session"], r["turn"]) for r in recs} == {
            (s, t) for s in ("sharegpt-0", "sharegpt-1") for t in (0, 1)
        }
        assert all(r["error"] is None and r["output_tokens"] >= 1 for r in recs)
        assert all(r["ttft"] > 0 and r["jct"] >= r["ttft"] for r in recs)
    pd = {(r["session"], r["turn"]): r for r in result["records"]["PD"]}
    cc = {(r["session"], r["turn"]): r for r in result["records"]["PD-CC"]}
    assert all(r["cached_tokens"] == 0 for r in pd.values())
    for s in ("sharegpt-0", "sharegpt-1"):
        assert cc[s, 1]["prompt_tokens"] == pd[s, 1]["prompt_tokens"]
        # turn 2 reuses at least the whole blocks of turn 1's prompt
        assert cc[s, 1]["cached_tokens"] >= (cc[s, 0]["prompt_tokens"] // 16) * 16 > 0
    files = [
        tmp_path / "e2e_sharegpt.json",
        tmp_path / "e2e_sharegpt_bars.png",
        tmp_path / "e2e_sharegpt_cdf.png",
    ]
    assert all(f.exists() for f in files)
    saved = json.loads(files[0].read_text())
    assert saved["setup"]["runtime"] == {"kind": "inline"}
    assert saved["summaries"]["PD-CC"]["cached_ratio_later"] > 0
    assert set(saved["ttft_later_ratio"]) == {"PD/PD-CC"}


def test_bench_is_a_subcommand_with_the_driver_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "-h"])
    assert exit_.value.code == 0
    shown = capsys.readouterr().out
    assert "usage: minimemserve bench" in shown
    assert all(opt in shown for opt in ("--workload", "--runtime", "--policy", "--cost-model"))


@pytest.mark.parametrize(
    "argv", [["--workload", "nope"], ["--policy", "fastest", "--configs", "PD-CC"]]
)
def test_bench_rejects_bad_choices_before_starting_anything(argv, capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", *argv])
    assert "invalid choice" in capsys.readouterr().err


def test_bench_over_instances_started_on_their_own(tiny_llama_dir, tmp_path, capsys):
    """``--runtime hosts``: standalone instances joined by a frontend, KV over NIXL where the
    extra loads (else gloo); every request answered and every pool balanced."""
    from minimemserve.disagg.nixl import nixl_missing

    transport = "gloo" if nixl_missing() else "nixl"
    argv = ["bench", "--runtime", "hosts", "--transport", transport, "--configs", "1P1D-CC"]
    argv += ["--sessions", "2", "--max-turns", "2", "--max-output-tokens", "4", "--rate", "inf"]
    cli.main([*argv, "--model", str(tiny_llama_dir), "--out", str(tmp_path), "--no-progress"])
    printed = capsys.readouterr().out
    assert "1P1D-CC: 4 requests" in printed and "pool balanced" in printed
    saved = json.loads((tmp_path / "e2e_sharegpt.json").read_text())
    summary = saved["summaries"]["1P1D-CC"]
    assert summary["errors"] == 0 and summary["transferred_bytes"] > 0


def test_bench_replays_a_trace_under_the_four_configs(tiny_llama_dir, tmp_path):
    rows = [  # two conversations after a shared first block, one request too long to fit
        {"timestamp": 0, "input_length": 1500, "output_length": 90, "hash_ids": [0, 1, 2]},
        {"timestamp": 10, "input_length": 700, "output_length": 9, "hash_ids": [0, 7]},
        {"timestamp": 20, "input_length": 2000, "output_length": 50, "hash_ids": [0, 1, 2, 3]},
        {"timestamp": 30, "input_length": 1100, "output_length": 5, "hash_ids": [0, 7, 8]},
        {"timestamp": 40, "input_length": 99999, "output_length": 5, "hash_ids": list(range(196))},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = load_trace(path, length_scale=32)
    result = run_bench(
        configs=DEFAULT_CONFIGS,
        workload=trace,
        rate=math.inf,
        max_output_tokens=3,
        model_dir=tiny_llama_dir,
        out_dir=tmp_path,
        progress=False,
        verbose=False,
    )
    assert result["setup"]["trace"]["dropped_too_long"] == 1
    for config in DEFAULT_CONFIGS:
        recs = {(r["session"], r["turn"]): r for r in result["records"][config]}
        assert len(recs) == 4 and all(r["error"] is None for r in recs.values())
        assert recs["trace-0-1", 1]["prompt_tokens"] == -(-2000 // 32)  # rounded up
        outputs = [recs[k]["output_tokens"] for k in sorted(recs)]
        assert outputs == [3, 2, 1, 1]  # ceil(length / 32), at most 3, by (session, turn)
        later = recs["trace-0-1", 1]["cached_tokens"]
        assert later >= 32 if config.endswith("-CC") else later == 0  # 2 whole blocks
    assert (tmp_path / "e2e_trace.json").exists()
