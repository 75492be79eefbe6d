"""End-to-end engine tests: exactness against HF, continuous batching, preemption, caching."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import assert_pool_clean, hf_greedy

from minimemserve import LLM, SamplingParams
from minimemserve.config import EngineConfig
from minimemserve.engine import Engine

GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompts_of_lengths(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def run_all(engine: Engine) -> dict:
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    return outs


LENGTHS = [1, 2, 5, 9, 15, 16, 17, 23, 31, 32, 33, 40, 47, 60, 64, 77]


@pytest.mark.parametrize(
    "kv_heads,block_size,rope",
    [
        pytest.param(2, 16, None, id="gqa-bs16"),
        pytest.param(4, 1, None, id="mha-bs1"),
        pytest.param(2, 32, {"rope_type": "linear", "factor": 2.0}, id="gqa-bs32-linear"),
    ],
)
def test_greedy_matches_hf_with_continuous_batching(
    tiny_llama_factory, hf_model_from_dir, kv_heads, block_size, rope
):
    model_dir = tiny_llama_factory(num_key_value_heads=kv_heads, rope_scaling=rope)
    max_new = 12
    prompts = prompts_of_lengths(512, LENGTHS, seed=block_size)
    expected = hf_greedy(hf_model_from_dir(model_dir), prompts, max_new)
    # a small token budget chunks the long prompts; half the requests arrive mid-batch
    ecfg = EngineConfig(
        block_size=block_size, num_blocks=400, max_num_batched_tokens=40, max_num_seqs=12
    )
    engine = Engine(model_dir, engine_config=ecfg)
    params = SamplingParams(max_tokens=max_new, **GREEDY)
    ids = [engine.add_request(p, params) for p in prompts[:8]]
    outs = {}
    for _ in range(3):
        outs.update({o.request_id: o for o in engine.step()})
    ids += [engine.add_request(p, params) for p in prompts[8:]]
    outs.update(run_all(engine))
    got = [outs[i].token_ids for i in ids]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}): {g} != {e}"
    assert_pool_clean(engine.pool)


@pytest.mark.parametrize("config", ["PD", "PD-CC", "1P1D", "1P1D-CC"])
def test_prefill_first_gives_hf_tokens_under_every_configuration(
    tiny_llama_dir, hf_model_from_dir, config
):
    """vLLM 0.4.0's step policy changes when tokens are computed, never which: the same greedy
    tokens as HF and as the chunked policy, with prompts arriving while others decode."""
    prompts = prompts_of_lengths(512, [3, 17, 40, 64, 9, 33], seed=5)
    expected = hf_greedy(hf_model_from_dir(tiny_llama_dir), prompts, 10)
    params = SamplingParams(max_tokens=10, **GREEDY)
    got = {}
    for policy in ("prefill_first", "chunked"):
        llm = LLM(
            tiny_llama_dir,
            config=config,
            num_blocks=200,
            max_num_batched_tokens=48,
            scheduler=policy,
        )
        eng = llm.engine
        ids = [eng.add_request(p, params) for p in prompts[:3]]
        outs = {o.request_id: o for o in eng.step()}
        ids += [eng.add_request(p, params) for p in prompts[3:]]
        outs.update(run_all(eng))
        got[policy] = [outs[i].token_ids for i in ids]
        eng.check_pools()
    assert got["prefill_first"] == expected and got["chunked"] == expected


def test_preemption_by_recompute_keeps_tokens(tiny_llama_dir):
    prompts = prompts_of_lengths(512, [30, 41, 52, 25, 36, 47], seed=3)
    params = SamplingParams(max_tokens=40, **GREEDY)
    roomy = Engine(tiny_llama_dir, engine_config=EngineConfig(num_blocks=200))
    ids = [roomy.add_request(p, params) for p in prompts]
    ref = run_all(roomy)
    for config in ("PD", "PD-CC"):
        # 16 blocks hold only ~3 of these requests at full length: later ones get preempted
        tight = Engine(tiny_llama_dir, config=config, engine_config=EngineConfig(num_blocks=16))
        tids = [tight.add_request(p, params) for p in prompts]
        got = run_all(tight)
        assert sum(o.metrics.preemptions for o in got.values()) > 0
        for a, b in zip(ids, tids):
            assert got[b].token_ids == ref[a].token_ids
        assert_pool_clean(tight.pool)


def test_caching_changes_nothing_but_speed(tiny_llama_dir):
    """Multi-turn: turn k+1 = history + own answer + new text; PD and PD-CC agree."""
    turns = prompts_of_lengths(512, [40, 13, 27, 9], seed=7)
    results = {}
    for config in ("PD", "PD-CC"):
        llm = LLM(tiny_llama_dir, config=config, num_blocks=256)
        history: list[int] = []
        outs = []
        for t in turns:
            history = history + t
            out = llm.generate([history], SamplingParams(max_tokens=10, **GREEDY))[0]
            outs.append(out)
            history = history + out.token_ids
        results[config] = outs
        assert_pool_clean(llm.pool)
    for a, b in zip(results["PD"], results["PD-CC"]):
        assert a.token_ids == b.token_ids
    assert all(o.metrics.cached_tokens == 0 for o in results["PD"])
    later = results["PD-CC"][1:]
    assert all(o.metrics.cached_tokens > 0 for o in later)
    # the previous answer is covered too (whole blocks of history + output)
    assert later[0].metrics.cached_tokens >= 48


def test_text_prompts_and_outputs(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, num_blocks=64)
    outs = llm.generate(
        ["Hello there, how are you?", "Write a poem"], SamplingParams(max_tokens=5, temperature=0.0)
    )
    assert all(1 <= len(o.token_ids) <= 5 for o in outs)
    assert all(isinstance(o.text, str) for o in outs)
    m = outs[0].metrics
    assert m.ttft is not None and m.latency >= m.ttft > 0
    assert outs[0].prompt_token_ids == llm.tokenizer.encode("Hello there, how are you?")
    assert_pool_clean(llm.pool)


def test_stop_token_and_max_tokens(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, num_blocks=64)
    p = prompts_of_lengths(512, [20])[0]
    free = llm.generate([p], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    stop = free.token_ids[3]
    first = free.token_ids.index(stop)
    out = llm.generate(
        [p], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,))
    )[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[: first + 1]
    assert_pool_clean(llm.pool)


def test_generation_capped_by_context(tiny_llama_factory):
    model_dir = tiny_llama_factory(max_position_embeddings=64)
    llm = LLM(model_dir, num_blocks=64)
    out = llm.generate([list(range(3, 60))], SamplingParams(max_tokens=50, **GREEDY))[0]
    assert out.finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.token_ids) == 64
    assert_pool_clean(llm.pool)


def test_seeded_sampling_is_reproducible_across_batching(tiny_llama_dir):
    prompts = prompts_of_lengths(512, [12, 30, 7], seed=11)
    params = SamplingParams(
        max_tokens=10, temperature=0.8, top_k=50, top_p=0.9, seed=1234, ignore_eos=True
    )
    alone = [LLM(tiny_llama_dir, num_blocks=64).generate([p], params)[0].token_ids for p in prompts]
    together = LLM(tiny_llama_dir, num_blocks=64, max_num_batched_tokens=16).generate(
        prompts, params
    )
    assert [o.token_ids for o in together] == alone
    other = LLM(tiny_llama_dir, num_blocks=64).generate(
        prompts[:1], SamplingParams(max_tokens=10, temperature=0.8, seed=99, ignore_eos=True)
    )
    assert other[0].token_ids != alone[0]


def test_top_k_one_is_greedy(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, num_blocks=64)
    p = prompts_of_lengths(512, [25], seed=5)
    a = llm.generate(p, SamplingParams(max_tokens=8, **GREEDY))[0].token_ids
    b = llm.generate(
        p, SamplingParams(max_tokens=8, temperature=1.5, top_k=1, seed=3, ignore_eos=True)
    )[0].token_ids
    c = llm.generate(
        p, SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-6, seed=3, ignore_eos=True)
    )[0].token_ids
    assert a == b == c


def test_triton_backend_generates_the_same_tokens(tiny_llama_dir):
    """The Triton kernels (interpreted on the CPU) drive the whole engine like the torch path."""
    pytest.importorskip("triton")
    from triton_kernels import interpreter_ready

    if not torch.cuda.is_available() and not interpreter_ready():
        pytest.skip("triton was imported without TRITON_INTERPRET=1 in this process")
    prompts = prompts_of_lengths(512, [5, 19, 33], seed=21)
    params = SamplingParams(max_tokens=6, **GREEDY)
    outs = {}
    for attention in ("torch", "triton"):
        llm = LLM(
            tiny_llama_dir,
            config="PD-CC",
            attention=attention,
            num_blocks=32,
            max_num_batched_tokens=24,
        )
        assert llm.engine.instances[0].engine.backend.name == attention
        outs[attention] = [o.token_ids for o in llm.generate(prompts, params)]
        assert_pool_clean(llm.pool)
    assert outs["triton"] == outs["torch"]


def test_pd_and_pd_cc_agree_on_real_sharegpt_sessions(tiny_llama_dir):
    """Real multi-turn ShareGPT sessions: identical greedy tokens, cache hits on later turns."""
    from minimemserve.model.tokenizer import Tokenizer
    from minimemserve.workloads.sessions import build_prompt, sharegpt_sessions

    tok = Tokenizer.from_dir(tiny_llama_dir)
    sessions = sharegpt_sessions(
        tok,
        num_sessions=3,
        max_turns=3,
        max_context=512,
        max_output_tokens=12,
        seed=0,
        scan_limit=400,
    )
    assert len(sessions) == 3 and all(len(s.turns) >= 2 for s in sessions)
    results = {}
    for config in ("PD", "PD-CC"):
        llm = LLM(tiny_llama_dir, config=config, num_blocks=160)
        outs = []
        for s in sessions:
            history: list[int] = []
            for k, turn in enumerate(s.turns):
                prompt = build_prompt(s, k, history)
                params = SamplingParams(max_tokens=turn.max_tokens, **GREEDY)
                out = llm.generate([prompt], params)[0]
                outs.append((k, out))
                history = prompt + out.token_ids
        results[config] = outs
        assert_pool_clean(llm.pool)
    assert [o.token_ids for _, o in results["PD"]] == [o.token_ids for _, o in results["PD-CC"]]
    later = [o for k, o in results["PD-CC"] if k > 0]
    assert later and all(o.metrics.cached_tokens > 0 for o in later)


def test_dram_tier_keeps_evicted_prefixes_and_serves_them_back(tiny_llama_dir):
    """A small hbm tier offloads cached blocks to dram; later turns still hit, onloaded."""
    sessions = [prompts_of_lengths(512, [60, 15, 20], seed=s) for s in range(4)]
    params = SamplingParams(max_tokens=8, **GREEDY)

    def run(**kw):
        llm = LLM(tiny_llama_dir, config="PD-CC", **kw)
        history = [[] for _ in sessions]
        outs = []
        for k in range(3):
            for s, turns in enumerate(sessions):  # other sessions push this one out of hbm
                history[s] = history[s] + turns[k]
                out = llm.generate([history[s]], params)[0]
                outs.append(out)
                history[s] = history[s] + out.token_ids
        assert_pool_clean(llm.pool)
        return llm, outs

    _, ref = run(num_blocks=256)
    small, got = run(num_blocks=12, dram_blocks=64)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    c = small.pool.stats()["counters"]
    assert c["offloaded_blocks"] > 0 and c["onloaded_blocks"] > 0
    assert sum(o.metrics.cached_tokens for o in got[len(sessions) :]) > 0
    _, lost = run(num_blocks=12)
    hits = lambda outs: sum(o.metrics.cached_tokens for o in outs)
    assert hits(got) > hits(lost)


def test_cli_generate(tiny_llama_dir, capsys):
    from minimemserve.cli import main

    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny_llama_dir),
                "--prompt",
                "Hello there",
                "--max-tokens",
                "4",
                "--config",
                "PD-CC",
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    assert "tokens, finish=" in out.err and "ttft=" in out.err


def test_abort_in_every_state_returns_partial_output_and_frees_every_block(tiny_llama_dir):
    ecfg = EngineConfig(num_blocks=64, max_num_batched_tokens=16, max_num_seqs=2)
    eng = Engine(tiny_llama_dir, config="PD-CC", engine_config=ecfg)
    params = SamplingParams(max_tokens=50, **GREEDY)
    decoding, prefilling, waiting = prompts_of_lengths(512, [5, 40, 7], seed=5)
    rd = eng.add_request(decoding, params)
    while eng.requests[rd].num_output < 2:
        assert eng.step() == []
    rp = eng.add_request(prefilling, params)
    eng.step()  # 16-token budget: the 40-token prompt is only partly computed
    assert 0 < eng.requests[rp].num_computed < 40 and eng.requests[rp].num_output == 0
    rw = eng.add_request(waiting, params)  # two sequences run already: this one waits
    eng.step()
    assert eng.requests[rw].blocks == []
    outs = {rid: eng.abort(rid) for rid in (rw, rp, rd)}
    assert all(o.finish_reason == "abort" for o in outs.values())
    assert len(outs[rd].token_ids) >= 2 and outs[rp].token_ids == outs[rw].token_ids == []
    assert eng.abort(rd) is None and eng.abort("unknown") is None
    assert not eng.has_unfinished()
    eng.check_pools(require_idle=True)  # nothing referenced; the cache index is consistent
    assert eng.pool.stats()["index"]["blocks"] > 0  # the aborted decode's KV stays cached


def test_abort_on_the_decode_instance_of_a_disaggregated_cluster(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, config="1P1D-CC", num_blocks=64)
    cluster = llm.engine
    rid = cluster.add_request(prompts_of_lengths(512, [20])[0], SamplingParams(max_tokens=40))
    decode = cluster.role("decode")[0].engine
    while rid not in decode.requests:
        assert cluster.step() == []
    out = cluster.abort(rid)
    assert out.finish_reason == "abort" and out.token_ids
    assert not cluster.has_unfinished() and cluster.abort(rid) is None
    cluster.check_pools(require_idle=True)


def test_hand_offs_move_while_the_next_prompt_computes_and_change_no_token(tiny_llama_dir):
    """handoff="overlap": a prefill instance hands a request off while its next forward pass
    runs (on the runner's thread); tokens equal the inline order's, every pool balances."""
    prompts = prompts_of_lengths(512, [40, 33, 57, 21, 64, 18], seed=3)
    params = SamplingParams(max_tokens=6, **GREEDY)
    tokens, beside = {}, {}
    for mode in ("inline", "overlap"):
        llm = LLM(
            tiny_llama_dir,
            config="1P1D-CC",
            num_blocks=256,
            handoff=mode,
            max_num_batched_tokens=64,  # a prompt or two per step: hand-offs have steps beside
        )
        prefill = llm.engine.instances[0].engine
        passes, sends = [], []  # (start, end) of each forward pass and each hand-off's send

        def timed(fn, spans, pause):
            def wrapped(*args):
                began = time.monotonic()
                time.sleep(pause)  # long enough that what runs beside it runs inside it
                try:
                    return fn(*args)
                finally:
                    spans.append((began, time.monotonic()))

            return wrapped

        prefill.runner.run = timed(prefill.runner.run, passes, 0.1)
        send = prefill.pool.transfer_with_insert
        prefill.pool.transfer_with_insert = timed(send, sends, 0.05)
        tokens[mode] = [o.token_ids for o in llm.generate(prompts, params)]
        beside[mode] = [any(a < d and c < b for c, d in passes) for a, b in sends]
        llm.engine.check_pools()
        llm.close()
    assert tokens["overlap"] == tokens["inline"]
    assert len(beside["inline"]) == len(beside["overlap"]) == len(prompts)
    assert not any(beside["inline"])  # inline: each hand-off inside the step that prefilled it
    assert sum(beside["overlap"]) >= len(prompts) // 2  # most beside the next forward pass
