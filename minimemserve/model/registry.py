"""The model registry: which family a checkpoint is, from its ``config.json``.

One file per family (``llama.py``, ``qwen2.py``, ``qwen3.py``) defines its model class and a
``FAMILY``; this table lists them. Adding a family is one file and one line here, or, from
outside the package, one :func:`register` call."""

from __future__ import annotations

from ..errors import CheckpointError, ConfigError
from .config import ModelConfig
from .family import Family
from .layers import CausalLM
from .llama import FAMILY as LLAMA
from .qwen2 import FAMILY as QWEN2
from .qwen3 import FAMILY as QWEN3

_FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, QWEN2, QWEN3)}


def register(family: Family) -> None:
    """Add ``family`` (its name must be new, its architecture names unclaimed)."""
    if family.name in _FAMILIES:
        raise ConfigError(f"a model family named {family.name!r} is already registered")
    claimed = {a for f in _FAMILIES.values() for a in f.architectures}
    if taken := claimed.intersection(family.architectures):
        raise ConfigError(f"architecture(s) {sorted(taken)} already belong to another family")
    _FAMILIES[family.name] = family


def supported() -> list[str]:
    """Every HF architecture name the registry loads."""
    return [a for f in _FAMILIES.values() for a in f.architectures]


def family_of(cfg: ModelConfig) -> Family:
    """The family of ``cfg``: by its ``architectures``, else its ``model_type``; an unknown one
    is a ``CheckpointError`` naming the supported architectures."""
    for family in _FAMILIES.values():
        if set(cfg.architectures) & set(family.architectures):
            return family
    if not cfg.architectures:
        for family in _FAMILIES.values():
            if family.model_type is not None and family.model_type == cfg.model_type:
                return family
    named = ", ".join(cfg.architectures) or f"model_type {cfg.model_type!r}"
    raise CheckpointError(f"unsupported architecture {named}; supported: {', '.join(supported())}")


def build_model(cfg: ModelConfig) -> CausalLM:
    """An untrained model of ``cfg``'s family at ``cfg``'s sizes, built of the family's
    layers (weights come after)."""
    family = family_of(cfg)
    return family.model(cfg, family.layer)
