"""Tokenizer: sentencepiece round trips on real ShareGPT text, special ids, errors; the same
for an HF ``tokenizer.json`` (fast tokenizers)."""

from __future__ import annotations

import pytest

from minimemserve.errors import CheckpointError, InvalidRequest
from minimemserve.model.tokenizer import Tokenizer
from minimemserve.sharegpt import iter_sharegpt


@pytest.fixture(scope="module")
def tokenizer(sp_tokenizer_path) -> Tokenizer:
    return Tokenizer.from_file(sp_tokenizer_path)


def test_special_ids_and_size(tokenizer):
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)
    assert tokenizer.vocab_size == 512
    assert tokenizer.id_to_piece(1) == "<s>"


def test_from_dir(tiny_llama_dir):
    assert Tokenizer.from_dir(tiny_llama_dir).vocab_size == 512


def test_from_dir_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.model, tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_round_trip_on_sharegpt(tokenizer):
    # Conversations far past the training text, so unseen characters hit byte fallback.
    messages = [
        turn["value"]
        for i, entry in enumerate(iter_sharegpt(limit=3000))
        if i >= 2500
        for turn in entry["conversations"]
    ]
    assert len(messages) > 1000
    for text in messages:
        ids = tokenizer.encode(text)
        assert ids[0] == tokenizer.bos_id
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.decode(ids) == text


def test_byte_fallback_covers_any_text(tokenizer):
    text = "  two spaces, tab\t, emoji 🦙, 漢字, zero-width \u200b end"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert 0 not in tokenizer.encode(text)  # never <unk>


def test_add_bos_flag(tokenizer):
    with_bos = tokenizer.encode("hello world")
    without = tokenizer.encode("hello world", add_bos=False)
    assert with_bos == [1, *without]


def test_decode_special_tokens(tokenizer):
    ids = [tokenizer.bos_id, *tokenizer.encode("hi", add_bos=False), tokenizer.eos_id]
    assert tokenizer.decode(ids) == "hi"
    assert tokenizer.decode(ids, skip_special=False) == "<s>hi</s>"


def test_ids_without_an_entry_have_no_text_and_bad_input_is_refused(tokenizer):
    assert tokenizer.decode([5, 512, -1]) == tokenizer.decode([5])
    assert tokenizer.id_to_piece(512) == ""
    with pytest.raises(InvalidRequest, match="str"):
        tokenizer.encode(b"bytes")  # type: ignore[arg-type]


def test_encode_empty(tokenizer):
    assert tokenizer.encode("") == [1]
    assert tokenizer.decode([]) == ""


@pytest.fixture(scope="module")
def fast(hf_tokenizer_files) -> Tokenizer:
    return Tokenizer.from_dir(hf_tokenizer_files)  # no tokenizer.model there: tokenizer.json


def test_fast_tokenizer_special_ids_from_its_config(fast, hf_tokenizer_files):
    assert fast.vocab_size == 512
    assert fast.bos_id is None  # Qwen-style: no BOS, so encode adds none
    assert fast.id_to_piece(fast.eos_id) == "<|im_end|>"
    assert fast.encode("hello world") == fast.encode("hello world", add_bos=False)


def test_fast_tokenizer_round_trips_any_text(fast):
    text = "  two spaces, tab\t, emoji 🦙, 漢字, zero-width \u200b end\nnew line"
    ids = fast.encode(text)
    assert all(0 <= i < fast.vocab_size for i in ids)
    assert fast.decode(ids) == text


def test_fast_tokenizer_special_tokens_are_kept_whole_and_dropped_on_decode(fast):
    ids = fast.encode("<|im_start|>user\nhi<|im_end|>")
    start, end = fast.encode("<|im_start|>")[0], fast.eos_id
    assert ids[0] == start and ids[-1] == end
    assert fast.decode(ids) == "user\nhi"
    assert fast.decode(ids, skip_special=False) == "<|im_start|>user\nhi<|im_end|>"


def test_fast_tokenizer_bad_files_are_named(tmp_path, hf_tokenizer_files):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((hf_tokenizer_files / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        Tokenizer.from_dir(tmp_path)


def test_fast_tokenizer_pieces_are_text(fast):
    """A byte-level piece reads as its text (a leading space, not ``Ġ``), as logprobs show it."""
    first = fast.encode(" hello there", add_bos=False)[0]
    assert fast.id_to_piece(first).startswith(" ") and "Ġ" not in fast.id_to_piece(first)
