"""The Llama model configuration, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
import math
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
# RoPE variants the model implements; "default" means plain RoPE (no scaling).
SUPPORTED_ROPE_TYPES = ("linear",)
_PLAIN_ROPE_TYPES = ("default", None)


# The model builds fp32 cos and sin tables for every position when it is constructed;
# 1 GiB of them is 1M positions at head_dim 128, so a longer context is a corrupt config.
MAX_ROTARY_TABLE_BYTES = 2**30
# Far above any Llama-2-family model (70B); a larger count means a corrupt config.json.
MAX_PARAMETERS = 2**40

_POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
)
_POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta")
_OPTIONAL_TOKEN_IDS = ("bos_token_id", "eos_token_id")


def _is_int(value: Any) -> bool:
    """A plain int (not a bool) within int64, as torch sizes and token ids must be."""
    return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63


def _positive_float(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite positive number; ``ConfigError`` otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            if math.isfinite(value) and value > 0:
                return float(value)
        except OverflowError:  # an int beyond the float range
            pass
    raise ConfigError(f"{name} must be a finite positive number, got {shown(value)}")


@dataclass(frozen=True)
class RopeScaling:
    """Linear RoPE scaling (position interpolation): positions are divided by ``factor``."""

    factor: float
    rope_type: str = "linear"

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope scaling type {shown(self.rope_type)}; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        object.__setattr__(self, "factor", _positive_float("rope scaling factor", self.factor))

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> RopeScaling | None:
        """Parse an HF ``rope_scaling`` / ``rope_parameters`` dict; None for plain RoPE."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ConfigError(f"rope scaling must be a dict or None, got {shown(raw)}")
        rope_type = raw.get("rope_type", raw.get("type"))
        if rope_type in _PLAIN_ROPE_TYPES:
            return None
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope scaling type {shown(rope_type)}; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if "factor" not in raw:
            raise ConfigError(f"rope scaling {shown(rope_type)} needs a 'factor', got {shown(raw)}")
        return cls(factor=raw["factor"], rope_type=str(rope_type))

    def to_dict(self) -> dict[str, Any]:
        """The HF form, ``{"rope_type": ..., "factor": ...}``."""
        return {"rope_type": self.rope_type, "factor": self.factor}


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and constants of a Llama-2-family decoder.

    Field names follow Hugging Face's ``LlamaConfig``. ``head_dim`` defaults to
    ``hidden_size // num_attention_heads``. ``eos_token_ids`` lists every id that ends a
    generation (``config.json`` may give several); ``eos_token_id`` is the first of them.
    Every field is type-checked (a bool or a float is not a size), and the sizes are bounded
    by the memory they imply (``MAX_ROTARY_TABLE_BYTES``, ``MAX_PARAMETERS``) so that a
    corrupt config fails here instead of when the model allocates.
    """

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

    def __post_init__(self) -> None:
        self._check_types()
        self._check_shapes()
        self._check_special_tokens()
        self._check_memory()

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _check_types(self) -> None:
        if isinstance(self.rope_scaling, dict):
            self._set("rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        if self.num_key_value_heads is None:
            self._set("num_key_value_heads", self.num_attention_heads)
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ConfigError(f"ModelConfig.{name} must be a positive int, got {shown(value)}")
        for name in _POSITIVE_FLOATS:
            self._set(name, _positive_float(name, getattr(self, name)))
        for name in _OPTIONAL_TOKEN_IDS:
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise ConfigError(f"ModelConfig.{name} must be an int or None, got {shown(value)}")
        ids = self.eos_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) for i in ids):
            raise ConfigError(f"ModelConfig.eos_token_ids must be a list of ints, got {shown(ids)}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError(
                f"tie_word_embeddings must be a bool, got {shown(self.tie_word_embeddings)}"
            )
        if self.torch_dtype is not None and not isinstance(self.torch_dtype, str):
            raise ConfigError(f"torch_dtype must be a str or None, got {shown(self.torch_dtype)}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError(
                f"rope_scaling must be a RopeScaling or None, got {shown(self.rope_scaling)}"
            )

    def _check_shapes(self) -> None:
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"hidden_size {self.hidden_size} is not divisible by "
                    f"num_attention_heads {self.num_attention_heads}"
                )
            self._set("head_dim", self.hidden_size // self.num_attention_heads)
        if not _is_int(self.head_dim) or self.head_dim <= 0 or self.head_dim % 2:
            raise ConfigError(
                f"head_dim must be a positive even int (RoPE), got {shown(self.head_dim)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    def _check_special_tokens(self) -> None:
        eos_ids = tuple(self.eos_token_ids)
        if not eos_ids and self.eos_token_id is not None:
            eos_ids = (self.eos_token_id,)
        if eos_ids and self.eos_token_id is None:
            self._set("eos_token_id", eos_ids[0])
        if eos_ids and self.eos_token_id != eos_ids[0]:
            raise ConfigError(
                f"eos_token_id {self.eos_token_id} is not the first of eos_token_ids {eos_ids}"
            )
        self._set("eos_token_ids", eos_ids)
        for token_id in (self.bos_token_id, *eos_ids):
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise ConfigError(
                    f"special token id {token_id} is outside the vocabulary [0, {self.vocab_size})"
                )

    def _check_memory(self) -> None:
        rotary = self.rotary_table_bytes()
        if rotary > MAX_ROTARY_TABLE_BYTES:
            raise ConfigError(
                f"max_position_embeddings {self.max_position_embeddings} at head_dim "
                f"{self.head_dim} needs {rotary / 2**30:.3g} GiB of rotary tables; "
                f"the limit is {MAX_ROTARY_TABLE_BYTES / 2**30:g} GiB"
            )
        if self.num_parameters() > MAX_PARAMETERS:
            raise ConfigError(
                f"vocab_size {self.vocab_size}, hidden_size {self.hidden_size}, intermediate_size "
                f"{self.intermediate_size} and num_hidden_layers {self.num_hidden_layers} make "
                f"a model of more than {MAX_PARAMETERS:.3g} parameters"
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
        mlp = 3 * h * self.intermediate_size
        per_layer = attention + mlp + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embeddings + h

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` from a checkpoint directory (or the file itself).

        Raises ``CheckpointError`` naming the file when it is missing, unreadable or not a
        JSON object, when it describes something other than a Llama causal LM, or when a
        value has the wrong type, is invalid or is unsupported.
        """
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
        except CheckpointError as exc:
            raise CheckpointError(f"{file}: {exc}") from exc
        except (KeyError, TypeError, ValueError, ArithmeticError) as exc:
            message = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
            raise CheckpointError(f"{file}: {message}") from exc

    @classmethod
    def _from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Values keep their JSON types; ``__post_init__`` rejects the wrong ones."""
        architectures = raw.get("architectures") or []
        if not isinstance(architectures, list) or not all(
            isinstance(a, str) for a in architectures
        ):
            raise CheckpointError(
                f"architectures must be a list of names, got {shown(architectures)}"
            )
        model_type = raw.get("model_type")
        if LLAMA_ARCHITECTURE not in architectures and model_type != LLAMA_MODEL_TYPE:
            named = ", ".join(architectures) if architectures else f"model_type {shown(model_type)}"
            raise CheckpointError(
                f"unsupported architecture {named}; only {LLAMA_ARCHITECTURE} "
                f"(model_type {LLAMA_MODEL_TYPE!r}) is supported"
            )
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise CheckpointError(f"unsupported hidden_act {shown(hidden_act)}; only 'silu'")
        for flag in ("attention_bias", "mlp_bias"):
            if raw.get(flag):
                raise CheckpointError(f"unsupported {flag}=true; Llama-2 layers have no bias")

        # Newer transformers keep rope_theta and the scaling together in rope_parameters.
        rope_parameters = raw.get("rope_parameters")
        if isinstance(rope_parameters, dict):
            rope_theta = rope_parameters.get("rope_theta", raw.get("rope_theta"))
            rope_raw = rope_parameters
        else:
            rope_theta = raw.get("rope_theta")
            rope_raw = raw.get("rope_scaling")

        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ()
        eos_id = eos_ids[0] if eos_ids else (None if isinstance(eos, list) else eos)
        torch_dtype = raw.get("torch_dtype", raw.get("dtype"))
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads"),
            head_dim=raw.get("head_dim"),
            rms_norm_eps=raw.get("rms_norm_eps", HF_DEFAULT_RMS_NORM_EPS),
            rope_theta=HF_DEFAULT_ROPE_THETA if rope_theta is None else rope_theta,
            rope_scaling=RopeScaling.from_dict(rope_raw),
            max_position_embeddings=raw.get("max_position_embeddings", HF_DEFAULT_MAX_POSITIONS),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos_id,
            eos_token_ids=eos_ids,
            torch_dtype=torch_dtype,
        )
