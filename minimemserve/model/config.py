"""The Llama model configuration, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minimemserve.errors import CheckpointError, ConfigError

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


@dataclass(frozen=True)
class RopeScaling:
    """Linear RoPE scaling (position interpolation): positions are divided by ``factor``."""

    factor: float
    rope_type: str = "linear"

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope scaling type {self.rope_type!r}; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if not self.factor > 0:
            raise ConfigError(f"rope scaling factor must be positive, got {self.factor}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> RopeScaling | None:
        """Parse an HF ``rope_scaling`` / ``rope_parameters`` dict; None for plain RoPE."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ConfigError(f"rope scaling must be a dict or None, got {raw!r}")
        rope_type = raw.get("rope_type", raw.get("type"))
        if rope_type in _PLAIN_ROPE_TYPES:
            return None
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope scaling type {rope_type!r}; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if "factor" not in raw:
            raise ConfigError(f"rope scaling {rope_type!r} needs a 'factor', got {raw!r}")
        return cls(factor=float(raw["factor"]), rope_type=str(rope_type))

    def to_dict(self) -> dict[str, Any]:
        """The HF form, ``{"rope_type": ..., "factor": ...}``."""
        return {"rope_type": self.rope_type, "factor": self.factor}


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and constants of a Llama-2-family decoder.

    Field names follow Hugging Face's ``LlamaConfig``. ``head_dim`` defaults to
    ``hidden_size // num_attention_heads``. ``eos_token_ids`` lists every id that ends a
    generation (``config.json`` may give several); ``eos_token_id`` is the first of them.
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
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"hidden_size {self.hidden_size} is not divisible by "
                    f"num_attention_heads {self.num_attention_heads}"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if not isinstance(self.head_dim, int) or self.head_dim <= 0 or self.head_dim % 2:
            raise ConfigError(f"head_dim must be a positive even int (RoPE), got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be positive, got {self.rope_theta}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError(
                f"rope_scaling must be a RopeScaling or None, got {self.rope_scaling}"
            )
        eos_ids = tuple(self.eos_token_ids)
        if not eos_ids and self.eos_token_id is not None:
            eos_ids = (self.eos_token_id,)
        if eos_ids and self.eos_token_id is None:
            object.__setattr__(self, "eos_token_id", eos_ids[0])
        if eos_ids and self.eos_token_id != eos_ids[0]:
            raise ConfigError(
                f"eos_token_id {self.eos_token_id} is not the first of eos_token_ids {eos_ids}"
            )
        object.__setattr__(self, "eos_token_ids", eos_ids)
        special = [self.bos_token_id, *eos_ids]
        for token_id in special:
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise ConfigError(
                    f"special token id {token_id} is outside the vocabulary [0, {self.vocab_size})"
                )

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

        Raises ``CheckpointError`` when the file is missing or unreadable, when it describes
        something other than a Llama causal LM, or when a value is invalid or unsupported.
        """
        path = Path(path)
        file = path / CONFIG_FILENAME if path.is_dir() else path
        if not file.is_file():
            raise CheckpointError(f"missing {CONFIG_FILENAME}: {file} does not exist")
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"cannot read {file}: {exc}") from exc
        if not isinstance(raw, dict):
            raise CheckpointError(f"{file} does not hold a JSON object")
        try:
            return cls._from_hf_dict(raw)
        except (KeyError, TypeError, ValueError) as exc:  # ConfigError is a ValueError
            message = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
            raise CheckpointError(f"{file}: {message}") from exc

    @classmethod
    def _from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        architectures = raw.get("architectures") or []
        model_type = raw.get("model_type")
        if LLAMA_ARCHITECTURE not in architectures and model_type != LLAMA_MODEL_TYPE:
            named = ", ".join(architectures) if architectures else f"model_type {model_type!r}"
            raise CheckpointError(
                f"unsupported architecture {named}; only {LLAMA_ARCHITECTURE} "
                f"(model_type {LLAMA_MODEL_TYPE!r}) is supported"
            )
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise CheckpointError(f"unsupported hidden_act {hidden_act!r}; only 'silu'")
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
        rope_theta = HF_DEFAULT_ROPE_THETA if rope_theta is None else float(rope_theta)

        eos = raw.get("eos_token_id")
        eos_ids = tuple(int(i) for i in eos) if isinstance(eos, list) else ()
        eos_id = eos_ids[0] if eos_ids else (None if eos is None else int(eos))
        if isinstance(eos, list) and not eos_ids:
            eos_id = None

        heads = int(raw["num_attention_heads"])
        kv_heads = raw.get("num_key_value_heads")
        head_dim = raw.get("head_dim")
        torch_dtype = raw.get("torch_dtype", raw.get("dtype"))
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=heads if kv_heads is None else int(kv_heads),
            head_dim=None if head_dim is None else int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", HF_DEFAULT_RMS_NORM_EPS)),
            rope_theta=rope_theta,
            rope_scaling=RopeScaling.from_dict(rope_raw),
            max_position_embeddings=int(
                raw.get("max_position_embeddings", HF_DEFAULT_MAX_POSITIONS)
            ),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=None if raw.get("bos_token_id") is None else int(raw["bos_token_id"]),
            eos_token_id=eos_id,
            eos_token_ids=eos_ids,
            torch_dtype=None if torch_dtype is None else str(torch_dtype),
        )
