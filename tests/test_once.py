"""Once per request, once per build. ``check_request`` runs once per request in process (``LLM``
over one engine and over a cluster), in the frontend of the process runtime (each instance
checks again only the message it receives over its socket) and in the simulator; a ``Checked``
prompt is taken as it is only where it holds. ``parse_config_name`` parses a deployment's name
once per build (an instance of the process runtime parses the Join it receives)."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from minimemserve import LLM, SamplingParams
from minimemserve import engine as engine_module
from minimemserve.config import EngineConfig
from minimemserve.deployment import DeploymentSpec
from minimemserve.disagg.runtime import ProcessCluster
from minimemserve.engine import Checked, check_once, tightest
from minimemserve.model.tokenizer import Tokenizer
from minimemserve.presets import preset_dir
from minimemserve.sim import FittedStepModel, cpu_setup, simulate
from minimemserve.workloads.sessions import make_workload

CPU_COEFS = (8e-3, 5e-4, 2e-7, 2e-6, 3e-4, 2.5e-4)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture
def calls(monkeypatch):
    """The ``check_request`` calls of this process, counted."""
    seen: list[int] = []  # the length of each prompt checked
    real = engine_module.check_request

    def counting(prompt, *args, **kwargs):
        seen.append(len(prompt))
        return real(prompt, *args, **kwargs)

    monkeypatch.setattr(engine_module, "check_request", counting)
    return seen


@pytest.mark.parametrize("config", ["PD", "PD-CC", "1P1D", "1P1D-CC"])
def test_in_process_each_request_is_checked_once(tiny_llama_dir, calls, config):
    llm = LLM(tiny_llama_dir, config=config, num_blocks=64)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=3))
    assert [len(o.token_ids) for o in outs] == [3, 3, 3]
    assert sorted(calls) == sorted(map(len, PROMPTS))


def test_across_processes_the_frontend_checks_each_request_once(tiny_llama_dir, calls):
    spec = DeploymentSpec("1P1D-CC", tiny_llama_dir, engine=EngineConfig(num_blocks=64))
    with LLM(dataclasses.replace(spec, runtime="process")) as llm:
        assert isinstance(llm.engine, ProcessCluster)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=3), use_tqdm=False)
        llm.engine.check_pools(require_idle=True)
    assert [len(o.token_ids) for o in outs] == [3, 3, 3]
    assert sorted(calls) == sorted(map(len, PROMPTS))


def test_the_simulator_checks_each_request_once(calls):
    tok = Tokenizer.from_dir(preset_dir("tiny"))
    sessions = make_workload("sharegpt", tok, 4, 384, seed=1, max_turns=3, max_output_tokens=8)
    setup = cpu_setup(FittedStepModel(CPU_COEFS))
    records, _ = simulate(setup, ["1P1D-CC"], sessions, rate=2.0, seed=0, progress=False)
    assert len(calls) == len(records["1P1D-CC"]) == sum(len(s.turns) for s in sessions)


def test_a_check_holds_only_for_its_params_and_limits_no_tighter(tiny_llama_dir):
    engine = LLM(tiny_llama_dir, config="PD", num_blocks=64).engine.instances[0].engine
    params = SamplingParams(max_tokens=4)
    checked = engine.validate(PROMPTS[0], params)
    assert isinstance(checked, Checked) and list(checked.ids) == PROMPTS[0]
    assert engine.validate(checked, params) is checked  # taken as it is
    other = SamplingParams(max_tokens=4)
    assert engine.validate(checked, other) is not checked  # other params: checked again
    vocab, context, block, blocks = engine.limits
    tighter = (vocab, len(PROMPTS[0]), block, blocks)  # the prompt no longer fits the context
    with pytest.raises(ValueError, match="prompt too long"):
        check_once(checked, params, engine.tokenizer, tighter)
    assert tightest([(9, 5, 16, 3), (7, 8, 16, 4)]) == (7, 5, 16, 3)


@pytest.fixture
def parses(monkeypatch):
    """The configuration names parsed in this process (``parse_config_name`` given a name;
    given a deployment parsed already, it hands that back and is not counted)."""
    import minimemserve.config as config_module

    seen: list[str] = []
    real = config_module.parse_config_name

    def counting(name):
        if isinstance(name, str):
            seen.append(name)
        return real(name)

    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "")
        if name.startswith("minimemserve") and getattr(module, "parse_config_name", None) is real:
            monkeypatch.setattr(module, "parse_config_name", counting)
    return seen


@pytest.mark.parametrize("config", ["PD-CC", "1P1D-CC", "2P2D"])
def test_in_process_a_build_parses_its_name_once(tiny_llama_dir, parses, config):
    llm = LLM(tiny_llama_dir, config=config, num_blocks=64)
    assert len(llm.engine.instances) == len(llm.deployment.instances())
    assert parses == [config]


def test_across_processes_the_frontend_parses_the_name_once(tiny_llama_dir, parses):
    spec = DeploymentSpec("1P1D-CC", tiny_llama_dir, engine=EngineConfig(num_blocks=64))
    with LLM(dataclasses.replace(spec, runtime="process")) as llm:
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    assert parses == ["1P1D-CC"]  # each instance parses the Join it receives, in its process


def test_the_simulator_parses_the_name_once(parses):
    tok = Tokenizer.from_dir(preset_dir("tiny"))
    sessions = make_workload("sharegpt", tok, 2, 384, seed=1, max_turns=2, max_output_tokens=4)
    setup = cpu_setup(FittedStepModel(CPU_COEFS))
    simulate(setup, ["1P1D-CC"], sessions, rate=2.0, seed=0, progress=False)
    assert parses == ["1P1D-CC"]


def test_a_process_reads_a_checkpoint_once(tiny_llama_dir, tmp_path, monkeypatch):
    """The server, its frontend and every engine of a deployment share one read of the
    checkpoint's config and tokenizer; a changed config.json is read again."""
    import shutil

    from minimemserve.model.config import ModelConfig

    ckpt = tmp_path / "ckpt"  # a directory no earlier test of this process has read
    shutil.copytree(tiny_llama_dir, ckpt)
    reads: list[str] = []
    real_cfg, real_tok = ModelConfig.from_hf.__func__, Tokenizer.from_dir.__func__
    monkeypatch.setattr(
        ModelConfig, "from_hf", classmethod(lambda c, p: reads.append("cfg") or real_cfg(c, p))
    )
    monkeypatch.setattr(
        Tokenizer, "from_dir", classmethod(lambda c, p: reads.append("tok") or real_tok(c, p))
    )
    for config in ("PD-CC", "1P1D-CC"):  # two, then two more engines; one read in all
        LLM(ckpt, config=config, num_blocks=64).generate([PROMPTS[0]], SamplingParams(max_tokens=2))
    assert reads == ["cfg", "tok"]
    text = (ckpt / "config.json").read_text()
    (ckpt / "config.json").write_text(text + "\n")
    LLM(ckpt, config="PD", num_blocks=64)
    assert reads == ["cfg", "tok"] * 2
