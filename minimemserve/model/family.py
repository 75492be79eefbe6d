"""What names a model family: the HF architecture names that select it and its model class."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .layers import CausalLM


@dataclass(frozen=True)
class Family:
    """A model family: ``config.json`` whose ``architectures`` lists one of ``architectures``
    (or, without that list, whose ``model_type`` is ``model_type``) is built as ``model(cfg)``."""

    name: str
    architectures: tuple[str, ...]
    model: type[CausalLM]
    model_type: str | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.model, type) and issubclass(self.model, CausalLM)):
            raise ConfigError(f"family {self.name!r}: model must be a CausalLM subclass")
        if not self.architectures or not all(isinstance(a, str) for a in self.architectures):
            raise ConfigError(f"family {self.name!r}: architectures must be non-empty names")
