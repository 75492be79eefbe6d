"""A full decode pool means "wait", never "failed": churn through tiny pools, in one process
and across processes, gives PD's tokens with balanced pools."""

from __future__ import annotations

import random

import pytest

from minimemserve import LLM, SamplingParams
from minimemserve.config import EngineConfig
from minimemserve.disagg.runtime import ProcessCluster

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def churn(n: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts over a few shared 32-token prefixes, each with its own suffix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 512) for _ in range(32)] for _ in range(6)]
    return [
        rng.choice(prefixes) + [rng.randrange(3, 512) for _ in range(rng.randrange(4, 40))]
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    prompts = churn(300)
    outs = LLM(tiny_llama_dir, config="PD", num_blocks=512).generate(prompts, PARAMS)
    return prompts, [o.token_ids for o in outs]


def test_six_long_prompts_through_a_16_block_decode_pool(tiny_llama_dir):
    prompts = churn(6, seed=1)
    prompts = [p + p[:40] for p in prompts]  # ~100 tokens: 7 of the 16 blocks each at the end
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = LLM(tiny_llama_dir, config="PD", num_blocks=64).generate(prompts, params)
    for config in ("1P1D", "1P1D-CC", "1P2D-CC"):
        llm = LLM(tiny_llama_dir, config=config, num_blocks=16)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref], config
        llm.engine.check_pools(require_idle=True)


@pytest.mark.parametrize("num_blocks", [48, 128])
@pytest.mark.parametrize("config", ["1P1D-CC", "1P2D-CC"])
def test_churn_in_process(tiny_llama_dir, reference, config, num_blocks):
    prompts, ref = reference
    llm = LLM(tiny_llama_dir, config=config, num_blocks=num_blocks)
    outs = llm.generate(prompts, PARAMS)
    assert [o.finish_reason for o in outs] == ["length"] * len(prompts)
    assert [o.token_ids for o in outs] == ref
    llm.engine.check_pools(require_idle=True)


@pytest.mark.parametrize("num_blocks", [48, 128])
@pytest.mark.parametrize("config", ["1P1D-CC", "1P2D-CC"])
def test_churn_across_processes(tiny_llama_dir, reference, config, num_blocks):
    prompts, ref = reference
    with ProcessCluster.of(
        tiny_llama_dir,
        config,
        engine=EngineConfig(num_blocks=num_blocks),
        start_method="forkserver",
    ) as cluster:
        rids = [cluster.add_request(p, PARAMS, request_id=f"r{i}") for i, p in enumerate(prompts)]
        outs = {o.request_id: o for o in cluster.run_until_done(timeout_s=300)}
        assert [outs[r].finish_reason for r in rids] == ["length"] * len(prompts), [
            outs[r].error for r in rids if outs[r].error
        ][:3]
        assert [outs[r].token_ids for r in rids] == ref
        cluster.check_pools(require_idle=True)
        # the prompt trees mirror each entry instance's index: once the last cache events
        # (pushed after each step) are in, none believes more is cached than is
        for _ in range(100):
            cluster.step()
            over = {
                name: (cluster.scheduler.trees.num_blocks(name), s["pool"]["index"]["blocks"])
                for name, s in cluster.stats().items()
                if name in cluster.scheduler.live
                and cluster.scheduler.trees.num_blocks(name) > s["pool"]["index"]["blocks"]
            }
            if not over:
                break
        assert not over, over
