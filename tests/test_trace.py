"""The trace workload on a small generated trace: determinism, equal ids -> equal tokens, the
partial last block, the window and scale options, bad lines refused with their number; the
scaled copy for an external client, and the replay serving.md documents (aiperf on it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from docs_blocks import REPO, blocks, commands, logical_lines

from minimemserve.cli import main
from minimemserve.model.config import ModelConfig
from minimemserve.presets import preset_dir
from minimemserve.workloads.trace import (
    TRACE_BLOCK,
    TraceError,
    default_trace_path,
    load_trace,
    parse_window,
)
from minimemserve_lab.trace_curve import CURVE_LENGTH_SCALE

VOCAB = 32000
ROWS = [
    {"timestamp": 0, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 1024, "output_length": 3, "hash_ids": [0, 1]},
    {"timestamp": 1500, "input_length": 600, "output_length": 40, "hash_ids": [0, 5]},
    {"timestamp": 4000, "input_length": 513, "output_length": 1, "hash_ids": [9, 1]},
]


def _write(tmp_path, rows, name="t.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_prompts_are_deterministic_and_cut_to_the_input_length(tmp_path):
    path = _write(tmp_path, ROWS)
    a, b = load_trace(path), load_trace(path)
    for ra, rb, row in zip(a.requests, b.requests, ROWS):
        pa = a.prompt(ra, VOCAB)
        assert pa == b.prompt(rb, VOCAB)
        assert len(pa) == row["input_length"]  # the last, partial block is cut
        assert all(3 <= t < VOCAB for t in pa)
        assert ra.output_length == row["output_length"]
    assert [r.arrival for r in a.requests] == [0.0, 0.5, 1.5, 4.0]
    assert [r.line for r in a.requests] == [1, 2, 3, 4]


def test_equal_ids_give_equal_tokens_and_different_ids_differ(tmp_path):
    trace = load_trace(_write(tmp_path, ROWS))
    p = [trace.prompt(r, VOCAB) for r in trace.requests]
    blk = TRACE_BLOCK
    assert p[0][: 2 * blk] == p[1][: 2 * blk]  # ids 0, 1 shared
    assert p[0][:blk] == p[2][:blk] and p[0][blk : blk + 16] != p[2][blk : blk + 16]
    # id 1 at position 1 of request 3, after a different first block: same tokens as id 1
    assert p[3][blk:] == p[0][blk : blk + 1]
    assert p[3][:16] != p[0][:16]


def test_length_scale_keeps_the_sharing_and_divides_lengths(tmp_path):
    path = _write(tmp_path, ROWS)
    full, small = load_trace(path), load_trace(path, length_scale=32)
    assert small.block_tokens == TRACE_BLOCK // 32
    assert [r.input_length for r in small.requests] == [35, 32, 19, 17]
    assert [r.output_length for r in small.requests] == [1, 1, 2, 1]
    p = [small.prompt(r, VOCAB) for r in small.requests]
    assert p[0][:32] == p[1][:32] and p[0][:16] == p[2][:16] and p[0][16:32] != p[2][16:32]
    # a scaled block is the head of the full one: equal ids, equal tokens at every scale
    assert p[0][:16] == full.prompt(full.requests[0], VOCAB)[:16]
    for bad in (0, 3, 1024, 2.0):
        with pytest.raises(ValueError, match="length scale"):
            load_trace(path, length_scale=bad)


def test_window_and_time_scale(tmp_path):
    path = _write(tmp_path, ROWS)
    t = load_trace(path, window=(1, 3), time_scale=0.5)
    assert [r.line for r in t.requests] == [2, 3]
    assert [r.arrival for r in t.requests] == [0.0, 0.5]  # from the window's first, halved
    assert [r.line for r in load_trace(path, window=parse_window("2")).requests] == [1, 2]
    assert [r.line for r in load_trace(path, window=parse_window("3:")).requests] == [4]
    with pytest.raises(TraceError, match="no request in the window"):
        load_trace(path, window=(10, None))
    for bad in ((2, 1), (-1, None)):
        with pytest.raises(ValueError, match="window"):
            load_trace(path, window=bad)
    with pytest.raises(ValueError, match="time scale"):
        load_trace(path, time_scale=0)
    with pytest.raises(ValueError, match="START:STOP"):
        parse_window("a:b")


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [0]}', "timestamp"),
        ('{"timestamp": 9, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length"),
        ('{"timestamp": 9, "input_length": 5, "output_length": "2", "hash_ids": [0]}', "output"),
        ('{"timestamp": 9, "input_length": 5, "output_length": 1, "hash_ids": [-3]}', "hash_ids"),
        ('{"timestamp": 9, "input_length": 600, "output_length": 1, "hash_ids": [0]}', "2 blocks"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [0]}', "before"),
    ],
)
def test_bad_lines_are_refused_with_their_number(tmp_path, line, field):
    path = _write(tmp_path, [ROWS[0], ROWS[1], "", line])  # a blank line is skipped
    with pytest.raises(TraceError, match=rf"line 4: .*{field}"):
        load_trace(path)


def test_missing_file_and_the_shared_trace(tmp_path):
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "none.jsonl")
    try:
        path = default_trace_path()
    except FileNotFoundError as e:
        assert "shared/" in str(e)
    else:
        assert path.name == "conversation_trace.jsonl"


def test_a_scaled_copy_for_an_external_client(tmp_path, capsys):
    """``minimemserve trace`` writes the window as the replay scales it: times from the
    window's first request, lengths divided, the same hash ids, each standing for
    ``block_tokens`` tokens (so an external client's prompts share what the replay's do)."""
    path, out = _write(tmp_path, ROWS), tmp_path / "scaled.jsonl"
    argv = ["trace", "--trace", path, "--trace-window", "1:4", "--time-scale", "0.5"]
    assert main([*argv, "--length-scale", "32", "--out", str(out)]) == 0
    assert "--isl-block-size 16" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    want = load_trace(path, window=(1, 4), time_scale=0.5, length_scale=32)
    assert [r["timestamp"] for r in rows] == [0, 500, 1750]
    assert all(type(r["timestamp"]) is int for r in rows)  # the format's whole milliseconds
    assert [r["input_length"] for r in rows] == [r.input_length for r in want.requests]
    assert [r["output_length"] for r in rows] == [1, 2, 1]
    assert [r["hash_ids"] for r in rows] == [ROWS[i]["hash_ids"] for i in (1, 2, 3)]
    for r in rows:  # every hash id covers block_tokens tokens of the scaled prompt
        assert len(r["hash_ids"]) == -(-r["input_length"] // want.block_tokens)


def test_the_copy_keeps_whole_milliseconds_and_what_the_context_holds(tmp_path, capsys):
    """A time scale that gives fractions of a millisecond still writes integers (the format's;
    a reader that wants an ``int`` refuses ``166.667``), and the requests whose scaled prompt
    and capped output exceed ``--max-context`` are left out, as ``bench --trace`` leaves them."""
    path, out = _write(tmp_path, ROWS), tmp_path / "scaled.jsonl"
    argv = ["trace", "--trace", path, "--time-scale", "0.3333", "--length-scale", "32"]
    assert main([*argv, "--max-context", "34", "--max-output-tokens", "1", "--out", str(out)]) == 0
    assert "1 beyond the context 34 left out" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["timestamp"] for r in rows] == [167, 500, 1333]  # the first (35 + 1 tokens) left out
    assert all(type(r["timestamp"]) is int for r in rows)
    assert [r["input_length"] + r["output_length"] for r in rows] == [33, 20, 18]
    assert [r["output_length"] for r in rows] == [1, 1, 1]


def test_the_copy_fits_the_tiny_preset_by_default(tmp_path, capsys):
    """Without ``--max-context`` the limit is the tiny preset's context (``serve``'s default
    model): a request the server would refuse is not written."""
    long = {"timestamp": 9000, "input_length": 70000, "output_length": 1, "hash_ids": [0] * 137}
    path, out = _write(tmp_path, [*ROWS, long]), tmp_path / "scaled.jsonl"
    assert main(["trace", "--trace", path, "--length-scale", "32", "--out", str(out)]) == 0
    context = ModelConfig.from_hf(preset_dir("tiny")).max_position_embeddings
    assert f"1 beyond the context {context} left out" in capsys.readouterr().out
    assert len(out.read_text().splitlines()) == len(ROWS)


# The fields aiperf's ``mooncake_trace`` loader reads from a line that carries hash ids.
MOONCAKE_FIELDS = {"timestamp", "input_length", "output_length", "hash_ids"}
SERVING = REPO / "docs" / "serving.md"


def _documented_replay() -> dict[str, list[str]]:
    """The ``minimemserve trace``, ``minimemserve sim`` and ``aiperf profile`` commands of
    serving.md's trace replay, each as its arguments."""
    found: dict[str, list[str]] = {}
    for block in blocks(SERVING):
        for line in logical_lines(block.text):
            for words in commands(line):
                head = words[0].rsplit("/", 1)[-1]
                if head == "minimemserve" and words[1] in ("trace", "sim") and "--trace" in words:
                    found.setdefault(words[1], words[2:])
                elif head == "aiperf" and "mooncake_trace" in words:
                    found.setdefault("aiperf", words[2:])
    assert set(found) == {"trace", "sim", "aiperf"}, f"serving.md's trace replay: {sorted(found)}"
    return found


def _option(words: list[str], name: str) -> str:
    return words[words.index(name) + 1]


def test_the_documented_replay_agrees_with_itself():
    """The docs' aiperf command reads the file the trace command writes, with the block size
    its hash ids stand for; the simulator's hit rate is of the same window, limits and scale."""
    cmd = _documented_replay()
    trace, sim, aiperf = cmd["trace"], cmd["sim"], cmd["aiperf"]
    scale = int(_option(trace, "--length-scale"))
    assert _option(aiperf, "--input-file") == _option(trace, "--out")
    assert _option(aiperf, "--custom-dataset-type") == "mooncake_trace"
    assert "--fixed-schedule" in aiperf and "ignore_eos:true" in aiperf
    assert int(_option(aiperf, "--isl-block-size")) == TRACE_BLOCK // scale
    assert scale == CURVE_LENGTH_SCALE  # the curve's one pool block per trace block
    assert _option(sim, "--trace-window") == _option(trace, "--trace-window")
    assert _option(sim, "--max-output-tokens") == _option(trace, "--max-output-tokens")
    context = ModelConfig.from_hf(preset_dir("tiny")).max_position_embeddings
    assert int(_option(sim, "--max-context")) == context  # the trace command's default
    slo = dict(pair.split(":") for pair in _option(aiperf, "--goodput").split())
    assert set(slo) == {"time_to_first_token", "inter_token_latency"}


def _documented_window(tmp_path) -> tuple[list[str], Path]:
    """The docs' ``minimemserve trace`` command run into ``tmp_path``: its arguments and file
    (skipped where the trace is not on this machine)."""
    try:
        default_trace_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    argv, out = _documented_replay()["trace"], tmp_path / "window.jsonl"
    argv[argv.index("--out") + 1] = str(out)
    assert main(["trace", *argv]) == 0
    return argv, out


def test_the_documented_window_is_what_aiperf_and_the_server_accept(tmp_path):
    """The file the docs' command writes: every line has the fields aiperf's loader needs, with
    integer values; each hash id stands for the block size the docs give aiperf; every prompt
    and output fit the tiny model's context with its BOS; the count is the one the docs state."""
    argv, out = _documented_window(tmp_path)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    window = parse_window(_option(argv, "--trace-window"))
    scale, cap = int(_option(argv, "--length-scale")), int(_option(argv, "--max-output-tokens"))
    block = TRACE_BLOCK // scale
    context = ModelConfig.from_hf(preset_dir("tiny")).max_position_embeddings
    fitted = [
        r
        for r in load_trace(None, window).requests
        if -(-r.input_length // scale) + min(-(-r.output_length // scale), cap) <= context
    ]
    assert len(rows) == len(fitted)
    stamps = [r["timestamp"] for r in rows]
    assert stamps == sorted(stamps) and stamps[0] == 0
    for r, src in zip(rows, fitted):
        assert set(r) == MOONCAKE_FIELDS
        assert all(type(r[k]) is int for k in ("timestamp", "input_length", "output_length"))
        assert r["hash_ids"] == list(src.hash_ids)  # the trace's own ids: the same sharing
        assert r["input_length"] == -(-src.input_length // scale)
        assert len(r["hash_ids"]) == -(-r["input_length"] // block)
        assert 1 <= r["output_length"] <= cap
        assert r["input_length"] + 1 + r["output_length"] <= context  # BOS, prompt, output
    assert f"{len(rows)} requests" in SERVING.read_text()


def test_the_documented_window_loads_in_aiperf(tmp_path):
    """Where aiperf is installed (not in the project's environment), its own model of a
    ``mooncake_trace`` line accepts every line of the documented window."""
    models = pytest.importorskip("aiperf.dataset.loader.models")
    _, out = _documented_window(tmp_path)
    for line in out.read_text().splitlines():
        row = models.MooncakeTrace.model_validate_json(line)
        assert row.hash_ids and row.input_length and isinstance(row.timestamp, int)
