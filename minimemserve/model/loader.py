"""Load Llama weights from a Hugging Face checkpoint directory (``*.safetensors``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from minimemserve.errors import CheckpointError
from minimemserve.model.config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
EMBED_NAME = "model.embed_tokens.weight"
LM_HEAD_NAME = "lm_head.weight"
# Old checkpoints saved RoPE's inverse frequencies as buffers; the model recomputes them.
_ROTARY_BUFFER_SUFFIX = "rotary_emb.inv_freq"
# Weight dtypes a checkpoint may store; integer, bool, complex and fp8 tensors are not
# Llama-2 weights (fp8 needs scales this loader does not read).
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
# How many names an error message lists before it says "and N more".
_NAMES_SHOWN = 5


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint for ``config`` holds, by HF name, with its shape.

    ``lm_head.weight`` is always listed; with tied embeddings a checkpoint may omit it.
    """
    h, d = config.hidden_size, config.head_dim
    q_size = config.num_attention_heads * d
    kv_size = config.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {EMBED_NAME: (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        shapes[f"{layer}.self_attn.q_proj.weight"] = (q_size, h)
        shapes[f"{layer}.self_attn.k_proj.weight"] = (kv_size, h)
        shapes[f"{layer}.self_attn.v_proj.weight"] = (kv_size, h)
        shapes[f"{layer}.self_attn.o_proj.weight"] = (h, q_size)
        shapes[f"{layer}.mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[f"{layer}.mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[f"{layer}.mlp.down_proj.weight"] = (h, config.intermediate_size)
        shapes[f"{layer}.input_layernorm.weight"] = (h,)
        shapes[f"{layer}.post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    shapes[LM_HEAD_NAME] = (config.vocab_size, h)
    return shapes


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_NAMES_SHOWN])
    extra = len(names) - _NAMES_SHOWN
    return f"{shown} and {extra} more" if extra > 0 else shown


def _read_index(index: Path) -> list[str]:
    """Shard file names named by ``model.safetensors.index.json``."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, RecursionError, KeyError, TypeError) as exc:
        raise CheckpointError(f"cannot read the shard index {index}: {exc}") from exc
    shards = weight_map.values() if isinstance(weight_map, dict) else [None]
    if not all(isinstance(s, str) and s and Path(s).name == s for s in shards):
        raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
    return sorted(set(shards))


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in load order.

    Uses ``model.safetensors.index.json`` when present (every shard it names must exist),
    else ``model.safetensors``, else every ``*.safetensors`` in the directory.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    index = path / INDEX_FILE
    if index.is_file():
        shards = _read_index(index)
        missing = [name for name in shards if not (path / name).is_file()]
        if missing:
            raise CheckpointError(f"{index} names missing shard file(s): {_listed(missing)}")
        return [path / name for name in shards]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"no safetensors weights in {path}: expected {SINGLE_FILE} or {INDEX_FILE}"
        )
    return files


def _check_tensor(reader, name: str, file: Path, expected: tuple[int, ...]) -> None:
    """Raise ``CheckpointError`` unless tensor ``name`` has the expected shape and a float dtype."""
    view = reader.get_slice(name)
    got = tuple(view.get_shape())
    if got != expected:
        raise CheckpointError(
            f"tensor {name} in {file.name} has shape {got}, expected {expected} for this config"
        )
    dtype = view.get_dtype()
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(
            f"tensor {name} in {file.name} has dtype {dtype}; weights must be one of "
            f"{', '.join(FLOAT_DTYPES)}"
        )


def _scan(files: list[Path], expected: dict[str, tuple[int, ...]]) -> dict[str, Path]:
    """Which file holds each expected tensor, after checking every header.

    Raises ``CheckpointError`` naming the file for an unreadable or corrupt file (truncated,
    garbage, a header that lies about sizes), a tensor of the wrong shape or dtype, a tensor
    found twice, or tensors the model has no place for.
    """
    locations: dict[str, Path] = {}
    unexpected: list[str] = []
    for file in files:
        try:
            with safe_open(file, framework="pt") as reader:
                for name in reader.keys():
                    if name.endswith(_ROTARY_BUFFER_SUFFIX):
                        continue
                    if name not in expected:
                        unexpected.append(f"{name} ({file.name})")
                        continue
                    if name in locations:
                        raise CheckpointError(
                            f"tensor {name} appears in both {locations[name].name} and {file.name}"
                        )
                    _check_tensor(reader, name, file, expected[name])
                    locations[name] = file
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(f"cannot read {file}: {exc}") from exc
    if unexpected:
        raise CheckpointError(f"unexpected tensors in {files[0].parent}: {_listed(unexpected)}")
    return locations


def _read(
    locations: dict[str, Path], dtype: torch.dtype, device: str | torch.device
) -> dict[str, torch.Tensor]:
    by_file: dict[Path, list[str]] = {}
    for name, file in locations.items():
        by_file.setdefault(file, []).append(name)
    weights: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        try:
            with safe_open(file, framework="pt") as reader:
                for name in names:
                    weights[name] = reader.get_tensor(name).to(device=device, dtype=dtype)
        except (OSError, SafetensorError) as exc:  # the file changed since it was scanned
            raise CheckpointError(f"cannot read {file}: {exc}") from exc
    return weights


def load_weights(
    path: str | Path,
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Read every weight of a Llama checkpoint, checked against ``config``.

    Returns tensors under their HF names (see :func:`expected_shapes`), cast to ``dtype``
    and placed on ``device``. With tied embeddings and no ``lm_head.weight`` in the files,
    ``lm_head.weight`` is the embedding tensor itself. Every header is checked before any
    tensor is read: ``CheckpointError``, naming the file, for a missing or corrupt file, a
    missing tensor, a tensor of the wrong shape or of a non-float dtype, or a tensor the
    model has no place for (rotary ``inv_freq`` buffers are skipped).
    """
    expected = expected_shapes(config)
    files = checkpoint_files(path)
    locations = _scan(files, expected)
    tied_from_embedding = LM_HEAD_NAME not in locations and config.tie_word_embeddings
    missing = [
        name
        for name in expected
        if name not in locations and not (name == LM_HEAD_NAME and tied_from_embedding)
    ]
    if missing:
        searched = _listed([file.name for file in files])
        raise CheckpointError(f"missing tensors in {path} ({searched}): {_listed(missing)}")
    weights = _read(locations, dtype, device)
    if tied_from_embedding:
        weights[LM_HEAD_NAME] = weights[EMBED_NAME]
    return {name: weights[name] for name in expected}
