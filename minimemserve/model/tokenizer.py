"""The sentencepiece tokenizer of a Llama checkpoint (``tokenizer.model``)."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from pathlib import Path

import sentencepiece as spm

from minimemserve.errors import CheckpointError, InvalidRequest

TOKENIZER_FILENAME = "tokenizer.model"


class Tokenizer:
    """Text to token ids and back, through a sentencepiece model. ``encode`` prepends BOS
    by default, as Llama-2 prompts start with it; ``decode`` drops control tokens."""

    def __init__(self, processor: spm.SentencePieceProcessor) -> None:
        self._sp = processor
        self._special = frozenset(filter(processor.is_control, range(len(processor))))

    @classmethod
    def from_file(cls, file: str | Path) -> Tokenizer:
        """Load a sentencepiece model file; ``CheckpointError`` if missing or unreadable."""
        file = Path(file)
        if not file.is_file():
            raise CheckpointError(f"missing tokenizer: {file} does not exist")
        processor = spm.SentencePieceProcessor()
        try:
            processor.load(str(file))
        except (OSError, RuntimeError) as exc:
            raise CheckpointError(f"cannot load sentencepiece model {file}: {exc}") from exc
        return cls(processor)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.model`` from a checkpoint directory."""
        return cls.from_file(Path(path) / TOKENIZER_FILENAME)

    @property
    def vocab_size(self) -> int:
        """Number of pieces, control and byte pieces included."""
        return self._sp.get_piece_size()

    @property
    def bos_id(self) -> int | None:
        """Begin-of-sequence id, or None if the model has none."""
        return self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    @property
    def eos_id(self) -> int | None:
        """End-of-sequence id, or None if the model has none."""
        return self._sp.eos_id() if self._sp.eos_id() >= 0 else None

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``, with BOS first when ``add_bos`` (and the model has one)."""
        if not isinstance(text, str):
            raise InvalidRequest(f"text to encode must be a str, got {type(text).__name__}")
        try:
            text.encode()
        except UnicodeEncodeError as e:  # sentencepiece takes UTF-8, which has no surrogates
            bad = text[e.start : e.end]
            raise InvalidRequest(f"text is not valid Unicode: {bad!r} at {e.start}") from None
        ids = self._sp.encode(text)
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
        """Text of ``ids``; control tokens dropped (shown as pieces unless ``skip_special``)."""
        ids, n = [int(i) for i in ids], self.vocab_size
        if bad := [i for i in ids if not 0 <= i < n]:
            raise InvalidRequest(f"token id(s) {bad[:5]} outside the vocabulary [0, {n})")
        if skip_special:
            return self._sp.decode([i for i in ids if i not in self._special])
        runs = itertools.groupby(ids, key=self._special.__contains__)
        return "".join(
            "".join(map(self._sp.id_to_piece, run)) if special else self._sp.decode(list(run))
            for special, run in runs
        )

    def id_to_piece(self, token_id: int) -> str:
        """The sentencepiece piece of one id (``"▁the"``, ``"<0x0A>"``, ``"</s>"``...)."""
        if not 0 <= token_id < self.vocab_size:
            raise InvalidRequest(f"token id {token_id} outside the vocabulary")
        return self._sp.id_to_piece(token_id)
