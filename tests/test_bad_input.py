"""Bad input gets a clear error naming the problem, and the engine keeps serving."""

from __future__ import annotations

import pytest
from helpers import assert_pool_clean

from minimemserve import LLM, InvalidRequest, PoolExhausted, SamplingParams
from minimemserve.errors import ConfigError


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, num_blocks=40, block_size=16)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-5), "top_k"),
    ],
)
def test_bad_sampling_values(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_engine_keeps_serving(llm):
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(InvalidRequest, match="empty prompt"):
        llm.generate([""], params)
    with pytest.raises(InvalidRequest, match="empty prompt"):
        llm.generate([[]], params)
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        llm.generate([[5, 6, 512]], params)
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        llm.generate([[5, -1]], params)
    with pytest.raises(InvalidRequest, match="not an integer"):
        llm.generate([[5, 6.5]], params)
    with pytest.raises(InvalidRequest, match="not valid Unicode"):
        llm.generate(["a lone \ud800 surrogate"], params)
    with pytest.raises(InvalidRequest, match="prompt too long"):
        llm.generate([[7] * 512], params)
    # a good and a bad prompt together: nothing is queued
    with pytest.raises(InvalidRequest):
        llm.generate([[5, 6, 7], []], params)
    assert not llm.engine.has_unfinished()
    out = llm.generate([[5, 6, 7]], params)[0]
    assert len(out.token_ids) >= 1
    assert_pool_clean(llm.pool)


def test_pool_too_small_for_one_request(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, num_blocks=2, block_size=16)
    with pytest.raises(PoolExhausted, match="needs 3 KV blocks"):
        llm.generate([[5] * 40], SamplingParams(max_tokens=4))
    out = llm.generate([[5] * 20], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert len(out.token_ids) >= 1
    assert_pool_clean(llm.pool)


def test_unknown_config_name(tiny_llama_dir):
    with pytest.raises(ConfigError, match="unknown config name 'PD-XX'"):
        LLM(tiny_llama_dir, config="PD-XX")
    with pytest.raises(ConfigError, match="block_size"):
        LLM(tiny_llama_dir, block_size=3)
    with pytest.raises(ConfigError, match="unknown attention backend"):
        LLM(tiny_llama_dir, attention="magic", num_blocks=8)


def test_prompt_forms_a_user_may_pass(llm):
    """Numpy arrays and numpy ints are token ids; None, bools and scalars are refused."""
    import numpy as np

    params = SamplingParams(max_tokens=2, temperature=0.0)
    ref = llm.generate([[5, 6, 7]], params)[0].token_ids
    for same in (np.array([5, 6, 7]), [np.int64(5), np.int64(6), np.int64(7)], [(5, 6, 7)]):
        assert llm.generate(same, params)[0].token_ids == ref
    refused = {"prompts must be": (None, 5), "a bool": ([[True, 5]],)}
    refused["not an integer"] = ([None], [[5, 6.0]])
    for needle, bad in ((n, b) for n, bs in refused.items() for b in bs):
        with pytest.raises(InvalidRequest, match=needle):
            llm.generate(bad, params)
    assert not llm.engine.has_unfinished()
