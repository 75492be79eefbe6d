"""The sentencepiece tokenizer of a Llama checkpoint (``tokenizer.model``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import sentencepiece as spm

from minimemserve.errors import CheckpointError, InvalidRequest

TOKENIZER_FILENAME = "tokenizer.model"


class Tokenizer:
    """Text to token ids and back, through a sentencepiece model.

    ``encode`` prepends BOS by default, as Llama-2 prompts start with it; ``decode`` drops
    control tokens (BOS, EOS, padding) unless asked to render them.
    """

    def __init__(self, processor: spm.SentencePieceProcessor, source: str = "<memory>") -> None:
        self._sp = processor
        self.source = source
        self._special = frozenset(
            i for i in range(processor.get_piece_size()) if processor.is_control(i)
        )

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
        return cls(processor, source=str(file))

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
        value = self._sp.bos_id()
        return None if value < 0 else value

    @property
    def eos_id(self) -> int | None:
        """End-of-sequence id, or None if the model has none."""
        value = self._sp.eos_id()
        return None if value < 0 else value

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``, with BOS first when ``add_bos`` (and the model has one)."""
        if not isinstance(text, str):
            raise InvalidRequest(f"text to encode must be a str, got {type(text).__name__}")
        ids = self._sp.encode(text)
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of ``ids``; control tokens are dropped, or rendered as their piece when
        ``skip_special`` is False."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InvalidRequest(
                f"token id(s) {bad[:5]} outside the vocabulary [0, {self.vocab_size})"
            )
        if skip_special:
            return self._sp.decode([i for i in ids if i not in self._special])
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self._special:
                if run:
                    parts.append(self._sp.decode(run))
                    run = []
                parts.append(self._sp.id_to_piece(i))
            else:
                run.append(i)
        if run:
            parts.append(self._sp.decode(run))
        return "".join(parts)

    def id_to_piece(self, token_id: int) -> str:
        """The sentencepiece piece of one id (``"▁the"``, ``"<0x0A>"``, ``"</s>"``...)."""
        if not 0 <= token_id < self.vocab_size:
            raise InvalidRequest(f"token id {token_id} outside the vocabulary")
        return self._sp.id_to_piece(token_id)
