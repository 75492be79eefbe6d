"""The deployment spec: one dataclass the commands' options are generated from, and the one
way LLM, the server and the benchmark build a deployment."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from minimemserve import LLM, SamplingParams, presets
from minimemserve.cli import build_parser
from minimemserve.config import EngineConfig
from minimemserve.deployment import DeploymentSpec
from minimemserve.disagg.runtime import ProcessCluster
from minimemserve.errors import ConfigError
from minimemserve.inprocess import InProcessCluster
from minimemserve.options import (
    DEPLOYMENT_FLAGS,
    add_deployment_arguments,
    deployment_options,
)

# The fields no command offers: the engine (its own options), and the runtimes' timings,
# ports and start method, Ray's pins and placement timeout (set from Python).
NOT_FLAGS = {
    "engine",
    "ttl_s",
    "base_port",
    "start_method",
    "timeout_s",
    "startup_timeout_s",
    "heartbeat_s",
    "heartbeat_timeout_s",
    "pin",
    "placement_timeout_s",
}


def test_every_field_but_those_set_from_python_has_a_generated_option():
    names = {f.name for f in dataclasses.fields(DeploymentSpec)}
    assert set(DEPLOYMENT_FLAGS) == names - NOT_FLAGS
    p = add_deployment_arguments(argparse.ArgumentParser(), list(DEPLOYMENT_FLAGS))
    defaults = p.parse_args([])
    spec = deployment_options(defaults, list(DEPLOYMENT_FLAGS), EngineConfig())
    assert spec == DeploymentSpec()  # the options default to the fields' defaults
    args = p.parse_args(
        ["--config", "2P1D", "--num-colocated", "3", "--policy", "session"]
        + ["--instances", "10.0.0.1:7000,10.0.0.2:7000", "--runtime", "process"]
    )
    spec = deployment_options(args, list(DEPLOYMENT_FLAGS), EngineConfig(num_blocks=64))
    assert (spec.config, spec.num_colocated, spec.policy, spec.runtime) == (
        "2P1D",
        3,
        "session",
        "process",
    )
    assert spec.instances == ("10.0.0.1:7000", "10.0.0.2:7000")
    assert spec.engine.num_blocks == 64
    with pytest.raises(SystemExit):  # choices come from the same tables the spec checks
        p.parse_args(["--runtime", "elsewhere"])


def test_a_command_gives_its_own_defaults():
    p = add_deployment_arguments(argparse.ArgumentParser(), ["config", "runtime"], config="PD-CC")
    spec = deployment_options(p.parse_args([]), ["config", "runtime"], EngineConfig())
    assert (spec.config, spec.runtime) == ("PD-CC", "inprocess")


def test_bad_values_are_named():
    for field, value in (("runtime", "cloud"), ("policy", "random"), ("transport", "carrier")):
        with pytest.raises(ConfigError, match=field):
            DeploymentSpec(**{field: value})
    with pytest.raises(ConfigError, match="engine must be an EngineConfig"):
        DeploymentSpec(engine={"num_blocks": 4})
    with pytest.raises(ConfigError, match="3P"):
        DeploymentSpec(config="3P").build()  # the name is checked where it is built
    with pytest.raises(ConfigError, match="process and ray runtimes only"):
        DeploymentSpec().build(ProcessCluster)


def test_llm_builds_from_the_spec_and_its_keywords_alike():
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    spec = DeploymentSpec(config="1P1D-CC", engine=EngineConfig(num_blocks=64))
    with LLM.from_spec(spec) as a, LLM(None, config="1P1D-CC", num_blocks=64) as b:
        assert isinstance(a.engine, InProcessCluster) and a.spec == b.spec
        assert a.generate([[5, 6, 7, 8]], params)[0].token_ids == (
            b.generate([[5, 6, 7, 8]], params)[0].token_ids
        )
        a.engine.check_pools(require_idle=True)


@pytest.mark.parametrize(
    ("argv", "fields"),
    [
        (["serve", "--runtime", "inprocess", "--config", "1P1D"], ("config", "runtime")),
        (["generate", "--prompt", "hi", "--dtype", "float16"], ("dtype",)),
        (["bench", "--policy", "least_load", "--transport", "gloo"], ("policy", "transport")),
    ],
)
def test_the_commands_take_their_deployment_options_from_the_spec(argv, fields):
    args = build_parser().parse_args(argv)
    spec = deployment_options(args, fields, EngineConfig())
    for field in fields:
        flag = DEPLOYMENT_FLAGS[field][0]
        assert getattr(spec, field) == argv[argv.index(flag) + 1]


def test_llama_2_7b_dummy_by_name_builds_its_shapes_on_meta(tmp_path, monkeypatch):
    monkeypatch.setenv(presets.CACHE_ENV, str(tmp_path))
    llm = LLM("llama-2-7b-dummy", device="meta", dtype="bfloat16", max_num_batched_tokens=2048)
    eng = llm.engine.instances[0].engine
    assert eng.config.load_format == "dummy" and llm.model_dir.parent == tmp_path
    cfg = eng.model_config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (4096, 32, 32000)
    params = dict(eng.model.named_parameters())
    assert sum(p.numel() for p in params.values()) == 6_738_415_616
    assert params["layers.31.self_attn.qkv_proj.weight"].shape == (3 * 4096, 4096)
    assert params["layers.0.mlp.gate_up_proj.weight"].shape == (2 * 11008, 4096)
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in params.values())
    kv = eng.pool.kv("hbm")  # the aggregated block: 16 tokens x 32 layers x K and V
    assert kv.device.type == "meta" and kv.shape[1:] == (32, 2, 16, 32, 128)
    assert llm.tokenizer.vocab_size == 32000


def test_a_dummy_presets_name_sets_the_load_format_for_every_command(tmp_path, monkeypatch):
    monkeypatch.setenv(presets.CACHE_ENV, str(tmp_path))
    spec = DeploymentSpec(model="llama-2-13b-dummy", engine=EngineConfig(num_blocks=4))
    assert spec.engine == EngineConfig(num_blocks=4, load_format="dummy")
    assert spec.model == spec.model_dir == presets.preset_dir("llama-2-13b-dummy")
    for command in ("bench", "generate"):
        argv = [command, "--model", "llama-2-7b-dummy"] + ["--prompt", "hi"] * (
            command == "generate"
        )
        args = build_parser().parse_args(argv)
        spec = deployment_options(args, ["model"], EngineConfig(load_format=args.load_format))
        assert spec.engine.load_format == "dummy" and spec.model_dir.parent == tmp_path
    assert DeploymentSpec(model=str(tmp_path)).engine.load_format == "auto"  # a directory


def test_the_process_runtime_takes_the_spec_fields_and_names_a_wrong_one():
    """``ProcessCluster.of(model_dir, config, **fields)``: a deployment spec's fields, checked
    before anything starts."""
    with pytest.raises(TypeError, match="num_block"):
        ProcessCluster.of("unused", "1P1D", num_block=4)
    with pytest.raises(ConfigError, match="base_port must be in"):
        ProcessCluster.of("unused", "1P1D", base_port=70000)
    with pytest.raises(ConfigError, match="heartbeat_s"):
        DeploymentSpec(heartbeat_s=0)
    spec = DeploymentSpec("1P1D-CC", "m", instances=["h:1"])
    assert spec.instances == ("h:1",) and spec.linked


def test_llm_over_a_spec_refuses_engine_settings_beside_it():
    with pytest.raises(ConfigError, match="from the spec.*num_blocks"):
        LLM(DeploymentSpec(), num_blocks=3)
