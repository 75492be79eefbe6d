"""What names a model family: the HF architecture names that select it, its model class and
the layer class its model is built of."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..errors import ConfigError
from .config import ModelConfig
from .layers import CausalLM, DecoderLayer


@dataclass(frozen=True)
class Family:
    """A model family: ``config.json`` whose ``architectures`` lists one of ``architectures``
    (or, without that list, whose ``model_type`` is ``model_type``) is built as
    ``model(cfg, layer)``: a family that changes a layer brings its own ``layer`` class."""

    name: str
    architectures: tuple[str, ...]
    model: type[CausalLM]
    model_type: str | None = None
    layer: type[nn.Module] = DecoderLayer

    def __post_init__(self) -> None:
        if not (isinstance(self.model, type) and issubclass(self.model, CausalLM)):
            raise ConfigError(f"family {self.name!r}: model must be a CausalLM subclass")
        if not self.architectures or not all(isinstance(a, str) for a in self.architectures):
            raise ConfigError(f"family {self.name!r}: architectures must be non-empty names")
        layer = self.layer
        if not (isinstance(layer, type) and issubclass(layer, nn.Module)):
            raise ConfigError(f"family {self.name!r}: layer must be an nn.Module subclass")
        if not callable(getattr(layer, "hf_tensors", None)):
            raise ConfigError(f"family {self.name!r}: layer {layer.__name__} has no hf_tensors")

    def layer_tensors(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The HF tensors (names after ``model.layers.<i>.``) and shapes of one layer."""
        return self.layer.hf_tensors(cfg, self.model.qkv_bias, self.model.qk_norm)
