"""A checkpoint's tokenizer: SentencePiece (``tokenizer.model``, Llama / Llama-2) or Hugging
Face's fast tokenizers (``tokenizer.json``: Llama-3, Qwen2, Qwen3), behind one class.

A ``tokenizer.json`` names no BOS or EOS by itself; they come from ``tokenizer_config.json``
beside it (``bos_token`` / ``eos_token``, a string or ``{"content": ...}``), as in
``transformers``."""

from __future__ import annotations

import itertools
import json
import operator
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import sentencepiece as spm
from tokenizers import Tokenizer as HFTokenizer

from minimemserve.errors import CheckpointError, InvalidRequest

TOKENIZER_FILENAME = "tokenizer.model"
HF_TOKENIZER_FILENAME = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


class Pieces(Protocol):
    """What :class:`Tokenizer` needs of a tokenizer library: ids of text without special
    tokens, text of ids, the piece of one id, the vocabulary size and the special ids."""

    size: int
    bos: int | None
    eos: int | None
    special: frozenset[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def piece(self, token_id: int) -> str: ...


class SentencePiece:
    """A sentencepiece model (``tokenizer.model``); its control pieces are the special ids."""

    def __init__(self, processor: spm.SentencePieceProcessor) -> None:
        self._sp = processor
        self.size = processor.get_piece_size()
        self.bos = processor.bos_id() if processor.bos_id() >= 0 else None
        self.eos = processor.eos_id() if processor.eos_id() >= 0 else None
        self.special = frozenset(filter(processor.is_control, range(len(processor))))

    @classmethod
    def load(cls, file: Path) -> SentencePiece:
        """Read a sentencepiece model file; ``CheckpointError`` if it is not one."""
        processor = spm.SentencePieceProcessor()
        try:
            processor.load(str(file))
        except (OSError, RuntimeError) as exc:
            raise CheckpointError(f"cannot load sentencepiece model {file}: {exc}") from exc
        return cls(processor)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, no BOS."""
        return self._sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``."""
        return self._sp.decode(ids)

    def piece(self, token_id: int) -> str:
        """The piece of one id."""
        return self._sp.id_to_piece(token_id)


def _special_name(value: Any) -> str | None:
    """A ``tokenizer_config.json`` special token: a string, ``{"content": ...}`` or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_config(file: Path) -> dict[str, Any]:
    """``tokenizer_config.json`` as a dict (empty when the file is absent)."""
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"cannot read {file} as JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{file} does not hold a JSON object")
    return config


class FastTokenizer:
    """An HF ``tokenizer.json`` (the ``tokenizers`` library); its added special tokens are the
    special ids, and ``tokenizer_config.json`` names BOS and EOS."""

    def __init__(self, tok: HFTokenizer, config: dict[str, Any]) -> None:
        self._tok = tok
        self.size = tok.get_vocab_size(with_added_tokens=True)
        added = tok.get_added_tokens_decoder()
        self.special = frozenset(i for i, t in added.items() if t.special)
        self.bos = self._id(config.get("bos_token"))
        self.eos = self._id(config.get("eos_token"))

    def _id(self, value: Any) -> int | None:
        name = _special_name(value)
        return None if name is None else self._tok.token_to_id(name)

    @classmethod
    def load(cls, file: Path) -> FastTokenizer:
        """Read ``tokenizer.json`` and the ``tokenizer_config.json`` beside it."""
        try:
            tok = HFTokenizer.from_file(str(file))
        except Exception as exc:  # the library raises a bare Exception on a bad file
            raise CheckpointError(f"cannot load tokenizer {file}: {exc}") from exc
        return cls(tok, _read_config(file.parent / TOKENIZER_CONFIG))

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, no special tokens added."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``."""
        return self._tok.decode(ids, skip_special_tokens=False)

    def piece(self, token_id: int) -> str:
        """The text of one id (``" the"``, not the byte-level ``"Ġthe"``; a special token's
        own name)."""
        return self._tok.decode([token_id], skip_special_tokens=False)


# what a checkpoint directory may hold, in the order it is looked for -> the library reading it
LOADERS = {TOKENIZER_FILENAME: SentencePiece.load, HF_TOKENIZER_FILENAME: FastTokenizer.load}


class Tokenizer:
    """Text to token ids and back, through a sentencepiece model or an HF ``tokenizer.json``.
    ``encode`` prepends BOS by default (when the tokenizer has one), as Llama prompts start
    with it; ``decode`` drops special tokens."""

    def __init__(self, pieces: Pieces) -> None:
        self._pieces = pieces
        self._special = pieces.special

    @classmethod
    def from_file(cls, file: str | Path) -> Tokenizer:
        """Load ``tokenizer.model`` (sentencepiece) or a ``.json`` file (HF); a
        ``CheckpointError`` if missing or unreadable."""
        file = Path(file)
        if not file.is_file():
            raise CheckpointError(f"missing tokenizer: {file} does not exist")
        name = HF_TOKENIZER_FILENAME if file.suffix == ".json" else TOKENIZER_FILENAME
        return cls(LOADERS[name](file))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load a checkpoint directory's ``tokenizer.model``, else its ``tokenizer.json``."""
        path = Path(path)
        for name, load in LOADERS.items():
            if (path / name).is_file():
                return cls(load(path / name))
        raise CheckpointError(f"missing tokenizer: {path} has none of {', '.join(LOADERS)}")

    @property
    def vocab_size(self) -> int:
        """Number of ids, special, added and byte pieces included."""
        return self._pieces.size

    @property
    def bos_id(self) -> int | None:
        """Begin-of-sequence id, or None if the tokenizer has none."""
        return self._pieces.bos

    @property
    def eos_id(self) -> int | None:
        """End-of-sequence id, or None if the tokenizer has none."""
        return self._pieces.eos

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``, with BOS first when ``add_bos`` (and the tokenizer has one)."""
        if not isinstance(text, str):
            raise InvalidRequest(f"text to encode must be a str, got {type(text).__name__}")
        try:
            text.encode()
        except UnicodeEncodeError as e:  # both libraries take UTF-8, which has no surrogates
            bad = text[e.start : e.end]
            raise InvalidRequest(f"text is not valid Unicode: {bad!r} at {e.start}") from None
        ids = self._pieces.encode(text)
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a non-empty prompt: text is encoded, ids of any integer type made ints."""
        if isinstance(prompt, str):
            ids = self.encode(prompt) if prompt else []
        else:
            try:
                ids = [operator.index(t) for t in prompt]
            except TypeError as e:
                raise InvalidRequest(f"a token id is not an integer: {e}") from None
            if any(isinstance(t, bool) for t in prompt):
                raise InvalidRequest("a token id is not an integer: a bool")
        if not ids:
            raise InvalidRequest("empty prompt")
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of ``ids``; special tokens dropped (shown as pieces unless ``skip_special``).
        An id the tokenizer has no entry for has no text: a checkpoint's embedding often has
        more rows than its tokenizer has tokens, and the model may generate any row."""
        n = self.vocab_size
        ids = [i for i in map(int, ids) if 0 <= i < n]
        pieces = self._pieces
        if skip_special:
            return pieces.decode([i for i in ids if i not in self._special])
        runs = itertools.groupby(ids, key=self._special.__contains__)
        return "".join(
            "".join(map(pieces.piece, run)) if special else pieces.decode(list(run))
            for special, run in runs
        )

    def id_to_piece(self, token_id: int) -> str:
        """The piece of one id (sentencepiece: ``"▁the"``, ``"<0x0A>"``, ``"</s>"``; HF: its
        text, ``" the"``, ``"<|im_end|>"``); empty for an id the tokenizer has no entry for."""
        if not 0 <= token_id < self.vocab_size:
            return ""
        return self._pieces.piece(token_id)
