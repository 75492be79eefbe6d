"""Request parsing and incremental detokenization, without a server."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("fastapi")

from minimemserve.model.tokenizer import Tokenizer
from minimemserve.server.protocol import Detokenizer


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    return Tokenizer.from_dir(tiny_llama_dir)


def test_deltas_add_up_to_the_whole_decode(tok):
    """Token by token (byte pieces included), the deltas are the text of all the tokens, and
    none ends in half a character."""
    g = torch.Generator().manual_seed(0)
    byte_pieces = [i for i in range(tok.vocab_size) if tok.id_to_piece(i).startswith("<0x")]
    for trial in range(40):
        ids = torch.randint(3, tok.vocab_size, (60,), generator=g).tolist()
        if trial % 2:  # runs of raw bytes: multi-byte characters, and broken ones
            ids[10:20] = [byte_pieces[int(j) % len(byte_pieces)] for j in ids[10:20]]
        d = Detokenizer(tok, [])
        deltas = [d.feed([t]) for t in ids[:-1]] + [d.feed(ids[-1:], final=True)]
        assert "".join(deltas) == tok.decode(ids)
        assert not any(
            x.endswith("\ufffd") for x in deltas[:-1] if tok.decode(ids).count("\ufffd") == 0
        )


def test_multi_byte_characters_are_never_split(tok):
    ids = tok.encode("naïve café – ✓ 日本語 🙂 done", add_bos=False)
    assert any(tok.id_to_piece(i).startswith("<0x") for i in ids)  # some come as raw bytes
    d = Detokenizer(tok, [])
    deltas = [d.feed([t]) for t in ids] + [d.feed([], final=True)]
    assert "".join(deltas) == tok.decode(ids) and all("\ufffd" not in x for x in deltas)


def test_a_stop_string_ends_the_text_before_it_even_across_deltas(tok):
    ids = tok.encode("the quick brown fox jumps over the lazy dog", add_bos=False)
    d = Detokenizer(tok, ["fox jumps"])
    out = "".join(d.feed([t]) for t in ids)
    assert out == "the quick brown " and d.stopped
    assert d.feed(ids[:2]) == ""
