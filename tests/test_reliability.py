"""One bad request fails alone; arbitrary sampling values either run or are refused."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minimemserve import LLM, SamplingParams, recipes
from minimemserve import engine as engine_module
from minimemserve.config import EngineConfig
from minimemserve.disagg.runtime import ProcessCluster
from minimemserve.errors import SamplingError

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
POISON_SEED = 666


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 512, (9 + 5 * i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, config="PD-CC", num_blocks=128)


def test_values_that_used_to_break_the_engine_now_run(llm):
    healthy = llm.generate(prompts(1), GREEDY)[0]
    odd = [
        SamplingParams(max_tokens=6, temperature=1e-300, ignore_eos=True),  # greedy
        SamplingParams(max_tokens=6, temperature=0.8, seed=time.time_ns(), ignore_eos=True),
    ]
    outs = llm.generate(prompts(1) * 3, [GREEDY, *odd])
    assert outs[0].token_ids == outs[1].token_ids == healthy.token_ids
    assert outs[2].finish_reason == "length" and len(outs[2].token_ids) == 6
    llm.engine.check_pools(require_idle=True)


def test_a_request_whose_sampling_fails_ends_alone(llm, monkeypatch):
    real = engine_module.sample

    def poisoned(logits, params, num_generated, generator):
        rows = [i for i, p in enumerate(params) if p.seed == POISON_SEED]
        logits = logits.clone()
        logits[rows] = float("nan")
        return real(logits, params, num_generated, generator)

    healthy = llm.generate(prompts(3), GREEDY)
    monkeypatch.setattr(engine_module, "sample", poisoned)
    poison = SamplingParams(max_tokens=6, temperature=0.7, seed=POISON_SEED)
    outs = llm.generate(prompts(3), [GREEDY, poison, GREEDY])
    assert outs[1].finish_reason == "error" and "SamplingError" in outs[1].error
    assert [outs[0].token_ids, outs[2].token_ids] == [healthy[0].token_ids, healthy[2].token_ids]
    llm.engine.check_pools(require_idle=True)
    assert llm.generate(prompts(1), GREEDY)[0].token_ids == healthy[0].token_ids


def _poisoned(real):
    """``real`` (an engine method or a pool call taking the request second), raising for the
    request seeded ``POISON_SEED``."""

    def call(first, req, *args):
        if req.params.seed == POISON_SEED:
            raise KeyError("injected")
        return real(first, req, *args)

    return call


@pytest.mark.parametrize("where", ["stop check", "finish hook"])
def test_a_failure_in_one_requests_postprocessing_ends_it_alone(llm, monkeypatch, where, caplog):
    healthy = llm.generate(prompts(3), GREEDY)
    if where == "stop check":
        stop = engine_module.Engine._stop_reason
        monkeypatch.setattr(engine_module.Engine, "_stop_reason", _poisoned(stop))
    else:
        monkeypatch.setitem(recipes.OPS, "insert", _poisoned(recipes.OPS["insert"]))
    poison = SamplingParams(max_tokens=6, temperature=0.0, seed=POISON_SEED, ignore_eos=True)
    outs = llm.generate(prompts(3), [GREEDY, poison, GREEDY])
    assert outs[1].finish_reason == "error" and "KeyError: 'injected'" in outs[1].error
    assert "post-processing failed" in caplog.text and outs[1].request_id in caplog.text
    assert [outs[0].token_ids, outs[2].token_ids] == [healthy[0].token_ids, healthy[2].token_ids]
    llm.engine.check_pools(require_idle=True)
    monkeypatch.undo()
    assert llm.generate(prompts(1), GREEDY)[0].token_ids == healthy[0].token_ids


def test_a_failing_forward_pass_fails_its_batch_and_the_engine_lives(llm, monkeypatch):
    runner = llm.engine.instances[0].engine.runner
    monkeypatch.setattr(runner, "run", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    outs = llm.generate(prompts(2), GREEDY)
    assert all(o.finish_reason == "error" and "boom" in o.error for o in outs)
    monkeypatch.undo()
    llm.engine.check_pools(require_idle=True)
    assert llm.generate(prompts(1), GREEDY)[0].finish_reason == "length"


ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=3),
    st.lists(st.integers(), max_size=3),
    st.integers(-5, 40),
    st.floats(0, 2),
)
FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos")


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.dictionaries(st.sampled_from(FIELDS), ANY, max_size=4))
def test_arbitrary_values_run_or_are_refused_and_the_next_request_works(llm, kwargs):
    kwargs.setdefault("max_tokens", 3)
    try:
        params = SamplingParams(**kwargs)
    except ValueError:
        params = None
    if params is not None and isinstance(params.max_tokens, int) and params.max_tokens <= 8:
        out = llm.generate(prompts(1), params)[0]
        assert out.finish_reason in ("length", "stop"), out.error
    assert llm.generate(prompts(1), GREEDY)[0].finish_reason == "length"
    llm.engine.check_pools(require_idle=True)


def test_sampling_error_carries_the_good_rows():
    err = SamplingError("x", rows=[1], tokens=[5, None])
    assert err.rows == [1] and err.tokens == [5, None]


def test_values_that_used_to_kill_instances_run_across_processes(tiny_llama_dir, llm):
    healthy = llm.generate(prompts(1), GREEDY)[0]
    odd = SamplingParams(max_tokens=6, temperature=0.8, seed=time.time_ns(), ignore_eos=True)
    tiny = SamplingParams(max_tokens=6, temperature=1e-300, ignore_eos=True)
    with ProcessCluster.of(
        tiny_llama_dir, "1P1D", engine=EngineConfig(num_blocks=64), timeout_s=10
    ) as c:
        rids = [c.add_request(prompts(1)[0], p) for p in (odd, tiny, GREEDY)]
        outs = {o.request_id: o for o in c.run_until_done(timeout_s=60)}
        assert [outs[r].finish_reason for r in rids] == ["length"] * 3
        assert outs[rids[1]].token_ids == outs[rids[2]].token_ids == healthy.token_ids
        assert not c.dead and c.num_reruns == 0
        c.check_pools(require_idle=True)


def test_every_failed_output_carries_its_cause(tiny_llama_dir, monkeypatch):
    """A hand-off that fails without saying why still ends with an error naming the instance;
    the ones that say why keep their cause."""
    llm = LLM(tiny_llama_dir, config="1P1D-CC", num_blocks=64)
    monkeypatch.setitem(recipes.OPS, "transfer_with_insert", lambda *a: recipes.Outcome.FAILED)
    (out,) = llm.generate(prompts(1), GREEDY)
    assert out.finish_reason == "error" and "P0" in out.error, out
    monkeypatch.undo()
    llm.engine.check_pools(require_idle=True)
    assert llm.generate(prompts(1), GREEDY)[0].finish_reason == "length"
