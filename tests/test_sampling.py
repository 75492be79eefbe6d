"""SamplingParams validation and the sampler: every value either constructs or raises
InvalidRequest, and every params object that constructs samples valid ids from finite logits."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minimemserve.errors import InvalidRequest, SamplingError
from minimemserve.sampling import GREEDY_TEMPERATURE, SamplingParams, sample, token_seed

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
    logits = torch.tensor([row], dtype=torch.float32)  # [1, V]
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
    ],
)
def test_bad_values_are_invalid_requests_naming_the_field(field, value):
    with pytest.raises(InvalidRequest, match=f"SamplingParams.{field} "):
        SamplingParams(**{field: value})


def test_fields_and_defaults_are_unchanged():
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    defaults["stop_token_ids"] = ()
    assert defaults == dict(
        max_tokens=16,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        seed=None,
        stop_token_ids=(),
        ignore_eos=False,
        logprobs=None,
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
