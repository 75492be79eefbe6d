"""load_weights: round trip against transformers, shards, tied embeddings, every error."""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from minimemserve.errors import CheckpointError
from minimemserve.model.config import ModelConfig
from minimemserve.model.llama import LlamaModel
from minimemserve.model.loader import DUMMY_INIT_STD, dummy_model, expected_shapes, load_weights


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(
    "overrides",
    [{}, {"num_key_value_heads": 4}, {"num_key_value_heads": 1, "num_hidden_layers": 3}],
    ids=["gqa", "mha", "mqa"],
)
def test_round_trip_equals_hf_state_dict(tiny_llama_factory, hf_model_from_dir, overrides):
    path = tiny_llama_factory(**overrides)
    cfg = ModelConfig.from_hf(path)
    weights = load_weights(path, cfg)
    state = hf_model_from_dir(path).state_dict()
    assert set(weights) == set(state) == set(expected_shapes(cfg))
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, state[name]), name


def test_weights_are_not_trivial(tiny_llama_dir):
    weights = load_weights(tiny_llama_dir, ModelConfig.from_hf(tiny_llama_dir))
    norm = weights["model.layers.0.input_layernorm.weight"]
    assert not torch.allclose(norm, torch.ones_like(norm))
    assert weights["model.layers.1.self_attn.q_proj.weight"].std() > 0.05


def test_dtype_cast(tiny_llama_dir):
    cfg = ModelConfig.from_hf(tiny_llama_dir)
    full = load_weights(tiny_llama_dir, cfg)
    half = load_weights(tiny_llama_dir, cfg, dtype=torch.float16)
    assert all(t.dtype == torch.float16 for t in half.values())
    name = "model.embed_tokens.weight"
    torch.testing.assert_close(half[name].float(), full[name], atol=2e-3, rtol=1e-3)


def test_sharded_checkpoint(tiny_llama_factory, hf_model_from_dir):
    path = tiny_llama_factory(shards=3)
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*-of-*.safetensors"))) >= 2
    cfg = ModelConfig.from_hf(path)
    weights = load_weights(path, cfg)
    state = hf_model_from_dir(path).state_dict()
    assert all(torch.equal(weights[n], state[n]) for n in state)


def test_tied_embeddings_without_lm_head(tiny_llama_factory, hf_model_from_dir):
    path = tiny_llama_factory(tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    cfg = ModelConfig.from_hf(path)
    weights = load_weights(path, cfg)
    assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]
    hf_head = hf_model_from_dir(path).lm_head.weight
    assert torch.equal(weights["lm_head.weight"], hf_head)


def test_missing_lm_head_without_tying_is_an_error(tiny_llama_dir, tmp_path):
    path = copy_checkpoint(tiny_llama_dir, tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_weights(path, ModelConfig.from_hf(path))


def test_no_safetensors_file(tiny_llama_dir, tmp_path):
    path = copy_checkpoint(tiny_llama_dir, tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no safetensors"):
        load_weights(path, ModelConfig.from_hf(path))


def test_index_naming_a_missing_shard(tiny_llama_factory, tmp_path):
    path = copy_checkpoint(tiny_llama_factory(shards=3), tmp_path / "ckpt")
    shard = sorted(path.glob("model-*-of-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load_weights(path, ModelConfig.from_hf(path))


def test_missing_tensor_is_named(tiny_llama_dir, tmp_path):
    path = copy_checkpoint(tiny_llama_dir, tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors.*layers\.1\.mlp\.up_proj"):
        load_weights(path, ModelConfig.from_hf(path))


def test_wrong_shape_names_tensor_expected_and_got(tiny_llama_dir, tmp_path):
    path = copy_checkpoint(tiny_llama_dir, tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError) as info:
        load_weights(path, ModelConfig.from_hf(path))
    message = str(info.value)
    assert "model.layers.0.self_attn.k_proj.weight" in message
    assert "(64, 64)" in message and "(32, 64)" in message


def test_config_disagreeing_with_weights(tiny_llama_dir, tmp_path):
    path = copy_checkpoint(tiny_llama_dir, tmp_path / "ckpt")
    raw = json.loads((path / "config.json").read_text())
    raw["intermediate_size"] = 256
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"mlp\.\w+_proj\.weight .* has shape"):
        load_weights(path, ModelConfig.from_hf(path))


def test_extra_layer_is_unexpected_but_inv_freq_is_ignored(tiny_llama_dir, tmp_path):
    path = copy_checkpoint(tiny_llama_dir, tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, path / "model.safetensors")
    cfg = ModelConfig.from_hf(path)
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in load_weights(path, cfg)
    tensors["model.layers.2.input_layernorm.weight"] = torch.ones(64)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected tensors.*layers\.2"):
        load_weights(path, cfg)


def test_missing_directory(tmp_path, tiny_llama_dir):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_weights(tmp_path / "nowhere", ModelConfig.from_hf(tiny_llama_dir))


# ---- corrupt checkpoints: each raises CheckpointError naming the file ----------------------


def _header(file: Path) -> tuple[dict, bytes]:
    """The JSON header of a safetensors file and the data bytes after it."""
    blob = file.read_bytes()
    size = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8 : 8 + size]), blob[8 + size :]


def _write_with_header(file: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _corrupt_checkpoint(src: Path, tmp_path: Path, damage) -> Path:
    path = copy_checkpoint(src, tmp_path / "ckpt")
    damage(path / "model.safetensors")
    return path


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:-100])


def _truncate_header(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:20])


def _garbage(file: Path) -> None:
    file.write_bytes(bytes(random.Random(0).randrange(256) for _ in range(4096)))


def _empty(file: Path) -> None:
    file.write_bytes(b"")


def _lie_about_shape(file: Path) -> None:
    header, data = _header(file)
    header["model.norm.weight"]["shape"] = [128]
    _write_with_header(file, header, data)


def _lie_about_offsets(file: Path) -> None:
    header, data = _header(file)
    begin, end = header["model.norm.weight"]["data_offsets"]
    header["model.norm.weight"]["data_offsets"] = [begin, end + 10**9]
    _write_with_header(file, header, data)


def _unknown_dtype(file: Path) -> None:
    header, data = _header(file)
    header["model.norm.weight"]["dtype"] = "F128"
    _write_with_header(file, header, data)


@pytest.mark.parametrize(
    "damage",
    [
        _truncate,
        _truncate_header,
        _garbage,
        _empty,
        _lie_about_shape,
        _lie_about_offsets,
        _unknown_dtype,
    ],
)
def test_corrupt_safetensors_file_is_named(tiny_llama_dir, tmp_path, damage):
    path = _corrupt_checkpoint(tiny_llama_dir, tmp_path, damage)
    with pytest.raises(CheckpointError, match=r"cannot read .*model\.safetensors"):
        load_weights(path, ModelConfig.from_hf(path))


def test_corrupt_shard_is_named(tiny_llama_factory, tmp_path):
    path = copy_checkpoint(tiny_llama_factory(shards=3), tmp_path / "ckpt")
    shard = sorted(path.glob("model-*-of-*.safetensors"))[1]
    _truncate(shard)
    with pytest.raises(CheckpointError, match=shard.name):
        load_weights(path, ModelConfig.from_hf(path))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.uint8])
def test_tensor_of_a_non_float_dtype_is_named(tiny_llama_dir, tmp_path, dtype):
    path = copy_checkpoint(tiny_llama_dir, tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = torch.ones_like(tensors[name], dtype=dtype)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"{name} in model\.safetensors has dtype"):
        load_weights(path, ModelConfig.from_hf(path))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_float_dtypes_are_cast(tiny_llama_dir, tmp_path, dtype):
    path = copy_checkpoint(tiny_llama_dir, tmp_path / "ckpt")
    tensors = {k: v.to(dtype) for k, v in load_file(path / "model.safetensors").items()}
    save_file(tensors, path / "model.safetensors")
    weights = load_weights(path, ModelConfig.from_hf(path))
    assert all(t.dtype == torch.float32 for t in weights.values())


def test_missing_tensor_names_the_file(tiny_llama_dir, tmp_path):
    path = copy_checkpoint(tiny_llama_dir, tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*model\.norm\.weight"):
        load_weights(path, ModelConfig.from_hf(path))


def test_wrong_shape_names_the_file(tiny_llama_dir, tmp_path):
    path = copy_checkpoint(tiny_llama_dir, tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight in model\.safetensors"):
        load_weights(path, ModelConfig.from_hf(path))


@pytest.mark.parametrize(
    "index",
    [
        b"\xff\xfe not json",
        b"{",
        b'{"weight_map": ["model-00001-of-00002.safetensors"]}',
        b'{"weight_map": {"model.norm.weight": 3}}',
        b'{"weight_map": {"model.norm.weight": "../model.safetensors"}}',
        b'{"metadata": {}}',
    ],
    ids=["not-utf8", "not-json", "list", "not-a-name", "outside-the-dir", "no-weight-map"],
)
def test_corrupt_shard_index_is_named(tiny_llama_dir, tmp_path, index):
    path = copy_checkpoint(tiny_llama_dir, tmp_path / "ckpt")
    (path / "model.safetensors.index.json").write_bytes(index)
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json"):
        load_weights(path, ModelConfig.from_hf(path))


# Llama-2-70B's published shape (GQA: 64 heads, 8 KV heads), for dummy weights on meta
LLAMA2_70B = dict(
    vocab_size=32000,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    max_position_embeddings=4096,
)


def _fused_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter shapes, from the config: q/k/v and gate/up stacked."""
    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    layer = {
        "self_attn.qkv_proj.weight": (q + 2 * kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_up_proj.weight": (2 * inter, h),
        "mlp.down_proj.weight": (h, inter),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    out = {"embed_tokens.weight": (cfg.vocab_size, h), "norm.weight": (h,)}
    for i in range(cfg.num_hidden_layers):
        out |= {f"layers.{i}.{name}": shape for name, shape in layer.items()}
    return out | {"lm_head.weight": (cfg.vocab_size, h)}


def test_dummy_weights_of_a_gqa_70b_config_on_meta_allocate_nothing():
    cfg = ModelConfig(**LLAMA2_70B)
    model = dummy_model(LlamaModel, cfg, "meta", torch.bfloat16)
    params = dict(model.named_parameters())
    assert {n: tuple(p.shape) for n, p in params.items()} == _fused_shapes(cfg)
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in params.values())
    assert sum(p.numel() for p in params.values()) == cfg.num_parameters() == 68_976_648_192


def test_dummy_weights_are_seeded_random_and_made_in_their_dtype(tiny_llama_dir):
    cfg = ModelConfig.from_hf(tiny_llama_dir)
    a = dummy_model(LlamaModel, cfg, "cpu", torch.bfloat16, seed=1)
    b = dummy_model(LlamaModel, cfg, "cpu", torch.bfloat16, seed=1)
    c = dummy_model(LlamaModel, cfg, "cpu", torch.bfloat16, seed=2)
    w = a.layers[0].mlp.down_proj.weight
    assert w.dtype == torch.bfloat16 and torch.equal(w, b.layers[0].mlp.down_proj.weight)
    assert not torch.equal(w, c.layers[0].mlp.down_proj.weight)
    assert abs(w.float().std().item() - DUMMY_INIT_STD) < 0.005
    assert torch.equal(a.norm.weight, torch.ones_like(a.norm.weight))
    assert torch.get_default_dtype() == torch.float32  # restored
