"""Request parsing and incremental detokenization, without a server."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("fastapi")

from minimemserve.cli import build_parser
from minimemserve.errors import CheckpointError, InvalidRequest
from minimemserve.model.tokenizer import Tokenizer
from minimemserve.server import app
from minimemserve.server.protocol import (
    CHAT_CONFIG,
    BadField,
    ChatFormat,
    Detokenizer,
    parse,
)


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


def _checkpoint_with(tmp_path, source_dir, config_text: str):
    """A copy of ``source_dir`` (files linked) whose ``tokenizer_config.json`` is the text."""
    out = tmp_path / "ckpt"
    out.mkdir()
    for f in source_dir.iterdir():
        if f.name != CHAT_CONFIG:
            (out / f.name).symlink_to(f)
    (out / CHAT_CONFIG).write_text(config_text)
    return out


BROKEN_CHAT_CONFIGS = [
    ("{not json", "cannot read"),
    ('["a list"]', "JSON object"),
    ('{"chat_template": 7}', "must be text"),
    ('{"chat_template": [{"name": "tool_use", "template": "x"}]}', "named 'default'"),
    ('{"chat_template": "{% for m in messages %}{{ m.content }"}', "does not compile"),
]


@pytest.mark.parametrize("text,needle", BROKEN_CHAT_CONFIGS)
def test_a_broken_chat_template_is_a_checkpoint_error_naming_the_file(
    tmp_path, tiny_llama_dir, tok, text, needle
):
    path = _checkpoint_with(tmp_path, tiny_llama_dir, text)
    with pytest.raises(CheckpointError, match=needle) as e:
        ChatFormat(path, tok)
    assert str(path / CHAT_CONFIG) in str(e.value)


def test_the_server_refuses_a_broken_chat_template_before_starting_the_engine(
    tmp_path, tiny_llama_dir, monkeypatch
):
    path = _checkpoint_with(tmp_path, tiny_llama_dir, BROKEN_CHAT_CONFIGS[-1][0])
    monkeypatch.setattr(app.EngineLoop, "start", lambda *a: pytest.fail("the engine started"))
    args = build_parser().parse_args(["serve", "--model", str(path), "--runtime", "inprocess"])
    with pytest.raises(CheckpointError, match=CHAT_CONFIG):
        app.make_server(args)


def test_a_named_default_template_renders_and_raise_exception_is_a_bad_field(tmp_path, tok):
    template = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    )
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}]
    (tmp_path / CHAT_CONFIG).write_text(json.dumps({"chat_template": named}))
    chat = ChatFormat(tmp_path, tok)
    assert chat.render([("user", "hi")]) == tok.prompt_ids("<user>hi")
    with pytest.raises(BadField, match="user first") as e:
        chat.render([("assistant", "hi")])
    assert e.value.param == "messages"


def test_a_lone_surrogate_is_a_bad_request_not_a_tokenizer_crash(tok):
    with pytest.raises(InvalidRequest, match="not valid Unicode"):
        tok.encode("lone \ud800 surrogate")
    with pytest.raises(BadField, match="not valid Unicode") as e:
        parse({"model": "m", "prompt": ["fine", "\udfff"]}, tok, None, 512)
    assert e.value.param == "prompt"


@pytest.mark.parametrize(
    "template, error",
    [
        ("{{ messages.__class__.__mro__ }}", "SecurityError"),
        ("{% for i in range(10**12) %}x{% endfor %}", "OverflowError"),
        ("{{ nothing.here }}", "UndefinedError"),
        ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ],
)
def test_a_template_failing_to_render_is_a_bad_field_naming_messages(
    tmp_path, tok, template, error
):
    (tmp_path / CHAT_CONFIG).write_text(json.dumps({"chat_template": template}))
    with pytest.raises(BadField, match=f"chat template failed.*{error}") as e:
        ChatFormat(tmp_path, tok).render([("user", "hi")])
    assert e.value.param == "messages"


def test_developer_messages_are_system_messages(tiny_llama_dir, tok):
    chat = ChatFormat(tiny_llama_dir, tok)
    body = {"model": "m", "messages": [{"role": "developer", "content": "Be brief."}]}
    body["messages"].append({"role": "user", "content": "hi"})
    as_system = [("system", "Be brief."), ("user", "hi")]
    assert parse(body, tok, chat, 512).prompts == [chat.render(as_system)]


def test_openai_sampling_fields_reach_the_params(tok):
    body = {
        "model": "m",
        "prompt": "hi",
        "frequency_penalty": 0.5,
        "presence_penalty": -1,
        "logit_bias": {"7": 3, "2": -100},
        "min_tokens": 2,
        "user": "someone",
        "tools": [],
        "response_format": {"type": "text"},
    }
    p = parse(body, tok, None, 512).params
    assert (p.frequency_penalty, p.presence_penalty, p.min_tokens) == (0.5, -1.0, 2)
    assert p.logit_bias == ((2, -100.0), (7, 3.0))


@pytest.mark.parametrize(
    "change, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"guided_json": {}}, "guided_json"),
        ({"logit_bias": {"x7": 1}}, "logit_bias"),
        ({"logit_bias": {"7": 101}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"presence_penalty": "1"}, "presence_penalty"),
        ({"min_tokens": 99}, "min_tokens"),
        ({"echo": True}, "echo"),
    ],
)
def test_unimplemented_or_bad_fields_are_refused_naming_themselves(tok, change, param):
    body = {"model": "m", "prompt": "hi", "max_tokens": 4} | change
    with pytest.raises(InvalidRequest, match=param) as e:
        parse(body, tok, None, 512)
    assert param in str(e.value)
    assert app.api_error(e.value).status == 400 and app.api_error(e.value).param == param


def test_stop_strings_count_only_after_min_tokens(tok):
    ids = tok.encode("the fox and the fox jumps", add_bos=False)
    fox = [i for i in range(len(ids)) if tok.decode(ids[: i + 1]).endswith("fox")]
    d = Detokenizer(tok, ["fox"], min_tokens=fox[0] + 2)
    out = "".join(d.feed([t]) for t in ids)
    assert d.stopped and out.startswith("the fox and") and out.count("fox") == 1


@pytest.mark.parametrize("chat", [False, True])
def test_a_prompt_longer_than_the_context_names_the_prompt_and_the_lengths(
    tiny_llama_dir, tok, chat
):
    body = {"model": "m", "max_tokens": 4}
    if chat:
        body["messages"] = [{"role": "user", "content": "word " * 300}]
    else:
        body["prompt"] = list(range(3, 103))
    form = ChatFormat(tiny_llama_dir, tok) if chat else None
    with pytest.raises(BadField) as e:
        parse(body, tok, form, 64)
    assert e.value.param == ("messages" if chat else "prompt")
    length = len(parse(body | {"max_tokens": 1}, tok, form, 10_000).prompts[0])
    assert f"is {length} tokens but the context holds 64" in str(e.value)
    body.pop("max_tokens")  # the default leaves no room either
    with pytest.raises(BadField, match="context holds 64") as e:
        parse(body, tok, form, 64)
    assert e.value.param == ("messages" if chat else "prompt")
