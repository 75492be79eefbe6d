"""A decoder's configuration, read from a Hugging Face ``config.json``.

The fields every supported family shares (sizes, RoPE, special tokens) are read here; which
family the checkpoint is (its ``architectures``) is recorded, and ``model/registry.py`` maps
it to the family's model class."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minimemserve.errors import CheckpointError, ConfigError, shown

CONFIG_FILENAME = "config.json"
LLAMA_ARCHITECTURE = "LlamaForCausalLM"
LLAMA_MODEL_TYPE = "llama"
# Defaults of transformers' LlamaConfig, used when config.json leaves a field out.
HF_DEFAULT_RMS_NORM_EPS = 1e-6
HF_DEFAULT_ROPE_THETA = 10000.0
HF_DEFAULT_MAX_POSITIONS = 2048
# RoPE variants the model implements (as HF defines them); "default" means plain RoPE.
SUPPORTED_ROPE_TYPES = ("linear", "llama3")
# The extra fields of each variant beyond ``factor`` (all required, as HF requires them).
_ROPE_FIELDS = {
    "linear": (),
    "llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# The model builds fp32 cos and sin tables for every position when it is constructed;
# 1 GiB of them is 1M positions at head_dim 128, so a longer context is a corrupt config.
MAX_ROTARY_TABLE_BYTES = 2**30
# Far above any supported model (70B); a larger count means a corrupt config.json.
MAX_PARAMETERS = 2**40

# Fields config.json must give, and fields that keep ModelConfig's default when it does not.
_REQUIRED = "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads".split()
_OPTIONAL = ("num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings")


def _is_int(value: Any) -> bool:
    """A plain int (not a bool) within int64, as torch sizes and token ids must be."""
    return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63


def _positive_float(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite positive number; ``ConfigError`` otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError):  # an int beyond the float range
            if math.isfinite(value) and value > 0:
                return float(value)
    raise ConfigError(f"{name} must be a finite positive number, got {shown(value)}")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling as HF defines it: ``linear`` divides every frequency by ``factor``
    (position interpolation); ``llama3`` divides only the low frequencies (wavelengths above
    ``original_max_position_embeddings / low_freq_factor``) and blends the middle band."""

    factor: float
    rope_type: str = "linear"
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: float | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope scaling type {shown(self.rope_type)}; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        object.__setattr__(self, "factor", _positive_float("rope scaling factor", self.factor))
        for name in _ROPE_FIELDS[self.rope_type]:
            value = _positive_float(f"rope scaling {name}", getattr(self, name))
            object.__setattr__(self, name, value)
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError("rope scaling high_freq_factor must exceed low_freq_factor")

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> RopeScaling | None:
        """Parse an HF ``rope_scaling`` / ``rope_parameters`` dict; None for plain RoPE."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ConfigError(f"rope scaling must be a dict or None, got {shown(raw)}")
        rope_type = raw.get("rope_type", raw.get("type"))
        if rope_type in ("default", None):
            return None
        needed = ("factor", *_ROPE_FIELDS.get(rope_type, ()))
        if rope_type in SUPPORTED_ROPE_TYPES and (missing := [k for k in needed if k not in raw]):
            raise ConfigError(f"rope scaling {shown(rope_type)} needs {missing}, got {shown(raw)}")
        extra = {k: raw[k] for k in _ROPE_FIELDS.get(rope_type, ())}
        return cls(factor=raw.get("factor"), rope_type=rope_type, **extra)

    def to_dict(self) -> dict[str, Any]:
        """The HF form, ``{"rope_type": ..., "factor": ...}`` and the variant's own fields."""
        extra = {k: getattr(self, k) for k in _ROPE_FIELDS[self.rope_type]}
        return {"rope_type": self.rope_type, "factor": self.factor, **extra}


_POSITIVE_INT = (lambda v: _is_int(v) and v > 0, "a positive int")
_OPTIONAL_ID = (lambda v: v is None or _is_int(v), "an int or None")
# field -> (accepts the value, what a valid value is); the float fields are converted apart
_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    **dict.fromkeys([*_REQUIRED, "num_key_value_heads", "max_position_embeddings"], _POSITIVE_INT),
    "bos_token_id": _OPTIONAL_ID,
    "eos_token_id": _OPTIONAL_ID,
    "eos_token_ids": (
        lambda v: isinstance(v, (list, tuple)) and all(map(_is_int, v)),
        "a list of ints",
    ),
    "tie_word_embeddings": (lambda v: isinstance(v, bool), "a bool"),
    "torch_dtype": (lambda v: v is None or isinstance(v, str), "a str or None"),
    "rope_scaling": (lambda v: v is None or isinstance(v, RopeScaling), "a RopeScaling or None"),
    "architectures": (
        lambda v: isinstance(v, tuple) and all(isinstance(a, str) for a in v),
        "a tuple of str",
    ),
    "model_type": (lambda v: v is None or isinstance(v, str), "a str or None"),
}


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and constants of a decoder, named as in HF's ``LlamaConfig``; ``architectures``
    and ``model_type`` name the family (``model/registry.py`` resolves them).
    ``head_dim`` defaults to ``hidden_size // num_attention_heads``; ``eos_token_ids`` lists every
    id that ends a generation (``eos_token_id`` is the first). Types are checked and sizes bounded
    by the memory they imply, so a corrupt config fails here."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = HF_DEFAULT_RMS_NORM_EPS
    rope_theta: float = HF_DEFAULT_ROPE_THETA
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = HF_DEFAULT_MAX_POSITIONS
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    eos_token_ids: tuple[int, ...] = field(default=())
    torch_dtype: str | None = None
    architectures: tuple[str, ...] = (LLAMA_ARCHITECTURE,)
    model_type: str | None = LLAMA_MODEL_TYPE

    def __post_init__(self) -> None:
        self._check_fields()
        self._check_special_tokens()
        if (rotary := self.rotary_table_bytes()) > MAX_ROTARY_TABLE_BYTES:
            raise ConfigError(
                f"max_position_embeddings {self.max_position_embeddings} at head_dim "
                f"{self.head_dim} needs {rotary / 2**30:.3g} GiB of rotary tables; "
                f"the limit is {MAX_ROTARY_TABLE_BYTES / 2**30:g} GiB"
            )
        if (n := self.num_parameters()) > MAX_PARAMETERS:
            raise ConfigError(f"the sizes make {n:.3g} parameters, more than {MAX_PARAMETERS:.3g}")

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _check_fields(self) -> None:
        if isinstance(self.rope_scaling, dict):
            self._set("rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        if isinstance(self.architectures, list):
            self._set("architectures", tuple(self.architectures))
        if self.num_key_value_heads is None:
            self._set("num_key_value_heads", self.num_attention_heads)
        for name, (valid, rule) in _CHECKS.items():
            value = getattr(self, name)
            if not valid(value):
                raise ConfigError(f"ModelConfig.{name} must be {rule}, got {shown(value)}")
        for name in ("rms_norm_eps", "rope_theta"):
            self._set(name, _positive_float(name, getattr(self, name)))
        if self.head_dim is None:
            self._check_divisible("hidden_size", "num_attention_heads")
            self._set("head_dim", self.hidden_size // self.num_attention_heads)
        if not _is_int(self.head_dim) or self.head_dim <= 0 or self.head_dim % 2:
            raise ConfigError(f"head_dim must be a positive even int, got {shown(self.head_dim)}")
        self._check_divisible("num_attention_heads", "num_key_value_heads")

    def _check_divisible(self, name: str, by: str) -> None:
        a, b = getattr(self, name), getattr(self, by)
        if a % b:
            raise ConfigError(f"{name} {a} is not divisible by {by} {b}")

    def _check_special_tokens(self) -> None:
        eos_ids = tuple(self.eos_token_ids)
        if not eos_ids and self.eos_token_id is not None:
            eos_ids = (self.eos_token_id,)
        if eos_ids and self.eos_token_id is None:
            self._set("eos_token_id", eos_ids[0])
        if eos_ids and self.eos_token_id != eos_ids[0]:
            raise ConfigError(f"eos_token_id {self.eos_token_id} is not the first of {eos_ids}")
        self._set("eos_token_ids", eos_ids)
        for token_id in (self.bos_token_id, *eos_ids):
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise ConfigError(
                    f"special token id {token_id} is outside the vocabulary [0, {self.vocab_size})"
                )

    def rotary_table_bytes(self) -> int:
        """Bytes of the fp32 cos and sin tables the model builds for every position."""
        return 2 * 4 * self.max_position_embeddings * self.head_dim

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head (1 for multi-head attention, >1 for GQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    def num_parameters(self) -> int:
        """Parameters of the model, counting a tied lm_head once."""
        h, d = self.hidden_size, self.head_dim
        attention = h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        per_layer = attention + 3 * h * self.intermediate_size + 2 * h  # + MLP and two norms
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embeddings + h

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` from a checkpoint directory (or the file itself). Any problem
        (missing, not JSON, a bad value) is a ``CheckpointError`` naming the file. The family is
        recorded, not checked: loading weights or building the model rejects an unknown one."""
        path = Path(path)
        file = path / CONFIG_FILENAME if path.is_dir() else path
        if not file.is_file():
            raise CheckpointError(f"missing {CONFIG_FILENAME}: {file} does not exist")
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as exc:  # bad UTF-8 is a ValueError too
            raise CheckpointError(f"cannot read {file} as JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise CheckpointError(f"{file} does not hold a JSON object")
        try:
            return cls._from_hf_dict(raw)
        except (KeyError, TypeError, ValueError, ArithmeticError) as exc:  # CheckpointError too
            message = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
            raise CheckpointError(f"{file}: {message}") from exc

    @classmethod
    def _from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Values keep their JSON types; ``__post_init__`` rejects the wrong ones."""
        archs = raw.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise CheckpointError(f"architectures must be a list of names, got {shown(archs)}")
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise CheckpointError(f"unsupported hidden_act {shown(hidden_act)}; only 'silu'")
        for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
            if raw.get(flag):
                raise CheckpointError(f"unsupported {flag}=true")
        # Newer transformers keep rope_theta and the scaling together in rope_parameters.
        rope, rope_theta = raw.get("rope_parameters"), raw.get("rope_theta")
        if isinstance(rope, dict):
            rope_theta = rope.get("rope_theta", rope_theta)
        else:
            rope = raw.get("rope_scaling")
        eos = raw.get("eos_token_id")  # an id, or a list of them
        return cls(
            **{name: raw[name] for name in _REQUIRED},
            **{name: raw[name] for name in _OPTIONAL if name in raw},
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            bos_token_id=raw.get("bos_token_id"),
            rope_theta=HF_DEFAULT_ROPE_THETA if rope_theta is None else rope_theta,
            rope_scaling=RopeScaling.from_dict(rope),
            eos_token_id=None if isinstance(eos, list) else eos,
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (),
            torch_dtype=raw.get("torch_dtype", raw.get("dtype")),
            architectures=tuple(archs),
            model_type=raw.get("model_type"),
        )
