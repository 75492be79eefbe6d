"""A disaggregated pair in processes: a prefill and a decode instance (1P1D-CC), each its own
process, KV moving between their pools over shared memory; the same greedy tokens as one
colocated instance in this process.

Run: python examples/disaggregated.py"""

from minimemserve import LLM, EngineConfig, SamplingParams
from minimemserve.deployment import DeploymentSpec


def main() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8)
    prompts = ["Prefill here, decode there.", "Prefill here, decode there, twice."]
    engine = EngineConfig(num_blocks=64)
    spec = DeploymentSpec(config="1P1D-CC", runtime="process", engine=engine)
    with LLM.from_spec(spec) as pair, LLM(config="PD", num_blocks=64) as alone:
        split = pair.generate(prompts, params)
        whole = alone.generate(prompts, params)
        pair.engine.check_pools()  # both processes' pools balance
    for prompt, a, b in zip(prompts, split, whole):
        print(f"{prompt!r} -> {a.text!r}")
        assert a.token_ids == b.token_ids, "disaggregation changed the tokens"
    print("the pair in processes gave the same tokens as one instance")


if __name__ == "__main__":  # the instances are spawned processes, which import this file
    main()
