"""A family that changes a layer brings its own layer class, registered with one line: the
layer here puts a learned gain on the MLP branch, a tensor every checkpoint of the family must
carry. With the gain at one it computes Llama's function, so its greedy tokens are HF Llama's;
at zero they change, so the registry's layer is the one that runs."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import hf_greedy
from safetensors.torch import load_file, save_file
from torch import nn

from minimemserve import LLM, SamplingParams
from minimemserve.errors import CheckpointError
from minimemserve.model import Family, registry
from minimemserve.model.layers import DecoderLayer
from minimemserve.model.llama import LlamaModel

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6)
ARCH = "GainedLlamaForCausalLM"


class Gain(nn.Module):
    """A learned per-channel gain."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, dim] -> [T, dim]
        return x * self.weight


class GainedLayer(DecoderLayer):
    """Llama's layer with ``mlp_gain`` scaling the MLP's output."""

    def __init__(self, cfg, layer_id, qkv_bias, qk_norm) -> None:
        super().__init__(cfg, layer_id, qkv_bias, qk_norm)
        self.mlp_gain = Gain(cfg.hidden_size)

    def forward(self, x, residual, positions, rotary, backend, md):
        h, residual = super().forward(x, residual, positions, rotary, backend, md)
        return self.mlp_gain(h), residual

    @classmethod
    def hf_tensors(cls, cfg, qkv_bias, qk_norm):
        return super().hf_tensors(cfg, qkv_bias, qk_norm) | {"mlp_gain.weight": (cfg.hidden_size,)}


@pytest.fixture
def gained_family(monkeypatch):
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))  # undone after
    registry.register(Family("gained", (ARCH,), LlamaModel, layer=GainedLayer))


def _gained_checkpoint(source, out, gain: float | None):
    """A copy of the Llama checkpoint ``source`` naming the gained architecture, each layer's
    gain set to ``gain`` (None: no gain tensors)."""
    out.mkdir()
    for file in source.iterdir():
        (out / file.name).write_bytes(file.read_bytes())
    raw = json.loads((out / "config.json").read_text())
    raw["architectures"] = [ARCH]
    (out / "config.json").write_text(json.dumps(raw))
    if gain is not None:
        (path,) = out.glob("*.safetensors")
        weights = load_file(path)
        for i in range(raw["num_hidden_layers"]):
            weights[f"model.layers.{i}.mlp_gain.weight"] = torch.full((raw["hidden_size"],), gain)
        save_file(weights, path, metadata={"format": "pt"})
    return out


def test_a_family_with_its_own_layer_runs_it(
    gained_family, tiny_llama_factory, hf_model_from_dir, tmp_path
):
    source = tiny_llama_factory()
    prompts = [[5, 9, 14, 200, 31, 7, 77, 8, 19], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
    expected = hf_greedy(hf_model_from_dir(source), prompts, GREEDY.max_tokens)
    outputs = {}
    for gain in (1.0, 0.0):
        model_dir = _gained_checkpoint(source, tmp_path / f"gain{gain}", gain)
        with LLM(model_dir, config="PD-CC", num_blocks=64) as llm:
            layers = llm.engine.instances[0].engine.model.layers
            assert all(type(layer) is GainedLayer for layer in layers)
            outputs[gain] = [r.token_ids for r in llm.generate(prompts, GREEDY)]
            llm.engine.check_pools()
    assert outputs[1.0] == expected  # a gain of one is Llama
    assert outputs[0.0] != expected  # no MLP: another function, so the family's layer ran


def test_a_checkpoint_without_the_layers_tensors_is_refused(
    gained_family, tiny_llama_factory, tmp_path
):
    model_dir = _gained_checkpoint(tiny_llama_factory(), tmp_path / "bare", None)
    with pytest.raises(CheckpointError, match="mlp_gain"):
        LLM(model_dir, num_blocks=32)
