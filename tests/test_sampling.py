"""SamplingParams validation and the sampler: every value either constructs or raises
InvalidRequest, and every params object that constructs samples valid ids from finite logits.
The logit adjustments (penalties, logit bias, min_tokens) against a reference computed here."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minimemserve import LLM
from minimemserve.errors import InvalidRequest, SamplingError
from minimemserve.sampling import (
    GREEDY_TEMPERATURE,
    SamplingParams,
    adjust_logits,
    sample,
    token_seed,
)

I64_MAX = 2**63 - 1

junk = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.booleans(),
    st.none(),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.lists(st.one_of(st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=2)), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.sampled_from(
        [np.int64(3), np.float32(0.5), np.bool_(True), np.float64("nan"), np.uint64(2**64 - 1)]
    ),
)
# Values each field accepts, mixed with junk so that many drawn objects construct.
valid = {
    "max_tokens": st.integers(1, I64_MAX),
    "temperature": st.one_of(st.floats(0, 1e300), st.sampled_from([1e-300, 5e-324, 1e-5])),
    "top_k": st.integers(-1, I64_MAX),
    "top_p": st.floats(0, 1, exclude_min=True),
    "seed": st.one_of(st.none(), st.integers(0, I64_MAX)),
    "stop_token_ids": st.lists(st.integers(0, I64_MAX), max_size=3),
    "ignore_eos": st.booleans(),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 50), st.floats(-100, 100), max_size=3),
    "min_tokens": st.integers(0, 8),
}
params_kwargs = st.fixed_dictionaries(
    {}, optional={k: st.one_of(v, junk) for k, v in valid.items()}
)
finite_logits = st.lists(
    st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=40
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kwargs=params_kwargs,
    row=finite_logits,
    n=st.integers(0, 2**40),
    engine_seed=st.integers(0, 2**32),
)
def test_any_value_constructs_or_is_rejected_and_constructed_params_sample(
    kwargs, row, n, engine_seed
):
    try:
        params = SamplingParams(**kwargs)
    except InvalidRequest as exc:
        assert isinstance(exc, ValueError)
        assert any(f"SamplingParams.{name}" in str(exc) for name in kwargs)
        return
    assert type(params.max_tokens) is int and type(params.top_k) is int
    assert type(params.temperature) is float and type(params.top_p) is float
    assert type(params.stop_token_ids) is tuple and type(params.ignore_eos) is bool
    assert type(params.logit_bias) is tuple and type(params.frequency_penalty) is float
    logits = torch.tensor([row], dtype=torch.float32)  # [1, V]
    if params.adjusts_logits:
        adjusted = adjust_logits(logits, [params], lambda i: [0, 0, len(row) - 1], ())
        assert adjusted.shape == logits.shape and not torch.isnan(adjusted).any()
    token = sample(logits, [params], [n], torch.Generator().manual_seed(engine_seed))[0]
    assert type(token) is int and 0 <= token < len(row)
    if params.greedy:
        assert token == int(logits.argmax())


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", "0.5"),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("temperature", None),
        ("temperature", 10**400),
        ("temperature", -1e-300),
        ("stop_token_ids", None),
        ("stop_token_ids", "12"),
        ("stop_token_ids", b"\x01"),
        ("stop_token_ids", [1, "2"]),
        ("stop_token_ids", [2**63]),
        pytest.param("stop_token_ids", [10**5000], id="stop_token_ids-5000-digits"),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", {1: 2}),
        ("max_tokens", True),
        ("max_tokens", 10**30),
        pytest.param("max_tokens", 10**5000, id="max_tokens-5000-digits"),
        ("max_tokens", 2**63),
        ("max_tokens", 4.0),
        ("max_tokens", "4"),
        ("top_k", True),
        ("top_k", 2**63),
        ("top_k", -2),
        ("top_k", 1.5),
        ("seed", True),
        ("seed", 2**63),
        ("seed", -1),
        ("seed", 1.0),
        ("seed", "7"),
        ("top_p", float("nan")),
        ("top_p", float("inf")),
        ("top_p", 0.0),
        ("top_p", "1"),
        ("ignore_eos", "no"),
        ("ignore_eos", 1),
        ("ignore_eos", None),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", True),
        ("logprobs", 2.0),
        ("frequency_penalty", 2.5),
        ("frequency_penalty", float("nan")),
        ("presence_penalty", -2.01),
        ("presence_penalty", "1"),
        ("logit_bias", {1: 101}),
        ("logit_bias", {-1: 1}),
        ("logit_bias", {"7": 1}),
        ("logit_bias", {1: float("nan")}),
        ("logit_bias", [1, 2]),
        ("logit_bias", "x"),
        ("logit_bias", {i: 1 for i in range(1025)}),
        ("min_tokens", -1),
        ("min_tokens", 17),  # above max_tokens (16)
        ("min_tokens", 1.0),
    ],
)
def test_bad_values_are_invalid_requests_naming_the_field(field, value):
    with pytest.raises(InvalidRequest, match=f"SamplingParams.{field} "):
        SamplingParams(**{field: value})


def test_fields_and_defaults_are_unchanged():
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    defaults["stop_token_ids"] = defaults["logit_bias"] = ()
    assert defaults == dict(
        max_tokens=16,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        seed=None,
        stop_token_ids=(),
        ignore_eos=False,
        logprobs=None,
        frequency_penalty=0.0,
        presence_penalty=0.0,
        logit_bias=(),
        min_tokens=0,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.0  # type: ignore[misc]


def test_numpy_scalars_become_python_values():
    p = SamplingParams(
        max_tokens=np.int32(5),
        temperature=np.float32(0.5),
        top_k=np.int64(3),
        top_p=np.float64(0.9),
        seed=np.uint64(2**63 - 1),
        stop_token_ids=[np.int16(7)],
        ignore_eos=np.bool_(True),
    )
    assert p == SamplingParams(5, 0.5, 3, 0.9, 2**63 - 1, (7,), True)
    assert all(type(v) in (int, float, bool, tuple, type(None)) for v in dataclasses.astuple(p))


def test_stop_ids_outside_the_vocabulary_are_kept():
    assert SamplingParams(stop_token_ids=[10**12, I64_MAX]).stop_token_ids == (10**12, I64_MAX)
    assert SamplingParams(stop_token_ids={3}).stop_token_ids == (3,)


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, GREEDY_TEMPERATURE / 2, 0.0, -0.0])
def test_tiny_temperatures_are_greedy(temperature):
    p = SamplingParams(temperature=temperature, seed=1)
    assert p.greedy
    logits = torch.tensor([[1.0, 3e38, -3e38, 2.0]])
    assert sample(logits, [p], [0], torch.Generator()) == [1]


def test_small_temperature_on_huge_logits_does_not_overflow():
    logits = torch.tensor([[3e38, -3e38, 3.3e38, 0.0]])
    for t in (GREEDY_TEMPERATURE, 1e-3, 0.5):
        p = SamplingParams(temperature=t, seed=0)
        assert sample(logits, [p], [0], torch.Generator()) == [2]
    p = SamplingParams(temperature=1e300, seed=4)  # huge temperature: uniform, still valid
    assert all(0 <= sample(logits, [p], [n], torch.Generator())[0] < 4 for n in range(20))


@pytest.mark.parametrize(
    "seed", [0, 99, 2**32 + 5, 1_764_500_000_000_000_000, I64_MAX]
)  # a time_ns
def test_token_n_depends_only_on_seed_and_n(seed):
    p = SamplingParams(temperature=1.0, seed=seed)
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(0))
    other = SamplingParams(temperature=0.7)
    first = [sample(logits[:1], [p], [n], torch.Generator().manual_seed(n))[0] for n in range(8)]
    # same (seed, n) in a different batch, a different row, a different engine generator
    again = [
        sample(logits[[1, 0]], [other, p], [3, n], torch.Generator().manual_seed(100 + n))[1]
        for n in range(8)
    ]
    assert first == again
    assert 0 <= token_seed(seed, 2**40) < 2**64


def test_seeds_differing_above_bit_32_draw_differently():
    logits = torch.zeros(1, 1000)  # uniform: 1000 equally likely tokens
    a = SamplingParams(seed=12345)
    b = SamplingParams(seed=12345 + 2**32)
    draws_a = [sample(logits, [a], [n], torch.Generator())[0] for n in range(10)]
    draws_b = [sample(logits, [b], [n], torch.Generator())[0] for n in range(10)]
    assert draws_a != draws_b


def test_small_seeds_keep_their_per_token_seeds():
    assert token_seed(99, 7) == 99 * 1_000_003 + 7
    assert token_seed(0, 0) == 0


@pytest.mark.parametrize(
    "bad_row",
    [
        [float("nan"), 0.0, 1.0],
        [float("inf"), 0.0, 1.0],
        [float("-inf")] * 3,
    ],
    ids=["nan", "inf", "all-neg-inf"],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_that_is_not_finite_raises_and_keeps_the_others(bad_row, temperature):
    logits = torch.tensor([[0.0, 5.0, 1.0], bad_row, [9.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=temperature, seed=1)]
    params.append(SamplingParams(temperature=0.0))
    with pytest.raises(SamplingError, match=r"row\(s\) \[1\]") as info:
        sample(logits, params, [0, 0, 0], torch.Generator())
    assert info.value.rows == [1]
    assert info.value.tokens == [1, None, 0]


def test_neg_inf_logits_are_allowed_when_one_is_finite():
    logits = torch.tensor([[float("-inf"), 2.0, float("-inf")]])
    p = SamplingParams(temperature=1.0, top_k=2, top_p=0.5, seed=3)
    assert sample(logits, [p], [0], torch.Generator()) == [1]


def _reference(logits, params, outputs, eos):
    """OpenAI's formula, token by token in plain Python, then the min_tokens mask."""
    out = logits.clone()
    for i, (p, hist) in enumerate(zip(params, outputs)):
        for j in range(logits.shape[1]):
            c = hist.count(j)
            out[i, j] -= c * p.frequency_penalty + (c > 0) * p.presence_penalty
            out[i, j] += dict(p.logit_bias).get(j, 0.0)
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
            if len(hist) < p.min_tokens and j in stops:
                out[i, j] = float("-inf")
    return out


def test_adjustments_match_openais_formula_and_pick_the_tokens_it_picks():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 12, generator=g) * 2  # [B, V]
    outputs = [[3, 3, 3, 7], [3, 3, 3, 7], [1, 1, 2], [], [5, 5, 0, 9, 9]]
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=1.5),
        SamplingParams(temperature=0.0, presence_penalty=-2.0, logit_bias={7: -5, 11: 2.5}),
        SamplingParams(temperature=0.0),  # untouched, between adjusted rows
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[4], logit_bias={0: 100}),
        SamplingParams(temperature=0.0, frequency_penalty=-0.5, presence_penalty=0.7, min_tokens=9),
    ]
    eos = (0,)
    got = adjust_logits(logits, params, lambda i: outputs[i], eos)
    want = _reference(logits, params, outputs, eos)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[2], logits[2])
    assert got[3, 0] == float("-inf") and got[3, 4] == float("-inf")  # EOS masked despite +100
    chosen = sample(got, params, [len(o) for o in outputs], torch.Generator())
    assert chosen == want.argmax(dim=-1).tolist()
    assert chosen[0] != 3 or logits[0, 3] - 4 * 1.5 >= logits[0].max() - 1e-6  # penalised


def test_min_tokens_lifts_its_mask_once_reached_and_spares_eos_with_ignore_eos():
    logits = torch.zeros(3, 6)
    logits[:, 0] = 10.0  # EOS the clear favourite
    params = [
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True),
    ]
    outputs = [[1], [1, 2], [1]]
    got = adjust_logits(logits, params, lambda i: outputs[i], (0,))
    assert got[:, 0].tolist() == [float("-inf"), 10.0, 10.0]


def test_neutral_values_leave_the_logits_untouched():
    logits = torch.randn(3, 8)
    params = [SamplingParams(frequency_penalty=0.0, presence_penalty=-0.0, logit_bias={})] * 3
    assert adjust_logits(logits, params, lambda i: [1, 2], (0,)) is logits


def test_a_logit_bias_outside_the_vocabulary_is_refused_by_the_engine(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, num_blocks=64)
    with pytest.raises(InvalidRequest, match="SamplingParams.logit_bias: token id 512 is outside"):
        llm.generate([1, 2, 3], SamplingParams(logit_bias={512: 1.0}))


def test_the_engine_applies_the_bias_and_min_tokens(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, num_blocks=64)
    eos = llm.tokenizer.eos_id
    prompt = [1, 20, 30, 40]
    plain = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    forced = llm.generate(
        prompt, SamplingParams(max_tokens=6, temperature=0.0, logit_bias={77: 100})
    )
    assert forced[0].token_ids == [77] * 6 and plain[0].token_ids != [77] * 6
    # EOS forced by its bias, held back for three tokens by min_tokens
    p = SamplingParams(max_tokens=8, temperature=0.0, logit_bias={eos: 100}, min_tokens=3)
    out = llm.generate(prompt, p)[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 4
    assert eos not in out.token_ids[:3] and out.token_ids[3] == eos
    # a frequency penalty of 2 against a bias of 5: the forced token gives way after 3 uses
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias={77: 5})
    free = llm.generate(prompt, p)[0].token_ids
    pen = dataclasses.replace(p, frequency_penalty=2.0)
    penalised = llm.generate(prompt, pen)[0].token_ids
    assert free == [77] * 6 and penalised.count(77) < 6, (free, penalised)
    llm.engine.check_pools()
