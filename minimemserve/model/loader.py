"""Load a decoder's weights from a Hugging Face checkpoint directory (``*.safetensors``), or
make random ones of a config's shapes on the device (``load_format="dummy"``)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from minimemserve.errors import CheckpointError
from minimemserve.model.config import CONFIG_FILENAME, ModelConfig
from minimemserve.model.registry import family_of
from minimemserve.model.tokenizer import Tokenizer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
EMBED_NAME = "model.embed_tokens.weight"
LM_HEAD_NAME = "lm_head.weight"
# Old checkpoints saved RoPE's inverse frequencies as buffers; the model recomputes them.
_ROTARY_BUFFER_SUFFIX = "rotary_emb.inv_freq"
# Weight dtypes a checkpoint may store; integer, bool, complex and fp8 tensors are not
# model weights (fp8 needs scales this loader does not read).
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
# How many names an error message lists before it says "and N more".
_NAMES_SHOWN = 5


# What this process read of each checkpoint: (directory, config.json's mtime) -> its parts.
_READ: dict[tuple[str, int], tuple[ModelConfig, Tokenizer]] = {}


def read_checkpoint(model_dir: str | Path) -> tuple[ModelConfig, Tokenizer]:
    """A checkpoint directory's config and tokenizer, read once per process (again only when
    its ``config.json`` changed): every engine, the frontend and the server of a process share
    them (both are read-only once built). Problems are ``CheckpointError``s naming the file."""
    path = Path(model_dir).resolve()
    try:
        stamp = (path / CONFIG_FILENAME).stat().st_mtime_ns
    except OSError:
        stamp = -1  # from_hf names what is missing
    key = (str(path), stamp)
    if key not in _READ:
        _READ[key] = (ModelConfig.from_hf(path), Tokenizer.from_dir(path))
    return _READ[key]


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint for ``config`` holds, by HF name, with its shape, as its
    family defines it (``lm_head.weight`` too, which a checkpoint with tied embeddings may
    omit); an unknown family is a ``CheckpointError``."""
    h = config.hidden_size
    layer = family_of(config).layer_tensors(config)
    shapes: dict[str, tuple[int, ...]] = {EMBED_NAME: (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{name}": s for name, s in layer.items()})
    return shapes | {"model.norm.weight": (h,), LM_HEAD_NAME: (config.vocab_size, h)}


def _listed(names: list[str]) -> str:
    extra = len(names) - _NAMES_SHOWN
    return ", ".join(names[:_NAMES_SHOWN]) + (f" and {extra} more" if extra > 0 else "")


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: the shards its index names (each
    must exist), else ``model.safetensors``, else every ``*.safetensors`` there."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, RecursionError, KeyError, TypeError) as exc:
            raise CheckpointError(f"cannot read the shard index {index}: {exc}") from exc
        shards = weight_map.values() if isinstance(weight_map, dict) else [None]
        if not all(isinstance(s, str) and s and Path(s).name == s for s in shards):
            raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
        files = [path / name for name in sorted(set(shards))]
        if missing := [file.name for file in files if not file.is_file()]:
            raise CheckpointError(f"{index} names missing shard file(s): {_listed(missing)}")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors in {path}: expected {SINGLE_FILE} or {INDEX_FILE}")
    return files


def _check_tensor(reader, name: str, file: Path, expected: tuple[int, ...]) -> None:
    view = reader.get_slice(name)
    got, dtype = tuple(view.get_shape()), view.get_dtype()
    if got != expected:
        raise CheckpointError(f"tensor {name} in {file.name} has shape {got}, expected {expected}")
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(
            f"tensor {name} in {file.name} has dtype {dtype}, not one of {FLOAT_DTYPES}"
        )


def _scan(files: list[Path], expected: dict[str, tuple[int, ...]]) -> dict[str, Path]:
    """Which file holds each expected tensor, after checking every header."""
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
        except (OSError, SafetensorError) as exc:  # truncated, garbage, a lying header
            raise CheckpointError(f"cannot read {file}: {exc}") from exc
    if unexpected:
        raise CheckpointError(f"unexpected tensors in {files[0].parent}: {_listed(unexpected)}")
    return locations


def load_weights(
    path: str | Path,
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Every weight of a checkpoint by HF name, cast to ``dtype`` on ``device``; a
    tied ``lm_head.weight`` the files lack is the embedding itself. All headers are checked
    against ``config`` first: a missing or corrupt file or tensor, a wrong shape or dtype, or
    an unexpected tensor raises ``CheckpointError`` naming the file."""
    expected, files = expected_shapes(config), checkpoint_files(path)
    locations = _scan(files, expected)
    tied = LM_HEAD_NAME not in locations and config.tie_word_embeddings
    if missing := [n for n in expected if n not in locations and not (n == LM_HEAD_NAME and tied)]:
        searched = _listed([file.name for file in files])
        raise CheckpointError(f"missing tensors in {path} ({searched}): {_listed(missing)}")
    weights: dict[str, torch.Tensor] = {}
    for file in dict.fromkeys(locations.values()):
        try:
            with safe_open(file, framework="pt") as reader:
                for name in (n for n, f in locations.items() if f == file):
                    weights[name] = reader.get_tensor(name).to(device=device, dtype=dtype)
        except (OSError, SafetensorError) as exc:  # the file changed since it was scanned
            raise CheckpointError(f"cannot read {file}: {exc}") from exc
    if tied:
        weights[LM_HEAD_NAME] = weights[EMBED_NAME]
    return {name: weights[name] for name in expected}


# The spread of dummy weights (Llama's initialiser range): random activations stay finite in
# bf16 through any number of layers; norm gains are 1.
DUMMY_INIT_STD = 0.02


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Make modules built inside hold ``dtype`` parameters from the start (no fp32 copy)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def dummy_model(
    model_class: Callable[[ModelConfig], torch.nn.Module],
    config: ModelConfig,
    device: str | torch.device,
    dtype: torch.dtype,
    seed: int = 0,
) -> torch.nn.Module:
    """``model_class(config)`` with random weights made on ``device`` in ``dtype``: nothing
    is read from disk, and the weights are never held in another dtype or on another device
    (on ``meta`` nothing is allocated at all). Matrices are N(0, DUMMY_INIT_STD²), norm gains
    1; ``seed`` fixes them on a real device."""
    device = torch.device(device)
    with torch.device(device), _default_dtype(dtype):
        model = model_class(config)
    generator = None if device.type == "meta" else torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, DUMMY_INIT_STD, generator=generator)
    return model.to(dtype=dtype).eval()
