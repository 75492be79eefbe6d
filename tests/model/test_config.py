"""ModelConfig: validation and parsing of HF config.json files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minimemserve.errors import CheckpointError, ConfigError
from minimemserve.model.config import MAX_ROTARY_TABLE_BYTES, ModelConfig, RopeScaling
from minimemserve.model.loader import load_weights
from minimemserve.model.registry import family_of

BASE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
)


def write_config(tmp_path: Path, **fields) -> Path:
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **BASE, **fields}
    raw = {k: v for k, v in raw.items() if v is not ...}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_defaults_derive_head_dim_kv_heads_and_eos_list():
    cfg = ModelConfig(**BASE)
    assert cfg.head_dim == 16
    assert cfg.num_key_value_heads == 4
    assert cfg.num_queries_per_kv == 1
    assert cfg.eos_token_ids == (2,)


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(hidden_size=0), "hidden_size"),
        (dict(vocab_size=-3), "vocab_size"),
        (dict(hidden_size=66), "not divisible by num_attention_heads"),
        (dict(num_key_value_heads=3), "not divisible by num_key_value_heads"),
        (dict(rms_norm_eps=0.0), "rms_norm_eps"),
        (dict(rope_theta=-1.0), "rope_theta"),
        (dict(eos_token_id=600), "outside the vocabulary"),
        (dict(head_dim=15), "head_dim"),
    ],
)
def test_invalid_values_raise_config_error(bad, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**(BASE | bad))


def test_config_is_frozen():
    cfg = ModelConfig(**BASE)
    with pytest.raises(AttributeError):
        cfg.hidden_size = 128  # type: ignore[misc]


def test_from_hf_gqa_and_quirks(tmp_path):
    path = write_config(
        tmp_path,
        num_key_value_heads=2,
        eos_token_id=[2, 7],
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        torch_dtype="bfloat16",
        max_position_embeddings=4096,
    )
    cfg = ModelConfig.from_hf(path)
    assert cfg.num_key_value_heads == 2 and cfg.num_queries_per_kv == 2
    assert cfg.eos_token_id == 2 and cfg.eos_token_ids == (2, 7)
    assert cfg.rms_norm_eps == 1e-5 and cfg.rope_theta == 500000.0
    assert cfg.torch_dtype == "bfloat16" and cfg.max_position_embeddings == 4096
    assert cfg.rope_scaling is None


def test_from_hf_missing_kv_heads_means_mha(tmp_path):
    cfg = ModelConfig.from_hf(write_config(tmp_path))
    assert cfg.num_key_value_heads == cfg.num_attention_heads == 4


def test_from_hf_rope_parameters_of_newer_transformers(tmp_path):
    rope = {"rope_type": "linear", "factor": 4.0, "rope_theta": 20000.0}
    cfg = ModelConfig.from_hf(write_config(tmp_path, rope_parameters=rope))
    assert cfg.rope_theta == 20000.0
    assert cfg.rope_scaling == RopeScaling(factor=4.0)


def test_from_hf_legacy_rope_scaling_type_key(tmp_path):
    path = write_config(tmp_path, rope_scaling={"type": "linear", "factor": 2.0})
    cfg = ModelConfig.from_hf(path)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 2.0
    assert cfg.rope_scaling.to_dict() == {"rope_type": "linear", "factor": 2.0}


def test_from_hf_default_rope_type_is_no_scaling(tmp_path):
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    assert ModelConfig.from_hf(write_config(tmp_path, rope_parameters=rope)).rope_scaling is None


@pytest.mark.parametrize("rope_type", ["dynamic", "yarn"])
def test_from_hf_unsupported_rope_type_is_named(tmp_path, rope_type):
    path = write_config(tmp_path, rope_scaling={"rope_type": rope_type, "factor": 8.0})
    with pytest.raises(CheckpointError, match=rope_type):
        ModelConfig.from_hf(path)


def test_direct_unsupported_rope_type_raises_config_error():
    with pytest.raises(ConfigError, match="yarn"):
        ModelConfig(**BASE, rope_scaling={"rope_type": "yarn", "factor": 2.0})


def test_from_hf_llama3_rope_needs_its_fields(tmp_path):
    path = write_config(tmp_path, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(CheckpointError, match="low_freq_factor"):
        ModelConfig.from_hf(path)
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    cfg = ModelConfig.from_hf(write_config(tmp_path, rope_scaling=rope))
    assert cfg.rope_scaling.to_dict() == rope
    with pytest.raises(CheckpointError, match="high_freq_factor"):
        ModelConfig.from_hf(write_config(tmp_path, rope_scaling=rope | {"high_freq_factor": 1}))


def test_foreign_architecture_is_named_with_the_supported_ones(tmp_path):
    path = write_config(tmp_path, architectures=["MistralForCausalLM"], model_type="mistral")
    cfg = ModelConfig.from_hf(path)  # read for its sizes; the family is checked at load
    with pytest.raises(CheckpointError, match="MistralForCausalLM.*Qwen2ForCausalLM"):
        family_of(cfg)
    with pytest.raises(CheckpointError, match="MistralForCausalLM"):
        load_weights(tmp_path, cfg)


def test_from_hf_model_type_llama_without_architectures(tmp_path):
    cfg = ModelConfig.from_hf(write_config(tmp_path, architectures=...))
    assert cfg.hidden_size == 64
    assert family_of(cfg).name == "llama"


def test_from_hf_missing_file_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        ModelConfig.from_hf(tmp_path)


def test_from_hf_missing_field_is_named(tmp_path):
    path = write_config(tmp_path, intermediate_size=...)
    with pytest.raises(CheckpointError, match="intermediate_size"):
        ModelConfig.from_hf(path)


def test_from_hf_invalid_value_becomes_checkpoint_error(tmp_path):
    path = write_config(tmp_path, num_key_value_heads=3)
    with pytest.raises(CheckpointError, match="num_key_value_heads"):
        ModelConfig.from_hf(path)


def test_from_hf_reads_a_transformers_checkpoint(tiny_llama_factory):
    path = tiny_llama_factory(rope_scaling={"rope_type": "linear", "factor": 2.0})
    cfg = ModelConfig.from_hf(path)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.rope_scaling == RopeScaling(factor=2.0)
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    assert cfg.max_position_embeddings == 512


def test_num_parameters_matches_transformers(tiny_llama_dir, hf_model_from_dir):
    cfg = ModelConfig.from_hf(tiny_llama_dir)
    model = hf_model_from_dir(tiny_llama_dir)
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())


# ---- corrupt config.json: CheckpointError naming the file ----------------------------------


@pytest.mark.parametrize(
    "content",
    [b'{"vocab_size": 512', b"\xff\xfe\x00garbage", b"", b"[" * 100_000, b"[1, 2]", b"null"],
    ids=["truncated", "not-utf8", "empty", "too-deep", "a-list", "null"],
)
def test_config_that_is_not_a_json_object_is_named(tmp_path, content):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(CheckpointError, match="config.json"):
        ModelConfig.from_hf(tmp_path)


@pytest.mark.parametrize(
    "fields",
    [
        dict(hidden_size="64"),
        dict(hidden_size=64.0),
        dict(hidden_size=True),
        dict(hidden_size=None),
        dict(num_hidden_layers=[2]),
        dict(vocab_size=10**400),
        dict(max_position_embeddings=float("inf")),
        dict(num_key_value_heads="2"),
        dict(head_dim=16.5),
        dict(rms_norm_eps="1e-6"),
        dict(rms_norm_eps=float("nan")),
        dict(rope_theta=float("inf")),
        dict(rope_theta=10**400),
        dict(rope_scaling={"rope_type": "linear", "factor": "2"}),
        dict(rope_scaling={"rope_type": "linear", "factor": float("inf")}),
        dict(rope_scaling=[2.0]),
        dict(tie_word_embeddings="false"),
        dict(torch_dtype=16),
        dict(bos_token_id="1"),
        dict(eos_token_id=[2, "x"]),
        dict(eos_token_id=2.0),
        dict(architectures="LlamaForCausalLM"),
        dict(architectures=[1]),
    ],
)
def test_config_values_of_the_wrong_type_are_named(tmp_path, fields):
    path = write_config(tmp_path, **fields)
    with pytest.raises(CheckpointError, match=r"config\.json") as info:
        ModelConfig.from_hf(path)
    assert next(iter(fields)) in str(info.value) or "rope scaling" in str(info.value)


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(max_position_embeddings=10**12), "rotary"),
        (dict(max_position_embeddings=2**30 // (8 * 16) + 1), "rotary"),
        (dict(vocab_size=10**12), "parameters"),
        (dict(num_hidden_layers=10**9), "parameters"),
        (dict(hidden_size=True), "hidden_size"),
        pytest.param(dict(vocab_size=10**5000), "vocab_size", id="5000-digit-vocab"),
        pytest.param(dict(eos_token_ids=(2, 10**5000)), "eos_token_ids", id="5000-digit-eos"),
        (dict(rms_norm_eps=float("inf")), "rms_norm_eps"),
        (dict(tie_word_embeddings=1), "tie_word_embeddings"),
        (dict(eos_token_ids=(2, "3")), "eos_token_ids"),
    ],
)
def test_absurd_sizes_and_wrong_types_raise_config_error(bad, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**(BASE | bad))


def test_largest_rotary_table_is_accepted():
    positions = MAX_ROTARY_TABLE_BYTES // (8 * 16)  # head_dim 16
    cfg = ModelConfig(**BASE, max_position_embeddings=positions)
    assert cfg.rotary_table_bytes() == MAX_ROTARY_TABLE_BYTES


def test_absurd_context_in_config_json_is_named_before_allocating(tmp_path):
    path = write_config(tmp_path, max_position_embeddings=10**12)
    with pytest.raises(CheckpointError, match=r"config\.json.*max_position_embeddings.*GiB"):
        ModelConfig.from_hf(path)


def test_integer_floats_stay_floats(tmp_path):
    cfg = ModelConfig.from_hf(write_config(tmp_path, rope_theta=10000, rms_norm_eps=1))
    assert type(cfg.rope_theta) is float and type(cfg.rms_norm_eps) is float
